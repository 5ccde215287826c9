"""The ``python`` tool's sandbox: a private read-only filesystem view and a process cap.

Each escape is tried twice where that is safe: with the isolation ``sandbox_isolation()`` found on
this machine (it must fail) and with that isolation switched off (it must succeed, so the test
can fail). Tests of an isolation this machine cannot provide (a container that forbids the
namespaces) are skipped. CPU only; a dozen short subprocesses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import sys
import time

import pytest

from async_rl.tools import make_python_tool, run_python
from async_rl.tools import python_exec
from async_rl.tools.python_exec import SandboxIsolation, network_isolation, sandbox_isolation

# Generous limits: the machine is shared and busy, and none of these tests is about limits.
LIMITS = {"cpu_s": 10, "wall_s": 30, "memory_mb": 1024}


def require(field: str) -> SandboxIsolation:
    isolation = sandbox_isolation()
    if not getattr(isolation, field):
        pytest.skip(f"sandbox_isolation().{field} is False on this machine")
    return isolation


@pytest.fixture
def unisolated(monkeypatch):
    """Switch the new isolation off (the network stays as found) to show each escape works then."""
    off = dataclasses.replace(sandbox_isolation(), filesystem=False, own_uid=False, processes=False)
    monkeypatch.setattr(python_exec, "sandbox_isolation", lambda: off)


def test_isolation_report_is_consistent():
    isolation = sandbox_isolation()
    assert network_isolation() == isolation.network in ("user+net", "net", "none")
    # A dedicated uid exists only for a root trainer, and it is what makes the cap hold for root.
    assert not isolation.own_uid or os.geteuid() == 0
    assert not (os.geteuid() == 0 and isolation.processes) or isolation.own_uid


READ_SECRETS = """
for path in ({passwd!r}, {secret!r}):
    try:
        print(path, "READ", open(path).read()[:20])
    except OSError as e:
        print(path, type(e).__name__)
"""


def test_host_files_are_hidden(tmp_path):
    require("filesystem")
    secret = tmp_path / "secret.txt"  # under /tmp, outside the call's work directory
    secret.write_text("s3cret-token")
    out = run_python(READ_SECRETS.format(passwd="/etc/passwd", secret=str(secret)), **LIMITS)
    assert out.splitlines() == ["/etc/passwd FileNotFoundError", f"{secret} FileNotFoundError"]


def test_host_files_are_readable_without_the_private_root(tmp_path, unisolated):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret-token")
    out = run_python(READ_SECRETS.format(passwd="/etc/passwd", secret=str(secret)), **LIMITS)
    assert f"{secret} READ s3cret-token" in out.splitlines()


LIST_ROOT = """
import os
print(sorted(os.listdir("/")))
print(sorted(os.listdir("/dev")))
print(sorted(os.listdir("/tmp")))
print(os.getcwd().split("/")[2])
"""


def _python_paths() -> list[str]:
    # The child is this interpreter, so it needs the same installation and import roots.
    paths = [sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix, *sys.path]
    return [p for p in paths if p.startswith("/") and os.path.isdir(p)]


def python_top_dirs() -> set[str]:
    return {p.split("/")[1] for p in _python_paths()}


def test_root_holds_only_what_python_needs():
    require("filesystem")
    root, dev, tmp, parent = run_python(LIST_ROOT, **LIMITS).splitlines()
    system = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "tmp"}
    assert set(eval(root)) <= system | python_top_dirs()
    assert ({"etc", "proc", "sys", "var", "home"} - python_top_dirs()).isdisjoint(eval(root))
    assert eval(dev) == ["null", "random", "shm", "urandom", "zero"]
    # /tmp shows the work directory's parent and, for a checkout or venv under /tmp (a CI clone),
    # the directories Python imports from, nothing else.
    under_tmp = {p.split("/")[2] for p in _python_paths() if p.startswith("/tmp/")}
    assert eval(tmp) == sorted({parent} | under_tmp)


def test_root_is_the_host_root_without_isolation(unisolated):
    root = eval(run_python(LIST_ROOT, **LIMITS).splitlines()[0])
    assert "etc" in root and "proc" in root


def test_system_dirs_are_read_only_and_the_work_dir_is_writable():
    require("filesystem")
    code = """
import os, tempfile
for path in ("/usr/sandbox_probe.txt", "/sandbox_probe.txt"):
    if not os.statvfs(os.path.dirname(path)).f_flag & os.ST_RDONLY:
        print(path, "on a writable mount: not tried")  # it would land in the host's /usr
        continue
    try:
        open(path, "w")
        print(path, "WRITTEN")
    except OSError as e:
        print(path, e.strerror)
with open("result.txt", "w") as f:
    f.write("kept")
with tempfile.NamedTemporaryFile("w+", delete=False) as f:
    f.write("temp")
print(open("result.txt").read(), open(f.name).read(), sorted(os.listdir(".")) == sorted(
    ["main.py", "result.txt", os.path.basename(f.name)]), os.path.dirname(f.name) == os.getcwd())
"""
    out = run_python(code, **LIMITS).splitlines()
    assert out == [
        "/usr/sandbox_probe.txt Read-only file system",
        "/sandbox_probe.txt Read-only file system",
        "kept temp True True",
    ]


def test_system_dirs_are_writable_without_isolation_as_root(unisolated):
    # Only asks: actually writing into the host's /usr as root would damage this machine.
    if os.geteuid() != 0:
        pytest.skip("only root can write to /usr anyway")
    assert run_python("import os; print(os.access('/usr/lib', os.W_OK))", **LIMITS) == "True\n"


FORK_BOMB = """
import os, time
print(os.getuid(), flush=True)
children = []
try:
    for i in range({forks}):
        pid = os.fork()
        if pid == 0:
            if i == 0 and {setsid}:
                os.setsid()  # out of the process group: only a kill by uid finds it
            time.sleep(60)
            os._exit(0)
        children.append(pid)
except OSError as e:
    print("stopped after", len(children), type(e).__name__, e.errno)
else:
    print("forked", len(children))
print(*children)
"""


def live_processes(pids: list[int], uid: int) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        if int(status["Uid"].split()[0]) == uid and not status["State"].strip().startswith("Z"):
            alive.append(pid)
    return alive


def wait_until_gone(pids: list[int], uid: int) -> list[int]:
    # A SIGKILLed process may take a moment to exit on a busy machine; give it up to 10 s.
    deadline = time.monotonic() + 10
    while live_processes(pids, uid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live_processes(pids, uid)


def test_forks_stop_at_max_processes_and_leave_nothing_behind():
    isolation = require("processes")
    code = FORK_BOMB.format(forks=40, setsid=isolation.own_uid)
    uid, stopped, children = run_python(code, max_processes=6, **LIMITS).splitlines()
    # The interpreter is one of the six.
    assert stopped == "stopped after 5 BlockingIOError 11"
    pids = [int(p) for p in children.split()]
    if isolation.own_uid:
        # Even the child that left the process group is gone by the time the call returns.
        assert live_processes(pids, int(uid)) == []
    assert wait_until_gone(pids, int(uid)) == []


def test_forks_are_unbounded_without_the_cap(unisolated):
    uid, forked, children = run_python(
        FORK_BOMB.format(forks=12, setsid=False), max_processes=6, **LIMITS
    ).splitlines()
    assert forked == "forked 12"
    assert wait_until_gone([int(p) for p in children.split()], int(uid)) == []


def test_threads_count_against_max_processes():
    require("processes")
    code = """
import threading, time
started = 0
try:
    for _ in range(10):
        threading.Thread(target=time.sleep, args=(2,), daemon=True).start()
        started += 1
except RuntimeError as e:
    print(started, e)
"""
    assert run_python(code, max_processes=4, **LIMITS) == "3 can't start new thread\n"


def test_model_code_still_runs():
    code = """
import json, math, re, collections, fractions, decimal, statistics, itertools, random
random.seed(0)
print(json.dumps({"a": math.comb(10, 3)}), re.sub("b+", "-", "abbbc"),
      collections.Counter("abca")["a"], fractions.Fraction(3, 6), decimal.Decimal("1.10") * 3,
      statistics.median([3, 1, 2]), list(itertools.accumulate([1, 2, 3])), random.randint(1, 6))
"""
    out = run_python(code, **LIMITS)
    assert out == '{"a": 120} a-c 2 1/2 3.30 2 [1, 3, 6] 4\n'
    if importlib.util.find_spec("numpy") is None:
        return
    code = "import numpy as np\nprint(np.linalg.solve([[2.0, 0], [0, 4.0]], [2, 2]))"
    out = run_python(code, **LIMITS)
    assert out == "[1.  0.5]\n"


def test_max_processes_is_validated():
    with pytest.raises(ValueError, match="max_processes must be >= 1"):
        make_python_tool(max_processes=0)
