"""Reward functions in worker processes (``async_rl.rewards.workers``): real processes, real
deadlines. A hang is a ``timeout``, a dying worker a ``crashed`` sample, a huge result
``too_large`` (or a bad type), each a counted rejection, and the pool goes on scoring; generation
never waits for a reward; no worker outlives its pool or its parent."""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from async_rl.rewards import RewardScorer, get_reward_fn, register_reward
from async_rl.rewards.config import RewardConfig
from async_rl.rewards.scorer import MAX_EXTRAS
from async_rl.rewards.workers import RewardWorkers

ROOT = Path(__file__).resolve().parents[1]

# One file, one behaviour per response text; ground truth "1" is the right answer.
REWARD = '''
import ctypes, math, os, time

def score(data_source, text, gt, extra):
    if text == "hang":
        time.sleep(1e6)
    if text == "exit":
        os._exit(1)
    if text == "segfault":
        ctypes.string_at(0)
    if text == "pid":
        return {"score": 1.0, "pid": float(os.getpid())}
    if text == "many_keys":
        return {"score": 1.0, **{f"k{i}": 1.0 for i in range(100_000)}}
    if text == "long_keys":
        return {"score": 1.0, **{f"{i}" + "k" * 1000: 1.0 for i in range(60)}}
    if text == "big_list":
        return [1.0] * 10_000_000
    if text == "big_str":
        return "x" * 10_000_000
    if text == "raise":
        raise KeyError("word")
    if text == "none":
        return None
    if text == "nan":
        return math.nan
    if text == "inf":
        return {"score": math.inf}
    if text == "str":
        return "1.0"
    if text.startswith("meet:"):  # two calls wait for each other: proof that they run at once
        mine, other = text.split(":")[1:]
        open(os.path.join(extra["dir"], mine), "w").close()
        for _ in range(400):
            if os.path.exists(os.path.join(extra["dir"], other)):
                return 1.0
            time.sleep(0.05)
        return 0.0
    return float(text.strip() == gt)
'''


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return f"{path}:score"


def _scorer(spec: str, on_error: str = "zero", num_workers: int = 1, timeout_s: float = 1.0) -> RewardScorer:
    return RewardScorer(get_reward_fn(spec), on_error, workers=RewardWorkers(spec, num_workers, timeout_s))


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie waiting for a reaper that is not us)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, within_s: float = 15.0) -> bool:
    deadline = time.monotonic() + within_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_hang_is_a_timeout_and_the_pool_scores_the_next_sample(spec):
    scorer = _scorer(spec, on_error="zero", timeout_s=1.0)
    try:
        first = scorer.score("d", "pid", "1", None)
        hung = scorer.score("d", "hang", "1", None)
        after = scorer.score("d", "pid", "1", None)
    finally:
        scorer.close()
    # A timeout rejects whatever on_error says: there is no reward to train on.
    assert hung.rejected and hung.reason == "timeout" and "reward.timeout_s=1" in hung.error
    assert after.score == 1.0 and after.extras["pid"] != first.extras["pid"], "the hung worker was replaced"
    assert _gone(int(first.extras["pid"]))
    counts = scorer.counts()
    assert (counts["reward/timeouts"], counts["reward/errors"], counts["reward/rejected"], counts["reward/scored"]) \
        == (1.0, 1.0, 1.0, 3.0)
    assert "no result within reward.timeout_s" in scorer.first_error
    assert scorer.workers.num_started == 2


@pytest.mark.parametrize("text, how", [("exit", "exit code 1"), ("segfault", "SIGSEGV")])
def test_a_worker_that_dies_mid_call_is_a_crash_and_is_replaced(spec, text, how):
    scorer = _scorer(spec, on_error="zero", timeout_s=30.0)
    try:
        crashed = scorer.score("d", text, "1", None)
        after = scorer.score("d", "1", "1", None)
    finally:
        scorer.close()
    assert crashed.rejected and crashed.reason == "crashed" and how in crashed.error
    assert after.score == 1.0
    assert scorer.counts()["reward/crashed"] == 1.0 and scorer.counts()["reward/rejected"] == 1.0
    assert scorer.workers.num_started == 2


@pytest.mark.parametrize("text, kind, reason", [
    ("many_keys", "too_large", "returned a dict of 100001 keys"),
    ("long_keys", "too_large", "extras of"),
    ("big_list", "error", "bad return type list"),
    ("big_str", "error", "bad return type str"),
])
def test_a_huge_result_never_reaches_the_parent(spec, text, kind, reason):
    workers = RewardWorkers(spec, 1, 30.0)
    received = []
    try:
        workers.submit(("d", text, "1", None), received.append)
        workers.drain()
    finally:
        workers.close()
    (outcome,) = received
    assert outcome.kind == kind and outcome.reason.startswith(reason), outcome
    # What crossed the pipe is the outcome itself: a few hundred bytes, not the function's return.
    assert len(pickle.dumps(outcome)) < 2_000
    assert MAX_EXTRAS == 64


@pytest.mark.parametrize("text", ["raise", "none", "nan", "inf", "str", "1", "2"])
@pytest.mark.parametrize("on_error", ["zero", "reject"])
def test_the_pool_validates_like_in_process_scoring(spec, text, on_error):
    in_process = RewardScorer(get_reward_fn(spec), on_error)
    pooled = _scorer(spec, on_error=on_error, timeout_s=30.0)
    try:
        got = pooled.score("d", text, "1", None)
    finally:
        pooled.close()
    assert got == in_process.score("d", text, "1", None)
    assert pooled.counts() == in_process.counts()
    assert pooled.first_error == in_process.first_error


def test_a_reward_that_times_out_on_every_call_stops_the_run(spec):
    from async_rl.rewards import check_rewards_work

    scorer = _scorer(spec, timeout_s=0.5)
    try:
        for _ in range(2):
            scorer.score("d", "hang", "1", None)
    finally:
        scorer.close()
    with pytest.raises(ValueError, match=r"failed on every call \(2 of 2\).*reward.timeout_s=0.5"):
        check_rewards_work(scorer.pop_metrics(), scorer.first_error, "step 1")


def test_a_worker_killed_between_calls_is_replaced(spec):
    scorer = _scorer(spec, timeout_s=30.0)
    try:
        pid = int(scorer.score("d", "pid", "1", None).extras["pid"])
        os.kill(pid, signal.SIGKILL)
        assert _wait_gone(pid)
        after = scorer.score("d", "pid", "1", None)
    finally:
        scorer.close()
    assert after.score == 1.0 and int(after.extras["pid"]) != pid
    assert scorer.counts()["reward/rejected"] == 0.0 and scorer.workers.num_started == 2


def test_several_calls_run_at_once_and_close_leaves_no_worker(spec, tmp_path):
    scorer = _scorer(spec, num_workers=2, timeout_s=60.0)
    results = []
    for mine, other in (("a", "b"), ("b", "a")):
        scorer.submit("d", f"meet:{mine}:{other}", "1", {"dir": str(tmp_path)}, done=results.append)
    scorer.drain()
    pids = scorer.workers.pids()
    assert [r.score for r in results] == [1.0, 1.0], "each call saw the other one's marker: both ran at once"
    assert len(pids) == 2
    scorer.close()
    scorer.close()  # idempotent
    assert all(_gone(pid) for pid in pids)
    assert scorer.workers.pids() == []


def test_workers_die_with_their_parent(spec, tmp_path):
    # A parent that exits without close(): PR_SET_PDEATHSIG takes its worker with it.
    script = textwrap.dedent(f"""
        import os, sys
        from async_rl.rewards import RewardScorer, get_reward_fn
        from async_rl.rewards.workers import RewardWorkers
        spec = {spec!r}
        scorer = RewardScorer(get_reward_fn(spec), workers=RewardWorkers(spec, 1, 30.0))
        print(int(scorer.score("d", "pid", "1", None).extras["pid"]), flush=True)
        os._exit(0)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert _wait_gone(int(out.stdout.split()[-1]))


def test_a_function_the_worker_cannot_load_stops_the_pool_in_one_line():
    # Registered in this process only: a worker process does not have it.
    name = "only_in_the_parent_for_test"

    @register_reward(name)
    def _only_here(*args):
        return 1.0

    workers = RewardWorkers(name, 1, 30.0)
    try:
        workers.submit(("d", "r", "g", None), lambda outcome: None)
        with pytest.raises(RuntimeError, match="could not load reward.fn='only_in_the_parent_for_test'"):
            workers.drain()
        with pytest.raises(RuntimeError, match="stopped"):
            workers.submit(("d", "r", "g", None), lambda outcome: None)
    finally:
        workers.close()


class _FakeEngine:
    """Finishes 16 samples at once (2 groups of 8) and notes when ``generate`` returns."""

    def __init__(self, events: list) -> None:
        self.events = events

    def generate(self, prompts, n, params, seeds=None, on_sample=None):
        from async_rl.generators.base import Sample

        for i in range(len(prompts)):
            for j in range(n):
                on_sample(i, j, Sample(response_ids=[7], logprobs=[-0.1], finish_reason="stop", policy_version=[0]))
        self.events.append("generate returned")


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "1"


SLOW_REWARD = '''
import time

def score(data_source, text, gt, extra):
    time.sleep(0.3)
    return float(text == gt)
'''


def test_generation_never_waits_on_scoring(tmp_path):
    from async_rl.step.rollout import GroupRequest, sample_groups

    path = tmp_path / "slow.py"
    path.write_text(SLOW_REWARD)
    spec = f"{path}:score"
    events: list = []
    threads: set[int] = set()
    scorer = _scorer(spec, num_workers=1, timeout_s=30.0)

    def on_trajectory(traj):
        threads.add(threading.get_ident())
        events.append(("scored", traj.trajectory_id, traj.reward))

    def on_group_closed(request, kept):
        threads.add(threading.get_ident())
        events.append(("closed", request.group_id, kept))

    requests = [GroupRequest(group_id=g, prompt_ids=[1, 2], prompt_uid=f"u{g}", data_source="d", ground_truth="1",
                             extra_info={}, n=8, seed=g) for g in range(2)]
    try:
        sample_groups(_FakeEngine(events), requests, None, _Tokenizer(), scorer, None, on_trajectory,
                      on_group_closed=on_group_closed)
    finally:
        scorer.close()
    scored = [e for e in events if e[0] == "scored"]
    assert len(scored) == 16 and all(e[2] == 1.0 for e in scored)
    # The engine finished all 16 samples before the first 0.3 s reward came back; sample_groups
    # (wait_scored) still returned only once all were scored and both groups closed.
    assert events.index("generate returned") < events.index(scored[0])
    assert [e for e in events if e[0] == "closed"] == [("closed", 0, 8), ("closed", 1, 8)]
    assert events[-1] == ("closed", 1, 8)
    # Every callback ran on one thread (the pool's), never the engine's.
    assert len(threads) == 1 and threading.get_ident() not in threads


def test_zero_workers_scores_in_process_and_config_is_checked():
    from async_rl.step.rollout import make_scorer

    scorer = make_scorer(RewardConfig(fn="arithmetic", num_workers=0), "zero")
    assert scorer.workers is None
    assert scorer.score("async_rl/arithmetic", "12", "12", None).score == 1.0
    pooled = make_scorer(RewardConfig(fn="arithmetic"), "zero")
    assert pooled.workers is not None and pooled.workers.pids() == [], "workers start on the first call"
    pooled.close()
    with pytest.raises(ValueError, match="reward.num_workers"):
        RewardConfig(num_workers=-1)
    with pytest.raises(ValueError, match="reward.timeout_s"):
        RewardConfig(timeout_s=0)
    assert RewardConfig().num_workers >= 1 and math.isfinite(RewardConfig().timeout_s)


# Every worker process of a generator actor hangs on its 2nd call until 3 hang tokens are used
# (files created atomically in the run's directory), so the run sees exactly 3 timeouts; the
# trainer's own evaluation workers (whose parent is this test's process) never hang.
HANGING_REWARD = '''
import os, time

TOKENS = {tokens!r}
TRAINER_PID = {trainer_pid}
_calls = 0

def score(data_source, text, gt, extra):
    global _calls
    _calls += 1
    if _calls == 2 and os.getppid() != TRAINER_PID:
        for i in range(3):
            try:
                os.close(os.open(os.path.join(TOKENS, str(i)), os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                continue
            time.sleep(1e6)
    ok = text.strip() == gt
    return {{"score": float(ok), "acc": float(ok)}}
'''


@pytest.mark.slow
def test_async_run_with_a_hanging_reward_finishes_and_counts_timeouts(tmp_path, ray_session):
    from async_rl.trainer import train
    from pipeline_helpers import small_run_cfg

    tokens = tmp_path / "tokens"
    tokens.mkdir()
    reward = tmp_path / "hanging_reward.py"
    reward.write_text(HANGING_REWARD.format(tokens=str(tokens), trainer_pid=os.getpid()))
    summary = train(small_run_cfg(tmp_path, "hang", "trainer.mode=async", f"reward.fn={reward}:score",
                                  "reward.timeout_s=2"))
    assert sorted(os.listdir(tokens)) == ["0", "1", "2"]
    assert summary["reward/timeouts"] == 3.0
    assert summary["reward/rejected"] >= 3.0 and summary["reward/errors"] >= 3.0
    assert "reward.timeout_s=2" in summary["reward/first_error"]
    assert summary["pipeline/trained"] == 12
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] == 0
    steps = [json.loads(line) for line in (tmp_path / "hang" / "metrics.jsonl").read_text().splitlines()]
    assert sum(s.get("reward/timeouts", 0.0) for s in steps) <= 3.0
