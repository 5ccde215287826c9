"""The adjustments megatron-core 0.16.1 needs to run a ``GPTModel`` on CPU (gloo).

megatron-core is written for CUDA; its local (non-Transformer-Engine) layer spec computes fine on
CPU except in three places, plus a fourth for tied embeddings with pipeline parallelism, each
handled here and nowhere else (``tests/test_megatron_cpu.py``, and for the fourth
``tests/test_megatron_model.py``, fail when a newer megatron-core makes one of them unnecessary
or insufficient):

1. ``torch.cuda.current_device()`` is called for devices of tensors it creates itself: RoPE's
   inverse frequencies and the global memory buffer. ``apply_cpu_adjustments`` points it at
   ``torch.device("cpu")`` when CUDA is not available (never on a machine with a GPU).
2. ``tensor_parallel.model_parallel_cuda_manual_seed`` builds an RNG tracker that forks the CUDA
   RNG state; ``seed_model_parallel`` asks for megatron's inference tracker on CPU, whose ``fork``
   is a no-op (we train with zero dropout, so no tensor-parallel RNG stream is ever drawn from).
3. Without an attention mask megatron builds its default causal mask with ``device="cuda"``;
   ``causal_attention_mask`` builds the boolean mask (padding and packed rows included) that the
   caller passes to ``GPTModel.forward`` instead.
4. With tied embeddings and pipeline parallelism, ``GPTModel.__init__`` moves the last stage's
   copy of the embedding with ``weight.data.cuda()`` before all-reducing it over the embedding
   group; ``cpu_model_construction`` makes ``Tensor.cuda`` return the tensor itself while the
   model is built (only without CUDA, only inside the ``with`` block).

megatron's pipeline schedules (``get_forward_backward_func()``) cannot run on CPU at all: they
allocate ``torch.zeros([], device="cuda")`` for the token count before anything else. A CPU
learner runs the stages itself (send/recv of the hidden states ``[s, b, h]``).

Typical use (what ``async_rl.learners.megatron.model.init_model_parallel`` does)::

    apply_cpu_adjustments()                  # no-op with CUDA
    parallel_state.initialize_model_parallel(tp, pp)
    seed_model_parallel(seed, torch.device("cpu"))
    logits = model(input_ids, position_ids, causal_attention_mask(attention_mask, position_ids))
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_original_current_device = None  # torch.cuda.current_device before apply_cpu_adjustments


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def cpu_adjustments_needed() -> bool:
    """Whether megatron-core runs here without CUDA, so adjustments 1 and 4 apply (the one test
    of it: ``apply_cpu_adjustments``, ``cpu_model_construction`` and the ``cpu_only`` test marker
    all go by it)."""
    return not torch.cuda.is_available()


def apply_cpu_adjustments() -> None:
    """Point ``torch.cuda.current_device`` at the CPU when CUDA is not available (idempotent).

    megatron-core passes ``device=torch.cuda.current_device()`` when it allocates RoPE
    frequencies and its global memory buffer; without a CUDA driver that call raises. With CUDA
    available this does nothing. ``undo_cpu_adjustments`` restores the original function.
    """
    global _original_current_device
    if not cpu_adjustments_needed() or _original_current_device is not None:
        return
    _original_current_device = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device


def undo_cpu_adjustments() -> None:
    """Restore ``torch.cuda.current_device`` (for tests; a no-op if nothing was adjusted)."""
    global _original_current_device
    if _original_current_device is not None:
        torch.cuda.current_device = _original_current_device
        _original_current_device = None


@contextlib.contextmanager
def cpu_model_construction() -> Iterator[None]:
    """Within the block, ``Tensor.cuda()`` returns the tensor itself (only without CUDA).

    Wrap ``GPTModel(...)`` on CPU: with tied embeddings and pipeline parallelism megatron's
    ``LanguageModule.setup_embeddings_and_output_layer`` calls ``weight.data.cuda()`` on the
    embedding copy before its all-reduce over the embedding group (gloo handles CPU tensors).
    Not thread-safe: it swaps a method of ``torch.Tensor`` for the duration of the block.
    """
    if not cpu_adjustments_needed():
        yield
        return
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        torch.Tensor.cuda = original


def seed_model_parallel(seed: int, device: torch.device) -> None:
    """Seed megatron's model-parallel RNG tracker (after ``initialize_model_parallel``).

    On CPU the default tracker cannot be used: it stores and forks ``torch.cuda`` RNG states
    (``torch.cuda.get_rng_state`` / ``set_rng_state``), which fail without CUDA. The inference
    tracker keeps the same interface with a no-op ``fork``; that is exact for us because every
    dropout is zero, so no tensor-parallel random stream is ever consumed. The tracker is reset
    on every call, so the model parallel state can be re-initialised in one process.
    """
    from megatron.core import tensor_parallel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=(device.type == "cpu"), force_reset_rng=True)


def causal_attention_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor) -> torch.Tensor:
    """The boolean self-attention mask megatron expects, built on ``position_ids.device``.

    Args:
        attention_mask: ``[b, s]`` int or bool, 1/True for real tokens, 0/False for padding; or
            ``None`` for packed rows (several sequences back to back in one row).
        position_ids: ``[b, s]`` int positions; a new sequence starts wherever it is 0.

    Returns:
        ``[b, 1, s, s]`` bool, True = masked out (megatron's convention, filled with -10000
        before the softmax). Query ``i`` may attend key ``j`` iff ``j <= i``, ``j`` is not
        padding, and ``i`` and ``j`` lie in the same sequence (no 0 in ``position_ids[j+1..i]``).
        The segment rule is also applied when ``attention_mask`` is given (a no-op for an
        ordinary row, whose positions reset only at its start). Every query keeps its own key
        unmasked, so padding queries never see an all-masked row (no NaN; their outputs are
        garbage the caller ignores).

    megatron's RoPE ignores ``position_ids`` (with ``position_embedding_type="rope"`` it rotates
    by ``0..s-1`` in every row). Right-padded rows are exact; packed rows and left padding are
    exact in arithmetic too, because attention stays inside each sequence and RoPE scores depend
    only on position offsets (float rounding of the larger angles grows with the offset).

    Example (one packed row, ``attention_mask=None``, ``position_ids=[[0, 1, 0, 1]]``); rows are
    queries, ``x`` = masked::

        . x x x
        . . x x
        x x . x
        x x . .
    """
    b, s = position_ids.shape
    device = position_ids.device
    idx = torch.arange(s, device=device)
    masked = (idx[None, :] > idx[:, None]).expand(b, s, s)  # causal: key after query
    segment = torch.cumsum((position_ids == 0).long(), dim=1)  # [b, s] sequence index per token
    masked = masked | (segment[:, :, None] != segment[:, None, :])
    if attention_mask is not None:
        masked = masked | ~attention_mask.to(device=device, dtype=torch.bool)[:, None, :]
    masked = masked & ~torch.eye(s, dtype=torch.bool, device=device)
    return masked[:, None, :, :]
