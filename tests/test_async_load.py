"""Load: the generator pool samples far faster than the learner trains (issue 18, acceptance 3).

The learner is slowed legitimately: with ``learner.world_size=1`` it runs in this process (the
trainer's driver), and its ``train_step`` sleeps before training. The generators then run as far
ahead as admission control lets them, and the test checks what must hold under that pressure:

* the replay buffer's peak resident size stays within the bound admission control guarantees
  (``async_loop.buffer_bound``: ``(max_staleness + 1) · B`` groups), and fills most of it;
* no trained sample is more than ``max_staleness`` policy versions old;
* the ledger balances: every dispatched group ended trained, rejected, dropped by dynamic
  sampling, evicted as stale, abandoned or left over at exit, and no sample was dropped but as a
  counted duplicate or late arrival.

Its figures (speed ratio, peak vs bound, staleness, ledger) print as a short report: run with
``python -m pytest -s -m slow tests/test_async_load.py`` (about a minute per case).
"""

from __future__ import annotations

import json
import time

import pytest

from async_rl.trainer import train
from pipeline_helpers import small_run_cfg

LEARNER_SLEEP_S = 2.0
"""Seconds each training step sleeps: a learner at a few samples per second, while the tiny
model's actors sample tens per second."""

LEDGER_ENDS = ("trained", "rejected", "stale", "abandoned", "dynamic_sampling_dropped", "ready_unused",
               "partial_at_exit", "queued_at_exit", "spread_partly_trained_at_exit")
"""Where a dispatched group can end (``AsyncLoop.ledger``), each counted where it happened."""


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [1, 2])
def test_generators_far_faster_than_the_learner_stay_bounded(tmp_path, ray_session, monkeypatch, max_staleness):
    from async_rl.learners.fsdp import FSDPLearner

    original = FSDPLearner.train_step
    train_calls: list[tuple[int, float]] = []  # (samples, seconds) per step, as the learner saw them

    def slow_train_step(self, batch, **kwargs):
        t0 = time.perf_counter()
        time.sleep(LEARNER_SLEEP_S)
        out = original(self, batch, **kwargs)
        train_calls.append((len(batch), time.perf_counter() - t0))
        return out

    monkeypatch.setattr(FSDPLearner, "train_step", slow_train_step)
    steps, B, n, name = 6, 4, 4, f"load{max_staleness}"
    # A version per step (B groups each): the bounds below are in steps (a version per mini-batch
    # has its own admission test in test_async_pipeline.py).
    summary = train(small_run_cfg(tmp_path, name, "trainer.mode=async", f"trainer.max_staleness={max_staleness}",
                                  f"trainer.total_steps={steps}", "generator.num_workers=2",
                                  "trainer.policy_version_per=step"))
    rows = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["step"] >= 1 and "policy/version" in r]

    # The learner ran here, in the driver, once per step: the sleep slowed the real one.
    assert [s for s, _ in train_calls] == [B * n] * steps and len(rows) == steps
    learner_rate = sum(s for s, _ in train_calls) / sum(t for _, t in train_calls)
    workers = 2
    generator_rate = summary["perf/generated_samples"] / (summary["perf/generator_busy_s"] / workers)

    bound = {k: summary[f"buffer/bound_{k}"] for k in ("groups", "samples", "tokens")}
    peak = {k: summary[f"buffer/peak_{k}"] for k in ("groups", "samples", "tokens")}
    ledger = {k: int(summary[f"pipeline/{k}"]) for k in ("dispatched",) + LEDGER_ENDS}
    unaccounted = int(summary["pipeline/unstarted_or_in_engine_at_exit"])
    stale_max = max(r["staleness/max"] for r in rows)
    print(f"\nload test, max_staleness={max_staleness}, B={B} groups x n={n} samples, {steps} steps:\n"
          f"  generator pool {generator_rate:.1f} samples/s while sampling ({workers} actors), learner "
          f"{learner_rate:.2f} samples/s: ratio {generator_rate / learner_rate:.0f}x\n"
          f"  buffer peak {peak['groups']:.0f} groups / {peak['samples']:.0f} samples / {peak['tokens']:.0f} tokens, "
          f"bound {bound['groups']:.0f} / {bound['samples']:.0f} / {bound['tokens']:.0f}\n"
          f"  staleness max {stale_max:.0f} (bound {max_staleness}), per step "
          f"{[int(r['staleness/max']) for r in rows]}\n"
          f"  ledger {ledger}, unaccounted {unaccounted}; dropped samples: duplicate {summary['pipeline/dropped_duplicate_samples']}, "
          f"late {summary['buffer/dropped_late']}")

    assert bound["groups"] == (max_staleness + 1) * B and bound["samples"] == bound["groups"] * n
    assert all(peak[k] <= bound[k] for k in bound), (peak, bound)
    # The generators did run ahead: while the learner slept they filled the admission window
    # beyond one step's worth, and trained some data that was max_staleness versions old.
    assert peak["groups"] >= max_staleness * B
    assert stale_max == max_staleness
    assert all(r["staleness/max"] <= max_staleness for r in rows)
    assert all(r.get(f"staleness/hist_{max_staleness + 1}", 0) == 0 for r in rows)
    # Every dispatched group is accounted for by a counted end (the ledger's remainder, groups
    # neither seen nor queued at exit, is 0), and the only samples dropped are counted ones.
    assert ledger["dispatched"] == sum(ledger[k] for k in LEDGER_ENDS)
    assert ledger["trained"] == steps * B
    assert summary["pipeline/dropped_duplicate_samples"] == summary["pipeline/malformed_messages"] == 0
