"""Megatron learner: megatron-core's ``GPTModel`` with tensor parallelism, built from a Hugging Face
Qwen2 or Llama checkpoint, behind the same learner protocol as FSDP2 (``learner.backend=megatron``).

Ranks form a ``tensor x pipeline x data`` parallel grid (megatron-core's ``parallel_state``;
data parallel = ``world_size / (tensor_parallel_size * pipeline_parallel_size)``). The ranks of one
model-parallel group hold one replica of the model: each a slice of every layer's weights of one
pipeline stage (Megatron-LM, Shoeybi et al. 2019, arXiv 1909.08053, section 3; stages:
``async_rl.learners.megatron.pipeline``). They run the same micro-batches; the last stage's
tensor-parallel rank 0 reports the replica's outputs. The data-parallel replicas take
token-balanced shares of the batch and sum their gradients with one all-reduce per optimizer
step.

The training step, the losses, the global normalisers and the metrics are
``async_rl.learners.core.LearnerCore``'s, the FSDP2 learner's own: only the model side differs.
Log-probs and entropies come from the vocab-parallel logits without gathering the vocabulary
(``async_rl.learners.megatron.ops``). Weights leave by Hugging Face name, the tensor-parallel slices
gathered and the fused ``linear_qkv`` / ``linear_fc1`` split back
(``async_rl.learners.megatron.model.named_hf_weights``), so the weight-sync layer, the engines and
``export_hf`` see what the FSDP2 learner sends. Checkpoints are megatron-core distributed
checkpoints (``async_rl.learners.megatron.checkpoint``), which load at another tensor-parallel
size.

On CPU megatron-core runs its local (non-Transformer-Engine) layers over gloo, with the three
adjustments of ``async_rl.learners.megatron.cpu``. The optimizer is ``torch.optim.AdamW`` over
each rank's slices (megatron-core's own optimizers allocate CUDA tensors); the gradient norm for
clipping counts every slice once (tensor-parallel duplicates, the layer norms, from one rank).

Packing (``learner.packing``) runs a micro-batch as one row with a block-diagonal causal mask
cut where the position ids restart: megatron-core's local rotary embedding numbers positions by
row index, but attention stays inside each sequence and rotary scores depend only on the distance
between two positions, so each sequence scores as it would alone (Su et al. 2021, arXiv
2104.09864, section 3.4.2).

Not supported (refused at load): LoRA.
"""

from __future__ import annotations

import logging
import os
from contextlib import nullcontext
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.buffers.trajectory import TrainBatch
from async_rl.utils.checkpoint_format import LEARNER_STATE, load_learner_state, save_state
from async_rl.learners.base import LearnerConfig, save_hf_model
from async_rl.learners.batching import pack_labels, unpack_labels
from async_rl.learners.capabilities import LearnerCapabilities
from async_rl.learners.core import LearnerCore
from async_rl.learners.megatron.critic import MegatronCritic
from async_rl.learners.megatron.ops import model_inputs, model_parallel_step, vocab_parallel_logprobs
from async_rl.learners.megatron.pipeline import stage_forward
from async_rl.learners.megatron.routing import routing_replay, stage_routers
from async_rl.learners.megatron.model import (build_model, fuse_expert_weights, hf_weight_metadata,
                                              init_model_parallel, is_moe, load_hf_checkpoint, load_hf_weights,
                                              named_hf_weights, train_routers_only, transformer_config)
from async_rl.learners.spmd import collective

logger = logging.getLogger(__name__)


class MegatronLearner(LearnerCore):
    """Policy learner on megatron-core (``learner.backend=megatron``).

    Mixture of experts (Qwen3-MoE): megatron-core ``MoELayer``s with ``SequentialMLP`` experts,
    ``learner.megatron.expert_parallel_size`` ways expert parallel (carved out of the
    data-parallel ranks) with ``learner.megatron.moe_token_dispatcher``; megatron-core's
    auxiliary and z-losses stay off (``algorithm.moe_aux_loss_coef`` / ``moe_z_loss_coef`` are
    refused for this learner until their scaling is checked against the FSDP2 learner's).

    Args:
        cfg: learner settings (``cfg.megatron``: parallel sizes).
        algo: algorithm settings, presets applied (as for ``FSDPLearner``).
        model_path: Hugging Face directory of a Qwen2, Llama, Qwen3 or Qwen3-MoE causal LM to start from.
        temperature: the generator's sampling temperature (log-probs and entropy use it).
        total_optimizer_steps: for the LR schedule.

    Raises:
        ValueError: an architecture other than Qwen2/Llama/Qwen3/Qwen3-MoE, parallel sizes that do
            not divide the world, the heads, the layers or the experts; the checkpoint lacks a weight;
            a vision-language model.
    """

    capabilities = LearnerCapabilities(name="Megatron", lora=False, cpu_offload=False, hf_attention=False,
                                       parallel_settings="megatron",
                                       model_parallel=("tensor_parallel_size", "pipeline_parallel_size"))
    """megatron-core's own model and attention, split by ``learner.megatron``; full weights only."""

    def __init__(self, cfg: LearnerConfig, algo: AlgorithmConfig, model_path: str, temperature: float,
                 total_optimizer_steps: int) -> None:
        from transformers import AutoConfig

        if getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None:
            raise ValueError("learner.backend=megatron does not train vision-language models yet; use fsdp2")
        self._setup(cfg, algo, model_path, temperature, total_optimizer_steps)
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            # Groups of an earlier learner in this process (tests, notebooks) may belong to a
            # process group that has been destroyed since: build them anew.
            ps.destroy_model_parallel()
        m = cfg.megatron
        init_model_parallel(m.tensor_parallel_size, m.pipeline_parallel_size, cfg.rng_seed, self.device,
                            expert_parallel_size=m.expert_parallel_size)
        torch.manual_seed(cfg.rng_seed)
        self.hf_config = AutoConfig.from_pretrained(model_path)
        self.vocab_size = self.hf_config.vocab_size
        if algo.records_routing and not is_moe(self.hf_config):
            key = "routing_replay" if algo.routing_replay else "record_routing"
            raise ValueError(f"algorithm.{key}=true needs a mixture-of-experts model; "
                             f"{type(self.hf_config).__name__} has no MoE layer")
        self.model = self._build(model_path)
        if is_moe(self.hf_config):
            from async_rl.utils.moe import moe_shape

            self._moe_routers, self._moe_shape = len(stage_routers(self.model)), moe_shape(self.hf_config)
        if cfg.shared_prefix:
            logger.warning("learner.shared_prefix=true is off: the Megatron learner runs its own attention, without "
                           "custom masks; each row runs its whole prompt")
        self.policy_loss = algo.policy_loss_fn
        self.correction, self.loss_options = algo.off_policy_correction(), algo.loss_options()
        self.ref_model: nn.Module | None = None
        self.critic: MegatronCritic | None = None
        if self.algo.needs_critic:
            from async_rl.data.builtin import resolve

            critic_path = resolve(cfg.critic.model_path) if cfg.critic.model_path else model_path
            self.critic = MegatronCritic(cfg.critic, lambda p: self._build(p, untied=True), critic_path,
                                         self._make_optimizer, packing=cfg.packing,
                                         sequence_multiple=self._sequence_multiple())
        self.reset_optimizer()

    # ------------------------------------------------------------------ model
    def _build(self, path: str, untied: bool = False) -> nn.Module:
        """This rank's slice of the model in ``path`` (a Hugging Face directory), in eval mode (no
        dropout, as for the FSDP2 learner); ``untied``: separate output weights (the critic's)."""
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(path)
        if untied:
            hf_config.tie_word_embeddings = False
        m = self.cfg.megatron
        tcfg = transformer_config(hf_config, tensor_parallel_size=m.tensor_parallel_size,
                                  pipeline_parallel_size=m.pipeline_parallel_size, device=self.device,
                                  sequence_parallel=self._sequence_parallel(),
                                  moe_token_dispatcher=m.moe_token_dispatcher,
                                  expert_parallel_size=m.expert_parallel_size if is_moe(hf_config) else 1)
        model = build_model(hf_config, tcfg)
        state = load_hf_checkpoint(path)
        if untied and "lm_head.weight" not in state:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]  # unused by a critic's value head
        load_hf_weights(model, hf_config, state)
        return train_routers_only(model.to(self.device).eval())

    def _sequence_parallel(self) -> bool:
        m = self.cfg.megatron
        return m.sequence_parallel and m.tensor_parallel_size > 1 and self.device.type == "cuda"

    def _sequence_multiple(self) -> int:
        """Rows must be a multiple of this many tokens: the tensor-parallel size under sequence
        parallelism (each rank holds a slice of the sequence), else 1."""
        return self.cfg.megatron.tensor_parallel_size if self._sequence_parallel() else 1

    def _forward(self, mb: TrainBatch, with_entropy: bool, model: nn.Module | None = None,
                 temperature: float | None = None, packed: bool | None = None,
                 topk_ids: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (and entropies) ``[b, L-1]`` float32 of a micro-batch's labels, from the
        vocab-parallel logits (``async_rl.learners.megatron.ops``); with ``topk_ids``
        (``[b, L-1, K]`` int64) a third tensor, their log-probs ``[b, L-1, K]`` float32, picked
        from the same logits by the tensor-parallel rank that owns each id, 0 at slots that
        predict no real token of their own row (see ``LearnerCore._forward``). A pipeline stage
        before the last returns stand-ins of the same shapes, tied to its send."""
        mb = mb.to(self.device)
        model = model or self.model
        temp = self.temperature if temperature is None else temperature
        if topk_ids is not None:
            topk_ids = self._check_topk_ids(mb, topk_ids)
        autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if self._precision() == "bf16"
                    and self.device.type == "cuda" else nullcontext())
        packed = self.cfg.packing if packed is None else packed
        with autocast:
            ids, positions, mask, width = model_inputs(mb, packed, self._sequence_multiple())
            # [b, L, V/tp] logits (one row [1, sum L, V/tp] packed)
            with self._megatron_routing(mb, model, packed, ids.shape[1]):
                logits = stage_forward(model, ids, positions, mask)
        if logits.dim() == 0:  # a pipeline stage before the last: its send, standing in for the outputs
            stand_in = logits + torch.zeros(mb.input_ids.shape[0], mb.input_ids.shape[1] - 1, device=self.device)
            if topk_ids is None:
                return stand_in, (stand_in if with_entropy else None)
            # Tied to the same send: a loss on any of them brings the next stage's gradient in.
            return stand_in, (stand_in if with_entropy else None), stand_in.unsqueeze(-1).expand(*topk_ids.shape)
        picks = None
        if topk_ids is not None:
            picks = pack_labels(topk_ids, mb.attention_mask) if packed else topk_ids  # [b, width-1, K]
        out = vocab_parallel_logprobs(logits[:, : width - 1], ids[:, 1:width], temp, self.vocab_size,
                                      with_entropy, topk_ids=picks)
        logprobs, entropy = out[0], out[1]
        if packed:
            logprobs = unpack_labels(logprobs, mb.attention_mask)
            entropy = unpack_labels(entropy, mb.attention_mask) if with_entropy else None
        if topk_ids is None:
            return logprobs, entropy
        if packed:
            return logprobs, entropy, unpack_labels(out[2], mb.attention_mask)
        real = mb.attention_mask[:, 1:].bool().unsqueeze(-1)
        return logprobs, entropy, torch.where(real, out[2], torch.zeros((), dtype=out[2].dtype, device=out[2].device))

    def _megatron_routing(self, mb: TrainBatch, model: nn.Module, packed: bool, width: int):
        """The routing context of one forward pass (``routing.routing_replay``): the micro-batch's
        recorded routing (``routed_experts`` extra, ``[b, L, layers, k]``) in the layout of the
        forward's ids (packed: the real tokens in one row), padded with -1 (the router's own
        choice) to ``width`` tokens, replayed under ``algorithm.routing_replay``; for the policy,
        the step's router statistics as ``LearnerCore._routing`` takes them for FSDP2 (no
        auxiliary losses: those are megatron-core's own, off)."""
        if not self._moe_routers:
            return nullcontext()
        routed = mb.extras.get("routed_experts")
        real = mb.attention_mask.bool()
        if packed:
            real = real[real].unsqueeze(0)
            routed = None if routed is None else routed[mb.attention_mask.bool()].unsqueeze(0)
        extra = width - real.shape[1]
        if extra:
            real = torch.cat([real, real.new_zeros(real.shape[0], extra)], dim=1)
            if routed is not None:
                routed = torch.cat([routed, routed.new_full((routed.shape[0], extra, *routed.shape[2:]), -1)], dim=1)
        stats = None
        if model is self.model:
            stats = self._router_stats_of(model, "train" if torch.is_grad_enabled() else "no_grad")
        return routing_replay(model, routed, replay=self.algo.routing_replay, stats=stats, real=real)

    # ------------------------------------------------------------------ backend hooks
    def _data_parallel(self) -> tuple[int, int, object]:
        from megatron.core import parallel_state as ps

        return (ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), ps.get_data_parallel_group())

    def _grad_scale(self) -> float:
        return 1.0  # model_parallel_step sums the replicas' gradients

    def _step_optimizer(self, with_schedule: bool = True) -> torch.Tensor:
        return model_parallel_step(self.model, self.optimizer, self.scheduler if with_schedule else None,
                                   self.cfg.grad_clip)

    def _reports_outputs(self) -> bool:
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.is_pipeline_last_stage()

    # ------------------------------------------------------------------ RL start
    @collective
    def begin_rl(self) -> None:
        """Freeze the RL starting point (see ``Learner.begin_rl``): fresh AdamW, the reference
        policy as a frozen copy of the current slices, the critic's backbone from the policy."""
        self.reset_optimizer()
        if self.algo.needs_reference:
            if self.ref_model is None:
                self.ref_model = self._build(self.model_path)
            self.ref_model.load_state_dict(self.model.state_dict())
            self.ref_model.eval().requires_grad_(False)
        if self.critic is not None and self.cfg.critic.model_path is None:
            self.critic.load_backbone(self.model)

    # ------------------------------------------------------------------ weights out
    @collective
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters by Hugging Face name (a tied head once), gathered from the tensor-parallel
        slices one tensor at a time; every rank iterates it to the end."""
        yield from named_hf_weights(self.model, self.hf_config)

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(Hugging Face name, dtype, full shape)`` of what ``named_weights`` yields, in order."""
        return hf_weight_metadata(self.hf_config, torch.float32)

    def weight_aliases(self) -> dict[str, str]:
        """``{"lm_head.weight": "model.embed_tokens.weight"}`` for tied embeddings, else ``{}``."""
        if getattr(self.hf_config, "tie_word_embeddings", False):
            return {"lm_head.weight": "model.embed_tokens.weight"}
        return {}

    @collective(local=("tokenizer",))
    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the policy as a Hugging Face safetensors directory (rank 0 writes; every rank
        gathers)."""
        from transformers import AutoModelForCausalLM

        state = {}
        for name, tensor in self.named_weights():
            state[name] = tensor.cpu() if dist.get_rank() == 0 else None
        if dist.get_rank() != 0:
            return
        model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        # Experts leave under their per-expert checkpoint names; transformers' model holds them fused.
        missing, unexpected = model.load_state_dict(fuse_expert_weights(state, self.hf_config), strict=False)
        missing = [k for k in missing if k not in self.weight_aliases()]
        if missing or unexpected:
            raise ValueError(f"export_hf: weights do not fit {type(model).__name__}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        if self.weight_aliases():
            model.tie_weights()
        save_hf_model(model, out_dir, tokenizer)

    # ------------------------------------------------------------------ checkpoints
    def _sharded_parts(self) -> tuple[dict, dict]:
        models, optimizers = {"policy": self.model}, {"policy": self.optimizer}
        if self.critic is not None:
            models["critic"], optimizers["critic"] = self.critic.model, self.critic.optimizer
        if self.ref_model is not None:
            models["reference"] = self.ref_model
        return models, optimizers

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write the whole training state under directory ``path`` (every rank): a megatron-core
        distributed checkpoint of the policy, the critic and the reference policy with their AdamW
        state (each rank writes its slices), plus ``learner_state.msgpack`` (rank 0: version, LR
        schedules, parallel layout; ``checkpoint_format``, nothing pickled). ``load_checkpoint``
        reads it at any tensor-parallel size."""
        from async_rl.learners.megatron.checkpoint import save_sharded

        models, optimizers = self._sharded_parts()
        os.makedirs(path, exist_ok=True)
        save_sharded(path, models, optimizers)
        if dist.get_rank() == 0:
            meta = {"version": self.version, "scheduler": self.scheduler.state_dict(),
                    "critic_scheduler": self.critic.scheduler.state_dict() if self.critic is not None else None,
                    "has_ref": self.ref_model is not None, "backend": "megatron",
                    "tensor_parallel_size": self.cfg.megatron.tensor_parallel_size,
                    "expert_parallel_size": self.cfg.megatron.expert_parallel_size}
            save_state(path, LEARNER_STATE, meta)
        dist.barrier()

    @collective
    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (instead of ``begin_rl``).

        Raises:
            FileNotFoundError: ``path`` holds no learner checkpoint.
            ValueError: a checkpoint of the FSDP2 learner, or one whose critic, reference policy or
                weights do not fit this run; a format-1 checkpoint (``learner_state.pt``, refused
                in one line).
        """
        from async_rl.learners.megatron.checkpoint import load_sharded

        meta = load_learner_state(path)
        if meta.get("backend") != "megatron":
            raise ValueError(f"{path}: a learner.backend=fsdp2 checkpoint; resume it with learner.backend=fsdp2 "
                             "(or start the Megatron run from its exported Hugging Face weights)")
        if (meta["critic_scheduler"] is not None) != (self.critic is not None):
            raise ValueError(f"{path}: the checkpoint {'has' if meta['critic_scheduler'] is not None else 'has no'} "
                             f"critic but this run's algorithm {'needs' if self.critic is not None else 'does not use'} one")
        if self.algo.needs_reference and not meta["has_ref"]:
            raise ValueError(f"{path}: the checkpoint has no reference policy but this run's KL term needs one")
        if meta["has_ref"] and self.ref_model is None:
            self.ref_model = self._build(self.model_path).requires_grad_(False)
        models, optimizers = self._sharded_parts()
        load_sharded(path, models, optimizers)
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        self.scheduler.load_state_dict(meta["scheduler"])
        if self.critic is not None:
            self.critic.scheduler.load_state_dict(meta["critic_scheduler"])
        self.version = int(meta["version"])


__all__ = ["MegatronLearner"]
