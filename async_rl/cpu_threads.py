"""CPU thread defaults of a run's processes: OpenMP's wait policy and the cores a budget splits.

Why: torch's CPU build runs its intra-op parallelism on OpenMP (``torch.__config__.parallel_info()``:
``ATen parallel backend: OpenMP``, GNU libgomp in the pip wheel). With ``OMP_WAIT_POLICY`` unset,
libgomp's threads spin for ``GOMP_SPINCOUNT`` = 300,000 iterations (a few ms) at the end of every
parallel region before they sleep; with ``PASSIVE`` the count is 0 (libgomp manual, GOMP_SPINCOUNT). A step of the default job (tiny model, 256 samples) runs
thousands of small parallel regions, so the spinning costs nothing on idle cores but, beside one
busy process on the same cores, a waiting thread burns the time slice the thread it waits for
needs, and every region ends a scheduler tick late. Measured with ``bench/bench_shared_cores.py``
(default job, 2 cores shared with other jobs, medians of 2 interleaved pairs, s per step): OpenMP's
default wait 42.8 alone and 47.2 beside one spinning process; ``OMP_WAIT_POLICY=PASSIVE`` 1.53
and 3.13 (2.0x: the spinner takes half the cores). The other jobs on those cores are busy
processes too, so the old default was already 28x slower than the passive wait "alone", the
slowdown issue 20 reported (0.5 s -> 14 s per step). ``OMP_WAIT_POLICY=ACTIVE`` (spin without
end): 10.9 -> 25.3 beside a spinner, against PASSIVE 1.7 -> 1.8, in a first single pair.
Beside a torch process doing matmuls (one pair): default wait 53.6 -> 105.8, passive 2.35 -> 5.60.

So a run's processes wait passively by default (``passive_openmp_wait``), set by the CLI at
process start, before torch loads libgomp (which reads the variables once, when it loads);
every process the run starts (learner ranks, generator actors, engine and reward worker
processes) inherits it. A caller of ``async_rl.trainer.train`` that imported torch first sets
``OMP_WAIT_POLICY=PASSIVE`` itself. Thread budgets split ``available_cores`` (the affinity mask)
between the roles a run starts on them (``async_rl.loops.async_loop.thread_budget``).

A user's own ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import os
import time
from collections.abc import MutableMapping

WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables that choose how OpenMP threads wait; if the user set either, the wait is theirs."""


def passive_openmp_wait(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` unless ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is already there; returns the variables it set (``{}`` when none).

    ``PASSIVE`` makes libgomp's spin count 0 (threads sleep on a futex as soon as they wait) and is
    read by LLVM's and Intel's OpenMP runtimes too, so ``GOMP_SPINCOUNT`` is not needed. It acts
    on a process only if set before that process loads OpenMP (``import torch``); children started
    later inherit it either way.
    """
    if any(name in environ for name in WAIT_POLICY_VARS):
        return {}
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def available_cores() -> int:
    """Cores this process may run on (>= 1): its CPU affinity mask (``taskset``, a container's
    cpuset, Slurm's binding), not the machine's core count, which ``os.cpu_count()`` gives and
    which oversubscribes a process pinned to a few cores."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return os.cpu_count() or 1


def user_num_threads(environ: MutableMapping[str, str] | None = None) -> int:
    """The thread count the user asked every process for with ``OMP_NUM_THREADS`` (its first
    entry, as OpenMP reads a nested list such as ``4,2``), or 0 when unset or not a positive
    integer (OpenMP then ignores it too)."""
    value = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "")
    first = value.split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else 0


def thread_times() -> tuple[float, float]:
    """The calling thread's CPU time and the time it spent runnable but waiting for a CPU (in a
    run queue, behind other threads of its cores), since it started, in seconds: Linux's
    ``/proc/thread-self/schedstat`` (its first two fields, ns; the kernel's
    ``Documentation/scheduler/sched-stats.rst``). Elsewhere ``time.thread_time()`` and 0.0.

    A phase's wall time minus the difference of both is what the thread spent blocked: waiting for
    the GIL, a lock, I/O or a sleep."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns) / 1e9, int(wait_ns) / 1e9
    except (OSError, ValueError):
        return time.thread_time(), 0.0
