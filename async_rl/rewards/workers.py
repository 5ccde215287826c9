"""Reward functions in worker processes: a per-call deadline, and a crash costs one sample.

A reward function is user code called for every sample. Run on the engine's decoding thread, one
that hangs stalls generation and one that segfaults or calls ``os._exit`` takes the generator
with it. ``RewardWorkers`` runs it in ``num_workers`` processes of its own instead, fed by one
thread of the parent (the pool thread)::

    engine thread ──submit(args, done)──> queue ──> pool thread ──(call id, args)──> worker k
                                                        │ <──(call id, Outcome)────── (resolves the
      on_trajectory / on_group_closed <── done(outcome) ┘     spec, calls, validates: call_reward)

- Each worker resolves the function itself from its spec (``reward.fn``; ``None``: the built-in
  of each row's ``data_source``), so nothing is pickled but the four arguments and a small
  ``Outcome`` (a float and a few float extras; a bigger result is refused in the worker as
  ``too_large``).
- Each call has a deadline (``reward.timeout_s``, counted from when the call reaches an idle
  worker): past it the worker is SIGKILLed and replaced, and the sample is ``timeout``. A worker
  that dies while scoring (``os._exit``, a segfault, an OOM kill) makes its sample ``crashed`` and
  is replaced; one killed while idle is replaced before its next call.
- Several calls are in flight at once, one per worker; ``done`` callbacks all run on the pool
  thread, in the order results come back, so a caller's callbacks never race each other.
- Workers start on the first call (a fresh interpreter plus the reward's imports, well under a
  second for the built-ins), as ``python -c`` processes (``_BOOTSTRAP``; never ``fork``: the parent
  holds threads, torch and Ray). They run with one OpenMP/MKL thread, ignore SIGINT (the trainer
  finishes its step on Ctrl-C), die with their parent (``PR_SET_PDEATHSIG``) and exit when their
  pipe closes; ``close`` stops them.

Example::

    workers = RewardWorkers("arithmetic", num_workers=1, timeout_s=30.0)
    workers.submit(("async_rl/arithmetic", "12", "12", None), print)   # on the pool thread:
    workers.drain()                    # Outcome(kind='ok', score=1.0, extras={'acc': 1.0}, ...)
    workers.close()
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

from async_rl.rewards.scorer import Outcome, call_reward, exception_text

__all__ = ["RewardWorkers"]

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 120.0
"""Longest wait for a new worker to import its reward function and say it is ready (seconds):
an import that takes longer (or hangs) stops the pool with an error instead of waiting forever."""
_CLOSE_TIMEOUT_S = 2.0
"""How long ``close`` waits for a worker to exit on its own before SIGKILL (seconds)."""


class RewardWorkers:
    """A pool of reward-function worker processes with a per-call deadline (thread-safe).

    Args:
        spec: ``reward.fn`` (a built-in name, ``pkg.module:fn`` or ``file.py:fn``), resolved in
            each worker; ``None``: the built-in reward of each call's ``data_source``.
        num_workers: worker processes (>= 1), one call in flight each.
        timeout_s: seconds a call may take once a worker has it (> 0).

    Raises:
        ValueError: ``num_workers`` < 1 or ``timeout_s`` <= 0.
    """

    def __init__(self, spec: str | None, num_workers: int, timeout_s: float) -> None:
        if num_workers < 1:
            raise ValueError(f"RewardWorkers: num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardWorkers: timeout_s must be > 0, got {timeout_s}")
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, float(timeout_s)
        self.num_started = 0
        """Worker processes started so far (replacements included)."""
        self._queue: deque[tuple[tuple, Callable[[Outcome], None]]] = deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._pending = 0
        self._crash: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)  # a full buffer already holds a wake-up: never block a caller
        self._workers: list[_Worker] = []  # touched by the pool thread only
        self._next_call = 0

    # ------------------------------------------------------------------ caller side
    def submit(self, args: tuple[str, str, Any, Any], done: Callable[[Outcome], None]) -> None:
        """Queue one call ``fn(*args)``; ``done(outcome)`` runs on the pool thread once its
        ``Outcome`` is known (``ok``, ``no_reward``, ``error``, ``too_large``, ``timeout`` or
        ``crashed``).

        Raises:
            RuntimeError: the pool stopped (a worker could not load the function, or a ``done``
                callback raised), or it was closed.
        """
        with self._lock:
            self._raise_if_stopped()
            if self._closing:
                raise RuntimeError("the reward workers are closed")
            self._pending += 1
            self._queue.append((args, done))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reward-workers", daemon=True)
                self._thread.start()
        self._wake()

    def drain(self) -> None:
        """Wait until every submitted call's ``done`` has returned.

        Raises:
            RuntimeError: the pool stopped (see ``submit``).
        """
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0 or self._crash is not None)
            self._raise_if_stopped()

    def check(self) -> None:
        """Raise if the pool stopped (see ``submit``); otherwise do nothing."""
        with self._lock:
            self._raise_if_stopped()

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and diagnostics)."""
        return [w.proc.pid for w in list(self._workers) if w.proc.poll() is None]

    def close(self) -> None:
        """Stop the workers (each is asked to exit, then SIGKILLed after ``_CLOSE_TIMEOUT_S``)
        and the pool thread. Calls still queued or running are dropped without ``done``: drain
        first to keep them. Idempotent."""
        with self._lock:
            self._closing = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._stop_workers()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------------ pool thread
    def _raise_if_stopped(self) -> None:
        if self._crash is not None:
            raise RuntimeError(f"the reward workers stopped: {self._crash}") from self._crash

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:  # closed, or the buffer is full of wake-ups already
            pass

    def _run(self) -> None:
        try:
            while self._step():
                pass
            # From this thread: the workers' PR_SET_PDEATHSIG fires when the thread that started
            # them exits, so they are asked to exit before it does.
            self._stop_workers()
        except BaseException as e:  # a done callback's bug, or a worker that cannot start
            with self._idle:
                self._crash = e
                self._idle.notify_all()
            self._stop_workers()

    def _step(self) -> bool:
        """One round: start missing workers, hand out calls, wait for results or a deadline.
        Returns False once the pool is closing."""
        with self._lock:
            if self._closing:
                return False
            queued = bool(self._queue)
        self._workers = [w for w in self._workers if not w.dead]
        if queued:
            while len(self._workers) < self.num_workers:
                self._workers.append(self._start())
        for w in self._workers:
            if w.ready and w.call is None:
                with self._lock:
                    if not self._queue:
                        break
                    args, done = self._queue.popleft()
                self._send(w, args, done)
        live = [w for w in self._workers if not w.dead]
        deadlines = [w.deadline for w in live if w.deadline is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        for ready in wait([self._wake_r] + [w.conn for w in live], timeout=timeout):
            if ready is self._wake_r:
                self._wake_r.recv(4096)
            else:
                self._receive(next(w for w in live if w.conn is ready))
        now = time.monotonic()
        for w in live:
            if w.dead:
                continue
            if w.call is not None and now >= w.deadline:
                w.kill()
                self._finish(w, Outcome("timeout", reason=f"no result within reward.timeout_s={self.timeout_s:g} s "
                                                          f"(worker pid {w.proc.pid} killed and replaced)"))
            elif not w.ready and w.deadline is not None and now >= w.deadline:
                w.kill()
                raise RuntimeError(f"a reward worker did not load reward.fn={self.spec!r} within "
                                   f"{_START_TIMEOUT_S:g} s")
        return True

    def _start(self) -> "_Worker":
        parent_sock, child_sock = socket.socketpair()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOTSTRAP, str(child_sock.fileno())],
                                    pass_fds=(child_sock.fileno(),), env=env, stdin=subprocess.DEVNULL)
        finally:
            child_sock.close()  # the child holds the only other end: its death reads as EOF here
        conn = Connection(parent_sock.detach())
        # The parent's import path first, so the worker imports the same async_rl and reward files.
        conn.send((self.spec, list(sys.path), os.getpid()))
        self.num_started += 1
        return _Worker(proc, conn, deadline=time.monotonic() + _START_TIMEOUT_S)

    def _send(self, w: "_Worker", args: tuple, done: Callable[[Outcome], None]) -> None:
        self._next_call += 1
        try:
            w.conn.send((self._next_call, args))
        except (OSError, EOFError):  # died while idle, unnoticed until now: its replacement retries
            w.kill()
            with self._lock:
                self._queue.appendleft((args, done))
            return
        except Exception as e:  # the arguments do not pickle: this sample's error, not the pool's
            self._done(done, Outcome("error", reason=f"reward arguments could not be sent: {type(e).__name__}: {exception_text(e)}"[:200]))
            return
        w.call, w.done, w.deadline = self._next_call, done, time.monotonic() + self.timeout_s

    def _receive(self, w: "_Worker") -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            code = w.kill()
            if w.call is not None:
                self._finish(w, Outcome("crashed", reason=f"the reward worker died while scoring ({_exit_text(code)}); "
                                                          "replaced"))
            elif not w.ready:
                raise RuntimeError(f"a reward worker died while loading reward.fn={self.spec!r} ({_exit_text(code)})")
            else:
                logger.warning("reward worker pid %d died while idle (%s); replaced", w.proc.pid, _exit_text(code))
            return
        if msg[0] == "ready":
            w.ready, w.deadline = True, None
        elif msg[0] == "init_error":
            w.kill()
            raise RuntimeError(f"a reward worker could not load reward.fn={self.spec!r}: {msg[1]}")
        elif msg[0] == w.call:
            self._finish(w, msg[1])

    def _finish(self, w: "_Worker", outcome: Outcome) -> None:
        done = w.done
        w.call, w.done, w.deadline = None, None, None
        self._done(done, outcome)

    def _done(self, done: Callable[[Outcome], None], outcome: Outcome) -> None:
        try:
            done(outcome)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _stop_workers(self) -> None:
        workers, self._workers = self._workers, []
        for w in workers:
            try:
                w.conn.send(None)
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        for w in workers:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            w.kill()


class _Worker:
    """The pool thread's record of one worker process: its pipe, the call it runs (id and
    ``done``) and its deadline (a call's, or the start's while not yet ready)."""

    def __init__(self, proc, conn: Connection, deadline: float) -> None:
        self.proc, self.conn, self.deadline = proc, conn, deadline
        self.ready, self.dead = False, False
        self.call: int | None = None
        self.done: Callable[[Outcome], None] | None = None

    def kill(self) -> int | None:
        """SIGKILL the process (if alive), reap it and close the pipe; returns its exit status
        (negative: the signal that ended it)."""
        if not self.dead:
            self.dead = True
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:  # unkillable (D state): left to the OS, never reused
                pass
            self.conn.close()
        return self.proc.returncode


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


_BOOTSTRAP = (
    "import sys\n"
    "from multiprocessing.connection import Connection\n"
    "conn = Connection(int(sys.argv[1]))\n"
    "spec, sys.path[:], parent_pid = conn.recv()\n"
    "from async_rl.rewards.workers import _worker_main\n"
    "_worker_main(conn, spec, parent_pid)\n"
)
"""What a worker process runs (``python -c``). Not ``multiprocessing``'s spawn or forkserver: they
re-run the parent's main script in each child (an unguarded driver script would train again, and
a Ray actor's would import Ray), and ``fork`` would copy a parent full of threads, torch and Ray.
The pipe still speaks ``multiprocessing.connection``'s framing; only the four arguments and an
``Outcome`` cross it."""


def _worker_main(conn: Connection, spec: str | None, parent_pid: int) -> None:
    """A worker process: resolve the reward function of ``spec``, then answer calls until the pipe
    closes or a ``None`` arrives. Each answer is ``(call id, Outcome)``."""
    _die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group: the trainer finishes its step on SIGINT, and its
    # reward workers must keep scoring until it closes them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        from async_rl.rewards.registry import resolve_reward_spec

        fn = resolve_reward_spec(spec)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the pool
        conn.send(("init_error", f"{type(e).__name__}: {exception_text(e)}"[:1000]))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or died
            return
        if msg is None:
            return
        call_id, args = msg
        conn.send((call_id, call_reward(fn, args)))


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the thread that started it exits (Linux ``PR_SET_PDEATHSIG``);
    exit now if the parent is already gone. Elsewhere, pipe EOF alone ends the worker."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)
