"""Security of a run: what listens where, what is unpickled, where secrets go.

* Every TCP socket a single-node run opens itself listens on loopback (measured on a real async
  run with 2 generator actors and 2 learner ranks); Ray's own (its daemons, and the core worker
  server in every Ray process) listen on every interface, which Ray offers no option against.
* The learner ranks' command broadcast and metric gathers are msgpack (``async_rl.learners.wire``):
  a follower serves a whole call with ``pickle`` unable to load anything.
* A WANDB_API_KEY and an HF_TOKEN appear nowhere the run writes: run directory (config, logs,
  metrics, checkpoints, W&B offline files), console, Ray's logs; a secret-looking config value
  (the schema has none of its own: a free-form ``node_labels`` entry) is ``***`` in the saved config.
* A vLLM engine's IPC socket directory left by a killed process is swept by the next start.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
import threading
import time
from pathlib import Path

import pytest
import torch

from async_rl.buffers.trajectory import TrainBatch
from async_rl.learners import wire

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    return TrainBatch(
        input_ids=torch.randint(0, 100, (3, 5), generator=g), attention_mask=torch.ones(3, 5, dtype=torch.long),
        position_ids=torch.arange(5).expand(3, 5), loss_mask=torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 1, 0.]]),
        behavior_logprobs=-torch.rand(3, 4, generator=g), advantages=torch.randn(3, 4, generator=g)[:, [3, 1, 0, 2]],
        rewards=torch.tensor([1.0, 0.0, 0.5]), group_ids=torch.tensor([7, 7, 8]),
        extras={"ref_logprobs": torch.randn(3, 4, generator=g).bfloat16(), "values": torch.empty(3, 0),
                "is_tool": torch.tensor([True, False, True])})


def _same_batch(a: TrainBatch, b: TrainBatch) -> bool:
    for f in dataclasses.fields(TrainBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        pairs = [(x[k], y[k]) for k in x] if isinstance(x, dict) else [(x, y)]
        if isinstance(x, dict) and set(x) != set(y):
            return False
        if not all(u.dtype == v.dtype and u.shape == v.shape and torch.equal(u, v) for u, v in pairs):
            return False
    return True


def test_learner_wire_round_trips_every_train_batch_field_without_pickle(monkeypatch):
    batch = _batch()
    call = ["train_step", {"batch": batch, "lr": 3e-4, "path": "ckpt/x", "none": None, "shape": (2, (3, "a")),
                           "flags": [True, False], "meta": {"k": b"\x00\x01"}}]
    data = wire.pack(call)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    monkeypatch.setattr(pickle, "Unpickler", None)
    name, args = wire.unpack(data)
    assert name == "train_step" and _same_batch(args.pop("batch"), batch)
    assert args == {"lr": 3e-4, "path": "ckpt/x", "none": None, "shape": (2, (3, "a")), "flags": [True, False],
                    "meta": {"k": b"\x00\x01"}}
    with pytest.raises(TypeError, match="a object cannot travel"):
        wire.pack({"x": object()})
    # A dtype name is looked up among torch's dtypes, never called or imported.
    with pytest.raises(ValueError, match="unknown tensor dtype 'compile'"):
        wire.unpack(wire.pack(torch.zeros(2)).replace(b"\xa7float32", b"\xa7compile"))


def _spmd_rank(rank: int, init_file: str, out: str) -> None:
    """One rank of ``test_learner_commands_travel_without_pickle`` (spawned)."""
    import json

    import torch.distributed as dist

    from async_rl.learners import spmd

    class Toy:
        _drives_followers, _command_depth = False, 0

        def __init__(self):
            self.calls = []

        @spmd.collective
        def step(self, batch, lr: float, names=("a",)):
            self.calls.append(["step", float(batch.advantages.sum()), str(batch.extras["ref_logprobs"].dtype), lr,
                               list(names), wire.all_gather(dist.get_rank())])

        @spmd.collective(local=("tokenizer",))
        def export(self, path: str, tokenizer=None):
            self.calls.append(["export", path, tokenizer is None])

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    toy = Toy()
    if rank == 0:
        spmd.drive_followers(toy)
        toy.step(_batch(), 0.5, names=("x", "y"))
        toy.export("out/dir", object())  # the tokenizer stays here: it cannot be sent
        spmd.stop_followers(toy)
    else:
        def refuse(*args, **kwargs):
            raise AssertionError("a follower unpickled what rank 0 sent")

        pickle.loads = pickle.load = refuse
        pickle.Unpickler = refuse
        dist.distributed_c10d._unpickler = refuse
        served = spmd.serve_commands(toy)
        Path(out).write_text(json.dumps({"served": served, "calls": toy.calls}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_learner_commands_travel_without_pickle(tmp_path):
    import json

    import torch.multiprocessing as mp

    from async_rl.learners import spmd

    assert "broadcast_object_list" not in Path(spmd.__file__).read_text()
    out = tmp_path / "follower.json"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_spmd_rank, args=(r, str(tmp_path / "init"), str(out))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    got = json.loads(out.read_text())
    assert got["served"] == 2
    assert got["calls"] == [["step", pytest.approx(float(_batch().advantages.sum())), "torch.bfloat16", 0.5, ["x", "y"],
                             [0, 1]],
                            ["export", "out/dir", True]]


def test_tcp_store_listens_on_its_host_only():
    psutil = pytest.importorskip("psutil")
    import datetime

    import torch.distributed as dist

    from async_rl.runtime.cluster import tcp_store

    store = tcp_store("127.0.0.1", 2, datetime.timedelta(seconds=30))
    listening = {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == store.port}
    assert listening == {("127.0.0.1", store.port)}
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, timeout=datetime.timedelta(seconds=30))
    client.set("k", "v")
    assert store.get("k") == b"v"
    with pytest.raises(OSError):
        tcp_store("192.0.2.250", 2, datetime.timedelta(seconds=30))  # TEST-NET: no address of this host


def test_config_secrets_are_redacted_and_their_look_alikes_kept(tmp_path):
    from async_rl.config import REDACTED, is_secret_key, load_config, redact, to_dict, to_yaml

    for key in ("WANDB_API_KEY", "HF_TOKEN", "apikey", "token", "client_secret", "DB_PASSWORD", "aws_credentials"):
        assert is_secret_key(key), key
    for key in ("max_prompt_tokens", "judge_token", "tokenizer_path", "pad_token_id", "num_tokens"):
        assert not is_secret_key(key), key
    assert redact({"a": [{"hf_token": "hf_x", "n_token": ""}], "api_key": None, "b": 1}) == \
        {"a": [{"hf_token": REDACTED, "n_token": ""}], "api_key": None, "b": 1}
    secret = secrets.token_hex(12)
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs/default.yaml",
                      [f"learner.node_labels.vault_token={secret}", "learner.node_labels.zone=a"])
    assert cfg.learner.node_labels["vault_token"] == secret  # the run itself still has it
    text = to_yaml(cfg)
    assert secret not in text and "vault_token: '***'" in text and "zone: a" in text
    assert to_dict(cfg)["learner"]["node_labels"] == {"vault_token": REDACTED, "zone": "a"}


def test_vllm_socket_dirs_of_killed_processes_are_swept(tmp_path):
    import subprocess
    import sys

    from async_rl.generators.vllm.process import SOCKET_DIR_PREFIX, sweep_socket_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    old = time.time() - 3600
    made = {}
    for name, pid, age in (("dead_old", dead_pid, old), ("dead_young", dead_pid, time.time()),
                           ("alive_old", os.getpid(), old)):
        d = tmp_path / f"{SOCKET_DIR_PREFIX}{pid}-{name}"
        d.mkdir()
        (d / "3814bd88-70c1-4ad4-a455-7f718eee51de").write_text("")
        os.utime(d, (age, age))
        made[name] = d
    other = tmp_path / "async-rl-vllm-notapid"
    other.mkdir()
    os.utime(other, (old, old))
    assert sweep_socket_dirs(str(tmp_path)) == [str(made["dead_old"])]
    assert not made["dead_old"].exists() and made["dead_young"].exists() and made["alive_old"].exists()
    assert other.exists()


RAY_DAEMONS = ("gcs_server", "raylet", "monitor.py", "log_monitor.py", "RuntimeEnvAgent", "DashboardAgent",
               "dashboard")
"""Processes of Ray's own (their command line holds one of these)."""

WILDCARDS = ("::", "0.0.0.0")


def _listening_sockets(root: int) -> dict[tuple[str, int], tuple[int, str]]:
    """``{(ip, port): (pid, command line)}`` of every listening TCP socket of ``root`` and its
    descendants."""
    import psutil

    try:
        procs = [psutil.Process(root)] + psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            name = " ".join(p.cmdline()[:3])[:160] or p.name()
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN:
                    out[(c.laddr.ip, c.laddr.port)] = (p.pid, name)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def _not_ours_to_bind(seen: dict[tuple[str, int], tuple[int, str]]) -> dict:
    """The listening sockets beyond loopback that are not Ray's: every socket of a Ray daemon is
    Ray's, and so is one wildcard socket per other process (Ray's core worker gRPC server, in
    the trainer and in every actor); anything else beyond loopback was opened by the run."""
    wild_per_pid: dict[int, int] = {}
    bad = {}
    for (ip, port), (pid, name) in sorted(seen.items()):
        if ip in LOOPBACK or any(d in name for d in RAY_DAEMONS):
            continue
        if ip in WILDCARDS and wild_per_pid.get(pid, 0) == 0:
            wild_per_pid[pid] = 1
            continue
        bad[(ip, port)] = (pid, name)
    return bad


@pytest.mark.slow
def test_a_single_node_run_listens_on_loopback_only_and_writes_no_secret(tmp_path, capfd, monkeypatch):
    """One real async run (2 generator actors, 2 learner ranks, W&B offline) serves both checks."""
    pytest.importorskip("psutil")
    pytest.importorskip("wandb")
    ray = pytest.importorskip("ray")
    import async_rl.trainer as trainer
    from pipeline_helpers import small_run_cfg

    if ray.is_initialized():  # the run must start (and configure) its own
        ray.shutdown()
    wandb_key, hf_token = secrets.token_hex(20), secrets.token_hex(20)
    monkeypatch.setenv("WANDB_API_KEY", wandb_key)
    monkeypatch.setenv("HF_TOKEN", hf_token)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the defaults are under test
        monkeypatch.delenv(name, raising=False)
    cfg = small_run_cfg(tmp_path, "secure", "trainer.mode=async", "generator.num_workers=2", "learner.world_size=2",
                        "logging.wandb.mode=offline", "trainer.checkpoint.every_steps=2")
    seen: dict[tuple[str, int], str] = {}
    sessions: list[str] = []
    done = threading.Event()
    # What this process already listened on before the run (earlier tests of the session, in this
    # process or its leftover children) is not the run's.
    before = set(_listening_sockets(os.getpid()))

    def watch():
        while not done.is_set():
            seen.update({k: v for k, v in _listening_sockets(os.getpid()).items() if k not in before})
            if not sessions and ray.is_initialized():
                try:
                    sessions.append(ray._private.worker._global_node.get_session_dir_path())
                except AttributeError:
                    pass
            done.wait(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        summary = trainer.train(cfg)
    finally:
        done.set()
        watcher.join(timeout=30)
    assert summary["last_step"] == 3
    out, err = capfd.readouterr()

    # What listened: the trajectory receiver, the weight-sync store, the learner's store, gloo
    # pairs of the learner and of the generators' engines, and Ray (its daemons; its core worker
    # server in every Ray process, which Ray binds on every interface).
    print("listening sockets of the run:", *sorted(seen.items()), sep="\n  ")
    ours = {k: v for k, v in seen.items() if v[0] == os.getpid() and k[0] in LOOPBACK}
    assert len(ours) >= 4, sorted(seen.items())  # receiver, two stores, the learner's gloo pairs
    assert any("raylet" in v[1] for v in seen.values()), sorted(seen.items())
    learner_rank = [k for k, v in seen.items() if "LearnerRank" in v[1] and k[0] in LOOPBACK]
    assert learner_rank, sorted(seen.items())  # rank 1's gloo pairs, on loopback
    bad = _not_ours_to_bind(seen)
    assert not bad, f"sockets of a single-node run listening beyond loopback: {bad}"
    assert "reachable from that network" not in out + err  # said only when it is so

    # No secret anywhere the run wrote.
    run_dir = tmp_path / "secure"
    assert (run_dir / "config.yaml").exists() and list((run_dir / "wandb").glob("offline-run-*"))
    roots = [run_dir, *(Path(s) / "logs" for s in sessions)]
    files = [p for root in roots for p in root.rglob("*") if p.is_file() and not p.is_symlink()]
    assert len(files) > 10
    for value in (wandb_key, hf_token):
        assert value not in out and value not in err
        hits = [str(p) for p in files if value.encode() in p.read_bytes()]
        assert not hits, f"a secret was written to {hits}"


@pytest.mark.slow
def test_a_run_binding_beyond_loopback_says_so_once(caplog):
    ray = pytest.importorskip("ray")
    from async_rl.runtime.cluster import Cluster, interface_addresses

    found = next((a for n, a in interface_addresses().items() if not a.startswith("127.")), None)
    if found is None:
        pytest.skip("no non-loopback IPv4 interface here")
    if ray.is_initialized():
        ray.shutdown()
    saved = {k: os.environ.get(k) for k in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
    with caplog.at_level("WARNING", logger="async_rl.runtime.cluster"):
        cluster = Cluster.connect(None, bind_host=found, num_cpus=1)
        try:
            said = [r.getMessage() for r in caplog.records if "reachable from that network" in r.getMessage()]
            assert len(said) == 1 and f"listen on {found}:" in said[0], said
        finally:
            cluster.close()
    assert {k: os.environ.get(k) for k in saved} == saved  # close gave the interface variables back


@pytest.mark.slow
def test_a_users_gloo_interface_beyond_loopback_is_kept_and_said(caplog, monkeypatch):
    """A single-node run binds loopback, but ``GLOO_SOCKET_IFNAME`` naming another interface is
    the user's choice: kept, and the run says once that its gloo groups listen there."""
    ray = pytest.importorskip("ray")
    from async_rl.runtime.cluster import Cluster, interface_addresses

    found = next((n for n, a in interface_addresses().items() if not a.startswith("127.")), None)
    if found is None:
        pytest.skip("no non-loopback IPv4 interface here")
    if ray.is_initialized():
        ray.shutdown()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", found)
    with caplog.at_level("WARNING", logger="async_rl.runtime.cluster"):
        cluster = Cluster.connect(None, num_cpus=1)
        try:
            assert cluster.bind_host == "127.0.0.1" and os.environ["GLOO_SOCKET_IFNAME"] == found
            said = [r.getMessage() for r in caplog.records if "reachable from that network" in r.getMessage()]
            assert len(said) == 1 and said[0].startswith(f"GLOO_SOCKET_IFNAME={found}:"), said
        finally:
            cluster.close()
