"""The two ends of a bucket transfer (``shm`` slots or a ``broadcast`` group): ``WeightSender`` on
the learner, ``WeightReceiver`` in each engine process (protocol: ``async_rl.weight_sync``).

One sender may serve each receiver by its own transport in the same update (``receiver_transports``):
engines on the learner's host read the shared-memory slots, engines on other hosts take the same
bucket bytes through the broadcast group, which holds the sender and the broadcast receivers only."""

from __future__ import annotations

import datetime
import os
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from torch.distributed.tensor import DTensor

from async_rl.runtime.cluster import LOOPBACK, tcp_store
from async_rl.weight_sync.config import WeightSyncConfig
from async_rl.weight_sync.protocols import PROTOCOLS
from async_rl.weight_sync.plan import DTYPES, UpdatePlan, pack_bucket, plan_update, unpack_bucket


POLL_S = 0.1
"""Seconds between a waiting receiver's looks at the store (the update's ``error`` key, and
whether the sender's store still answers): how soon it notices a sender that failed or died."""


def _store_timeout(timeout_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=timeout_s)


def _slot_path(prefix: str, k: int) -> str:
    return f"/dev/shm/{prefix}-slot{k}" if os.path.isdir("/dev/shm") else os.path.join(
        os.environ.get("TMPDIR", "/tmp"), f"{prefix}-slot{k}")


class WeightSender:
    """The learner's end of the weight sync layer (see the module docstring for the protocol).

    Args:
        cfg: weight-sync settings; ``cfg.transport`` must be ``shm`` or ``broadcast`` unless
            ``receiver_transports`` is given (then it is not read).
        num_receivers: generator engines that receive every update (>= 1).
        host: address receivers reach the store at (``127.0.0.1`` for one host).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL) for ``broadcast``.
        protocol: ``async_rl`` (our ``WeightReceiver``s) or ``sglang`` (SGLang engines,
            ``config.engine_protocol``): the broadcast group is then formed the way SGLang's
            ``init_weights_update_group`` joins one (``init_custom_process_group`` over this
            sender's store, group name ``prefix``), and buckets are packed back to back
            (``plan_update(align=1)``), the layout of its ``update_weights_from_distributed(
            load_format="flattened_bucket")``.
        receiver_transports: each receiver rank's transport, ``shm`` or ``broadcast`` (length
            ``num_receivers``); ``None``: ``cfg.transport`` for all. Each bucket is packed once,
            into a shm slot when any receiver is ``shm``, and the broadcast receivers get the
            same bytes through the group (sender = group rank 0, the broadcast receivers ranks
            1.. in receiver order: ``init_info()["group_ranks"]``). Slots exist only when some
            receiver is ``shm``. A mixed list needs ``protocol="async_rl"``.

    Raises:
        ValueError: a transport this class does not carry (``colocated`` needs no sender), a
            ``receiver_transports`` of the wrong length, an unknown protocol, or a mixed list
            with ``protocol="sglang"``.

    Attributes:
        name: ``shm``, ``broadcast`` or ``shm+broadcast`` (mixed); display, diagnostics and
            ``init_info()["transport"]``.
        transports: each receiver rank's transport.
        group_ranks: each receiver rank's rank in the broadcast group (``None`` for ``shm``).
        broken: why the broadcast group is gone (an update failed while it existed), or ``None``.
            The group cannot be formed again under this sender's rendezvous: every further
            ``send`` raises, and the owner rebuilds the transport (``WeightPublisher.push``
            does, before its next update).
    """

    def __init__(self, cfg: WeightSyncConfig, num_receivers: int, host: str = LOOPBACK, device: str = "cpu",
                 protocol: str = "async_rl", receiver_transports: Sequence[str] | None = None) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"unknown weight sync protocol {protocol!r} (one of {', '.join(PROTOCOLS)})")
        spec = PROTOCOLS[protocol]
        transports = [cfg.transport] * num_receivers if receiver_transports is None else list(receiver_transports)
        if len(transports) != num_receivers:
            raise ValueError(f"receiver_transports has {len(transports)} entries for {num_receivers} receivers")
        bad = sorted({t for t in transports if t not in ("shm", "broadcast")})
        if bad:
            raise ValueError(f"WeightSender carries shm or broadcast, not {bad[0]!r}")
        if not spec.mixed_transports and len(set(transports)) > 1:
            raise ValueError(f"{spec.receivers} cannot mix shm and broadcast in one update (they join the broadcast "
                             "group themselves): set weight_sync.transport=shm or broadcast")
        self.cfg, self.num_receivers, self.device, self.protocol = cfg, num_receivers, device, protocol
        self._spec = spec
        self.transports = transports
        self.name = "shm+broadcast" if len(set(transports)) > 1 else (transports[0] if transports else cfg.transport)
        # Group rank of each receiver: 1.. over the broadcast receivers in rank order, None for shm.
        bcast = [r for r, t in enumerate(transports) if t == "broadcast"]
        self.group_ranks: list[int | None] = [None] * num_receivers
        for k, r in enumerate(bcast):
            self.group_ranks[r] = k + 1
        self.group_world = 1 + len(bcast)
        self._shm = "shm" in transports
        self.store = tcp_store(host, num_receivers + 1, _store_timeout(cfg.timeout_s))
        self.host, self.port = host, self.store.port
        self.prefix = f"async-rl-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.slots: list[torch.Tensor] = []
        self._slot_paths: list[str] = []
        self._slot_bytes = 0
        self.group = None
        self.broken: str | None = None
        self.num_updates = 0
        self._bcast_buf: torch.Tensor | None = None
        if self._shm:
            self._alloc_slots(cfg.bucket_bytes)
        import atexit

        atexit.register(self._free_slots)

    def _alloc_slots(self, nbytes: int) -> None:
        self._free_slots()
        self._slot_bytes = nbytes
        self._slot_paths = [_slot_path(f"{self.prefix}-{nbytes}", k) for k in range(self.cfg.num_slots)]
        # torch.from_file(shared=True) maps the file MAP_SHARED: every process that maps it sees
        # one copy of the bytes, and the mapping is made once per slot, not once per update.
        self.slots = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in self._slot_paths]

    def _free_slots(self) -> None:
        for p in self._slot_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        self.slots, self._slot_paths = [], []

    def init_info(self) -> dict[str, Any]:
        """What a receiver needs to connect (JSON-able).

        ``transport``: ``shm``, ``broadcast``, or ``shm+broadcast`` for a mixed sender;
        ``transports``/``group_ranks``: per receiver rank, its transport and its rank in the
        broadcast group (``None`` for ``shm``); ``world_size``: the broadcast group's size (the
        sender plus the broadcast receivers); ``num_receivers``: all receivers."""
        return {"transport": self.name, "transports": list(self.transports), "group_ranks": list(self.group_ranks),
                "host": self.host, "port": self.port, "num_receivers": self.num_receivers,
                "world_size": self.group_world, "timeout_s": self.cfg.timeout_s,
                "device": self.device, "prefix": self.prefix, "protocol": self.protocol,
                "group_name": self.prefix,
                "slots": [[p, self._slot_bytes] for p in self._slot_paths]}

    def unlink_slots(self) -> None:
        """Remove the slot files once every receiver has mapped them (``connect``): the memory
        stays shared through the mappings and is freed when the last process unmaps it, so a
        killed run leaves nothing behind in ``/dev/shm``."""
        for p in self._slot_paths:
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass

    def connect(self) -> None:
        """Join the broadcast group (blocks until every broadcast receiver connects); no-op when
        every receiver is ``shm``."""
        if self.group_world > 1 and self.group is None:
            new = _sglang_group if self._spec.engine_group else _new_group
            self.group = new(self.store, 0, self.group_world, self.device, self.cfg.timeout_s, self.prefix)

    def plan(self, named_tensors: Sequence[tuple[str, torch.Tensor]], version: int,
             aliases: dict[str, str] | None = None) -> UpdatePlan:
        """The bucket layout of ``named_tensors`` (full tensors, or DTensors: only shapes are read)."""
        return self.plan_shapes([(n, t.dtype, tuple(t.shape)) for n, t in named_tensors], version, aliases)

    def plan_shapes(self, meta: Sequence[tuple[str, torch.dtype, Sequence[int]]], version: int,
                    aliases: dict[str, str] | None = None) -> UpdatePlan:
        """The bucket layout of ``(name, dtype, full shape)`` entries (``plan_update``); grows the
        shm slots if one layer is larger than a bucket."""
        wire = None if self.cfg.wire_dtype == "auto" else DTYPES[self.cfg.wire_dtype]
        plan = plan_update(meta, version, self.cfg.bucket_bytes, aliases, wire,
                           **({} if self._spec.align is None else {"align": self._spec.align}))
        if self._shm and max(plan.bucket_nbytes) > self._slot_bytes:
            self._alloc_slots(max(plan.bucket_nbytes))  # one oversized tensor: grow the slots once
        return plan

    def send(self, plan: UpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float | None = None,
             watch: Callable[[], None] | None = None) -> dict[str, float]:
        """Stream ``tensors`` (in plan order; DTensors are gathered one at a time) to every receiver.

        Call while every receiver runs ``WeightReceiver.receive(plan)`` (concurrently).

        On any failure the sender posts it as the update's ``error`` (every receiver polls that
        key, so it stops within ``POLL_S``) and, if it has a broadcast group, drops the group
        (``broken``): broadcast receivers wait in a collective the sender will not match, and
        closing the group's connections ends it at once on their side.

        Args:
            deadline: ``time.monotonic()`` by which the update must be through (default: now +
                ``weight_sync.timeout_s``).
            watch: called about every 0.25 s while waiting on the receivers; it raises when one
                of them is gone (its process died), so that the update fails in about a second
                instead of at the deadline.

        Returns:
            ``weight_sync/bytes``; seconds: ``weight_sync/pack_s`` (copying the learner's
            tensors into the slots or the broadcast buffer, cast to the wire dtype),
            ``weight_sync/send_s`` (announcing a slot; the broadcasts), ``weight_sync/slot_wait_s``
            (``shm``: waiting for the receivers to release a slot before reusing it).

        Raises:
            RuntimeError: a receiver reported an error (its message, e.g. an unknown weight name),
                or the group broke in an earlier update (``broken``: rebuild the transport).
            TimeoutError: receivers did not get ready or acknowledge in time (which and where).
            Exception: what ``watch`` raised.
        """
        if self.broken is not None:
            message = (f"weight sync ({self.name}): {self.broken}; this sender's broadcast group is gone, rebuild the "
                       f"transport (a new WeightSender, every receiver connected again)")
            self.store.set(f"{plan.update_id}/error", f"sender: {message}")  # receivers already waiting stop
            raise RuntimeError(message)
        deadline = deadline or time.monotonic() + self.cfg.timeout_s
        self._forget_previous(plan)
        try:
            self._wait_count(plan, "ready", self.num_receivers, deadline, watch)
            return self._send(plan, tensors, deadline, watch)
        except BaseException as e:
            # Tell the receivers at once rather than leaving them blocked on the next bucket:
            # each polls this key while it waits.
            if not self.store.check([f"{plan.update_id}/error"]):
                self.store.set(f"{plan.update_id}/error", f"sender: {type(e).__name__}: {e}")
            if self.group is not None:
                self._drop_group(f"update v{plan.version} failed ({type(e).__name__}: {e})")
            raise

    def _drop_group(self, why: str) -> None:
        # The last reference goes: the group's destructor closes its connections, which fails
        # the collective each broadcast receiver waits in ("Connection closed by peer") at once;
        # the error key set before tells them why. (ProcessGroupGloo.abort/shutdown leave the
        # connections open: measured, a receiver's pending broadcast then ran to its timeout.)
        # No collective of the sender's own is pending here (each broadcast was waited for), so
        # the destructor does not block on one.
        self.broken = why
        group, self.group = self.group, None
        if self._spec.engine_group:
            import torch.distributed as dist

            try:  # registered with torch's group registry (``_sglang_group``), which holds it too
                dist.destroy_process_group(group)
            except Exception:  # noqa: BLE001 - best effort: SGLang's schedulers time out themselves
                pass
        del group

    def _send(self, plan: UpdatePlan, tensors: Iterable[tuple[str, torch.Tensor]], deadline: float,
              watch: Callable[[], None] | None) -> dict[str, float]:
        it = iter(tensors)
        pack_s = send_s = wait_s = 0.0
        nslots = len(self.slots)
        for i, metas in enumerate(plan.buckets):
            if i and self.store.check([f"{plan.update_id}/error"]):
                # A receiver gave up (its loader failed): broadcast receivers would leave the next
                # collective unmatched, shm ones would never acknowledge.
                raise RuntimeError(f"weight sync v{plan.version}: a generator failed: "
                                   f"{self.store.get(f'{plan.update_id}/error').decode()}")
            want = {m.name for m in metas if m.alias_of is None}
            got: dict[str, torch.Tensor] = {}
            while len(got) < len(want):
                name, t = next(it)
                if name not in want:
                    raise ValueError(f"weight {name!r} arrived out of plan order (bucket {i} expects {sorted(want)[:4]})")
                # A sharded learner's parameter is gathered here, one at a time.
                got[name] = t.full_tensor() if isinstance(t, DTensor) else t
            t0 = time.perf_counter()
            if self._shm:
                if i >= nslots:  # slot reuse: every receiver must be done with bucket i - nslots
                    self._wait_count(plan, f"ack{i - nslots}", self.num_receivers, deadline, watch)
                wait_s += time.perf_counter() - t0
                t0 = time.perf_counter()
                buf = self.slots[i % nslots][: plan.bucket_nbytes[i]]
                pack_bucket(buf, metas, got)
                t1 = time.perf_counter()
                # Announced first: shm receivers load while the broadcast below is in flight.
                self.store.set(f"{plan.update_id}/bucket{i}", f"{self._slot_paths[i % nslots]}:{self._slot_bytes}")
                if self.group is not None:
                    # The slot's bytes, not a second pack; NCCL needs them on the device first.
                    self.group.broadcast(buf if buf.device.type == torch.device(self.device).type
                                         else buf.to(self.device), 0).wait()
            else:
                # Kept across updates: a fresh buffer would fault every page in again, each update.
                if self._bcast_buf is None or self._bcast_buf.numel() < plan.bucket_nbytes[i]:
                    self._bcast_buf = None
                    self._bcast_buf = torch.empty(max(plan.bucket_nbytes), dtype=torch.uint8, device=self.device)
                buf = self._bcast_buf[: plan.bucket_nbytes[i]]
                pack_bucket(buf, metas, got)
                t1 = time.perf_counter()
                self.group.broadcast(buf, 0).wait()
            pack_s += t1 - t0
            send_s += time.perf_counter() - t1
            del got
        self.num_updates += 1
        return {"weight_sync/bytes": float(plan.total_bytes), "weight_sync/pack_s": pack_s, "weight_sync/send_s": send_s,
                "weight_sync/slot_wait_s": wait_s}

    def _forget_previous(self, plan: UpdatePlan) -> None:
        # The previous update is complete (its caller waited for every engine): drop its keys so
        # a long run does not grow the store by a few keys per version.
        prev, self._last_plan = getattr(self, "_last_plan", None), plan
        if prev is None:
            return
        for key in ["ready", "error"] + [f"bucket{i}" for i in range(len(prev.buckets))] + \
                [f"ack{i}" for i in range(len(prev.buckets))]:
            self.store.delete_key(f"{prev.update_id}/{key}")

    def _wait_count(self, plan: UpdatePlan, key: str, n: int, deadline: float,
                    watch: Callable[[], None] | None = None) -> None:
        full = f"{plan.update_id}/{key}"
        err = f"{plan.update_id}/error"
        next_watch = time.monotonic() + 0.25
        while True:
            if watch is not None and time.monotonic() >= next_watch:
                watch()
                next_watch = time.monotonic() + 0.25
            if self.store.check([err]):
                raise RuntimeError(f"weight sync v{plan.version}: a generator failed: {self.store.get(err).decode()}")
            if self.store.add(full, 0) >= n:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(self.diagnose(plan, f"waiting for {n} receivers' {key!r}"))
            time.sleep(0.0005)

    def diagnose(self, plan: UpdatePlan, what: str) -> str:
        """Where each receiver stands in ``plan`` (for a timeout message)."""
        ready = self.store.add(f"{plan.update_id}/ready", 0)
        acks = [self.store.add(f"{plan.update_id}/ack{i}", 0) for i in range(len(plan.buckets))]
        return (f"weight sync v{plan.version} ({self.name}) timed out after {self.cfg.timeout_s:.0f} s "
                f"{what}: {ready}/{self.num_receivers} receivers ready; acknowledgements per bucket {acks}")

    def close(self) -> None:
        """Release the slots (the files are unlinked; receivers' mappings stay valid until closed)
        and the broadcast buffer."""
        self._free_slots()
        self._bcast_buf = None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def _new_group(store, rank: int, world: int, device: str, timeout_s: float, prefix: str):
    import torch.distributed as dist

    pstore = dist.PrefixStore(f"{prefix}/pg", store)
    if device.startswith("cuda"):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _store_timeout(timeout_s)
        return dist.ProcessGroupNCCL(pstore, rank, world, opts)
    return dist.ProcessGroupGloo(pstore, rank, world, _store_timeout(timeout_s))


def _sglang_group(store, rank: int, world: int, device: str, timeout_s: float, group_name: str):
    # The group SGLang's scheduler forms in ``init_weights_update_group``
    # (sglang.srt.utils.init_custom_process_group: a PrefixStore named after the group over the
    # rendezvous store, then torch's own group helper, which prefixes it again per group and
    # device). Forming it the same way over this sender's TCPStore (the scheduler's
    # ``tcp://host:port`` rendezvous connects to it) is what lets the two sides meet.
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _new_process_group_helper

    backend = "nccl" if device.startswith("cuda") else "gloo"
    pg, _ = _new_process_group_helper(world, rank, [], dist.Backend(backend), dist.PrefixStore(group_name, store),
                                      group_name=group_name, backend_options=None, timeout=_store_timeout(timeout_s))
    return pg


class WeightReceiver:
    """A generator's end of the weight sync layer (see the module docstring for the protocol).

    Args:
        init_info: ``WeightSender.init_info()``.
        rank: this receiver's index among the sender's receivers (0-based).

    Attributes:
        transport: this receiver's own transport, ``shm`` or ``broadcast`` (a mixed sender serves
            each receiver by its own).
        group_rank: its rank in the broadcast group (``None`` for ``shm``).
        broken: why this receiver cannot take another update (a failed update dropped its
            broadcast group), or ``None``; connect a new receiver to a rebuilt sender.
    """

    def __init__(self, init_info: dict[str, Any], rank: int) -> None:
        import torch.distributed as dist

        self.info, self.rank = dict(init_info), rank
        # init_info without the per-rank lists comes from a uniform sender (group rank = rank + 1).
        self.transport = init_info["transports"][rank] if "transports" in init_info else init_info["transport"]
        self.group_rank = init_info["group_ranks"][rank] if "group_ranks" in init_info else (
            rank + 1 if self.transport == "broadcast" else None)
        num_receivers = int(init_info.get("num_receivers", int(init_info["world_size"]) - 1))
        self.store = dist.TCPStore(init_info["host"], int(init_info["port"]), num_receivers + 1, False,
                                   timeout=_store_timeout(float(init_info["timeout_s"])))
        self.group = None
        self.broken: str | None = None
        self._maps: dict[str, torch.Tensor] = {}
        self._bufs: list[torch.Tensor] = []
        """``broadcast``: two receive buffers of the largest bucket, kept across updates (bucket
        i + 1 arrives in one while the loader reads bucket i from the other)."""

    def connect(self) -> None:
        """Map the shm slots, or join the broadcast group (blocks until the sender and all
        broadcast receivers connect).

        Raises:
            RuntimeError: the receiver is ``broken`` (a failed update dropped its group)."""
        if self.broken is not None:
            raise RuntimeError(f"weight receiver {self.rank}: {self.broken}; connect a new receiver to a rebuilt "
                               f"sender")
        if self.transport == "shm":  # a broadcast receiver may be on another host, without the files
            for path, nbytes in self.info.get("slots", []):
                self._slot(path, int(nbytes))
        if self.transport == "broadcast" and self.group is None:
            self.group = _new_group(self.store, self.group_rank, int(self.info["world_size"]), self.info["device"],
                                    float(self.info["timeout_s"]), self.info["prefix"])

    def fail(self, plan: UpdatePlan, message: str) -> None:
        """Tell the sender this update cannot be loaded (it raises ``RuntimeError`` with ``message``).

        The first error posted for an update stands (it is the cause; later ones are its echoes)."""
        key = f"{plan.update_id}/error"
        if not self.store.check([key]):
            self.store.set(key, f"receiver {self.rank}: {message}")

    def receive(self, plan: UpdatePlan, check=None) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Yield each bucket's ``(name, tensor)`` views in plan order.

        Args:
            plan: the update's layout.
            check: optional callable on ``plan.names`` run before any byte moves (the engine's
                check of the whole plan, ``check_update``); if it raises, the sender is told and
                the error propagates.

        A yielded bucket's views are valid only until the next one is requested: the loader must
        consume (or copy) them before asking for the next. A ``broadcast`` receiver posts the
        next bucket's receive before yielding one, into its other buffer, so the transfer of
        bucket i + 1 overlaps the loading of bucket i (memory: two buffers of the largest bucket). If the loader stops early (it raised,
        or closed this iterator) the sender is told, so it stops instead of waiting for
        acknowledgements; a loader that ``fail``s with its own message inside the loop, before
        leaving it, has that message reach the sender instead.

        A sender that fails mid-update is noticed within about ``POLL_S`` on every transport:
        while a bucket is awaited the receiver polls the update's ``error`` key (which the
        sender sets when it raises), and a sender whose process died shows as its store no
        longer answering (or, for ``broadcast``, the group's connection closing). A broadcast
        receiver then leaves its group (``broken``): it takes no further update.

        Raises:
            RuntimeError: the sender (or another receiver) reported an error mid-update (its
                message), or the sender is gone (its process died: the store does not answer).
            TimeoutError: a bucket did not arrive within ``timeout_s``.
        """
        try:
            if check is not None:
                check(plan.names)
            self.connect()
        except Exception as e:
            self.fail(plan, f"{type(e).__name__}: {e}")
            raise
        i, complete = 0, False
        pending = None  # broadcast: the one receive posted and not yet waited for
        if self.transport == "broadcast" and plan.buckets:
            largest = max(plan.bucket_nbytes)
            if len(self._bufs) < 2 or self._bufs[0].numel() < largest:
                self._bufs = []
                self._bufs = [torch.empty(largest, dtype=torch.uint8, device=self.info["device"]) for _ in range(2)]
        self.store.add(f"{plan.update_id}/ready", 1)
        try:
            if self.transport == "broadcast" and plan.buckets:
                pending = self._post(plan, 0)
            for i, metas in enumerate(plan.buckets):
                if self.transport == "shm":
                    key = f"{plan.update_id}/bucket{i}"
                    self._wait_key(plan, key)
                    path, nbytes = self._store_call(plan, self.store.get, key).decode().rsplit(":", 1)
                    buf = self._slot(path, int(nbytes))[: plan.bucket_nbytes[i]]
                else:
                    buf, work = pending
                    self._wait_broadcast(plan, i, work)
                    # The next bucket arrives in the other buffer while the loader reads this one.
                    pending = self._post(plan, i + 1) if i + 1 < len(plan.buckets) else None
                yield unpack_bucket(buf, metas)
                self._store_call(plan, self.store.add, f"{plan.update_id}/ack{i}", 1)
            complete = True
        finally:
            if not complete:
                try:
                    self.fail(plan, f"stopped at bucket {i} of {len(plan.buckets)}")
                except Exception:  # noqa: BLE001 - the store may be gone with the sender; the cause propagates
                    pass
                if self.group is not None:  # this receiver left the group's sequence of collectives
                    self._leave_group(plan, pending[1] if pending is not None else None)

    def _post(self, plan: UpdatePlan, i: int) -> tuple[torch.Tensor, Any]:
        # Bucket i's receive, into buffer i % 2: the bucket before it (the other buffer) may still
        # be in the loader's hands, the one two back is not (the loader asked for the next).
        buf = self._bufs[i % 2][: plan.bucket_nbytes[i]]
        return buf, self.group.broadcast(buf, 0)

    def _wait_key(self, plan: UpdatePlan, key: str) -> None:
        deadline = time.monotonic() + float(self.info["timeout_s"])
        while not self._store_call(plan, self.store.check, [key]):
            self._raise_if_aborted(plan)
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight sync v{plan.version}: receiver {self.rank} waited "
                                   f"{self.info['timeout_s']} s for {key!r}")
            time.sleep(0.0002)

    def _wait_broadcast(self, plan: UpdatePlan, i: int, work) -> None:
        # In slices rather than one blocking wait: between them the update's error key is read,
        # so a sender that raised stops this receiver within POLL_S, not at the group's timeout.
        # (is_completed reads gloo's state or NCCL's CUDA event without blocking.) The pause
        # grows to 2 ms: a bucket's transfer takes far longer, and a tight loop would take CPU
        # from gloo's own threads.
        deadline = time.monotonic() + float(self.info["timeout_s"])
        next_poll = time.monotonic() + POLL_S
        pause = 0.0002
        try:
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_poll:
                    self._raise_if_aborted(plan)
                    next_poll = now + POLL_S
                if now > deadline:
                    raise TimeoutError(f"weight sync v{plan.version}: receiver {self.rank} waited "
                                       f"{self.info['timeout_s']} s for bucket {i} of {len(plan.buckets)} (broadcast)")
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
            try:
                work.wait()
            except Exception as e:  # its connection closed (the sender dropped the group, or died), or a timeout
                self._raise_if_aborted(plan)  # the sender's own error, or "the sender is gone" if its store is
                raise RuntimeError(f"weight sync v{plan.version}: the broadcast of bucket {i} of {len(plan.buckets)} "
                                   f"failed ({_first_line(e)})") from e
        except BaseException:
            self._leave_group(plan, work)
            raise

    def _raise_if_aborted(self, plan: UpdatePlan) -> None:
        err = f"{plan.update_id}/error"
        if self._store_call(plan, self.store.check, [err]):
            cause = self._store_call(plan, self.store.get, err).decode()
            raise RuntimeError(f"weight sync v{plan.version} aborted: {cause}")

    def _store_call(self, plan: UpdatePlan, fn, *args):
        # The store lives in the sender's process: when it stops answering, the sender is gone.
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - torch raises several kinds (DistNetworkError, RuntimeError)
            raise RuntimeError(f"weight sync v{plan.version}: the sender is gone (its store at {self.info['host']}:"
                               f"{self.info['port']} does not answer: {_first_line(e)})") from e

    def _leave_group(self, plan: UpdatePlan, work) -> None:
        # The broadcast this receiver posted may still be pending: it ends when the sender's side
        # of the group closes (the sender drops it when an update fails, or its process died),
        # at the latest at the group's timeout. Destroying a gloo group waits for its pending
        # work, so the group is released on a thread of its own once that work ended; its
        # receive buffer goes with it (the pending op may still write into it). NCCL: abort the
        # communicator, which also frees a collective kernel stuck on the device.
        self.broken = f"update v{plan.version} failed mid-stream, which dropped the broadcast group"
        group, buf, self.group, self._bufs = self.group, self._bufs, None, []
        if group is None:
            return
        if str(self.info["device"]).startswith("cuda"):
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort: the group is being dropped anyway
                pass

        if work is None:  # nothing pending: released here
            return

        def release(group=group, work=work, buf=buf) -> None:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - expected: the collective failed
                pass

        threading.Thread(target=release, name="weight-sync-release", daemon=True).start()

    def _slot(self, path: str, nbytes: int) -> torch.Tensor:
        # Mapped once per slot file; the sender allocates new files only if a bucket outgrows them.
        if path not in self._maps:
            self._maps[path] = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        return self._maps[path]

    def close(self) -> None:
        """Drop the slot mappings and the receive buffers."""
        self._maps.clear()
        self._bufs = []
