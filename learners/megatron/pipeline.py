"""Pipeline stages of the Megatron learner, joined by point-to-point sends inside autograd.

With ``pipeline_parallel_size = P`` each rank holds one stage (a run of consecutive decoder
layers; the first also the embedding, the last the final norm and output layer; GPipe, Huang et
al. 2019, arXiv 1811.06965). A micro-batch's forward runs stage by stage: a stage receives the
previous stage's hidden states ``[s, b, h]``, runs its layers and sends its output on. Backward
runs the other way: the last stage's loss backward reaches the received hidden states, whose
gradient goes back to the previous stage, whose backward continues from there.

megatron-core's schedules (``get_forward_backward_func``) would do this with 1F1B overlap, but in
megatron-core 0.16.1 they allocate a CUDA tensor before any communication and cannot run on CPU
(``tests/test_megatron_model.py::test_megatron_pipeline_schedule_needs_cuda``). Here the
sends live inside autograd instead, so the learner's one training step (``LearnerCore``: forward,
loss, ``backward()`` per micro-batch) runs unchanged on every stage: a stage that is not the last
gets a zero "output" tied to its send, whose backward receives the real gradient. Stages run one
micro-batch at a time, in the same order on every stage (no overlap: correct, with a pipeline
bubble of ``(P - 1) / P`` of the time).

Every tensor crosses in float32, and each tensor-parallel rank talks to its own peer in the next
stage (megatron-core's pipeline groups).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class _SendForward(torch.autograd.Function):
    """Forward: send ``hidden`` to the next stage, return a 0-dim zero tied to it. Backward: receive
    the gradient of ``hidden`` from the next stage (the incoming gradient of the zero is ignored:
    the loss lives on the last stage)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, peer: int, group) -> torch.Tensor:
        ctx.peer, ctx.group, ctx.shape, ctx.dtype = peer, group, hidden.shape, hidden.dtype
        dist.send(hidden.detach().float().contiguous(), dst=peer, group=group)
        return hidden.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx, _unused: torch.Tensor):
        grad = torch.empty(ctx.shape, dtype=torch.float32, device=_unused.device)
        dist.recv(grad, src=ctx.peer, group=ctx.group)
        return grad.to(ctx.dtype), None, None


def _receive_hidden(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The previous stage's hidden states ``shape`` (float32 on the wire, ``dtype`` here); when
    gradients are on, a leaf whose gradient is sent back to that stage as soon as backward computes it."""
    from megatron.core import parallel_state as ps

    group, prev = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_prev_rank()
    hidden = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(hidden, src=prev, group=group)
    hidden = hidden.to(dtype)
    if torch.is_grad_enabled():
        hidden.requires_grad_(True)
        hidden.register_hook(lambda g: dist.send(g.float().contiguous(), dst=prev, group=group))
    return hidden


def stage_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor) -> torch.Tensor:
    """This rank's stage of a ``GPTModel`` forward over one micro-batch.

    Args:
        model: this rank's stage (``pre_process`` on the first, ``post_process`` on the last).
        input_ids, position_ids: ``[b, s]`` int64 (every stage has them; only the first embeds).
        attention_mask: ``[b, 1, s, s]`` bool, True = masked.

    Returns:
        On the last stage the model's output (``[b, s, V/tp]`` logits, or a critic's values); on
        the others a 0-dim float32 zero whose backward brings the next stage's gradient in. With
        one stage, the model's output.
    """
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return model(input_ids, position_ids, attention_mask)
    cfg = model.config
    if not ps.is_pipeline_first_stage():
        s = input_ids.shape[1] // (ps.get_tensor_model_parallel_world_size() if cfg.sequence_parallel else 1)
        model.set_input_tensor(_receive_hidden((s, input_ids.shape[0], cfg.hidden_size), input_ids.device,
                                               cfg.params_dtype))
    out = model(input_ids, position_ids, attention_mask)
    if ps.is_pipeline_last_stage():
        return out
    return _SendForward.apply(out, ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_group())


def reduce_shared_embedding_grads(model: nn.Module) -> None:
    """Sum the gradients of a tied embedding's two copies (the first stage's input embedding, the
    last stage's output layer) over megatron-core's embedding group, as its
    ``finalize_model_grads`` does; no-op with one stage or untied weights."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1 or not getattr(model, "share_embeddings_and_output_weights",
                                                                         False):
        return
    if not ps.is_rank_in_embedding_group():
        return
    weight = model.shared_embedding_or_output_weight()
    grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
    dist.all_reduce(grad, group=ps.get_embedding_group())
    weight.grad = grad


__all__ = ["stage_forward", "reduce_shared_embedding_grads"]
