"""The generator pool: long-running Ray actors that sample, score and stream trajectories.

::

    controller ──GroupRequest──> ray.util.queue.Queue ──get──> GeneratorWorker k (own engine)
                                                               │ each sample as it finishes:
                                                               │ decode, score, Trajectory
                                                               v
                        ReplayBuffer <── receiver thread <── ZMQ PULL <── PUSH (one per worker)
                                                               ^
                                       GroupClosed(g, kept) ───┘ once all n samples of g are scored

Each worker pulls as many queued groups as fit its engine batch (blocking for the first), samples
them with per-group seeds (so which worker samples a group does not change its tokens), and sends
each accepted trajectory the moment its sample finishes decoding; a sample rejected by the reward
is counted and announced through ``GroupClosed`` with the group's number of kept samples, so the
buffer can complete groups with rejections. Ray carries only control (requests, weights, stats);
trajectories travel over ZeroMQ as msgpack.

New weights arrive through ``receive_weights`` (the weight sync layer, ``async_rl.weight_sync``)
on a second actor thread while ``run`` decodes in the first; the engine loads them between
decoding steps (HF) or paused (vLLM) and the call returns once they are in use, so waiting on
every worker's call is the barrier after which the new policy version is the only one generating.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class GroupRequest:
    """One prompt to sample ``n`` responses for, as group ``group_id``.

    Attributes:
        group_id: the group's id (unique per run); trajectory ids are ``"<group_id>/<j>"``.
        prompt_ids: rendered prompt token ids.
        prompt_uid: the dataset identity of the prompt.
        data_source, ground_truth, extra_info: what the reward function needs.
        n: samples in the group (>= 1).
        seed: sampling seed of the group (``controller.group_seed``).
        messages: the prompt's chat messages (multi-turn tool use continues the conversation).
    """

    group_id: int
    prompt_ids: list[int]
    prompt_uid: str
    data_source: str
    ground_truth: str | None
    extra_info: dict[str, Any]
    n: int
    seed: int
    messages: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class WorkerStats:
    """Counters of one worker since it started (seconds, tokens, groups)."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    generated_tokens: int = 0
    groups: int = 0
    samples: int = 0
    rejected_samples: int = 0
    weight_updates: int = 0
    weight_update_s: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)


class GeneratorWorker:
    """A generator actor: one engine, one reward scorer, one ZMQ sender (wrap with ``ray.remote``).

    Args:
        worker_id: index in the pool (for logs).
        model_path: Hugging Face model directory of the starting weights.
        tokenizer_path: tokenizer directory (decodes responses for the reward).
        gen_cfg: ``GeneratorConfig``.
        params: ``SamplingParams`` of training rollouts.
        reward_fn: reward spec (``reward.fn``), or ``None`` to dispatch on ``data_source``.
        on_error: ``reward.on_error``.
        sender: ``ZmqSenderFactory`` (or any picklable callable returning a sender).
        num_threads: torch intra-op threads of this process (>= 1).
        lora: the learner's ``LoRAConfig`` (``make_generator``); ``None`` = no LoRA.
        agent_cfg: ``AgentConfig``; with tools configured each sample is a multi-turn
            conversation (``async_rl.agent``) run on this worker's engine.
    """

    def __init__(self, worker_id: int, model_path: str, tokenizer_path: str, gen_cfg, params,
                 reward_fn: str | None, on_error: str, sender, num_threads: int, lora=None, agent_cfg=None) -> None:
        import torch
        from transformers import AutoTokenizer

        from async_rl.rewards import RewardScorer, get_reward_fn
        from async_rl.generators import make_generator

        torch.set_num_threads(max(1, num_threads))
        self.worker_id = worker_id
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.engine = make_generator(gen_cfg, model_path, pad, num_threads=max(1, num_threads), lora=lora)
        self.params = params
        self.agent = None
        if agent_cfg is not None and agent_cfg.enabled:
            from async_rl.agent import AgentLoop

            self.agent = AgentLoop(agent_cfg, self.tokenizer, params.stop_token_ids)
        if reward_fn:
            fn = get_reward_fn(reward_fn)
        else:
            from async_rl.controller import _dispatch_by_source as fn
        self.scorer = RewardScorer(fn, on_error=on_error)
        self.sender = sender()
        self.stats = WorkerStats()
        self._stop = threading.Event()
        self._max_groups = max(1, gen_cfg.max_batch_size)

    # ------------------------------------------------------------------ control (second thread)
    def connect_weight_sync(self, init_info: dict, rank: int) -> None:
        """Connect the engine to the learner's ``WeightSender`` (``async_rl.weight_sync``)."""
        self.engine.connect_weight_sync(init_info, rank)

    def receive_weights(self, plan: dict, version: int) -> float:
        """Receive and load one update (loaded between decoding steps / with the engine paused);
        returns seconds until the new weights are in use."""
        t0 = time.perf_counter()
        self.engine.receive_weights(plan, version)
        dt = time.perf_counter() - t0
        self.stats.weight_updates += 1
        self.stats.weight_update_s += dt
        return dt

    def close(self) -> None:
        """Shut the engine down (vLLM: its processes)."""
        if hasattr(self.engine, "close"):
            self.engine.close()

    def stop(self) -> None:
        """Ask ``run`` to return after its current batch."""
        self._stop.set()

    def get_stats(self) -> dict[str, float]:
        """Counters so far, plus the reward scorer's (``reward/scored``, ``reward/errors``,
        ``reward/no_reward``, ``reward/rejected``; totals since the actor started)."""
        out = {k: float(v) for k, v in vars(self.stats).items() if k != "extra"}
        out.update(self.scorer.counts())
        out["in_flight_updates"] = float(self.engine.num_weight_updates_in_flight)
        if self.agent is not None:
            out.update(self.agent.counts())
        return out

    def pid(self) -> int:
        """The actor's process id (tests kill it to check re-issue)."""
        return os.getpid()

    # ------------------------------------------------------------------ the loop (first thread)
    def run(self, requests) -> dict[str, float]:
        """Serve ``requests`` (a ``ray.util.queue.Queue`` of ``GroupRequest``) until ``stop``.

        Returns:
            ``get_stats()`` at exit.
        """
        from queue import Empty

        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                first = requests.get(block=True, timeout=0.2)
            except Empty:
                self.stats.idle_s += time.perf_counter() - t0
                continue
            batch = [first]
            # Take what else is queued, up to the engine batch: bigger batches, same samples.
            while sum(r.n for r in batch) < self._max_groups:
                try:
                    batch.append(requests.get_nowait())
                except Empty:
                    break
            self.stats.idle_s += time.perf_counter() - t0
            t1 = time.perf_counter()
            self._serve(batch)
            self.stats.busy_s += time.perf_counter() - t1
        self.sender.close()
        return self.get_stats()

    def _serve(self, batch: list[GroupRequest]) -> None:
        from async_rl.controller import scored_trajectory
        from async_rl.buffers.transport import GroupClosed

        n = batch[0].n
        if any(r.n != n for r in batch):
            raise ValueError("a pool batch mixes group sizes")
        kept = [0] * len(batch)
        finished = [0] * len(batch)

        def on_sample(i: int, j: int, s) -> None:
            req = batch[i]
            self.stats.samples += 1
            self.stats.generated_tokens += sum(s.loss_mask) if hasattr(s, "final_text") else len(s.response_ids)
            traj = scored_trajectory(s, self.tokenizer, self.scorer, req.group_id, j, req.prompt_uid, req.prompt_ids,
                                     req.data_source, req.ground_truth, req.extra_info)
            if traj is None:
                self.stats.rejected_samples += 1
            else:
                kept[i] += 1
                self.sender.send(traj)
            finished[i] += 1
            if finished[i] == n:
                self.stats.groups += 1
                self.sender.send(GroupClosed(group_id=req.group_id, num_kept=kept[i]))

        if self.agent is not None:
            self.agent.run(self.engine, [(r.prompt_ids, r.messages) for r in batch], n, self.params,
                           [r.seed for r in batch], on_sample=on_sample)
            return
        self.engine.generate([r.prompt_ids for r in batch], n, self.params, seeds=[r.seed for r in batch],
                             on_sample=on_sample)
