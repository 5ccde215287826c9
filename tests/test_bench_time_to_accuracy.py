"""``bench/bench_time_to_accuracy.py`` (issue 32): the figures it derives from curves (trailing
means, time and steps to a target, last-quarter means, their standard errors) on hand-computed
values, the RL clock that leaves snapshot copies out, and its short form end to end (CI's form:
two seeds of sync and async; it checks the machinery, not the figures)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pipeline_helpers import bench_module

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return bench_module("bench_time_to_accuracy")


def _curve(accs, dt=10.0, every=10):
    return [{"step": i * every, "rl_s": i * dt, "sampled": a, "greedy": a} for i, a in enumerate(accs)]


def test_trailing_mean_needs_k_values():
    b = _bench()
    means = b.trailing_mean([0.1, 0.2, 0.6, 0.4], 3)
    assert means[:2] == [None, None] and means[2] == pytest.approx(0.3) and means[3] == pytest.approx(0.4)


def test_first_reach_uses_the_trailing_mean_not_one_lucky_evaluation():
    b = _bench()
    # One evaluation at 0.9 (step 20) does not reach 0.6: the trailing means are 0.43, 0.43,
    # 0.53, 0.5, then (0.5 + 0.8 + 0.8) / 3 = 0.7 at step 60.
    curve = _curve([0.2, 0.2, 0.9, 0.2, 0.5, 0.8, 0.8])
    point = b.first_reach(curve, 0.6, "sampled")
    assert point["step"] == 60 and point["rl_s"] == 60.0
    assert b.first_reach(curve, 0.71, "sampled") is None


def test_tail_mean_is_the_last_quarter_of_the_steps():
    b = _bench()
    curve = _curve([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], every=10)  # steps 0..80
    assert b.tail_mean(curve, "sampled", 80) == pytest.approx((0.7 + 0.8) / 2)  # steps > 60
    assert b.tail_mean(curve[:2], "sampled", 80) == pytest.approx(0.1)  # none that late: the last one


def test_mean_se():
    b = _bench()
    m, se = b.mean_se([1.0, 2.0, 3.0, 4.0])
    assert m == 2.5 and se == pytest.approx(math.sqrt(5 / 3) / 2)
    assert math.isnan(b.mean_se([1.0])[1])


def test_summarize_targets_sync_minus_three_points_and_counts_misses_as_the_whole_run():
    b = _bench()
    runs = {
        "sync": [{"seed": 0, "rl_s": 40.0, "curve": _curve([0.5, 0.6, 0.7, 0.8, 0.8])},
                 {"seed": 1, "rl_s": 40.0, "curve": _curve([0.5, 0.6, 0.7, 0.8, 0.6])}],
        "async": [{"seed": 0, "rl_s": 30.0, "curve": _curve([0.5, 0.7, 0.8, 0.8, 0.8], dt=7.5)},
                  {"seed": 1, "rl_s": 30.0, "curve": _curve([0.5, 0.5, 0.5, 0.5, 0.5], dt=7.5)}],
    }
    s = b.summarize(runs, 40, "sampled", None)
    # sync's last quarter = steps > 30: step 40 only -> 0.8 and 0.6, mean 0.7; target 0.67.
    assert s["target"] == pytest.approx(0.67)
    sync, async_ = s["contenders"]["sync"], s["contenders"]["async"]
    # sync: trailing means (0.6, 0.7, 0.77) and (0.6, 0.7, 0.7): both reach at step 30.
    assert sync["time_to_target"][0] == pytest.approx(30.0) and sync["reached"] == 2
    # async seed 0: (0.667, 0.767, ...) reaches at step 30 (22.5 s); seed 1 never: its whole 30 s.
    assert async_["time_to_target"][0] == pytest.approx((22.5 + 30.0) / 2) and async_["reached"] == 1
    assert async_["steps_to_target"][0] == pytest.approx((30 + 40) / 2)
    assert async_["tail"][0] == pytest.approx(0.65)


def test_report_summarizes_the_runs_of_several_invocations(tmp_path, capsys):
    b = _bench()
    runs = tmp_path / "runs"
    runs.mkdir()
    # Seeds 0 and 1 of sync from one invocation, seed 2 from a later one (--first-seed 2), and
    # async's seed 0: --report summarizes them all, by contender and seed.
    for name, seed, curve in [("sync", 2, [0.5, 0.6, 0.7, 0.8, 0.9]), ("sync", 0, [0.5, 0.6, 0.7, 0.8, 0.8]),
                              ("sync", 1, [0.5, 0.6, 0.7, 0.8, 0.6]), ("async", 0, [0.5, 0.7, 0.8, 0.8, 0.8])]:
        (runs / f"{name}-seed{seed}.json").write_text(json.dumps(
            {"contender": name, "seed": seed, "rl_s": 40.0, "curve": _curve(curve)}))
    s = b.main(["--out", str(tmp_path), "--report"])
    assert list(s["contenders"]) == ["sync", "async"]
    assert s["contenders"]["sync"]["seeds"] == [0, 1, 2]
    # sync's last quarter (step 40): 0.8, 0.6, 0.9 -> mean 0.7667; the target 3 points below.
    assert s["contenders"]["sync"]["tail"][0] == pytest.approx(0.7667, abs=1e-4)
    assert s["target"] == pytest.approx(0.7367, abs=1e-4)
    assert "40 steps" in capsys.readouterr().out
    assert (tmp_path / "time_to_accuracy.json").exists() and (tmp_path / "time_to_accuracy.png").exists()
    # Runs of different lengths are not averaged together.
    (runs / "async-seed1.json").write_text(json.dumps(
        {"contender": "async", "seed": 1, "rl_s": 30.0, "curve": _curve([0.5, 0.6, 0.7])}))
    with pytest.raises(SystemExit, match="different lengths"):
        b.main(["--out", str(tmp_path), "--report"])
    with pytest.raises(SystemExit, match="no run results"):
        b.main(["--out", str(tmp_path / "empty"), "--report"])


def test_report_prints_the_runs_own_settings_and_refuses_runs_that_differ(tmp_path, capsys):
    b = _bench()
    runs = tmp_path / "runs"
    runs.mkdir()
    common = {"config": "longtail.yaml", "eval_every": 5, "eval_samples": 4, "overrides": []}

    def save(name, seed, **changes):
        own = {"contender_overrides": ["trainer.policy_version_per=step"] if name == "async" else [],
               "trl_defaults": False}
        (runs / f"{name}-seed{seed}.json").write_text(json.dumps(
            {"contender": name, "seed": seed, "rl_s": 20.0, "curve": _curve([0.5, 0.6, 0.7], every=5),
             "settings": {**common, **own, **changes}}))

    save("sync", 0)
    save("async", 0)
    # The header is the runs' (evaluation every 5 steps, 4 samples, the long-tailed job), not
    # the command line's defaults (10, 16, the default job).
    b.main(["--out", str(tmp_path), "--report"])
    out = capsys.readouterr().out
    assert "longtail.yaml: 10 steps, evaluation every 5, seeds 1, accuracy = sampled (4 samples per prompt)" in out
    assert "async runs with trainer.policy_version_per=step" in out
    # A later invocation with 16 samples per prompt, or another async setting, is not averaged in.
    save("sync", 1, eval_samples=16)
    with pytest.raises(SystemExit, match="differ in eval_samples"):
        b.main(["--out", str(tmp_path), "--report"])
    save("sync", 1)
    save("async", 1, contender_overrides=[])
    with pytest.raises(SystemExit, match="async runs .* differ in their own settings"):
        b.main(["--out", str(tmp_path), "--report"])
    # Runs saved before settings were recorded: the interval from their curves, samples unknown.
    for f in runs.iterdir():
        r = json.loads(f.read_text())
        del r["settings"]
        f.write_text(json.dumps(r))
    b.main(["--out", str(tmp_path), "--report"])
    assert "evaluation every 5, seeds 2, accuracy = sampled (samples per prompt not recorded)" in capsys.readouterr().out


def test_the_rl_clock_leaves_the_snapshot_copies_out():
    b = _bench()
    snaps = b.Snapshots()
    snaps.start()

    def slow_weights():
        time.sleep(0.3)
        yield "w", torch.ones(3)

    snaps.take(10, slow_weights())
    assert snaps.points[0][0] == 10 and snaps.points[0][1] < 0.1
    assert torch.equal(snaps.points[0][2]["w"], torch.ones(3))
    assert snaps.elapsed() < 0.2


def test_the_short_form_runs_sync_and_async_over_two_seeds(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_time_to_accuracy.py"), "--short",
                           "--contenders", "sync,async", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "time to target async/sync" in done.stdout and "last-quarter accuracy sync - async" in done.stdout
    data = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    runs = data["runs"]
    assert sorted(runs) == ["async", "sync"]
    for name, results in runs.items():
        assert [r["seed"] for r in results] == [0, 1]
        for r in results:
            assert [p["step"] for p in r["curve"]] == [0, 2, 4], name
            assert r["rl_s"] > 0 and r["curve"][-1]["rl_s"] <= r["rl_s"] + 1e-6
            assert all(0.0 <= p[k] <= 1.0 for p in r["curve"] for k in ("greedy", "sampled"))
            assert [p["rl_s"] for p in r["curve"]] == sorted(p["rl_s"] for p in r["curve"])
    # Every run starts from the same warm-started policy, evaluated with the same seeds: the
    # step-0 figures of all four runs are one and the same.
    starts = {(r["curve"][0]["greedy"], r["curve"][0]["sampled"]) for rs in runs.values() for r in rs}
    assert len(starts) == 1, starts
    assert set(data["summary"]["contenders"]) == {"sync", "async"}
    assert (tmp_path / "time_to_accuracy.png").stat().st_size > 10_000


def test_trl_runs_in_float32_like_ours_unless_asked_for_its_defaults(tmp_path, tiny_model_path):
    # TRL's config turns bf16 autocast on by default, on a CPU too: its sampling and training
    # then ran in bfloat16 against our float32, and learned about a point more late in the run.
    pytest.importorskip("trl")
    vs_trl = bench_module("bench_vs_trl")
    cfg = vs_trl.default_config()
    matched = vs_trl.trl_trainer(Path(tiny_model_path), cfg, 1, tmp_path / "a")
    assert matched.args.bf16 is False and matched.args.gradient_checkpointing is False
    assert matched.args.learning_rate == cfg.learner.lr and matched.args.max_grad_norm == cfg.learner.grad_clip
    own = vs_trl.trl_trainer(Path(tiny_model_path), cfg, 1, tmp_path / "b",
                             extra={"bf16": True, "gradient_checkpointing": True})
    assert own.args.bf16 is True and own.args.gradient_checkpointing is True


def test_an_environments_job_warm_starts_and_evaluates_on_its_own_rows(tmp_path, tiny_model_path):
    # The bench's warm start and held-out evaluation once read data files as paths, so a job whose
    # rows come from its environment (data files env:train / env:val) could not be benched.
    pytest.importorskip("reasoning_gym")
    vs_trl = bench_module("bench_vs_trl")
    config = ROOT / "examples" / "reasoning_gym" / "spell_backward.yaml"
    overrides = [f"model.path={tiny_model_path}", "env.args.size=40", "env.args.val_size=6",
                 "trainer.warm_start.steps=2", "trainer.warm_start.batch_size=4"]
    warm = vs_trl.warm_started_model(tmp_path, config, overrides)
    assert (warm / "config.json").exists()
    held_out = vs_trl.HeldOut(warm, config, overrides)
    try:
        # Every held-out row of the environment (no data.val_max_prompts cap), run as its episodes.
        assert len(held_out.val_ds) == 6 and held_out.agent is not None
        assert {p.data_source for p in held_out.val_ds} == {"reasoning_gym/spell_backward"}
        assert 0.0 <= held_out.accuracy() <= 1.0
    finally:
        held_out.close()
