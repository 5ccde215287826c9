"""The Ray cluster of one run: joining a cluster (or starting a single-node one), the address
every socket binds, and where each actor is placed.

::

    trainer process = Ray driver, learner rank 0   (node A, ``bind_host``)
      ├─ binds: trajectory receiver (ZeroMQ PULL), weight store (TCPStore), learner rendezvous
      ├─ placement group "learner" (PACK):    learner ranks 1..N-1, one bundle each
      └─ placement group "generators" (SPREAD): generator actors, one bundle each
           actors on node A get weights over shared memory, actors on other nodes by broadcast

* **Joining**: ``trainer.ray_address`` (or ``RAY_ADDRESS``, as Ray users expect) connects to a
  running cluster (``ray start --head`` / ``ray start --address ...``); the trainer process is
  the driver. Without either, the run starts a Ray of its own on this machine, bound to
  loopback, and shuts it down at the end.
* **Addresses**: every socket the pipeline binds uses ``bind_host``: ``trainer.bind_host``, or
  the driver's node IP as Ray knows it on a cluster of several nodes, or ``127.0.0.1`` on a
  single node (the Ray a run starts itself; nothing is then reachable from another machine).
  Gloo (and NCCL's bootstrap) pick the interface of their own process's node IP
  (``use_node_interface``; ``lo`` on a single node): left to themselves they resolve the host
  name, which on many machines maps to ``127.0.0.1`` (an address other nodes cannot dial) and on
  others to the LAN address (a single-node run would listen on the network). TCPStore servers
  are made by ``tcp_store``, since torch's own binds every interface.
* **Placement**: each role is one Ray placement group (``Cluster.place``), one bundle per actor of
  ``{"CPU": num_cpus, "GPU": num_gpus}`` and an optional node label selector: packed for the
  learner (its collectives want one fast link), spread for the generators (their engines share
  nothing). Where each actor landed is printed at start and written to ``placement.json`` in the
  run directory. Ray's CPU accounting only admits actors; their torch threads come from the
  thread budget (``loops.async_loop.thread_budget``), since Ray does not pin cores; a role can be
  pinned to cores of its own (``generator.cpu_affinity``, ``learner.cpu_affinity``: ``pin_process``).

What each role asks for (``PlacementConfig`` and its checks) is ``async_rl.runtime.placement``; the CPU
pinning is ``async_rl.utils.cpu_affinity``. Both are re-exported here, their import path before they
had modules of their own.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from async_rl.utils.cpu_affinity import (  # noqa: F401
    check_cpu_affinity, cpus_restored, pin_process, pin_thread, service_cores, split_learner_threads, started_on,
)
from async_rl.runtime.placement import (  # noqa: F401
    PLACEMENT_STRATEGIES, PLACEMENT_TIMEOUT_S, PlacementConfig, PlacementError, check_placement, ray_cpus_needed,
)

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
"""The single-node default: what a run binds on the Ray it starts itself."""

_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


class ClusterUnreachable(ValueError):
    """``trainer.ray_address`` / ``RAY_ADDRESS`` names no cluster this process can join."""


def ray_address(trainer_cfg) -> str | None:
    """The cluster to join: ``trainer.ray_address``, else ``RAY_ADDRESS``, else ``None`` (start one)."""
    return trainer_cfg.ray_address or os.environ.get("RAY_ADDRESS") or None


def node_ip() -> str:
    """This process's node IP as Ray knows it: the address its raylet registered with
    (``ray start --node-ip-address``, or ``127.0.0.1`` for a run's own Ray). Not
    ``ray.util.get_node_ip_address()``, which answers with this host's default-route address
    whatever the node was started with."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is this machine's loopback."""
    return host.startswith("127.") or host in ("::1", "localhost")


def group_ip(bind_host: str | None) -> str:
    """The address a Ray actor's gloo groups and NCCL bootstrap use (``use_node_interface``):
    loopback when the run binds loopback (a single-node run, whose actors all share the trainer's
    node: ``Cluster.check_reachable``), else this node's IP as Ray knows it (``node_ip``). Not
    ``node_ip`` alone: Ray registers a node under the host's own address even when started with
    ``_node_ip_address=127.0.0.1`` (Ray 2.60, measured), which would put a single-node run's
    groups on the network."""
    return LOOPBACK if bind_host and is_loopback(bind_host) else node_ip()


def interface_addresses() -> dict[str, str]:
    """``{interface name: IPv4 address}`` of this host's interfaces that have one (Linux
    ``SIOCGIFADDR``)."""
    out = {}
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
            except OSError:  # no IPv4 address on it
                continue
        out[name] = socket.inet_ntoa(raw[20:24])
    return out


def interface_of(ip: str) -> str | None:
    """The name of the network interface holding IPv4 address ``ip`` on this host, or ``None``."""
    return next((name for name, addr in interface_addresses().items() if addr == ip), None)


def use_node_interface(ip: str) -> str | None:
    """Make gloo and NCCL's bootstrap in this process use the interface holding ``ip`` (this
    node's address, or loopback on a single node), by ``GLOO_SOCKET_IFNAME`` /
    ``NCCL_SOCKET_IFNAME``. Call before the process forms a group; children it starts inherit it.
    Left to themselves they resolve the host name, which maps to ``127.0.0.1`` on some machines
    (other nodes cannot dial it) and to the LAN address on others (a single-node run would then
    listen on the network). A variable the user set is left alone when this host has that
    interface; one naming an interface this host lacks (exported for a cluster whose nodes name
    their interfaces differently), or loopback for a non-loopback ``ip``, is replaced, with a
    warning, since gloo would fail on it ("Unable to find address for: eth0") or time out.

    Returns:
        The interface chosen, or ``None`` (the user's is kept, or no interface holds ``ip``).
    """
    names = {n for _, n in socket.if_nameindex()}
    user = os.environ.get("GLOO_SOCKET_IFNAME")
    loopback = interface_of(LOOPBACK)
    # Loopback cannot reach another node: kept only for a single-node (loopback) group.
    if user and all(part in names and (ip.startswith("127.") or part != loopback) for part in user.split(",")):
        return None
    name = interface_of(ip)
    if name is not None:
        if user:
            logger.warning("GLOO_SOCKET_IFNAME=%s names no interface of this host that reaches other nodes; using "
                           "%s, which holds this node's address %s", user, name, ip)
        os.environ["GLOO_SOCKET_IFNAME"] = name
        nccl = os.environ.get("NCCL_SOCKET_IFNAME")
        if not nccl or (nccl == loopback and not ip.startswith("127.")):  # NCCL's own prefix rules: the user's stays
            os.environ["NCCL_SOCKET_IFNAME"] = name
    return name


def tcp_store(host: str, world_size: int, timeout, wait_for_workers: bool = False):
    """A ``torch.distributed.TCPStore`` server (``is_master``) that listens on ``host`` only, on a
    free port (``store.port``).

    Why not ``TCPStore(host, 0, ..., True)``: torch's server binds every interface (``::``)
    whatever ``host`` says (torch 2.13, measured), so a run on loopback would accept connections
    from the network. The socket is bound here and handed over (``master_listen_fd``; the store
    owns and closes it).

    Args:
        host: the address to listen on (``bind_host``), IPv4, IPv6 or a name.
        world_size: clients plus this server, as ``TCPStore`` counts them.
        timeout: ``datetime.timedelta`` for the store's operations.
        wait_for_workers: block until ``world_size - 1`` clients joined.

    Raises:
        OSError: ``host`` is not an address of this machine (``bind`` fails).
    """
    import torch.distributed as dist

    family, kind, proto, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(address[:2] if family == socket.AF_INET else address)
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    fd = sock.detach()
    try:
        return dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
                             master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


def where() -> dict[str, Any]:
    """Where the calling process runs: Ray node id and IP, host name, pid, and the CPU ids the
    calling thread may run on (``cpus``: ``os.sched_getaffinity``, Linux; ``None`` elsewhere)."""
    import ray

    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": node_ip(),
            "hostname": socket.gethostname(), "pid": os.getpid(), "cpus": cpus}

def _where_actor(instance) -> dict[str, Any]:  # run inside an actor by ``__ray_call__``
    return where()


class Cluster:
    """The Ray cluster one run uses (``Cluster.start``); ``close`` releases what the run took.

    Attributes:
        started: whether this run started Ray itself (then ``close`` shuts it down).
        address: the cluster joined (``None`` when started here).
        bind_host: the address every socket of the pipeline binds and announces.
        driver: ``where()`` of the trainer process.
        placed: ``{role: [where() + bundle, ...]}`` of every placed actor.
    """

    def __init__(self, started: bool, address: str | None, bind_host: str) -> None:
        self.started, self.address, self.bind_host = started, address, bind_host
        self.driver = where()
        self.placed: dict[str, list[dict[str, Any]]] = {}
        self._groups: list = []
        self._strategies: dict[str, list] = {}
        self.placement_timeout_s = PLACEMENT_TIMEOUT_S
        self._saved_env: dict[str, str | None] = {}

    @classmethod
    def start(cls, cfg) -> "Cluster":
        """The cluster of a run's ``Config``: join ``ray_address(cfg.trainer)``, or start a
        single-node Ray with enough logical CPUs for its actors (``ray_cpus_needed``, at least
        the machine's cores and 2), bound to ``trainer.bind_host`` or loopback.

        Raises:
            ValueError, ClusterUnreachable: see ``connect``.
        """
        cluster = cls.connect(ray_address(cfg.trainer), cfg.trainer.bind_host,
                              max(2, os.cpu_count() or 1, ray_cpus_needed(cfg)))
        cluster.placement_timeout_s = cfg.trainer.placement_timeout_s
        return cluster

    @classmethod
    def connect(cls, address: str | None, bind_host: str | None = None, num_cpus: int | None = None) -> "Cluster":
        """Join the Ray cluster at ``address``, or (``None``) start one on this machine with
        ``num_cpus`` logical CPUs; an already initialised Ray in this process is used as it is.

        Args:
            address: ``auto``, ``host:port``, or ``None``.
            bind_host: the address sockets bind (``trainer.bind_host``); ``None`` = loopback on a
                single-node Ray (started here or not), else this node's IP.
            num_cpus: logical CPUs of a Ray started here (default: the machine's cores, at least 2).

        Raises:
            ValueError: ``bind_host`` is a wildcard (others cannot dial it), or a ``ray://``
                client address (the driver must run on a node: the pipeline's sockets bind on it).
            ClusterUnreachable: the cluster cannot be joined (Ray's reason, in one line).
        """
        import ray

        if address and address.startswith("ray://"):
            raise ValueError(f"trainer.ray_address={address}: Ray Client addresses are not supported; run the trainer "
                             "on a node of the cluster and give the GCS address (host:port, or auto)")
        if bind_host in ("0.0.0.0", "*", "::"):
            raise ValueError(f"trainer.bind_host={bind_host} is a wildcard other nodes cannot dial: "
                             "give this node's address")
        started = False
        if not ray.is_initialized():
            if address:
                try:
                    ray.init(address=address, log_to_driver=True, configure_logging=False)
                except ConnectionError as e:
                    raise ClusterUnreachable(
                        f"cannot join the Ray cluster at {address} (trainer.ray_address / RAY_ADDRESS): "
                        f"{str(e).splitlines()[0]}; is `ray start` running there, and does this machine hold the "
                        "cluster's token (~/.ray/auth_token or RAY_AUTH_TOKEN)?") from None
            else:
                ray.init(num_cpus=num_cpus or max(2, os.cpu_count() or 1), include_dashboard=False,
                         log_to_driver=True, _node_ip_address=bind_host or LOOPBACK, configure_logging=False)
                started = True
        # One node (a Ray started here, or a single-node one): nothing needs more than loopback.
        alive = [n for n in ray.nodes() if n.get("Alive")]
        single = len(alive) == 1 and alive[0]["NodeID"] == ray.get_runtime_context().get_node_id()
        host = bind_host or (LOOPBACK if started or single else node_ip())
        saved = {k: os.environ.get(k) for k in _IFNAME_VARS}
        use_node_interface(host)
        cluster = cls(started, address, host)
        cluster._saved_env = saved
        if not is_loopback(host):
            logger.warning("the pipeline's sockets (trajectory receiver, weight-sync store and group, learner "
                           "rendezvous) listen on %s: reachable from that network, not only from this machine", host)
        else:
            # The user's interface is kept (use_node_interface): say that gloo then listens beyond
            # loopback, as the run says for a non-loopback bind_host.
            gloo = os.environ.get("GLOO_SOCKET_IFNAME")
            if gloo and any(part != interface_of(LOOPBACK) for part in gloo.split(",")):
                logger.warning("GLOO_SOCKET_IFNAME=%s: the run's gloo groups (learner ranks, weight broadcast) listen "
                               "on that interface: reachable from that network, not only from this machine (unset it "
                               "to keep a single-node run on loopback)", gloo)
        return cluster

    def place(self, role: str, n: int, placement: PlacementConfig, cuda: bool = False) -> list:
        """Reserve ``n`` bundles for ``role`` in one placement group and wait until they are; a
        second call for the same role returns the first reservation (the trainer reserves the
        generators' bundles before its warm start, so a cluster that cannot hold them fails in
        seconds, and the pool takes them later).

        Returns:
            ``n`` Ray scheduling strategies, one per actor, for ``.options(scheduling_strategy=...)``.

        Raises:
            PlacementError: the cluster did not offer the bundles within ``placement_timeout_s``
                (what was asked; the CPUs, GPUs and labels of each node).
        """
        import ray
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if role in self._strategies:
            return self._strategies[role]
        bundle = placement.bundle(cuda)
        strategy = placement.strategy
        labels = dict(placement.node_labels)
        # Only with labels: Ray releases without label selectors still place the rest.
        pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy,
                             **({"bundle_label_selector": [dict(labels) for _ in range(n)]} if labels else {}))
        ready, _ = ray.wait([pg.ready()], timeout=self.placement_timeout_s)
        if not ready:
            remove_placement_group(pg)
            nodes = "; ".join(
                f"{nd['NodeManagerAddress']}: {nd['Resources'].get('CPU', 0):g} CPU, {nd['Resources'].get('GPU', 0):g} GPU"
                f", labels {{{', '.join(f'{k}: {v}' for k, v in nd.get('Labels', {}).items() if not k.startswith('ray.io/'))}}}"
                for nd in self._nodes())
            noun = {"generators": "generator actor", "learner": "learner rank"}.get(role, f"{role} actor")
            raise PlacementError(
                f"cannot place {n} {noun}(s) of {bundle} each ({strategy}"
                f"{', node labels ' + str(labels) if labels else ''}) within {self.placement_timeout_s:g} s "
                f"(trainer.placement_timeout_s); "
                f"the cluster's nodes (total resources): {nodes}")
        self._groups.append(pg)
        table = placement_group_table(pg).get("bundles_to_node_id", {})
        ips = {nd["NodeID"]: nd["NodeManagerAddress"] for nd in self._nodes()}
        self.placed[role] = [{"bundle": bundle, "strategy": strategy, "node_labels": labels,
                              "node_id": table.get(i), "node_ip": ips.get(table.get(i))} for i in range(n)]
        self._strategies[role] = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                                  for i in range(n)]
        return self._strategies[role]

    def record(self, role: str, actors: list) -> list[dict[str, Any]]:
        """Ask each of ``role``'s actors where it runs (node, IP, pid) and keep it; returns the
        entries. Actors placed without ``place`` are recorded too (their bundle is empty)."""
        import ray

        spots = ray.get([a.__ray_call__.remote(_where_actor) for a in actors])
        entries = self.placed.setdefault(role, [{} for _ in actors])
        for entry, spot in zip(entries, spots):
            entry.update(spot)
        return entries

    def record_replacement(self, role: str, index: int, actor, incarnation: int) -> dict[str, Any]:
        """Record where the actor that replaced ``role``'s actor ``index`` runs, as its
        ``incarnation`` (replacements so far at that index); returns its entry."""
        import ray

        entry = self.placed[role][index]
        entry.update(ray.get(actor.__ray_call__.remote(_where_actor)))
        entry["incarnation"] = incarnation
        return entry

    def check_reachable(self, role: str, entries: list[dict[str, Any]]) -> None:
        """Refuse a loopback ``bind_host`` when any of ``role``'s recorded actors runs on another
        node: it would dial its own loopback and wait out a timeout.

        Raises:
            ValueError: one line naming the actor, its node and the key to set.
        """
        if not is_loopback(self.bind_host):
            return
        for i, entry in enumerate(entries):
            if not self.on_driver_node(entry):
                raise ValueError(f"{role} actor {i} runs on node {entry.get('node_ip')}, but the run's sockets bind "
                                 f"{self.bind_host} (trainer.bind_host), which other nodes cannot reach: unset "
                                 "trainer.bind_host or give an address of this node")

    def on_driver_node(self, entry: dict[str, Any]) -> bool:
        """Whether a recorded actor runs on the trainer's node (same host: shared memory reaches it)."""
        return entry.get("node_id") == self.driver["node_id"]

    def describe(self) -> list[str]:
        """One line per role: which node (IP) each actor landed on."""
        lines = [f"ray: {'joined ' + self.address if self.address else 'started on this machine'}, "
                 f"{len(self._nodes())} node(s); sockets bind {self.bind_host}; trainer on {self.driver['node_ip']}"]
        for role, entries in self.placed.items():
            spots = ", ".join(f"{i}@{e.get('node_ip', '?')}" for i, e in enumerate(entries))
            lines.append(f"placement: {role} {spots}")
        return lines

    def _nodes(self) -> list[dict[str, Any]]:
        import ray

        return [n for n in ray.nodes() if n.get("Alive")]

    def save(self, run_dir: Path) -> Path:
        """Write ``placement.json`` (the cluster, the trainer, every placed actor) to ``run_dir``."""
        path = Path(run_dir) / "placement.json"
        nodes = [{"node_id": n["NodeID"], "node_ip": n["NodeManagerAddress"], "resources": n.get("Resources", {}),
                  "labels": n.get("Labels", {})} for n in self._nodes()]
        path.write_text(json.dumps({"ray_address": self.address, "started_here": self.started,
                                    "bind_host": self.bind_host, "nodes": nodes, "trainer": self.driver,
                                    "actors": self.placed}, indent=2))
        return path

    def release(self) -> None:
        """Remove the placement groups this run made (their actors go with them)."""
        from ray.util.placement_group import remove_placement_group

        groups, self._groups = self._groups, []
        self._strategies.clear()
        for pg in groups:
            try:
                remove_placement_group(pg)
            except Exception as e:  # noqa: BLE001 - Ray already gone: nothing is held
                logger.debug("placement group removal: %s", e)

    def close(self) -> None:
        """Release the placement groups; shut Ray down if this run started it; give this process
        back the interface variables ``connect`` found (a later run in it chooses afresh). Safe to
        call twice."""
        import ray

        saved, self._saved_env = self._saved_env, {}
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not ray.is_initialized():
            return
        self.release()
        if self.started:
            ray.shutdown()
