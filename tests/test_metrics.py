"""Tests for async_rl.runtime.metrics: every sink is read back from disk after the logger closes.

Run with ``pytest tests/test_metrics.py`` (a few seconds; W&B runs offline, never online).
"""

import json
import logging
import math
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.runtime.metrics import LoggingConfig, MetricsLogger, WandbConfig, metric_reduction, reduce_metrics

QUIET = dict(progress=False, console_every_steps=0)


def read_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# --- config ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, key",
    [
        (lambda: WandbConfig(mode="cloud"), "logging.wandb.mode"),
        (lambda: WandbConfig(project=""), "logging.wandb.project"),
        (lambda: WandbConfig(name=""), "logging.wandb.name"),
        (lambda: LoggingConfig(console_every_steps=-1), "logging.console_every_steps"),
    ],
)
def test_config_validation_names_the_key(make, key):
    with pytest.raises(ValueError, match=key):
        make()


def test_config_builds_from_omegaconf_dotlist():
    from omegaconf import OmegaConf

    merged = OmegaConf.merge(
        OmegaConf.structured(LoggingConfig),
        OmegaConf.from_dotlist(["console_every_steps=5", "wandb.mode=offline", "wandb.tags=[a]"]),
    )
    cfg = OmegaConf.to_object(merged)
    expected = LoggingConfig(console_every_steps=5, wandb=WandbConfig(mode="offline", tags=["a"]))
    assert cfg == expected
    with pytest.raises(ValueError, match="logging.console_every_steps must be >= 0, got -1"):
        OmegaConf.to_object(OmegaConf.merge(merged, {"console_every_steps": -1}))


def test_wandb_options_without_effect_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="async_rl.runtime.metrics"):
        WandbConfig(mode="disabled", tags=["x"])
    assert "no effect" in caplog.text


# --- JSONL ----------------------------------------------------------------------------------


def test_jsonl_records_values_types_and_nonfinite_as_null(tmp_path, caplog):
    logger = MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=2)
    with caplog.at_level(logging.WARNING, logger="async_rl.runtime.metrics"):
        logger.log(
            {
                "loss/pg": torch.tensor(0.25),
                "loss/kl": torch.tensor([1.5], dtype=torch.bfloat16),
                "rollout/reward_mean": np.float32(0.5),
                "rollout/num_samples": 64,
                "perf/tokens_per_s": 1234.5,
                "nonamespace": 1.0,
            },
            step=1,
        )
        # Readable before close: a crashed run keeps what it logged.
        assert read_jsonl(tmp_path)[0]["loss/pg"] == 0.25
        logger.log({"loss/pg": float("nan"), "nonamespace": 2.0}, step=2)
        logger.log({"loss/pg": torch.tensor(float("inf")), "eval/accuracy": 0.75}, step=2)
    logger.close()

    first, second, third = read_jsonl(tmp_path)
    assert first["step"] == 1 and first["time_s"] >= 0
    assert first["loss/pg"] == 0.25 and type(first["loss/pg"]) is float
    assert first["loss/kl"] == 1.5
    assert first["rollout/reward_mean"] == 0.5
    assert first["rollout/num_samples"] == 64 and type(first["rollout/num_samples"]) is int
    assert first["perf/tokens_per_s"] == 1234.5
    assert second == {"step": 2, "time_s": second["time_s"], "loss/pg": None, "nonamespace": 2.0}
    assert third["loss/pg"] is None and third["eval/accuracy"] == 0.75
    assert third["time_s"] >= second["time_s"] >= first["time_s"]
    assert logger.num_nonfinite == 2
    # One warning per key, not per occurrence.
    assert caplog.text.count("'nonamespace' has no namespace") == 1
    assert caplog.text.count("metric 'loss/pg' is") == 1


def test_jsonl_appends_on_resume(tmp_path):
    for step in (1, 2):
        with MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=2) as logger:
            logger.log({"loss/pg": float(step)}, step=step)
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1, 2]


@pytest.mark.parametrize(
    "metrics, error",
    [
        ({"loss/pg": torch.ones(2)}, ValueError),
        ({"loss/pg": np.ones(3)}, ValueError),
        ({"step": 1.0}, ValueError),
        ({"loss/pg": "high"}, TypeError),
        ({3: 1.0}, TypeError),
    ],
)
def test_log_rejects_bad_metrics(tmp_path, metrics, error):
    with MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=1) as logger:
        with pytest.raises(error):
            logger.log(metrics, step=1)


def test_close_is_idempotent_and_log_after_close_raises(tmp_path):
    logger = MetricsLogger(LoggingConfig(tensorboard=True), tmp_path, total_steps=1)
    logger.log({"loss/pg": 1.0}, step=1)
    logger.close()
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log({"loss/pg": 1.0}, step=2)
    with pytest.raises(ValueError, match="total_steps"):
        MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=-1)


# --- console --------------------------------------------------------------------------------


def test_console_summary_every_k_steps_and_final_bar(tmp_path, capsys):
    cfg = LoggingConfig(jsonl=False, progress=True, console_every_steps=2)
    with MetricsLogger(cfg, tmp_path, total_steps=5) as logger:
        for step in range(1, 6):
            logger.log({"rollout/reward_mean": 1 / 3, "loss/pg": -0.0123456, "x/y": 7.0}, step)
            if step == 4:
                logger.log({"eval/accuracy": torch.tensor(0.875)}, step)
            logger.advance(step)
        logger.print("note [not markup]")
    out = capsys.readouterr().out
    lines = out.splitlines()
    summaries = [line for line in lines if line.startswith("step ")]
    # Every 2nd step, plus the last one.
    assert [s.split(" | ")[0] for s in summaries] == ["step 2/5", "step 4/5", "step 5/5"]
    assert "reward 0.3333 | loss_pg -0.01235" in summaries[0]
    assert "eval_acc" not in summaries[0]
    # Eval logged at the same step joins that step's line.
    assert "reward 0.3333 | eval_acc 0.875 | loss_pg -0.01235" in summaries[1]
    assert "note [not markup]" in lines
    # Off a terminal rich draws the bar once, when the logger closes.
    assert lines[-1].startswith("train") and "5/5" in lines[-1]


def _hms(text: str) -> int:
    h, m, s = (int(x) for x in text.split(":"))
    return 3600 * h + 60 * m + s


def test_resume_continues_the_clock_from_the_checkpoint(tmp_path, capsys):
    """After ``resume(step, elapsed_s)`` the JSONL ``time_s``, the summary line's clock and the bar's
    elapsed time continue from the saved seconds (5 h here), not from 0; the bar starts at the
    resumed step."""
    saved = 5 * 3600.0
    cfg = LoggingConfig(progress=True, console_every_steps=1)
    with MetricsLogger(cfg, tmp_path, total_steps=5) as logger:
        t0 = time.perf_counter()
        logger.resume(3, saved)
        for step in (4, 5):
            logger.log({"loss/pg": 0.5}, step)
            logger.advance(step)
        since = time.perf_counter() - t0
    lines = capsys.readouterr().out.splitlines()
    times = [r["time_s"] for r in read_jsonl(tmp_path)]
    assert len(times) == 2 and all(saved <= t <= saved + since + 0.01 for t in times), (times, since)
    summaries = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in summaries] == ["step 4/5", "step 5/5"]
    for s in summaries:
        assert saved <= _hms(s.split(" | ")[1]) <= saved + since + 1, s
    bar = lines[-1].split()
    assert bar[0] == "train" and "5/5" in bar
    assert saved <= _hms(bar[bar.index("5/5") + 1]) <= saved + since + 1, lines[-1]


@pytest.mark.parametrize("step, elapsed_s", [(-1, 0.0), (1, -1.0), (1, math.nan)])
def test_resume_rejects_bad_values(tmp_path, step, elapsed_s):
    with MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=2) as logger:
        with pytest.raises(ValueError, match="step" if step < 0 else "elapsed_s"):
            logger.resume(step, elapsed_s)


def test_phase_shows_its_own_bar_with_info(tmp_path, capsys):
    """A warm start's bar: its own description, done/total and the info text, beside the training
    bar that has not moved; without a progress bar the update callable is a no-op."""
    cfg = LoggingConfig(jsonl=False, progress=True, console_every_steps=0)
    with MetricsLogger(cfg, tmp_path, total_steps=300) as logger:
        with logger.phase("warm start", total=4) as update:
            for k in range(1, 5):
                update(k, f"loss {1.0 / k:.4f}")
    lines = capsys.readouterr().out.splitlines()
    warm = [line for line in lines if line.startswith("warm start")]
    assert len(warm) == 1 and "4/4" in warm[0] and warm[0].rstrip().endswith("loss 0.2500"), lines
    train = [line for line in lines if line.startswith("train")]
    assert len(train) == 1 and "0/300" in train[0], lines

    with MetricsLogger(LoggingConfig(**QUIET), tmp_path, total_steps=1) as logger:
        with logger.phase("warm start", total=2) as update:
            update(1, "x")
        with pytest.raises(ValueError, match="total"):
            with logger.phase("warm start", total=-1):
                pass
    assert "warm start" not in capsys.readouterr().out


# --- TensorBoard ----------------------------------------------------------------------------


def test_tensorboard_scalars_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = LoggingConfig(jsonl=False, tensorboard=True, **QUIET)
    with MetricsLogger(cfg, tmp_path, total_steps=3) as logger:
        for step in range(1, 4):
            logger.log({"loss/pg": torch.tensor(0.5 * step), "perf/tokens_per_s": 100 * step}, step)
        logger.log({"eval/accuracy": 0.25}, step=3)

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss/pg")] == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert [e.value for e in acc.Scalars("perf/tokens_per_s")] == [100, 200, 300]
    assert [(e.step, e.value) for e in acc.Scalars("eval/accuracy")] == [(3, 0.25)]


# --- Weights & Biases -----------------------------------------------------------------------


def read_wandb_records(path: Path) -> list:
    """Parses a ``run-*.wandb`` transaction log into ``wandb_internal_pb2.Record`` messages.

    wandb 0.31 writes no ``wandb-summary.json`` or ``config.yaml`` for offline runs; everything
    goes into this file. Its layout: a 7-byte header (``:W&B``, magic 0xBEE1 little-endian,
    version 0), then 32 KiB blocks of chunks, each ``crc32 (u32 LE) | length (u16 LE) | type (u8)
    | payload``, where type 1 is a whole record and 2/3/4 are its first/middle/last pieces; a block
    tail shorter than a chunk header is zero padding. The CRC covers the type byte and payload.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    block, header = 32 * 1024, 7
    records, pieces, offset = [], b"", header
    while offset + header <= len(data):
        room = block - offset % block
        if room < header:
            offset += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[offset : offset + header])
        if kind == 0:  # zero padding up to the block end
            offset += room
            continue
        payload = data[offset + header : offset + header + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"bad checksum at byte {offset}"
        offset += header + length
        pieces = payload if kind in (1, 2) else pieces + payload
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            records.append(record)
    return records


def item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def test_wandb_offline_run_read_back(tmp_path, monkeypatch):
    # Keep wandb's settings and caches inside the test directory.
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run_dir = tmp_path / "grpo-tiny"
    cfg = LoggingConfig(**QUIET, wandb=WandbConfig(mode="offline", project="tests", tags=["ci"]))
    run_config = {"learner": {"lr": 1e-6}, "num_steps": 3}
    with MetricsLogger(cfg, run_dir, total_steps=3, run_config=run_config) as logger:
        for step in range(1, 4):
            logger.log({"loss/pg": torch.tensor(0.5 * step), "rollout/reward_mean": step / 4}, step)
        logger.log({"eval/accuracy": np.float64(0.625)}, step=3)

    (log_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's service process (shared by the whole pytest process once an earlier test started
    # it) may still be writing the file when finish() returns: read until the run record is in.
    deadline = time.monotonic() + 30
    records = read_wandb_records(log_file)
    while not any(r.WhichOneof("record_type") == "exit" for r in records) and time.monotonic() < deadline:
        time.sleep(0.2)
        records = read_wandb_records(log_file)

    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "tests" and run.display_name == "grpo-tiny" and list(run.tags) == ["ci"]
    config = {item_key(u): json.loads(u.value_json) for u in run.config.update}
    assert config["learner"] == {"lr": 1e-6} and config["num_steps"] == 3

    history = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item_key(i): json.loads(i.value_json) for i in r.history.item}
            history.setdefault(row["_step"], {}).update(row)
    assert sorted(history) == [1, 2, 3]
    assert [history[s]["loss/pg"] for s in (1, 2, 3)] == [0.5, 1.0, 1.5]
    assert history[3]["rollout/reward_mean"] == 0.75 and history[3]["eval/accuracy"] == 0.625

    # Summary updates are incremental; folding them in order gives the final summary.
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({item_key(u): json.loads(u.value_json) for u in r.summary.update})
    assert summary["_step"] == 3
    assert summary["loss/pg"] == 1.5
    assert summary["rollout/reward_mean"] == 0.75
    assert summary["eval/accuracy"] == 0.625


def test_wandb_online_without_credentials_raises_instead_of_prompting(tmp_path, monkeypatch):
    import wandb

    calls = []
    monkeypatch.setattr(wandb, "login", lambda **kw: calls.append(kw) or False)
    monkeypatch.setattr(wandb, "init", lambda **kw: pytest.fail("wandb.init must not run"))
    cfg = LoggingConfig(**QUIET, wandb=WandbConfig(mode="online"))
    with pytest.raises(ValueError, match="logging.wandb.mode"):
        MetricsLogger(cfg, tmp_path, total_steps=1)
    assert calls == [{"prompt": False, "verify": False}]


# --- reduce_metrics -------------------------------------------------------------------------


def test_reduce_metrics_weighted_mean_skips_absent_keys():
    micro = [
        {"loss/pg": torch.tensor(1.0), "loss/kl": torch.tensor(4.0)},
        {"loss/pg": torch.tensor(3.0, dtype=torch.bfloat16)},
    ]
    out = reduce_metrics(micro, weights=[1, 3])
    assert list(out) == ["loss/pg", "loss/kl"]
    assert out["loss/pg"].item() == pytest.approx((1 * 1 + 3 * 3) / 4)
    assert out["loss/kl"].item() == 4.0
    assert out["loss/pg"].dtype == torch.float32 and out["loss/pg"].shape == ()


def test_reduce_metrics_unweighted_tensor_weights_and_zero_weight():
    micro = [{"a/x": torch.tensor(2.0)}, {"a/x": torch.tensor(4.0)}, {"a/x": torch.tensor(9.0)}]
    assert reduce_metrics(micro)["a/x"].item() == pytest.approx(5.0)
    # Token counts as tensors (as the learner has them) stay on device: no .item() needed.
    counts = [torch.tensor(3), torch.tensor(1), torch.tensor(0)]
    assert reduce_metrics(micro, weights=counts)["a/x"].item() == pytest.approx(2.5)
    assert math.isnan(reduce_metrics(micro, weights=[0, 0, 0])["a/x"].item())
    # Matches the metric computed on the whole batch at once when weighted by token counts.
    tokens = torch.tensor([0.5, 1.5, 2.0, 4.0, 6.0])
    micro = [{"m/v": tokens[:2].mean()}, {"m/v": tokens[2:].mean()}]
    whole = reduce_metrics(micro, weights=[2, 3])["m/v"]
    assert whole.item() == pytest.approx(tokens.mean().item())
    grad = torch.tensor(1.0, requires_grad=True)
    assert not reduce_metrics([{"loss/pg": grad * 2}])["loss/pg"].requires_grad


def test_reduce_metrics_extremes_are_max_and_min_of_the_tokens_not_a_mean():
    # A max over micro-batches is the max over the whole batch whatever the cut; a weighted mean
    # of per-micro-batch maxima (what loss/ratio_max was) gives (1*10 + 50*1 + 2*10) / 21 = 3.81.
    ratios = [torch.tensor([1.0, 0.9]), torch.tensor([50.0]), torch.tensor([2.0, 1.1])]
    micro = [{"loss/ratio_max": r.max(), "loss/ratio_min": r.min(), "loss/pg": r.mean()} for r in ratios]
    out = reduce_metrics(micro, weights=[10, 1, 10])
    assert out["loss/ratio_max"].item() == 50.0
    assert out["loss/ratio_min"].item() == pytest.approx(0.9)
    assert out["loss/pg"].item() == pytest.approx((0.95 * 10 + 50 * 1 + 1.55 * 10) / 21)
    assert reduce_metrics(micro)["loss/ratio_max"].item() == 50.0
    # A zero-weight entry (no valid token: its max is a placeholder 0) is skipped, not a minimum.
    micro.append({"loss/ratio_min": torch.tensor(0.0)})
    assert reduce_metrics(micro, weights=[10, 1, 10, 0])["loss/ratio_min"].item() == pytest.approx(0.9)
    assert math.isnan(reduce_metrics(micro[-1:], weights=[0])["loss/ratio_min"].item())
    # Genuine infinities survive (only "nothing weighed" is NaN).
    assert reduce_metrics([{"a/x_max": torch.tensor(math.inf)}], weights=[1])["a/x_max"].item() == math.inf


@pytest.mark.parametrize("key, how", [("loss/ratio_max", "max"), ("staleness/max", "max"), ("x_min", "min"),
                                      ("staleness/min", "min"), ("loss/ratio_mean", "mean"),
                                      ("agent/max_turns", "mean"), ("loss/pg", "mean")])
def test_metric_reduction_by_key(key, how):
    assert metric_reduction(key) == how


@pytest.mark.parametrize(
    "micro, weights, match",
    [
        ([], None, "at least one"),
        ([{"a/x": torch.tensor(1.0)}], [1, 2], "2 weights for 1"),
        ([{"a/x": torch.tensor(1.0)}], [-1], ">= 0"),
    ],
)
def test_reduce_metrics_errors(micro, weights, match):
    with pytest.raises(ValueError, match=match):
        reduce_metrics(micro, weights)
