"""A ``python`` tool: run model-written code in a fresh, limited subprocess and return its output.

Each call writes the code to ``main.py`` in a new empty temporary directory and runs
``sys.executable -I -X utf8 -c <bootstrap> ...`` there, in a new session (process group), with
stdin from /dev/null and a minimal environment (``HOME`` and ``TMPDIR`` are the work directory).
Before the user's code runs, the bootstrap inside the child:

1. moves itself into a new network namespace (no interfaces but a down loopback, so nothing,
   not even 127.0.0.1, is reachable), by ``unshare(CLONE_NEWUSER | CLONE_NEWNET)`` through
   ctypes (Python 3.11 has no ``os.unshare``), mapping its own uid/gid into the user namespace;
   the user namespace also strips every capability in the parent namespace, so even a child of
   root cannot raise its hard resource limits. If that is not permitted it tries
   ``unshare(CLONE_NEWNET)`` alone, then falls back silently to step 3 only.
   ``network_isolation()`` reports which one a probe child managed;
2. sets ``RLIMIT_CPU`` (soft = ``cpu_s``, hard one second later), ``RLIMIT_AS`` (``memory_mb``
   MiB of address space), ``RLIMIT_FSIZE`` (``max_file_mb`` MiB per written file, stdout and
   stderr included) and ``RLIMIT_CORE`` = 0;
3. replaces ``socket.socket`` (new sockets only; wrapping existing descriptors, as
   ``socket.socketpair`` and asyncio do, still works), ``socket.create_connection``,
   ``create_server``, ``getaddrinfo`` and the ``gethostby*`` functions with ones that raise
   ``PermissionError``. This is defence in depth only: ``import _socket`` gets around it, the
   namespace of step 1 does not.

The parent waits at most ``wall_s`` seconds, then kills the whole process group (also done after
a normal exit, for stray children). stdout and stderr go to files outside the work directory, so
a flood of output costs disk (bounded by ``RLIMIT_FSIZE``), not parent memory; the returned text
is stdout, then stderr, cut to ``max_output_chars`` (head and tail kept), then one
``Error: ...`` line for a non-zero exit, a signal, the CPU/memory/wall-clock limits.

Not isolated: the filesystem (the code runs with the caller's uid and can read what it can read),
and the process count (``RLIMIT_NPROC`` counts every process of the uid on the machine). Code that
calls ``setsid`` escapes the final process-group kill, but not its own limits.

Measured on the development machine (Linux 6.18, Python 3.11.7, no seccomp filter,
``/usr/bin/unshare --net`` also works there): ``network_isolation()`` == "user+net" both as root
and as an unprivileged uid (65534, via ``setpriv``); the probe takes ~30 ms. A child then lists
only ``lo`` in ``socket.if_nameindex()``, and ``connect(("127.0.0.1", port))`` to a port the
parent listens on fails with ``ENETUNREACH`` even through the raw ``_socket`` module; raising
``RLIMIT_CPU`` inside fails ("not allowed to raise maximum limit") even though the parent is
root. A call costs about 70-130 ms of wall time on 2 busy cores (interpreter start-up). In a
container whose seccomp profile forbids ``unshare`` the result is "none" (prelude only).
"""

from __future__ import annotations

import functools
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile

from async_rl.tools.base import Tool

__all__ = ["make_python_tool", "network_isolation", "python_tool", "run_python"]

# Runs in the child before the user's code (argv: isolation mode, cpu_s, memory bytes,
# file-size bytes, code path). Kept free of third-party imports; -I ignores PYTHON* variables.
_BOOTSTRAP = r'''
import os, sys, resource

def _unshare(flags):
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).unshare(ctypes.c_int(flags)) == 0
    except Exception:
        return False

def _isolate(mode):
    CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
    if mode == "user+net":
        uid, gid = os.getuid(), os.getgid()
        if _unshare(CLONE_NEWUSER | CLONE_NEWNET):
            # Without a mapping the uid is "nobody" inside and file creation fails (EOVERFLOW).
            for path, text in (("/proc/self/setgroups", "deny"),
                               ("/proc/self/uid_map", f"{uid} {uid} 1"),
                               ("/proc/self/gid_map", f"{gid} {gid} 1")):
                try:
                    with open(path, "w") as f:
                        f.write(text)
                except OSError:
                    pass
            return "user+net"
        mode = "net"
    if mode == "net" and _unshare(CLONE_NEWNET):
        return "net"
    return "none"

_mode, _cpu_s, _mem_bytes, _fsize_bytes, _path = sys.argv[1:6]
_ISOLATION = _isolate(_mode)

def _limit(which, soft, hard):
    # Never above an inherited hard limit: setrlimit would refuse, and that limit is stricter.
    _, old_hard = resource.getrlimit(which)
    if old_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    resource.setrlimit(which, (soft, hard))

_limit(resource.RLIMIT_CORE, 0, 0)
_limit(resource.RLIMIT_FSIZE, int(_fsize_bytes), int(_fsize_bytes))
_limit(resource.RLIMIT_CPU, int(_cpu_s), int(_cpu_s) + 1)

import socket as _socket_module

_NO_NET = "network access is disabled in this sandbox"

class _NoNetworkSocket(_socket_module.socket):
    def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
        if fileno is None:
            raise PermissionError(_NO_NET)
        super().__init__(family, type, proto, fileno)

def _no_network(*args, **kwargs):
    raise PermissionError(_NO_NET)

_socket_module.socket = _socket_module.SocketType = _NoNetworkSocket
for _name in ("create_connection", "create_server", "getaddrinfo", "gethostbyname",
              "gethostbyname_ex", "gethostbyaddr", "getnameinfo"):
    setattr(_socket_module, _name, _no_network)

import runpy, traceback
_limit(resource.RLIMIT_AS, int(_mem_bytes), int(_mem_bytes))
sys.argv = [_path]
try:
    runpy.run_path(_path, run_name="__main__")
except SystemExit:
    raise
except BaseException as _e:
    _tb = _e.__traceback__
    # Hide the bootstrap's and runpy's frames: the model should see only its own code.
    while _tb is not None and _tb.tb_frame.f_code.co_filename != _path:
        _tb = _tb.tb_next
    traceback.print_exception(type(_e), _e, _tb)
    sys.exit(1)
'''

_CODE_FILE = "main.py"


def _isolation_probe_code() -> str:
    # The bootstrap's _isolate, then checks that files can still be created and that the
    # loopback the parent could listen on is unreachable.
    head = _BOOTSTRAP.split("_mode, _cpu_s")[0]
    return head + r'''
mode = _isolate(sys.argv[1])
with open("probe.txt", "w") as f:
    f.write("ok")
import _socket
s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", int(sys.argv[2])))
except OSError:
    reachable = False
else:
    reachable = True
print(mode if not reachable else "none")
'''


@functools.lru_cache(maxsize=1)
def network_isolation() -> str:
    """How the ``python`` tool's children are cut off from the network on this machine.

    Runs one probe child (cached for the process): it tries the namespaces, writes a file, and
    connects to a port this process listens on.

    Returns:
        "user+net" (new user and network namespaces), "net" (a network namespace only, e.g.
        root where user namespaces are disabled), or "none" (only the socket prelude; a
        determined program can reach the network).
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        for mode in ("user+net", "net"):
            with tempfile.TemporaryDirectory(prefix="async_rl_probe_") as workdir:
                try:
                    out = subprocess.run(
                        [sys.executable, "-I", "-c", _isolation_probe_code(), mode, str(port)],
                        cwd=workdir, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                        timeout=30, env=_child_env(workdir),
                    )
                except (OSError, subprocess.SubprocessError):
                    continue
                result = out.stdout.strip()
                if out.returncode == 0 and result == mode:
                    return mode
        return "none"
    finally:
        listener.close()


def _child_env(workdir: str) -> dict[str, str]:
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
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
    with tempfile.TemporaryDirectory(prefix="async_rl_python_", ignore_cleanup_errors=True) as root:
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        with open(os.path.join(workdir, _CODE_FILE), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
        args = [
            sys.executable, "-I", "-X", "utf8", "-c", _BOOTSTRAP, mode, str(cpu_limit),
            str(memory_mb * 2**20), str(max_file_mb * 2**20), _CODE_FILE,
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

    def python(code: str) -> str:
        return run_python(
            code, cpu_s=cpu_s, memory_mb=memory_mb, wall_s=wall_s,
            max_output_chars=max_output_chars, max_file_mb=max_file_mb,
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
