"""The PPO critic on megatron-core: the policy's ``GPTModel`` layout with a value head in place of
the output layer, on the policy's tensor- and pipeline-parallel ranks (the FSDP2 learner's
counterpart is ``async_rl.learners.critic``)."""

from __future__ import annotations

import torch
from torch import nn

from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners.base import CriticConfig
from async_rl.learners.batching import unpack_labels
from async_rl.learners.critic import CriticCore
from async_rl.learners.megatron.ops import model_inputs, model_parallel_step
from async_rl.learners.megatron.pipeline import stage_forward


class ValueHead(nn.Module):
    """``Linear(hidden, 1)`` in place of a critic ``GPTModel``'s ``output_layer``, replicated on the
    tensor-parallel ranks (one output cannot be split); starts at zero, like
    ``async_rl.learners.critic.ValueModel``'s.

    ``forward(hidden [s, b, h]) -> ([s, b, 1] float32, None)``, the output layer's signature.
    """

    def __init__(self, hidden_size: int, sequence_parallel: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))
        self.bias = nn.Parameter(torch.zeros(1))
        self.sequence_parallel = sequence_parallel

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden)
        return hidden.float() @ self.weight.float().t() + self.bias.float(), None


class MegatronCritic(CriticCore):
    """The PPO critic on megatron-core: the policy's ``GPTModel`` (untied) with a ``ValueHead``.

    Same contract as ``async_rl.learners.critic.FSDPCritic`` (values aligned with the label slots:
    ``values[:, t] = V(input_ids[:, : t + 1])``; PPO, Schulman et al. 2017; GAE, Schulman et al.
    2015).

    Args:
        cfg: critic settings.
        build: ``(hf_dir) -> GPTModel`` with untied embeddings, loaded from ``hf_dir``.
        model_path: Hugging Face directory of the backbone's starting weights.
        make_optimizer: ``(params, lr) -> (optimizer, scheduler)`` with the learner's schedule.
        packing: run micro-batches as packed rows (``learner.packing``; see ``model_inputs``).
        sequence_multiple: pad rows to a multiple of this (the tensor-parallel size under
            sequence parallelism; see ``model_inputs``).
    """

    def __init__(self, cfg: CriticConfig, build, model_path: str, make_optimizer, packing: bool = False,
                 sequence_multiple: int = 1) -> None:
        self.cfg, self.packing, self.sequence_multiple = cfg, packing, sequence_multiple
        self.model = build(model_path)
        if self.model.post_process:  # only the last pipeline stage has an output layer to replace
            self.model.output_layer = ValueHead(self.model.config.hidden_size, self.model.config.sequence_parallel)
        self.model.to(next(self.model.parameters()).device).eval()
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg.lr)

    def load_backbone(self, policy: nn.Module) -> None:
        """Copy the policy's weights into the backbone (the head is kept; a tied policy's embedding
        is the critic's input embedding, its output layer is not used)."""
        source = dict(policy.named_parameters())
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if not name.startswith("output_layer."):
                    param.copy_(source[name])

    def values(self, mb: TrainBatch) -> torch.Tensor:
        """Values ``[b, L-1]`` float32 of a micro-batch (on the critic's device); differentiable."""
        ids, positions, mask, width = model_inputs(mb, self.packing, self.sequence_multiple)
        out = stage_forward(self.model, ids, positions, mask)
        if out.dim() == 0:  # a pipeline stage before the last (see MegatronLearner._forward)
            return out + torch.zeros(mb.input_ids.shape[0], mb.input_ids.shape[1] - 1, device=out.device)
        values = out[..., 0][:, : width - 1].float()
        return unpack_labels(values, mb.attention_mask) if self.packing else values

    def optimizer_step(self, grad_clip: float) -> torch.Tensor:
        """Reduce, clip, step and zero the critic's gradients; returns the pre-clip grad norm."""
        return model_parallel_step(self.model, self.optimizer, self.scheduler, grad_clip)


__all__ = ["MegatronCritic", "ValueHead"]
