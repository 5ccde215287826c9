"""A follower learner rank killed (SIGKILL) in the middle of a 2-rank sync run (issue 18): the run
stops within seconds with one error line naming the rank, its process and the checkpoint to resume
from, leaves no process or shared-memory file behind and no half-written checkpoint, and
``trainer.resume=auto`` finishes the run from that checkpoint.

Run with ``python -m pytest -q -m slow tests/test_learner_rank_death.py`` (about two minutes).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from pipeline_helpers import ROOT, small_run
from test_trainer_kill import _alive, _descendants, _last_step, _shm_of


def test_actor_end_reads_rays_exit_detail():
    from async_rl.learners.launch import _actor_end

    ray_text = ("The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit "
                "detail: Worker unexpectedly exits with a connection error code 2. End of file. Some common causes "
                "include: (1) the process was killed by the OOM killer")
    assert _actor_end(RuntimeError(ray_text)) == (
        "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
        "End of file (its process vanished: killed by a signal such as SIGKILL or the OOM killer, or crashed)")
    assert _actor_end(ValueError("bad batch\n  at line 3")) == "ValueError: bad batch at line 3"


def test_resume_point_note_names_the_latest_complete_checkpoint(tmp_path):
    from async_rl.runtime.checkpoint import CheckpointConfig
    from async_rl.loops.base import TrainerConfig
    from async_rl.trainer import resume_point_note

    t_cfg = TrainerConfig(checkpoint=CheckpointConfig(every_steps=0))
    assert "no checkpoint was written (trainer.checkpoint.every_steps=0)" in resume_point_note(tmp_path, t_cfg)
    done = tmp_path / "checkpoints" / "step_000003"
    done.mkdir(parents=True)
    (done / "trainer_state.pt").write_bytes(b"")
    (tmp_path / "checkpoints" / "step_000004.tmp").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_000003")
    assert resume_point_note(tmp_path, t_cfg) == (f"the last good checkpoint is {done} (after step 3): run again with "
                                                  "trainer.resume=auto to continue from it")


@pytest.mark.slow
def test_killed_learner_rank_is_named_and_the_run_resumes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["OMP_NUM_THREADS"] = "1"
    steps = 5
    args = small_run(tmp_path, "ranks", "learner.world_size=2", f"trainer.total_steps={steps}",
                     "trainer.checkpoint.every_steps=1", "trainer.warm_start.steps=2", "logging.console_every_steps=1")
    cmd = [sys.executable, "-m", "async_rl.cli", "train", "--config", str(ROOT / "configs/default.yaml"), *args]
    run_dir, log = tmp_path / "ranks", tmp_path / "first.log"
    with open(log, "w") as out:
        trainer = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while _last_step(run_dir) < 2:
            assert trainer.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached step 2"
            time.sleep(0.2)
        rank1 = json.loads((run_dir / "placement.json").read_text())["actors"]["learner"][0]["pid"]
        procs = _descendants(trainer.pid) | {rank1}
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        # Generous: only to fail rather than hang (it takes a few seconds; gloo's timeout is 30 min).
        status = trainer.wait(timeout=300)
        print(f"\nrank 1 killed: the trainer exited {time.monotonic() - killed_at:.1f} s later with status {status}")
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("async-rl: error:")]
    assert status == 1 and len(errors) == 1, text[-3000:]
    print(errors[0])
    assert f"learner rank 1 of 2 (pid {rank1} on " in errors[0] and "SIGKILL" in errors[0]
    saved = re.search(r"the last good checkpoint is (\S+) \(after step (\d+)\): run again with trainer.resume=auto",
                      errors[0])
    assert saved, errors[0]
    # Nothing of the run is left: its Ray instance went down with it, and no shared memory.
    deadline = time.monotonic() + 180
    while _alive(procs) and time.monotonic() < deadline:
        time.sleep(1.0)
    assert not _alive(procs), {p: open(f"/proc/{p}/cmdline", "rb").read()[:80] for p in _alive(procs)}
    assert _shm_of(trainer.pid) == []
    # The checkpoint named is the latest complete one; no half-written one is left beside it.
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step_"))
    step = int(saved.group(2))
    assert checkpoints[-1] == f"step_{step:06d}" == os.path.basename(saved.group(1)) and 1 <= step <= steps
    assert not [c for c in checkpoints if c.endswith(".tmp")], checkpoints

    resumed = subprocess.run([*cmd, "trainer.resume=auto"], capture_output=True, text=True, env=env, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / checkpoints[-1]}: step {step} done" in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["last_step"] == steps
    # The resumed run trained exactly the steps after the checkpoint.
    trained = [int(k) for k in re.findall(rf"^step (\d+)/{steps} \|", resumed.stdout, flags=re.M)]
    assert trained == list(range(step + 1, steps + 1)), resumed.stdout[-2000:]
