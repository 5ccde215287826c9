"""``bench/bench_distillation.py`` (issue 35): the figures it derives from curves (steps to the
teacher's level by a trailing mean and by one evaluation, best and final accuracies) on
hand-computed values, and its short form end to end (it checks the machinery, not the figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_helpers import bench_module

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    return bench_module("bench_distillation")


def _curve(sampled, greedy=None, every=10, kl=None):
    greedy = greedy or sampled
    return [{"step": i * every, "rl_s": float(i), "sampled": s, "greedy": g, "policy_version": i * every,
             "reverse_kl": None if kl is None else kl[i]} for i, (s, g) in enumerate(zip(sampled, greedy))]


def test_steps_to_target_use_the_trailing_mean_and_the_first_evaluation():
    b = _bench()
    # target 0.70: one evaluation at 0.72 (step 20) is not enough for the trailing mean of 3
    # (0.40, 0.50, 0.72 -> 0.54; then 0.61, 0.68, 0.683); it reaches 0.70 at step 60
    # ((0.72 + 0.73 + 0.71) / 3 = 0.72).
    s = b.summarize(_curve([0.40, 0.50, 0.72, 0.60, 0.72, 0.73, 0.71],
                           kl=[None, 1.0, 0.8, 0.6, 0.5, 0.4, 0.3]), 0.70)
    assert s["steps_to_target"] == 60 and s["steps_to_target_single"] == 20
    assert s["best"] == 0.73 and s["final"] == 0.71 and s["last_step"] == 60 and s["last_reverse_kl"] == 0.3
    never = b.summarize(_curve([0.3, 0.5, 0.6]), 0.70)
    assert never["steps_to_target"] is None and never["steps_to_target_single"] is None and never["best"] == 0.6


def test_curve_of_reads_evaluations_and_the_reverse_kl_of_their_step(tmp_path):
    b = _bench()
    lines = [{"step": 0, "eval/accuracy": 0.3, "eval/mean@4": 0.25, "time_s": 1.0},
             {"step": 1, "distill/reverse_kl": 1.5, "time_s": 2.0},
             {"step": 2, "distill/reverse_kl": 1.2, "eval/accuracy": 0.5, "eval/mean@4": 0.4,
              "eval/policy_version": 2.0, "time_s": 3.0},
             {"step": 3, "distill/reverse_kl": 1.1, "policy/version": 3.0},
             # an evaluation on the async pool, started after step 3, logged when it ended at step 4
             {"step": 4, "eval/accuracy": 0.6, "eval/mean@4": 0.45, "eval/started_step": 3.0},
             {"step": 4, "distill/reverse_kl": 1.0, "policy/version": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    curve = b.curve_of(tmp_path, 4)
    assert [(p["step"], p["sampled"], p["greedy"], p["reverse_kl"]) for p in curve] == [
        (0, 0.25, 0.3, None), (2, 0.4, 0.5, 1.2), (3, 0.45, 0.6, 1.1)]


def test_report_names_the_target_and_every_contender():
    b = _bench()
    result = {"teacher": {"path": "t", "samples": 16, "sampled": 0.77, "sampled_se": 0.04, "greedy": 0.775},
              "points": 2.0, "samples": 8, "target": 0.75,
              "summary": {"distill_sync": b.summarize(_curve([0.3, 0.76, 0.77, 0.78]), 0.75),
                          "rl_sync": b.summarize(_curve([0.3, 0.5, 0.6]), 0.75)}}
    text = b.report(result)
    assert "target (mean@16 - 2 points) 0.750" in text
    assert "| distill_sync | 30 | 10 | 0.780 |" in text and "| rl_sync | never in 20 | never in 20 |" in text


@pytest.mark.slow
def test_short_form_runs_teacher_contenders_and_writes_table_and_plot(tmp_path):
    out = tmp_path / "d"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_distillation.py"), "--short", "--out", str(out),
                           "--contenders", "distill_sync,distill_async,rl_sync"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "distillation.json").read_text())
    assert list(result["summary"]) == ["distill_sync", "distill_async", "rl_sync"]
    assert [p["step"] for p in result["curves"]["distill_sync"]] == [0, 2, 3]
    assert result["curves"]["distill_sync"][-1]["reverse_kl"] is not None  # the teacher scored its samples
    assert result["curves"]["rl_sync"][-1]["reverse_kl"] is None
    assert (out / "distillation.png").stat().st_size > 10_000
    assert "| distill_async |" in proc.stdout
