"""FSDP2 learner: a Hugging Face causal LM sharded with ``torch.distributed.fsdp.fully_shard``.

Each decoder layer (the classes in the model's ``_no_split_modules``) is sharded, then the root,
over a 1-D device mesh on the default process group (gloo on CPU). With world size 1 the group
is created in-process from a ``HashStore``, so a laptop run needs no launcher or free port. Every
rank is a data-parallel rank; FSDP2 averages gradients over them. One fp32 rank trains the plain
module, unwrapped (``FSDPLearner._wraps_with_fsdp``: the same update without DTensor overhead).

The training step itself (mini-batches, micro-batches, global normalisers, losses, metrics) is
``async_rl.learners.core.LearnerCore``'s, shared with the Megatron learner.
"""

from __future__ import annotations

import logging
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
from async_rl.buffers.trajectory import TrainBatch
from async_rl.utils.checkpoint_format import LEARNER_STATE, dcp_reader_and_planner, load_learner_state, save_state
from async_rl.learners.base import (LearnerConfig, clip_and_step, copy_matching_parameters, save_hf_model)
from async_rl.learners.capabilities import LearnerCapabilities
from async_rl.learners.batching import (SharedPrefixPack, pack_labels, pack_rows, scatter_slots, share_prefix_rows,
                                       unpack_labels)
from async_rl.learners.core import LearnerCore
from async_rl.learners import batching, lora, vision
from async_rl.utils.vision import input_only_token_ids, suppress_input_only, zero_input_only_labels
from async_rl.utils.lora import wrap as wrap_with_lora
from async_rl.learners.critic import FSDPCritic
from async_rl.learners.spmd import collective

logger = logging.getLogger(__name__)


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: without the ``._checkpoint_wrapped_module`` level that
    activation checkpointing inserts (state dicts drop it too, so engines and checkpoints see
    the same names with and without it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return name.replace(_CHECKPOINT_PREFIX, "")  # "layers.0._checkpoint_wrapped_module.mlp" -> "layers.0.mlp"


def reshard_root(module: torch.nn.Module) -> None:
    """Reshard an FSDP2 root after a no-grad forward pass.

    FSDP2 keeps the root unit's parameters (embeddings, final norm, tied head) unsharded after
    forward, for the backward that normally follows. After a no-grad pass no backward comes: the
    full parameters would stay allocated on every rank, and ``module.parameters()`` would return
    the unsharded tensors, so an optimizer built then would step copies that the model never
    reads (measured: embeddings and final norm frozen; regression test in
    ``tests/test_learner_options.py``).
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        module.reshard()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find decoder layers to shard")
    return layers



class FSDPLearner(LearnerCore):
    """Policy learner on FSDP2.

    Args:
        cfg: learner settings.
        algo: algorithm settings (policy loss, clipping, aggregation, KL, entropy), presets
            already applied (``load_config`` does it; else ``AlgorithmConfig.apply_preset()``).
        model_path: Hugging Face model directory to start from.
        temperature: the generator's sampling temperature; learner log-probs and entropy are
            computed from ``logits / temperature`` so they match the behavior log-probs.
        total_optimizer_steps: for the LR schedule.

    Raises:
        ValueError: ``algo`` is not resolved (a preset field still None), the model declares no
            decoder layers to shard, or the critic's backbone does not match the policy's weights.
    """

    capabilities = LearnerCapabilities(name="FSDP2", lora=True, cpu_offload=True, hf_attention=True,
                                       moe_aux_losses=True, vision_language=True)
    """Every rank data parallel over the Hugging Face model; adapters and CPU offload supported."""
    _share_prefix = False
    """``learner.shared_prefix`` in force (set at start by ``_check_shared_prefix``)."""

    shard_one_rank: bool = False
    """Wrap with FSDP2 on one fp32 rank too (the learner's update is the same either way; tests
    set it to compare the two)."""

    def __init__(self, cfg: LearnerConfig, algo: AlgorithmConfig, model_path: str, temperature: float,
                 total_optimizer_steps: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self._setup(cfg, algo, model_path, temperature, total_optimizer_steps)
        torch.manual_seed(cfg.rng_seed)
        # fully_shard moves each module's parameters and buffers to the mesh's device.
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.model = self._load_policy(model_path)
        self._vision = self._vision_inputs(self.model)
        suppressed = input_only_token_ids(self.model.config)
        # Scored with probability 0, as every engine samples them (utils.vision.input_only_token_ids).
        self._input_only = torch.tensor(suppressed, dtype=torch.long, device=self.device) if suppressed else None
        self._layout = None  # CheckpointLayout of self.model, on the first weight push
        self._init_router_stats(self.model)
        if cfg.packing:
            self._check_packing()
        self._share_prefix = cfg.shared_prefix and self._check_shared_prefix()
        self.policy_loss = algo.policy_loss_fn
        self.correction, self.loss_options = algo.off_policy_correction(), algo.loss_options()
        self.ref_model: torch.nn.Module | None = None
        self.critic: FSDPCritic | None = None
        if self.algo.needs_critic:
            from async_rl.data.builtin import resolve

            if self._vision is not None:
                raise ValueError(f"algorithm.name={self.algo.name} trains a critic, which does not take images yet: "
                                 "use a critic-free algorithm (grpo, rloo, ...) with a vision-language policy")

            critic_path = resolve(cfg.critic.model_path) if cfg.critic.model_path else model_path
            self.critic = FSDPCritic(cfg.critic, critic_path, self._shard, self._make_optimizer, packing=cfg.packing)
        self.reset_optimizer()

    def _wraps_with_fsdp(self) -> bool:
        """Whether ``_shard`` wraps modules with FSDP2: on more than one rank, or for what only its
        policies give (``bf16`` mixed precision, CPU offload), or when ``shard_one_rank`` asks.

        On one fp32 rank FSDP2 computes the same update as the plain module (its all-gather is a
        copy of the one shard and its reduce-scatter averages over one rank), but every parameter
        becomes a DTensor: each optimizer and clipping op goes through DTensor dispatch and each
        forward and backward through FSDP2's pre/post hooks (measured on the default job: AdamW
        ~42 ms per optimizer step with DTensors; regression test in
        ``tests/test_learner_options.py``)."""
        return (self.shard_one_rank or dist.get_world_size() > 1 or self._precision() != "fp32"
                or self.cfg.cpu_offload)

    def _shard(self, module: torch.nn.Module, layers_of: torch.nn.Module | None = None) -> None:
        """Wrap ``module`` (its decoder layers, then the root) with FSDP2, or on one fp32 rank only
        move it to the device (``_wraps_with_fsdp``); activation checkpointing either way.

        Raises:
            ValueError: ``learner.cpu_offload`` on a CPU learner.
        """
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        layers = _decoder_layers(layers_of or module)
        if self.cfg.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            # Non-reentrant checkpointing of each decoder layer, applied before sharding so
            # FSDP2's all-gather hooks run again in the recomputed forward.
            ids = {id(layer) for layer in layers}
            apply_activation_checkpointing(module, check_fn=lambda m: id(m) in ids)
            layers = _decoder_layers(layers_of or module)
        if not self._wraps_with_fsdp():
            module.to(self.device)
            return
        if self._precision() == "bf16":
            # Layers hand bf16 activations to each other; only the root's output (logits, values)
            # is cast back to float32 for the log-softmax and the loss.
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               output_dtype=torch.float32)
        else:
            policy = root_policy = MixedPrecisionPolicy()
        if self.cfg.cpu_offload and self.mesh.device_type == "cpu":
            raise ValueError("learner.cpu_offload=true needs a CUDA learner: on CPU the parameters, gradients "
                             "and optimizer state already live in host memory")
        offload = CPUOffloadPolicy() if self.cfg.cpu_offload else OffloadPolicy()
        for layer in layers:
            fully_shard(layer, mesh=self.mesh, mp_policy=policy, offload_policy=offload)
        fully_shard(module, mesh=self.mesh, mp_policy=root_policy, offload_policy=offload)

    def _step_optimizer(self, with_schedule: bool = True) -> torch.Tensor:
        """FSDP2 has reduced (averaged) the gradients in backward: clip and step."""
        return clip_and_step(self.model.parameters(), self.optimizer, self.scheduler if with_schedule else None,
                             self.cfg.grad_clip)

    def _release(self, module: torch.nn.Module) -> None:
        reshard_root(module)

    def _scored_module(self, model: torch.nn.Module | None) -> torch.nn.Module:
        # A LoRA reference (adapters off) runs the policy's own sharded root.
        return model.model if isinstance(model, lora.AdapterDisabled) else (model or self.model)

    def _load_policy(self, path: str, with_lora: bool = True) -> torch.nn.Module:
        """The policy (or a plain copy of it, ``with_lora=False``) of ``path``, float32, in eval
        mode, sharded: a causal LM, or a vision-language model (``AutoModelForImageTextToText``,
        its vision blocks sharded like the decoder layers) with its vision tower frozen under
        ``learner.freeze_vision``.

        Raises:
            ValueError: LoRA target modules that match the vision tower.
        """
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        extra = {} if self.cfg.attn_implementation == "auto" else {"attn_implementation": self.cfg.attn_implementation}
        is_vl = vision.is_vision_language(AutoConfig.from_pretrained(path))
        auto = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
        model = auto.from_pretrained(path, dtype=torch.float32, **extra)
        model.config.use_cache = False
        if is_vl:
            # The text model reads its own config's use_cache: without it a KV cache would be
            # built, and transformers then stops cutting packed rows into their sequences.
            model.config.get_text_config().use_cache = False
            if self.cfg.freeze_vision:
                vision.vision_tower(model).requires_grad_(False)
            if with_lora and self.cfg.lora.rank > 0:
                vision.check_lora_targets(model, self.cfg.lora.target_modules)
        if with_lora and self.cfg.lora.rank > 0:
            # Before sharding, so each decoder layer's FSDP unit holds its adapters too.
            model = wrap_with_lora(model, self.cfg.lora)
        self._shard(model)
        # Eval mode = no dropout (gradients still flow): the generator samples without dropout, so
        # dropout in the learner would make proximal and training log-probs noisy and the PPO ratio
        # != 1 on-policy (GPT-2 configs ship 0.1 dropout; regression test in test_learner_algorithms).
        return model.eval()

    @staticmethod
    def _vision_inputs(model: torch.nn.Module) -> tuple[int, object] | None:
        """``(image token id, the model's get_rope_index)`` of a vision-language policy, else None."""
        config = model.config
        if not vision.is_vision_language(config):
            return None
        return int(config.image_token_id), vision.rope_index_fn(model)

    def _model_inputs(self, mb: TrainBatch, packed: bool) -> dict[str, torch.Tensor]:
        """The forward call's tensors for micro-batch ``mb``: ``input_ids`` ``[b, L]`` (or ``[1, N]``
        packed: ``pack_rows``), ``position_ids`` and, padded, ``attention_mask``; for a
        vision-language policy its images and multimodal positions (``async_rl.learners.vision``)."""
        if self._vision is not None:
            token_id, rope_index = self._vision
            return vision.forward_kwargs(rope_index, token_id, mb.input_ids, mb.attention_mask,
                                         mb.position_ids, mb.extras, packed)
        if packed:
            ids, positions = pack_rows(mb.input_ids, mb.attention_mask, mb.position_ids)
            return {"input_ids": ids, "position_ids": positions}
        return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids}

    @collective
    def begin_rl(self) -> None:
        """Freeze the RL starting point: call once, after any warm start and before step 1.

        Resets the policy optimizer; snapshots the current policy as the frozen reference when a
        KL term is on (the KL then anchors to the policy RL started from, as in verl and
        OpenRLHF); and, when the critic has no ``model_path`` of its own, starts its backbone from
        the current policy.
        """
        self.reset_optimizer()
        if self.algo.needs_reference and self.cfg.lora.rank > 0:
            # The base model with adapters off while they are untrained, else a merged copy.
            self.ref_model = lora.reference_policy(self.model, self.ref_model,
                                                   lambda: self._load_policy(self.model_path, with_lora=False))
        elif self.algo.needs_reference:
            if self.ref_model is None:
                self.ref_model = self._load_policy(self.model_path)
            copy_matching_parameters(self.model.named_parameters(), self.ref_model)
            self.ref_model.eval().requires_grad_(False)
        if self.critic is not None and self.cfg.critic.model_path is None:
            self.critic.load_backbone(lora.merged_named_weights(self.model).items() if self.cfg.lora.rank > 0
                                      else self.model.named_parameters())

    # ------------------------------------------------------------------ forward passes
    def _forward(self, mb: TrainBatch, with_entropy: bool, model: torch.nn.Module | None = None,
                 temperature: float | None = None, packed: bool | None = None,
                 topk_ids: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (and entropies) ``[b, L-1]`` float32 of a micro-batch's labels; with
        ``learner.packing`` from one padding-free packed row (``async_rl.learners.batching.pack_rows``),
        unpacked to the same layout (0 where a slot predicts no real token); with
        ``learner.shared_prefix`` (and ``packed`` not given) each group's common prefix runs once
        (``_shared_prefix_forward``) where that fills at most ``SHARED_PREFIX_MAX_FILL`` of the
        padded slots, else the configured layout.

        With ``topk_ids`` (``[b, L-1, K]`` int64 in ``[0, V)``, label layout) a third output
        ``[b, L-1, K]`` float32: ``log_softmax(logits / temperature)`` at those ids, from the same
        forward pass and the same logsumexp as the log-probs (no further ``[.., V]`` tensor),
        differentiable, 0 at slots that predict no real token of their own row (both layouts;
        the ids there are not read). See ``LearnerCore._forward``."""
        mb = mb.to(self.device)
        model = model or self.model
        temp = self.temperature if temperature is None else temperature
        if topk_ids is not None:
            topk_ids = self._check_topk_ids(mb, topk_ids)
        if self._share_prefix and packed is None:
            pack = share_prefix_rows(mb.input_ids, mb.attention_mask, mb.position_ids, mb.group_ids,
                                     row_tokens=batching.SHARED_PREFIX_ROW_TOKENS)
            # Too little shared (distinct prompts, as a warm start's rows) and the packed rows'
            # padding and masked attention would cost more than the padding they save: the
            # configured layout instead.
            if pack.input_ids.numel() <= SHARED_PREFIX_MAX_FILL * mb.input_ids.numel():
                return self._shared_prefix_forward(mb, pack, with_entropy, model, temp, topk_ids)
        packed = self.cfg.packing if packed is None else packed
        inputs = self._model_inputs(mb, packed)
        if packed:
            ids = inputs["input_ids"]
            with self._routing(mb, model, packed):
                logits = suppress_input_only(model(**inputs, use_cache=False).logits[:, :-1], self._input_only)
            if topk_ids is None:
                logprobs = logprobs_from_logits(logits, ids[:, 1:], temp)
            else:
                logprobs, topk = _logprobs_and_topk(logits, ids[:, 1:], pack_labels(topk_ids, mb.attention_mask),
                                                    temp)
            logprobs = unpack_labels(zero_input_only_labels(logprobs, ids[:, 1:], self._input_only), mb.attention_mask)
            entropy = (unpack_labels(entropy_from_logits(logits, temp), mb.attention_mask)
                       if with_entropy else None)
            if topk_ids is None:
                return logprobs, entropy
            return logprobs, entropy, unpack_labels(topk, mb.attention_mask)
        with self._routing(mb, model, packed):
            logits = suppress_input_only(model(**inputs, use_cache=False).logits[:, :-1], self._input_only)
        labels = mb.input_ids[:, 1:]
        entropy = entropy_from_logits(logits, temp) if with_entropy else None
        if topk_ids is None:
            return zero_input_only_labels(logprobs_from_logits(logits, labels, temp), labels, self._input_only), entropy
        logprobs, topk = _logprobs_and_topk(logits, labels, topk_ids, temp)
        logprobs = zero_input_only_labels(logprobs, labels, self._input_only)
        real = mb.attention_mask[:, 1:].bool().unsqueeze(-1)
        return logprobs, entropy, torch.where(real, topk, torch.zeros((), dtype=topk.dtype, device=topk.device))

    def _shared_prefix_forward(self, mb: TrainBatch, pack: SharedPrefixPack, with_entropy: bool,
                               model: torch.nn.Module, temp: float, topk_ids: torch.Tensor | None):
        """``_forward`` on ``pack``, micro-batch ``mb`` with each group's common prefix run once
        (``learner.shared_prefix``; ``async_rl.learners.batching.share_prefix_rows``): the same
        outputs in the same ``[b, L-1]`` layout, 0 where a slot predicts no real token. The
        label-dependent values are read at each slot's predicting position (``[S, V]`` logits
        gathered, as many as unshared packing has)."""
        logits = model(input_ids=pack.input_ids, position_ids=pack.position_ids,
                       attention_mask=self._attention_mask(pack.attend), use_cache=False).logits.flatten(0, 1)
        logits = suppress_input_only(logits, self._input_only)
        # index_select, not logits[positions]: the prefix's positions are read by every row of
        # its group, and the backward of advanced indexing adds those duplicates on several
        # threads in a racing order (runs of one seed then differ by rounding); index_select's
        # backward adds them in a fixed order.
        slot_logits = logits.index_select(0, pack.slot_positions).unsqueeze(0)  # [1, S, V]
        labels = mb.input_ids[:, 1:][pack.slot_mask].unsqueeze(0)  # [1, S]
        if topk_ids is None:
            logprobs = logprobs_from_logits(slot_logits, labels, temp)
        else:
            logprobs, topk = _logprobs_and_topk(slot_logits, labels, topk_ids[pack.slot_mask].unsqueeze(0), temp)
        logprobs = scatter_slots(zero_input_only_labels(logprobs, labels, self._input_only)[0], pack.slot_mask)
        entropy = (scatter_slots(entropy_from_logits(logits, temp).index_select(0, pack.slot_positions), pack.slot_mask)
                   if with_entropy else None)
        if topk_ids is None:
            return logprobs, entropy
        return logprobs, entropy, scatter_slots(topk[0], pack.slot_mask)

    def _attention_mask(self, attend: torch.Tensor) -> torch.Tensor:
        """The ``[R, 1, W, W]`` custom mask as the policy's attention takes it: boolean for sdpa
        (True = attend), additive in the compute dtype for eager (0, or the dtype's lowest value;
        bfloat16 under ``mixed_precision: bf16``, whose parameters stay float32)."""
        # The policy's config and dtype: a reference model is loaded alike, and LoRA's reference
        # (the policy with its adapters off) is a wrapper without a config of its own.
        if getattr(self.model.config, "_attn_implementation", "sdpa") != "eager":
            return attend
        dtype = torch.bfloat16 if self._precision() == "bf16" else next(self.model.parameters()).dtype
        return torch.zeros(attend.shape, dtype=dtype, device=attend.device).masked_fill(~attend, torch.finfo(dtype).min)

    @torch.no_grad()
    def _check_shared_prefix(self) -> bool:
        """Whether ``learner.shared_prefix`` can serve this policy: a dense text policy whose
        attention follows a custom mask (two rows of one group that share a prompt must score
        the same shared as padded). Otherwise one warning line says why it is off."""
        from async_rl.buffers.trajectory import position_ids_from_mask

        impl = getattr(self.model.config, "_attn_implementation", "?")
        why = None
        if self._vision is not None or self._moe_routers:
            why = f"a {'vision-language' if self._vision is not None else 'mixture-of-experts'} policy"
        elif impl not in ("sdpa", "eager"):
            why = f"{impl} attention takes no custom mask (sdpa or eager do)"
        else:
            ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18], [11, 12, 13, 24, 25, 26, 0, 0],
                                [31, 32, 0, 0, 0, 0, 0, 0]])
            mask = (ids != 0).long()
            probe = TrainBatch(ids, mask, position_ids_from_mask(mask), *(torch.zeros(3, 7),) * 3,
                               torch.zeros(3), torch.tensor([5, 5, 6]))
            pack = share_prefix_rows(probe.input_ids, probe.attention_mask, probe.position_ids, probe.group_ids)
            shared = self._shared_prefix_forward(probe, pack, False, self.model, self.temperature, None)[0]
            padded = self._forward(probe, with_entropy=False, packed=False)[0]
            reshard_root(self.model)
            gap = float((shared - padded)[mask[:, 1:].bool()].abs().max())
            if gap > (5e-2 if self._precision() == "bf16" else 1e-3):
                why = f"this model's {impl} attention does not follow a custom mask (log-probs differ by {gap:.3g})"
        if why is not None:
            logger.warning("learner.shared_prefix=true is off: %s; each row runs its whole prompt", why)
        return why is None

    @torch.no_grad()
    def _check_packing(self) -> None:
        """Refuse ``learner.packing`` for a model whose attention ignores packed position ids
        (it would let each sequence attend to the ones packed before it): two short sequences
        must score the same packed as padded.

        Raises:
            ValueError: the packed log-probs differ (names the attention implementation).
        """
        from async_rl.buffers.trajectory import position_ids_from_mask

        ids = torch.tensor([[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 0, 0]])
        mask = (ids != 0).long()
        probe = TrainBatch(ids, mask, position_ids_from_mask(mask), *(torch.zeros(2, 7),) * 3,
                           torch.zeros(2), torch.zeros(2, dtype=torch.long))
        packed = self._forward(probe, with_entropy=False, packed=True)[0]
        padded = self._forward(probe, with_entropy=False, packed=False)[0]
        reshard_root(self.model)
        valid = mask[:, 1:].bool()
        gap = float((packed - padded)[valid].abs().max())
        # The two layouts differ by rounding only (~1e-6 in float32, ~1e-2 in bf16); attending
        # across the boundary moves the second sequence's log-probs by ~0.1 to several nats.
        if gap > (5e-2 if self._precision() == "bf16" else 1e-3):
            impl = getattr(self.model.config, "_attn_implementation", "?")
            raise ValueError(f"learner.packing=true: this model's attention ({impl}) does not separate packed "
                             f"sequences by position ids (log-probs differ by {gap:.3g}); use "
                             f"learner.packing=false or learner.attn_implementation=sdpa|flash_attention_2")

    # ------------------------------------------------------------------ weights out
    @collective
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters by Hugging Face checkpoint name (tied ones once), gathered from the
        shards: a parameter transformers holds in another layout than its checkpoint (stacked
        experts) goes as its checkpoint tensors (``async_rl.weight_sync.layout``); with LoRA only
        the adapter matrices, under peft's adapter-file names (``async_rl.learners.lora``)."""
        if self.cfg.lora.rank > 0:
            for name, tensor in lora.adapter_named_weights(self.model):
                yield hf_name(name), tensor
            return
        layout = self._checkpoint_layout()
        for name, param in self.model.named_parameters():
            data = param.detach()
            yield from layout.split(hf_name(name), data.full_tensor() if isinstance(data, DTensor) else data)

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what ``named_weights`` yields, in order, without
        gathering (a DTensor's shape is the global one)."""
        if self.cfg.lora.rank > 0:
            return [(hf_name(n), d, s) for n, d, s in lora.adapter_metadata(self.model)]
        layout = self._checkpoint_layout()
        return [meta for n, p in self.model.named_parameters()
                for meta in layout.split_metadata(hf_name(n), p.dtype, tuple(p.shape))]

    def _checkpoint_layout(self):
        # Built on first use: a weight update carries checkpoint names (one tensor per expert of a
        # mixture-of-experts layer, where transformers stacks them in one parameter).
        if self._layout is None:
            from async_rl.weight_sync.layout import CheckpointLayout

            self._layout = CheckpointLayout(self.model, [(hf_name(n), tuple(p.shape))
                                                         for n, p in self.model.named_parameters()])
        return self._layout

    def weight_aliases(self) -> dict[str, str]:
        """``{tied name: name sent}`` for parameters ``named_weights`` yields once under another
        name (tied embeddings: ``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
        from async_rl.weight_sync import tied_aliases

        if self.cfg.lora.rank > 0:
            return {}
        # Both sides under their checkpoint names (a vision-language model's tied embedding is
        # model.language_model.embed_tokens in memory, model.embed_tokens on disk and on the wire).
        layout = self._checkpoint_layout()
        return {layout.checkpoint_names(hf_name(k))[0]: layout.checkpoint_names(hf_name(v))[0]
                for k, v in tied_aliases(self.model).items()}

    @collective(local=("tokenizer",))
    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the current policy as a Hugging Face directory (safetensors) to ``out_dir``; with
        LoRA a plain model with the adapters merged in, plus the adapter under ``out_dir/adapter``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.cfg.lora.rank > 0:
            lora.export_merged(self.model, self.cfg.lora, out_dir, tokenizer, self.model_path)
            return
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            save_hf_model(self.model, out_dir, tokenizer, state_dict=state)

    # ------------------------------------------------------------------ checkpoints
    def _checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.critic is not None:
            state["critic_model"], state["critic_optim"] = get_state_dict(self.critic.model, self.critic.optimizer)
        if isinstance(self.ref_model, torch.nn.Module):  # a LoRA AdapterDisabled reference has no state of its own
            state["ref_model"] = get_model_state_dict(self.ref_model)
        return state

    @collective
    def save_checkpoint(self, path: str) -> None:
        """Write the learner's whole training state under directory ``path`` (every rank).

        Sharded with ``torch.distributed.checkpoint`` (each rank writes its own shards, no
        gather): policy weights and AdamW state, the critic's weights and optimizer state, the
        frozen reference policy; plus ``learner_state.msgpack`` (rank 0; ``checkpoint_format``,
        nothing pickled) with the policy version and the LR schedulers' positions.
        ``load_checkpoint`` restores it on any world size.
        """
        import torch.distributed.checkpoint as dcp

        dcp.save(self._checkpoint_state(), checkpoint_id=path)
        if dist.get_rank() == 0:
            meta = {"version": self.version, "scheduler": self.scheduler.state_dict(),
                    "critic_scheduler": self.critic.scheduler.state_dict() if self.critic is not None else None,
                    "has_ref": self.ref_model is not None,
                    "ref_adapters_off": isinstance(self.ref_model, lora.AdapterDisabled)}
            save_state(path, LEARNER_STATE, meta)
        dist.barrier()

    @collective
    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (instead of ``begin_rl``: the reference policy,
        optimizer and schedules come from the checkpoint).

        Nothing is unpickled as code: the DCP index and non-tensor entries are read with
        ``checkpoint_format.dcp_reader_and_planner``.

        Raises:
            FileNotFoundError: ``path`` holds no learner checkpoint.
            ValueError: the checkpoint's contents do not fit this learner (a critic or reference
                policy on one side only; parameter names or shapes differ); a format-1 checkpoint
                (``learner_state.pt``, refused in one line) or an index naming code.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        meta = load_learner_state(path)
        if (meta["critic_scheduler"] is not None) != (self.critic is not None):
            raise ValueError(f"{path}: the checkpoint {'has' if meta['critic_scheduler'] is not None else 'has no'} "
                             "critic but this run's algorithm "
                             f"{'needs' if self.critic is not None else 'does not use'} one")
        if self.algo.needs_reference and not meta["has_ref"]:
            raise ValueError(f"{path}: the checkpoint has no reference policy but this run's KL term needs one")
        if meta.get("ref_adapters_off"):
            self.ref_model = lora.AdapterDisabled(self.model)
        elif meta["has_ref"] and not isinstance(self.ref_model, torch.nn.Module):
            self.ref_model = self._load_policy(self.model_path, with_lora=False).requires_grad_(False)
        state = self._checkpoint_state()
        if not meta["has_ref"]:
            state.pop("ref_model", None)
        try:
            reader, planner = dcp_reader_and_planner(path)
            dcp.load(state, storage_reader=reader, planner=planner)
        except Exception as e:  # DCP reports missing keys / size mismatches as CheckpointException
            raise ValueError(f"{path}: the learner checkpoint does not fit this model: {e}") from e
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if self.critic is not None:
            set_state_dict(self.critic.model, self.critic.optimizer, model_state_dict=state["critic_model"],
                           optim_state_dict=state["critic_optim"])
            self.critic.scheduler.load_state_dict(meta["critic_scheduler"])
        if "ref_model" in state:
            set_model_state_dict(self.ref_model, state["ref_model"])
            self.ref_model.eval().requires_grad_(False)
        self.scheduler.load_state_dict(meta["scheduler"])
        self.version = int(meta["version"])


SHARED_PREFIX_MAX_FILL = 0.75
"""``learner.shared_prefix`` runs a micro-batch shared only when its packed rows' ``R * W`` slots
are at most this fraction of the padded micro-batch's ``B * L``; otherwise the configured layout
(padded, or ``learner.packing``). Measured on CPU with sdpa when a micro-batch packed into one
dense-masked row: a row of 0.87 of the padded slots (no prompt shared) took 1.9x the padded
pass's time, one of 0.34 (whole groups) 0.52x."""


def _logprobs_and_topk(logits: torch.Tensor, labels: torch.Tensor, topk_ids: torch.Tensor, temperature: float,
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``labels`` ``[..., T]`` and of ``topk_ids`` ``[..., T, K]`` under
    ``softmax(logits / temperature)`` (``logits`` ``[..., T, V]``), float32 and differentiable:
    one ``z = float32(logits) / temperature``, one logsumexp, one gather of the ``1 + K`` picked
    logits. The label log-probs are ``logprobs_from_logits``'s to the bit (the same ops)."""
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = logits.float() / temperature
    picked = z.gather(-1, torch.cat([labels.long().unsqueeze(-1), topk_ids.long()], -1))
    picked = picked - torch.logsumexp(z, dim=-1, keepdim=True)
    return picked[..., 0], picked[..., 1:]
