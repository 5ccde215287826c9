"""The child side of the ``python`` tool's sandbox: the Python source a sandboxed process runs
before the model's code, and the isolation probe built from it.

Both are plain source text, passed to ``sys.executable -I -c``: the bootstrap isolates the
child (namespaces, a private root, its own uid, resource limits, the socket prelude; the steps
are described in ``async_rl.tools.python_exec``'s docstring), then runs the code file; the probe
isolates itself the same way and reports, as one JSON line, which of those steps held. The
parent side (starting the child, the limits, killing what is left) is ``async_rl.tools.python_exec``.
"""

from __future__ import annotations

__all__ = ["UID_BASE", "bootstrap_code", "isolation_probe_code"]

# The first uid of the range the child of root switches to: UID_BASE + the child's pid, so no two
# live sandboxes share a uid (pids are unique, at most 2**22 on Linux). Nothing else may use it.
UID_BASE = 2_000_000_000

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


def isolation_probe_code() -> str:
    """The isolation probe's source (``sandbox_isolation`` runs it): the bootstrap up to its
    ``# --- main ---`` marker, then checks of each isolation the bootstrap claims.

    The child takes argv ``[network mode, new-root mount point, marker file path, loopback
    port, process cap]`` and prints one JSON object: ``{"network": str, "filesystem": bool,
    "own_uid": bool, "processes": bool}``.
    """
    # The bootstrap's _isolate, then checks of each isolation it claims: the work directory is
    # writable, a file next to it is hidden, the parent's loopback port is unreachable and forks
    # stop at the process cap.
    head = bootstrap_code().split("# --- main ---")[0]
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


def bootstrap_code() -> str:
    """The bootstrap's source, with ``UID_BASE`` filled in (``run_python`` runs it with ``-c``).

    The child takes argv ``[network mode, "fs"/"-", "uid"/"-", cpu seconds, memory bytes,
    file-size bytes, max processes, new-root mount point, code path]``.
    """
    return _BOOTSTRAP.replace("UID_BASE_VALUE", str(UID_BASE))
