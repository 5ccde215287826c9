"""A ``python`` tool: run model-written code in a fresh, limited subprocess and return its output.

Each call writes the code to ``main.py`` in a new empty temporary directory and runs
``sys.executable -I -X utf8 -c <bootstrap> ...`` there, in a new session (process group), with
stdin from /dev/null and a minimal environment (``HOME`` and ``TMPDIR`` are the work directory).
Before the user's code runs, the bootstrap inside the child (``async_rl.tools.sandbox_child``;
all through ctypes: Python 3.11 has no ``os.unshare``; ``sandbox_isolation()`` reports what a
probe child managed):

1. creates new namespaces with ``unshare``: as root ``CLONE_NEWNS | CLONE_NEWNET`` (owned by the
   initial user namespace, so once the child has dropped root in step 3 they are out of its
   reach); as any other uid ``CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET``, mapping its own
   uid/gid into the user namespace. The network namespace has no interfaces but a down
   loopback, so nothing, not even 127.0.0.1, is reachable. Where that is refused it tries
   smaller sets, down to none;
2. gives itself a root of its own (with the mount namespace): a fresh tmpfs holding read-only,
   nosuid, nodev bind mounts of /usr, /bin, /sbin, /lib* (symlinks copied), the Python
   installation, the venv and every other import root on ``sys.path`` (e.g. one a ``.pth``
   file adds), bind mounts of /dev/null, /dev/zero, /dev/random and /dev/urandom, and the work
   directory, writable, at its own path, plus a private 64 MiB tmpfs at /dev/shm (for
   ``multiprocessing``). Then ``pivot_root`` into it and detach the old root:
   /etc, /proc, /home, /root's files, the rest of /tmp and the trainer's checkout are not
   there at all (``FileNotFoundError``), and writes outside the work directory fail with
   ``EROFS``. Mounts are made private first, so nothing propagates back to the host;
3. as root: switches to a uid and gid of its own, ``2_000_000_000 + its pid`` (no groups),
   after checking that the Python directories and the work directory (chowned to it) stay
   reachable for it. It then has no capabilities, cannot read root's 0700 files even where
   step 2 failed, and ``RLIMIT_NPROC`` binds it (it never binds root). If the switch fails
   (e.g. a container whose user namespace does not map that uid) it stays root but enters a
   new user namespace, which strips every capability in the initial one;
4. sets ``RLIMIT_NPROC`` = ``max_processes`` where that counts only this call's processes and
   threads (after step 3's uid switch, or inside its own user namespace on Linux >= 5.14,
   where the count is per user namespace), ``RLIMIT_CPU`` (soft = ``cpu_s``, hard one second
   later), ``RLIMIT_AS`` (``memory_mb`` MiB of address space), ``RLIMIT_FSIZE``
   (``max_file_mb`` MiB per written file, stdout and stderr included) and ``RLIMIT_CORE`` = 0.
   Without capabilities in the initial user namespace the child cannot raise them again;
5. replaces ``socket.socket`` (new sockets only; wrapping existing descriptors, as
   ``socket.socketpair`` and asyncio do, still works), ``socket.create_connection``,
   ``create_server``, ``getaddrinfo`` and the ``gethostby*`` functions with ones that raise
   ``PermissionError``. This is defence in depth only: ``import _socket`` gets around it, the
   namespace of step 1 does not.

The parent waits at most ``wall_s`` seconds, then kills the whole process group (also done after
a normal exit, for stray children) and, after a uid switch, every process left with that uid
(children that called ``setsid``). stdout and stderr go to files outside the work directory, so
a flood of output costs disk (bounded by ``RLIMIT_FSIZE``), not parent memory; the returned text
is stdout, then stderr, cut to ``max_output_chars`` (head and tail kept), then one
``Error: ...`` line for a non-zero exit, a signal, the CPU/memory/wall-clock limits.

Not isolated: what stays visible read-only (the system directories and the installed Python
packages, e.g. a ``.pth``-added site-packages holding the trainer's dependencies), other
processes' CPU and memory (limits are per process; up to ``max_processes`` of them, each with
its own ``cpu_s``), and the kernel itself (the code may still create user namespaces of its
own, inside the private root). Under a non-root trainer the sandbox runs with the trainer's uid:
children that call ``setsid`` escape the final kill (not their limits), and on Linux < 5.14
``RLIMIT_NPROC`` counts every process of that uid. Code that reads /proc or /etc fails.

Measured on the development machine (Linux 6.18, Python 3.11.7 from pyenv under /root, no
seccomp filter): as root ``sandbox_isolation()`` == ``SandboxIsolation(network="net",
filesystem=True, own_uid=True, processes=True)``; as an unprivileged uid (65534, via
``setpriv``, Debian's /usr/bin/python3) ``("user+net", True, False, True)``. The probe takes
~75-130 ms on 2 busy cores (load 5-9). A child then sees ``/`` = bin, dev, lib, lib64, root
(only .pyenv), sbin, tmp (only its own directory), usr, work (only the two venvs), lists only
``lo`` in ``socket.if_nameindex()``; ``connect(("127.0.0.1", port))`` to a port the parent
listens on fails with ``ENETUNREACH`` even through ``_socket``; raising ``RLIMIT_CPU`` or
``RLIMIT_NPROC`` fails ("not allowed to raise maximum limit"); with ``max_processes=8`` the 8th
``os.fork`` (or thread) fails with ``EAGAIN``; a ``chroot`` escape from a user namespace it
creates itself ends in the same private root. A call costs about 130-180 ms of wall time there
(median 184 ms against 148 ms without steps 2 and 3; the /proc scan for leftovers is ~3-12 ms
of it). In a container whose seccomp profile forbids ``unshare`` the network is "none" and the
filesystem not private (the uid switch still happens where the Python files are readable by that
uid; otherwise steps 4 and 5 only).
"""

from __future__ import annotations

import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from async_rl.tools.definition import Tool
from async_rl.tools.sandbox_child import UID_BASE, bootstrap_code, isolation_probe_code

__all__ = [
    "SandboxIsolation",
    "make_python_tool",
    "network_isolation",
    "python_tool",
    "run_python",
    "sandbox_isolation",
]

_CODE_FILE = "main.py"
_PROBE_PROCESSES = 3


@dataclass(frozen=True)
class SandboxIsolation:
    """What the ``python`` tool's children achieve on this machine; see ``sandbox_isolation``."""

    network: str
    """"user+net" (network namespace inside a new user namespace), "net" (a network namespace
    created by root before it drops to the sandbox uid, or where user namespaces are disabled)
    or "none" (only the socket prelude; a determined program can reach the network)."""
    filesystem: bool
    """The code sees a private root: read-only system and Python directories, four /dev nodes,
    a private /dev/shm and its writable work directory, nothing else of the host."""
    own_uid: bool
    """Each call runs as a uid of its own (only when the trainer is root), which cannot read
    root's files and whose leftover processes are killed after the call."""
    processes: bool
    """``max_processes`` is enforced (RLIMIT_NPROC counts only this call's processes)."""


@functools.lru_cache(maxsize=1)
def sandbox_isolation() -> SandboxIsolation:
    """Which isolation the ``python`` tool's children achieve on this machine.

    Runs one probe child (cached for the process; ~75-130 ms on 2 busy cores): it isolates
    itself as every call does, then checks each claim: it writes to its work directory, looks
    for a file next to it (hidden only by a private root), connects to a port this process
    listens on, and forks until a process cap of 3 stops it.

    Returns:
        The ``SandboxIsolation`` achieved, each part False / "none" where the kernel or a
        container's seccomp profile forbids it (the socket prelude and the other resource
        limits still apply); all False / "none" if the probe child itself fails.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with tempfile.TemporaryDirectory(prefix="async_rl_probe_") as root:
            workdir, new_root = _prepare_dirs(root)
            marker = os.path.join(root, "marker")
            open(marker, "w").close()
            args = [sys.executable, "-I", "-c", isolation_probe_code(), "net", new_root, marker,
                    str(port), str(_PROBE_PROCESSES)]
            try:
                proc = subprocess.Popen(
                    args, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL, text=True, env=_child_env(workdir),
                    start_new_session=True,
                )
            except OSError:
                return SandboxIsolation("none", False, False, False)
            try:
                stdout, _ = proc.communicate(timeout=30)
                result = json.loads(stdout) if proc.returncode == 0 else {}
            except (subprocess.SubprocessError, ValueError):
                result = {}
            finally:
                _kill_group(proc.pid)
                _kill_uid(UID_BASE + proc.pid)
                proc.wait()
        if not isinstance(result, dict) or result.get("network") not in ("user+net", "net", "none"):
            return SandboxIsolation("none", False, False, False)
        return SandboxIsolation(
            result["network"], result["filesystem"] is True, result["own_uid"] is True,
            result["processes"] is True,
        )
    finally:
        listener.close()


def network_isolation() -> str:
    """How the ``python`` tool's children are cut off from the network on this machine.

    Returns:
        ``sandbox_isolation().network``: "user+net" (new user and network namespaces, the case
        of an unprivileged trainer), "net" (a network namespace only: a root trainer creates it
        before dropping to the sandbox uid, or user namespaces are disabled), or "none" (only
        the socket prelude; a determined program can reach the network).
    """
    return sandbox_isolation().network


def _prepare_dirs(root: str) -> tuple[str, str]:
    # The work directory and the (empty) mount point of the child's private root, side by side
    # in a 0700 directory of the parent's.
    workdir, new_root = os.path.join(root, "work"), os.path.join(root, "fs")
    os.mkdir(workdir)
    os.mkdir(new_root)
    return workdir, new_root


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        # Threads count against max_processes: BLAS and OpenMP pools must not size to the cores.
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    # Keep the tail too: a traceback, the most useful part of failing output, comes last.
    head = limit * 3 // 4
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n... [{omitted} characters omitted] ...\n{text[len(text) - tail:]}"


def _read(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")


def run_python(
    code: str,
    *,
    cpu_s: float = 5,
    memory_mb: int = 512,
    wall_s: float = 10,
    max_output_chars: int = 4000,
    max_file_mb: int = 16,
    max_processes: int = 16,
) -> str:
    """Run ``code`` in a sandboxed child process (see the module docstring) and return its output.

    Args:
        code: Python source, run as ``__main__`` from ``main.py`` in an empty work directory.
        cpu_s: CPU-time limit in seconds (rounded up to whole seconds; RLIMIT_CPU).
        memory_mb: address-space limit in MiB (RLIMIT_AS); a bigger allocation raises
            MemoryError in the child.
        wall_s: wall-clock limit in seconds; then the process group is killed.
        max_output_chars: most characters of output returned (stdout then stderr; the first 3/4
            and last 1/4 of the budget are kept).
        max_file_mb: most MiB the child may write to any one file (RLIMIT_FSIZE), stdout and
            stderr included.
        max_processes: most processes and threads the code may have at once, its interpreter
            included (RLIMIT_NPROC); a fork or thread beyond it fails with EAGAIN. Enforced only
            where ``sandbox_isolation().processes``.

    Returns:
        The output (``"(no output)"`` if there was none and the exit was clean), followed by an
        ``"Error: ..."`` line for a non-zero exit code, a MemoryError, a signal, the CPU-time
        limit or the wall-clock limit.

    Raises:
        ValueError: ``code`` is not a string. Sandbox failures are reported in the text instead.
    """
    if not isinstance(code, str):
        raise ValueError(f"code must be a string, got {type(code).__name__}")
    cpu_limit = max(1, math.ceil(cpu_s))
    mode = network_isolation()
    isolation = sandbox_isolation()
    with tempfile.TemporaryDirectory(prefix="async_rl_python_", ignore_cleanup_errors=True) as root:
        workdir, new_root = _prepare_dirs(root)
        with open(os.path.join(workdir, _CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        args = [
            sys.executable, "-I", "-X", "utf8", "-c", bootstrap_code(), mode,
            "fs" if isolation.filesystem else "-", "uid" if isolation.own_uid else "-",
            str(cpu_limit), str(memory_mb * 2**20), str(max_file_mb * 2**20),
            str(max_processes), new_root, _CODE_FILE,
        ]
        timed_out = False
        with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
            proc = subprocess.Popen(
                args, cwd=workdir, stdin=subprocess.DEVNULL, stdout=out_f, stderr=err_f,
                env=_child_env(workdir), start_new_session=True,
            )
            try:
                returncode = proc.wait(timeout=wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                returncode = proc.wait()
            finally:
                _kill_group(proc.pid)
                if isolation.own_uid:
                    _kill_uid(UID_BASE + proc.pid)
        stdout, stderr = _read(out_path), _read(err_path)
    text = stdout
    if stderr:
        text += ("\n" if text and not text.endswith("\n") else "") + stderr
    text = _truncate(text, max_output_chars)
    status = _status(returncode, timed_out, stderr, cpu_limit, memory_mb, wall_s)
    if status is None:
        return text if text.strip() else "(no output)"
    return (text.rstrip("\n") + "\n" if text.strip() else "") + status


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_uid(uid: int) -> None:
    # Catches what the process-group kill misses (children that called setsid), until no live
    # process of the sandbox's uid is left. Zombies are skipped: they are dead, init reaps them.
    if uid < UID_BASE or uid == os.getuid():
        return
    for _ in range(100):
        pids = _live_pids_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)  # let the kills land before looking again


def _live_pids_of_uid(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                fields = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        except OSError:
            continue
        uids = fields.get(b"Uid", b"").split()
        if uids and int(uids[0]) == uid and not fields.get(b"State", b"").strip().startswith(b"Z"):
            pids.append(int(name))
    return pids


def _status(
    returncode: int, timed_out: bool, stderr: str, cpu_s: int, memory_mb: int, wall_s: float
) -> str | None:
    if timed_out:
        return f"Error: wall-clock time limit of {wall_s:g} s exceeded; the process was killed."
    if returncode == -signal.SIGXCPU or returncode == -signal.SIGKILL:
        # SIGKILL that we did not send comes from the CPU hard limit (soft + 1 s) when the
        # code catches SIGXCPU; the OOM killer is the unlikely alternative.
        return f"Error: CPU time limit of {cpu_s} s exceeded; the process was killed."
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"Error: the process was killed by {name}."
    if returncode > 0:
        if "MemoryError" in stderr[-2000:]:
            return (
                f"Error: memory limit of {memory_mb} MiB exceeded (MemoryError); exit code "
                f"{returncode}."
            )
        if "File too large" in stderr[-2000:]:
            return f"Error: file/output size limit exceeded; exit code {returncode}."
        return f"Error: the process exited with code {returncode}."
    return None


def make_python_tool(
    cpu_s: float = 5,
    memory_mb: int = 512,
    wall_s: float = 10,
    max_output_chars: int = 4000,
    *,
    name: str = "python",
    max_file_mb: int = 16,
    max_processes: int = 16,
) -> Tool:
    """A ``Tool`` that runs Python code with the given limits (see ``run_python``).

    The tool's own executor timeout is ``wall_s + 5`` seconds, so the sandbox's wall-clock kill
    (which also reaps the process group and gives a clearer message) normally fires first.

    Args:
        cpu_s: CPU-time limit in seconds; > 0.
        memory_mb: address-space limit in MiB; >= 64 (the interpreter itself needs ~20-40 MiB).
        wall_s: wall-clock limit in seconds; > 0.
        max_output_chars: most characters returned; >= 100.
        name: the tool name the model sees.
        max_file_mb: per-file write limit in MiB; >= 1.
        max_processes: most processes and threads at once, the interpreter included; >= 1.

    Returns:
        The tool, with one required string parameter ``code``.

    Raises:
        ValueError: a limit out of range.
    """
    if not cpu_s > 0 or not wall_s > 0:
        raise ValueError(f"cpu_s and wall_s must be > 0, got {cpu_s!r} and {wall_s!r}")
    if memory_mb < 64:
        raise ValueError(f"memory_mb must be >= 64 (the interpreter needs ~30 MiB), got {memory_mb}")
    if max_output_chars < 100 or max_file_mb < 1:
        raise ValueError(
            f"max_output_chars must be >= 100 and max_file_mb >= 1, got {max_output_chars} "
            f"and {max_file_mb}"
        )
    if max_processes < 1:
        raise ValueError(f"max_processes must be >= 1 (the interpreter), got {max_processes}")

    def python(code: str) -> str:
        return run_python(
            code, cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s,
            max_output_chars=max_output_chars, max_file_mb=max_file_mb,
            max_processes=max_processes,
        )

    return Tool(
        name=name,
        description=(
            "Run a Python 3 program and return what it prints (stdout, then stderr). Each call is "
            "a fresh process: nothing is kept between calls, so print every value you need. No "
            f"network access, no input. Limits: {math.ceil(cpu_s)} s CPU, {memory_mb} MiB "
            f"memory, {wall_s:g} s wall clock, {max_output_chars} characters of output."
        ),
        parameters={
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The complete Python program to run."}
            },
            "required": ["code"],
        },
        fn=python,
        timeout_s=wall_s + 5.0,
    )


python_tool = make_python_tool()
