"""Top-K log-probs of the student from the learners' ``_forward(..., topk_ids=...)``: the packed-layout
helpers (``pack_labels`` / ``unpack_labels`` with trailing dimensions), the FSDP2 learner against
a hand-made log-softmax of the Hugging Face model (padded, packed, LoRA), and the Megatron learner
(tensor-parallel 2, two pipeline stages; spawned gloo ranks) against the FSDP2 learner: the same
top-K log-probs and the same update from a loss on them.
"""

from __future__ import annotations

import pytest
import torch

from async_rl.learners.batching import pack_labels, pack_rows, unpack_labels

TEMPERATURE = 0.7
K = 5


# ----------------------------------------------------------------------------- pack / unpack helpers

def test_pack_labels_hand_example_round_trip_and_gradients():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    mask = (ids != 0).long()  # 3 + 2 + 4 = 9 packed tokens, 8 packed label positions
    base = torch.tensor([[0.0, 1, 2], [10, 11, 12], [20, 21, 22]])
    values = torch.stack([base, -base], -1).requires_grad_(True)  # [B=3, L-1=3, 2]
    packed = pack_labels(values, mask)
    # Slot t of row b at packed position offset_b + t; the boundary positions 2 and 4 (each
    # sequence's last token) get 0; slots predicting padding (12, 2, 11, 12) are not read.
    assert packed.shape == (1, 8, 2)
    assert packed[0, :, 0].tolist() == [0, 1, 0, 10, 0, 20, 21, 22]
    assert packed[0, :, 1].tolist() == [0, -1, 0, -10, 0, -20, -21, -22]
    (packed * torch.arange(1.0, 9.0).view(1, 8, 1)).sum().backward()
    assert values.grad[..., 0].tolist() == [[1, 2, 0], [4, 0, 0], [6, 7, 8]]
    assert torch.equal(values.grad[..., 1], values.grad[..., 0])
    # Round trip: unpack(pack(v)) is v at the slots that predict a real token, 0 elsewhere.
    back = unpack_labels(packed, mask)
    assert back.shape == (3, 3, 2)
    assert back[..., 0].tolist() == [[0, 1, 0], [10, 0, 0], [20, 21, 22]]
    assert torch.equal(back[..., 1], -back[..., 0])
    # The other way: pack(unpack(x)) is x with the boundary positions zeroed; gradients flow back.
    x = torch.arange(1.0, 17.0).view(1, 8, 2).requires_grad_(True)
    u = unpack_labels(x, mask)
    assert u[..., 0].tolist() == [[1, 3, 0], [7, 0, 0], [11, 13, 15]]
    again = pack_labels(u, mask)
    assert torch.equal(again, x.detach() * torch.tensor([1, 1, 0, 1, 0, 1, 1, 1.0]).view(1, 8, 1))
    again.sum().backward()
    assert x.grad[0, :, 0].tolist() == [1, 1, 0, 1, 0, 1, 1, 1]
    # Token ids keep their dtype (topk_ids go through pack_labels), and [N-1, K] unpacks too.
    ids_k = torch.arange(18).view(3, 3, 2)
    packed_ids = pack_labels(ids_k, mask)
    assert packed_ids.dtype == torch.int64 and packed_ids[0, :, 0].tolist() == [0, 2, 0, 6, 0, 12, 14, 16]
    assert torch.equal(unpack_labels(packed_ids[0], mask), unpack_labels(packed_ids, mask))
    with pytest.raises(ValueError, match=r"need \[B, L-1, ...\]"):
        pack_labels(values[:, :2], mask)
    with pytest.raises(ValueError, match="need N - 1"):
        unpack_labels(torch.zeros(1, 9, 2), mask)


# ----------------------------------------------------------------------------- FSDP2 learner

def _batch():
    """4 rows of 6, 10, 13 and 7 tokens (one full row, three padded)."""
    from multirank_worker import make_batch

    batch = make_batch().select(slice(3, 7))
    assert batch.attention_mask.sum(1).tolist() == [6, 10, 13, 7]
    return batch


def _topk_ids(batch, vocab: int, seed: int = 0) -> torch.Tensor:
    """``[b, L-1, K]`` ids: the label, ids at the top of the vocabulary (the last tensor-parallel
    slice), random ones; random ids at the padding slots too."""
    g = torch.Generator().manual_seed(seed)
    b, length = batch.input_ids.shape
    ids = torch.randint(0, vocab, (b, length - 1, K), generator=g)
    ids[..., 0] = batch.input_ids[:, 1:]
    ids[..., 1] = vocab - 1 - torch.randint(0, 6, (b, length - 1), generator=g)
    return ids


def _cfg(**kw):
    from async_rl.learners.base import LearnerConfig

    # As the multi-rank equality tests: a large Adam eps keeps the first step continuous in the gradient.
    return LearnerConfig(lr=1e-2, eps=1e-3, warmup_steps=1, micro_batch_size=4, **kw)


def _fsdp(model_path: str, **kw):
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.fsdp import FSDPLearner

    return FSDPLearner(_cfg(**kw), AlgorithmConfig(name="grpo").apply_preset(), model_path,
                       temperature=TEMPERATURE, total_optimizer_steps=4)


def _loss(topk: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A distillation-like loss: fixed random weights on every top-K log-prob."""
    coef = torch.randn(topk.shape, generator=torch.Generator().manual_seed(seed))
    return (coef * topk).sum() / topk.shape[0]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.config.use_cache = False
    return model.eval()


@pytest.fixture(scope="module")
def fsdp_learner(tiny_model_path):
    return _fsdp(tiny_model_path)


def _by_hand(model, batch, topk_ids: torch.Tensor, temperature: float, packed: bool) -> torch.Tensor:
    """``log_softmax(logits / T)`` of the Hugging Face model gathered at ``topk_ids``, slot by slot
    (0 at slots predicting no real token), differentiable."""
    mask = batch.attention_mask
    lengths = mask.sum(1).tolist()
    want = torch.zeros(topk_ids.shape)
    if packed:
        ids, positions = pack_rows(batch.input_ids, mask, batch.position_ids)
        logsm = torch.log_softmax(model(input_ids=ids, position_ids=positions).logits[0] / temperature, -1)
        offset = 0
        for b, n in enumerate(lengths):
            for t in range(n - 1):
                want[b, t] = logsm[offset + t, topk_ids[b, t]]
            offset += n
        return want
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids).logits
    logsm = torch.log_softmax(logits[:, :-1] / temperature, -1)
    for b, n in enumerate(lengths):
        for t in range(n - 1):
            want[b, t] = logsm[b, t, topk_ids[b, t]]
    return want


def _grads(named) -> dict[str, torch.Tensor]:
    return {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in named if p.grad is not None}


@pytest.mark.parametrize("packed, temperature", [(False, None), (True, None), (False, 1.3), (True, 1.3)])
def test_fsdp_topk_logprobs_equal_the_log_softmax_by_hand(fsdp_learner, hf_model, packed, temperature):
    learner, batch = fsdp_learner, _batch()
    vocab = hf_model.config.vocab_size
    topk_ids = _topk_ids(batch, vocab)
    learner.model.zero_grad(set_to_none=True)
    logprobs, entropy, topk = learner._forward(batch, with_entropy=True, temperature=temperature, packed=packed,
                                               topk_ids=topk_ids)
    assert topk.shape == topk_ids.shape and topk.dtype == torch.float32
    temp = TEMPERATURE if temperature is None else temperature
    hf_model.zero_grad(set_to_none=True)
    want = _by_hand(hf_model, batch, topk_ids, temp, packed)
    torch.testing.assert_close(topk, want, rtol=0, atol=1e-6)
    valid = batch.attention_mask[:, 1:].bool()
    assert (topk[~valid] == 0).all() and (topk[valid] < 0).all()
    # Column 0 holds the labels: the same numbers as the log-probs (same forward, same logsumexp).
    torch.testing.assert_close(topk[..., 0][valid], logprobs[valid], rtol=0, atol=0)
    # The gradient of a loss on them reaches the parameters, and equals the hand-made one.
    _loss(topk).backward()
    _loss(want).backward()
    got, expected = _grads(learner.model.named_parameters()), _grads(hf_model.named_parameters())
    assert got.keys() == expected.keys() and len(got) == len(list(hf_model.parameters()))
    for name, g in expected.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert float(got["model.layers.0.self_attn.q_proj.weight"].abs().max()) > 1e-4
    # Without topk_ids: the 2-tuple, with the same log-probs and entropies.
    with torch.no_grad():
        plain = learner._forward(batch, with_entropy=True, temperature=temperature, packed=packed)
    assert len(plain) == 2
    torch.testing.assert_close(plain[0], logprobs.detach(), rtol=0, atol=0)
    torch.testing.assert_close(plain[1], entropy.detach(), rtol=0, atol=0)
    learner.model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("packed", [False, True])
def test_fsdp_topk_over_the_whole_vocabulary_sums_to_one(fsdp_learner, hf_model, packed):
    batch, vocab = _batch(), hf_model.config.vocab_size
    b, length = batch.input_ids.shape
    every = torch.arange(vocab).expand(b, length - 1, vocab)
    with torch.no_grad():
        topk = fsdp_learner._forward(batch, with_entropy=False, packed=packed, topk_ids=every)[2]
    valid = batch.attention_mask[:, 1:].bool()
    torch.testing.assert_close(topk.exp().sum(-1)[valid], torch.ones(int(valid.sum())), rtol=0, atol=1e-5)
    assert (topk[~valid] == 0).all()


def test_fsdp_topk_ids_of_another_layout_are_refused(fsdp_learner):
    batch = _batch()
    with pytest.raises(ValueError, match=r"topk_ids \(4, 13, 5\) for a micro-batch of 4 rows of 13 tokens"):
        fsdp_learner._forward(batch, with_entropy=False, topk_ids=torch.zeros(4, 13, K, dtype=torch.long))


def test_lora_student_topk_logprobs_and_adapter_gradients(tiny_model_path, hf_model):
    """A LoRA student goes through the same ``_forward``: with fresh adapters (B = 0) it is the base
    model, and the gradient of a top-K loss reaches the adapters only."""
    from async_rl.utils.lora import LoRAConfig

    learner = _fsdp(tiny_model_path, lora=LoRAConfig(rank=4), packing=True)
    batch = _batch()
    topk_ids = _topk_ids(batch, hf_model.config.vocab_size)
    topk = learner._forward(batch, with_entropy=False, topk_ids=topk_ids)[2]
    with torch.no_grad():
        torch.testing.assert_close(topk, _by_hand(hf_model, batch, topk_ids, TEMPERATURE, packed=True),
                                   rtol=0, atol=1e-6)
    _loss(topk).backward()
    grads = _grads(learner.model.named_parameters())
    assert grads and all(".lora_" in n for n in grads)
    assert max(float(g.abs().max()) for n, g in grads.items() if ".lora_B." in n) > 1e-4


# ----------------------------------------------------------------------------- Megatron learner

def test_vocab_parallel_topk_equals_the_full_log_softmax():
    """At tensor-parallel size 1, pure tensor math: the top-K picks are the full log-softmax's,
    padding vocabulary rows beyond ``vocab_size`` ignored, and the label log-probs unchanged."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    from async_rl.learners.base import init_single_process_group
    from async_rl.learners.megatron.model import init_model_parallel
    from async_rl.learners.megatron.ops import vocab_parallel_logprobs

    init_single_process_group()
    init_model_parallel(1, 1, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 4
    padded = torch.cat([logits, torch.full((3, 5, 2), 50.0)], -1).requires_grad_(True)  # padding must not count
    labels = torch.randint(0, 40, (3, 5), generator=g)
    ids = torch.randint(0, 40, (3, 5, 7), generator=g)
    lp, ent, topk = vocab_parallel_logprobs(padded, labels, 0.6, 40, with_entropy=True, topk_ids=ids)
    exact = torch.log_softmax(logits.double() / 0.6, -1)
    torch.testing.assert_close(topk.double(), exact.gather(-1, ids), rtol=0, atol=1e-5)
    plain_lp, plain_ent = vocab_parallel_logprobs(padded, labels, 0.6, 40, with_entropy=True)
    assert torch.equal(lp, plain_lp) and torch.equal(ent, plain_ent)
    topk.sum().backward()
    assert padded.grad[..., 40:].abs().max() == 0 and padded.grad[..., :40].abs().max() > 0.1


MEGATRON_LAYOUTS = ((2, 1), (1, 2))
"""``(tensor_parallel_size, pipeline_parallel_size)`` on two ranks."""


def _megatron_rank(rank: int, world: int, init_file: str, model_path: str, out: str) -> None:
    """One of two spawned gloo ranks: for each layout of ``MEGATRON_LAYOUTS``, the top-K log-probs
    (padded and packed) and the weights after one step on ``_loss`` of them (padded at
    tensor-parallel 2, packed with two stages), written by the reporting rank / rank 0."""
    import torch.distributed as dist

    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import MegatronConfig
    from async_rl.learners.launch import exit_rank_process
    from async_rl.learners.megatron import MegatronLearner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    batch = _batch()
    for tp, pp in MEGATRON_LAYOUTS:
        cfg = _cfg(backend="megatron", world_size=world,
                   megatron=MegatronConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
        learner = MegatronLearner(cfg, AlgorithmConfig(name="grpo").apply_preset(), model_path,
                                  temperature=TEMPERATURE, total_optimizer_steps=4)
        topk_ids = _topk_ids(batch, learner.vocab_size)
        step_packed = pp > 1
        with torch.no_grad():
            other = learner._forward(batch, with_entropy=True, packed=not step_packed, topk_ids=topk_ids)
        stepped = learner._forward(batch, with_entropy=True, packed=step_packed, topk_ids=topk_ids)
        # Every rank returns the 3-tuple of the same shapes (a first stage its stand-ins).
        for res in (other, stepped):
            assert len(res) == 3 and res[2].shape == topk_ids.shape and res[2].dtype == torch.float32
        _loss(stepped[2]).backward()
        learner._step_optimizer()
        weights = {n: t.clone() for n, t in learner.named_weights()}  # collective: every rank
        if learner._reports_outputs():
            padded, packed = (stepped, other) if step_packed else (other, stepped)
            torch.save({"padded": padded[2].detach(), "packed": packed[2].detach()}, f"{out}-{tp}{pp}-topk.pt")
        if rank == 0:
            torch.save(weights, f"{out}-{tp}{pp}-weights.pt")
    dist.destroy_process_group()
    exit_rank_process(0)


@pytest.mark.slow
def test_megatron_topk_logprobs_and_their_gradients_equal_fsdp2(tmp_path, tiny_model_path):
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    ctx, out = mp.get_context("spawn"), str(tmp_path / "mg")
    procs = [ctx.Process(target=_megatron_rank, args=(r, 2, str(tmp_path / "init"), tiny_model_path, out))
             for r in range(2)]
    for p in procs:
        p.start()
    # The FSDP2 reference meanwhile: top-K log-probs (padded and packed) and one step on the loss.
    batch = _batch()
    learner = _fsdp(tiny_model_path)
    topk_ids = _topk_ids(batch, learner.model.config.vocab_size)
    with torch.no_grad():
        fsdp_packed = learner._forward(batch, with_entropy=False, packed=True, topk_ids=topk_ids)[2]
    fsdp_padded = learner._forward(batch, with_entropy=False, packed=False, topk_ids=topk_ids)[2]
    _loss(fsdp_padded).backward()
    learner._step_optimizer()
    want = {n: t.clone() for n, t in learner.named_weights()}
    start = {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters()}
    assert max(float((w - start[n]).abs().max()) for n, w in want.items()) > 1e-4  # equality can fail
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    for tp, pp in MEGATRON_LAYOUTS:
        got = torch.load(f"{out}-{tp}{pp}-topk.pt")
        torch.testing.assert_close(got["padded"], fsdp_padded.detach(), rtol=0, atol=1e-5, msg=f"tp{tp} pp{pp}")
        torch.testing.assert_close(got["packed"], fsdp_packed, rtol=0, atol=1e-5, msg=f"tp{tp} pp{pp}")
        weights = torch.load(f"{out}-{tp}{pp}-weights.pt")
        assert list(weights) == list(want)
        for name, w in want.items():
            torch.testing.assert_close(weights[name], w, rtol=1e-5, atol=1e-5, msg=f"tp{tp} pp{pp} {name}")
