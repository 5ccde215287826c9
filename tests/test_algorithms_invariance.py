"""Loss and gradients must not depend on how one optimizer step's batch is split.

A tiny `nn.Linear` maps hidden states to logits; the loss is a policy loss plus a KL term over a
batch with ragged masks (a fully masked row, a multi-turn hole, NaN in padded slots). The same
step is computed as one full batch, as 2 and 4 micro-batches with gradient accumulation, and as
2 gloo ranks x 2 micro-batches with all-reduced normalisers and gradients (SUM).
"""

import datetime
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_rl.algorithms import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    OffPolicyCorrection,
    PolicyLossInputs,
    count_normalizers,
    kl_loss,
    logprobs_from_logits,
)
from async_rl.learners.launch import exit_rank_process

B, T, H, V = 8, 6, 5, 11
ATOL = 1e-6


def _batch():
    g = torch.Generator().manual_seed(1234)
    hidden = torch.randn(B, T, H, generator=g)
    labels = torch.randint(V, (B, T), generator=g)
    lengths = torch.tensor([6, 1, 0, 4, 3, 6, 2, 5])
    mask = torch.arange(T).expand(B, T) < lengths.unsqueeze(-1)
    mask[0, 2:4] = False  # tool output in the middle of a multi-turn response
    with torch.no_grad():
        reference_lp = logprobs_from_logits(_model()(hidden), labels)
    proximal = reference_lp + 0.3 * torch.randn(B, T, generator=g)
    behavior = proximal + 0.2 * torch.randn(B, T, generator=g)
    ref = reference_lp + 0.1 * torch.randn(B, T, generator=g)
    for t in (proximal, behavior, ref):
        t[~mask] = float("nan")  # garbage in padded slots must not matter
    advantages = torch.randn(B, 1, generator=g).expand(B, T).clone()
    return dict(hidden=hidden, labels=labels, mask=mask, proximal=proximal, behavior=behavior, ref=ref,
                advantages=advantages)


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(H, V)


# Cover token- and sequence-level behaviour weights along the way.
CORRECTION = {"ppo_clip": "tis", "gspo": "seq_tis", "cispo": "icepop"}


def _micro_loss(model, mb, loss_name, mode, num_tokens, num_seqs):
    logprobs = logprobs_from_logits(model(mb["hidden"]), mb["labels"])
    agg = dict(agg_mode=mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs, horizon=T)
    inputs = PolicyLossInputs(logprobs, mb["proximal"], mb["behavior"], mb["advantages"], mb["mask"], **agg)
    loss, _ = POLICY_LOSSES.get(loss_name)(inputs, OffPolicyCorrection(CORRECTION[loss_name]))
    return loss + 0.1 * kl_loss(logprobs, mb["ref"], mb["mask"], kind="k3", **agg)


def _split(batch, rows):
    return [{k: v[r] for k, v in batch.items()} for r in rows]


def _step(model, micro_batches, loss_name, mode, group=None):
    """One optimizer step's loss and gradients; normalisers and grads are summed over `group`."""
    num_tokens = torch.zeros((), dtype=torch.int64)
    num_seqs = torch.zeros((), dtype=torch.int64)
    for mb in micro_batches:
        t, s = count_normalizers(mb["mask"])
        num_tokens, num_seqs = num_tokens + t, num_seqs + s
    if group is not None:
        dist.all_reduce(num_tokens)
        dist.all_reduce(num_seqs)
    model.zero_grad(set_to_none=False)
    total = torch.zeros(())
    for mb in micro_batches:
        loss = _micro_loss(model, mb, loss_name, mode, num_tokens, num_seqs)
        loss.backward()
        total = total + loss.detach()
    grads = [p.grad.clone() for p in model.parameters()]
    if group is not None:
        dist.all_reduce(total)
        for g in grads:
            dist.all_reduce(g)
    return total, grads


def _chunks(num):
    return [slice(i * B // num, (i + 1) * B // num) for i in range(num)]


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.isfinite(loss_a) and all(torch.isfinite(g).all() for g in grads_a)
    torch.testing.assert_close(loss_b, loss_a, atol=ATOL, rtol=0)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=ATOL, rtol=0)


@pytest.mark.parametrize("loss_name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gradient_accumulation_invariance(mode, loss_name):
    batch, model = _batch(), _model()
    full = _step(model, [batch], loss_name, mode)
    assert any(g.abs().sum() > 0 for g in full[1])
    for num in (2, 4):
        _assert_same(full, _step(model, _split(batch, _chunks(num)), loss_name, mode))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, world_size, port, out_path):
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        batch, model = _batch(), _model()
        half = B // world_size
        rows = [slice(rank * half + i * half // 2, rank * half + (i + 1) * half // 2) for i in range(2)]
        results = {(name, mode): _step(model, _split(batch, rows), name, mode, group=dist.group.WORLD)
                   for name in POLICY_LOSSES.names() for mode in LOSS_AGG_MODES}
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()
    exit_rank_process(0)


def test_data_parallel_gloo_invariance(tmp_path):
    out_path = tmp_path / "rank0.pt"
    mp.spawn(_rank_worker, args=(2, _free_port(), str(out_path)), nprocs=2, join=True)
    results = torch.load(out_path)
    batch, model = _batch(), _model()
    for name in POLICY_LOSSES.names():
        for mode in LOSS_AGG_MODES:
            _assert_same(_step(model, [batch], name, mode), results[(name, mode)])
