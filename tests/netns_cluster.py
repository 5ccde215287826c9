"""A two-node Ray cluster on one machine, the second node where the first's loopback is not.

::

    this network namespace                       namespace arl-<id> (made here, deleted at exit)
    head node  10.R.S.1 ──── veth pair ────      second node  10.R.S.2
    (ray start --head, labels node=head)         (ray start --address, labels node=second)

Two raylets on one host share its loopback, so a pipeline that binds ``127.0.0.1`` would still
work between them; with the second node in its own network namespace, ``127.0.0.1`` there is its
own, and only the veth pair joins the two. Traffic stays between the namespaces made here. Needs
root and ``ip`` (iproute2); ``available()`` says whether this machine can.

Used by ``tests/test_multinode.py``; as a script it runs one command against the cluster::

    python tests/netns_cluster.py -- async-rl train --config configs/default.yaml trainer.mode=async

(``RAY_ADDRESS`` is set for the command), then reports what the run left behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

RAY_PROCESS_NAMES = ("GeneratorWorker", "LearnerRank", "RewardModel", "EngineCore", "sglang::")
"""Command-line fragments of the processes a run places or starts (actors, engine processes)."""


def available() -> str | None:
    """``None`` when a namespace cluster can be made here, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None:
        return "needs iproute2's ip"
    name = f"arl-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", name], capture_output=True)
    return None


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip", *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def shm_files() -> set[str]:
    """Names in ``/dev/shm`` now."""
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _parents() -> dict[int, int]:
    out = {}
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold spaces and parentheses.
                out[int(pid)] = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    return out


def run_processes(roots: set[int] | None = None) -> list[str]:
    """Command lines of live processes a run places or starts (``RAY_PROCESS_NAMES``) that
    descend from ``roots`` (a cluster's node processes: Ray workers start their own sessions, so
    ancestry, not the process group, ties them to their node), or anywhere."""
    parents = _parents()

    def under_roots(pid: int) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid in roots:
                return True
            pid, seen = parents.get(pid, 0), seen + 1
        return False

    out = []
    for pid in parents:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(n in cmd for n in RAY_PROCESS_NAMES) and (roots is None or under_roots(pid)):
            out.append(f"{pid}: {cmd[:160]}")
    return out


def wait_run_processes_gone(roots: set[int] | None = None, timeout_s: float = 30.0) -> float:
    """Wait until no run process is alive (Ray kills a finished driver's actors asynchronously);
    returns the seconds waited (``timeout_s`` if some are still there)."""
    t0 = time.monotonic()
    while run_processes(roots) and time.monotonic() - t0 < timeout_s:
        time.sleep(0.5)
    return time.monotonic() - t0


class TwoNodeCluster:
    """Start on ``__enter__``, stop everything (both nodes' process groups, the namespace and the
    veth pair) on ``__exit__``.

    Args:
        work_dir: where the nodes' logs go (Ray's session files: a short path under /tmp, removed
            at exit).
        cpus: logical CPUs of the head and the second node (Ray's admission only).

    Attributes:
        address: the head's GCS address (``host:port``), for ``RAY_ADDRESS``.
        head_ip, node_ip: the two nodes' addresses.
        env: the environment to run a driver with (``RAY_ADDRESS``, token auth).
    """

    def __init__(self, work_dir: Path, cpus: tuple[int, int] = (2, 2)) -> None:
        tag = uuid.uuid4().hex[:6]
        self.ns = f"arl-{tag}"
        self.veth = (f"arlh{tag}", f"arln{tag}")  # interface names: at most 15 characters
        octet = 16 + int(tag[:2], 16) % 200
        self.head_ip, self.node_ip = f"10.{octet}.{int(tag[2:4], 16)}.1", f"10.{octet}.{int(tag[2:4], 16)}.2"
        with socket.socket() as s:  # a free port for the head's GCS (released just before ray binds it)
            s.bind(("", 0))
            self.port = s.getsockname()[1]
        self.address = f"{self.head_ip}:{self.port}"
        self.work_dir, self.cpus = Path(work_dir), cpus
        # Ray's session directory holds Unix sockets, whose paths may not exceed 107 bytes.
        self.ray_dir = f"/tmp/arl-ray-{tag}"
        self.procs: list[subprocess.Popen] = []
        # A node's processes choose their own interface (async_rl.runtime.cluster.use_node_interface): one
        # named in this process's environment may not exist in the second node's namespace.
        self.env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        self.env.update(RAY_ADDRESS=self.address, RAY_AUTH_MODE="token")

    def __enter__(self) -> "TwoNodeCluster":
        try:
            self._network()
            self._start_nodes()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _network(self) -> None:
        _ip("netns", "add", self.ns)
        _ip("link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
        _ip("link", "set", self.veth[1], "netns", self.ns)
        _ip("addr", "add", f"{self.head_ip}/24", "dev", self.veth[0])
        _ip("link", "set", self.veth[0], "up")
        _ip("addr", "add", f"{self.node_ip}/24", "dev", self.veth[1], ns=self.ns)
        _ip("link", "set", self.veth[1], "up", ns=self.ns)
        _ip("link", "set", "lo", "up", ns=self.ns)

    def _start_nodes(self) -> None:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        common = ["--disable-usage-stats", "--block"]
        head = [_ray_bin(), "start", "--head", "--node-ip-address", self.head_ip, "--port", str(self.port),
                "--num-cpus", str(self.cpus[0]), "--include-dashboard", "false", "--labels", "node=head",
                "--temp-dir", self.ray_dir, *common]
        node = ["ip", "netns", "exec", self.ns, _ray_bin(), "start", "--address", self.address,
                "--node-ip-address", self.node_ip, "--num-cpus", str(self.cpus[1]), "--labels", "node=second",
                *common]
        env = dict(self.env)
        env.pop("RAY_ADDRESS")
        # Own sessions: every Ray process of a node stays in its process group, killed as one.
        self.procs.append(subprocess.Popen(head, env=env, start_new_session=True,
                                           stdout=open(self.work_dir / "head.log", "w"), stderr=subprocess.STDOUT))
        self._wait_nodes(1)
        self.procs.append(subprocess.Popen(node, env=env, start_new_session=True,
                                           stdout=open(self.work_dir / "second.log", "w"), stderr=subprocess.STDOUT))
        self._wait_nodes(2)

    def _wait_nodes(self, n: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        probe = ("import ray, sys; ray.init(logging_level='ERROR'); "
                 "print(sum(x['Alive'] for x in ray.nodes())); ray.shutdown()")
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"a Ray node exited; see {self.work_dir}/*.log")
            r = subprocess.run([sys.executable, "-c", probe], env=self.env, capture_output=True, text=True,
                               timeout=120)
            if r.returncode == 0 and r.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(2)
        raise TimeoutError(f"{n} Ray node(s) not up within {timeout_s:.0f} s; see {self.work_dir}/*.log")

    @property
    def pids(self) -> set[int]:
        """The two nodes' ``ray start`` processes: every Ray process of a node descends from one."""
        return {p.pid for p in self.procs}

    def __exit__(self, *exc) -> None:
        for p in reversed(self.procs):
            _kill_group(p)
        subprocess.run(["ip", "link", "delete", self.veth[0]], capture_output=True)
        subprocess.run(["ip", "netns", "delete", self.ns], capture_output=True)
        shutil.rmtree(self.ray_dir, ignore_errors=True)


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=30)


def main(argv: list[str]) -> int:
    """``python tests/netns_cluster.py [--work-dir D] -- COMMAND ...``: run COMMAND against a
    two-node cluster, then list what it left (run processes, new /dev/shm files); exit status is
    COMMAND's, or 3 when a run process outlived it."""
    if "--" not in argv:
        print(main.__doc__)
        return 2
    cut = argv.index("--")
    opts, command = argv[:cut], argv[cut + 1:]
    work = Path(opts[opts.index("--work-dir") + 1]) if "--work-dir" in opts else Path(f"/tmp/arl-cluster-{os.getpid()}")
    if reason := available():
        print(f"cannot make a namespace cluster here: {reason}")
        return 2
    before = shm_files()

    def stop(signum, frame):  # SIGTERM/SIGHUP: leave through __exit__, which removes the namespace
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    with TwoNodeCluster(work) as cluster:
        print(f"cluster: head {cluster.head_ip}, second node {cluster.node_ip} (namespace {cluster.ns}); "
              f"RAY_ADDRESS={cluster.address}", flush=True)
        rc = subprocess.run(command, env=cluster.env).returncode
        waited = wait_run_processes_gone(cluster.pids)
        left = run_processes(cluster.pids)
        new_shm = sorted(shm_files() - before)
    print(f"command exit status {rc}")
    print(f"left after the run ({waited:.1f} s after it exited): {len(left)} run processes; {len(new_shm)} new "
          f"/dev/shm files (machine-wide: another job's count too)")
    for line in left + new_shm:
        print("  " + line)
    after_teardown = sorted(shm_files() - before)
    print(f"after the cluster stopped: {len(after_teardown)} new /dev/shm files {after_teardown}; node logs in {work}")
    return rc if rc else (3 if left else 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
