"""The backend-agnostic half of a learner: how a training step cuts its batch, computes the loss
and steps the optimizer, whatever holds the model (``async_rl.learners.fsdp``: FSDP2;
``async_rl.learners.megatron``: megatron-core with tensor and pipeline parallelism).

Before a training step the trainer's loop calls ``prepare`` (``async_rl.step.batch.make_batch``) (no
grad): proximal log-probs with the current weights (unless the algorithm runs in bypass mode,
proximal := behavior), reference log-probs when a KL term is on, and critic values when the
estimator needs them. Advantages are computed from these (KL-in-reward and GAE need them), then
``train_step``:

1. takes the proximal log-probs from ``prepare`` (or computes them if it was skipped);
2. for each epoch, split the batch into ``num_mini_batches`` mini-batches; for each, count the
   valid tokens and sequences of the whole mini-batch over the data-parallel ranks (the global
   normaliser), run this rank's micro-batches with gradient accumulation, clip, and take one
   optimizer step; the critic, when there is one, takes its step on the same mini-batch. A
   mini-batch without a valid token (on every rank) is skipped: no pass, no optimizer and no
   LR-scheduler step. That happens when a batch has fewer sequences than ``num_mini_batches``
   (reward rejections at run time; the config check refuses it for full batches) or when every
   token of it is masked (DAPO's overlong filter);
3. return metrics reduced once per training step (token-weighted means over micro-batches and
   ranks; extremes such as ``loss/ratio_max`` by max / min); the step is one policy version
   whatever its number of optimizer steps.

Every rank holds the whole batch. Data-parallel ranks take contiguous, token-balanced shares of
it (``async_rl.learners.batching.split_by_tokens``); the ranks of one model replica (its tensor-
and pipeline-parallel peers) take the same share and run the same passes.

A backend subclasses ``LearnerCore`` and provides the model-side hooks: ``_forward`` (log-probs and
entropies of a micro-batch), ``_data_parallel`` (its data-parallel size, rank and group),
``_grad_scale``, ``_step_optimizer``, ``_release`` and ``_reports_outputs``.
"""

from __future__ import annotations

import contextlib

import logging
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from async_rl.algorithms.aggregation import aggregate_loss, count_normalizers
from async_rl.algorithms.distill import topk_kl
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.logprobs import masked_mean
from async_rl.algorithms.losses import PolicyLossInputs
from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners.base import LearnerConfig, init_single_process_group, learner_device, process_group_backend
from async_rl.learners.batching import micro_batches_by_tokens, split_by_tokens
from async_rl.learners import wire
from async_rl.learners.spmd import collective
from async_rl.runtime.metrics import metric_reduction, reduce_metrics

logger = logging.getLogger(__name__)


def _reduce_across_ranks(local: dict[str, torch.Tensor], per_mb: list[dict], weights: list[float],
                         skip: tuple[str, ...], report: bool = True) -> dict[str, torch.Tensor]:
    """Per-micro-batch metrics over every rank's micro-batches: token-weighted means, and the
    max / min of extremes (``async_rl.runtime.metrics.metric_reduction``: ``loss/ratio_max`` is the
    largest ratio on any rank).

    ``local`` holds this rank's reductions (``reduce_metrics``); each key's weight is the tokens
    of the micro-batches that report it. Ranks may report different keys (a rank without a real
    micro-batch reports none), so the ``(sum, weight)`` pairs (``(value, weight)`` for an extreme)
    travel with ``wire.all_gather`` (msgpack; a few dozen floats per step). Keys in ``skip`` (already
    global, like gradient norms) are left out; a rank with ``report=False`` (a tensor-parallel
    peer repeating its replica's numbers) contributes nothing. A key no rank weighs is NaN.
    """
    pairs = {}
    for key, value in local.items() if report else ():
        if key in skip or value.dim():
            continue
        w = sum(float(wt) for entry, wt in zip(per_mb, weights) if key in entry)
        if metric_reduction(key) == "mean":
            pairs[key] = (float(value) * w if w else 0.0, w)
        else:
            pairs[key] = (float(value), w)
    gathered = wire.all_gather(pairs)
    out: dict[str, torch.Tensor] = {}
    for key in dict.fromkeys(k for rank_pairs in gathered for k in rank_pairs):
        entries = [rank_pairs[key] for rank_pairs in gathered if key in rank_pairs]
        how = metric_reduction(key)
        if how == "mean":
            s, w = sum(e[0] for e in entries), sum(e[1] for e in entries)
            out[key] = torch.tensor(s / w if w else float("nan"))
        else:
            kept = [v for v, w in entries if w]
            out[key] = torch.tensor((max if how == "max" else min)(kept) if kept else float("nan"))
    return out


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


class LearnerCore:
    """The training step, the no-grad scoring passes and the supervised step of a learner, over
    data-parallel ranks; the model side comes from the subclass (see the module docstring).

    A subclass's constructor calls ``_setup`` (settings, device, process group, ``version``),
    then sets ``model``, ``ref_model`` (or ``None``), ``critic`` (an object with ``model``,
    ``values``, ``backward``, ``optimizer_step``; or ``None``), ``policy_loss``, ``correction`` and
    ``loss_options`` (``AlgorithmConfig.loss_options()``), and calls ``reset_optimizer``.
    """

    version: int = 0
    """Policy version: training steps taken (``Learner.version``); ``_setup`` starts it at 0 and
    ``train_step`` and ``load_checkpoint`` move it."""
    _moe_routers: int = 0
    """Routers of a mixture-of-experts policy on this rank (``_init_router_stats``; 0: dense)."""
    _moe_shape: tuple[int, int, int] | None = None
    """``(num_moe_layers, num_experts, top_k)`` of a mixture-of-experts policy (the whole model)."""
    _router_stats: dict | None = None
    """``{"train" | "no_grad": RouterStats}`` of the step's policy passes so far."""
    _router_losses: list | None = None
    """The last training forward pass's ``(load-balancing, z)`` loss terms per MoE layer."""

    def _setup(self, cfg: LearnerConfig, algo, model_path: str, temperature: float, total_optimizer_steps: int) -> None:
        """What every backend's constructor starts with: the settings (``algo`` resolved: the
        caller applies presets, ``load_config`` does it), the rank-0 command channel's
        attributes, the device and a world-size-1 process group when none exists.

        Raises:
            ValueError: ``algo`` still has an unresolved preset field; ``learner.device=cuda``
                without a GPU.
        """
        import os

        self.cfg, self.algo, self.temperature = cfg, algo.require_resolved(), temperature
        self.total_optimizer_steps, self.model_path = total_optimizer_steps, model_path
        # Set by async_rl.learners.spmd.drive_followers on rank 0 of a launched multi-rank learner.
        self._drives_followers, self._command_depth = False, 0
        # Set by async_rl.learners.launch on rank 0 of Ray-placed ranks: () -> the error naming a
        # follower rank that died, or None (spmd raises it in place of gloo's).
        self._follower_failure = None
        self.device = learner_device(cfg)
        init_single_process_group(process_group_backend(self.device))
        if self.device.type == "cuda":
            # torchrun sets LOCAL_RANK; a Ray-placed rank sees only its own GPU (index 0).
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.version = 0
        self._warned_skip = False  # train_step warns once about mini-batches without a valid token

    def _precision(self) -> str:
        """``learner.mixed_precision`` resolved: ``auto`` = ``bf16`` on CUDA, ``fp32`` on CPU (where
        bf16 matmuls are emulated on most cores and only change the numerics)."""
        if self.cfg.mixed_precision != "auto":
            return self.cfg.mixed_precision
        return "bf16" if self.device.type == "cuda" else "fp32"

    # ------------------------------------------------------------------ backend hooks
    def _forward(self, mb: TrainBatch, with_entropy: bool, model: torch.nn.Module | None = None,
                 temperature: float | None = None, packed: bool | None = None,
                 topk_ids: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Log-probs (and entropies) ``[b, L-1]`` float32 of a micro-batch's labels under ``model``
        (default the policy) at ``temperature`` (default the generator's); ``packed`` (default
        ``learner.packing``): from one packed row. Only meaningful on a rank where
        ``_reports_outputs()``; the others return what their stage computes (stand-ins of the
        same shapes that carry the backward to the stage's send).

        ``topk_ids``: ``[b, L-1, K]`` int64 token ids in ``[0, vocab)`` in the label layout (slot
        ``t`` is the position predicting ``input_ids[:, t+1]``). When given, the return value is
        ``(logprobs, entropy, topk_logprobs)`` with ``topk_logprobs`` ``[b, L-1, K]`` float32,
        differentiable: ``log_softmax(logits / temperature)`` of each id at each slot, from the
        same forward pass, and 0 at slots that predict no real token of their own row (whatever
        ids are there). Without it, the 2-tuple ``(logprobs, entropy)`` at no extra cost."""
        raise NotImplementedError

    def _check_topk_ids(self, mb: TrainBatch, topk_ids: torch.Tensor) -> torch.Tensor:
        """``topk_ids`` of ``_forward`` as int64 on the learner's device.

        Raises:
            ValueError: not ``[b, L-1, K]`` for the micro-batch's ``[b, L]`` ids.
        """
        b, length = mb.input_ids.shape
        if topk_ids.dim() != 3 or tuple(topk_ids.shape[:2]) != (b, length - 1):
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} for a micro-batch of {b} rows of {length} tokens "
                             f"(need [{b}, {length - 1}, K], the label layout)")
        return topk_ids.to(self.device, torch.long)

    def _data_parallel(self) -> tuple[int, int, object]:
        """``(size, rank, process group)`` of the data-parallel dimension (the group ``None`` =
        the default group)."""
        return dist.get_world_size(), dist.get_rank(), None

    def _grad_scale(self) -> float:
        """Factor on each micro-batch loss before ``backward``: the loss is already divided by the
        global normaliser, so a backend that averages gradients over data-parallel ranks (FSDP2)
        scales back up by their number; one that sums them uses 1."""
        return float(self._data_parallel()[0])

    def _step_optimizer(self, with_schedule: bool = True) -> torch.Tensor:
        """Reduce gradients as the backend needs, clip to ``cfg.grad_clip``, step (and the LR
        schedule if ``with_schedule``), zero grads; returns the pre-clip global norm (0-dim)."""
        raise NotImplementedError

    def _release(self, module: torch.nn.Module) -> None:
        """Called after a no-grad pass over ``module`` (FSDP2 reshards its root)."""

    def _reports_outputs(self) -> bool:
        """Whether this rank's forward outputs (log-probs, losses, metrics) are its replica's report:
        true on one rank of each model replica (FSDP2: every rank), so sums over ranks count each
        replica once."""
        return True

    def _scored_module(self, model: torch.nn.Module | None) -> torch.nn.Module:
        """The module a no-grad scoring pass of ``model`` (default the policy) runs, for ``_release``."""
        return model or self.model

    def _make_optimizer(self, params, lr: float):
        params = list(params)
        # AdamW's fused kernel updates every parameter in one op: torch's default on a CPU runs
        # about ten small ops per parameter, 4.2 ms a step for the default job's 50 parameters
        # against 1.1 ms fused (one thread; more under DTensor's per-op dispatch). The update is
        # AdamW's (Loshchilov & Hutter 2019, Alg. 2) either way, equal up to float rounding.
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps,
                                      weight_decay=self.cfg.weight_decay, fused=fused or None)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg, self.total_optimizer_steps))

    @collective
    def reset_optimizer(self, lr: float | None = None) -> None:
        """Fresh AdamW and LR schedule (after a supervised warm start, for example)."""
        # Only trainable parameters: with LoRA the frozen base would get no state, but AdamW
        # would still walk it every step.
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = self._make_optimizer(params, lr or self.cfg.lr)


    @torch.no_grad()
    @collective
    def compute_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs ``[B, L-1]`` float32 of the batch's labels under the current weights (or
        ``model``'s); 0 beyond each micro-batch's trimmed width (padding).

        On N ranks (each holding the whole batch) every rank computes only its token-balanced
        share of the rows and one all-reduce assembles the result: each row is written by one
        rank and the others add exact zeros, so the pass costs 1/N of the compute per rank.
        """
        return self._score_rows(batch, lambda mb: self._forward(mb, with_entropy=False, model=model)[0],
                                self._scored_module(model))

    def _score_rows(self, batch: TrainBatch, score, module: torch.nn.Module) -> torch.Tensor:
        """``score(micro_batch) -> [b, w]`` over this data-parallel rank's token-balanced share of
        the rows, assembled into ``[B, L-1]`` float32 on every rank with one all-reduce (rows
        another replica scored arrive as its values; each rank adds exact zeros elsewhere, and a
        rank that does not report its replica's outputs adds zeros everywhere). ``module`` is
        the module ``score`` ran, released afterwards (``_release``)."""
        out = torch.zeros(batch.loss_mask.shape)
        dp_size, dp_rank, _ = self._data_parallel()
        share = split_by_tokens(batch.attention_mask.sum(1).tolist(), dp_size)[dp_rank]
        report = self._reports_outputs()
        mine = batch.select(slice(share.start, share.stop))
        for sl, real in self._micro_slices(mine, batch):
            mb = (mine if real else batch).select(sl)
            if self.cfg.max_tokens_per_micro_batch:
                mb = mb.trimmed()
            values = score(mb.to(self.device))
            if real and report:
                out[share.start + sl.start : share.start + sl.start + len(mb), : values.shape[1]] = values.float().cpu()
        self._release(module)
        if dist.get_world_size() > 1:
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
    def _split(self, group_ids: torch.Tensor, parts: int, epoch: int) -> list[torch.Tensor]:
        """Row indices of each of ``parts`` mini-batches of a batch whose rows have ``group_ids``
        (``[B]`` int64), dealt in a seeded random order (``learner.mini_batch_split``): single
        rows, or whole groups (a group's rows stay together and in batch order)."""
        n = len(group_ids)
        if parts == 1:
            return [torch.arange(n)]
        rng = torch.Generator().manual_seed(self.cfg.rng_seed + 7919 * self.version + epoch)
        if self.cfg.mini_batch_split == "samples":
            return list(torch.randperm(n, generator=rng).tensor_split(parts))
        groups, inverse = torch.unique(group_ids, return_inverse=True)
        dealt = torch.randperm(len(groups), generator=rng).tensor_split(parts)
        return [torch.nonzero(torch.isin(inverse, part)).flatten() for part in dealt]

    @collective
    def train_step(self, batch: TrainBatch, num_mini_batches: int | None = None) -> dict[str, float]:
        """Policy-gradient update(s) on one step's batch; see the module docstring.

        Args:
            batch: collated trajectories with ``advantages`` and ``behavior_logprobs`` set, after
                ``prepare``: its ``proximal_logprobs`` extra is used (computed here if absent), a
                ``ref_logprobs`` extra for the KL loss term, ``values`` and ``returns`` extras
                for the critic.
            num_mini_batches: optimizer steps to split ``batch`` into (``None``: the learner's
                ``num_mini_batches``); 1 when the async loop publishes a version per mini-batch
                (``trainer.policy_version_per=mini_batch``) and hands over one mini-batch at a time.

        Returns:
            Metrics under ``loss/``, ``actor/``, ``critic/`` and ``mismatch/``, one value per
            training step; ``actor/optimizer_steps`` counts the optimizer steps taken and
            ``actor/skipped_mini_batches`` the mini-batches skipped for want of a valid token
            (fewer sequences than ``num_mini_batches``, or every token masked). ``loss/pg`` is
            averaged over the steps taken (0 when none was).

        Raises:
            KeyError: a KL loss term or a critic is configured but the batch lacks its extras.
        """
        parts = num_mini_batches or self.cfg.num_mini_batches
        proximal = self._proximal_logprobs(batch)
        acc = _StepAccumulator()
        dp_size, dp_rank, _ = self._data_parallel()
        for epoch in range(self.cfg.num_epochs):
            for idx in self._split(batch.group_ids, parts, epoch):
                mini, mini_prox = batch.select(idx), proximal[idx]
                # This rank's contiguous, token-balanced share (every rank holds the whole batch).
                share = split_by_tokens(mini.attention_mask.sum(1).tolist(), dp_size)[dp_rank]
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
        self._warn_skipped(acc.skipped, len(batch), parts)
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
        """(valid tokens, sequences with a valid token) of the mini-batch over the data-parallel
        ranks (each passes its own share's ``loss_mask``)."""
        num_tokens, num_seqs = count_normalizers(loss_mask)
        dp_size, _, dp_group = self._data_parallel()
        if dp_size > 1:
            # Global normalisers before any backward pass: every rank divides by the same.
            norms = torch.stack([num_tokens, num_seqs]).float()
            dist.all_reduce(norms, group=dp_group)
            num_tokens, num_seqs = norms[0], norms[1]
        return num_tokens, num_seqs

    def _micro_batch_backward(self, mb: TrainBatch, mb_prox: torch.Tensor, num_tokens: torch.Tensor,
                              num_seqs: torch.Tensor, acc: "_StepAccumulator", real: bool) -> None:
        """Forward and backward of one micro-batch: policy loss, entropy bonus, KL term, the
        teacher's top-k divergence (``algorithm.distill.signal=topk_*``), critic."""
        a, scale = self.algo, self._grad_scale()
        agg = {"num_global_tokens": num_tokens, "num_global_seqs": num_seqs, "horizon": a.loss_horizon_tokens}
        student_topk = None
        if a.needs_teacher and a.distill.uses_topk and "teacher_topk_ids" in mb.extras:
            # The student's log-probs at the teacher's top-k ids, from the same forward pass.
            logprobs, entropy, student_topk = self._forward(mb, with_entropy=True, topk_ids=mb.extras["teacher_topk_ids"])
        else:
            logprobs, entropy = self._forward(mb, with_entropy=True)
        router_losses = self._router_losses
        self._router_losses = None
        inputs = PolicyLossInputs(logprobs, mb_prox, mb.behavior_logprobs, mb.advantages, mb.loss_mask,
                                  agg_mode=a.loss_agg_mode, **agg)
        loss, metrics = self.policy_loss(inputs, self.correction, self.loss_options)
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
        if student_topk is not None:
            kind = "reverse" if a.distill.signal == "topk_reverse_kl" else "forward"
            divergence = topk_kl(student_topk, mb.extras["teacher_topk_logprobs"], kind)
            total = total + a.distill.coef * aggregate_loss(divergence, mb.loss_mask, a.loss_agg_mode, **agg)
            metrics["loss/distill_kl"] = masked_mean(divergence.detach(), mb.loss_mask)
        if router_losses:
            # Each layer's terms are means over this micro-batch's tokens; weighting them by its
            # share of the mini-batch's loss tokens makes the mini-batch's term their token-weighted
            # mean, as the policy loss's token-mean is.
            share = mb.loss_mask.sum() / num_tokens.clamp(min=1)
            balance = torch.stack([b for b, _ in router_losses]).mean()
            z = torch.stack([z for _, z in router_losses]).mean()
            total = total + share * (a.moe_aux_loss_coef * balance + a.moe_z_loss_coef * z)
            metrics["moe/aux_loss"], metrics["moe/z_loss"] = balance.detach(), z.detach()
        # The global normaliser already divides: the backend's scale makes the reduced gradient
        # the 1-rank one (see _grad_scale).
        (total * scale).backward()
        metrics["actor/entropy"] = masked_mean(entropy.detach(), mb.loss_mask)
        if self.critic is not None:
            critic_metrics = self.critic.backward(mb, a.loss_agg_mode, num_tokens, num_seqs,
                                                  a.loss_horizon_tokens, grad_scale=scale)
            acc.vf_losses.append(critic_metrics.pop("critic/vf_loss"))
            metrics.update(critic_metrics)
        if real:
            acc.per_mb.append(metrics)
            acc.weights.append(float(mb.loss_mask.sum()))

    def _mini_batch_optimizer_step(self, acc: "_StepAccumulator") -> None:
        step_metrics = {"actor/grad_norm": self._step_optimizer()}
        if self.critic is not None:
            step_metrics["critic/grad_norm"] = self.critic.optimizer_step(self.cfg.grad_clip)
        acc.per_mb.append(step_metrics)
        acc.weights.append(1.0)
        acc.num_steps += 1

    def _warn_skipped(self, skipped: int, batch_size: int, parts: int) -> None:
        if skipped and not self._warned_skip:
            self._warned_skip = True
            logger.warning("train_step: %d of %d mini-batches had no valid token (a batch of %d sequences for "
                           "learner.num_mini_batches=%d, or every token masked) and took no optimizer or "
                           "LR-scheduler step; actor/skipped_mini_batches counts them from here on",
                           skipped, self.cfg.num_epochs * parts, batch_size, parts)

    def _init_router_stats(self, model: torch.nn.Module) -> None:
        """Note whether the policy is a mixture-of-experts model (its routers' statistics are then
        taken in its forward passes: ``moe/*`` metrics)."""
        from async_rl.utils.moe import check_replayable, moe_shape, routers

        self._moe_routers = len(routers(model))
        self._moe_shape = moe_shape(model.config) if self._moe_routers else None
        self._router_stats = None
        if self.algo.records_routing:
            check_replayable(model)  # one line: not an MoE model, or a router replay cannot serve

    def _routing(self, mb: TrainBatch, model: torch.nn.Module, packed: bool):
        """The context of one forward pass of ``model`` on micro-batch ``mb`` for a
        mixture-of-experts policy (a no-op context for a dense one): with the batch's
        ``routed_experts`` extra (``[b, L, layers, k]``, input layout, ``-1`` unrecorded), each
        router uses the recorded experts when ``algorithm.routing_replay`` is on (the proximal,
        current and reference passes alike: R3) and is compared with them either way; the
        policy's passes add to the step's router statistics (``_router_metrics``), and its
        training passes leave their load-balancing and z-loss terms in ``_router_losses`` (the training loss adds
        ``algorithm.moe_aux_loss_coef`` and ``moe_z_loss_coef`` times them)."""
        if not self._moe_routers:
            return contextlib.nullcontext()
        from async_rl.utils.moe import replay_routing

        routed = mb.extras.get("routed_experts")
        keep = mb.attention_mask.bool()
        if routed is not None:
            # The rows in the order every router sees them: the packed row's real tokens, or
            # the padded [b, L] batch flattened row-major.
            routed = routed[keep] if packed else routed.reshape(-1, *routed.shape[2:])
        stats = aux = None
        if model is self.model:
            # Training passes give the load and the auxiliary losses; a no-grad pass of the policy
            # (the proximal pass, before any update of this step) the cleanest agreement with
            # the engine, whose weights it shares in sync mode.
            training = torch.is_grad_enabled()
            if training:
                aux = self._router_losses = []
            stats = self._router_stats_of(model, "train" if training else "no_grad")
        return replay_routing(model, routed, replay=self.algo.routing_replay, real=None if packed else keep.reshape(-1),
                              stats=stats, aux=aux)

    def _router_stats_of(self, model: torch.nn.Module, kind: str):
        """The step's ``RouterStats`` of the policy's ``kind`` of pass (``train`` or ``no_grad``),
        made on first use (one ``load`` row per MoE layer of the whole model)."""
        from async_rl.utils.moe import RouterStats

        if self._router_stats is None:
            self._router_stats = {}
        if kind not in self._router_stats:
            layers, experts, top_k = self._moe_shape
            self._router_stats[kind] = RouterStats(num_experts=experts, top_k=top_k,
                                                   load=torch.zeros(layers, experts, dtype=torch.int64))
        return self._router_stats[kind]

    def _router_metrics(self) -> dict[str, torch.Tensor]:
        """``moe/load_*`` of the step's training passes and ``moe/router_agreement`` of its
        no-grad policy passes (the proximal pass; its training passes' where none ran)
        (``async_rl.utils.moe.RouterStats.metrics``), counts summed over ranks; ``{}`` for a
        dense policy. Collective on more than one rank (every rank runs the same passes)."""
        if self._moe_shape is None:
            return {}
        by_kind, self._router_stats = self._router_stats or {}, None
        out: dict[str, float] = {}
        for kind in ("train", "no_grad"):
            stats = by_kind.get(kind)
            if stats is None:
                continue
            counts = torch.cat([stats.load.reshape(-1), torch.tensor([stats.recorded, stats.agreeing])]).double()
            if dist.get_world_size() > 1:
                dist.all_reduce(counts)
            stats.load = counts[:-2].round().long().view_as(stats.load)
            stats.recorded, stats.agreeing = int(counts[-2]), int(counts[-1])
            metrics = stats.metrics()
            if kind == "train":
                out.update(metrics)
            elif "moe/router_agreement" in metrics:
                out["moe/router_agreement"] = metrics["moe/router_agreement"]
        return {k: torch.tensor(v) for k, v in out.items()}

    def _step_metrics(self, acc: "_StepAccumulator") -> dict[str, torch.Tensor]:
        """The training step's metrics: token-weighted means over micro-batches (and ranks), or
        their max / min for extremes (``metric_reduction``); the optimizer-step counts; and
        ``loss/pg`` / ``critic/vf_loss`` averaged over optimizer steps."""
        world, report = dist.get_world_size(), self._reports_outputs()
        # Every rank takes the same optimizer steps, so per_mb is empty on all ranks or on none.
        out = reduce_metrics(acc.per_mb, acc.weights) if acc.per_mb else {}
        if world > 1:
            out.update(_reduce_across_ranks(out, acc.per_mb, acc.weights,
                                            skip=("actor/grad_norm", "critic/grad_norm"), report=report))
        out["actor/lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        out["actor/optimizer_steps"] = torch.tensor(float(acc.num_steps))
        out["actor/skipped_mini_batches"] = torch.tensor(float(acc.skipped))
        # Micro-batch losses are already divided by the mini-batch's global normaliser, so their
        # sum (over micro-batches and ranks) is the mini-batch loss; loss/pg is that sum averaged
        # over the optimizer steps.
        sums = torch.stack([torch.stack(acc.pg_losses).sum().cpu() if acc.pg_losses else torch.zeros(()),
                            torch.stack(acc.vf_losses).sum().cpu() if acc.vf_losses else torch.zeros(())])
        if world > 1:
            # The losses are shares of one global normaliser: their sum over the replicas is the loss.
            sums = sums if report else torch.zeros_like(sums)
            dist.all_reduce(sums)
        out["loss/pg"] = sums[0] / max(acc.num_steps, 1)
        if acc.vf_losses:
            out["critic/vf_loss"] = sums[1] / max(acc.num_steps, 1)
        out.update(self._router_metrics())
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
        dp_size, dp_rank, _ = self._data_parallel()
        share = split_by_tokens(batch.attention_mask.sum(1).tolist(), dp_size)[dp_rank]
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
            # The backend's scale makes the reduced gradient the sum over the shares.
            (loss * self._grad_scale()).backward()
            loss_sum += loss.detach().cpu()
        if dist.get_world_size() > 1:
            if not self._reports_outputs():
                loss_sum.zero_()  # a peer repeating its replica's loss (or a stage without one)
            dist.all_reduce(loss_sum)
        # No scheduler step: the warm start's LR is constant and the RL schedule starts afterwards.
        grad_norm = self._step_optimizer(with_schedule=False)
        return {"sft/loss": loss_sum, "sft/grad_norm": grad_norm.detach()}
