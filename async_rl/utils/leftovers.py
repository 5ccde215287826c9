"""What a killed process of ours leaves on the host, and the sweep that removes it at the next start.

A ``WeightSender`` with shm receivers makes ``weight_sync.num_slots`` files (two by default) named
``async-rl-<pid>-<8 hex>-<bytes>-slot<k>`` in ``/dev/shm`` (or ``$TMPDIR``/``/tmp`` without it,
``slot_dirs``) and unlinks them once every receiver has mapped them, or at exit. A SIGKILL in
between (no handler, no ``atexit``) leaves them: up to ``weight_sync.bucket_size_mb`` each of
host memory, until the next reboot. Their names carry the owner's pid, so ``sweep_weight_slots``
(run by ``async_rl.trainer`` as a run starts) removes those whose process is gone and keeps a live
one's. The vLLM engine's socket directories follow the same rule
(``async_rl.generators.vllm.process.sweep_socket_dirs``, at each engine start).

A pid may live in another pid namespace (a container sharing ``/dev/shm``) and look dead from
here: only files older than ``min_age_s`` (15 min, longer than any engine start, the window in
which a slot file exists) are removed, as the vLLM sweep does.

W&B's temp directories (``tmp<random>wandb-media`` and ``tmp<random>wandb-artifacts``, made in the
temp dir when ``wandb`` is imported and removed at interpreter exit) carry no owner either: a run's
process renames its own to ``async-rl-<pid>-<name>`` once it imported wandb (``own_wandb_temp_dirs``),
so that a SIGKILLed run's are swept like the slot files (``sweep_wandb_temp_dirs``).

vLLM's shared-memory queues (``/dev/shm/psm_<8 hex>``, two per engine: its ``MessageQueue`` ring
buffers, ``(chunk + 1 + readers) * 10`` bytes) are unlinked by the engine's own processes as they
stop; an engine process SIGKILLed (a killed actor's process group, vLLM's own kill of a hung
engine) leaves them, 160 and 240 MB each. Their names carry no owner: ``sweep_vllm_queues`` removes
only this user's files of that size, old enough, that no process visible here maps or holds open
(``held_paths``; a process this user cannot read is none of a run's, ``cannot_reach``).

A Ray actor of ours ends by ``ray.kill`` once its work is done (the follower learner ranks, the
generator actors): a forced exit that runs no exit handler, after Ray killed the actor's children.
What a library of the actor's removes only at exit would be left: W&B's temp directories
(megatron-core imports wandb in every learner rank), ``multiprocessing``'s ``pymp-*`` directory
(the listener of its resource sharer, through which torch hands a CPU tensor's file descriptor to
another process: SGLang's weight loads), that of a ``multiprocessing`` manager (a child of the
actor, which its exit handler stops while it still runs). So such an actor runs its exit handlers
itself as its work ends, before it is killed (``run_exit_handlers``). One killed before (a failed
run, a hung engine) still leaves them: a learner rank's W&B directories carry its pid
(``own_wandb_temp_dirs``), the rest is among what is not covered below.

Not covered at a run's start: ``multiprocessing``'s semaphores (``/dev/shm/sem.mp-<random>``, 32
bytes) and listener directories (``pymp-<random>``) carry no owner in their name and no size that
would tell ours; Python's resource tracker unlinks them when their process dies, unless it was
killed with it. The test suite removes the semaphores its own killed processes made
(``tests/conftest.py``, ``sweep_unheld``). Nor vLLM's torch store file (``vllm_dist_<32 hex>`` in
the temp dir): a live engine keeps it for its whole life without holding it open, so nothing here
tells a killed engine's from a live one's.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import time

logger = logging.getLogger(__name__)

SLOT_NAME = re.compile(r"async-rl-(?P<pid>\d+)-[0-9a-f]{8}-\d+-slot\d+")
"""A weight-sync slot file's name (``WeightSender``: ``async-rl-<pid>-<uuid hex[:8]>-<bytes>-slot<k>``)."""

MIN_AGE_S = 900.0
"""Seconds a dead owner's file must have existed before the sweep removes it (module docstring)."""


def slot_dirs() -> list[str]:
    """Where ``WeightSender`` puts slot files: ``/dev/shm`` where it exists, else ``$TMPDIR`` or
    ``/tmp`` (``weight_sync/wire.py``, ``_slot_path``)."""
    return ["/dev/shm"] if os.path.isdir("/dev/shm") else [os.environ.get("TMPDIR", tempfile.gettempdir())]


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (``kill(pid, 0)``); another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(directory: str, pattern: re.Pattern[str], min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove the files of ``directory`` whose whole name matches ``pattern`` (with a ``pid``
    group), whose process is gone, and that are at least ``min_age_s`` seconds old (mtime).

    Returns the paths removed, sorted. An unreadable directory or a file that vanished meanwhile
    (another sweep) is skipped: the sweep never fails a run.
    """
    removed = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_file(follow_symlinks=False) or now - entry.stat().st_mtime < min_age_s:
                continue
            if pid_alive(int(match["pid"])):
                continue
            os.unlink(entry.path)
        except OSError:
            continue
        removed.append(entry.path)
    return sorted(removed)


def sweep_weight_slots(min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove the weight-sync slot files that killed processes of ours left (``sweep`` over
    ``slot_dirs``), saying so in one line when there were any; returns the paths removed."""
    removed = [p for d in slot_dirs() for p in sweep(d, SLOT_NAME, min_age_s)]
    if removed:
        logger.warning("removed %d weight-sync slot file(s) left by killed async-rl processes: %s",
                       len(removed), ", ".join(removed))
    return removed


WANDB_TEMP = re.compile(r"async-rl-(?P<pid>\d+)-tmp\w{8}wandb-(media|artifacts)")
"""A run's renamed W&B temp directory (``own_wandb_temp_dirs``)."""


def own_wandb_temp_dirs() -> list[str]:
    """Rename this process's W&B temp directories (``wandb.sdk.data_types._private.MEDIA_TMP``,
    ``wandb.sdk.artifacts.artifact.Artifact._TMP_DIR``: ``tempfile.TemporaryDirectory`` objects
    that wandb makes at import) to carry this process's pid, so that the next start's sweep can tell
    a killed run's from a live one's. wandb reads them through the objects' ``name``, set here; their
    exit cleanup follows the new name. Call after ``import wandb``; does nothing to a directory
    already renamed or to a wandb without them. Returns the new paths."""
    import sys
    import weakref

    holders = []
    private = sys.modules.get("wandb.sdk.data_types._private")
    if private is not None:
        holders.append(getattr(private, "MEDIA_TMP", None))
    artifact = sys.modules.get("wandb.sdk.artifacts.artifact")
    if artifact is not None:
        holders.append(getattr(getattr(artifact, "Artifact", None), "_TMP_DIR", None))
    renamed = []
    for tmp in holders:
        if not isinstance(tmp, tempfile.TemporaryDirectory):
            continue
        old = tmp.name
        base = os.path.basename(old)
        if base.startswith("async-rl-") or not os.path.isdir(old):
            continue
        new = os.path.join(os.path.dirname(old), f"async-rl-{os.getpid()}-{base}")
        try:
            os.rename(old, new)
        except OSError:
            continue
        tmp.name = new
        finalizer = getattr(tmp, "_finalizer", None)
        if finalizer is not None and finalizer.detach() is not None:
            tmp._finalizer = weakref.finalize(
                tmp, type(tmp)._cleanup, new, warn_message=f"Implicitly cleaning up {tmp!r}",
                ignore_errors=getattr(tmp, "_ignore_cleanup_errors", False))
        renamed.append(new)
    return renamed


def sweep_wandb_temp_dirs(min_age_s: float = MIN_AGE_S, directory: str | None = None) -> list[str]:
    """Remove the renamed W&B temp directories (``own_wandb_temp_dirs``) of processes that are
    gone and at least ``min_age_s`` old, from ``directory`` (default: the temp dir); returns the
    paths removed."""
    import shutil

    removed = []
    now = time.time()
    directory = directory or tempfile.gettempdir()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    for entry in entries:
        match = WANDB_TEMP.fullmatch(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or now - entry.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        if pid_alive(int(match["pid"])):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.exists(entry.path):
            removed.append(entry.path)
    return sorted(removed)


def run_exit_handlers() -> bool:
    """Run this process's exit handlers now (``atexit``: W&B's temp directories, ``multiprocessing``'s
    finalizers, logging's flush), when it is a Ray actor whose work is done and which its launcher
    kills next (``ray.kill``: no exit handler runs; see the module docstring). Ray's own handler
    (``ray.shutdown``) is left registered and not run: it would disconnect the actor from Ray while
    its call still has to return.

    The handlers run once: ``atexit`` forgets them. Call it as the actor's last work, from the call
    whose return the launcher waits for before killing it.

    Returns:
        Whether the handlers ran: ``False`` (nothing done) outside a Ray actor, e.g. in a trainer
        process, which still has its run's exit to make.
    """
    import atexit
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return False
    atexit.unregister(ray.shutdown)
    try:
        atexit._run_exitfuncs()
    finally:
        atexit.register(ray.shutdown)
    return True


def _started_at(pid: str) -> float:
    """When process ``pid`` started (epoch seconds), or ``inf`` when unknown."""
    try:
        ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return float("inf")


def held_paths() -> tuple[set, list[tuple[int, int, float]]] | None:
    """Every file path that a process visible here maps (``/proc/<pid>/maps``), holds open
    (``/proc/<pid>/fd``), has as its working directory, or listens on as a Unix socket
    (``/proc/net/unix``), and as ``("inode", n)`` the inodes of what they map or hold open; and the processes that could not be read (``(pid, uid, started_at)``:
    another user's, a protected init), which may hold anything. ``None`` when ``/proc`` cannot be
    read at all."""
    held: set[str] = set()
    unreadable: list[tuple[int, int, float]] = []
    try:
        pids = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return None
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) == 6:
                        held.add(parts[5].strip().removesuffix(" (deleted)"))
                        held.add(("inode", int(parts[4])))  # a file mapped under another name: glibc's
                        # sem_open maps a temporary file, then links it to the semaphore's name
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                    held.add(("inode", os.stat(f"/proc/{pid}/fd/{fd}").st_ino))
                except FileNotFoundError:
                    pass  # closed meanwhile
            held.add(os.readlink(f"/proc/{pid}/cwd"))
        except (FileNotFoundError, ProcessLookupError):
            continue  # gone meanwhile
        except OSError:
            try:
                uid = os.stat(f"/proc/{pid}").st_uid
            except OSError:
                continue
            unreadable.append((int(pid), uid, _started_at(pid)))
    try:
        with open("/proc/net/unix") as f:
            next(f, None)
            for line in f:
                parts = line.split()
                if len(parts) >= 8:
                    held.add(parts[7].lstrip("@"))
    except OSError:
        return None
    return held, unreadable


def cannot_reach(proc: tuple[int, int, float], st: os.stat_result) -> bool:
    """Whether an unreadable process ``(pid, uid, started_at)`` cannot hold a file of ours of stat
    ``st``: the file is this user's, and a process we cannot read is none of ours (a run's
    processes are this user's Python processes, which this user can read; one we cannot read is
    another user's or a protected one, such as a sandbox's init), so it was never told the file's
    random name."""
    return st.st_uid == os.getuid()


def _holds_under(held: set, path: str, st: os.stat_result) -> bool:
    """Whether ``held`` (``held_paths``) has ``path`` (by name or, a file, by inode) or a path under it."""
    prefix = path.rstrip("/") + "/"
    if path in held or ("inode", st.st_ino) in held:
        return True
    return any(isinstance(h, str) and h.startswith(prefix) for h in held)


def sweep_unheld(directory: str, pattern: re.Pattern[str], min_age_s: float = MIN_AGE_S,
                 only: set[str] | None = None, size_ok=None, unreachable=cannot_reach) -> list[str]:
    """Remove the entries of ``directory`` whose whole name matches ``pattern``, that no process
    visible here holds (``held_paths``; a directory: nothing under it), at least ``min_age_s`` old,
    among ``only`` names when given, and whose size passes ``size_ok`` when given (files). An entry
    is kept while any process that could not be read might hold it (``unreachable(proc, stat)``
    false). Returns the paths removed, sorted."""
    import shutil

    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return []
    candidates = []
    for entry in entries:
        if pattern.fullmatch(entry.name) is None or (only is not None and entry.name not in only):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if now - st.st_mtime < min_age_s:
            continue
        is_dir = entry.is_dir(follow_symlinks=False)
        if not is_dir and size_ok is not None and not size_ok(st.st_size):
            continue
        candidates.append((entry.path, is_dir, st))
    if not candidates:
        return []
    found = held_paths()  # read once there is something to remove: it reads every process
    if found is None:
        return []
    held, unreadable = found
    removed = []
    for path, is_dir, st in candidates:
        if _holds_under(held, path, st) or not all(unreachable(proc, st) for proc in unreadable):
            continue
        try:
            if is_dir:
                shutil.rmtree(path)
            else:
                os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return sorted(removed)


VLLM_QUEUE = re.compile(r"psm_[0-9a-f]{8}")
"""A ``multiprocessing.shared_memory`` name as vLLM's ``MessageQueue`` makes it."""


def is_vllm_queue_size(size: int, max_chunks: int = 10, max_readers: int = 64) -> bool:
    """Whether ``size`` bytes is a vLLM ``MessageQueue`` buffer: ``max_chunks`` chunks of a whole
    number of MiB, each with ``1 + readers`` bytes of metadata (``shm_broadcast.ShmRingBuffer``)."""
    if size <= 0 or size % max_chunks:
        return False
    per_chunk = size // max_chunks
    return any((per_chunk - 1 - n) % (1 << 20) == 0 and per_chunk - 1 - n > 0 for n in range(1, max_readers + 1))


def sweep_vllm_queues(min_age_s: float = MIN_AGE_S) -> list[str]:
    """Remove from ``/dev/shm`` the vLLM queue buffers of engines killed before they could unlink
    them (module docstring), saying so in one line when there were any; returns the paths removed."""
    if not os.path.isdir("/dev/shm"):
        return []
    removed = sweep_unheld("/dev/shm", VLLM_QUEUE, min_age_s, size_ok=is_vllm_queue_size)
    if removed:
        logger.warning("removed %d vLLM shared-memory queue(s) left by killed engine processes: %s",
                       len(removed), ", ".join(removed))
    return removed


def sweep_at_start(min_age_s: float = MIN_AGE_S) -> list[str]:
    """What a run's start removes of what killed runs left: weight-sync slot files, renamed W&B
    temp directories, vLLM queue buffers. Returns the paths removed."""
    removed = sweep_weight_slots(min_age_s) + sweep_wandb_temp_dirs(min_age_s)
    removed += sweep_vllm_queues(min_age_s)
    return removed
