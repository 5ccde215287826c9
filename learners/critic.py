"""The PPO critic: the policy's backbone with a scalar value head, sharded like the policy.

Values are aligned with the learner's label slots: ``values[:, t]`` is V(s_t), the value of the
prefix ``input_ids[:, : t + 1]``, i.e. of the state in which token ``input_ids[:, t + 1]`` is
chosen. This is the alignment ``gae_advantages`` expects (``delta_t = r_t + gamma V_{t+1} -
V_t`` over label slots).

Source: PPO (Schulman et al. 2017, arXiv 1707.06347) with GAE (Schulman et al. 2015, arXiv
1506.02438); the value model as a language-model backbone plus a linear head follows
InstructGPT (Ouyang et al. 2022, arXiv 2203.02155, appendix C).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from async_rl.algorithms.critic import value_loss
from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners.base import CriticConfig, clip_and_step, copy_matching_parameters


class ValueModel(nn.Module):
    """Transformer backbone plus ``Linear(hidden, 1)``.

    The head starts at zero, so a fresh critic predicts V = 0 everywhere: GAE with ``lam = 1``
    then reduces to whitened Monte-Carlo returns on the first step instead of returns minus random
    noise.

    Args:
        backbone: a Hugging Face base model (``AutoModel``) returning ``last_hidden_state``.
    """

    def __init__(self, backbone: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor) -> torch.Tensor:
        """Values ``[B, L-1]`` float32 for the label slots of ``input_ids`` ``[B, L]`` int64
        (``attention_mask`` ``None`` for a packed row told apart by ``position_ids``)."""
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        # A matmul with the head's single row, not Linear + squeeze: FSDP2 warns about (and can
        # mishandle) a root module returning a view.
        # float32 head math also under bf16 mixed precision (head parameters cast to bf16).
        return hidden[:, :-1].float() @ self.value_head.weight[0].float() + self.value_head.bias[0].float()


class CriticCore:
    """The value loss both critics (``FSDPCritic``, ``async_rl.learners.megatron.critic.MegatronCritic``)
    train with; a subclass provides ``cfg`` (``CriticConfig``) and ``values(mb)``."""

    def backward(self, mb: TrainBatch, agg_mode: str, num_tokens, num_seqs, horizon,
                 grad_scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Clipped value loss of one micro-batch against ``extras["returns"]``; accumulates grads.

        The loss is divided by the mini-batch's global normalisers, like the policy loss, so
        micro-batch splits do not change the update; ``grad_scale`` is the learner's
        (``LearnerCore._grad_scale``: the data-parallel size where the backend averages
        gradients, 1 where it sums them).
        """
        values = self.values(mb)
        loss, metrics = value_loss(values, mb.extras["values"], mb.extras["returns"], mb.loss_mask,
                                   clip_range_value=self.cfg.clip_range_value, agg_mode=agg_mode,
                                   num_global_tokens=num_tokens, num_global_seqs=num_seqs, horizon=horizon)
        (self.cfg.loss_coef * grad_scale * loss).backward()
        return {"critic/vf_loss": loss.detach(), **{f"critic/{k}": v for k, v in metrics.items()}}


class FSDPCritic(CriticCore):
    """The critic's model, optimizer and update, driven by ``FSDPLearner``.

    Args:
        cfg: critic settings.
        model_path: Hugging Face directory of the backbone's starting weights.
        shard: function sharding a module in place (the learner's FSDP2 wrapping).
        make_optimizer: ``(params, lr) -> (optimizer, scheduler)`` with the learner's schedule.
        packing: run micro-batches as packed rows (``learner.packing``; see ``values``).
    """

    def __init__(self, cfg: CriticConfig, model_path: str, shard, make_optimizer, packing: bool = False) -> None:
        from transformers import AutoModel

        self.cfg, self.packing = cfg, packing
        backbone = AutoModel.from_pretrained(model_path, dtype=torch.float32)
        backbone.config.use_cache = False
        self.model = ValueModel(backbone)
        shard(self.model, layers_of=backbone)
        self.model.eval()  # no dropout, as for the policy (see FSDPLearner._load_policy)
        self.optimizer, self.scheduler = make_optimizer(self.model.parameters(), cfg.lr)
        # The causal LM's names carry its base-model prefix ("model." for Qwen2, "transformer."
        # for GPT-2); the bare backbone's do not.
        self.policy_prefix = f"{backbone.base_model_prefix}."

    def load_backbone(self, policy_named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Overwrite the backbone with the policy's current weights (the head is kept)."""
        copy_matching_parameters(policy_named_params, self.model.backbone, prefix=self.policy_prefix)

    def values(self, mb: TrainBatch) -> torch.Tensor:
        """Values ``[b, L-1]`` float32 of a micro-batch (on the critic's device) under the
        current critic, from one packed row when ``packing`` is on (0 at slots that predict no
        real token). Differentiable; ``FSDPLearner.prepare`` calls it under ``no_grad``."""
        if self.packing:
            from async_rl.learners.batching import pack_rows, unpack_labels

            ids, positions = pack_rows(mb.input_ids, mb.attention_mask, mb.position_ids)
            return unpack_labels(self.model(ids, None, positions), mb.attention_mask)
        return self.model(mb.input_ids, mb.attention_mask, mb.position_ids)

    def optimizer_step(self, grad_clip: float) -> torch.Tensor:
        """Clip, step and zero the critic's gradients; returns the pre-clip grad norm."""
        return clip_and_step(self.model.parameters(), self.optimizer, self.scheduler, grad_clip)


__all__ = ["ValueModel", "CriticCore", "FSDPCritic"]
