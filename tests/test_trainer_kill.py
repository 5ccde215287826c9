"""Every way an async run's trainer process ends (a normal end, an error, SIGTERM, SIGINT, a
second SIGINT, SIGKILL) leaves nothing of the run behind: no process, no listening socket, no
shared-memory file; and after SIGKILL ``trainer.resume=auto`` finishes the run from its last
checkpoint with the ledger still adding up."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline_helpers import ROOT, small_run


def _children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            out.setdefault(ppid, []).append(int(entry))
    return out


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` now (Ray's workers start their own sessions, so the process
    tree, not the process group, finds them)."""
    children, found, todo = _children(), set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie waits for its parent (here pid 1) to reap it: it holds nothing
            alive.add(pid)
    return alive


def _last_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max([json.loads(l)["step"] for l in lines if l.endswith("}")] or [-1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _shm_of(pid: int) -> list[str]:
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"async-rl-{pid}-")] if os.path.isdir("/dev/shm") else []


@pytest.mark.slow
def test_sigkilled_async_trainer_leaves_nothing_and_resumes_from_its_checkpoint(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["OMP_NUM_THREADS"] = "1"
    args = small_run(tmp_path, "killed", "trainer.mode=async", "trainer.total_steps=6",
                     "trainer.checkpoint.every_steps=2", "logging.console_every_steps=1")
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", str(ROOT / "configs/default.yaml"), *args]
    log = tmp_path / "first.log"
    with open(log, "w") as out:
        trainer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    run_dir = tmp_path / "killed"
    try:
        deadline = time.monotonic() + 600
        while _last_step(run_dir) < 3:
            assert trainer.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 3"
            time.sleep(0.2)
        procs = _descendants(trainer.pid)
        text = log.read_text()
        ports = [int(p) for p in re.findall(r"(?:store [\d.]+:|trajectories on tcp://[\d.]+:)(\d+)", text)]
        assert len(ports) == 2, text[-2000:]
        assert procs and all(_listening(p) for p in ports)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    _assert_nothing_left(procs, ports, trainer.pid)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    complete = [c for c in checkpoints if not c.endswith(".tmp")]
    # A SIGKILL during a save (no handler runs) leaves that save's .tmp: never the latest.
    assert complete and (run_dir / "checkpoints/latest").read_text() == complete[-1], checkpoints
    saved = int(complete[-1].split("_")[1])
    assert saved in (2, 4)

    resumed = subprocess.run([*cmd, "trainer.resume=auto"], capture_output=True, text=True, env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == 6
    assert summary["pipeline/trained"] == 6 * 4
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] == 0
    # The resumed run appended its steps, from the one after the checkpoint to the last.
    steps = [json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert set(range(saved + 1, 7)) <= set(steps) and steps[-1] == 6
    assert not list((run_dir / "checkpoints").glob("*.tmp"))  # the continuing run removed any


def _default_sigint() -> None:
    # The trainer must see SIGINT as a user's Ctrl-C would reach it, however pytest was started:
    # under `nohup ... &` from a script SIGINT is inherited as ignored, and the trainer leaves it so.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _assert_nothing_left(procs: set[int], ports: list[int], trainer_pid: int) -> None:
    """No process of the run, no listening socket of it, no shared-memory file of its trainer.
    Ray's own processes go when they find the driver gone: its agents poll their raylet, so they
    get up to three minutes."""
    deadline = time.monotonic() + 180
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(1.0)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid in _alive(procs) if Path(f"/proc/{pid}").exists()}
    assert not left, f"processes of the run still alive: {left}"
    assert not [p for p in ports if _listening(p)], "a socket of the run still listens"
    assert _shm_of(trainer_pid) == []


FAILING_REWARD = """
def reward(data_source, response_text, ground_truth, extra_info):
    # Held-out prompts score; every training sample fails, so the run stops with this error at
    # its first step, with its generator pool up (a reward failing on every call is a bug).
    if extra_info["split"] == "train":
        raise RuntimeError("the reward service is down")
    return 0.0
"""


@pytest.mark.slow
@pytest.mark.parametrize("ending", ["normal", "error", "SIGTERM", "SIGINT twice"])
def test_every_exit_path_leaves_nothing_behind(tmp_path, ending):
    """The trainer of an async run (2 generator actors, shm weight sync) ends normally, with an
    error (its reward fails on every training call), on SIGTERM or on two SIGINTs in
    a row (the second stops it at once): each time its processes, sockets and shared-memory files
    are gone afterwards, and the exit status says how it ended."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env["OMP_NUM_THREADS"] = "1"
    reward_file = tmp_path / "reward.py"
    reward_file.write_text(FAILING_REWARD)
    extra = [f"reward.fn={reward_file}:reward"] if ending == "error" else []
    args = small_run(tmp_path, "ends", "trainer.mode=async", "trainer.total_steps=8", "logging.console_every_steps=1",
                     *extra)
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", str(ROOT / "configs/default.yaml"), *args]
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        trainer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   preexec_fn=_default_sigint)
    run_dir = tmp_path / "ends"
    procs: set[int] = set()
    ports: list[int] = []
    try:
        deadline = time.monotonic() + 600
        # Watch the run until its pool is up (both ports logged), collecting its processes.
        while len(ports) < 2 and trainer.poll() is None:
            assert time.monotonic() < deadline, "the run never started its pool"
            procs |= _descendants(trainer.pid)
            ports = [int(p) for p in re.findall(r"(?:store [\d.]+:|trajectories on tcp://[\d.]+:)(\d+)",
                                                log.read_text())]
            time.sleep(0.2)
        assert len(ports) == 2, log.read_text()[-3000:]
        if ending in ("SIGTERM", "SIGINT twice"):
            while _last_step(run_dir) < 2:
                assert trainer.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "the run never reached step 2"
                procs |= _descendants(trainer.pid)
                time.sleep(0.2)
            procs |= _descendants(trainer.pid)
            if ending == "SIGTERM":
                os.kill(trainer.pid, signal.SIGTERM)
            else:
                os.kill(trainer.pid, signal.SIGINT)
                time.sleep(0.5)
                os.kill(trainer.pid, signal.SIGINT)
        else:
            while trainer.poll() is None and time.monotonic() < deadline:
                procs |= _descendants(trainer.pid)
                time.sleep(0.5)
        status = trainer.wait(timeout=300)
    finally:
        if trainer.poll() is None:
            trainer.kill()
    text = log.read_text()
    expected = {"normal": 0, "error": 1, "SIGTERM": 128 + signal.SIGTERM, "SIGINT twice": 128 + signal.SIGINT}[ending]
    assert status == expected, text[-3000:]
    if ending == "error":
        assert "the reward service is down" in text
    assert procs, "no process of the run was seen"
    _assert_nothing_left(procs, ports, trainer.pid)


@pytest.mark.slow
def test_a_run_that_fails_while_being_built_leaves_no_ray_behind(tmp_path, monkeypatch):
    """An error after the run started its Ray instance (here: the metrics logger) but before it
    began: the instance is shut down with it, so this process can start another."""
    ray = pytest.importorskip("ray")
    import async_rl.trainer as trainer
    from pipeline_helpers import small_run_cfg

    def broken_logger(*args, **kwargs):
        raise ValueError("logging.wandb: cannot reach the server")

    monkeypatch.setattr(trainer, "MetricsLogger", broken_logger)
    assert not ray.is_initialized()
    with pytest.raises(ValueError, match="cannot reach the server"):
        trainer.train(small_run_cfg(tmp_path, "broken", "trainer.mode=async"))
    assert not ray.is_initialized()
    assert not (tmp_path / "broken").exists()  # and no run directory
