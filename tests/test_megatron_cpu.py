"""``async_rl.learners.megatron.cpu`` is exactly what megatron-core needs on CPU: each adjustment is
necessary (the forward raises without it) and the three together are sufficient (the forward
runs). A newer megatron-core that makes one unnecessary or insufficient fails here, so the module
can shrink or grow with it. The fourth adjustment (tied embeddings with pipeline parallelism)
needs two ranks and is pinned in ``tests/test_megatron_model.py``.

Each test builds a tiny local-spec ``GPTModel`` (1 layer, hidden 32) in a world-size-1 gloo group.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from async_rl.learners.megatron import cpu as megatron_cpu
from async_rl.learners.megatron.cpu import causal_attention_mask

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

pytestmark = pytest.mark.cpu_only  # checks megatron-core on a machine without CUDA

VOCAB, SEQ = 50, 8


@pytest.fixture(scope="module")
def model_parallel(tmp_path_factory):
    """megatron's TP=1/PP=1 groups on a world-size-1 gloo group in this process: the one an earlier
    test left (the learners' in-process group; the full suite runs those first), else a new one."""
    from megatron.core import parallel_state

    torch.set_num_threads(1)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'init'}",
                                rank=0, world_size=1)
    assert dist.get_world_size() == 1, "these checks run in a world-size-1 process group"
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, 1)
    yield
    megatron_cpu.undo_cpu_adjustments()
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


def _forward(*, current_device: bool = True, rng_tracker: bool = True, mask: str = "padded"):
    """Seed, build a tiny GPTModel and run it; each keyword switches one adjustment off."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if current_device:
        megatron_cpu.apply_cpu_adjustments()
    else:
        megatron_cpu.undo_cpu_adjustments()
    if rng_tracker:
        megatron_cpu.seed_model_parallel(0, torch.device("cpu"))
    else:  # megatron's default (training) tracker
        tensor_parallel.model_parallel_cuda_manual_seed(0, force_reset_rng=True)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                            normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                            add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            use_cpu_initialization=True)
    model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=VOCAB,
                     max_sequence_length=2 * SEQ, position_embedding_type="rope").eval()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ).expand(2, SEQ)
    attention_mask = {"padded": causal_attention_mask(torch.ones(2, SEQ, dtype=torch.long), pos),
                      "none": None}[mask]
    with torch.no_grad():
        return model, model(ids, pos, attention_mask)


def test_all_adjustments_run_the_forward(model_parallel):
    _, logits = _forward()
    assert logits.shape == (2, SEQ, VOCAB) and torch.isfinite(logits).all()


def test_forward_needs_current_device_on_cpu(model_parallel):
    # RoPE moves its inverse frequencies to torch.cuda.current_device() in forward.
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        _forward(current_device=False)


def test_seeding_needs_the_inference_rng_tracker_on_cpu(model_parallel):
    # The default tracker saves torch.cuda.get_rng_state() when a stream is added.
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        _forward(rng_tracker=False)


def test_forward_needs_an_explicit_mask_on_cpu(model_parallel):
    # Without a mask megatron builds its default causal mask with device="cuda".
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        _forward(mask="none")


def test_apply_is_idempotent_and_undoable(model_parallel):
    megatron_cpu.undo_cpu_adjustments()
    original = torch.cuda.current_device
    megatron_cpu.apply_cpu_adjustments()
    megatron_cpu.apply_cpu_adjustments()
    assert torch.cuda.current_device() == torch.device("cpu")
    megatron_cpu.undo_cpu_adjustments()
    assert torch.cuda.current_device is original


def test_mask_padded_rows():
    m = causal_attention_mask(torch.tensor([[1, 1, 1], [1, 1, 0]]), torch.arange(3).expand(2, 3))
    x, o = True, False  # x = masked
    assert m.shape == (2, 1, 3, 3) and m.dtype == torch.bool
    assert m[0, 0].tolist() == [[o, x, x], [o, o, x], [o, o, o]]
    assert m[1, 0].tolist() == [[o, x, x], [o, o, x], [o, o, o]]  # padding query keeps itself
    pad_key = causal_attention_mask(torch.tensor([[1, 0, 1]]), torch.tensor([[0, 1, 2]]))
    assert pad_key[0, 0].tolist() == [[o, x, x], [o, o, x], [o, x, o]]


def test_mask_packed_row():
    m = causal_attention_mask(None, torch.tensor([[0, 1, 0, 1, 2]]))
    x, o = True, False
    assert m[0, 0].tolist() == [[o, x, x, x, x], [o, o, x, x, x], [x, x, o, x, x], [x, x, o, o, x],
                                [x, x, o, o, o]]


def test_packed_row_equals_separate_rows(model_parallel):
    # megatron's RoPE ignores position_ids (it rotates by 0..s-1 per row); a packed row is still
    # exact because attention stays inside each sequence and RoPE scores depend only on offsets.
    model, _ = _forward()
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, VOCAB, (1, 5), generator=g), torch.randint(0, VOCAB, (1, 3), generator=g)
    packed_pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    with torch.no_grad():
        packed = model(torch.cat([a, b], 1), packed_pos, causal_attention_mask(None, packed_pos))
        alone = [model(t, torch.arange(t.shape[1])[None], causal_attention_mask(None, torch.arange(t.shape[1])[None]))
                 for t in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), rtol=0, atol=1e-5)
