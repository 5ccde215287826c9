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

That passive wait has a price on a quiet machine, the common case: every region then pays a
futex wake. On the default job (one warm-started policy, seed 0, 300 sync steps, quiet machine)
the RL phase took 224 s with ``OMP_WAIT_POLICY=PASSIVE``, 165 s with ``ACTIVE`` and 157 s with
``GOMP_SPINCOUNT=10000``, the accuracy curves identical to the last digit. A spin of any length
(3,000 to 300,000 iterations, or ``ACTIVE``) is 2.5-3x slower beside one busy process, where the
passive wait is 1.1-1.6x. One thread has no teammate to wait for, whatever the policy.

So a run's processes spin briefly (``openmp_wait_defaults``: ``GOMP_SPINCOUNT=SPIN_COUNT``), set
by the CLI at process start, before torch loads libgomp (which reads the variables once, when it
loads); every process the run starts (learner ranks, generator actors, engine and reward worker
processes) inherits it. A caller of ``async_rl.trainer.train`` that imported torch first sets
it itself. In sync mode, where one process does all the work on all its cores, the
``SharedCoreGovernor`` drops torch's threads to what other processes leave of the cores before
each step (one beside a process that spins on one of two), so no thread spins beside a busy
process. Thread budgets split ``available_cores`` (the affinity mask) between the roles a run
starts on them (``async_rl.loops.async_loop.thread_budget``); those roles run one thread each on
a small machine, with nothing to spin for.

A user's own ``OMP_WAIT_POLICY``, ``GOMP_SPINCOUNT`` or ``OMP_NUM_THREADS`` always wins.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import MutableMapping
from typing import Callable

WAIT_POLICY_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
"""Variables that choose how OpenMP threads wait; if the user set either, the wait is theirs."""


SPIN_COUNT = 10_000
"""libgomp's spin count of the run's processes (``GOMP_SPINCOUNT``): how many iterations a thread
that waits for work spins before it sleeps on a futex; libgomp's own default is 300,000 (a few
ms) and ``OMP_WAIT_POLICY=PASSIVE`` makes it 0. Chosen on the default job by
``bench/bench_shared_cores.py`` and ``bench/bench_time_to_accuracy.py`` (figures in the module
docstring)."""


def openmp_wait_defaults(environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set ``GOMP_SPINCOUNT=SPIN_COUNT`` in ``environ`` unless ``OMP_WAIT_POLICY`` or
    ``GOMP_SPINCOUNT`` is already there; returns the variables it set (``{}`` when none).

    A short spin keeps torch's thousands of small parallel regions per step from paying a futex
    wake each (the passive wait's cost on a quiet machine), and ``SharedCoreGovernor`` drops the
    threads that would spin beside a busy process. It acts on a process only if set before that
    process loads OpenMP (``import torch``); children started later inherit it either way.
    LLVM's and Intel's OpenMP runtimes read ``KMP_BLOCKTIME`` instead and keep their own default.
    """
    if any(name in environ for name in WAIT_POLICY_VARS):
        return {}
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


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


def _proc_stat_busy_s(cores: set[int]) -> float | None:
    """CPU seconds the CPUs in ``cores`` have spent running tasks at normal or higher priority
    since boot (``/proc/stat``: user + system + irq + softirq + steal, in ``USER_HZ`` ticks; the
    ``nice`` column, tasks that yield to us, is left out); ``None`` where there is no
    ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        user, _nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
        ticks += user + system + irq + softirq + steal
    return ticks / hz


def _own_cpu_s() -> float:
    """CPU seconds (user + system) of this process, every thread."""
    t = os.times()
    return t.user + t.system


class SharedCoreGovernor:
    """Chooses this process's torch thread count from the share of its cores other processes use.

    Why: OpenMP threads that spin while they wait (``openmp_wait_defaults``) make a quiet run
    fast, but beside a busy process the thread that shares a core with it makes every parallel
    region end a scheduler tick late, and each waiting teammate burns the slice it needs. One
    thread has no teammates to wait for. So before each step the governor measures, over the time
    since its last look, how many of the process's cores other tasks kept busy (``/proc/stat``
    over the affinity mask, minus this process's own CPU time; ``nice``d tasks, which yield to
    us, are not counted) and uses ``round(cores - others)`` threads, between 1 and
    ``max_threads``: all of them on a quiet machine, one beside a process that spins on one of
    two cores.

    Args:
        max_threads: the thread count on a quiet machine (>= 1).
        cores: the CPU ids the process may run on (default: its affinity mask).
        set_threads: applies a count (default ``torch.set_num_threads``).
        min_interval_s: a look sooner than this after the previous one keeps the count (seconds);
            shorter windows are dominated by the ``USER_HZ`` tick (10 ms).

    Raises:
        ValueError: ``max_threads < 1``.
    """

    def __init__(self, max_threads: int, cores: list[int] | None = None,
                 set_threads: Callable[[int], None] | None = None, min_interval_s: float = 0.25) -> None:
        if max_threads < 1:
            raise ValueError(f"SharedCoreGovernor: max_threads must be >= 1, got {max_threads}")
        if cores is None:
            cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        if set_threads is None:
            import torch

            set_threads = torch.set_num_threads
        self.max_threads, self.cores, self.set_threads = max_threads, set(cores), set_threads
        self.min_interval_s = min_interval_s
        self.threads = max_threads
        self.others_cores = 0.0
        self._last = self._sample()

    def _sample(self) -> tuple[float, float | None, float]:
        return time.perf_counter(), _proc_stat_busy_s(self.cores), _own_cpu_s()

    def update(self) -> int:
        """Measure since the previous look, set and return the thread count (unchanged when the
        window is shorter than ``min_interval_s`` or ``/proc/stat`` is missing)."""
        now = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        if busy0 is None or busy1 is None or t1 - t0 < self.min_interval_s:
            return self.threads
        self._last = now
        self.others_cores = max(0.0, (busy1 - busy0) - (own1 - own0)) / (t1 - t0)
        threads = max(1, min(self.max_threads, math.floor(len(self.cores) - self.others_cores + 0.5)))
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads
        return threads
