"""A ``python`` tool: run model-written code in a fresh, limited subprocess and return its output.

Each call writes the code to ``main.py`` in a new empty temporary directory and runs
``sys.executable -I -X utf8 -c <bootstrap> ...`` there, in a new session (process group), with
stdin from /dev/null and a minimal environment (``HOME`` and ``TMPDIR`` are the work directory).
Before the user's code runs, the bootstrap inside the child (all through ctypes: Python 3.11
has no ``os.unshare``; ``sandbox_isolation()`` reports what a probe child managed):

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

__all__ = [
    "SandboxIsolation",
    "make_python_tool",
    "network_isolation",
    "python_tool",
    "run_python",
    "sandbox_isolation",
]

# The first uid of the range the child of root switches to: _UID_BASE + the child's pid, so no two
# live sandboxes share a uid (pids are unique, at most 2**22 on Linux). Nothing else may use it.
_UID_BASE = 2_000_000_000

# Runs in the child before the user's code (argv: network mode, "fs"/"-", "uid"/"-", cpu_s,
# memory bytes, file-size bytes, max processes, new-root mount point, code path). Kept free of
# third-party imports; -I ignores PYTHON* variables. Everything above the "main" marker is also
# the head of the isolation probe.
_BOOTSTRAP = r'''
import os, sys, resource

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE, MNT_DETACH = 4096, 16384, 1 << 18, 2
UID_BASE = UID_BASE_VALUE
# The system directories the interpreter and its shared libraries live in (symlinks are copied).
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_LIBC = None

def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC

def _check(rc, what):
    if rc != 0:
        import ctypes
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), what)

def _unshare(flags):
    try:
        import ctypes
        return _libc().unshare(ctypes.c_int(flags)) == 0
    except Exception:
        return False

def _mount(source, target, fstype, flags, data=None):
    import ctypes
    enc = lambda s: None if s is None else os.fsencode(s)
    _check(_libc().mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")

def _pivot_root(new_root, put_old):
    import ctypes
    fn = getattr(_libc(), "pivot_root", None)
    if fn is None:  # older glibc has no wrapper: the raw system call (KeyError elsewhere)
        number = ctypes.c_long({"x86_64": 155, "aarch64": 41}[os.uname().machine])
        fn = lambda new, old: _libc().syscall(number, new, old)
    _check(fn(os.fsencode(new_root), os.fsencode(put_old)), "pivot_root")

def _map_ids(proc, uid, gid):
    # Without a mapping the uid is "nobody" inside and file creation fails (EOVERFLOW). Written
    # through a /proc/<pid> descriptor opened earlier: /proc itself may be gone by now.
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"),
                       ("gid_map", f"{gid} {gid} 1")):
        try:
            path = name if proc is not None else "/proc/self/" + name
            fd = os.open(path, os.O_WRONLY, dir_fd=proc)
            try:
                os.write(fd, text.encode())
            finally:
                os.close(fd)
        except OSError:
            pass

def _python_dirs():
    # What the interpreter reads after start-up: its installation, the venv and every import root
    # (a .pth file may add one from elsewhere); nested ones are covered by their parent.
    found = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
             os.path.dirname(os.__file__), *sys.path]
    dirs = []
    for path in sorted({os.path.abspath(p) for p in found if p and os.path.isdir(p)}, key=len):
        if path != "/" and not any(path.startswith(d + "/") for d in dirs):
            dirs.append(path)
    return dirs

def _bind(source, new_root, read_only):
    target = new_root + source
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    try:
        _mount(source, target, None, MS_BIND)
    except OSError:
        # In a user namespace a plain bind that would uncover what lies under a submount is refused.
        _mount(source, target, None, MS_BIND | MS_REC)
    if source in DEVICES:
        return
    # A user namespace may add mount flags but never drop the ones it inherited.
    noexec = MS_NOEXEC if os.statvfs(source).f_flag & os.ST_NOEXEC else 0
    flags = MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV | noexec | (MS_RDONLY if read_only else 0)
    _mount(None, target, None, flags)

def _private_root(new_root, workdir):
    # A fresh tmpfs holding read-only binds of what Python needs plus the work directory; after
    # pivot_root and the detach of the old root nothing else of the host is reachable.
    try:
        _mount(None, "/", None, MS_REC | MS_PRIVATE)  # so no mount below propagates to the host
        _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        covered = []
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                os.symlink(os.readlink(path), new_root + path)
                covered.append(path)
            elif os.path.isdir(path):
                _bind(path, new_root, read_only=True)
                covered.append(path)
        for path in _python_dirs():
            if not any(path == c or path.startswith(c + "/") for c in covered):
                _bind(path, new_root, read_only=True)
        for path in DEVICES:
            if os.path.exists(path):
                _bind(path, new_root, read_only=False)
        # multiprocessing's locks are POSIX semaphores, files in /dev/shm: give it a private one.
        os.makedirs(new_root + "/dev/shm")
        _mount("tmpfs", new_root + "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC,
               "mode=1777,size=64m")
        _bind(workdir, new_root, read_only=False)
        os.mkdir(new_root + "/.old_root")
        _pivot_root(new_root, new_root + "/.old_root")
        os.chdir("/")
        import ctypes
        _check(_libc().umount2(b"/.old_root", ctypes.c_int(MNT_DETACH)), "umount /.old_root")
        os.rmdir("/.old_root")
        _mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
        ok = True
    except (OSError, KeyError):
        ok = False
    os.chdir(workdir)
    return ok

def _switch_uid(workdir, code_path):
    # Root's processes are exempt from RLIMIT_NPROC and may read every file: drop to a uid of this
    # sandbox's own, if the interpreter's files and the work directory stay reachable for it.
    uid = UID_BASE + os.getpid()
    try:
        for path in (workdir, code_path):
            if path:
                os.chown(path, uid, uid)
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, 0, 0)  # access() checks the real uid; euid 0 keeps the way back open
        if (all(os.access(p, os.R_OK | os.X_OK) for p in _python_dirs())
                and os.access(workdir, os.R_OK | os.W_OK | os.X_OK)):
            os.setresuid(uid, uid, uid)
            return True
    except OSError:  # EINVAL: the uid is not mapped (root inside a container's user namespace)
        pass
    os.setresuid(0, 0, 0)
    os.setresgid(0, 0, 0)
    return False

def _isolate(net, fs, uid, new_root, code_path):
    """Returns (network mode, private root?, own uid?, RLIMIT_NPROC counts only this sandbox?)."""
    workdir, my_uid, my_gid = os.getcwd(), os.getuid(), os.getgid()
    root = os.geteuid() == 0
    try:
        proc = os.open("/proc/self", os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        proc = None
    # Root creates the namespaces in the initial user namespace, then drops to a fresh uid, which
    # leaves them out of the code's reach; anyone else needs a user namespace to create them.
    user = 0 if root else CLONE_NEWUSER
    ns_flag = CLONE_NEWNS if fs else 0
    net_flag = CLONE_NEWNET if net != "none" else 0
    done = 0
    for flags in dict.fromkeys((user | ns_flag | net_flag, user | net_flag, user | ns_flag,
                                net_flag, ns_flag)):
        if flags and _unshare(flags):
            done = flags
            break
    if done & CLONE_NEWUSER:
        _map_ids(proc, my_uid, my_gid)
    private_root = bool(done & CLONE_NEWNS) and _private_root(new_root, workdir)
    own_uid = root and uid and _switch_uid(workdir, code_path)
    if root and not own_uid and _unshare(CLONE_NEWUSER):
        # Still root: the new user namespace strips every capability in the initial one.
        _map_ids(proc, 0, 0)
        done |= CLONE_NEWUSER
    if proc is not None:
        os.close(proc)
    mode = "none"
    if done & CLONE_NEWNET:
        mode = "user+net" if done & CLONE_NEWUSER and not root else "net"
    # RLIMIT_NPROC counts per uid and user namespace (Linux >= 5.14) and never binds root.
    return mode, private_root, own_uid, own_uid or bool(done & CLONE_NEWUSER and not root)

def _limit(which, soft, hard):
    # Never above an inherited hard limit: setrlimit would refuse, and that limit is stricter.
    _, old_hard = resource.getrlimit(which)
    if old_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, old_hard), min(hard, old_hard)
    resource.setrlimit(which, (soft, hard))

# --- main ---
(_mode, _fs, _uid, _cpu_s, _mem_bytes, _fsize_bytes, _max_procs, _new_root,
 _path) = sys.argv[1:10]
_ISOLATION = _isolate(_mode, _fs == "fs", _uid == "uid", _new_root, _path)
if _ISOLATION[3]:
    _limit(resource.RLIMIT_NPROC, int(_max_procs), int(_max_procs))

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
_PROBE_PROCESSES = 3


def _isolation_probe_code() -> str:
    # The bootstrap's _isolate, then checks of each isolation it claims: the work directory is
    # writable, a file next to it is hidden, the parent's loopback port is unreachable and forks
    # stop at the process cap.
    head = _bootstrap().split("# --- main ---")[0]
    return head + r'''
import json, _socket
net, private_root, own_uid, nproc = _isolate(sys.argv[1], True, True, sys.argv[2], None)
with open("probe.txt", "w") as f:
    f.write("ok")
private_root = private_root and not os.path.exists(sys.argv[3])
s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
s.settimeout(1.0)
try:
    s.connect(("127.0.0.1", int(sys.argv[4])))
    net = "none"
except OSError:
    pass
capped = False
if nproc:
    cap = int(sys.argv[5])
    _limit(resource.RLIMIT_NPROC, cap, cap)
    r, w = os.pipe()
    children = []
    try:
        for _ in range(cap + 2):
            pid = os.fork()
            if pid == 0:
                os.close(w)
                os.read(r, 1)  # returns once the probe closes its end
                os._exit(0)
            children.append(pid)
    except BlockingIOError:
        capped = len(children) == cap - 1
    os.close(w)
    for pid in children:
        os.waitpid(pid, 0)
print(json.dumps({"network": net, "filesystem": private_root, "own_uid": own_uid,
                  "processes": capped}))
'''


def _bootstrap() -> str:
    return _BOOTSTRAP.replace("UID_BASE_VALUE", str(_UID_BASE))


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
            args = [sys.executable, "-I", "-c", _isolation_probe_code(), "net", new_root, marker,
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
                _kill_uid(_UID_BASE + proc.pid)
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
            sys.executable, "-I", "-X", "utf8", "-c", _bootstrap(), mode,
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
                    _kill_uid(_UID_BASE + proc.pid)
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
    if uid < _UID_BASE or uid == os.getuid():
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
