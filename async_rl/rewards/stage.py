"""A model stage of the rollout road: finished samples queue, one thread scores them in batches.

Two stages stand on it: the reward model's (``async_rl.rewards.model.ModelRewardStage``) and the
teacher's of on-policy distillation (``async_rl.rewards.teacher.TeacherStage``). Decoding never
waits for either: the engine's callback (or the stage before) only queues a sample, and the
stage's own thread takes whatever has finished meanwhile, up to ``batch_size``, into one model
call, then hands each sample on (``done``) in submission order. Nothing waits to fill a batch,
so a lone sample goes out as soon as the thread is free.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

__all__ = ["BatchingStage"]


class BatchingStage:
    """Queue, thread and drain of a batched model stage; subclasses define ``_finish``.

    Args:
        batch_size: most samples per ``_finish`` call (>= 1).
        name: the stage's name, for its thread and its errors (``"reward model"``, ``"teacher"``).
        metric_keys: the counters of ``counts`` and ``pop_metrics`` (subclasses add to
            ``self._counts[key]`` under ``self._lock``).

    Attributes:
        first_error: the stage's first failure (what the subclass recorded), or ``None``.

    Subclasses implement ``_finish(batch)``, ``batch`` a list of ``(item, traj, done)`` in
    submission order: score the items, and call every ``done(traj or None)`` (``None``: the
    sample is rejected) exactly once. It runs on the stage's thread; an exception there is a bug
    of the stage or of a ``done`` callback and stops the stage (``drain`` and ``submit`` raise it).
    """

    def __init__(self, batch_size: int, name: str, metric_keys: tuple[str, ...] = ()) -> None:
        self.batch_size, self.name = batch_size, name
        self.first_error: str | None = None
        self._metric_keys = metric_keys
        self._counts: dict[str, float] = dict.fromkeys(metric_keys, 0)
        self._popped = dict(self._counts)
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition(self._lock)
        self._crash: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, item: Any, traj, done: Callable[[Any], None]) -> None:
        """Queue ``traj`` (a ``Trajectory``, or ``None`` when an earlier stage rejected it) with
        what the model reads of it; ``done(traj or None)`` is called on the stage's thread, in
        submission order, once the stage is done with it (``None``: rejected).

        Raises:
            RuntimeError: the stage stopped (a ``done`` callback raised on its thread).
        """
        with self._lock:
            if self._crash is not None:
                raise RuntimeError(f"the {self.name} stage stopped: {self._crash}") from self._crash
            self._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name.replace(" ", "-"), daemon=True)
                self._thread.start()
        self._queue.put((item, traj, done))

    def drain(self) -> None:
        """Wait until every submitted sample has been handed on.

        Raises:
            RuntimeError: a ``done`` callback raised on the stage's thread (the stage stops).
        """
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0 or self._crash is not None)
            if self._crash is not None:
                raise RuntimeError(f"the {self.name} stage stopped: {self._crash}") from self._crash

    def counts(self) -> dict[str, float]:
        """Totals of the stage's counters since construction (reduction: sum)."""
        with self._lock:
            return {k: float(v) for k, v in self._counts.items()}

    def pop_metrics(self) -> dict[str, float]:
        """The ``counts`` since the previous call (reduction: sum over the window)."""
        with self._lock:
            now, before, self._popped = dict(self._counts), self._popped, dict(self._counts)
        return {k: float(now[k] - before[k]) for k in self._metric_keys}

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            # Whatever else has finished meanwhile joins the batch; nothing waits to fill it.
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            try:
                self._finish(batch)
            except BaseException as e:  # a callback's bug: surface it in the caller's thread
                with self._idle:
                    self._crash = e
                    self._idle.notify_all()
                return
            with self._idle:
                self._pending -= len(batch)
                self._idle.notify_all()

    def _finish(self, batch: list[tuple[Any, Any, Callable]]) -> None:
        raise NotImplementedError
