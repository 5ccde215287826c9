"""learner.shared_prefix: each group's common prompt runs once per micro-batch (Prefix Grouper's
shared-prefix forward). The packing is checked on a hand-worked example; the learner's
log-probs, entropies, top-k log-probs and whole update must equal the unshared ones (sdpa and
eager), and a policy or backend it cannot serve is refused in one line."""

from __future__ import annotations

import random

import pytest
import torch

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.learners.base import LearnerConfig
from async_rl.learners.batching import scatter_slots, share_prefix_rows


def test_share_prefix_rows_packs_each_groups_prompt_once():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0], [1, 2, 3, 6], [9, 8, 0, 0]])
    mask = (ids != 0).long()
    positions = torch.arange(4).expand(4, 4) * mask
    pack = share_prefix_rows(ids, mask, positions, torch.tensor([7, 7, 7, 3]))
    # Group 7's rows agree on [1, 2] (its shortest row has 3 tokens, so at most 2 are shared).
    assert pack.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 6, 9, 8]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 2, 2, 3, 0, 1]]
    assert pack.prefix_tokens == 13 - 9
    # Slot t of a row is predicted where its token t sits: row 2's slot 2 (predicting 6) is its
    # own token 3 at packed position 5; every row's slots 0-1 read the shared prefix.
    assert pack.slot_positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 5, 7]
    attend = pack.attend[0, 0]
    assert attend.shape == (9, 9)
    assert torch.nonzero(attend[4]).flatten().tolist() == [0, 1, 4]  # row 1's "5": prefix and itself
    assert torch.nonzero(attend[6]).flatten().tolist() == [0, 1, 5, 6]  # row 2's "6"
    assert torch.nonzero(attend[8]).flatten().tolist() == [7, 8]  # the other group sees nothing of group 7
    assert torch.nonzero(attend[1]).flatten().tolist() == [0, 1]  # a prefix token: causal within the prefix
    values = scatter_slots(torch.arange(9.0), pack.slot_mask)
    assert values.tolist() == [[0, 1, 2], [3, 4, 0], [5, 6, 7], [8, 0, 0]]


def test_share_prefix_rows_places_segments_into_rows_of_a_capacity():
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 5, 0], [1, 2, 3, 6], [9, 8, 0, 0], [4, 4, 4, 0]])
    mask = (ids != 0).long()
    positions = torch.arange(4).expand(5, 4) * mask
    # Segments: group 7 [1, 2 | 3, 4 | 5 | 3, 6] (7 tokens), group 3 [9, 8], group 5 [4, 4, 4].
    # Capacity max(4, 7) = 7: group 7 fills row 0, groups 5 (3 tokens) and 3 (2) share row 1
    # (placed longest first, laid out in group order).
    pack = share_prefix_rows(ids, mask, positions, torch.tensor([7, 7, 7, 3, 5]), row_tokens=4)
    assert pack.input_ids.tolist() == [[1, 2, 3, 4, 5, 3, 6], [9, 8, 4, 4, 4, 0, 0]]
    assert pack.position_ids.tolist() == [[0, 1, 2, 3, 2, 2, 3], [0, 1, 0, 1, 2, 0, 0]]
    assert pack.prefix_tokens == 16 - 12
    # Flat positions (row * 7 + column): row 3's slot 0 reads its "9" at row 1, column 0.
    assert pack.slot_positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 5, 7, 9, 10]
    assert pack.attend.shape == (2, 1, 7, 7)
    second = pack.attend[1, 0]
    assert torch.nonzero(second[1]).flatten().tolist() == [0, 1]
    assert torch.nonzero(second[4]).flatten().tolist() == [2, 3, 4]  # group 5 sees nothing of group 3
    assert torch.nonzero(second[5]).flatten().tolist() == [5]  # padding: itself only
    assert not second[:5, 5:].any()  # no real token attends to padding
    with pytest.raises(ValueError, match="row_tokens"):
        share_prefix_rows(ids, mask, positions, torch.tensor([7, 7, 7, 3, 5]), row_tokens=0)


def test_share_prefix_rows_refuses_left_padding():
    ids = torch.tensor([[0, 1, 2], [1, 2, 3]])
    mask = (ids != 0).long()
    with pytest.raises(ValueError, match="right-padded"):
        share_prefix_rows(ids, mask, torch.zeros_like(ids), torch.tensor([0, 0]))


def _grouped_batch(seed: int = 0):
    """Four groups of four samples: each group's rows share a prompt of 3-7 tokens and answer
    with 1-6 tokens of their own (some rows equal a sibling's first answer tokens)."""
    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(seed)
    trajs = []
    for g in range(4):
        prompt = [rng.randint(10, 200) for _ in range(rng.randint(3, 7))]
        first = [rng.randint(10, 200) for _ in range(3)]
        for k in range(4):
            resp = (first[: k] if k < 3 else []) + [rng.randint(10, 200) for _ in range(rng.randint(1, 3))]
            trajs.append(Trajectory(trajectory_id=f"{g}/{k}", group_id=100 + g, prompt_uid=f"p{g}", prompt_ids=prompt,
                                    response_ids=resp, behavior_logprobs=[-rng.uniform(3, 6) for _ in resp],
                                    loss_mask=[1] * len(resp), finish_reason="stop", policy_version=[0] * len(resp),
                                    reward=0.0))
    rng.shuffle(trajs)  # a group's rows need not be adjacent
    batch = collate(trajs, pad_token_id=0)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(seed)) * batch.loss_mask
    return batch


def _learner(model_path: str, **kw):
    from async_rl.learners.fsdp import FSDPLearner

    algo = AlgorithmConfig(name="grpo", loss_horizon_tokens=16).apply_preset()
    cfg = LearnerConfig(lr=1e-2, eps=1e-3, micro_batch_size=16, num_mini_batches=2, mini_batch_split="groups", **kw)
    return FSDPLearner(cfg, algo, model_path, temperature=0.7, total_optimizer_steps=2)


@pytest.mark.parametrize("attn,row_tokens", [("sdpa", 256), ("eager", 256), ("sdpa", 12), ("eager", 12)])
def test_shared_prefix_gives_the_unshared_log_probs_and_update(tiny_model_path, attn, row_tokens, monkeypatch):
    from async_rl.learners import batching

    # 256: a micro-batch's segments fit one packed row; 12: several rows, padded.
    monkeypatch.setattr(batching, "SHARED_PREFIX_ROW_TOKENS", row_tokens)
    plain, shared = _learner(tiny_model_path, attn_implementation=attn), \
        _learner(tiny_model_path, attn_implementation=attn, shared_prefix=True)
    batch = _grouped_batch()
    valid = batch.attention_mask[:, 1:].bool()
    with torch.no_grad():
        lp, ent = plain._forward(batch, with_entropy=True)
        lp_s, ent_s = shared._forward(batch, with_entropy=True)
        topk = torch.randint(0, 200, (*valid.shape, 3))
        _, _, k_plain = plain._forward(batch, with_entropy=False, topk_ids=topk)
        _, _, k_shared = shared._forward(batch, with_entropy=False, topk_ids=topk)
    # The padded layout leaves values at slots past a row's end; the shared one 0 there.
    torch.testing.assert_close(lp_s, lp * valid, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent_s, ent * valid, rtol=0, atol=2e-5)
    torch.testing.assert_close(k_shared, k_plain * valid.unsqueeze(-1), rtol=0, atol=2e-5)
    assert (lp_s[~valid] == 0).all() and lp_s[valid].lt(0).all()
    before = {n: w.clone() for n, w in plain.named_weights()}
    losses = []
    for learner in (plain, shared):
        batch = _grouped_batch()
        learner.prepare(batch)  # the proximal pass shares too
        losses.append(float(learner.train_step(batch)["loss/pg"]))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-7)
    weights = dict(plain.named_weights())
    for name, w in shared.named_weights():
        torch.testing.assert_close(w, weights[name], rtol=1e-5, atol=1e-6)
    assert max(float((w - before[n]).abs().max()) for n, w in weights.items()) > 1e-3  # the step moved them


def test_shared_prefix_gives_the_unshared_supervised_step(tiny_model_path):
    plain, shared = _learner(tiny_model_path), _learner(tiny_model_path, shared_prefix=True)
    losses = [float(learner.sft_step(_grouped_batch(seed=2), lr=1e-2)["sft/loss"]) for learner in (plain, shared)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    weights = dict(plain.named_weights())
    for name, w in shared.named_weights():
        torch.testing.assert_close(w, weights[name], rtol=1e-5, atol=1e-6)


def test_shared_prefix_really_shares(tiny_model_path, monkeypatch):
    learner = _learner(tiny_model_path, shared_prefix=True)
    seen = []
    forward = learner.model.forward
    monkeypatch.setattr(learner.model, "forward", lambda **kw: (seen.append(kw["input_ids"].shape), forward(**kw))[1])
    batch = _grouped_batch()
    with torch.no_grad():
        learner._forward(batch, with_entropy=False)
    assert seen[0][0] == 1  # one packed row
    # Each group's prompt (and the answer tokens its rows agree on) runs once instead of 4 times.
    assert seen[0][1] <= int(batch.attention_mask.sum()) - 3 * 4 * 3
    # Rows of distinct groups share nothing: the padded pass, not a dense mask over all of them.
    batch.group_ids = torch.arange(len(batch))
    with torch.no_grad():
        learner._forward(batch, with_entropy=False)
    assert seen[1] == tuple(batch.input_ids.shape)


def _default_job_batch():
    """Eight groups of eight samples shaped like the default job's: a 13-token prompt each,
    answers of 3-8 tokens, the groups' rows shuffled together."""
    from async_rl.buffers.trajectory import Trajectory, collate

    rng = random.Random(0)
    trajs = []
    for g in range(8):
        prompt = [rng.randint(10, 200) for _ in range(13)]
        for k in range(8):
            resp = [rng.randint(10, 200) for _ in range(rng.randint(3, 8))]
            trajs.append(Trajectory(trajectory_id=f"{g}/{k}", group_id=g, prompt_uid=f"p{g}", prompt_ids=prompt,
                                    response_ids=resp, behavior_logprobs=[-3.0] * len(resp),
                                    loss_mask=[1] * len(resp), finish_reason="stop", policy_version=[0] * len(resp),
                                    reward=0.0))
    rng.shuffle(trajs)
    batch = collate(trajs, pad_token_id=0)
    batch.advantages = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0)) * batch.loss_mask
    return batch


def test_shared_prefix_gradients_repeat_to_the_bit_on_two_threads(tiny_model_path):
    # Every row of a group reads the prefix's positions; a backward that adds those duplicate
    # reads on several threads in a racing order made two runs of one seed differ by rounding
    # (the default job then ended 0.84, 0.81, 0.79). The gradients must repeat exactly.
    import hashlib

    learner = _learner(tiny_model_path, shared_prefix=True)
    batch = _default_job_batch()
    pack = share_prefix_rows(batch.input_ids, batch.attention_mask, batch.position_ids, batch.group_ids)
    threads = torch.get_num_threads()
    digests = set()
    try:
        torch.set_num_threads(2)
        for _ in range(4):
            learner.model.zero_grad(set_to_none=True)
            lp, ent = learner._shared_prefix_forward(batch, pack, True, learner.model, learner.temperature, None)
            ((lp * batch.advantages).sum() + 0.1 * ent.sum()).backward()
            digests.add(hashlib.sha1(b"".join(w.grad.numpy().tobytes() for w in learner.model.parameters()
                                              if w.grad is not None)).hexdigest())
    finally:
        torch.set_num_threads(threads)
    assert len(digests) == 1


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_under_bf16_mixed_precision(tiny_model_path, attn):
    batch = _grouped_batch(seed=1)
    valid = batch.attention_mask[:, 1:].bool()
    with torch.no_grad():
        lp = _learner(tiny_model_path, attn_implementation=attn, mixed_precision="bf16")._forward(batch, False)[0]
        lp_s = _learner(tiny_model_path, attn_implementation=attn, mixed_precision="bf16",
                        shared_prefix=True)._forward(batch, False)[0]
    assert float((lp_s - lp * valid).abs().max()) < 5e-2  # bf16 rounding, not a wrong mask (~nats)


def test_shared_prefix_is_off_with_one_warning_where_it_cannot_serve(tiny_model_path, monkeypatch, caplog):
    from async_rl.learners.fsdp import FSDPLearner

    # A key of the default job: other backends take it, and leave it off (the Megatron learner says so).
    assert LearnerConfig(backend="megatron", shared_prefix=True).shared_prefix
    # An attention that ignores the custom mask fails the start-up probe: off, one line, unshared passes.
    monkeypatch.setattr(FSDPLearner, "_attention_mask", lambda self, attend: None)
    with caplog.at_level("WARNING"):
        learner = _learner(tiny_model_path, shared_prefix=True)
    assert not learner._share_prefix
    lines = [r.getMessage() for r in caplog.records if "shared_prefix" in r.getMessage()]
    assert len(lines) == 1 and "does not follow a custom mask" in lines[0]
    batch = _grouped_batch()
    with torch.no_grad():
        lp = learner._forward(batch, with_entropy=False)[0]
        lp_plain = _learner(tiny_model_path)._forward(batch, with_entropy=False)[0]
    torch.testing.assert_close(lp, lp_plain, rtol=0, atol=0)
