"""CPU pinning of a run's roles: which cores the learner, the generators and the threads that
serve them (the trajectory receiver, the dispatcher, Ray's and ZeroMQ's I/O threads) may run on.

Ray's CPU accounting only admits actors and does not pin cores, and a role's torch threads that
float onto another role's cores cost both, so a role can be pinned to cores of its own
(``generator.cpu_affinity``, ``learner.cpu_affinity``: ``pin_process``), and async mode's rank 0
splits its own process between the thread that trains and the rest (``split_learner_threads``).
Linux only (``os.sched_setaffinity``); the thread counts on those cores are
``async_rl.utils.cpu_threads``'s.
"""

from __future__ import annotations

import contextlib
import os


def check_cpu_affinity(key: str, cores: list[int]) -> None:
    """Validate a ``<section>.cpu_affinity`` list at load: CPU ids >= 0, each once.

    Raises:
        ValueError: a negative, non-integer or repeated id (one line naming ``key``).
    """
    if any(not isinstance(c, int) or isinstance(c, bool) or c < 0 for c in cores):
        raise ValueError(f"{key} must list CPU ids >= 0, got {cores}")
    if len(set(cores)) != len(cores):
        raise ValueError(f"{key} lists a CPU id twice: {cores}")


def _check_cores(cores: list[int], key: str) -> None:
    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{key}: CPU pinning needs Linux (os.sched_setaffinity); leave it empty here")
    if cores and max(cores) >= (os.cpu_count() or 1):
        raise ValueError(f"{key}={cores}: this machine has CPU ids 0..{(os.cpu_count() or 1) - 1}")


def pin_process(cores: list[int], key: str) -> list[int]:
    """Let every thread of the calling process run only on the CPUs ``cores`` (Linux
    ``sched_setaffinity`` on each task of ``/proc/self/task``); threads and processes started
    afterwards inherit the mask of the thread that starts them. Ray does not pin cores, and a
    role's torch threads that float onto another role's cores cost both of them.

    Args:
        cores: CPU ids of this machine; empty: change nothing.
        key: the config key they came from, for the error.

    Returns:
        The calling thread's CPU ids before the call (sorted), to restore them.

    Raises:
        ValueError: not Linux, or a CPU id this process may not use (beyond ``os.cpu_count()``
            or outside its cgroup's cpuset).
    """
    _check_cores(cores, key)
    before = sorted(os.sched_getaffinity(0))
    if not cores:
        return before
    mask = set(cores)
    # Linux sets the mask per thread: Ray's, torch's and ZeroMQ's threads already run, so each
    # task is pinned, not only the caller.
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), mask)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except OSError as e:
            raise ValueError(f"{key}={cores}: this process may not run there ({e.strerror}; "
                             f"allowed: {before})") from None
    return before


def service_cores(learner_cores: list[int]) -> list[int]:
    """The CPU ids the calling thread may use outside ``learner_cores`` (sorted): where the
    trainer's threads that do not train run in async mode (``split_learner_threads``). When
    ``learner_cores`` take every one of them, ``learner_cores`` themselves: nothing is left to
    split off."""
    others = sorted(set(os.sched_getaffinity(0)) - set(learner_cores))
    return others or sorted(learner_cores)


def split_learner_threads(learner_cores: list[int], key: str) -> list[int]:
    """Async mode's rank 0: the calling thread (the one that trains) runs on ``learner_cores``,
    every other thread of the process on the rest (``service_cores``): the trajectory receiver,
    the dispatcher, Ray's, gRPC's and ZeroMQ's I/O threads would otherwise take the learner's
    core between its torch ops. Threads that the calling thread starts later inherit
    ``learner_cores`` (torch's intra-op threads do, as they should); start the others inside
    ``started_on(service)``, which hands them the service cores.

    Call it before anything has run a parallel torch op (an intra-op pool started earlier would
    land on the service cores) and before Ray starts (its processes and threads then inherit the
    service cores when started inside ``started_on``).

    Args:
        learner_cores: CPU ids; empty: change nothing.
        key: the config key they came from, for the error.

    Returns:
        The service cores (sorted; ``learner_cores`` when none remain; empty when
        ``learner_cores`` is).

    Raises:
        ValueError: as ``pin_process``.
    """
    if not learner_cores:
        return []
    _check_cores(learner_cores, key)
    service = service_cores(learner_cores)
    pin_process(service, key)
    pin_thread(learner_cores, key)
    return service


def pin_thread(cores: list[int], key: str) -> None:
    """Let the calling thread (only) run on the CPUs ``cores``; threads and processes it starts
    afterwards inherit them.

    Raises:
        ValueError: not Linux, or a CPU id this process may not use (one line naming ``key``).
    """
    _check_cores(cores, key)
    try:
        os.sched_setaffinity(0, set(cores))
    except OSError as e:
        raise ValueError(f"{key}={cores}: this thread may not run there ({e.strerror})") from None


@contextlib.contextmanager
def started_on(cores: list[int]):
    """Inside the block the calling thread runs on ``cores``, so the threads and processes it
    starts there inherit them (Ray's, ZeroMQ's, the async pipeline's); its own CPU ids come back
    after. Empty ``cores``: change nothing."""
    if not cores:
        yield
        return
    before = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, set(before))


@contextlib.contextmanager
def cpus_restored(active: bool = True):
    """At the block's end (return or raise) every thread of the process gets back the CPU ids
    the calling thread had at its start: a run that pins roles (``pin_process``,
    ``split_learner_threads``) leaves its process as it found it, so a later run in the same
    process (a bench, a test) splits the same cores. ``active=False`` or not Linux: a no-op."""
    if not active or not hasattr(os, "sched_getaffinity"):
        yield
        return
    before = sorted(os.sched_getaffinity(0))
    try:
        yield
    finally:
        pin_process(before, "the process's CPU ids")
