"""Checkpoint and resume: a run of 6 steps equals a run of 3 steps stopped by a signal and resumed
for 3 more (per-step losses, final weights), in sync mode bit for bit; the dataset position and
the replay buffer are restored; epoch boundaries; resume resolution and signal handling."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch

from async_rl.runtime.checkpoint import (CheckpointConfig, StopRequest, latest_checkpoint, load_trainer_state,
                                         resolve_resume)
from async_rl.utils.checkpoint_format import save_state
from async_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


PARITY_REWARD = ("def reward(data_source, response_text, ground_truth, extra_info):\n"
                 "    return float(len(response_text) % 2)\n")


def _cfg(tmp_path, name: str, *extra):
    """A 6-step run of the default job cut small. Its reward is the response length's parity,
    which differs within a group whatever the model knows: after a 3-step warm start the addition
    reward scores every sample 0, every advantage is 0, and runs compared step by step would
    compare gradients of rounding noise (loss/pg 0.0 in both, whatever the code does)."""
    reward = Path(tmp_path) / "parity_reward.py"
    reward.parent.mkdir(parents=True, exist_ok=True)
    reward.write_text(PARITY_REWARD)
    return load_config(ROOT / "configs/default.yaml", [
        f"reward.fn={reward}:reward", f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=6",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=3", "trainer.warm_start.batch_size=8", "data.val_max_prompts=8",
        "learner.num_mini_batches=2", "learner.warmup_steps=2", "learner.lr_schedule=cosine",
        "logging.progress=false", *extra])


def _steps(run: Path) -> dict[int, dict]:
    """The last record of each training step in metrics.jsonl (a resumed run appends)."""
    out = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if rec["step"] >= 1 and "loss/pg" in rec:
            out[rec["step"]] = rec
    return out


@pytest.fixture(autouse=True)
def _ctrl_c_not_ignored():
    """Every test here starts with Python's usual SIGINT handler, however the suite was started: under
    `nohup pytest ... &` from a script SIGINT is inherited as ignored, and the trainer then leaves
    it so (by design), so a test that stops a run with SIGINT would never see it stop."""
    original = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, original)


def _interrupt_after(step_to_stop: int, signum=signal.SIGINT):
    """Patch SyncLoop.step to send this process ``signum`` during step ``step_to_stop``."""
    from async_rl.loops.sync import SyncLoop

    original = SyncLoop.step

    def step(self, step):
        out = original(self, step)
        if step == step_to_stop:
            os.kill(os.getpid(), signum)
        return out

    return step


def _weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path).state_dict())


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT])
def test_six_steps_equal_three_plus_three_resumed(tmp_path, monkeypatch, signum):
    from async_rl.loops.sync import SyncLoop
    from async_rl.trainer import train

    full = train(_cfg(tmp_path, "full"))
    assert "interrupted" not in full and full["last_step"] == 6

    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", _interrupt_after(3, signum))
        first = train(_cfg(tmp_path, "split"))
    assert first["interrupted"] == signal.Signals(signum).name and first["last_step"] == 3
    assert not (tmp_path / "split" / "final_model").exists()
    ckpt = latest_checkpoint(tmp_path / "split")
    assert ckpt is not None and ckpt.name == "step_000003"
    state = load_trainer_state(ckpt)
    # 3 steps of 4 prompts: the dataset position and the next group id are where step 4 starts.
    assert state["loop"]["next_group"] == 12 and state["loop"]["dataset"] == {"epoch": 0, "position": 12}
    assert state["elapsed_s"] > 0

    second = train(_cfg(tmp_path, "split", "trainer.resume=auto"))
    assert second["last_step"] == 6 and "interrupted" not in second

    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "split")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert all(0 < a[step]["rollout/reward_mean"] < 1 and a[step]["loss/pg"] != 0 for step in a)
    # The resumed run's clock continues from the checkpoint's, not from 0.
    assert all(b[step]["time_s"] >= state["elapsed_s"] for step in (4, 5, 6))
    for step in range(1, 7):
        for key in ("loss/pg", "actor/grad_norm", "actor/lr", "rollout/reward_mean", "policy/version"):
            assert b[step][key] == a[step][key], (step, key, a[step][key], b[step][key])
    wa, wb = _weights(tmp_path / "full" / "final_model"), _weights(tmp_path / "split" / "final_model")
    for name, w in wa.items():
        assert torch.equal(wb[name], w), name
    assert second["eval_step_0"] == full["eval_step_0"]
    assert second["eval_final"] == full["eval_final"]


@pytest.mark.slow
def test_ppo_with_critic_and_kl_resumes_exactly(tmp_path, monkeypatch):
    """The critic (weights, optimizer, schedule) and the frozen reference policy are restored too."""
    from async_rl.loops.sync import SyncLoop
    from async_rl.trainer import train

    extra = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "trainer.total_steps=4", "trainer.checkpoint.every_steps=2")
    train(_cfg(tmp_path, "full", *extra))
    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", _interrupt_after(2, signal.SIGTERM))
        first = train(_cfg(tmp_path, "split", *extra))
    assert first["interrupted"] == "SIGTERM" and first["last_step"] == 2
    # A checkpoint from before the run's clock was saved still resumes (its clock starts at 0).
    ckpt = latest_checkpoint(tmp_path / "split")
    state = load_trainer_state(ckpt)
    del state["elapsed_s"]
    save_state(ckpt, "trainer_state", state)
    train(_cfg(tmp_path, "split", *extra, "trainer.resume=auto"))
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "split")
    for step in (3, 4):
        for key in ("loss/pg", "critic/vf_loss", "loss/kl", "critic/grad_norm"):
            assert b[step][key] == a[step][key], (step, key)
    assert sorted(p.name for p in (tmp_path / "split" / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]


@pytest.mark.slow
def test_async_resume_restores_buffer_and_reissues_in_flight_groups(tmp_path, monkeypatch):
    """Async mode: the checkpoint holds the replay buffer and the dispatch state; groups in flight
    at the checkpoint are abandoned (counted) and their prompts dispatched again, so the resumed
    run's ledger still adds up and no prompt is skipped."""
    from async_rl.loops.async_loop import AsyncLoop
    from async_rl.trainer import train

    original = AsyncLoop.step

    def step(self, step):
        out = original(self, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    extra = ("trainer.mode=async", "generator.num_workers=1", "trainer.total_steps=4", "trainer.max_staleness=2")
    with monkeypatch.context() as m:
        m.setattr(AsyncLoop, "step", step)
        first = train(_cfg(tmp_path, "run", *extra))
    assert first["interrupted"] == "SIGTERM"
    state = load_trainer_state(latest_checkpoint(tmp_path / "run"))["loop"]
    # With max_staleness 2 the pool runs ahead of the learner: something was dispatched beyond
    # the 8 trained groups, and it is either in the saved buffer or in the re-issue list.
    ready = [g["group_id"] for g in state["buffer"]["ready"]]
    outstanding = [r["group_id"] for r in state["outstanding"]]
    # Each group is dealt over 2 versions (trainer.group_spread's default): the last version's
    # 2 groups have one share trained and one saved.
    pending = {t["group_id"] for e in state["spread_pending"] for t in e["trajectories"]}
    assert state["num_trained_groups"] == 6 and len(pending) == 2
    assert ready or outstanding, "the pool should have run ahead of the learner"
    assert state["num_dispatched"] == 8 + len(ready) + len(outstanding) + first["pipeline/rejected"]
    second = train(_cfg(tmp_path, "run", *extra, "trainer.resume=auto"))
    assert second["last_step"] == 4
    assert second["pipeline/trained"] == 16
    assert second["pipeline/abandoned"] == len(outstanding)
    assert second["pipeline/dispatched"] == second["pipeline/trained"] + sum(
        v for k, v in second.items() if k.startswith("pipeline/") and k not in (
            "pipeline/dispatched", "pipeline/trained", "pipeline/dropped_duplicate_samples", "pipeline/malformed_messages",
            "pipeline/reissued", "pipeline/generator_restarts"))
    assert second["pipeline/reissued"] == len(outstanding)  # the resume's re-issues are counted too


def test_dataset_epoch_boundary_resume(tiny_tokenizer, tmp_path):
    """A checkpoint taken exactly at an epoch's end resumes into the next epoch's permutation, and a
    batch that crosses the end is filled from the next epoch (never a short or empty step)."""
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset

    files = [resolve("builtin:arithmetic/test")]
    ds = PromptDataset(files, tiny_tokenizer, 64, seed=3, limit=8)
    ref = PromptDataset(files, tiny_tokenizer, 64, seed=3, limit=8)
    stream = [p.uid for p in ref.next_batch(24)]
    first = [p.uid for p in ds.next_batch(8)]
    assert ds.state_dict() == {"epoch": 0, "position": 8}
    resumed = PromptDataset(files, tiny_tokenizer, 64, seed=3, limit=8)
    resumed.load_state_dict(ds.state_dict())
    rest = [p.uid for p in resumed.next_batch(16)]
    assert first + rest == stream
    assert sorted(stream[8:16]) == sorted(stream[:8]) and stream[8:16] != stream[:8]  # a new permutation
    # A step of 5 prompts from position 6 of 8: 2 from epoch 0 and 3 from epoch 1.
    ds2 = PromptDataset(files, tiny_tokenizer, 64, seed=3, limit=8)
    ds2.next_batch(6)
    assert [p.uid for p in ds2.next_batch(5)] == stream[6:11]
    assert ds2.state_dict() == {"epoch": 1, "position": 3}


def test_a_continued_run_removes_what_a_killed_save_left(tmp_path, caplog):
    """A SIGKILLed save leaves its ``step_*.tmp`` (and maybe ``latest.tmp``): the run that
    continues the directory removes them, in one line; a fresh run into a new name has none."""
    from types import SimpleNamespace

    from async_rl.runtime.checkpoint import RunDirectory

    ckpt = tmp_path / "run" / "checkpoints"
    (ckpt / "step_000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step_000002")
    (ckpt / "step_000004.tmp" / "learner").mkdir(parents=True)
    (ckpt / "latest.tmp").write_text("step_000004")
    t_cfg = SimpleNamespace(output_dir=str(tmp_path), run_name="run", resume="auto", overwrite=False)
    with caplog.at_level("WARNING", logger="async_rl.runtime.checkpoint"):
        RunDirectory(t_cfg).create("x: 1\n")
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_000002"]
    assert [r.getMessage() for r in caplog.records] == [
        f"removed latest.tmp, step_000004.tmp in {ckpt}: left half-written by a run that was killed while saving"]


def test_resolve_resume(tmp_path):
    assert resolve_resume(None, str(tmp_path), "x") is None
    assert resolve_resume("auto", str(tmp_path), "x") is None  # nothing to resume yet: start fresh
    with pytest.raises(ValueError, match="trainer.run_name"):
        resolve_resume("auto", str(tmp_path), None)
    with pytest.raises(FileNotFoundError, match="trainer.resume"):
        resolve_resume(str(tmp_path / "missing"), str(tmp_path), "x")
    ckpt = tmp_path / "x" / "checkpoints" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "x" / "checkpoints" / "latest").write_text("step_000004")
    assert resolve_resume("auto", str(tmp_path), "x") == ckpt
    assert resolve_resume(str(tmp_path / "x"), str(tmp_path), "y") == ckpt
    assert resolve_resume(str(ckpt), str(tmp_path), "y") == ckpt


def test_checkpoint_config_validation():
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointConfig(keep_last=0)
    with pytest.raises(ConfigError, match="every_steps"):
        load_config(ROOT / "configs/default.yaml", ["trainer.checkpoint.every_steps=-1"])
    cfg = load_config(ROOT / "configs/default.yaml", ["trainer.resume=auto", "trainer.checkpoint.every_steps=10"])
    assert cfg.trainer.resume == "auto" and cfg.trainer.checkpoint.every_steps == 10


def test_stop_request_first_signal_asks_second_raises():
    # SIGINT starts at Python's default handler (the autouse fixture), whatever the shell gave us.
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_sigint_landing_in_a_dcp_save_still_exits_128_plus_sigint(tmp_path, monkeypatch, capsys):
    """The second SIGINT's KeyboardInterrupt lands wherever the main thread is. Inside a DCP save
    (here its fsync, where CI caught it) DCP wraps it in a CheckpointException, a BaseException:
    the CLI used to exit 1 with DCP's traceback; it exits 130 with one line."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from async_rl import cli

    real_fsync = os.fsync

    def fsync_then_sigint(fd):
        real_fsync(fd)
        os.kill(os.getpid(), signal.SIGINT)

    def train(cfg):
        with StopRequest() as stop:
            os.kill(os.getpid(), signal.SIGINT)
            assert stop.requested
            monkeypatch.setattr(dcp_fs.os, "fsync", fsync_then_sigint)
            try:
                dcp.save({"w": torch.zeros(4)}, checkpoint_id=str(tmp_path / "step_000001.tmp"))
            finally:
                monkeypatch.setattr(dcp_fs.os, "fsync", real_fsync)
        raise AssertionError("the second SIGINT did not stop the save")

    monkeypatch.setattr("async_rl.trainer.train", train)
    status = cli.main(["train", "--config", str(ROOT / "configs/default.yaml"), f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert status == 128 + signal.SIGINT
    assert "interrupted by a second SIGINT: stopped at once (CheckpointException" in err
    assert "Traceback" not in err
    # The next loop starts clean: an unrelated failure later is not taken for this stop.
    with StopRequest():
        pass
    monkeypatch.setattr("async_rl.trainer.train", lambda cfg: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["train", "--config", str(ROOT / "configs/default.yaml"), f"trainer.output_dir={tmp_path}"])


class _Stopped(Exception):
    pass


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


def test_stop_request_leaves_an_ignored_sigint_ignored_and_still_honours_sigterm(monkeypatch, caplog):
    """Started with SIGINT ignored (``nohup async-rl train ... &`` from a script), Ctrl-C stays
    ignored, as the shell meant, and the run says so once; SIGTERM still asks for a clean stop, and a
    second one stops at once (here through a stand-in handler, where the real default would end the
    test process)."""
    monkeypatch.setattr(StopRequest, "_told_sigint_ignored", False)
    int_before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    term_before = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        with caplog.at_level("WARNING", logger="async_rl.runtime.checkpoint"):
            with StopRequest(), StopRequest():
                pass
        told = [r.getMessage() for r in caplog.records if "SIGINT" in r.getMessage()]
        assert told == [f"Ctrl-C (SIGINT) is ignored in this process (started in the background without job "
                        f"control): stop it with kill {os.getpid()} (SIGTERM), which saves first"]
        with StopRequest() as stop:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and stop.signal_name == "SIGTERM"
            with pytest.raises(_Stopped):
                os.kill(os.getpid(), signal.SIGTERM)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is _raise_stopped
    finally:
        signal.signal(signal.SIGINT, int_before)
        signal.signal(signal.SIGTERM, term_before)


def test_stop_request_restores_the_handler_it_found():
    original = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with StopRequest():
            assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, original)


@pytest.mark.slow
def test_cli_sigterm_saves_and_exits_143(tmp_path):
    """``kill -TERM`` of a running ``async-rl train``: it finishes the step in progress, writes a
    checkpoint at that step and exits with 128 + 15; ``trainer.resume=auto`` continues from it."""
    import subprocess
    import sys
    import time

    args = [sys.executable, "-m", "async_rl.cli", "train", "--config", str(ROOT / "configs/default.yaml"),
            f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=500",
            "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
            "trainer.warm_start.steps=0", "data.val_files=[]", "logging.progress=false"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    last = max(json.loads(line)["step"] for line in metrics.read_text().splitlines())
    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == f"step_{last:06d}", out
    assert "SIGTERM: stopping after step" in out
    again = [f"trainer.total_steps={last + 1}" if a.startswith("trainer.total_steps=") else a for a in args]
    resumed = subprocess.run(again + ["trainer.resume=auto"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"step {last} done" in resumed.stdout


@pytest.mark.slow
def test_resume_in_another_mode_is_refused(tmp_path):
    from async_rl.trainer import train

    train(_cfg(tmp_path, "run", "trainer.total_steps=1", "trainer.warm_start.steps=0", "data.val_files=[]"))
    with pytest.raises(ValueError, match="trainer.mode=sync; resume it with the same mode"):
        train(_cfg(tmp_path, "run", "trainer.total_steps=2", "trainer.resume=auto", "trainer.mode=async"))


@pytest.mark.slow
def test_resume_at_or_past_total_steps_is_refused(tmp_path):
    from async_rl.trainer import train

    train(_cfg(tmp_path, "run", "trainer.total_steps=2", "trainer.warm_start.steps=0", "data.val_files=[]"))
    with pytest.raises(ValueError, match="at step 2, not before trainer.total_steps=2"):
        train(_cfg(tmp_path, "run", "trainer.total_steps=2", "trainer.resume=auto"))
