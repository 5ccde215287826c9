"""The engine side of a push, as the learner's publisher reaches it: an engine object in the
learner's process (``LocalTarget``) or a generator actor (``RayTarget``), both behind the
``WeightTarget`` protocol."""

from __future__ import annotations

from typing import Any, Iterable, Protocol

import torch


class WeightTarget(Protocol):
    """The engine side of a push, as the publisher reaches it: an engine object in this process
    (``LocalTarget``) or a generator actor (``RayTarget``). The calls return handles at once;
    ``wait`` collects them.

    The engine behind it implements ``async_rl.generators.base.Generator``'s weight methods
    (``connect_weight_sync``, ``receive_weights``; for ``load``, ``update_weights``).
    """

    in_process: bool
    """Whether the engine object lives in the learner's process (only then can it take the
    learner's tensors by reference: the ``colocated`` transport)."""

    def connect(self, init_info: dict[str, Any], rank: int) -> Any:
        """Start connecting the engine's receiver (``WeightSender.init_info()``, receiver ``rank``);
        returns a handle for ``wait``."""
        ...

    def receive(self, plan: dict[str, Any], version: int) -> Any:
        """Start loading one update (``UpdatePlan.to_dict()``) from the connected sender; returns a
        handle for ``wait`` whose result is the engine's seconds until the weights were in use."""
        ...

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """``colocated``: hand the full tensors by name to the engine (``update_weights``), all or
        nothing, blocking until they are in use.

        Raises:
            TypeError: the engine is not in this process (``in_process`` is false).
            KeyError, ValueError, RuntimeError: the engine's refusal or failure (``update_weights``).
        """
        ...

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        """Results of ``handles`` (from targets of this kind), in order.

        Raises:
            TimeoutError: not all finished within ``timeout_s`` seconds.
            Exception: the first handle's own error (the engine's refusal or failure).
        """
        ...


class LocalTarget:
    """A generator engine object in this process (sync mode, or the evaluation engine of async
    mode), driven from a helper thread so the learner's thread can stream the buckets meanwhile.

    Args:
        engine: an ``async_rl.generators.base.Generator``.
    """

    in_process = True

    def __init__(self, engine) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.engine = engine
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-recv")

    def connect(self, init_info: dict[str, Any], rank: int):
        """``engine.connect_weight_sync`` on the helper thread; returns its future."""
        return self._pool.submit(self.engine.connect_weight_sync, init_info, rank)

    def receive(self, plan: dict[str, Any], version: int):
        """``engine.receive_weights`` on the helper thread; returns its future."""
        return self._pool.submit(self.engine.receive_weights, plan, version)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """``engine.update_weights`` in the caller's thread (the tensors are the learner's own)."""
        self.engine.update_weights(named_tensors, version)

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        """Results of the futures ``handles``; ``TimeoutError`` if any is still running after ``timeout_s``."""
        from concurrent.futures import wait

        done, pending = wait(handles, timeout=timeout_s)
        if pending:
            raise TimeoutError
        return [h.result() for h in handles]


class RayTarget:
    """A generator actor (``async_rl.loops.actors.GeneratorWorker``) reached through Ray calls.

    Args:
        actor: the actor handle.
    """

    in_process = False

    def __init__(self, actor) -> None:
        self.actor = actor

    def connect(self, init_info: dict[str, Any], rank: int):
        """``actor.connect_weight_sync.remote``; returns its object ref."""
        return self.actor.connect_weight_sync.remote(init_info, rank)

    def receive(self, plan: dict[str, Any], version: int):
        """``actor.receive_weights.remote``; returns its object ref."""
        return self.actor.receive_weights.remote(plan, version)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Not possible: the engine lives in another process (use ``shm`` or ``broadcast``).

        Raises:
            TypeError: always.
        """
        raise TypeError("a generator actor is not in the learner's process: weights reach it through shm or "
                        "broadcast, not colocated")

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        """``ray.get`` of ``handles``; ``TimeoutError`` if any is still running after ``timeout_s``."""
        import ray

        ready, pending = ray.wait(handles, num_returns=len(handles), timeout=timeout_s)
        if pending:
            raise TimeoutError
        return ray.get(handles)


def wait_all(targets: list, handles: list, timeout_s: float, on_timeout: str) -> list:
    """The results of ``handles`` (one per target, from ``connect``/``receive``), collected the way
    the targets' class does (``WeightTarget.wait``).

    Raises:
        TimeoutError: some handle still runs after ``timeout_s`` seconds; the message is ``on_timeout``.
    """
    try:
        return type(targets[0]).wait(handles, timeout_s)
    except TimeoutError:
        raise TimeoutError(on_timeout) from None
