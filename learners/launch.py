"""Start the learner on ``learner.world_size`` ranks; rank 0 is the calling (trainer) process.

* ``world_size == 1``: an in-process gloo group of one (no rendezvous, no free port needed).
* Ray placement (default for ``world_size > 1``): ranks 1..N-1 are Ray actors in one placement
  group (``learner.num_cpus_per_rank``, ``num_gpus_per_rank``, ``node_labels``,
  ``placement_strategy``: PACK by default; ``async_rl.runtime.cluster``), on the run's cluster or a local
  Ray. Rank 0 starts the group's TCPStore on a free port of the cluster's ``bind_host`` only
  (``async_rl.runtime.cluster.tcp_store``: loopback on a local Ray, this node's IP on a cluster), the
  actors connect to it and all ranks join one gloo group on that store, each
  builds the same learner (``FSDPLearner`` or ``MegatronLearner`` by ``learner.backend``; same
  weights, same seed), and the actors then serve rank 0's
  collective calls (``async_rl.learners.spmd``). Ray kills the actors when the driver exits, so a crashed
  trainer leaves no rank behind. A follower that dies is reported by Ray to a watcher thread of
  rank 0 (``RankMonitor``, within about a second); rank 0's collective call, which gloo fails at
  the same time ("Connection closed by peer"), then raises ``LearnerRankDied`` naming the rank,
  its process and how it ended (the trainer adds the checkpoint to resume from).
* torchrun: ``torchrun --nproc-per-node N -m async_rl.cli train --config ...`` starts N copies;
  rank 0 (``RANK=0``) runs the trainer, the others only the learner (``follow_from_env``), all on
  the ``env://`` group torchrun sets up. ``learner.world_size`` must equal ``WORLD_SIZE``.

Threads: on CPU each follower uses ``learner.num_threads`` threads, else the user's
``OMP_NUM_THREADS``, else the cores of its CPU affinity divided by the world size; oversubscribed
torch processes slow each other down many-fold (``async_rl.utils.cpu_threads``).
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from async_rl.learners.base import LearnerConfig, learner_device, process_group_backend

logger = logging.getLogger(__name__)

PG_TIMEOUT = datetime.timedelta(minutes=30)
"""Collective timeout of the learner group (a rank stuck longer than this fails the run)."""


def launched_by_torchrun() -> bool:
    """Whether this process is one of several started by torchrun (``WORLD_SIZE`` > 1 in the env)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def exit_rank_process(status: int = 0) -> NoReturn:
    """End a process that ran a learner rank on a gloo group: run the atexit handlers, flush, then
    exit without Python's interpreter finalization (``os._exit``).

    Why: gloo's worker threads release a finished collective's tensors after the caller's ``wait``
    has returned. Releasing a tensor that Python still owns takes the GIL; if the main thread has
    meanwhile reached interpreter finalization, Python ends the worker thread (``pthread_exit``),
    the unwind crosses a ``noexcept`` C++ frame, and the process dies with "terminate called without
    an active exception" (SIGABRT, exit -6) after a run that succeeded. ``destroy_process_group``
    does not prevent it: FSDP2's ``DeviceMesh`` keeps the group (and its threads) alive until
    finalization. Seen in the multi-rank tests on a loaded machine (gdb: the abort is in
    ``ProcessGroupGloo::runLoop`` destroying an ``AsyncAllgatherCoalescedWork``), about 1 run in 40.

    The atexit handlers (W&B, shared-memory slot cleanup) still run, while the interpreter is
    whole, so a worker thread that needs the GIL then simply waits for it. Call it only once
    everything the process owes is written (checkpoints, exports, metrics).

    Args:
        status: the process exit status.
    """
    import atexit

    atexit._run_exitfuncs()  # what a normal exit runs first (logging.shutdown is one of them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing left to save
            pass
    os._exit(status)


def learner_class(cfg: LearnerConfig):
    """The learner class of ``learner.backend``: ``FSDPLearner`` (``fsdp2``) or ``MegatronLearner``
    (``megatron``, imported only then: megatron-core is an optional dependency)."""
    from async_rl.learners.capabilities import learner_class as registered

    return registered(cfg.backend)


def _follower_threads(cfg: LearnerConfig) -> int:
    """Torch threads of a follower rank: ``learner.num_threads``, else one per core of
    ``learner.cpu_affinity`` where pinned, else this process's cores (its CPU affinity) over the
    ranks. ``OMP_NUM_THREADS`` is not read here: in a Ray-placed rank Ray sets it itself (to the
    actor's ``num_cpus``), so it is not the user's choice."""
    from async_rl.utils.cpu_threads import available_cores

    return cfg.num_threads or len(cfg.cpu_affinity) or max(1, available_cores() // cfg.world_size)


class LearnerRank:
    """A follower rank (1..N-1) of the learner: joins the group, builds the learner, serves rank 0.

    Args:
        rank, world_size: this rank and the group size.
        store_address: ``(host, port)`` of rank 0's TCPStore, the group's rendezvous.
        learner_args: ``(cfg, algo, model_path, temperature, total_optimizer_steps)`` for the
            learner class (``learner_class``).
    """

    def __init__(self, rank: int, world_size: int, store_address: tuple[str, int], learner_args: tuple) -> None:
        self.rank, self.world_size, self.learner_args = rank, world_size, learner_args
        self.store_address = tuple(store_address)

    def run(self) -> int:
        """Join, build, serve until rank 0 stops us; returns the number of calls served.

        However it ends, it runs this process's exit handlers before returning or raising
        (``async_rl.utils.leftovers.run_exit_handlers``): ``LearnerHandle.close`` kills the actor next,
        which runs none, and megatron-core's W&B temp directories would be left. A rank killed
        before (a failed run) leaves them renamed after its pid, for the next start's sweep
        (``own_wandb_temp_dirs``).
        """
        from async_rl.learners.spmd import serve_commands

        from async_rl.runtime.cluster import group_ip, pin_process, use_node_interface
        from async_rl.utils.leftovers import own_wandb_temp_dirs, run_exit_handlers

        try:
            pin_process(self.learner_args[0].cpu_affinity, "learner.cpu_affinity")
            torch.set_num_threads(_follower_threads(self.learner_args[0]))
            host, port = self.store_address
            use_node_interface(group_ip(host))  # gloo announces this node's address (loopback on one node)
            backend = process_group_backend(learner_device(self.learner_args[0]))
            store = dist.TCPStore(host, int(port), self.world_size, False, timeout=PG_TIMEOUT)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size,
                                    timeout=PG_TIMEOUT)
            try:
                learner = learner_class(self.learner_args[0])(*self.learner_args)
                own_wandb_temp_dirs()  # megatron-core imported wandb (none: FSDP2)
                return serve_commands(learner)
            finally:
                dist.destroy_process_group()
        finally:
            run_exit_handlers()


class LearnerRankDied(RuntimeError):
    """A follower learner rank's process ended while the run needed it; ``str()`` names the rank,
    its process (pid, node) and how Ray saw it end.

    Attributes:
        rank: the rank that died (1..N-1).
    """

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank


def _actor_end(error: BaseException) -> str:
    """How a Ray actor ended, in one line: Ray's ``Worker exit type`` and ``detail`` where its
    error names them, else the error's first 300 characters. Ray cannot see a signal's number:
    a process that vanished (SIGKILL, the OOM killer, a segfault) reads "SYSTEM_ERROR ...
    connection error code 2. End of file", which gets that explanation appended."""
    text = " ".join(str(error).split())
    if "Worker exit type:" not in text:
        return f"{type(error).__name__}: {text[:300]}"
    text = text[text.index("Worker exit type:"):]
    for tail in (" Some common causes", " There are some potential root causes"):
        if tail in text:
            text = text[:text.index(tail)]
    text = text[:300].rstrip(". ")
    if "End of file" in text:
        text += " (its process vanished: killed by a signal such as SIGKILL or the OOM killer, or crashed)"
    return text


class RankMonitor:
    """Rank 0's watch over its Ray-placed follower ranks: a daemon thread waits on their ``run``
    calls, which end only when rank 0 stops them, so any earlier end is a rank that died.

    Args:
        refs: the followers' ``LearnerRank.run`` object refs, rank 1 first.
        spots: where each follower runs (``Cluster.record`` entries: ``pid``, ``node_ip``).
        world_size: the learner group's size (for the message).
    """

    report_wait_s = 10.0
    """How long ``failure`` waits for Ray's word after gloo failed (seconds): gloo sees the broken
    connection first; Ray notices the dead process within about a second on the same node."""

    def __init__(self, refs: list, spots: list[dict[str, Any]], world_size: int) -> None:
        self._refs, self._spots, self._world_size = list(refs), spots, world_size
        self._dead: LearnerRankDied | None = None
        self._found = threading.Event()
        self._stop = threading.Event()
        self.found_at: float | None = None
        """``time.monotonic()`` when the death was found, or ``None``."""
        self._thread = threading.Thread(target=self._watch, name="learner-rank-monitor", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import ray

        pending = list(self._refs)
        while pending and not self._stop.is_set():
            done, pending = ray.wait(pending, num_returns=1, timeout=0.5)
            if not done or self._stop.is_set():
                continue
            ref = done[0]
            rank = self._refs.index(ref) + 1
            try:
                ray.get(ref)
                how = "returned before rank 0 stopped it"
            except Exception as e:  # noqa: BLE001 - the actor's end, as Ray reports it
                how = _actor_end(e)
            spot = self._spots[rank - 1] if rank - 1 < len(self._spots) else {}
            self._dead = LearnerRankDied(rank, f"learner rank {rank} of {self._world_size} (pid {spot.get('pid', '?')} "
                                               f"on {spot.get('node_ip', '?')}) died: {how}")
            self.found_at = time.monotonic()
            self._found.set()
            logger.error("%s; the run stops at rank 0's next learner call", self._dead)
            return

    def failure(self, wait_s: float | None = None) -> LearnerRankDied | None:
        """The error naming the follower rank that died, waiting up to ``wait_s`` seconds
        (default ``report_wait_s``) for Ray to report one; ``None`` if none did."""
        self._found.wait(self.report_wait_s if wait_s is None else wait_s)
        return self._dead

    def stop(self) -> None:
        """Stop watching (before rank 0 releases the followers: their ends are then expected)."""
        self._stop.set()
        self._thread.join(timeout=5)


class LearnerHandle:
    """What ``launch_learner`` keeps besides the rank-0 learner: the follower actors, their run
    refs, and the ``Cluster`` it joined itself (``None`` when the run's own was given);
    ``close`` stops the followers and tears the group down."""

    def __init__(self, learner, actors: list, refs: list, cluster=None, monitor: RankMonitor | None = None) -> None:
        self.learner, self.actors, self.refs, self.cluster = learner, actors, refs, cluster
        self.monitor = monitor

    def close(self, failed: bool = False) -> None:
        """Release the followers, wait for them (60 s), destroy the group; safe to call twice.

        Args:
            failed: the run is ending on an exception. A collective call may then have failed on
                rank 0 alone, leaving the followers inside one of its collectives, where they
                would never read the stop command: they are killed instead (Ray-placed ranks;
                torchrun tears its ranks down when rank 0 exits with the error).
        """
        from async_rl.learners.spmd import stop_followers

        if self.learner is None:
            return
        learner, self.learner = self.learner, None
        if self.monitor is not None:
            self.monitor.stop()
            learner._follower_failure = None
        if dist.is_initialized() and dist.get_world_size() > 1 and not failed:
            try:
                stop_followers(learner)
            except Exception as e:  # a broken group: the followers are killed below
                logger.warning("stopping the learner ranks: %s", e)
        if self.refs:
            import ray

            if not failed:
                try:
                    ray.get(self.refs, timeout=60)
                except Exception as e:
                    logger.warning("learner rank shutdown: %s", e)
            for actor in self.actors:
                ray.kill(actor)
            if self.cluster is not None:  # one launch_learner joined or started itself
                self.cluster.close()
        if dist.is_initialized() and dist.get_world_size() > 1:
            from async_rl.learners.spmd import forget_command_group

            dist.destroy_process_group()
            forget_command_group()


def launch_learner(cfg: LearnerConfig, algo, model_path: str, temperature: float,
                   total_optimizer_steps: int, cluster=None):
    """Build the learner on ``cfg.world_size`` ranks; returns ``(rank-0 learner, LearnerHandle)``.

    Args:
        cluster: the run's ``async_rl.runtime.cluster.Cluster`` (whose ``bind_host`` the rendezvous binds);
            ``None`` = join or start one here for ranks 1..N-1 (``RAY_ADDRESS``, else a local Ray
            the handle shuts down).

    Raises:
        ValueError: under torchrun, ``learner.world_size`` differs from ``WORLD_SIZE``.
        RuntimeError: a follower rank failed to start (its error is chained).
        PlacementError: the cluster cannot place the ranks (``Cluster.place``; a ``ValueError``).
    """
    from async_rl.learners.spmd import drive_followers

    args = (cfg, algo, model_path, temperature, total_optimizer_steps)
    device = learner_device(cfg)
    backend = process_group_backend(device)
    if launched_by_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world_size:
            raise ValueError(f"torchrun started {world} processes but learner.world_size={cfg.world_size}")
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method="env://", timeout=PG_TIMEOUT)
        learner = learner_class(cfg)(*args)
        drive_followers(learner)
        return learner, LearnerHandle(learner, [], [])
    if cfg.world_size == 1:
        learner = learner_class(cfg)(*args)
        return learner, LearnerHandle(learner, [], [])
    import ray

    from async_rl.runtime.cluster import Cluster, PlacementConfig, tcp_store

    own = cluster is None
    if own:
        cluster = Cluster.connect(os.environ.get("RAY_ADDRESS") or None)
    # Made before the actors so they have its port; it listens on bind_host only.
    store = tcp_store(cluster.bind_host, cfg.world_size, PG_TIMEOUT)
    store_address = (cluster.bind_host, store.port)
    # Ray's CPU count only admits the ranks; their threads come from _follower_threads. On CUDA
    # each rank asks for one GPU by default (Ray sets its CUDA_VISIBLE_DEVICES).
    placement = PlacementConfig.of_learner(cfg)
    strategies = cluster.place("learner", cfg.world_size - 1, placement, cuda=device.type == "cuda")
    bundle = placement.bundle(device.type == "cuda")
    actor_cls = ray.remote(LearnerRank)
    actors = [actor_cls.options(num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0),
                                scheduling_strategy=strategies[r - 1]).remote(r, cfg.world_size, store_address, args)
              for r in range(1, cfg.world_size)]
    # Before run: an actor serves one call at a time.
    cluster.check_reachable("learner rank", cluster.record("learner", actors))
    refs = [a.run.remote() for a in actors]
    if dist.is_initialized():
        # A world-size-1 group left by an earlier run in this process (tests, notebooks).
        dist.destroy_process_group()
    try:
        dist.init_process_group(backend, store=store, rank=0, world_size=cfg.world_size, timeout=PG_TIMEOUT)
        learner = learner_class(cfg)(*args)
    except Exception as e:
        done, _ = ray.wait(refs, timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except Exception as follower_error:
                raise RuntimeError(f"a learner rank failed to start: {follower_error}") from e
        raise
    drive_followers(learner)
    monitor = RankMonitor(refs, cluster.placed["learner"], cfg.world_size)
    learner._follower_failure = monitor.failure
    return learner, LearnerHandle(learner, actors, refs, cluster if own else None, monitor)


def follow_from_env(cfg: LearnerConfig, algo, model_path: str, temperature: float,
                    total_optimizer_steps: int) -> int:
    """torchrun ranks 1..N-1: join the ``env://`` group, build the learner, serve rank 0.

    Returns:
        The number of calls served.
    """
    from async_rl.learners.spmd import serve_commands

    from async_rl.runtime.cluster import pin_process

    pin_process(cfg.cpu_affinity, "learner.cpu_affinity")
    torch.set_num_threads(_follower_threads(cfg))
    dist.init_process_group(process_group_backend(learner_device(cfg)), init_method="env://", timeout=PG_TIMEOUT)
    try:
        return serve_commands(learner_class(cfg)(cfg, algo, model_path, temperature, total_optimizer_steps))
    finally:
        dist.destroy_process_group()
