"""The Ray-side actors of the async mode: ``GeneratorWorker`` (long-running, samples, scores and
streams trajectories) and ``RequestBroker`` (the queue that remembers who took what). The
component that places, supervises and pushes weights into them is ``loops.pool.GeneratorPool``.

::

    AsyncLoop ──GroupRequest──> RequestBroker ──take (claimed)──> GeneratorWorker k (own engine)
                                                               │ each sample as it finishes:
                                                               │ decode, submit to its reward
                                                               │ workers; scored: Trajectory,
                                                               │ kept until its group is closed
                                                               v
    ReplayBuffer <── receiver thread <── ZMQ PULL <── PUSH (one per worker) <── TrajectoryGroup(g, kept
    (trajectories, then GroupClosed)                      trajectories) once all n samples of g are scored

The dispatcher queues every group admission allows at once (``RequestBroker.put_many``). Each
worker pulls as many queued groups as fit its engine batch (blocking for the first), idle workers
splitting what is queued, samples them with per-group seeds (so which worker samples a group
does not change its tokens), scores each sample the moment it finishes (in the actor's own
reward worker processes while its engine decodes on), and once all ``n`` samples of a group are
scored sends the group's kept trajectories as one ``TrajectoryGroup`` message, which the receiver
hands on as the trajectories and a ``GroupClosed`` with the group's number of kept samples (a
sample rejected by the reward is counted and left out), so the buffer can complete groups with
rejections. Ray carries only control (requests, weights, stats); trajectories travel over
ZeroMQ as msgpack.

New weights arrive through ``receive_weights`` (the weight sync layer, ``async_rl.weight_sync``)
on a second actor thread while ``run`` decodes in the first; the engine loads them between
decoding steps (HF) or paused (vLLM) and the call returns once they are in use, so waiting on
every worker's call is the barrier after which the new policy version is the only one generating.

Requests go through a ``RequestBroker`` actor rather than a plain queue: a worker takes its batch
from it under its own index, so when a worker dies the broker can say exactly which groups it held
(``reclaim``), and the trainer re-issues those once (``GeneratorPool``'s supervision, through
``Dispatcher.requeue``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass

import ray
import torch
from transformers import AutoTokenizer

from async_rl.data.dataset import image_processing_for
from async_rl.step.episodes import make_episode_loop
from async_rl.buffers.transport import TrajectoryGroup
from async_rl.runtime.cluster import group_ip, pin_process, use_node_interface, where
from async_rl.generators import make_generator
from async_rl.rewards.config import RewardConfig
from async_rl.rewards.teacher import TeacherStage
from async_rl.step.rollout import GroupRequest, SampleCounts, make_scorer, sample_groups

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats(SampleCounts):
    """Counters of one worker since it started: the rollout counts (``SampleCounts``), seconds
    busy sampling and idle waiting for requests, weight updates and their load time (seconds)."""

    busy_s: float = 0.0
    idle_s: float = 0.0
    served_tokens: int = 0
    """Tokens of the batches ``busy_s`` counts (those whose ``_serve`` returned): the numerator of
    an engine's busy speed (``generated_tokens`` also counts the batch still decoding)."""
    weight_updates: int = 0
    weight_update_s: float = 0.0


class RequestBroker:
    """The pool's request queue, which remembers who took what (wrap with ``ray.remote``, threaded).

    A worker's ``take`` is atomic here, in one actor, so at every moment each dispatched request
    is either queued or claimed by exactly one worker (a ``(worker index, incarnation)`` pair):
    what ``reclaim`` returns for a dead worker is all it held and nothing another worker holds,
    and a ``take`` the dead worker sent before dying that arrives afterwards claims nothing.
    Claims stay until the trainer ``forget``s groups that ended, since a worker that finished
    sampling a group may die before its last messages leave its socket.
    """

    def __init__(self, num_workers: int = 1) -> None:
        if num_workers < 1:
            raise ValueError(f"RequestBroker: num_workers must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        """The pool's size (``generator.num_workers``): an evaluation waits until every live worker is idle."""
        self._down: dict[int, int] = {}
        """Worker index -> the incarnation reclaimed last, until a newer incarnation takes (its replacement is up)."""
        self._queue: deque[GroupRequest] = deque()
        self._eval_queue: deque[GroupRequest] = deque()
        """Evaluation groups (``put_eval``): handed out only while no training request waits and
        every live worker is idle."""
        self._evaluating: tuple[int, int] | None = None
        """The worker sampling evaluation groups now: one at a time, so the others stay free for
        the training requests that arrive meanwhile."""
        self._claims: dict[tuple[int, int], dict[int, GroupRequest]] = {}  # worker -> group id -> request
        self._dead: set[tuple[int, int]] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._takers = 0
        """Workers inside ``take`` now (waiting for requests, or woken and not yet served)."""

    def put(self, request: GroupRequest) -> None:
        """Queue one request (``GroupRequest``) behind the others."""
        self.put_many([request])

    def put_many(self, requests: list[GroupRequest]) -> None:
        """Queue ``requests`` behind the others, in order, at once: workers waiting in ``take``
        then see them together and share them, instead of the first waking with only the first
        (a batch of one group that decodes to its longest row on its own)."""
        with self._cond:
            self._queue.extend(requests)
            self._cond.notify_all()

    EVAL_TAKE_SAMPLES = 8
    """Most samples of evaluation groups one ``take`` hands out (at least one group): a worker
    busy with an evaluation batch cannot serve a training request that arrives meanwhile, so the
    batches are kept short and the worker asks again (training first) after each. Measured on the
    default job in async mode (``bench/bench_pool_eval.py``): 8 against 32 samples cut the
    learner's slowdown while an evaluation runs from 1.20x to 1.12x before the all-idle rule
    (``put_eval``), and to 1.06x with it."""

    def put_eval(self, requests: list[GroupRequest]) -> None:
        """Queue an evaluation's groups (each with its own ``params``). They fill the pool's
        idle time: ``take`` hands them out only while no training request is queued and every
        live worker (``num_workers`` less those reclaimed and not yet replaced) is idle in
        ``take``, to one worker at a time and ``EVAL_TAKE_SAMPLES`` at a time. So an evaluation
        never holds back a sample the learner waits for: when training requests arrive, the other
        workers are free to take them at once, and the evaluating one is back after a short
        batch. (Handing evaluation groups to any idle worker while another was busy with training
        left the training to fewer workers: the learner then waited for data, 1.12-1.20x slower
        steps while an evaluation ran on the default job, against 1.03x with the rule.) Not
        claimed, not in ``qsize``, not re-issued: the exactly-once accounting is the training
        groups'; an evaluation a dead worker held is abandoned as a whole (``drop_eval``)."""
        with self._cond:
            self._eval_queue.extend(requests)
            self._cond.notify_all()

    def drop_eval(self) -> int:
        """Forget the queued evaluation groups; returns how many."""
        with self._cond:
            dropped = len(self._eval_queue)
            self._eval_queue.clear()
            return dropped

    def take(self, worker: tuple[int, int], max_samples: int, timeout_s: float) -> list[GroupRequest]:
        """Claim queued requests for ``worker`` (index, incarnation): the first (waiting up to ``timeout_s`` seconds
        for one), then more while the claimed samples (``n`` each) are fewer than ``max_samples``
        and the requests fewer than this worker's share of the queue: its length divided by the
        workers inside ``take`` (those idle now), rounded up, so idle workers split what is queued
        and a busy worker's share is not left waiting.

        Returns:
            The claimed requests, oldest first; empty if none came in time, the broker closed, or
            ``worker`` was reclaimed.
        """
        with self._cond:
            if self._evaluating == worker:  # back for more: its evaluation groups are sampled
                self._evaluating = None
            if worker in self._dead:  # a take sent before it died: nothing, and not an idle worker
                return []
            index, incarnation = worker
            if index in self._down and incarnation > self._down[index]:
                del self._down[index]  # the replacement of a reclaimed worker is up
            self._takers += 1
            self._cond.notify_all()  # one more idle worker: an evaluation may be due
            try:
                ready = self._cond.wait_for(lambda: self._queue or self._closed or (
                    self._eval_queue and self._evaluating is None and self._all_idle()), timeout=timeout_s)
                if not ready or self._closed or worker in self._dead:
                    return []
                if not self._queue:  # idle: a few of an evaluation's groups (EVAL_TAKE_SAMPLES)
                    limit = min(max_samples, self.EVAL_TAKE_SAMPLES)
                    batch = [self._eval_queue.popleft()]
                    while self._eval_queue and sum(r.n for r in batch) + self._eval_queue[0].n <= limit:
                        batch.append(self._eval_queue.popleft())
                    self._evaluating = worker
                    return batch
                share = -(-len(self._queue) // self._takers)
            finally:
                self._takers -= 1
            batch = [self._queue.popleft()]
            while self._queue and len(batch) < share and sum(r.n for r in batch) < max_samples:
                batch.append(self._queue.popleft())
            claims = self._claims.setdefault(worker, {})
            for r in batch:
                claims[r.group_id] = r
            return batch

    def _all_idle(self) -> bool:
        """Every live worker is inside ``take`` (the caller holds the lock)."""
        return self._takers >= self.num_workers - len(self._down)

    def reclaim(self, worker: tuple[int, int]) -> list[GroupRequest]:
        """Every request ``worker`` (index, incarnation) claimed that the trainer has not
        ``forget``-ten; from now on ``worker`` claims nothing. Call once it is dead or killed."""
        with self._cond:
            self._dead.add(worker)
            index, incarnation = worker
            self._down[index] = max(incarnation, self._down.get(index, -1))
            self._cond.notify_all()  # one live worker fewer: the others may be all that is left
            if self._evaluating == worker:
                self._evaluating = None
                self._cond.notify_all()
            return list(self._claims.pop(worker, {}).values())

    def forget(self, group_ids: list[int]) -> None:
        """Drop the claims on groups that ended (trained, rejected, evicted or abandoned)."""
        with self._cond:
            for claims in self._claims.values():
                for g in group_ids:
                    claims.pop(g, None)

    def claimed(self) -> dict[tuple[int, int], list[int]]:
        """Group ids claimed per worker (index, incarnation), not yet forgotten."""
        with self._cond:
            return {w: sorted(c) for w, c in self._claims.items()}

    def qsize(self) -> int:
        """Requests queued and not yet claimed."""
        with self._cond:
            return len(self._queue)

    def close(self) -> list[GroupRequest]:
        """Stop handing out requests (every ``take`` returns empty from now on); returns the
        requests still queued, for the ledger."""
        with self._cond:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
            return left


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
        reward_cfg: the ``RewardConfig`` (``reward.num_workers``, ``reward.timeout_s``, the reward
            model's settings; its ``fn`` and ``on_error`` are the two above); ``None``: defaults.
        reward_model: the reward actor (``RewardModel`` under ``ray.remote``) scoring this
            worker's samples in batches; the worker keeps sampling while it scores.
        teacher: the teacher actor of on-policy distillation (``TeacherModel`` under
            ``ray.remote``) giving this worker's training samples their teacher log-probs, in
            batches of up to ``teacher_batch_size``, before their group is sent; ``None``: none.
        incarnation: how many times the pool replaced the actor at ``worker_id`` before this one
            (its claims at the ``RequestBroker`` are kept apart from its predecessors').
        bind_host: the run's ``Cluster.bind_host`` (loopback: this actor's groups use loopback too).
        env_cfg: ``EnvConfig`` (``async_rl.step.episodes.rollout_env_config``: ``env``, the
            ``tools`` environment of ``agent.tools``, or ``single_turn``); with a name set each
            sample is an episode of the environment (``async_rl.step.episodes``), whose first
            observation may have at most ``max_prompt_tokens`` tokens; ``None`` (tests and
            benches driving an engine directly): plain samples, one engine call per batch.
        data_cfg: the run's ``DataConfig``: a vision-language policy's observation images are
            processed within its ``image_min_pixels`` .. ``image_max_pixels``; ``None``: the
            processor's own bounds.
    """

    def __init__(self, worker_id: int, model_path: str, tokenizer_path: str, gen_cfg, params,
                 reward_fn: str | None, on_error: str, sender, num_threads: int, lora=None,
                 reward_cfg=None, reward_model=None, incarnation: int = 0, bind_host: str | None = None,
                 env_cfg=None, max_prompt_tokens: int = 0, teacher=None, teacher_batch_size: int = 16,
                 data_cfg=None) -> None:
        # First: the engine's threads and processes inherit the mask (generator.cpu_affinity).
        pin_process(gen_cfg.cpu_affinity, "generator.cpu_affinity")
        torch.set_num_threads(max(1, num_threads))
        # Before the engine starts: its processes inherit it, and a broadcast group on another
        # node then announces this node's address, on a single node loopback (async_rl.runtime.cluster).
        use_node_interface(group_ip(bind_host))
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # a bar per model load, in every actor's log
        self.worker_id = worker_id
        self.incarnation = incarnation
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.engine = make_generator(gen_cfg, model_path, pad, num_threads=max(1, num_threads), lora=lora)
        self.params = params
        # A vision-language policy's observations may hold images, processed here as the
        # trainer's dataset processes a row's (same processor, same data.image_*_pixels).
        self.agent = (make_episode_loop(env_cfg, self.tokenizer, params.stop_token_ids, max_prompt_tokens, params,
                                        images=image_processing_for(model_path, data_cfg))
                      if env_cfg is not None and env_cfg.enabled else None)
        # This actor's own reward workers (reward.num_workers processes, started on the first
        # sample): a reward function that hangs or crashes costs a sample, never this engine.
        reward_cfg = dataclasses.replace(reward_cfg or RewardConfig(), fn=reward_fn, on_error=on_error,
                                         model=(reward_cfg.model if reward_model is not None else None))
        stage = (TeacherStage(lambda items: ray.get(teacher.scores.remote(items)), teacher_batch_size)
                 if teacher is not None else None)
        self.scorer = make_scorer(reward_cfg, on_error, reward_model and (
            lambda items: ray.get(reward_model.score.remote(items))), teacher=stage)
        self.sender = sender()
        self._unsent: dict[int, list] = {}  # group id -> its kept trajectories until the group is closed
        self.stats = WorkerStats()
        self.eval_stats = SampleCounts()
        """Samples of evaluation groups (not the rollouts' throughput)."""
        self._eval_executor = None
        self._stop = threading.Event()
        self._max_groups = max(1, gen_cfg.max_batch_size)
        self._last_progress = time.monotonic()

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
        self._beat()
        return dt

    def close(self) -> None:
        """Stop the reward workers and shut the engine down (vLLM: its processes), then run this
        actor process's exit handlers: ``GeneratorPool.close`` kills the actor next, which runs
        none (``async_rl.utils.leftovers.run_exit_handlers``; the ``pymp-*`` directory of an SGLang
        engine's weight loads would be left)."""
        from async_rl.utils.leftovers import run_exit_handlers

        try:
            self.scorer.close()
            self.engine.close()
        finally:
            run_exit_handlers()

    def stop(self) -> None:
        """Ask ``run`` to return after its current batch."""
        self._stop.set()

    def get_stats(self) -> dict[str, float]:
        """Counters so far, plus the reward scorer's (``reward/scored``, ``reward/errors``,
        ``reward/no_reward``, ``reward/rejected``, ``reward/timeouts``, ``reward/crashed``,
        ``reward/too_large``; totals since the actor started)."""
        out = {k: float(v) for k, v in vars(self.stats).items()}
        out.update(self.scorer.counts())
        out["in_flight_updates"] = float(self.engine.num_weight_updates_in_flight)
        if self.agent is not None:
            out.update(self.agent.counts())
        return out

    def probe(self, prompts: list[list[int]], max_tokens: int) -> dict:
        """Greedy-decode ``prompts`` with the engine's current weights (call once ``run`` has
        returned): the check that the weights it holds are the learner's (``weight_sync.probe_at_exit``).

        Returns:
            ``{"worker", "policy_version", "node_id", "node_ip", "hostname", "pid",
            "response_ids": [[int]], "logprobs": [[float]]}``, one row per prompt.
        """
        params = dataclasses.replace(self.params, greedy=True, max_tokens=max_tokens)
        rows = self.engine.generate(prompts, 1, params, seeds=[0] * len(prompts))
        return {"worker": self.worker_id, "policy_version": int(self.engine.policy_version), **where(),
                "response_ids": [r[0].response_ids for r in rows], "logprobs": [r[0].logprobs for r in rows]}

    def reward_first_error(self) -> str | None:
        """This actor's first reward failure and where it happened (``RewardScorer.first_error``)."""
        return self.scorer.first_error

    # ------------------------------------------------------------------ the loop (first thread)
    def run(self, requests) -> dict[str, float]:
        """Serve ``requests`` (a ``RequestBroker`` actor) until ``stop``: take a batch under this
        worker's index, sample it, repeat.

        Returns:
            ``get_stats()`` at exit.
        """
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._beat()
            # Take what is queued, up to the engine batch: bigger batches, same samples.
            batch = ray.get(requests.take.remote((self.worker_id, self.incarnation), self._max_groups, 0.2))
            self.stats.idle_s += time.perf_counter() - t0
            if not batch:
                continue
            self._beat()
            t1, n0 = time.perf_counter(), self.stats.generated_tokens
            self._serve(batch)
            self.stats.busy_s += time.perf_counter() - t1
            self.stats.served_tokens += self.stats.generated_tokens - n0
        self.scorer.drain()  # the last batch's samples are scored and go out before the sender closes
        self.sender.close()
        return self.get_stats()

    def _beat(self) -> None:
        self._last_progress = time.monotonic()

    def heartbeat(self) -> dict[str, float]:
        """Seconds since this worker last made progress (took requests, finished a sample, loaded
        weights, or polled an empty queue), and its process id: the supervisor's liveness probe."""
        return {"since_progress_s": time.monotonic() - self._last_progress, "pid": float(os.getpid())}

    def _keep(self, traj) -> None:
        traj.generator_id = self.worker_id  # which actor (and so which node) sampled it
        self._unsent.setdefault(traj.group_id, []).append(traj)
        self._beat()

    def _send_group(self, request, kept: int) -> None:
        # The whole group as one message (its kept trajectories, closing it): the buffer admits a
        # group only once it is complete, so holding its samples here until the last is scored
        # delays nothing the learner sees, and the wire pays one message's fixed cost per group
        # instead of n + 1 (bench/bench_transport.py).
        trajectories = self._unsent.pop(request.group_id, [])
        if len(trajectories) != kept:
            # An internal invariant (the rollout road counted what it handed to _keep); a raise,
            # not an assert, so that `python -O` cannot send a group short without a word.
            raise RuntimeError(f"group {request.group_id}: {len(trajectories)} trajectories held for sending, "
                               f"but the rollout kept {kept}")
        self.sender.send(TrajectoryGroup(request.group_id, trajectories))
        self._beat()

    def _serve(self, batch: list[GroupRequest]) -> None:
        # The one rollout road of both modes (async_rl.step.rollout): here each kept trajectory is
        # held the moment its sample is scored, and the group sent as one message once all n are.
        train = [r for r in batch if r.params is None]
        if train:
            sample_groups(self.engine, train, self.params, self.tokenizer, self.scorer, self.agent,
                          on_trajectory=self._keep, on_group_closed=self._send_group,
                          counts=self.stats, wait_scored=False)
        # Evaluation groups (RequestBroker.put_eval): one engine call per sampling setting and
        # group size, kept out of the rollout counters (the run's throughput and tool figures).
        kinds: dict[tuple, list[GroupRequest]] = {}
        for r in batch:
            if r.params is not None:
                kinds.setdefault((r.params, r.n), []).append(r)
        for (params, _), requests in kinds.items():
            def evaluate(requests=requests, params=params) -> None:
                with self.agent.counted_apart() if self.agent is not None else contextlib.nullcontext():
                    sample_groups(self.engine, requests, params, self.tokenizer, self.scorer, self.agent,
                                  on_trajectory=self._keep, on_group_closed=self._send_group,
                                  counts=self.eval_stats, wait_scored=False, with_teacher=False)

            # On a thread of the lowest CPU priority (this one waits for it, so the engine still
            # serves one call at a time): evaluation takes what the learner and the other actors
            # leave of the cores, which is what "idle time" means on a machine they share.
            self._idle_priority().submit(evaluate).result()

    def _idle_priority(self):
        """The single thread evaluation groups are sampled on, at nice 19 (``os.setpriority`` on
        its thread id; Linux). An engine whose decoding runs in processes of its own (vLLM,
        SGLang) keeps their priority; torch's intra-op threads (``threads_per_worker`` > 1) are
        shared with the rollouts' and keep theirs."""
        if self._eval_executor is None:
            from concurrent.futures import ThreadPoolExecutor

            def lower() -> None:
                with contextlib.suppress(OSError, AttributeError):  # not Linux, or not allowed: as is
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)

            self._eval_executor = ThreadPoolExecutor(1, thread_name_prefix="evaluation", initializer=lower)
        return self._eval_executor
