"""``bench/gpu_check.py``, the GPU check (issue 20, P7): its CPU dry-run runs every stage through
the project's real code and prints the tables; a failing stage is reported and the others still
run; on a GPU (``gpu``-marked) the real check passes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline_helpers import bench_module

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["env", "config", "model", "learner", "sync", "async", "weight-sync-check"]
FIGURES = ["generation tokens/s (sync, engine time)", "generation tokens/s (async, wall time)",
           "learner tokens/s (learner alone)", "learner tokens/s (sync run)", "weight sync s (sync run)",
           "weight sync GB/s (sync run)", "step time sync / async", "async speed-up (sync step / async step)"]


def _gpu_check():
    """``bench/gpu_check.py`` as a module."""
    return bench_module("gpu_check")


def _run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout_s)


def _summary(out: str) -> list[str]:
    assert "==== gpu_check summary" in out, out[-3000:]
    return out.split("==== gpu_check summary", 1)[1].splitlines()


@pytest.mark.slow
def test_dry_run_passes_every_stage_and_prints_the_tables(tmp_path):
    """The whole check on CPU (tiny model, HF engine, gloo, sdpa, colocated/shm): every stage
    PASS, the stage table and the figures table with a value in each figure row."""
    proc = _run(["--dry-run", "--workdir", str(tmp_path / "work"), "--out-dir", str(tmp_path / "out")], 900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for stage in STAGES:
        assert f"PASS {stage} (" in out, f"stage {stage} did not pass:\n{out[-4000:]}"
    summary = _summary(out)
    assert "dry-run on CPU: figures meaningless" in summary[0]
    stage_table = summary[2:summary.index("")]  # the stage table ends at the first blank line
    assert {line.split()[0]: line.split()[1] for line in stage_table} == {stage: "PASS" for stage in STAGES}
    for figure in FIGURES:
        line = next((ln for ln in summary if ln.startswith(figure)), None)
        assert line is not None, f"no figure row {figure!r}"
        value = line[len(figure):].split()[0]
        assert value != "-", f"figure row without a value: {line}"
        assert line.endswith("(dry-run)")
    assert "0 stage(s) failed" in out
    out_files = {p.name for p in (tmp_path / "out").iterdir()}
    assert out_files == {"gpu_check_learner.log", "gpu_check_sync.log", "gpu_check_async.log",
                         "gpu_check_weight_sync_check.log", "gpu_check_summary.json"}
    summary_json = json.loads((tmp_path / "out" / "gpu_check_summary.json").read_text())
    assert {k: v["status"] for k, v in summary_json["stages"].items()} == {stage: "PASS" for stage in STAGES}


def test_a_failing_stage_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    """A stage that raises prints FAIL with its one-line reason; the stages after it run, the
    figures it would have given print ``-``, and the exit status is 1."""
    gc = _gpu_check()
    ran = []

    def boom(plan, res, *args):
        raise ValueError("learner.packing: no such key\nsecond line")

    def passes(name):
        def stage(plan, res, *args):
            ran.append(name)
            res.status, res.note = "PASS", "ok"
        return stage

    monkeypatch.setattr(gc, "stage_config", boom)
    for name in ("env", "model", "learner", "weight_sync_check"):
        monkeypatch.setattr(gc, f"stage_{name}", passes(name))
    monkeypatch.setattr(gc, "stage_run", lambda plan, res, mode, *a: passes(mode)(plan, res))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--workdir", str(tmp_path)])
    assert gc.main() == 1
    out = capsys.readouterr().out
    assert "FAIL config (" in out and "ValueError: learner.packing: no such key" in out
    assert "second line" not in out.split("==== gpu_check summary", 1)[1]
    assert ran == ["env", "model", "learner", "sync", "async", "weight_sync_check"]
    assert "1 stage(s) failed" in out
    line = next(ln for ln in _summary(out) if ln.startswith("learner tokens/s (learner alone)"))
    assert line[len("learner tokens/s (learner alone)"):].split()[0] == "-"


def test_reason_and_medians(tmp_path):
    """A failed child's one line is its last error line; run figures are medians over the steps
    after the first."""
    gc = _gpu_check()
    tail = "loading\nTraceback (most recent call last):\n  File \"x.py\", line 1\nImportError: No module named 'vllm'\n"
    assert gc.reason_from(tail, 1, 60) == "exit status 1: ImportError: No module named 'vllm'"
    assert gc.reason_from("still going", None, 60).startswith("did not finish within 60 s")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("\n".join([
        '{"step": 0, "eval/accuracy": 0.1}',
        '{"step": 1, "timing/step_s": 9.0, "perf/train_tokens_per_s": 1.0}',
        '{"step": 2, "timing/step_s": 2.0, "perf/train_tokens_per_s": 10.0}',
        '{"step": 3, "timing/step_s": 4.0, "perf/train_tokens_per_s": 30.0}',
        '{"step": 4, "timing/step_s": 3.0, "perf/train_tokens_per_s": 20.0}']))
    med, n = gc.medians(metrics, ("timing/step_s", "perf/train_tokens_per_s", "timing/weight_sync_s"))
    assert n == 4
    assert med == {"timing/step_s": 3.0, "perf/train_tokens_per_s": 20.0}


def test_gpu_overrides_name_the_gpu_pipeline():
    """The GPU plan's runs: vLLM in bf16, FSDP2 bf16 on CUDA with packing, a bf16 wire, one
    engine actor holding the GPU in async mode."""
    gc = _gpu_check()
    plan = gc.Plan(False, "/w", "/w/model", "vllm", "flash_attention_2", gc.Workload(32, 8, 256, 4, 8192), 450)
    sync, async_ = gc.overrides(plan, "sync"), gc.overrides(plan, "async")
    for key in ("generator.backend=vllm", "generator.vllm.dtype=bfloat16", "learner.device=cuda",
                "learner.mixed_precision=bf16", "learner.packing=True",
                "learner.attn_implementation=flash_attention_2", "weight_sync.wire_dtype=bfloat16"):
        assert key in sync and key in async_
    assert "trainer.mode=sync" in sync and "generator.num_workers=1" not in sync
    assert {"trainer.mode=async", "generator.num_workers=1", "generator.num_gpus_per_worker=1"} <= set(async_)


def test_gpu_overrides_with_the_hf_engine():
    """``--engine hf`` on a GPU (an image without vLLM): transformers' engine on CUDA in bf16,
    no vLLM key; the same learner and wire settings."""
    gc = _gpu_check()
    plan = gc.Plan(False, "/w", "/w/model", "hf", "sdpa", gc.Workload(32, 8, 256, 4, 8192), 450)
    for mode in ("sync", "async"):
        ov = gc.overrides(plan, mode)
        assert {"generator.backend=hf", "generator.hf.device=cuda", "generator.hf.dtype=bfloat16",
                "learner.device=cuda", "learner.mixed_precision=bf16", "weight_sync.wire_dtype=bfloat16"} <= set(ov)
        assert not [o for o in ov if o.startswith("generator.vllm.")]


def test_a_run_whose_library_is_missing_fails_at_once_naming_it(tmp_path, monkeypatch):
    """A run whose engine (vLLM) or pool (Ray) library is not installed fails without starting a
    process, in one line naming the module."""
    gc = _gpu_check()
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("ray", "vllm") else real_find_spec(name, *a))
    monkeypatch.setattr(gc, "run_process", lambda *a: pytest.fail("a process was started"))
    w = gc.Workload(2, 2, 8, 2, 256)
    for engine, mode, wanted in (("hf", "async", ["ray"]), ("vllm", "sync", ["vllm"]),
                                 ("vllm", "async", ["vllm", "ray"])):
        plan = gc.Plan(False, str(tmp_path), str(tmp_path / "model"), engine, "sdpa", w, 60)
        res = gc.StageResult(mode)
        gc.stage_run(plan, res, mode, 60, tmp_path, 1.0)
        assert res.status == "FAIL" and res.note.startswith("not run: ")
        assert [m for m in ("vllm", "ray") if f"No module named '{m}'" in res.note] == wanted
        assert "\n" not in res.note
    assert gc.missing_modules(gc.Plan(False, "/w", "/m", "hf", "sdpa", w, 60), "sync") == []


@pytest.mark.gpu
def test_gpu_check_passes_on_a_gpu(tmp_path):
    """The real check on a CUDA machine with vLLM and Ray: every stage passes."""
    pytest.importorskip("vllm", reason="the sync and async stages need vLLM built for CUDA")
    pytest.importorskip("ray", reason="the async stage needs Ray")
    proc = _run(["--workdir", str(tmp_path / "work")], 600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for stage in STAGES:
        assert f"PASS {stage} (" in out, out[-6000:]
