"""The pipeline on a two-node Ray cluster (issue 17), the second node in its own network
namespace so that nothing reaches the first node's loopback (``tests/netns_cluster.py``).

One async run with a generator actor pinned to each node (``STRICT_SPREAD``) checks that both
nodes' trajectories are trained, that the local engine gets weights over shared memory and the
remote one by broadcast, that both engines end with exactly the learner's weights (their greedy
probe equals a fresh engine built from the exported model), and that nothing of the run is left
once it exits. A second run puts learner rank 1 on the second node and must give the first run's
losses (``max_staleness=0``: both runs train on the same samples).

Needs root and iproute2 (CI has both); skipped elsewhere with the reason.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns_cluster import TwoNodeCluster, available, run_processes, shm_files, wait_run_processes_gone  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(available() is not None, reason=str(available()))]

STEPS = 3


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with TwoNodeCluster(tmp_path_factory.mktemp("ray-cluster")) as c:
        yield c


def _train(cluster: TwoNodeCluster, out: Path, name: str, *extra: str) -> tuple[subprocess.CompletedProcess, Path]:
    cmd = [str(Path(sys.executable).with_name("async-rl")), "train", "--config", str(ROOT / "configs/default.yaml"),
           f"trainer.output_dir={out}", f"trainer.run_name={name}", "trainer.mode=async", "trainer.max_staleness=0",
           f"trainer.total_steps={STEPS}", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4",
           "trainer.eval_every_steps=0", "trainer.warm_start.steps=30", "trainer.warm_start.batch_size=16",
           "data.val_max_prompts=8", "logging.progress=false", "generator.max_batch_size=8",
           "generator.num_workers=2", "generator.placement_strategy=STRICT_SPREAD",
           "weight_sync.bucket_size_mb=0.5", "weight_sync.probe_at_exit=true", *extra]
    env = dict(cluster.env, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc, out / name


def _steps(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m["step"] >= 1 and "loss/pg" in m]


@pytest.fixture(scope="module")
def one_rank_run(cluster, tmp_path_factory):
    before = shm_files()
    proc, run_dir = _train(cluster, tmp_path_factory.mktemp("runs"), "two-nodes")
    wait_run_processes_gone(cluster.pids)  # Ray kills a finished driver's actors asynchronously
    return proc, run_dir, run_processes(cluster.pids), sorted(shm_files() - before)


def test_the_second_node_cannot_reach_the_heads_loopback(cluster):
    # What makes the tests below able to fail: a socket bound to 127.0.0.1 here is not reachable
    # from the second node, one bound to the head's address is.
    for host, reachable in (("127.0.0.1", False), (cluster.head_ip, True)):
        with socket.socket() as server:
            server.bind((host, 0))
            server.listen()
            code = (f"import socket\ntry:\n socket.create_connection(('{host}', {server.getsockname()[1]}), "
                    f"timeout=3)\n print('ok')\nexcept OSError as e:\n print('refused', e)")
            out = subprocess.run(["ip", "netns", "exec", cluster.ns, sys.executable, "-c", code],
                                 capture_output=True, text=True, timeout=60).stdout
            assert out.startswith("ok" if reachable else "refused"), (host, out)


def test_async_run_trains_both_nodes_trajectories_with_shm_and_broadcast(cluster, one_rank_run):
    proc, run_dir, _, _ = one_rank_run
    placement = json.loads((run_dir / "placement.json").read_text())
    assert {n["node_ip"] for n in placement["nodes"]} == {cluster.head_ip, cluster.node_ip}
    assert placement["bind_host"] == cluster.head_ip and placement["trainer"]["node_ip"] == cluster.head_ip
    gens = placement["actors"]["generators"]
    assert sorted(g["node_ip"] for g in gens) == sorted([cluster.head_ip, cluster.node_ip])
    for g in gens:  # shared memory on the trainer's node, broadcast to the other
        assert g["weight_transport"] == ("shm" if g["node_ip"] == cluster.head_ip else "broadcast"), g
    summary = json.loads((run_dir / "summary.json").read_text())
    trained = [summary[f"generator_{i}/trained_samples"] for i in range(2)]
    assert all(n > 0 for n in trained) and sum(trained) == STEPS * 4 * 4, trained
    steps = _steps(run_dir)
    assert [s["policy/version"] for s in steps] == list(range(1, STEPS + 1))
    assert all(s["weight_sync/bytes"] > 0 for s in steps)
    assert f"trajectories on tcp://{cluster.head_ip}:" in proc.stdout + proc.stderr


def test_both_engines_hold_exactly_the_learners_weights(one_rank_run):
    # Each actor's engine, after every update of the run, greedily decodes like an engine built
    # fresh from the exported final model (the same weights, loaded from disk).
    from transformers import AutoTokenizer

    from async_rl.generators import make_generator
    from async_rl.generators.base import GeneratorConfig, SamplingParams

    _, run_dir, _, _ = one_rank_run
    probe = json.loads((run_dir / "engine_probe.json").read_text())
    model = str(run_dir / "final_model")
    tok = AutoTokenizer.from_pretrained(model)
    fresh = make_generator(GeneratorConfig(backend="hf", max_batch_size=8), model, tok.pad_token_id)
    params = SamplingParams(max_tokens=probe["max_tokens"], greedy=True, stop_token_ids=(tok.eos_token_id,))
    rows = fresh.generate(probe["prompts"], 1, params, seeds=[0] * len(probe["prompts"]))
    assert len(probe["actors"]) == 2
    for actor in probe["actors"]:
        assert actor["policy_version"] == STEPS
        assert actor["response_ids"] == [r[0].response_ids for r in rows], actor["node_ip"]
        for got, want in zip(actor["logprobs"], [r[0].logprobs for r in rows]):
            assert got == pytest.approx(want, abs=1e-5), actor["node_ip"]


def test_nothing_of_the_run_is_left(one_rank_run):
    proc, run_dir, processes, new_shm = one_rank_run
    assert processes == []
    # /dev/shm is machine-wide: count what a run of ours names (weight-sync slots carry the
    # trainer's pid; torch's and the engines' segments), not the sem.mp-* files any Python
    # multiprocessing user beside the test may be creating meanwhile.
    assert [f for f in new_shm if f.startswith(("async-rl-", "torch_", "vllm", "sglang"))] == []
    actors = [a for role in json.loads((run_dir / "placement.json").read_text())["actors"].values() for a in role]
    assert len(actors) == 2 and not [a["pid"] for a in actors if Path(f"/proc/{a['pid']}").exists()]
    # The sockets it bound on the head's address (trajectory receiver, weight store) are closed.
    log = proc.stdout + proc.stderr
    bound = re.findall(r"trajectories on tcp://([\d.]+):(\d+)", log) + re.findall(r"\(store ([\d.]+):(\d+)\)", log)
    assert len(bound) == 2, log[-2000:]
    for host, port in bound:
        with pytest.raises(OSError):
            socket.create_connection((host, int(port)), timeout=3).close()


def test_learner_rank_on_the_second_node_gives_the_one_rank_loss(cluster, one_rank_run, tmp_path):
    _, one_dir, _, _ = one_rank_run
    _, two_dir = _train(cluster, tmp_path, "two-ranks", "learner.world_size=2", "learner.node_labels={node: second}")
    learner = json.loads((two_dir / "placement.json").read_text())["actors"]["learner"]
    assert [r["node_ip"] for r in learner] == [cluster.node_ip]
    one, two = _steps(one_dir), _steps(two_dir)
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two):
        assert b["rollout/reward_mean"] == a["rollout/reward_mean"]
        assert b["loss/pg"] == pytest.approx(a["loss/pg"], abs=1e-5)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3)


def _refused(cluster: TwoNodeCluster, out: Path, *extra: str) -> str:
    """The one ``async-rl:`` line a run that must stop before training prints (no traceback)."""
    cmd = [str(Path(sys.executable).with_name("async-rl")), "train", "--config", str(ROOT / "configs/default.yaml"),
           f"trainer.output_dir={out}", "trainer.run_name=refused", "trainer.mode=async", "trainer.total_steps=1",
           "trainer.warm_start.steps=0", "data.val_files=[]", "logging.progress=false",
           "generator.num_workers=2",  # one per node (the driver's 2 cores alone would give 1)
           *extra]
    proc = subprocess.run(cmd, env=dict(cluster.env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("async-rl: ")]
    assert proc.returncode != 0 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert not (out / "refused").exists()  # nothing trained: no run directory left
    return lines[0]


def test_a_loopback_bind_host_on_a_cluster_is_refused_in_one_line(cluster, tmp_path):
    # The hard-coded loopback of before, chosen on purpose: the remote actor would dial its own
    # 127.0.0.1 and wait out the weight store's timeout; the run stops at placement instead.
    line = _refused(cluster, tmp_path, "generator.placement_strategy=STRICT_SPREAD", "trainer.bind_host=127.0.0.1")
    assert f"runs on node {cluster.node_ip}, but the run's sockets bind 127.0.0.1" in line


def test_a_role_the_cluster_cannot_place_stops_in_one_line_naming_each_nodes_labels(cluster, tmp_path):
    line = _refused(cluster, tmp_path, "generator.node_labels={node: nowhere}", "trainer.placement_timeout_s=5")
    assert "cannot place 2 generator actor(s)" in line and "node labels {'node': 'nowhere'}" in line
    assert f"{cluster.node_ip}: 2 CPU, 0 GPU, labels {{node: second}}" in line, line
