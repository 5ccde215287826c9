"""A user's mistakes at the command line: each is one line on stderr naming the problem, a
nonzero exit, no traceback and no run directory left behind.

Bad config files (YAML syntax, a list at the top, a folder), a missing model directory, a hub
id that is neither cached nor reachable, missing data files (checked before the model), a
misspelt reward function, a reused ``trainer.run_name`` (refused unless resumed or
overwritten), and a warm start stopped by Ctrl-C or by a data error. Runs are tiny; the Ctrl-C
test runs the real console script in a child process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from async_rl.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs/default.yaml")
SCRIPT = Path(sys.executable).with_name("async-rl")

# A few prompts of the built-in task; steps=0 keeps runs that should fail early from warm-starting.
TINY = ["trainer.total_steps=1", "trainer.prompts_per_step=2", "trainer.samples_per_prompt=2",
        "learner.num_mini_batches=1", "trainer.eval_every_steps=0", "trainer.warm_start.steps=0",
        "data.val_max_prompts=2", "logging.progress=false", "logging.console_every_steps=1"]


@pytest.fixture(autouse=True)
def _no_progress_bars():
    """transformers draws a progress bar on stderr while it loads weights; off, stderr holds only
    what the CLI writes."""
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    yield
    if was_on:
        hf_logging.enable_progress_bar()


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    """``async-rl ARGV`` in this process: (exit status, stderr lines)."""
    rc = main(list(argv))
    err = capsys.readouterr().err
    return rc, err.strip().splitlines()


def _train(capsys, out: Path, *overrides: str, config: str = DEFAULT) -> tuple[int, list[str]]:
    return _run(capsys, "train", "--config", config, f"trainer.output_dir={out}", "trainer.run_name=run",
                *TINY, *overrides)


def _assert_one_line(lines: list[str], *needles: str) -> None:
    assert len(lines) == 1, lines
    assert lines[0].startswith("async-rl: ") and "Traceback" not in lines[0], lines
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


# ------------------------------------------------------------------------------------ config files
@pytest.mark.parametrize("kind", ["yaml_syntax", "top_level_list", "folder"])
def test_a_bad_config_file_is_one_line(tmp_path, capsys, kind):
    path = tmp_path / "my.yaml"
    if kind == "yaml_syntax":
        path.write_text("model:\n  path: builtin:tiny-qwen2\ndata:\n  train_files: [a.jsonl\n")
        needles = ("not valid YAML", "line 4")
    elif kind == "top_level_list":
        path.write_text("- model\n- data\n")
        needles = ("top level must be a mapping", "got a list")
    else:
        path.mkdir()
        needles = ("is a directory",)
    rc, err = _run(capsys, "train", "--config", str(path), f"trainer.output_dir={tmp_path / 'runs'}")
    assert rc == 2
    _assert_one_line(err, "config error", str(path), *needles)
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------- model
def test_a_missing_model_directory_is_named_as_a_directory(tmp_path, capsys):
    missing = tmp_path / "my-model"
    rc, err = _train(capsys, tmp_path / "runs", f"model.path={missing}")
    assert rc == 1
    # Not the hub's "Repo id must be in the form ..." nor an attempt to reach it.
    _assert_one_line(err, f"model.path={missing}", "no such directory")
    assert "hub" not in err[0] and not (tmp_path / "runs").exists()


def test_a_model_directory_without_config_json_is_refused(tmp_path, capsys):
    (tmp_path / "weights").mkdir()
    rc, err = _train(capsys, tmp_path / "runs", f"model.path={tmp_path / 'weights'}")
    assert rc == 1
    _assert_one_line(err, "model.path=", "config.json")
    assert "final_model" not in err
    assert not (tmp_path / "runs").exists()
    # A run directory given as the model: the line names its trained model.
    (tmp_path / "old_run" / "final_model").mkdir(parents=True)
    (tmp_path / "old_run" / "final_model" / "config.json").write_text("{}")
    rc, err = _train(capsys, tmp_path / "runs", f"model.path={tmp_path / 'old_run'}")
    assert rc == 1
    _assert_one_line(err, "holds no config.json", f"its trained model is {tmp_path / 'old_run' / 'final_model'}")


@pytest.fixture
def empty_hub_cache(tmp_path, monkeypatch):
    """No model in the Hugging Face cache, and nothing in the environment deciding online/offline."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    return constants


def test_a_hub_id_while_offline_is_one_line(tmp_path, capsys, monkeypatch, empty_hub_cache):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rc, err = _train(capsys, tmp_path / "runs", "model.path=someone/some-model")
    assert rc == 1
    _assert_one_line(err, "model.path=someone/some-model", "not in the Hugging Face cache", "offline")
    assert not (tmp_path / "runs").exists()


def test_a_hub_id_with_the_hub_unreachable_is_one_line(tmp_path, capsys, monkeypatch, empty_hub_cache):
    # A port nothing listens on: the connection is refused at once, as an unreachable hub.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(empty_hub_cache, "ENDPOINT", f"http://127.0.0.1:{port}")
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    rc, err = _train(capsys, tmp_path / "runs", "model.path=someone/some-model")
    assert rc == 1
    _assert_one_line(err, "model.path=someone/some-model", "not in the Hugging Face cache", "unreachable",
                     f"127.0.0.1:{port}")
    assert not (tmp_path / "runs").exists()


def test_gsm8k_config_names_its_missing_data_before_the_model(tmp_path, capsys, monkeypatch, empty_hub_cache):
    # Offline with an empty cache: had the model been looked up first, the line would be about it.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    rc, err = _run(capsys, "train", "--config", str(ROOT / "configs/gsm8k_qwen2.5_0.5b.yaml"),
                   f"trainer.output_dir={tmp_path / 'runs'}")
    assert rc == 1
    _assert_one_line(err, "not found", "data.train_files: data/gsm8k/train.parquet",
                     "data.val_files: data/gsm8k/test.parquet", str(tmp_path))
    assert "model" not in err[0] and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ reward
def test_a_misspelt_reward_function_names_the_file_and_what_it_defines(tmp_path, capsys):
    f = tmp_path / "my_reward.py"
    f.write_text("import math\n\ndef score(data_source, response, truth, extra):\n    return 1.0\n\n"
                 "def _private():\n    pass\n\ndef score_strict(data_source, response, truth, extra):\n"
                 "    return 0.0\n")
    rc, err = _train(capsys, tmp_path / "runs", f"reward.fn={f}:scor")
    assert rc == 2
    _assert_one_line(err, "reward.fn", str(f), "'scor'", "did you mean 'score'?", "it defines: score, score_strict")
    assert "async_rl_user" not in err[0] and "math" not in err[0] and "_private" not in err[0]
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- reusing a run name
def _steps(run: Path) -> list[int]:
    return [rec["step"] for rec in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
            if rec["step"] >= 1 and "policy/version" in rec]


@pytest.mark.slow
def test_a_reused_run_name_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    run = tmp_path / "run"
    assert _train(capsys, tmp_path)[0] == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert Path("checkpoints/step_000001/trainer_state.msgpack") in before and Path("summary.json") in before

    # The same name again: refused before anything loads, the first run untouched.
    rc, err = _train(capsys, tmp_path)
    assert rc == 1
    _assert_one_line(err, f"trainer.run_name=run: {run} already holds a run", "trainer.resume=auto",
                     "trainer.overwrite=true", "another trainer.run_name")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    # Resuming continues it: step 2 follows step 1, once each.
    assert _train(capsys, tmp_path, "trainer.resume=auto", "trainer.total_steps=2")[0] == 0
    assert _steps(run) == [1, 2]
    assert (run / "checkpoints/latest").read_text() == "step_000002"

    # Overwriting starts over in an emptied directory: one step, its own checkpoint only.
    assert _train(capsys, tmp_path, "trainer.overwrite=true")[0] == 0
    assert _steps(run) == [1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert json.loads((run / "summary.json").read_text())["last_step"] == 1


def test_overwrite_and_resume_together_are_refused(tmp_path, capsys):
    rc, err = _train(capsys, tmp_path, "trainer.overwrite=true", "trainer.resume=auto")
    assert rc == 2
    _assert_one_line(err, "trainer.overwrite=true", "trainer.resume=auto")


@pytest.mark.parametrize("name", [".", "..", "a/../b", "/abs"])
def test_a_run_name_outside_the_output_dir_is_refused(tmp_path, capsys, name):
    # trainer.overwrite would delete it: only a directory strictly inside output_dir is a run's.
    rc, err = _run(capsys, "train", "--config", DEFAULT, f"trainer.output_dir={tmp_path / 'runs'}",
                   f"trainer.run_name={name}", "trainer.overwrite=true")
    assert rc == 2
    _assert_one_line(err, f"trainer.run_name={name!r}", "inside trainer.output_dir")
    assert not (tmp_path / "runs").exists()


def test_a_name_whose_directory_holds_no_checkpoint_is_not_offered_resume(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    rc, err = _train(capsys, tmp_path)
    assert rc == 1
    _assert_one_line(err, "already holds a run", "trainer.overwrite=true")
    assert "resume" not in err[0] and (tmp_path / "run" / "notes.txt").read_text() == "mine"


def test_unnamed_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    import datetime as dt

    from async_rl.runtime import checkpoint
    from async_rl.loops.base import TrainerConfig

    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2025, 1, 2, 3, 4, 5)

    monkeypatch.setattr(checkpoint, "datetime", Frozen)
    t_cfg = TrainerConfig(output_dir=str(tmp_path))
    # Both named before either makes its directory: the second still gets a free one.
    first, second = checkpoint.RunDirectory(t_cfg), checkpoint.RunDirectory(t_cfg)
    assert first.create("a: 1\n") == tmp_path / "20250102-030405"
    assert second.create("a: 2\n") == tmp_path / "20250102-030405-1"
    assert checkpoint.RunDirectory(t_cfg).path == tmp_path / "20250102-030405-2"
    assert (first.path / "config.yaml").read_text() == "a: 1\n" and first.created and second.created


def test_discard_removes_only_what_the_run_made(tmp_path):
    from async_rl.runtime.checkpoint import RunDirectory
    from async_rl.loops.base import TrainerConfig

    made = RunDirectory(TrainerConfig(output_dir=str(tmp_path / "new" / "runs"), run_name="a"))
    made.create("x: 1\n")
    assert made.discard() and not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    found = RunDirectory(TrainerConfig(output_dir=str(tmp_path), run_name="empty"))
    found.create("x: 1\n")
    assert not found.created and not found.discard() and (tmp_path / "empty" / "config.yaml").exists()


# ------------------------------------------------------------------- the warm start, interrupted
@pytest.mark.slow
def test_ctrl_c_during_the_warm_start_is_one_line_and_leaves_no_run_dir(tmp_path):
    out = tmp_path / "runs"
    cmd = [str(SCRIPT), "train", "--config", DEFAULT, f"trainer.output_dir={out}", "trainer.run_name=ws",
           "trainer.warm_start.steps=100000", "trainer.warm_start.batch_size=2", "data.val_max_prompts=2",
           "logging.progress=false", "learner.num_threads=1"]
    # No progress bars on stderr (transformers draws one while loading weights): stderr is then
    # exactly what the CLI writes.
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    # A child of a shell that started pytest with `nohup ... &` inherits SIGINT ignored: restore it.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    watchdog = threading.Timer(900, proc.kill)
    watchdog.start()
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            # Printed once the run directory exists, just before the warm start's first step.
            if "warm start" in line:
                assert (out / "ws" / "config.yaml").exists()
                proc.send_signal(signal.SIGINT)
                break
        assert any("warm start" in line for line in seen), seen
        _, err = proc.communicate(timeout=600)
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 130
    _assert_one_line(err.strip().splitlines(), "interrupted during the warm start", "nothing saved yet",
                     f"removed {out / 'ws'}")
    assert not (out / "ws").exists()


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _row(a: int, b: int, **extra_info) -> dict:
    return {"prompt": [{"role": "user", "content": f"{a}+{b}="}], "data_source": "async_rl/arithmetic",
            "reward_model": {"style": "rule", "ground_truth": str(a + b)}, "extra_info": extra_info}


def test_a_row_without_the_warm_start_field_is_one_line_and_leaves_no_run_dir(tmp_path, capsys):
    data = _jsonl(tmp_path / "train.jsonl", [_row(1, 2, solution="3"), _row(2, 2)])
    rc, err = _train(capsys, tmp_path / "runs", f"data.train_files=[{data}]", "data.val_files=[]",
                     "trainer.warm_start.steps=2", "trainer.warm_start.batch_size=2",
                     "trainer.warm_start.response_field=extra_info.solution")
    assert rc == 1
    _assert_one_line(err, "extra_info.solution")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_data_error_inside_the_warm_start_is_one_line_and_leaves_no_run_dir(tmp_path, capsys):
    # A reference far longer than the micro-batch token budget: found only when the warm start
    # batches it, after the run directory was made (40 = 32 prompt + 8 response tokens, the
    # longest rollout sequence, so the config itself is fine).
    data = _jsonl(tmp_path / "train.jsonl", [_row(1, 2, answer="3 " * 60), _row(2, 2, answer="4 " * 60)])
    rc, err = _train(capsys, tmp_path / "runs", f"data.train_files=[{data}]", "data.val_files=[]",
                     "trainer.warm_start.steps=2", "trainer.warm_start.batch_size=2",
                     "learner.max_tokens_per_micro_batch=40")
    assert rc == 1
    _assert_one_line(err, "learner.max_tokens_per_micro_batch=40")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_an_error_after_a_trained_step_keeps_the_run_dir(tmp_path, capsys, monkeypatch):
    """The other side of the rule: a run that trained keeps its directory, whatever stops it."""
    from async_rl.loops.sync import SyncLoop

    original = SyncLoop.step

    def step(self, n):
        if n == 2:
            raise ValueError("reward service gone")
        return original(self, n)

    monkeypatch.setattr(SyncLoop, "step", step)
    rc, err = _train(capsys, tmp_path, "trainer.total_steps=2", "trainer.checkpoint.save_at_exit=false")
    assert rc == 1
    _assert_one_line(err, "reward service gone")
    assert _steps(tmp_path / "run") == [1]
