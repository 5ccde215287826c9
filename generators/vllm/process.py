"""Where a vLLM engine's processes run: the directory their IPC sockets go to (and the sweep of
those a killed process left), and the environment they start with. Imports nothing of vLLM."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

SHUTDOWN_TIMEOUT_S = 30
"""How long ``close`` lets the engine's processes stop cleanly before vLLM kills them. On a loaded
2-core machine the worker takes up to about 8 s to leave and the engine core a few seconds more;
vLLM's 5 s defaults (``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` and ``AsyncLLM.shutdown``'s) kill
them, with two warnings, before they release their own resources. A hung engine is still killed."""

FUTURE_WARNING_FILTER = "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning"
"""A ``PYTHONWARNINGS`` entry for the engine's processes: vLLM's worker scans every module's
attributes (triton_utils/dispatcher.py), touching torch's deprecated ``reduce_op`` alias, which
warns twice per engine; nothing here uses the alias."""


SOCKET_PATH_MAX = 107
"""Bytes of a Unix socket's path (``sizeof(sockaddr_un.sun_path)`` less the NUL on Linux)."""


def socket_dir() -> str:
    """A new directory for one engine's IPC socket files: every process of the engine names its
    sockets ``<VLLM_RPC_BASE_PATH>/<uuid4>`` as it starts (the spawned ones inherit the variable),
    so a directory of its own collects them all (vLLM leaves all seven). Made under
    ``VLLM_RPC_BASE_PATH`` or the temp dir, or under ``/tmp`` where that would make a socket path
    longer than :data:`SOCKET_PATH_MAX` (a deep ``TMPDIR``), which ZeroMQ refuses to bind. Its name
    carries this process's pid: directories of processes killed while their engine started
    (the only window in which one exists) are removed here (``sweep_socket_dirs``)."""
    base = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()
    prefix = f"{SOCKET_DIR_PREFIX}{os.getpid()}-"
    longest = len(prefix) + 8 + 1 + 36  # mkdtemp's 8 random characters, "/", a uuid4
    if len(os.path.abspath(base)) + 1 + longest > SOCKET_PATH_MAX:
        base = "/tmp"
    sweep_socket_dirs(base)
    return tempfile.mkdtemp(prefix=prefix, dir=base)


SOCKET_DIR_PREFIX = "async-rl-vllm-"


def sweep_socket_dirs(base: str, min_age_s: float = 900.0) -> list[str]:
    """Remove ``base``'s engine socket directories whose process is gone and that are older than
    ``min_age_s`` seconds (longer than any engine start, so a live engine in another pid namespace
    sharing ``base`` keeps its own); returns the paths removed."""
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            pid = entry.name[len(SOCKET_DIR_PREFIX):].split("-", 1)[0]
            if not (entry.name.startswith(SOCKET_DIR_PREFIX) and pid.isdigit() and entry.is_dir(follow_symlinks=False)):
                continue
            try:
                if now - entry.stat(follow_symlinks=False).st_mtime < min_age_s:
                    continue
                os.kill(int(pid), 0)
                continue  # its process still runs
            except ProcessLookupError:
                pass
            except OSError:  # another user's process, or the entry vanished
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


@contextlib.contextmanager
def engine_environment(ipc_dir: str, error_file: str = ""):
    """The environment an engine's processes start with (they are spawned and inherit it; this
    process gets its own back afterwards, so a later engine is set up afresh): its socket
    directory (``VLLM_RPC_BASE_PATH``: only the start makes socket names), loopback for its gloo
    groups unless an interface is chosen (``GLOO_SOCKET_IFNAME``), room for a clean shutdown
    (``SHUTDOWN_TIMEOUT_S``) and ``FUTURE_WARNING_FILTER``. Values the user set are kept
    (``PYTHONWARNINGS`` is extended). ``error_file``: where the engine's log filter records a
    fatal error's root cause (``model_support.ERROR_FILE_ENV``; empty = nowhere)."""
    from async_rl.runtime.cluster import LOOPBACK, interface_of
    from async_rl.generators.model_support import ERROR_FILE_ENV

    changes = {
        ERROR_FILE_ENV: error_file,
        "VLLM_RPC_BASE_PATH": ipc_dir,
        # vLLM's own gloo groups listen where the host name resolves (the LAN address on many
        # machines) unless told; a generator actor has set its node's interface already.
        "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(LOOPBACK) or "lo",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": os.environ.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS",
                                                               str(SHUTDOWN_TIMEOUT_S // 2)),
        "PYTHONWARNINGS": ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), FUTURE_WARNING_FILTER])),
    }
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
