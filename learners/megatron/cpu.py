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

5. Mixture-of-experts layers with the ``alltoall`` token dispatcher: ``MoEAlltoAllTokenDispatcher``
   makes a ``torch.cuda.Stream()`` in ``__init__`` (class attribute ``cuda_dtoh_stream``;
   ``transformer/moe/token_dispatcher.py:444-445`` in megatron-core 0.16.1) and, in every
   forward, copies its split sizes to the host on that stream and waits on a CUDA event
   (``_maybe_dtoh_and_synchronize``, same file, lines 862-900). ``cpu_moe_construction`` gives
   the class a stand-in stream while the model is built (only without CUDA) and
   ``cpu_moe_dispatchers`` replaces that method, per dispatcher instance, with one that does
   what it does to tensors already on the host: nothing.

6. Not a CPU matter but one of every machine without TransformerEngine: megatron-core 0.16.1's
   ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` and the ``fused_*`` MoE kernels
   only inside ``try: import transformer_engine`` (lines 22-39) and leaves the names undefined
   when that fails, yet the router's ``RouterGatingLinearFunction.forward`` tests
   ``te_general_gemm is not None`` (line 1192): every MoE forward raises ``NameError``.
   ``define_missing_te_names`` sets the missing names to ``None`` (what the guard expects).

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


class _HostStream:
    """Stands in for the ``torch.cuda.Stream`` megatron's alltoall dispatcher keeps (adjustment 5);
    never used as a stream: ``cpu_moe_dispatchers`` removes every use of it."""


@contextlib.contextmanager
def cpu_moe_construction() -> Iterator[None]:
    """Within the block, building an alltoall-dispatcher MoE layer does not create a CUDA stream
    (only without CUDA; adjustment 5). Wrap ``GPTModel(...)`` and call ``cpu_moe_dispatchers`` on
    the model afterwards. Not thread-safe: it sets a class attribute of megatron's dispatcher for
    the duration of the block (restored after)."""
    if not cpu_adjustments_needed():
        yield
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    saved = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    if saved is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _HostStream()
    try:
        yield
    finally:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved


def _host_dtoh_and_synchronize(dispatcher, point: str, tokens_per_expert: torch.Tensor | None = None,
                               ) -> torch.Tensor | None:
    """``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` for tensors already on the host.

    On CUDA that method copies the split sizes to the host on a side stream at
    ``cuda_dtoh_point``, turning ``input_splits``, ``output_splits`` and ``output_splits_tp`` into
    numpy arrays (``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which leaves a CPU tensor as it
    is), and waits on an event at ``cuda_sync_point``. Here the same conversion is done without a
    stream; the three must be numpy arrays (or lists) because ``all_to_all_single`` takes its split
    sizes as a sequence of ints, not a tensor (a CPU tensor there raises ``TypeError``).
    """
    if not dispatcher.drop_and_pad and point == dispatcher.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(dispatcher, name, None)
            if isinstance(value, torch.Tensor):
                setattr(dispatcher, name, value.numpy())
    return tokens_per_expert


def cpu_moe_dispatchers(model: torch.nn.Module) -> int:
    """Make every alltoall token dispatcher in ``model`` run without CUDA streams (adjustment 5).

    Only without CUDA; the override is an attribute of each dispatcher instance, so models built
    elsewhere in the process and the class itself are untouched. Returns how many dispatchers were
    adjusted (0 with CUDA or for a dense model).
    """
    import functools

    if not cpu_adjustments_needed():
        return 0
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    count = 0
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
            dispatcher._maybe_dtoh_and_synchronize = functools.partial(_host_dtoh_and_synchronize, dispatcher)
            count += 1
    return count


_TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                 "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                 "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")


def define_missing_te_names() -> list[str]:
    """Set the TransformerEngine names megatron's ``moe_utils`` leaves undefined without TE to
    ``None`` (adjustment 6; idempotent; names TE did define are untouched). Returns the names set."""
    from megatron.core.transformer.moe import moe_utils

    missing = [name for name in _TE_MOE_NAMES if not hasattr(moe_utils, name)]
    for name in missing:
        setattr(moe_utils, name, None)
    return missing


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
