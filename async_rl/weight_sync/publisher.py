"""The learner's driver of every push: the transport objects (``colocated``, ``shm``/``broadcast``,
or both in one update: each target by its own) and ``WeightPublisher``. The engine targets live
in ``targets`` (re-exported here: ``WeightTarget``, ``LocalTarget``, ``RayTarget``)."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Protocol, Sequence

import torch
from torch.distributed.tensor import DTensor

from async_rl.runtime.cluster import LOOPBACK, started_on
from async_rl.weight_sync.config import WeightSyncConfig, replace_transport
from async_rl.weight_sync.plan import UpdatePlan
from async_rl.weight_sync.sources import NamedTensors, WeightSource
from async_rl.weight_sync.targets import LocalTarget, RayTarget, WeightTarget, wait_all
from async_rl.weight_sync.wire import WeightSender

__all__ = ["BucketTransport", "ColocatedTransport", "LocalTarget", "RayTarget", "Transport", "WeightPublisher",
           "WeightTarget", "make_transport"]

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """How one push travels (``make_transport``): the single call ``WeightPublisher.push`` makes,
    whatever the transport."""

    name: str
    """``colocated``, ``shm``, ``broadcast`` or ``shm+broadcast`` (a mixed update), for display and metrics."""
    sender: WeightSender | None
    """The bucket sender (``shm``/``broadcast``), or ``None``."""

    def push(self, source: WeightSource, version: int, watch: Callable[[], None] | None = None) -> dict[str, float]:
        """Move ``source``'s current weights into every target as ``version``, returning once all
        of them have loaded it (all or nothing per engine); returns transfer metrics. ``watch``,
        if given, is called while engines in other processes are waited on, and what it raises
        fails the push."""
        ...

    def close(self) -> None:
        """Release what the transport holds (shm slots)."""
        ...


class ColocatedTransport:
    """``colocated``: each engine lives in the learner's process and takes the learner's full
    tensors by name (``WeightTarget.load``: the engine's ``update_weights``), nothing copied in
    between. All or nothing per engine (``check_update`` before any write).

    Args:
        cfg: weight-sync settings.
        targets: ``WeightTarget``s, every one ``in_process``.

    Raises:
        ValueError: a target whose engine is not in this process.
    """

    name = "colocated"

    def __init__(self, cfg: WeightSyncConfig, targets: list) -> None:
        if not all(t.in_process for t in targets):
            raise ValueError("weight_sync.transport=colocated needs the engine in the learner's process "
                             "(sync mode, generator.backend=hf or sglang); use shm or broadcast")
        self.cfg, self.targets = cfg, targets
        self.sender: WeightSender | None = None

    def push(self, source: WeightSource, version: int, watch: Callable[[], None] | None = None) -> dict[str, float]:
        """Load ``source``'s weights into every engine as ``version``; returns ``{}`` (nothing is
        packed or sent). ``watch`` is not called: the engines load in this thread.

        Raises:
            KeyError, ValueError: an engine's refusal (``check_update``; that engine is untouched).
            RuntimeError: an engine's write failed midway (it refuses to sample until a complete update).
        """
        for t in self.targets:
            t.load(source.named_weights(), version)
        return {}

    def close(self) -> None:
        """Nothing to release."""


class BucketTransport:
    """``shm`` and ``broadcast``: one ``WeightSender`` streams planned buckets to the engines'
    ``WeightReceiver``s (the protocol of the module docstring). Connects every target on creation.

    Args:
        cfg: weight-sync settings (``cfg.transport`` is ignored; ``transport`` rules).
        transport: ``shm`` or ``broadcast`` for every target, or one of them per target (e.g.
            ``["shm", "broadcast"]``: shm for the engines on the learner's host, broadcast for the
            others, each bucket packed once); a list of equal entries is that single name.
        targets: ``WeightTarget``s (all of one kind).
        device: where the learner's tensors live: ``cuda`` makes ``broadcast`` use NCCL.
        protocol: the engines' bucket protocol (``config.engine_protocol``): ``async_rl`` or ``sglang``.
        host: the address engines reach the sender's store (and broadcast group) at: this host's
            address on the network they share (``127.0.0.1`` when all run here).
        watch: called about every 0.25 s (0.5 s while a broadcast group forms) while the
            receivers connect (the pool's supervision: an engine that hangs must not hold the
            connection to the timeout); what it raises fails the connection.

    Raises:
        ValueError: a transport other than ``shm``/``broadcast``, a list whose length is not the
            number of targets, or a mixed list with ``protocol="sglang"``.
        TimeoutError: a receiver did not connect within ``cfg.timeout_s``.
        RuntimeError: a receiver failed to connect (its error, within a second of it).
        Exception: what ``watch`` raised.
    """

    def __init__(self, cfg: WeightSyncConfig, transport: str | Sequence[str], targets: list, device: str = "cpu",
                 protocol: str = "async_rl", host: str = LOOPBACK, watch: Callable[[], None] | None = None) -> None:
        transports = _per_target(transport, targets)
        self.cfg, self.targets = cfg, targets
        single = transport if isinstance(transport, str) else (transports[0] if len(set(transports)) == 1 else None)
        self.sender = WeightSender(replace_transport(cfg, single) if single else cfg, len(targets), host=host,
                                   device=device, protocol=protocol, receiver_transports=transports)
        self.name = self.sender.name
        handles = [t.connect(self.sender.init_info(), r) for r, t in enumerate(targets)]
        self._form_group(handles, watch)  # broadcast: the group forms here, with every broadcast receiver joining
        deadline = time.monotonic() + cfg.timeout_s
        while True:  # in slices: a receiver's own failure, and what watch finds, end the wait at once
            try:
                wait_all(targets, handles, min(0.25, max(0.0, deadline - time.monotonic())), "")
                break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"weight sync ({self.name}) timed out after {cfg.timeout_s:.0f} s "
                                       f"connecting") from None
            self._raise_failed(handles, "failed to connect")
            if watch is not None:
                watch()
        self.sender.unlink_slots()

    def _form_group(self, handles: list, watch: Callable[[], None] | None = None) -> None:
        # Forming the group blocks until every broadcast receiver joins; a receiver that failed
        # to connect (a bad interface, an engine that died) would leave it waiting out the whole
        # timeout with a store error that names no one. Form it on a helper thread and watch the
        # receivers meanwhile, so their own error surfaces within a second.
        import threading

        done, errors = threading.Event(), []

        def form() -> None:
            try:
                self.sender.connect()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                errors.append(e)
            finally:
                done.set()

        threading.Thread(target=form, name="weight-sync-group", daemon=True).start()
        while not done.wait(0.5):
            self._raise_failed(handles, "failed to connect")
            if watch is not None:
                watch()
        if errors:
            raise errors[0]

    def _raise_failed(self, handles: list, what: str) -> None:
        # A receiver whose call already ended in an error (its engine refused or failed, its
        # actor died) will never join or acknowledge: say so now, naming it, not at the deadline.
        kind = type(self.targets[0])
        for rank, handle in enumerate(handles):
            try:
                kind.wait([handle], 0)
            except TimeoutError:
                continue  # still running
            except Exception as e:
                text = str(e).strip()
                raise RuntimeError(f"weight sync ({self.name}): receiver {rank} {what}: {type(e).__name__}: "
                                   f"{text.splitlines()[0] if text else ''}") from e

    def _watch(self, handles: list, watch: Callable[[], None] | None) -> None:
        self._raise_failed(handles, "failed")
        if watch is not None:
            watch()

    def _wait(self, handles: list, plan: UpdatePlan, what: str, timeout_s: float) -> list:
        try:
            return type(self.targets[0]).wait(handles, timeout_s)
        except TimeoutError:
            raise TimeoutError(self.sender.diagnose(plan, what)) from None

    def push(self, source: WeightSource, version: int, watch: Callable[[], None] | None = None) -> dict[str, float]:
        """Plan ``source``'s weights as ``version`` (from ``weight_metadata``, nothing gathered),
        stream them, and wait until every engine has loaded them. ``watch`` (optional) is called
        about every 0.25 s while waiting on the engines; what it raises fails the update.

        Returns:
            ``weight_sync/bytes``, ``weight_sync/pack_s``, ``weight_sync/send_s``, ``weight_sync/slot_wait_s``
            (``WeightSender.send``).

        Raises:
            RuntimeError: an engine refused the update (the message names the weights) or failed
                loading it, or a receiver's process died (named within about a second).
            Exception: whatever ``source.named_weights`` raised mid-stream (re-raised once the
                engines have settled).
            TimeoutError: not done within ``weight_sync.timeout_s`` (who, where).
        """
        deadline = time.monotonic() + self.cfg.timeout_s
        # Shapes without gathering: send() then gathers one tensor at a time.
        plan = self.sender.plan_shapes(source.weight_metadata(), version, source.weight_aliases())
        handles = [t.receive(plan.to_dict(), version) for t in self.targets]
        try:
            metrics = self.sender.send(plan, source.named_weights(), deadline, watch=lambda: self._watch(handles, watch))
        except Exception as sent:
            # Let every engine settle first (a staged copy dropped, or the engine marked
            # unusable), so that none is still loading when the caller sees the error; a
            # receiver's own exception names the weight, so surface it too.
            try:
                self._wait(handles, plan, "collecting the receivers' errors", timeout_s=30)
            except Exception as cause:
                if isinstance(sent, RuntimeError) and str(cause) not in str(sent):
                    raise RuntimeError(f"{sent} ({type(cause).__name__}: {cause})") from cause
                raise sent from cause
            raise
        self._wait_loaded(handles, plan, deadline, watch)
        return metrics

    def _wait_loaded(self, handles: list, plan: UpdatePlan, deadline: float, watch: Callable[[], None] | None) -> None:
        # In slices, so that ``watch`` runs while the engines load (a hung one would else hold
        # the update until the deadline).
        kind = type(self.targets[0])
        while True:
            try:
                kind.wait(handles, min(0.25, max(0.0, deadline - time.monotonic())))
                return
            except TimeoutError:
                if time.monotonic() >= deadline:  # who stands where, read once
                    raise TimeoutError(self.sender.diagnose(plan, "waiting for the engines to load")) from None
            if watch is not None:
                watch()

    def close(self) -> None:
        """Release the sender's slots."""
        self.sender.close()


def _per_target(transport: str | Sequence[str], targets: list) -> list[str]:
    # One name per target; a bare name applies to all.
    if isinstance(transport, str):
        return [transport] * len(targets)
    transports = list(transport)
    if len(transports) != len(targets):
        raise ValueError(f"weight_sync: {len(transports)} transports for {len(targets)} targets (one per target)")
    return transports


def make_transport(cfg: WeightSyncConfig, transport: str | Sequence[str], targets: list, device: str = "cpu",
                   protocol: str = "async_rl", host: str = LOOPBACK, watch: Callable[[], None] | None = None) -> Transport:
    """The transport object of a resolved ``transport`` over ``targets``: a ``ColocatedTransport``
    or a (connected) ``BucketTransport`` speaking ``protocol``.

    Args:
        transport: a resolved name (``resolve_transport``) for every target, or one per target
            (``transports_for_targets``); a list of equal entries is that single name, a mixed
            one may hold only ``shm`` and ``broadcast``.
        host: the sender's address as the engines reach it (``BucketTransport``).
        watch: called while the engines connect (``BucketTransport``).

    Raises:
        ValueError: ``auto`` or an unknown name; ``colocated`` with targets not in this process
            or mixed with another transport; a list whose length is not the number of targets; a
            mixed list with ``protocol="sglang"``.
    """
    transports = _per_target(transport, targets)
    names = sorted(set(transports)) or [transport]  # no targets: the bare name still decides
    if names == ["colocated"]:
        return ColocatedTransport(cfg, targets)
    unresolved = [n for n in names if n not in ("shm", "broadcast")]
    if unresolved:
        raise ValueError(f"not a resolved weight_sync transport: {unresolved[0]!r} (resolve_transport first"
                         f"{'; colocated cannot mix with shm or broadcast' if unresolved == ['colocated'] else ''})")
    return BucketTransport(cfg, transports, targets, device, protocol, host, watch)


class WeightPublisher:
    """The learner's driver: one call of ``push`` moves one policy version into every generator.

    Every push goes through here (sync rollouts, async pool, the evaluation engine, a resume):
    the transport object (``make_transport``) decides how the tensors travel. ``push`` blocks
    until every engine has loaded the version; ``start_push`` (async mode's
    ``weight_sync.overlap_push``) returns once the weights are staged and finishes the push on a
    background thread, collected by ``wait``. At most one push is pending at a time.

    Args:
        cfg: weight-sync settings.
        transport: the resolved transport (``resolve_transport``): ``colocated``, ``shm`` or
            ``broadcast``; or one per target (``transports_for_targets``), e.g. ``["shm",
            "broadcast"]`` (``make_transport``).
        learner: the ``WeightSource`` (a learner, ``ModuleWeights``, ``NamedTensors``).
        targets: ``WeightTarget``s (``LocalTarget``s or ``RayTarget``s, all of one kind).
        device: where the learner's tensors live: ``cuda`` makes ``broadcast`` use NCCL.
        protocol: the engines' bucket protocol (``config.engine_protocol(generator.backend)``).
        host: the address engines on other hosts reach the sender at (``127.0.0.1``: all on this host).
        watch: called while the engines connect, here and when a broken broadcast group is
            rebuilt (``BucketTransport``); what it raises fails the connection.

    Raises:
        ValueError: ``colocated`` with targets that are not in this process, an unresolved
            transport name, or a bad per-target list (``make_transport``).
        TimeoutError: ``shm``/``broadcast``: a target did not connect within ``cfg.timeout_s``.
    """

    def __init__(self, cfg: WeightSyncConfig, transport: str | Sequence[str], learner: WeightSource, targets: list,
                 device: str = "cpu", protocol: str = "async_rl", host: str = LOOPBACK,
                 watch: Callable[[], None] | None = None) -> None:
        self.cfg, self.transport, self.learner, self.targets = cfg, transport, learner, targets
        self.published_version: int | None = None
        self._where = (device, protocol, host, watch)
        self._transport = make_transport(cfg, transport, targets, device, protocol, host, watch)
        self._pending: Future | None = None  # start_push's background push, until wait() collects it
        self._pending_version: int | None = None
        self._staging: dict[str, torch.Tensor] = {}  # start_push's copy of the weights, reused

    @property
    def transport_name(self) -> str:
        """For display and metrics: ``colocated``, ``shm``, ``broadcast`` or ``shm+broadcast`` (mixed)."""
        return self._transport.name

    @property
    def sender(self) -> WeightSender | None:
        """The bucket sender (``shm``/``broadcast``), or ``None`` (``colocated``)."""
        return self._transport.sender

    def push(self, version: int, watch: Callable[[], None] | None = None) -> dict[str, float]:
        """Send the learner's current weights as ``version``; returns once every generator has
        loaded them (then, and only then, ``published_version = version``). ``watch``: for
        ``shm``/``broadcast``, called about every 0.25 s while the engines are waited on (the
        pool's supervision: it raises when an actor hangs); what it raises fails the push.

        A push still pending (``start_push``) is collected first, and its failure raised.

        A failed push publishes nothing: each engine either refused the update before any write
        (unchanged), dropped its staged copy (HF: old weights and version), or is marked unusable
        until a complete update (vLLM, after a failure past its first loaded bucket). See the
        module docstring, *All or nothing*. A failed push with a broadcast group drops the group
        (``WeightSender.broken``); the next push first rebuilds the transport, connecting every
        engine again.

        Returns:
            ``timing/weight_sync_s`` (= ``weight_sync/publish_lag_s``: the caller waits for every
            engine) and, for shm/broadcast, bytes moved, pack/send seconds and ``weight_sync/gb_per_s``.

        Raises:
            RuntimeError: a generator rejected the update (the message names the weights and what
                was wrong) or failed loading it.
            KeyError, ValueError: ``colocated``: the engine's own refusal (``check_update``).
            Exception: whatever the learner's ``named_weights`` raised mid-stream (re-raised once
                the engines have settled).
            TimeoutError: the sync did not finish in ``weight_sync.timeout_s`` (who, where), or
                an engine did not reconnect in that time when the transport was rebuilt.
        """
        t0 = time.perf_counter()
        self.wait()  # a pending push first (its failure raises here): one push at a time
        self._repair()
        metrics = self._transport.push(self.learner, version, watch)
        self.published_version = version
        metrics["timing/weight_sync_s"] = metrics["weight_sync/publish_lag_s"] = time.perf_counter() - t0
        if metrics.get("weight_sync/bytes"):
            metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / 1e9 / metrics["timing/weight_sync_s"]
        return metrics

    @property
    def can_overlap(self) -> bool:
        """Whether ``start_push`` finishes in the background: ``shm``/``broadcast``, whose sender
        reads a staged copy. ``colocated`` hands the learner's own tensors to the engine by
        reference, so its pushes always block."""
        return self._transport.sender is not None

    @property
    def pending_version(self) -> int | None:
        """The version ``start_push`` is pushing (or pushed, not yet collected by ``wait``), or ``None``."""
        return None if self._pending is None else self._pending_version

    def pending_done(self) -> bool:
        """Whether a pending push has ended (``wait`` then returns or raises without blocking);
        ``False`` when none is pending."""
        return self._pending is not None and self._pending.done()

    def start_push(self, version: int, watch: Callable[[], None] | None = None,
                   on_published: Callable[[int], None] | None = None,
                   thread_cores: list[int] | None = None) -> dict[str, float]:
        """Push the learner's current weights as ``version`` without waiting for the engines:
        returns as soon as the learner may change its parameters again.

        On the caller's thread: the pending push, if any, is collected first (``wait``; its
        failure raises here, before anything else), a broken broadcast group is rebuilt, and
        ``named_weights`` is drained into a staging copy (``_stage``: collective on a multi-rank
        learner, so every rank gathers in the same order on its main thread). A background thread
        then plans, streams the copy and waits until every engine has loaded it, calling
        ``watch`` as ``push`` does (from that thread); only then is ``published_version = version``
        and ``on_published(version)`` called (from that thread). ``wait`` collects its metrics or
        raises its failure. With ``colocated`` (``can_overlap`` false) this is ``push``, followed
        by ``on_published``. ``thread_cores``: the CPU ids the background thread runs on (the
        async pipeline's service cores, off the learner's; empty or ``None``: the caller's).

        Returns:
            ``timing/weight_sync_s`` (seconds the caller was held: the staging copy, or the whole
            push when it blocks), ``weight_sync/stage_s`` and ``weight_sync/bytes`` (the update's
            size on the wire, from its plan); the background push's metrics
            (``weight_sync/publish_lag_s``: seconds from this call until every engine had the
            version, bytes, pack/send seconds, ``weight_sync/gb_per_s`` over the background
            seconds) come from ``wait``.

        Raises:
            Exception: the previous pending push's failure (as ``wait``), or what ``push`` raises
                with ``colocated``, or what ``named_weights`` raised while staging.
            TimeoutError: an engine did not reconnect within ``weight_sync.timeout_s`` while a
                broken broadcast group was rebuilt.
        """
        t0 = time.perf_counter()
        self.wait()
        if not self.can_overlap:
            metrics = self.push(version, watch)
            if on_published is not None:
                on_published(version)
            return metrics
        self._repair()
        staged = self._stage()
        held_s = time.perf_counter() - t0
        transport = self._transport

        def finish() -> dict[str, float]:
            t1 = time.perf_counter()
            metrics = transport.push(staged, version, watch)
            self.published_version = version
            if on_published is not None:
                on_published(version)
            now = time.perf_counter()
            metrics["weight_sync/publish_lag_s"] = now - t0
            if metrics.get("weight_sync/bytes"):
                metrics["weight_sync/gb_per_s"] = metrics["weight_sync/bytes"] / 1e9 / max(now - t1, 1e-9)
            return metrics

        # The update's size is known now: each step reports the bytes of the push it started
        # (the background push's own figures arrive with ``wait``, in a later step). Planned
        # before the thread starts: planning may grow the shm slots, which the push then uses.
        plan = transport.sender.plan_shapes(staged.weight_metadata(), version, staged.weight_aliases())
        with started_on(thread_cores or []):
            self._pending, self._pending_version = _in_background(finish, f"weight-push-v{version}"), version
        return {"timing/weight_sync_s": held_s, "weight_sync/stage_s": held_s,
                "weight_sync/bytes": float(plan.total_bytes)}

    def wait(self) -> dict[str, float]:
        """Block until the pending push (``start_push``) ends, and collect it.

        Returns:
            Its background metrics (see ``start_push``), ``{}`` when none is pending.

        Raises:
            Exception: the push's failure, the very exception ``push`` would have raised (an
                engine's refusal naming the weights, a receiver that died, ``TimeoutError``, what
                ``watch`` raised), once: the push then counts as collected.
        """
        pending = self._pending
        if pending is None:
            return {}
        try:
            metrics = pending.result()
        except Exception:
            self._pending = None
            raise
        self._pending = None
        return metrics

    def _repair(self) -> None:
        # A failed push with a broadcast group dropped the group: connect every engine anew.
        sender = self._transport.sender
        if sender is not None and sender.broken is not None:
            self._transport.close()
            self._transport = make_transport(self.cfg, self.transport, self.targets, *self._where)

    def _stage(self) -> NamedTensors:
        """The learner's weights copied into the staging buffers (full tensors, in
        ``named_weights`` order, on the learner's device and in its dtype), so that the next
        optimizer step may change the parameters while the copy is being sent. The buffers are
        allocated once and reused; at most one push reads them (``start_push`` collects the
        pending one first)."""
        named = []
        for name, tensor in self.learner.named_weights():
            # A sharded parameter is gathered here, on the caller's thread (it is collective).
            tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            buf = self._staging.get(name)
            if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype or buf.device != tensor.device:
                buf = self._staging[name] = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            buf.copy_(tensor)
            named.append((name, buf))
        return NamedTensors(named, self.learner.weight_aliases())

    def close(self) -> None:
        """Wait for a pending push (its failure is logged: a caller that needs it calls ``wait``
        first), then release the transport (shm slots) and the staging buffers."""
        version = self.pending_version
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - closing: the owner has collected what it needs
            logger.warning("weight push v%s failed before close: %s", version, e)
        self._staging.clear()
        self._transport.close()


def _in_background(fn: Callable[[], Any], name: str) -> Future:
    """``fn()`` on a daemon thread of its own; its result or exception in the returned future.
    (Not a thread pool: a push stuck until its timeout must not hold the interpreter at exit.)"""
    future: Future = Future()

    def run() -> None:
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller of wait()
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
