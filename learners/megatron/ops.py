"""What the Megatron learner does to one micro-batch and one optimizer step on model slices:
the model inputs (padded or packed rows and their attention mask), log-probs and entropies from
vocabulary-parallel logits, and the optimizer step over tensor-, pipeline- and data-parallel
ranks. Shared by the policy (``async_rl.learners.megatron``) and its critic
(``async_rl.learners.megatron.critic``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners.batching import pack_rows
from async_rl.learners.megatron.cpu import causal_attention_mask
from async_rl.learners.megatron.pipeline import reduce_shared_embedding_grads


def vocab_parallel_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                            with_entropy: bool, topk_ids: torch.Tensor | None = None) -> tuple:
    """Log-probs of ``labels`` and entropies from logits split over the vocabulary, without
    gathering it: each tensor-parallel rank holds ``logits[..., r*V_r : (r+1)*V_r]``.

    With ``z = float32(logits) / temperature`` over the real vocabulary (padding rows beyond
    ``vocab_size`` dropped), ``log p(y) = z_y - logsumexp(z)`` and ``H = logsumexp(z) - sum_v p_v
    z_v`` (the forms of ``async_rl.algorithms.logprobs``). The maximum, the sum of exponentials,
    the label's logit and ``sum p z`` are each one all-reduce over the tensor-parallel group; the
    sums go through megatron-core's ``reduce_from_tensor_model_parallel_region`` (identity in
    backward), so gradients reach every rank's slice. Megatron-LM's vocab-parallel cross-entropy
    (Shoeybi et al. 2019, section 3) is the same decomposition.

    Args:
        logits: ``[b, t, V_r]`` this rank's vocabulary slice (any float dtype).
        labels: ``[b, t]`` int64 token ids in ``[0, vocab_size)``.
        temperature: sampling temperature (> 0) the behavior log-probs were taken at.
        vocab_size: the real (unpadded) vocabulary.
        with_entropy: also return the entropies.
        topk_ids: ``[b, t, K]`` int64 ids (the teacher's top-k); their log-probs are picked like
            the label's, each rank its own slice's, summed over the ranks.

    Returns:
        ``(logprobs [b, t], entropy [b, t] or None)``, float32, differentiable; with ``topk_ids``
        a third, ``[b, t, K]`` float32.

    Raises:
        ValueError: a rank's slice holds no real vocabulary entry (more padding than the slice).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    tp_size, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    per_rank = logits.shape[-1]
    start = tp_rank * per_rank
    real = min(per_rank, vocab_size - start)
    if real <= 0:
        raise ValueError(f"tensor-parallel rank {tp_rank} holds no real vocabulary entry ({vocab_size} entries "
                         f"over {tp_size} slices of {per_rank})")
    z = logits[..., :real].float() / temperature
    top = z.detach().amax(-1)
    if tp_size > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = z - top.unsqueeze(-1)
    sum_exp = reduce_from_tensor_model_parallel_region(z.exp().sum(-1))
    lse = sum_exp.log()
    local = labels - start
    owned = (local >= 0) & (local < real)
    picked = z.gather(-1, local.clamp(0, real - 1).unsqueeze(-1)).squeeze(-1) * owned
    logprobs = reduce_from_tensor_model_parallel_region(picked) - lse
    entropy = None
    if with_entropy:
        p = (z - lse.unsqueeze(-1)).exp()
        entropy = lse - reduce_from_tensor_model_parallel_region((p * z).sum(-1))
    if topk_ids is None:
        return logprobs, entropy
    local_k = topk_ids - start
    owned_k = (local_k >= 0) & (local_k < real)
    picked_k = z.gather(-1, local_k.clamp(0, real - 1)) * owned_k
    return logprobs, entropy, reduce_from_tensor_model_parallel_region(picked_k) - lse.unsqueeze(-1)


def model_parallel_step(model: nn.Module, optimizer, scheduler, grad_clip: float) -> torch.Tensor:
    """Sum gradients over the data-parallel replicas, clip by the global norm, step, zero grads.

    Mixture of experts: expert weights (megatron's ``allreduce=False``) are summed over the
    expert-data-parallel group instead, and their squared norm over the expert
    tensor x expert x pipeline group (each rank holds other experts).

    The norm counts each weight once: tensor-parallel slices from every rank, duplicated
    parameters (layer norms, biases of row-parallel layers) from tensor-parallel rank 0
    (megatron-core's ``param_is_not_tensor_parallel_duplicate``), a tied embedding's last-stage
    copy not at all (``param.shared``), squared norms summed over the model-parallel group
    (tensor x pipeline). As megatron-core's ``finalize_model_grads`` does, the two copies of a tied
    embedding sum their gradients over the embedding group first, and with sequence parallelism
    the layer norms' partial gradients are all-reduced over the tensor-parallel group; without it,
    Qwen3's QK-norm weights' partial gradients are summed over it and the MoE experts' divided by
    the TP size (``model._mark_tensor_parallel_gradients`` says why).

    Args:
        model: this rank's slice of the model (its trainable parameters are stepped).
        optimizer, scheduler: torch optimizer and LR scheduler (``scheduler`` may be ``None``).
        grad_clip: max global L2 norm; 0 = no clipping.

    Returns:
        The pre-clip global gradient norm, a 0-dim float32 tensor (the same on every rank).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    reduce_shared_embedding_grads(model)
    params = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
    # megatron marks MoE expert weights ``allreduce=False``: each expert-parallel rank holds other
    # experts, whose gradients already cover every data-parallel replica's tokens (the dispatcher's
    # all-to-all brought them), so they are summed only over replicas of the *same* experts
    # (megatron's expert-data-parallel group), everything else over the data-parallel group.
    experts = [p for p in model.parameters() if p.requires_grad and not getattr(p, "allreduce", True)]
    for p in experts:
        if p.grad is None:  # an expert no token reached on any micro-batch: the same flat sizes on every rank
            p.grad = torch.zeros_like(p)
    params = [p for p in params if getattr(p, "allreduce", True)] + experts
    dense = [p for p in params if getattr(p, "allreduce", True)]
    _sum_grads(dense, ps.get_data_parallel_world_size(), ps.get_data_parallel_group)
    if experts:
        _sum_grads(experts, ps.get_expert_data_parallel_world_size(), ps.get_expert_data_parallel_group)
    if ps.get_tensor_model_parallel_world_size() > 1:
        for p in params:
            # Both flags come from model._mark_tensor_parallel_gradients (TP > 1, no sequence parallelism).
            if getattr(p, "sequence_parallel", False) or getattr(p, "tp_partial_grad", False):
                dist.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())
            elif getattr(p, "tp_duplicated_tokens", 0):
                p.grad.div_(p.tp_duplicated_tokens)
    device = params[0].grad.device if params else "cpu"

    def squared_norm(group_params) -> torch.Tensor:
        squares = torch.zeros((), dtype=torch.float32, device=device)
        for p in group_params:
            if param_is_not_tensor_parallel_duplicate(p) and not getattr(p, "shared", False):
                squares = squares + p.grad.float().pow(2).sum()
        return squares

    squares = squared_norm(dense)
    if ps.get_tensor_model_parallel_world_size() * ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(squares, group=ps.get_model_parallel_group())
    if experts:  # every stage of a MoE model has experts (every layer is sparse)
        # Experts differ across expert-parallel (and expert tensor-parallel) ranks and stages, as
        # megatron's get_grad_norm_fp32 counts them: one more sum, over that group. Every rank of
        # it joins, with or without local experts (a dense stage contributes 0).
        expert_squares = squared_norm(experts)
        if dist.get_world_size(ps.get_expert_tensor_model_pipeline_parallel_group()) > 1:
            dist.all_reduce(expert_squares, group=ps.get_expert_tensor_model_pipeline_parallel_group())
        squares = squares + expert_squares
    norm = squares.sqrt()
    if grad_clip > 0 and params:
        torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach().cpu()


def _sum_grads(params: list, size: int, group) -> None:
    """Sum ``params``' gradients over the ``size`` ranks of process group ``group()`` with one flat
    all-reduce (the loss is already divided by the global normaliser, so the sum is the 1-replica
    gradient); nothing when ``size`` is 1 or there are no gradients."""
    grads = [p.grad for p in params]
    if size > 1 and grads:
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=group())
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)


def model_inputs(mb: TrainBatch, packed: bool, multiple: int = 1,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(input_ids, position_ids, attention mask, width)`` for a ``GPTModel`` forward of a micro-batch.

    Padded: the batch's ``[b, L]`` ids and positions and a ``[b, 1, L, L]`` causal, key-padding
    mask. Packed: one ``[1, N]`` row of the real tokens (``async_rl.learners.batching.pack_rows``)
    and a block-diagonal causal mask cut where the positions restart. Masks are bool, True =
    masked (megatron's convention), on the batch's device. ``width`` is ``L`` (or ``N``): the
    rows are padded beyond it to a multiple of ``multiple`` (sequence parallelism splits the
    sequence over the tensor-parallel ranks), with masked pad tokens, and outputs past ``width``
    are to be dropped.
    """
    if packed:
        ids, positions = pack_rows(mb.input_ids, mb.attention_mask, mb.position_ids)
        keep = torch.ones_like(ids)
    else:
        ids, positions, keep = mb.input_ids, mb.position_ids, mb.attention_mask
    width, extra = ids.shape[1], -ids.shape[1] % multiple
    if extra:
        # Pads at position 0 open blocks of their own, and their keys are masked: nothing sees them.
        pad = ids.new_zeros(ids.shape[0], extra)
        ids, positions, keep = (torch.cat([t, pad.to(t.dtype)], 1) for t in (ids, positions, keep))
    return ids, positions, causal_attention_mask(keep if extra or not packed else None, positions), width


__all__ = ["model_inputs", "model_parallel_step", "vocab_parallel_logprobs"]
