"""The generator pool of the async loop: places the generator actors (``loops.actors``), supervises
and restarts them, and owns every push of weights into them.

* **Placement**: each actor in its bundle of the run's placement group (``placer``).
* **Publication**: the learner's weights go to every actor through the weight sync layer
  (``async_rl.weight_sync``: shared-memory buckets on one host, or a gloo/NCCL broadcast group);
  the version counts as published, for admission, only once all actors hold it. With
  ``weight_sync.overlap_push`` the learner only stages its weights and a background thread
  pushes them (``WeightPublisher.start_push``); one push at a time: the next push, a checkpoint,
  an evaluation's engine sync and ``close`` collect the pending one first (``settle``), and its
  failure is raised on the learner's thread and handled as a blocking push's would be.
* **Supervision**: an actor that dies, or makes no progress and does not answer for
  ``generator.heartbeat_timeout_s``, is found while the learner waits for data or pushes weights.
  The groups it had claimed at the ``RequestBroker`` go back to dispatch (the ``lost`` callback:
  ``Dispatcher.requeue``); the actor is replaced in its placement bundle, up to
  ``generator.max_restarts`` times, and the current weights pushed to the pool again before the
  replacement samples. With no actor left the run stops with an error naming each actor's end.

Supervision and publication live together because a push is where a death often shows, and a
replacement needs a push: neither calls across a file boundary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import ray

from async_rl.runtime.cluster import PlacementConfig, started_on
from async_rl.utils.cpu_threads import available_cores
from async_rl.loops.actors import GeneratorWorker
from async_rl.loops.base import GeneratorsGone  # noqa: F401  (raised here; defined where importing needs no Ray)
from async_rl.rewards import check_rewards_work
from async_rl.step.episodes import rollout_env_config
from async_rl.weight_sync import RayTarget, WeightPublisher, engine_protocol, transports_for_targets

logger = logging.getLogger(__name__)


def thread_budget(num_workers: int, threads_per_worker: int, cores: int | None = None,
                  user_threads: int = 0) -> tuple[int, int]:
    """``(threads per worker, learner threads)`` for ``num_workers`` generator processes.

    With ``threads_per_worker = 0`` the cores are split evenly between the workers and the
    learner (each at least 1); the learner gets what the workers leave. ``cores`` defaults to
    this process's CPU affinity (``available_cores``), not the machine's core count: a run
    pinned to 2 of 64 cores must not start 64 threads per process. ``user_threads`` (the user's
    ``OMP_NUM_THREADS``, 0 if unset) is every process's count where it has none of its own
    (``threads_per_worker``), as OpenMP would have it.

    Example: 2 workers on 16 cores -> ``(5, 6)``; on 2 cores -> ``(1, 1)`` (never 0 threads).
    """
    if user_threads:
        return threads_per_worker or user_threads, user_threads
    cores = cores or available_cores()
    per_worker = threads_per_worker or max(1, cores // (num_workers + 1))
    return per_worker, max(1, cores - num_workers * per_worker)


def engine_tokens_per_s(delta: dict[str, float], total: dict[str, float]) -> float | None:
    """The pool's engines' busy speed for one step's metrics, in tokens per busy second: the
    tokens of the batches that ended (``served_tokens``) over the seconds they took (``busy_s``),
    from this step's counters ``delta`` or, when no batch ended during the step (one long batch),
    from the run's so far ``total``; ``None`` before any batch ended. (A step's tokens over a busy
    time that does not hold them read as billions per second.)"""
    for counters in (delta, total):
        busy = counters.get("busy_s", 0.0)
        if busy > 0:
            return counters.get("served_tokens", 0.0) / busy
    return None


def probe_difference(reference: dict, probe: dict) -> dict[str, Any]:
    """How far an engine's greedy probe (``GeneratorWorker.probe``) is from ``reference``:
    ``tokens_equal`` (every row's ids), ``max_abs_logprob_diff`` over the common prefix of
    each row (nats), and whether the policy versions agree."""
    diff = 0.0
    for ids_a, lp_a, ids_b, lp_b in zip(reference["response_ids"], reference["logprobs"],
                                        probe["response_ids"], probe["logprobs"]):
        same = 0
        while same < min(len(ids_a), len(ids_b)) and ids_a[same] == ids_b[same]:
            same += 1
        diff = max([diff] + [abs(a - b) for a, b in zip(lp_a[:same], lp_b[:same])])
    return {"tokens_equal": reference["response_ids"] == probe["response_ids"], "max_abs_logprob_diff": diff,
            "same_version": reference["policy_version"] == probe["policy_version"]}


def placer(ctx, cluster, worker_args: tuple, reward_actor, teacher_actor=None) -> Callable[[list[int] | None, int], list]:
    """The function that starts generator actors (all, with ``indices=None``, or those at
    ``indices``) under ``incarnation`` in their bundles of the run's placement group
    (``generator.num_cpus_per_worker``, ``num_gpus_per_worker``, ``node_labels``,
    ``placement_strategy``). ``worker_args``: ``(tokenizer path, reward fn, sender factory,
    threads per worker)``; ``reward_actor`` and ``teacher_actor`` (``None``: none) score every
    worker's samples. A replacement loads the warm start's model; the pool then pushes it the
    current weights."""
    cfg, g_cfg = ctx.cfg, ctx.cfg.generator
    tok_path, reward_fn, sender_factory, per_worker = worker_args

    def place(indices: list[int] | None = None, incarnation: int = 0) -> list:
        placement = PlacementConfig.of_generators(g_cfg)
        bundle = placement.bundle(cuda=False)
        strategies = cluster.place("generators", g_cfg.num_workers, placement)
        # max_concurrency: run() decodes on one thread while weights and stats arrive on others.
        worker_cls = ray.remote(max_concurrency=3)(GeneratorWorker)
        return [worker_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                   scheduling_strategy=strategies[i]).remote(
                    i, ctx.model_path, tok_path, g_cfg, ctx.params, reward_fn, cfg.reward.on_error, sender_factory,
                    per_worker, cfg.learner.lora, reward_cfg=cfg.reward, reward_model=reward_actor,
                    teacher=teacher_actor, teacher_batch_size=cfg.algorithm.distill.batch_size,
                    env_cfg=rollout_env_config(cfg), max_prompt_tokens=cfg.data.max_prompt_tokens,
                    data_cfg=cfg.data, incarnation=incarnation, bind_host=cluster.bind_host)
                for i in (range(g_cfg.num_workers) if indices is None else indices)]
    return place


def root_cause(error: BaseException) -> str:
    """``<type>: <first line>`` of what ended an actor's ``run``, at most 300 characters. Ray wraps
    an exception raised inside an actor in a ``RayTaskError`` whose text starts with the actor's
    traceback header; its ``cause`` is the exception the actor raised (for a dead vLLM engine,
    ``EngineDied`` naming the root cause its processes logged), so that one is named."""
    cause = getattr(error, "cause", None)
    if isinstance(cause, BaseException):
        error = cause
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


class GeneratorPool:
    """The generator actors of one async run: where they run, whether they live, which weights
    they hold.

    Args:
        ctx: the run's ``RunContext`` (its ``cfg``, ``learner``, ``log``, ``run_dir``,
            ``service_cores``).
        cluster: the run's ``cluster.Cluster`` (placement records, ``placement.json``).
        broker: the ``RequestBroker`` actor the workers take requests from.
        place: starts actors (``placer``'s result).
        lost: ``lost(held)`` takes a dead actor's claimed requests back (``Dispatcher.requeue``
            with the buffer's abandon) and returns how many were re-issued.
        on_published: called once every actor holds a new version (wakes the dispatcher).
        ray_api: the module the pool calls for ``get``/``wait``/``kill`` (``ray``; a fake in tests).

    Attributes:
        workers: actor handles by index, ``None`` for an index retired past ``generator.max_restarts``.
        restarts: replacements so far, per index.
        published_version: the version every live actor holds (``-1`` before the first push).
        push_metrics: background pushes' metrics collected on the learner's thread, reported
            with its next step.
    """

    def __init__(self, ctx, cluster, broker, place: Callable[..., list], lost: Callable[[list], int],
                 on_published: Callable[[], None], ray_api: Any = ray) -> None:
        self.ctx, self.cluster, self.broker = ctx, cluster, broker
        self._place, self._lost, self._announce, self._ray = place, lost, on_published, ray_api
        self.overlap = ctx.cfg.weight_sync.overlap_push
        self.workers: list[Any] = []
        self.run_refs: list[Any] = []
        self.restarts: list[int] = []
        self.publisher: WeightPublisher | None = None
        self.transport = ""
        self.published_version = -1
        self.push_metrics: dict[str, float] = {}
        # Each index's last counters and last heartbeat probe (object ref, seconds sent), the
        # counters of actors that died, and how each retired index ended.
        self._stats_by_worker: dict[int, dict[str, float]] = {}
        self._retired_stats: dict[str, float] = {}
        self._beats: dict[int, tuple[Any, float]] = {}
        self._ends: dict[int, str] = {}
        self._starting: set[int] = set()  # replaced, waiting for the weights before they sample
        self._killed: dict[int, str] = {}  # killed as hung, not yet replaced: why
        # The heartbeat probes run on the learner's thread and, through ``_watch``, on a
        # background push's.
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ start and stop
    def place_all(self) -> list[dict]:
        """Start every actor and record where (``cluster.record``); checks each is reachable.
        Returns their placement entries."""
        self.workers = self._place()
        self.restarts = [0] * len(self.workers)
        spots = self.cluster.record("generators", self.workers)
        self.cluster.check_reachable("generator", spots)
        return spots

    def start(self) -> None:
        """Connect the weight sync to every actor, push the learner's (warm-started or resumed)
        weights unsupervised (supervision starts with the runs), and start each actor's ``run``."""
        self.connect(supervised=False)
        self.publisher.push(self.ctx.learner.version)
        self.published_version = self.ctx.learner.version
        self.run_refs = [w.run.remote(self.broker) for w in self.workers]

    def active(self) -> list[int]:
        """Indices of the actors not retired."""
        return [i for i, w in enumerate(self.workers) if w is not None]

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask every live actor to stop sampling and wait for each ``run`` to end (all within
        ``timeout_s``); one dead actor does not cut short the wait for the others."""
        active = self.active()
        for i in active:
            self.workers[i].stop.remote()
        deadline = time.monotonic() + timeout_s
        for i in active:
            try:
                self._ray.get(self.run_refs[i], timeout=max(0.1, deadline - time.monotonic()))
            except Exception as e:  # a dead worker was already reported by step()
                logger.warning("generator actor %d stop: %s", i, e)

    def close(self) -> None:
        """Shut every engine down, close the weight publisher and kill the actors."""
        active = self.active()
        try:
            self._ray.get([self.workers[i].close.remote() for i in active], timeout=60)
        except Exception as e:
            logger.warning("generator engine shutdown: %s", e)
        if self.publisher is not None:  # None: a supervised reconnection failed
            self.publisher.close()
        for i in active:
            self._ray.kill(self.workers[i])

    # ------------------------------------------------------------------ counters
    def stats(self, timeout_s: float = 5.0) -> dict[str, float]:
        """The pool's counters summed (``actors.WorkerStats``): each live actor's (its last answer,
        if it does not answer within ``timeout_s``: supervision deals with it) plus those of the
        actors that died."""
        active = self.active()
        refs = [self.workers[i].get_stats.remote() for i in active]
        self._ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for i, ref in zip(active, refs):
            try:
                self._stats_by_worker[i] = self._ray.get(ref, timeout=0)
            except Exception:  # noqa: BLE001 - dead or slow: keep its last counters
                pass
        total = dict(self._retired_stats)
        for i in active:
            for k, v in self._stats_by_worker.get(i, {}).items():
                total[k] = total.get(k, 0.0) + v
        return total

    def reward_first_error(self) -> str | None:
        """The first reward-function error any live actor saw, or ``None``."""
        errors = [e for e in self._ray.get([self.workers[i].reward_first_error.remote() for i in self.active()])
                  if e is not None]
        return errors[0] if errors else None

    def check_rewards(self, since: dict[str, float], needed: int, where: str) -> bool:
        """Whether the actors' reward function was judged: ``False`` until they have scored
        ``needed`` samples since the counters ``since`` (``stats``), then ``True``.

        Raises:
            ValueError: it failed on every one of those calls (``rewards.check_rewards_work``,
                naming ``where`` and the first error)."""
        stats = self.stats()
        window = {k: stats.get(k, 0.0) - since.get(k, 0.0)
                  for k in ("reward/scored", "reward/errors", "reward/model_scored", "reward/model_errors")}
        if max(window["reward/scored"], window["reward/model_scored"]) < needed:
            return False
        if (window["reward/errors"] >= window["reward/scored"]
                or window["reward/model_errors"] >= window["reward/model_scored"]):
            check_rewards_work(window, self.reward_first_error(), where)
        return True

    def probe_engines(self, sync_trainer_engine: Callable[[], None], num_prompts: int = 4,
                      max_tokens: int = 16) -> dict[str, float]:
        """``weight_sync.probe_at_exit``: every live actor's engine (``GeneratorWorker.probe``)
        and the trainer's own, given the learner's weights by ``sync_trainer_engine()`` once the
        actors answered, greedily decode the same ``num_prompts`` prompts (validation set, else
        training set) for up to ``max_tokens`` tokens. The tokens and log-probs, with where each
        engine ran, go to ``<run_dir>/engine_probe.json``. Returns the largest log-prob
        difference over the tokens both produced (nats) and the number of actors whose tokens
        differ (``weight_sync/probe_*``); nothing when an actor fails or does not answer within
        300 s (logged)."""
        ctx = self.ctx
        ds = ctx.val_ds if ctx.val_ds is not None and len(ctx.val_ds) else ctx.train_ds
        prompts = [list(p.prompt_ids) for p in ds.prompts[:num_prompts]]
        try:
            probes = self._ray.get([self.workers[i].probe.remote(prompts, max_tokens) for i in self.active()],
                                   timeout=300)
        except Exception as e:  # a dead worker was already reported by step()
            logger.warning("engine probe: %s", e)
            return {}
        sync_trainer_engine()
        params = dataclasses.replace(ctx.eval_params, greedy=True, max_tokens=max_tokens)
        rows = ctx.generator.generate(prompts, 1, params, seeds=[0] * len(prompts))
        ref = {"policy_version": int(ctx.learner.version),
               "response_ids": [r[0].response_ids for r in rows], "logprobs": [r[0].logprobs for r in rows]}
        diffs = [probe_difference(ref, p) for p in probes]
        (ctx.run_dir / "engine_probe.json").write_text(json.dumps(
            {"prompts": prompts, "max_tokens": max_tokens, "trainer_engine": ref, "actors": probes,
             "differences": diffs}, indent=1))
        return {"weight_sync/probe_max_abs_logprob_diff": max(d["max_abs_logprob_diff"] for d in diffs),
                "weight_sync/probe_token_mismatches": float(sum(not d["tokens_equal"] for d in diffs))}

    # ------------------------------------------------------------------ publication
    def connect(self, supervised: bool = True) -> None:
        """(Re)build the weight publisher over the live actors: per actor, shared memory on the
        trainer's node and a broadcast group to the others (``transports_for_targets``).
        ``supervised``: the pool is watched while the actors connect (``_watch``), so one that
        hangs meanwhile fails the connection instead of holding it to the timeout."""
        cfg, g_cfg = self.ctx.cfg, self.ctx.cfg.generator
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        active = self.active()
        spots = [self.cluster.placed["generators"][i] for i in active]
        transports = transports_for_targets(cfg.weight_sync, g_cfg.backend, "async",
                                            [self.cluster.on_driver_node(e) for e in spots])
        self.publisher = WeightPublisher(cfg.weight_sync, transports, self.ctx.learner,
                                         [RayTarget(self.workers[i]) for i in active],
                                         protocol=engine_protocol(g_cfg.backend), host=self.cluster.bind_host,
                                         watch=self._watch if supervised else None)
        self.transport = self.publisher.transport_name
        for entry, transport in zip(spots, transports):
            entry["weight_transport"] = transport  # saved in placement.json

    def _published(self, version: int) -> None:
        # Every actor holds ``version`` (called from a background push's thread, or this one).
        self.published_version = version
        self._announce()

    def _publish(self, background: bool = False) -> dict[str, float]:
        """Push the learner's current weights to every actor. A pending push is collected first
        (its failure raises here). ``background``: return once the weights are staged, the
        version published later from the push's thread; else once every actor loaded them.
        ``timing/weight_sync_s``: seconds this thread was held, the wait for a pending push included."""
        t0 = time.perf_counter()
        self.push_metrics.update(self.publisher.wait())
        version = self.ctx.learner.version
        if background:
            # The push's thread copies into the slots and waits on the engines: off the learner's cores.
            metrics = self.publisher.start_push(version, watch=self._watch, on_published=self._published,
                                                thread_cores=self.ctx.service_cores)
        else:
            metrics = self.publisher.push(version, watch=self._watch)
            self._published(version)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t0
        return metrics

    def _supervised(self, push: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``push()``; when it fails because an actor died (found within a few seconds), the
        actor is replaced, which pushes the weights again (returns ``weight_sync/retried``).

        Raises:
            Exception: ``push``'s failure when no actor died (an engine's refusal, a timeout)."""
        try:
            return push()
        except Exception:
            dead = self.dead(timeout_s=5.0)
            if not dead:
                raise
            self.supervise([(i, reason + " during a weight update") for i, reason in dead])
            return {"weight_sync/retried": 1.0}

    def publish(self) -> dict[str, float]:
        """Push the learner's weights to every actor (in the background with
        ``weight_sync.overlap_push``), supervised: the previous background push's failure
        surfaces here too, handled alike. Returns the push's metrics (``timing/weight_sync_s``,
        ``weight_sync/*``).

        Raises:
            RuntimeError: no generator actor is left, or a replacement failed to start.
            Exception: a push failed with no actor dead (an engine's refusal, a timeout)."""
        return self._supervised(lambda: self._publish(background=self.overlap))

    def settle(self, block: bool = True) -> None:
        """Collect a pending background push (only one that has ended, unless ``block``), its
        failure handled as ``publish`` handles one. Before what must see the pool's weights
        settled: a checkpoint, an evaluation, the exit probe, ``close``."""
        if self.publisher is None or self.publisher.pending_version is None:
            return
        if block or self.publisher.pending_done():
            self.push_metrics.update(self._supervised(self.publisher.wait))

    def take_push_metrics(self) -> dict[str, float]:
        """The background pushes' metrics collected since the last call (``weight_sync/publish_lag_s``, ...)."""
        out, self.push_metrics = self.push_metrics, {}
        return out

    def _drop_pending_push(self) -> None:
        # Supervision rebuilds the publisher and pushes to every actor again: a pending push is
        # waited for first (it reads the publisher's transport), and its failure, most likely
        # the death being handled, is superseded by that push.
        if self.publisher is None:
            return
        version = self.publisher.pending_version
        try:
            self.push_metrics.update(self.publisher.wait())
        except Exception as e:  # noqa: BLE001 - superseded: supervision pushes the weights again
            logger.warning("weight push v%s failed (%s: %s); supervision pushes the weights again",
                           version, type(e).__name__, e)

    # ------------------------------------------------------------------ supervision
    def supervise(self, dead: list[tuple[int, str]] | None = None) -> None:
        """Replace dead and hung generator actors (``dead``, or those found now), then push the
        learner's weights to the pool before the replacements start sampling; repeats while
        more die.

        Raises:
            RuntimeError: no generator actor is left, or a replacement failed to start.
        """
        if dead is None:
            self.hung()
            dead = self.dead()
        if dead:
            with started_on(self.ctx.service_cores):  # the new publisher's threads (TCPStore)
                self._replace_dead(dead)

    def _replace_dead(self, dead: list[tuple[int, str]]) -> None:
        """``supervise``'s work once some actors are gone (see there)."""
        while dead:
            self._drop_pending_push()
            for i, reason in dead:
                self._replace(i, reason)
            try:
                self.connect()
                self._publish()
            except Exception:
                dead = self.dead(timeout_s=5.0)  # another one died meanwhile?
                if not dead:
                    raise
                continue
            for i in sorted(self._starting):
                self.run_refs[i] = self.workers[i].run.remote(self.broker)
            self._starting.clear()
            self.cluster.save(self.ctx.run_dir)  # placement.json: the replacements' nodes and pids
            self.hung()
            dead = self.dead()

    def dead(self, timeout_s: float = 0.0) -> list[tuple[int, str]]:
        """Actors whose ``run`` ended (waiting up to ``timeout_s`` for a first one), with how:
        ``died (<error type>: <first line>)``, ``stopped unexpectedly``, or why it was killed as hung."""
        active = [i for i in self.active() if i not in self._starting]
        refs = [self.run_refs[i] for i in active]
        if not refs:
            return []
        if timeout_s > 0:
            self._ray.wait(refs, num_returns=1, timeout=timeout_s)
        done, _ = self._ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in done:
            i = active[refs.index(ref)]
            try:
                self._ray.get(ref)
                reason = "stopped unexpectedly"
            except Exception as e:  # the actor's end, as Ray reports it
                reason = f"died ({root_cause(e)})"
            with self._lock:
                out.append((i, self._killed.pop(i, reason)))
        return out

    def hung(self) -> list[tuple[int, str]]:
        """Probe each live actor's heartbeat (at most once a second); an actor that made no
        progress, or did not answer, for ``generator.heartbeat_timeout_s`` is killed (its run
        then ends; ``dead`` reports it with this reason) and returned. Replacements still
        loading are not probed: their calls queue behind the constructor."""
        with self._lock:
            return self._probe_heartbeats()

    def _probe_heartbeats(self) -> list[tuple[int, str]]:
        # ``hung``'s body, under its lock.
        timeout = self.ctx.cfg.generator.heartbeat_timeout_s
        now = time.monotonic()
        hung = []
        for i in self.active():
            if i in self._starting:
                continue
            probe = self._beats.get(i)
            if probe is None:
                self._beats[i] = (self.workers[i].heartbeat.remote(), now)
                continue
            ref, sent = probe
            ready, _ = self._ray.wait([ref], timeout=0)
            if ready:
                try:
                    beat = self._ray.get(ref)
                except Exception:  # noqa: BLE001 - a dead actor: its run() reports it
                    beat = None
                if beat is not None and beat["since_progress_s"] > timeout:
                    hung.append((i, f"made no progress for {beat['since_progress_s']:.0f} s "
                                    f"(generator.heartbeat_timeout_s={timeout:g})"))
                elif now - sent >= 1.0:
                    self._beats[i] = (self.workers[i].heartbeat.remote(), now)
            elif now - sent > timeout:
                hung.append((i, f"did not answer for {now - sent:.0f} s (generator.heartbeat_timeout_s={timeout:g})"))
        for i, reason in hung:
            self._killed[i] = reason
            self._beats.pop(i, None)
            self._ray.kill(self.workers[i], no_restart=True)
            try:  # wait until it is gone, so that it cannot claim requests any more
                self._ray.wait([self.run_refs[i]], timeout=30)
            except Exception:  # noqa: BLE001
                pass
        return hung

    def _replace(self, i: int, reason: str) -> None:
        """Actor ``i`` is gone: hand the groups it held back to dispatch (``lost``), and start its
        replacement (it samples once ``supervise`` has pushed it the weights), or retire the index
        past ``generator.max_restarts``.

        Raises:
            RuntimeError: no generator actor is left (naming how each one ended).
        """
        g_cfg = self.ctx.cfg.generator
        entry = self.cluster.placed["generators"][i]
        incarnation = self.restarts[i]  # the dead actor's: each restart makes the next one
        old = self.workers[i]
        # Give the receiver thread a moment to route what the actor streamed before it died, so
        # a group it finished completes rather than being abandoned (either way nothing is lost).
        time.sleep(0.2)
        reissued = self._lost(self._ray.get(self.broker.reclaim.remote((i, incarnation))))
        for k, v in self._stats_by_worker.pop(i, {}).items():
            self._retired_stats[k] = self._retired_stats.get(k, 0.0) + v
        self._beats.pop(i, None)
        self._ray.kill(old, no_restart=True)
        where = f"on {entry.get('node_ip', '?')} (pid {entry.get('pid', '?')})"
        if self.restarts[i] >= g_cfg.max_restarts:
            self.workers[i] = None
            self._ends[i] = f"actor {i} {where} {reason}"
            self.ctx.log.print(f"generator actor {i} {where} {reason}; {reissued} groups re-issued; retired after "
                               f"{self.restarts[i]} restarts (generator.max_restarts={g_cfg.max_restarts})")
            if not self.active():
                raise GeneratorsGone("every generator actor is gone: " + "; ".join(self._ends[k] for k in sorted(self._ends)))
        else:
            self.restarts[i] += 1
            self.ctx.log.print(f"generator actor {i} {where} {reason}; {reissued} groups re-issued; restarting it "
                               f"({self.restarts[i]}/{g_cfg.max_restarts})")
            (self.workers[i],) = self._place([i], incarnation + 1)
            self.cluster.check_reachable("generator", [self.cluster.record_replacement("generators", i, self.workers[i],
                                                                                       incarnation + 1)])
            self._starting.add(i)

    def _watch(self) -> None:
        # Called while a push waits on the engines (on the learner's thread, or on a background
        # push's): a hung actor would hold it to the deadline.
        hung = self.hung()
        if hung:
            raise RuntimeError(f"generator actor {hung[0][0]} {hung[0][1]}")
