"""Evaluation on the async pool (``async_rl.loops.evaluation``, ``trainer.eval_on_pool``): the broker
hands evaluation groups out only in idle time and keeps them out of the exactly-once accounting,
the intake routes their messages away from the replay buffer, the metrics carry the policy
versions measured, a lost actor abandons the evaluation, and a real async run logs them while the
learner trains."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from async_rl.buffers.trajectory import Trajectory
from async_rl.buffers.transport import GroupClosed
from async_rl.generators.base import SamplingParams
from async_rl.loops.actors import RequestBroker
from async_rl.loops.evaluation import PoolEvaluation
from async_rl.loops.intake import Intake
from async_rl.step.evaluation import EVAL_FIRST_GROUP_ID, EvalAtK
from async_rl.step.rollout import GroupRequest

from pipeline_helpers import small_run_cfg


class _Prompt:
    def __init__(self, i: int, source: str = "arithmetic") -> None:
        self.prompt_ids, self.uid, self.data_source = [1, 2, i], f"p{i}", source
        self.ground_truth, self.extra_info, self.messages = str(i), {}, []


class _Dataset:
    def __init__(self, k: int) -> None:
        self.prompts = [_Prompt(i) for i in range(k)]

    def __iter__(self):
        return iter(self.prompts)

    def __len__(self) -> int:
        return len(self.prompts)


GREEDY = SamplingParams(greedy=True, max_tokens=8, stop_token_ids=(0,))
AT_K = EvalAtK(4, SamplingParams(temperature=0.8, max_tokens=8, stop_token_ids=(0,)))


def _traj(gid: int, j: int, text: str, acc: float, version: int, uid: str) -> Trajectory:
    return Trajectory(trajectory_id=f"{gid}/{j}", group_id=gid, prompt_uid=uid, prompt_ids=[1],
                      response_ids=[5, 6], behavior_logprobs=[-0.1, -0.2], loss_mask=[1, 1], finish_reason="stop",
                      policy_version=[version, version], reward=acc, reward_extras={"acc": acc}, response_text=text)


def _request(gid: int, n: int = 2, params=None) -> GroupRequest:
    return GroupRequest(gid, [1], f"u{gid}", "arithmetic", "1", {}, n, 0, params=params)


def test_the_broker_hands_out_evaluation_groups_only_when_no_training_request_waits():
    broker = RequestBroker()  # one worker: idle in take is the whole pool idle
    broker.put_eval([_request(-10 + i, 1, GREEDY) for i in range(5)])
    broker.put_many([_request(0), _request(1)])
    assert broker.qsize() == 2  # evaluation groups are not the ledger's queue
    first = broker.take((0, 0), max_samples=64, timeout_s=0.1)
    assert [r.group_id for r in first] == [0, 1]
    evals = broker.take((0, 0), max_samples=3, timeout_s=0.1)  # idle: evaluation, up to the engine batch
    assert [r.group_id for r in evals] == [-10, -9, -8]
    assert broker.claimed() == {(0, 0): [0, 1]}  # evaluation groups are never claimed
    broker.put_many([_request(2)])
    # Back for more: training first, then the evaluation's next share.
    assert [r.group_id for r in broker.take((0, 0), 64, 0.1)] == [2]
    assert [r.group_id for r in broker.take((0, 0), 1, 0.1)] == [-7]
    assert broker.drop_eval() == 1 and broker.take((0, 0), 64, 0.05) == []
    # At most EVAL_TAKE_SAMPLES samples a take, but always one whole group.
    broker.put_eval([_request(-20, 16, AT_K.params), _request(-21, 4, AT_K.params), _request(-22, 8, AT_K.params)])
    assert [r.group_id for r in broker.take((0, 0), 64, 0.1)] == [-20]
    assert [r.group_id for r in broker.take((0, 0), 64, 0.1)] == [-21]  # 4 + 8 > EVAL_TAKE_SAMPLES
    assert broker.EVAL_TAKE_SAMPLES == 8


def _take_in_thread(broker: RequestBroker, worker: tuple[int, int], timeout_s: float):
    out: list = []
    thread = threading.Thread(target=lambda: out.extend(broker.take(worker, 64, timeout_s)))
    thread.start()
    return thread, out


def test_an_evaluation_waits_until_every_live_worker_is_idle():
    """With two workers, evaluation groups go out only while both wait in take: a worker busy
    with training is not left alone with the training requests that arrive meanwhile."""
    broker = RequestBroker(num_workers=2)
    broker.put_eval([_request(-10 + i, 8, AT_K.params) for i in range(4)])  # one group a take
    assert broker.take((0, 0), 64, 0.05) == []  # (1, 0) is busy (not in take): no evaluation
    waiting, got = _take_in_thread(broker, (1, 0), 0.5)  # (1, 0) becomes idle ...
    time.sleep(0.05)
    mine = broker.take((0, 0), 64, 0.2)  # ... so one of the two takes the evaluation's share
    waiting.join()
    assert sorted(r.group_id for r in mine + got) == [-10]
    evaluating = (0, 0) if mine else (1, 0)
    other = (1, 0) if mine else (0, 0)
    # One worker evaluates at a time; a training request goes to the other at once.
    assert broker.take(other, 64, 0.05) == []
    broker.put_many([_request(0)])
    assert [r.group_id for r in broker.take(other, 64, 0.1)] == [0]
    # A reclaimed worker leaves the pool one worker smaller: the survivor alone is all of it idle.
    broker.reclaim(other)
    assert [r.group_id for r in broker.take(evaluating, 64, 0.1)] == [-9]
    assert broker.take(other, 64, 0.05) == []  # the dead incarnation gets nothing, and is not idle
    # Its replacement (next incarnation) counts again from its first take: busy, no evaluation ...
    broker.put_many([_request(1)])
    assert [r.group_id for r in broker.take((other[0], 1), 64, 0.1)] == [1]
    assert broker.take(evaluating, 64, 0.05) == []
    waiting, got = _take_in_thread(broker, (other[0], 1), 0.5)  # ... until it waits in take too
    time.sleep(0.05)
    mine = broker.take(evaluating, 64, 0.2)
    waiting.join()
    assert sorted(r.group_id for r in mine + got) == [-8]
    with pytest.raises(ValueError, match="num_workers"):
        RequestBroker(num_workers=0)


def test_an_evaluation_collects_its_groups_and_tags_the_versions_it_measured():
    ev = PoolEvaluation(_Dataset(3), GREEDY, AT_K)
    requests = ev.start(step=10)
    assert len(requests) == 6 and all(r.group_id < 0 for r in requests)
    assert [r.n for r in requests] == [1, 1, 1, 4, 4, 4]
    assert all(r.params is GREEDY for r in requests[:3]) and all(r.params is AT_K.params for r in requests[3:])
    assert ev.start(step=12) is None and ev.counts["eval/skipped_busy"] == 1  # one at a time
    single, sampled = requests[:3], requests[3:]
    for k, r in enumerate(single):
        ev.add(_traj(r.group_id, 0, str(k), float(k == 0), 40 + k, r.prompt_uid))
        ev.add(GroupClosed(r.group_id, 1))
    for r in sampled[:2]:
        for j in range(4):
            ev.add(_traj(r.group_id, j, "7", float(j == 0), 42, r.prompt_uid))
        ev.add(GroupClosed(r.group_id, 4))
    assert ev.poll() is None  # one group still open
    ev.add(_traj(sampled[2].group_id, 9, "x", 1.0, 42, sampled[2].prompt_uid))  # outside its group
    assert ev.counts["eval/refused_messages"] == 1
    ev.add(GroupClosed(sampled[2].group_id, 0))  # every sample rejected by the reward: all wrong
    out = ev.poll()
    assert out["eval/accuracy"] == pytest.approx(1 / 3) and out["eval/num_prompts"] == 3
    assert out["eval/policy_version"] == 40 and out["eval/policy_version_max"] == 42
    assert out["eval/started_step"] == 10 and out["eval/wall_s"] >= 0
    assert out["eval/pass@1"] == pytest.approx((0.25 + 0.25 + 0) / 3)
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert not ev.running and ev.poll() is None
    # A late message of a finished evaluation is still an evaluation's, never the buffer's.
    assert ev.accepts(requests[0].group_id) and not ev.accepts(0) and not ev.accepts(EVAL_FIRST_GROUP_ID - 1)
    ev.add(_traj(requests[0].group_id, 0, "0", 1.0, 40, "p0"))
    assert ev.counts["eval/refused_messages"] == 2
    # The next evaluation's ids are new.
    later = ev.start(step=20)
    assert min(r.group_id for r in later) > max(r.group_id for r in requests)


def test_a_lost_generator_abandons_the_running_evaluation():
    ev = PoolEvaluation(_Dataset(2), GREEDY)
    assert not ev.abandon("nothing runs")
    requests = ev.start(step=4)
    ev.add(_traj(requests[0].group_id, 0, "0", 1.0, 7, "p0"))
    assert ev.abandon("a generator actor was lost") and ev.counts["eval/abandoned"] == 1
    assert ev.poll() is None and not ev.running
    assert ev.start(step=6) is not None  # the next one starts afresh


def test_the_intake_routes_evaluation_messages_away_from_the_buffer():
    class Buffer:
        def __init__(self):
            self.added = []

        def add(self, msg):
            self.added.append(msg)

        def close_group(self, gid, kept):
            self.added.append(("closed", gid))

    buffer, ev = Buffer(), PoolEvaluation(_Dataset(1), GREEDY)
    (request,) = ev.start(step=1)
    intake = Intake(receiver=None, buffer=buffer, knows_group=lambda g: g == 0, group_size=2,
                    learner_version=lambda: 100, on_messages=lambda: None, eval_sink=ev)
    assert intake.route(_traj(request.group_id, 0, "0", 1.0, 3, "p0")) is None
    assert intake.route(GroupClosed(request.group_id, 1)) is None
    assert intake.route(_traj(0, 1, "0", 1.0, 3, "u0")) is None
    assert [getattr(m, "group_id", m) for m in buffer.added] == [0]  # only the training group's
    assert ev.poll()["eval/accuracy"] == 1.0 and intake.refused == {}


def test_async_run_evaluates_on_the_pool_while_training(tmp_path, ray_session):
    from async_rl.trainer import train

    # Staleness 0: the actor has sampled a version's groups before the learner trains on them,
    # so it is idle while the learner trains, every step, and that idle time is what an
    # evaluation is sampled in. At staleness 1 admission keeps it busy on the next version's
    # groups, and whether any evaluation finished in 8 steps depended on the machine's load.
    cfg = small_run_cfg(tmp_path, "pool_eval", "trainer.mode=async", "trainer.total_steps=8",
                        "trainer.eval_every_steps=2", "trainer.eval_samples=2", "trainer.max_staleness=0")
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "pool_eval" / "metrics.jsonl").read_text().splitlines()]
    pooled = [r for r in lines if "eval/started_step" in r]
    started = [2, 4, 6]  # step 8's is the last: on the colocated engine
    finished = [int(r["eval/started_step"]) for r in pooled]
    assert finished and set(finished) <= set(started)
    assert len(finished) + summary["eval/abandoned"] + summary["eval/skipped_busy"] == len(started)
    for r in pooled:
        # A record of its own at the step its last group arrived, never merged with another's.
        assert r["step"] > r["eval/started_step"] and "loss/pg" not in r and "timing/eval_s" not in r
        assert 0 <= r["eval/policy_version"] <= r["eval/policy_version_max"]
        assert r["eval/num_prompts"] <= 8 and "eval/pass@2" in r and "timing/eval_s" not in r
    last = [r for r in lines if r["step"] == 8 and "timing/eval_s" in r]
    assert len(last) == 1 and "eval/started_step" not in last[0]
    assert last[0]["eval/policy_version"] >= max(r["eval/policy_version_max"] for r in pooled)
    # Evaluation groups stay out of the exactly-once ledger and out of the trained batches.
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] >= 0
    assert summary["pipeline/refused_messages"] == 0 and summary["eval/refused_messages"] >= 0
    assert all(np.isfinite(r["eval/accuracy"]) for r in pooled)


def test_an_evaluation_that_ends_as_the_run_closes_is_logged_or_abandoned(tmp_path, ray_session, monkeypatch):
    """Regression: an evaluation whose last group arrived only as the loop closed was neither
    logged nor counted. Its results are held back here until ``close``, so the one started
    after step 2 is still running at steps 4 and 6 (both skipped) and ends only at close."""
    from async_rl.loops.async_loop import AsyncLoop
    from async_rl.trainer import train

    closing = threading.Event()
    poll, close = PoolEvaluation.poll, AsyncLoop.close
    monkeypatch.setattr(PoolEvaluation, "poll", lambda self: poll(self) if closing.is_set() else None)

    def close_then_poll(self):
        closing.set()
        return close(self)

    monkeypatch.setattr(AsyncLoop, "close", close_then_poll)
    cfg = small_run_cfg(tmp_path, "late_eval", "trainer.mode=async", "trainer.total_steps=8",
                        "trainer.eval_every_steps=2")
    summary = train(cfg)
    lines = [json.loads(line) for line in (tmp_path / "late_eval" / "metrics.jsonl").read_text().splitlines()]
    pooled = [r for r in lines if "eval/started_step" in r]
    assert summary["eval/skipped_busy"] == 2
    assert len(pooled) + summary["eval/abandoned"] == 1
    for r in pooled:  # logged at the last step, apart from the final evaluation's record
        assert r["eval/started_step"] == 2 and r["step"] == 8 and "timing/eval_s" not in r
    (final,) = [r for r in lines if r["step"] == 8 and "timing/eval_s" in r]
    assert summary["eval_final"] == final["eval/accuracy"]


def test_the_pool_evaluation_bench_prints_its_ratio(tmp_path, ray_session, monkeypatch, capsys):
    """The bench's machinery in a short form (its figures come from the full run by hand)."""
    from pipeline_helpers import bench_module

    bench = bench_module("bench_pool_eval")
    # Staleness 0, as in the async run above: the actor idles while the learner trains, so an
    # evaluation finishes within the short run whatever the machine's load.
    monkeypatch.setattr("sys.argv", ["bench_pool_eval.py", "--steps", "10", "--eval-every", "4", "--samples", "2",
                                     "trainer.warm_start.steps=10", "data.val_max_prompts=8",
                                     "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4",
                                     "trainer.max_staleness=0"])
    bench.main()
    out = capsys.readouterr().out
    assert "pool:" in out and "ratio" in out and "colocated:" in out and "pass@2" in out
