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

Not covered: ``multiprocessing``'s semaphores (``/dev/shm/sem.mp-<random>``) carry no owner in
their name; Python's resource tracker unlinks them when their process dies, unless it was killed
with it.
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
