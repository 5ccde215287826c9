"""FSDP2 learner: a Hugging Face causal LM sharded with ``torch.distributed.fsdp.fully_shard``.

Each decoder layer (the classes in the model's ``_no_split_modules``) is sharded, then the root,
over a 1-D device mesh on the default process group (gloo on CPU). With world size 1 the group
is created in-process from a ``HashStore``, so a laptop run needs no launcher or free port.

Before a training step the trainer's loop calls ``prepare`` (``async_rl.batch.make_batch``) (no grad): proximal log-probs with the
current weights (unless the algorithm runs in bypass mode, proximal := behavior), reference
log-probs when a KL term is on, and critic values when the estimator needs them. Advantages are
computed from these (KL-in-reward and GAE need them), then ``train_step``:

1. takes the proximal log-probs from ``prepare`` (or computes them if it was skipped);
2. for each epoch, split the batch into ``num_mini_batches`` mini-batches; for each, count the
   valid tokens and sequences of the whole mini-batch (the global normaliser), run the
   micro-batches with gradient accumulation, clip, and take one optimizer step; the critic, when
   there is one, takes its step on the same mini-batch. A mini-batch without a valid token (on
   every rank) is skipped: no pass, no optimizer and no LR-scheduler step. That happens when a
   batch has fewer sequences than ``num_mini_batches`` (reward rejections at run time; the
   config check refuses it for full batches) or when every token of it is masked (DAPO's
   overlong filter);
3. return metrics reduced once per training step (token-weighted means over micro-batches); the
   step is one policy version whatever its number of optimizer steps.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from async_rl.algorithms.aggregation import aggregate_loss, count_normalizers
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits, masked_mean
from async_rl.algorithms.losses import POLICY_LOSSES, PolicyLossInputs
from async_rl.metrics import reduce_metrics
from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners.base import LearnerConfig, clip_and_step, copy_matching_parameters
from async_rl.learners.batching import micro_batches_by_tokens, pack_rows, split_by_tokens, unpack_labels
from async_rl.learners import lora
from async_rl.lora import wrap as wrap_with_lora
from async_rl.learners.critic import FSDPCritic
from async_rl.learners.spmd import collective

logger = logging.getLogger(__name__)


def hf_name(name: str) -> str:
    """A parameter's Hugging Face name: without the ``._checkpoint_wrapped_module`` level that
    activation checkpointing inserts (state dicts drop it too, so engines and checkpoints see
    the same names with and without it)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

    return name.replace(_CHECKPOINT_PREFIX, "")  # "layers.0._checkpoint_wrapped_module.mlp" -> "layers.0.mlp"


def learner_device(cfg: LearnerConfig) -> torch.device:
    """The learner's device type: ``learner.device``, with ``auto`` = CUDA when available."""
    if cfg.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("learner.device=cuda but torch sees no CUDA device")
    return torch.device(cfg.device)


def process_group_backend(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for the CPU ones (normalisers,
    micro-batch counts, the rank-0 command channel)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_single_process_group(backend: str = "gloo") -> None:
    """Create a world-size-1 default group in-process (no rendezvous) if none exists."""
    if not dist.is_initialized():
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


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


def _token_weighted_across_ranks(local: dict[str, torch.Tensor], per_mb: list[dict], weights: list[float],
                                 skip: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Token-weighted means of per-micro-batch metrics over every rank's micro-batches.

    ``local`` holds this rank's means (``reduce_metrics``); each key's weight is the tokens of
    the micro-batches that report it. Ranks may report different keys (a rank without a real
    micro-batch reports none), so the ``(sum, weight)`` pairs travel with ``all_gather_object``
    (a few dozen floats per step). Keys in ``skip`` (already global, like gradient norms) are
    left out.
    """
    pairs = {}
    for key, mean in local.items():
        if key in skip or mean.dim():
            continue
        w = sum(float(wt) for entry, wt in zip(per_mb, weights) if key in entry)
        pairs[key] = (float(mean) * w if w else 0.0, w)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, pairs)
    total: dict[str, list[float]] = {}
    for rank_pairs in gathered:
        for key, (s, w) in rank_pairs.items():
            acc = total.setdefault(key, [0.0, 0.0])
            acc[0] += s
            acc[1] += w
    return {k: torch.tensor(s / w if w else float("nan")) for k, (s, w) in total.items()}


@dataclass
class _StepAccumulator:
    """What ``FSDPLearner.train_step`` gathers over its micro-batches and optimizer steps."""

    per_mb: list[dict[str, torch.Tensor]] = field(default_factory=list)  # metrics per real micro-batch / step
    weights: list[float] = field(default_factory=list)  # their weights: valid tokens, or 1 for a step's
    pg_losses: list[torch.Tensor] = field(default_factory=list)  # detached 0-dim policy losses
    vf_losses: list[torch.Tensor] = field(default_factory=list)  # detached 0-dim critic losses
    num_steps: int = 0  # optimizer steps taken
    skipped: int = 0  # mini-batches without a valid token


def lr_lambda(cfg: LearnerConfig, total_steps: int):
    """LR multiplier per optimizer step: linear warm-up from 0, then constant/linear/cosine decay.

    Args:
        cfg: learner settings (``warmup_steps``, ``lr_schedule``, ``min_lr_ratio``).
        total_steps: optimizer steps in the run; decay reaches ``min_lr_ratio`` there.
    """

    def fn(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        if cfg.lr_schedule == "linear":
            decay = 1.0 - progress
        else:
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay

    return fn


class FSDPLearner:
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

    def __init__(self, cfg: LearnerConfig, algo: AlgorithmConfig, model_path: str, temperature: float,
                 total_optimizer_steps: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        # The caller resolves presets (load_config, or apply_preset() by hand): one place fills them.
        self.cfg, self.algo, self.temperature = cfg, algo.require_resolved(), temperature
        self.total_optimizer_steps = total_optimizer_steps
        self.model_path = model_path
        # Set by async_rl.learners.spmd.drive_followers on rank 0 of a launched multi-rank learner.
        self._drives_followers, self._command_depth = False, 0
        self.device = learner_device(cfg)
        init_single_process_group(process_group_backend(self.device))
        if self.device.type == "cuda":
            # torchrun sets LOCAL_RANK; a Ray-placed rank sees only its own GPU (index 0).
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.manual_seed(cfg.seed)
        # fully_shard moves each module's parameters and buffers to the mesh's device.
        self.mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        self.model = self._load_policy(model_path)
        if cfg.packing:
            self._check_packing()
        self.policy_loss = POLICY_LOSSES.get(algo.policy_loss)
        self.correction, self.loss_params = algo.off_policy_correction(), algo.loss_params()
        self.ref_model: torch.nn.Module | None = None
        self.critic: FSDPCritic | None = None
        if self.algo.needs_critic:
            from async_rl.data.builtin import resolve

            critic_path = resolve(cfg.critic.model_path) if cfg.critic.model_path else model_path
            self.critic = FSDPCritic(cfg.critic, critic_path, self._shard, self._make_optimizer, packing=cfg.packing)
        self.version = 0
        self._warned_skip = False  # train_step warns once about mini-batches without a valid token
        self.reset_optimizer()

    def _shard(self, module: torch.nn.Module, layers_of: torch.nn.Module | None = None) -> None:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        layers = _decoder_layers(layers_of or module)
        if self.cfg.activation_checkpointing:
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

            # Non-reentrant checkpointing of each decoder layer, applied before sharding so
            # FSDP2's all-gather hooks run again in the recomputed forward.
            ids = {id(layer) for layer in layers}
            apply_activation_checkpointing(module, check_fn=lambda m: id(m) in ids)
            layers = _decoder_layers(layers_of or module)
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

    def _precision(self) -> str:
        if self.cfg.mixed_precision != "auto":
            return self.cfg.mixed_precision
        return "bf16" if self.mesh.device_type == "cuda" else "fp32"

    def _load_policy(self, path: str, with_lora: bool = True) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        extra = {} if self.cfg.attn_implementation == "auto" else {"attn_implementation": self.cfg.attn_implementation}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
        model.config.use_cache = False
        if with_lora and self.cfg.lora.rank > 0:
            # Before sharding, so each decoder layer's FSDP unit holds its adapters too.
            model = wrap_with_lora(model, self.cfg.lora)
        self._shard(model)
        # Eval mode = no dropout (gradients still flow): the generator samples without dropout, so
        # dropout in the learner would make proximal and training log-probs noisy and the PPO ratio
        # != 1 on-policy (GPT-2 configs ship 0.1 dropout; regression test in test_learner_algorithms).
        return model.eval()

    def _make_optimizer(self, params, lr: float):
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps,
                                      weight_decay=self.cfg.weight_decay)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg, self.total_optimizer_steps))

    @collective
    def reset_optimizer(self, lr: float | None = None) -> None:
        """Fresh AdamW and LR schedule (after a supervised warm start, for example)."""
        # Only trainable parameters: with LoRA the frozen base would get no state, but AdamW
        # would still walk it every step.
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = self._make_optimizer(params, lr or self.cfg.lr)

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
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (and entropies) ``[b, L-1]`` float32 of a micro-batch's labels; with
        ``learner.packing`` from one padding-free packed row (``async_rl.learners.batching.pack_rows``),
        unpacked to the same layout (0 where a slot predicts no real token)."""
        mb = mb.to(self.device)
        model = model or self.model
        temp = self.temperature if temperature is None else temperature
        if self.cfg.packing if packed is None else packed:
            ids, positions = pack_rows(mb.input_ids, mb.attention_mask, mb.position_ids)
            logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits[:, :-1]
            logprobs = unpack_labels(logprobs_from_logits(logits, ids[:, 1:], temp), mb.attention_mask)
            entropy = (unpack_labels(entropy_from_logits(logits, temp), mb.attention_mask)
                       if with_entropy else None)
            return logprobs, entropy
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                       position_ids=mb.position_ids, use_cache=False).logits[:, :-1]
        labels = mb.input_ids[:, 1:]
        logprobs = logprobs_from_logits(logits, labels, temp)
        entropy = entropy_from_logits(logits, temp) if with_entropy else None
        return logprobs, entropy

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

    @torch.no_grad()
    @collective
    def compute_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs ``[B, L-1]`` float32 of the batch's labels under the current weights (or
        ``model``'s); 0 beyond each micro-batch's trimmed width (padding).

        On N ranks (each holding the whole batch) every rank computes only its token-balanced
        share of the rows and one all-reduce assembles the result: each row is written by one
        rank and the others add exact zeros, so the pass costs 1/N of the compute per rank.
        """
        # A LoRA reference (adapters off) runs the policy's own sharded root.
        root = model.model if isinstance(model, lora.AdapterDisabled) else (model or self.model)
        return self._score_rows(batch, lambda mb: self._forward(mb, with_entropy=False, model=model)[0], root)

    def _score_rows(self, batch: TrainBatch, score, module: torch.nn.Module) -> torch.Tensor:
        """``score(micro_batch) -> [b, w]`` over this rank's token-balanced share of the rows,
        assembled into ``[B, L-1]`` float32 on every rank with one all-reduce (rows another rank
        scored arrive as its values; each rank adds exact zeros elsewhere). ``module`` is the
        FSDP2 root that ``score`` ran, resharded afterwards (``reshard_root``)."""
        out = torch.zeros(batch.loss_mask.shape)
        world, rank = dist.get_world_size(), dist.get_rank()
        share = split_by_tokens(batch.attention_mask.sum(1).tolist(), world)[rank]
        mine = batch.select(slice(share.start, share.stop))
        for sl, real in self._micro_slices(mine, batch):
            mb = (mine if real else batch).select(sl)
            if self.cfg.max_tokens_per_micro_batch:
                mb = mb.trimmed()
            values = score(mb.to(self.device))
            if real:
                out[share.start + sl.start : share.start + sl.start + len(mb), : values.shape[1]] = values.float().cpu()
        reshard_root(module)
        if world > 1:
            dist.all_reduce(out)
        return out

    @torch.no_grad()
    @collective
    def prepare(self, batch: TrainBatch) -> dict[str, float]:
        """No-grad passes that advantages and the loss need, stored in ``batch.extras``.

        Sets ``proximal_logprobs`` ``[B, L-1]`` (the current policy version; skipped in bypass
        mode), ``ref_logprobs`` ``[B, L-1]`` (when a KL term is on) and ``values`` ``[B, L-1]``
        (when there is a critic), all float32 and aligned with the labels.

        Returns:
            Timings in seconds: ``timing/proximal_s``, ``timing/ref_s``, ``timing/values_s``.

        Raises:
            RuntimeError: a KL term is on but ``begin_rl`` was never called (no reference yet).
        """
        import time

        timings: dict[str, float] = {}
        t0 = time.perf_counter()
        if not self.algo.bypass_proximal:
            batch.extras["proximal_logprobs"] = self.compute_logprobs(batch)
            timings["timing/proximal_s"] = time.perf_counter() - t0
        if self.algo.needs_reference:
            if self.ref_model is None:
                raise RuntimeError("algorithm.kl_coef > 0 but no reference policy: call begin_rl() before training")
            t0 = time.perf_counter()
            batch.extras["ref_logprobs"] = self.compute_logprobs(batch, model=self.ref_model)
            timings["timing/ref_s"] = time.perf_counter() - t0
        if self.critic is not None:
            t0 = time.perf_counter()
            # Rows split across ranks as for the log-probs.
            batch.extras["values"] = self._score_rows(batch, self.critic.values, self.critic.model)
            timings["timing/values_s"] = time.perf_counter() - t0
        return timings

    # ------------------------------------------------------------------ updates
    def _optimizer_step(self) -> torch.Tensor:
        return clip_and_step(self.model.parameters(), self.optimizer, self.scheduler, self.cfg.grad_clip)

    def _split(self, n: int, parts: int, epoch: int) -> list[torch.Tensor]:
        if parts == 1:
            return [torch.arange(n)]
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.cfg.seed + 7919 * self.version + epoch))
        return list(order.tensor_split(parts))

    @collective
    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Policy-gradient update(s) on one step's batch; see the module docstring.

        Args:
            batch: collated trajectories with ``advantages`` and ``behavior_logprobs`` set, after
                ``prepare``: its ``proximal_logprobs`` extra is used (computed here if absent), a
                ``ref_logprobs`` extra for the KL loss term, ``values`` and ``returns`` extras
                for the critic.

        Returns:
            Metrics under ``loss/``, ``actor/``, ``critic/`` and ``mismatch/``, one value per
            training step; ``actor/optimizer_steps`` counts the optimizer steps taken and
            ``actor/skipped_mini_batches`` the mini-batches skipped for want of a valid token
            (fewer sequences than ``num_mini_batches``, or every token masked). ``loss/pg`` is
            averaged over the steps taken (0 when none was).

        Raises:
            KeyError: a KL loss term or a critic is configured but the batch lacks its extras.
        """
        proximal = self._proximal_logprobs(batch)
        acc = _StepAccumulator()
        world, rank = dist.get_world_size(), dist.get_rank()
        for epoch in range(self.cfg.num_epochs):
            for idx in self._split(len(batch), self.cfg.num_mini_batches, epoch):
                mini, mini_prox = batch.select(idx), proximal[idx]
                # This rank's contiguous, token-balanced share (every rank holds the whole batch).
                share = split_by_tokens(mini.attention_mask.sum(1).tolist(), world)[rank]
                mine = mini.select(slice(share.start, share.stop))
                mine_prox = mini_prox[share.start : share.stop]
                num_tokens, num_seqs = self._global_normalizers(mine.loss_mask)
                if int(num_tokens) == 0:
                    # Nothing to learn from (an empty cut of a short batch, or every token masked),
                    # and AdamW on a zero gradient is no no-op: momentum and weight decay would still
                    # move the weights, and the LR schedule would advance. The count is global, so
                    # every rank skips the same mini-batches and the collectives stay matched.
                    acc.skipped += 1
                    continue
                for sl, real in self._micro_slices(mine, mini):
                    mb = (mine if real else mini).select(sl).to(self.device)
                    mb_prox = (mine_prox if real else mini_prox)[sl].to(self.device)
                    if not real:
                        # Padding micro-batch: FSDP's collectives need every rank to run as many
                        # passes; a zero loss mask makes it contribute nothing.
                        mb.loss_mask = torch.zeros_like(mb.loss_mask)
                    if self.cfg.max_tokens_per_micro_batch:
                        keep = mb.trimmed()
                        mb_prox = mb_prox[:, : keep.loss_mask.shape[1]]
                        mb = keep
                    self._micro_batch_backward(mb, mb_prox, num_tokens, num_seqs, acc, real)
                self._mini_batch_optimizer_step(acc)
        self._warn_skipped(acc.skipped, len(batch))
        # One policy version per training step (per batch of trajectories), however many optimizer
        # steps it took: staleness is counted in these versions, as in AReaL and PipelineRL.
        self.version += 1
        return self._step_metrics(acc)

    def _proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """``[B, T]`` float32 log pi_prox: the behaviour log-probs in bypass mode, else ``prepare``'s
        (computed now if ``prepare`` was skipped)."""
        if self.algo.bypass_proximal:
            return batch.behavior_logprobs
        if "proximal_logprobs" in batch.extras:
            return batch.extras["proximal_logprobs"]
        return self.compute_logprobs(batch)

    def _global_normalizers(self, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid tokens, sequences with a valid token) of the mini-batch over every rank."""
        num_tokens, num_seqs = count_normalizers(loss_mask)
        if dist.get_world_size() > 1:
            # Global normalisers before any backward pass: every rank divides by the same.
            norms = torch.stack([num_tokens, num_seqs]).float()
            dist.all_reduce(norms)
            num_tokens, num_seqs = norms[0], norms[1]
        return num_tokens, num_seqs

    def _micro_batch_backward(self, mb: TrainBatch, mb_prox: torch.Tensor, num_tokens: torch.Tensor,
                              num_seqs: torch.Tensor, acc: "_StepAccumulator", real: bool) -> None:
        """Forward and backward of one micro-batch: policy loss, entropy bonus, KL term, critic."""
        a, world = self.algo, dist.get_world_size()
        agg = {"num_global_tokens": num_tokens, "num_global_seqs": num_seqs, "horizon": a.loss_horizon_tokens}
        logprobs, entropy = self._forward(mb, with_entropy=True)
        inputs = PolicyLossInputs(logprobs, mb_prox, mb.behavior_logprobs, mb.advantages, mb.loss_mask,
                                  agg_mode=a.loss_agg_mode, **agg)
        loss, metrics = self.policy_loss(inputs, self.correction, **self.loss_params)
        metrics = {f"loss/{k}": v for k, v in metrics.items()}
        acc.pg_losses.append(loss.detach())
        total = loss
        if a.entropy_coef:
            total = total - a.entropy_coef * aggregate_loss(entropy, mb.loss_mask, a.loss_agg_mode, **agg)
        if a.kl_coef and not a.use_kl_in_reward:
            kl = kl_penalty(logprobs, mb.extras["ref_logprobs"], a.kl_estimator, mask=mb.loss_mask,
                            k3_clamp=a.kl_k3_clamp)
            total = total + a.kl_coef * aggregate_loss(kl, mb.loss_mask, a.loss_agg_mode, **agg)
            metrics["loss/kl"] = masked_mean(kl.detach(), mb.loss_mask)
        # FSDP averages gradients over ranks; the global normaliser already divides, so
        # scale back up to the sum (the 1-rank gradient).
        (total * world).backward()
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mb.loss_mask)
        if self.critic is not None:
            critic_metrics = self.critic.backward(mb, a.loss_agg_mode, num_tokens, num_seqs,
                                                  a.loss_horizon_tokens, grad_scale=world)
            acc.vf_losses.append(critic_metrics.pop("critic/vf_loss"))
            metrics.update(critic_metrics)
        if real:
            acc.per_mb.append(metrics)
            acc.weights.append(float(mb.loss_mask.sum()))

    def _mini_batch_optimizer_step(self, acc: "_StepAccumulator") -> None:
        step_metrics = {"actor/grad_norm": self._optimizer_step()}
        if self.critic is not None:
            step_metrics["critic/grad_norm"] = self.critic.optimizer_step(self.cfg.grad_clip)
        acc.per_mb.append(step_metrics)
        acc.weights.append(1.0)
        acc.num_steps += 1

    def _warn_skipped(self, skipped: int, batch_size: int) -> None:
        if skipped and not self._warned_skip:
            self._warned_skip = True
            logger.warning("train_step: %d of %d mini-batches had no valid token (a batch of %d sequences for "
                           "learner.num_mini_batches=%d, or every token masked) and took no optimizer or "
                           "LR-scheduler step; actor/skipped_mini_batches counts them from here on",
                           skipped, self.cfg.num_epochs * self.cfg.num_mini_batches, batch_size,
                           self.cfg.num_mini_batches)

    def _step_metrics(self, acc: "_StepAccumulator") -> dict[str, torch.Tensor]:
        """The training step's metrics: token-weighted means over micro-batches (and ranks), the
        optimizer-step counts, and ``loss/pg`` / ``critic/vf_loss`` averaged over optimizer steps."""
        world = dist.get_world_size()
        # Every rank takes the same optimizer steps, so per_mb is empty on all ranks or on none.
        out = reduce_metrics(acc.per_mb, acc.weights) if acc.per_mb else {}
        if world > 1:
            out.update(_token_weighted_across_ranks(out, acc.per_mb, acc.weights,
                                                    skip=("actor/grad_norm", "critic/grad_norm")))
        out["actor/lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        out["actor/optimizer_steps"] = torch.tensor(float(acc.num_steps))
        out["actor/skipped_mini_batches"] = torch.tensor(float(acc.skipped))
        # Micro-batch losses are already divided by the mini-batch's global normaliser, so their
        # sum (over micro-batches and ranks) is the mini-batch loss; loss/pg is that sum averaged
        # over the optimizer steps.
        sums = torch.stack([torch.stack(acc.pg_losses).sum().cpu() if acc.pg_losses else torch.zeros(()),
                            torch.stack(acc.vf_losses).sum().cpu() if acc.vf_losses else torch.zeros(())])
        if world > 1:
            # The losses are shares of one global normaliser: their sum over ranks is the loss.
            dist.all_reduce(sums)
        out["loss/pg"] = sums[0] / max(acc.num_steps, 1)
        if acc.vf_losses:
            out["critic/vf_loss"] = sums[1] / max(acc.num_steps, 1)
        return out

    def _micro_slices(self, mine: TrainBatch, mini: TrainBatch) -> list[tuple[slice, bool]]:
        """This rank's micro-batches (slices of ``mine``), padded with ``(slice(0, 1), False)``
        entries up to the most any rank has, so every rank runs as many passes."""
        if self.cfg.max_tokens_per_micro_batch:
            ranges = micro_batches_by_tokens(mine.attention_mask.sum(1).tolist(), self.cfg.max_tokens_per_micro_batch,
                                             packed=self.cfg.packing)
            slices = [slice(r.start, r.stop) for r in ranges]
        else:
            slices = [slice(s, s + self.cfg.micro_batch_size) for s in range(0, len(mine), self.cfg.micro_batch_size)]
        out = [(sl, True) for sl in slices]
        if dist.get_world_size() > 1:
            count = torch.tensor([len(out)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            out += [(slice(0, 1), False)] * (int(count) - len(out))
        return out

    @collective
    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, torch.Tensor]:
        """One supervised step: token-mean negative log-likelihood of the loss-masked tokens.

        Used by the supervised warm start, at temperature 1 and learning rate ``lr`` (the
        schedule does not advance). On N ranks each runs its token-balanced share of the rows
        against the whole batch's token count, so N ranks take the 1-rank step at 1/N of the
        compute each. Returns ``{"sft/loss", "sft/grad_norm"}``.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        num_tokens, _ = count_normalizers(batch.loss_mask)  # the whole batch's: same on every rank
        world, rank = dist.get_world_size(), dist.get_rank()
        share = split_by_tokens(batch.attention_mask.sum(1).tolist(), world)[rank]
        mine = batch.select(slice(share.start, share.stop))
        loss_sum = torch.zeros(())
        for sl, real in self._micro_slices(mine, batch):
            mb = (mine if real else batch).select(sl)
            if self.cfg.max_tokens_per_micro_batch:
                mb = mb.trimmed()
            mb = mb.to(self.device)
            # A padding pass (ranks must run as many passes for FSDP's collectives) adds nothing.
            mask = mb.loss_mask if real else torch.zeros_like(mb.loss_mask)
            nll = -self._forward(mb, with_entropy=False, temperature=1.0)[0]
            loss = aggregate_loss(nll, mask, "token-mean", num_global_tokens=num_tokens, num_global_seqs=len(batch))
            # FSDP averages gradients over ranks; scale back to the sum over the shares.
            (loss * world).backward()
            loss_sum += loss.detach().cpu()
        if world > 1:
            dist.all_reduce(loss_sum)
        # No scheduler step: the warm start's LR is constant and the RL schedule starts afterwards.
        grad_norm = clip_and_step(self.model.parameters(), self.optimizer, None, self.cfg.grad_clip)
        return {"sft/loss": loss_sum, "sft/grad_norm": grad_norm.detach()}

    # ------------------------------------------------------------------ weights out
    @collective
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters by Hugging Face name (tied ones once), gathered from the shards; with
        LoRA only the adapter matrices, under peft's adapter-file names (``async_rl.learners.lora``)."""
        if self.cfg.lora.rank > 0:
            for name, tensor in lora.adapter_named_weights(self.model):
                yield hf_name(name), tensor
            return
        for name, param in self.model.named_parameters():
            data = param.detach()
            yield hf_name(name), data.full_tensor() if isinstance(data, DTensor) else data

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what ``named_weights`` yields, in order, without
        gathering (a DTensor's shape is the global one)."""
        if self.cfg.lora.rank > 0:
            return [(hf_name(n), d, s) for n, d, s in lora.adapter_metadata(self.model)]
        return [(hf_name(n), p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def weight_aliases(self) -> dict[str, str]:
        """``{tied name: name sent}`` for parameters ``named_weights`` yields once under another
        name (tied embeddings: ``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
        from async_rl.weight_sync import tied_aliases

        if self.cfg.lora.rank > 0:
            return {}
        return {hf_name(k): hf_name(v) for k, v in tied_aliases(self.model).items()}

    @collective
    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the current policy as a Hugging Face directory (safetensors) to ``out_dir``; with
        LoRA a plain model with the adapters merged in, plus the adapter under ``out_dir/adapter``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.cfg.lora.rank > 0:
            lora.export_merged(self.model, self.cfg.lora, out_dir, tokenizer, self.model_path)
            return
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)

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
        frozen reference policy; plus ``learner_state.pt`` (rank 0) with the policy version and
        the LR schedulers' positions. ``load_checkpoint`` restores it on any world size.
        """
        import os

        import torch.distributed.checkpoint as dcp

        dcp.save(self._checkpoint_state(), checkpoint_id=path)
        if dist.get_rank() == 0:
            meta = {"version": self.version, "scheduler": self.scheduler.state_dict(),
                    "critic_scheduler": self.critic.scheduler.state_dict() if self.critic is not None else None,
                    "has_ref": self.ref_model is not None,
                    "ref_adapters_off": isinstance(self.ref_model, lora.AdapterDisabled)}
            torch.save(meta, os.path.join(path, "learner_state.pt"))
        dist.barrier()

    @collective
    def load_checkpoint(self, path: str) -> None:
        """Restore what ``save_checkpoint`` wrote (instead of ``begin_rl``: the reference policy,
        optimizer and schedules come from the checkpoint).

        Raises:
            FileNotFoundError: ``path`` holds no learner checkpoint.
            ValueError: the checkpoint's contents do not fit this learner (a critic or reference
                policy on one side only; parameter names or shapes differ).
        """
        import os

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        meta_path = os.path.join(path, "learner_state.pt")
        if not os.path.exists(meta_path):
            raise FileNotFoundError(f"{path}: no learner checkpoint (learner_state.pt is missing)")
        meta = torch.load(meta_path, weights_only=False)
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
            dcp.load(state, checkpoint_id=path)
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
