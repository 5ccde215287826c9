"""FSDP2 learner: a Hugging Face causal LM sharded with ``torch.distributed.fsdp.fully_shard``.

Each decoder layer (the classes in the model's ``_no_split_modules``) is sharded, then the root,
over a 1-D device mesh on the default process group (gloo on CPU). With world size 1 the group
is created in-process from a ``HashStore``, so a laptop run needs no launcher or free port.

Before a training step the controller calls ``prepare`` (no grad): proximal log-probs with the
current weights (unless the algorithm runs in bypass mode, proximal := behavior), reference
log-probs when a KL term is on, and critic values when the estimator needs them. Advantages are
computed from these (KL-in-reward and GAE need them), then ``train_step``:

1. takes the proximal log-probs from ``prepare`` (or computes them if it was skipped);
2. for each epoch, split the batch into ``num_mini_batches`` mini-batches; for each, count the
   valid tokens and sequences of the whole mini-batch (the global normaliser), run the
   micro-batches with gradient accumulation, clip, and take one optimizer step (one policy
   version); the critic, when there is one, takes its step on the same mini-batch;
3. return metrics reduced once per training step (token-weighted means over micro-batches).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.distributed as dist

from async_rl.algorithms.aggregation import aggregate_loss, count_normalizers
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits, masked_mean
from async_rl.algorithms.losses import POLICY_LOSSES
from async_rl.metrics import reduce_metrics
from buffers.trajectory import TrainBatch
from learners.base import LearnerConfig, clip_and_step
from learners.batching import micro_batches_by_tokens, split_by_tokens
from learners.critic import FSDPCritic, copy_matching_parameters


def init_single_process_group() -> None:
    """Create a world-size-1 gloo default group in-process (no rendezvous) if none exists."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} declares no _no_split_modules: cannot find decoder layers to shard")
    return layers


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
        algo: algorithm settings (policy loss, clipping, aggregation, KL, entropy).
        model_path: Hugging Face model directory to start from.
        temperature: the generator's sampling temperature; learner log-probs and entropy are
            computed from ``logits / temperature`` so they match the behavior log-probs.
        total_optimizer_steps: for the LR schedule.

    Raises:
        ValueError: the model declares no decoder layers to shard, or the critic's backbone does
            not match the policy's weights.
    """

    def __init__(self, cfg: LearnerConfig, algo: AlgorithmConfig, model_path: str, temperature: float,
                 total_optimizer_steps: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.cfg, self.algo, self.temperature = cfg, algo.apply_preset(), temperature
        self.total_optimizer_steps = total_optimizer_steps
        self.model_path = model_path
        init_single_process_group()
        torch.manual_seed(cfg.seed)
        self.mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        self.model = self._load_policy(model_path)
        self.policy_loss = POLICY_LOSSES.get(algo.policy_loss)
        self.ref_model: torch.nn.Module | None = None
        self.critic: FSDPCritic | None = None
        if self.algo.needs_critic:
            from async_rl.data.builtin import resolve

            critic_path = resolve(cfg.critic.model_path) if cfg.critic.model_path else model_path
            self.critic = FSDPCritic(cfg.critic, critic_path, self._shard, self._make_optimizer)
        self.version = 0
        self.reset_optimizer()

    def _shard(self, module: torch.nn.Module, layers_of: torch.nn.Module | None = None) -> None:
        from torch.distributed.fsdp import fully_shard

        for layer in _decoder_layers(layers_of or module):
            fully_shard(layer, mesh=self.mesh)
        fully_shard(module, mesh=self.mesh)

    def _load_policy(self, path: str) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        model.config.use_cache = False
        self._shard(model)
        # Eval mode = no dropout (gradients still flow): the generator samples without dropout, so
        # dropout in the learner would make proximal and training log-probs noisy and the PPO ratio
        # != 1 on-policy (GPT-2 configs ship 0.1 dropout; regression test in test_learner_algorithms).
        return model.eval()

    def _make_optimizer(self, params, lr: float):
        optimizer = torch.optim.AdamW(params, lr=lr, betas=tuple(self.cfg.betas), eps=self.cfg.eps,
                                      weight_decay=self.cfg.weight_decay)
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(self.cfg, self.total_optimizer_steps))

    def reset_optimizer(self, lr: float | None = None) -> None:
        """Fresh AdamW and LR schedule (after a supervised warm start, for example)."""
        self.optimizer, self.scheduler = self._make_optimizer(self.model.parameters(), lr or self.cfg.lr)

    def begin_rl(self) -> None:
        """Freeze the RL starting point: call once, after any warm start and before step 1.

        Resets the policy optimizer; snapshots the current policy as the frozen reference when a
        KL term is on (the KL then anchors to the policy RL started from, as in verl and
        OpenRLHF); and, when the critic has no ``model_path`` of its own, starts its backbone from
        the current policy.
        """
        self.reset_optimizer()
        if self.algo.needs_reference:
            if self.ref_model is None:
                self.ref_model = self._load_policy(self.model_path)
            copy_matching_parameters(self.model.named_parameters(), self.ref_model)
            self.ref_model.eval().requires_grad_(False)
        if self.critic is not None and self.cfg.critic.model_path is None:
            self.critic.load_backbone(self.model.named_parameters())

    # ------------------------------------------------------------------ forward passes
    def _forward(self, mb: TrainBatch, with_entropy: bool, model: torch.nn.Module | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = (model or self.model)(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                            position_ids=mb.position_ids, use_cache=False).logits[:, :-1]
        labels = mb.input_ids[:, 1:]
        logprobs = logprobs_from_logits(logits, labels, self.temperature)
        entropy = entropy_from_logits(logits, self.temperature) if with_entropy else None
        return logprobs, entropy

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        if self.cfg.max_tokens_per_micro_batch:
            for r in micro_batches_by_tokens(batch.attention_mask.sum(1).tolist(), self.cfg.max_tokens_per_micro_batch):
                yield batch.select(slice(r.start, r.stop)).trimmed()
            return
        for start in range(0, len(batch), self.cfg.micro_batch_size):
            yield batch.select(slice(start, start + self.cfg.micro_batch_size))

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch, model: torch.nn.Module | None = None) -> torch.Tensor:
        """Log-probs ``[B, L-1]`` float32 of the batch's labels under the current weights (or
        ``model``'s); 0 beyond each micro-batch's trimmed width (padding)."""
        out = torch.zeros(batch.loss_mask.shape)
        row = 0
        for mb in self._micro_batches(batch):
            lp = self._forward(mb, with_entropy=False, model=model)[0]
            out[row : row + len(mb), : lp.shape[1]] = lp
            row += len(mb)
        return out

    @torch.no_grad()
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
            batch.extras["values"] = self.critic.compute_values(batch, self.cfg.micro_batch_size)
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

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Policy-gradient update(s) on one step's batch; see the module docstring.

        Args:
            batch: collated trajectories with ``advantages`` and ``behavior_logprobs`` set, after
                ``prepare``: its ``proximal_logprobs`` extra is used (computed here if absent), a
                ``ref_logprobs`` extra for the KL loss term, ``values`` and ``returns`` extras
                for the critic.

        Returns:
            Metrics under ``loss/``, ``actor/``, ``critic/`` and ``mismatch/``, one value per
            training step.

        Raises:
            KeyError: a KL loss term or a critic is configured but the batch lacks its extras.
        """
        a = self.algo
        if a.bypass_proximal:
            proximal = batch.behavior_logprobs
        elif "proximal_logprobs" in batch.extras:
            proximal = batch.extras["proximal_logprobs"]
        else:
            proximal = self.compute_logprobs(batch)
        per_mb: list[dict[str, torch.Tensor]] = []
        weights: list[float] = []
        # Micro-batch losses are already divided by the mini-batch's global normaliser, so their
        # sum (over micro-batches and ranks) is the mini-batch loss; loss/pg is that sum averaged
        # over the optimizer steps.
        pg_losses: list[torch.Tensor] = []
        vf_losses: list[torch.Tensor] = []
        world, rank = dist.get_world_size(), dist.get_rank()
        for epoch in range(self.cfg.num_epochs):
            for idx in self._split(len(batch), self.cfg.num_mini_batches, epoch):
                mini = batch.select(idx)
                mini_prox = proximal[idx]
                # This rank's contiguous, token-balanced share (every rank holds the whole batch).
                share = split_by_tokens(mini.attention_mask.sum(1).tolist(), world)[rank]
                mine = mini.select(slice(share.start, share.stop))
                mine_prox = mini_prox[share.start : share.stop]
                num_tokens, num_seqs = count_normalizers(mine.loss_mask)
                if world > 1:
                    # Global normalisers before any backward pass: every rank divides by the same.
                    norms = torch.stack([num_tokens, num_seqs]).float()
                    dist.all_reduce(norms)
                    num_tokens, num_seqs = norms[0], norms[1]
                for sl, real in self._micro_slices(mine, mini):
                    mb = (mine if real else mini).select(sl)
                    mb_prox = (mine_prox if real else mini_prox)[sl]
                    if not real:
                        # Padding micro-batch: FSDP's collectives need every rank to run as many
                        # passes; a zero loss mask makes it contribute nothing.
                        mb.loss_mask = torch.zeros_like(mb.loss_mask)
                    if self.cfg.max_tokens_per_micro_batch:
                        keep = mb.trimmed()
                        mb_prox = mb_prox[:, : keep.loss_mask.shape[1]]
                        mb = keep
                    logprobs, entropy = self._forward(mb, with_entropy=True)
                    loss, metrics = self.policy_loss(
                        logprobs, mb_prox, mb.behavior_logprobs, mb.advantages, mb.loss_mask,
                        agg_mode=a.loss_agg_mode, num_global_tokens=num_tokens, num_global_seqs=num_seqs,
                        horizon=a.loss_horizon_tokens, behavior_correction=a.behavior_correction,
                        tis_cap=a.tis_cap, icepop_low=a.icepop_low, icepop_high=a.icepop_high,
                        bypass=a.bypass_proximal,
                        **a.loss_params(),
                    )
                    metrics = {f"loss/{k}": v for k, v in metrics.items()}
                    pg_losses.append(loss.detach())
                    total = loss
                    ent = aggregate_loss(entropy, mb.loss_mask, a.loss_agg_mode, num_global_tokens=num_tokens,
                                         num_global_seqs=num_seqs, horizon=a.loss_horizon_tokens)
                    if a.entropy_coef:
                        total = total - a.entropy_coef * ent
                    if a.kl_coef and not a.use_kl_in_reward:
                        kl = kl_penalty(logprobs, mb.extras["ref_logprobs"], a.kl_estimator, mask=mb.loss_mask)
                        kl_loss = aggregate_loss(kl, mb.loss_mask, a.loss_agg_mode, num_global_tokens=num_tokens,
                                                 num_global_seqs=num_seqs, horizon=a.loss_horizon_tokens)
                        total = total + a.kl_coef * kl_loss
                        metrics["loss/kl"] = masked_mean(kl.detach(), mb.loss_mask)
                    # FSDP averages gradients over ranks; the global normaliser already divides, so
                    # scale back up to the sum (the 1-rank gradient).
                    (total * world).backward()
                    metrics["actor/entropy"] = masked_mean(entropy.detach(), mb.loss_mask)
                    if self.critic is not None:
                        critic_metrics = self.critic.backward(mb, a.loss_agg_mode, num_tokens, num_seqs,
                                                              a.loss_horizon_tokens, grad_scale=world)
                        vf_losses.append(critic_metrics.pop("critic/vf_loss"))
                        metrics.update(critic_metrics)
                    if real:
                        per_mb.append(metrics)
                        weights.append(float(mb.loss_mask.sum()))
                step_metrics = {"actor/grad_norm": self._optimizer_step()}
                if self.critic is not None:
                    step_metrics["critic/grad_norm"] = self.critic.optimizer_step(self.cfg.grad_clip)
                per_mb.append(step_metrics)
                weights.append(1.0)
        # One policy version per training step (per batch of trajectories), however many optimizer
        # steps it took: staleness is counted in these versions, as in AReaL and PipelineRL.
        self.version += 1
        out = reduce_metrics(per_mb, weights)
        out["actor/lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        num_steps = self.cfg.num_epochs * self.cfg.num_mini_batches
        sums = torch.stack([torch.stack(pg_losses).sum(), torch.stack(vf_losses).sum() if vf_losses else torch.zeros(())])
        if world > 1:
            # The losses are shares of one global normaliser: their sum over ranks is the loss.
            dist.all_reduce(sums)
        out["loss/pg"] = sums[0] / num_steps
        if vf_losses:
            out["critic/vf_loss"] = sums[1] / num_steps
        return out

    def _micro_slices(self, mine: TrainBatch, mini: TrainBatch) -> list[tuple[slice, bool]]:
        """This rank's micro-batches (slices of ``mine``), padded with ``(slice(0, 1), False)``
        entries up to the most any rank has, so every rank runs as many passes."""
        if self.cfg.max_tokens_per_micro_batch:
            ranges = micro_batches_by_tokens(mine.attention_mask.sum(1).tolist(), self.cfg.max_tokens_per_micro_batch)
            slices = [slice(r.start, r.stop) for r in ranges]
        else:
            slices = [slice(s, s + self.cfg.micro_batch_size) for s in range(0, len(mine), self.cfg.micro_batch_size)]
        out = [(sl, True) for sl in slices]
        if dist.get_world_size() > 1:
            count = torch.tensor([len(out)])
            dist.all_reduce(count, op=dist.ReduceOp.MAX)
            out += [(slice(0, 1), False)] * (int(count) - len(out))
        return out

    def sft_step(self, batch: TrainBatch, lr: float) -> dict[str, torch.Tensor]:
        """One supervised step: token-mean negative log-likelihood of the loss-masked tokens.

        Used by the supervised warm start, at temperature 1 and learning rate ``lr`` (the
        schedule does not advance). Returns ``{"sft/loss", "sft/grad_norm"}``.
        """
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        num_tokens, _ = count_normalizers(batch.loss_mask)
        loss_sum = torch.zeros(())
        for mb in self._micro_batches(batch):
            logits = self.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                                position_ids=mb.position_ids, use_cache=False).logits[:, :-1]
            nll = -logprobs_from_logits(logits, mb.input_ids[:, 1:], 1.0)
            loss = aggregate_loss(nll, mb.loss_mask, "token-mean", num_global_tokens=num_tokens,
                                  num_global_seqs=len(batch))
            loss.backward()
            loss_sum += loss.detach()
        # No scheduler step: the warm start's LR is constant and the RL schedule starts afterwards.
        grad_norm = clip_and_step(self.model.parameters(), self.optimizer, None, self.cfg.grad_clip)
        return {"sft/loss": loss_sum, "sft/grad_norm": grad_norm.detach()}

    # ------------------------------------------------------------------ weights out
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters by Hugging Face name (tied ones once), gathered from the shards."""
        for name, param in self.model.named_parameters():
            data = param.detach()
            yield name, data.full_tensor() if hasattr(data, "full_tensor") else data

    def weight_metadata(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """``(name, dtype, full shape)`` of what ``named_weights`` yields, in order, without
        gathering (a DTensor's shape is the global one)."""
        return [(n, p.dtype, tuple(p.shape)) for n, p in self.model.named_parameters()]

    def weight_aliases(self) -> dict[str, str]:
        """``{tied name: name sent}`` for parameters ``named_weights`` yields once under another
        name (tied embeddings: ``{"lm_head.weight": "model.embed_tokens.weight"}``)."""
        from async_rl.weight_sync import tied_aliases

        return tied_aliases(self.model)

    def export_hf(self, out_dir: str, tokenizer=None) -> None:
        """Write the current policy as a Hugging Face directory (safetensors) to ``out_dir``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() == 0:
            self.model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
            if tokenizer is not None:
                tokenizer.save_pretrained(out_dir)
