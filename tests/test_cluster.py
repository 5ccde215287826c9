"""``async_rl.runtime.cluster`` without a cluster: placement keys, bind-address rules, the interface gloo
is pointed at, and the engine probe comparison (the two-node runs are in test_multinode.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from async_rl.runtime.cluster import (Cluster, PlacementConfig, check_placement, interface_addresses, interface_of,
                                      ray_address, use_node_interface)
from async_rl.config import load_config
from async_rl.loops.async_loop import probe_difference

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, match", [
    (("generator", "worker", -1.0, 0.0, "SPREAD"), r"generator.num_cpus_per_worker and num_gpus_per_worker must be >= 0"),
    (("learner", "rank", 0.0, 0.0, "PACK"), r"learner.num_cpus_per_rank and num_gpus_per_rank are both 0"),
    (("learner", "rank", 1.0, None, "TIGHT"), r"learner.placement_strategy must be one of"),
])
def test_bad_placement_keys_are_one_clear_line(args, match):
    with pytest.raises(ValueError, match=match) as e:
        check_placement(*args)
    assert "\n" not in str(e.value)


def test_placement_keys_load_from_the_config_and_refuse_bad_values():
    cfg = load_config(ROOT / "configs/default.yaml", [
        "generator.num_gpus_per_worker=1", "generator.node_labels={role: rollout}",
        "generator.placement_strategy=STRICT_SPREAD", "learner.num_cpus_per_rank=2"])
    g = PlacementConfig.of_generators(cfg.generator)
    assert (g.num_cpus, g.num_gpus, g.node_labels, g.strategy) == (1.0, 1.0, {"role": "rollout"}, "STRICT_SPREAD")
    assert PlacementConfig.of_learner(cfg.learner).strategy == "PACK"
    with pytest.raises(ValueError, match="generator.placement_strategy must be one of"):
        load_config(ROOT / "configs/default.yaml", ["generator.placement_strategy=spread_out"])


def test_bundle_defaults_one_gpu_per_learner_rank_only_on_cuda():
    rank = PlacementConfig(num_cpus=1.0, num_gpus=None)
    assert rank.bundle(cuda=False) == {"CPU": 1.0}
    assert rank.bundle(cuda=True) == {"CPU": 1.0, "GPU": 1.0}
    assert PlacementConfig(num_cpus=0.0, num_gpus=2.0).bundle(cuda=True) == {"GPU": 2.0}
    with pytest.raises(ValueError, match="empty bundle"):
        PlacementConfig(num_cpus=0.0, num_gpus=None).bundle(cuda=False)


def test_ray_address_from_config_else_environment(monkeypatch):
    cfg = load_config(ROOT / "configs/default.yaml", [])
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(cfg.trainer) is None
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(cfg.trainer) == "10.0.0.1:6379"
    cfg.trainer.ray_address = "auto"
    assert ray_address(cfg.trainer) == "auto"


@pytest.mark.parametrize("address, bind_host, match", [
    ("ray://head:10001", None, "Ray Client addresses are not supported"),
    (None, "0.0.0.0", "trainer.bind_host=0.0.0.0 is a wildcard"),
])
def test_unusable_addresses_are_refused_before_ray_starts(address, bind_host, match):
    with pytest.raises(ValueError, match=match):
        Cluster.connect(address, bind_host)


def _an_interface_address() -> tuple[str, str] | None:
    return next(((n, a) for n, a in interface_addresses().items() if n != "lo"), None)


def test_interface_of_finds_the_interface_holding_an_address():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.254") is None  # TEST-NET-3: held by no interface here
    if (found := _an_interface_address()) is not None:
        assert interface_of(found[1]) == found[0]


def test_use_node_interface_points_gloo_at_the_node_address_unless_set(monkeypatch):
    # setenv first: monkeypatch undoes a delenv of an absent variable by doing nothing, which
    # once leaked the variables set below into every later test's environment (and from there
    # into the two-node cluster's processes, pointing gloo at an interface the second node lacks).
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    # A single node: gloo listens on loopback, not on what the host name resolves to.
    lo = interface_of("127.0.0.1")
    assert use_node_interface("127.0.0.1") == lo and os.environ["GLOO_SOCKET_IFNAME"] == lo
    found = _an_interface_address()
    if found is None:
        pytest.skip("no non-loopback IPv4 interface here")
    assert use_node_interface(found[1]) == found[0]
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == found[0]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", found[0])  # the user's choice, present here: kept
    assert use_node_interface(found[1]) is None and os.environ["GLOO_SOCKET_IFNAME"] == found[0]
    # ... but not loopback (left by a single-node run in this process): other nodes cannot reach it.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)
    assert use_node_interface(found[1]) == found[0] and os.environ["GLOO_SOCKET_IFNAME"] == found[0]
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", lo)
    assert use_node_interface("127.0.0.1") is None and os.environ["GLOO_SOCKET_IFNAME"] == lo
    # One this host lacks (set for another node of the cluster) would make gloo fail: replaced.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth-elsewhere9")
    assert use_node_interface(found[1]) == found[0] and os.environ["GLOO_SOCKET_IFNAME"] == found[0]


def test_loopback_bind_host_is_refused_for_an_actor_on_another_node():
    cluster = Cluster.__new__(Cluster)
    cluster.bind_host, cluster.driver = "127.0.0.1", {"node_id": "a"}
    cluster.check_reachable("generator", [{"node_id": "a", "node_ip": "127.0.0.1"}])
    with pytest.raises(ValueError, match=r"generator actor 1 runs on node 10.0.0.2, but the run's sockets bind "
                                         r"127.0.0.1 \(trainer.bind_host\)"):
        cluster.check_reachable("generator", [{"node_id": "a"}, {"node_id": "b", "node_ip": "10.0.0.2"}])
    cluster.bind_host = "10.0.0.1"
    cluster.check_reachable("generator", [{"node_id": "b", "node_ip": "10.0.0.2"}])


def test_probe_difference_compares_tokens_and_their_common_prefix():
    ref = {"policy_version": 3, "response_ids": [[1, 2, 3], [4]], "logprobs": [[-0.1, -0.2, -0.3], [-1.0]]}
    same = probe_difference(ref, dict(ref))
    assert same == {"tokens_equal": True, "max_abs_logprob_diff": 0.0, "same_version": True}
    other = {"policy_version": 2, "response_ids": [[1, 2, 9], [4]], "logprobs": [[-0.1, -0.25, -5.0], [-1.5]]}
    diff = probe_difference(ref, other)
    # Token 3 differs: only the common prefix [1, 2] and row 2 count.
    assert diff["tokens_equal"] is False and diff["same_version"] is False
    assert diff["max_abs_logprob_diff"] == pytest.approx(0.5)


def test_loopback_appears_only_as_the_single_node_default():
    # Issue 17: nothing binds or announces 127.0.0.1 except the single-node default, which is
    # named once (cluster.LOOPBACK); the python tool's sandbox checks its own loopback and is the
    # only other place.
    import ast

    offenders = []
    for folder in ("async_rl", "learners", "generators", "buffers"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.relative_to(ROOT).as_posix() == "async_rl/tools/python_exec.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and "127.0.0.1" in node.value:
                    # Docstrings may say what the default is; code may not spell it.
                    if node.value.lstrip().startswith(("tcp://127", "127.0.0.1")) or len(node.value) < 40:
                        offenders.append((path.relative_to(ROOT).as_posix(), node.value[:40]))
    assert offenders == [("async_rl/runtime/cluster.py", "127.0.0.1")], offenders
