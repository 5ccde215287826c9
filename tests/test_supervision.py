"""Supervision of the generator pool: the request broker's claims, and async runs whose actors are
killed (SIGKILL), killed during a weight update, or hung (SIGSTOP) mid-run."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from async_rl.loops.actors import RequestBroker
from async_rl.step.rollout import GroupRequest
from pipeline_helpers import small_run_cfg


def _request(gid: int, n: int = 4) -> GroupRequest:
    return GroupRequest(gid, [1, 2, 3], f"p{gid}", "arithmetic", "3", {}, n, gid)


def test_broker_hands_each_request_to_one_worker_and_reclaims_exactly_its_claims():
    broker = RequestBroker()
    for gid in range(6):
        broker.put(_request(gid))
    a, b = (0, 0), (1, 0)
    assert [r.group_id for r in broker.take(a, 8, 0)] == [0, 1]  # 4 + 4 samples: the batch is full
    assert [r.group_id for r in broker.take(b, 4, 0)] == [2]
    assert [r.group_id for r in broker.take(b, 5, 0)] == [3, 4]  # fewer than 5 after one: take another
    assert broker.claimed() == {a: [0, 1], b: [2, 3, 4]}
    broker.forget([3])  # ended (trained): no re-issue for it, whoever dies
    assert sorted(r.group_id for r in broker.reclaim(b)) == [2, 4]
    # The dead worker's take that arrives after the reclaim claims nothing, and leaves the queue.
    assert broker.take(b, 8, 0) == [] and broker.qsize() == 1
    assert broker.reclaim(b) == []
    # Its replacement is a new incarnation: it takes again.
    assert [r.group_id for r in broker.take((1, 1), 8, 0)] == [5]
    assert broker.claimed() == {a: [0, 1], (1, 1): [5]}
    broker.put(_request(6))
    assert [r.group_id for r in broker.close()] == [6]
    assert broker.take(a, 8, 1.0) == [] and broker.qsize() == 0


def test_broker_take_waits_for_a_request_until_its_timeout():
    broker = RequestBroker()
    t0 = time.monotonic()
    assert broker.take((0, 0), 4, 0.05) == []
    assert time.monotonic() - t0 >= 0.05
    threading.Timer(0.1, broker.put, [_request(7)]).start()
    assert [r.group_id for r in broker.take((0, 0), 4, 5.0)] == [7]


def test_idle_workers_share_the_groups_dispatched_together():
    """``put_many`` queues what admission allows at once: one idle worker takes it as one engine
    batch, two idle workers split it, oldest first, instead of the first waking with one group."""
    broker = RequestBroker()
    broker.put_many([_request(g) for g in range(8)])
    assert [r.group_id for r in broker.take((0, 0), 1000, 0)] == list(range(8))

    taken: dict[int, list[int]] = {}

    def take(worker: int) -> None:
        taken[worker] = [r.group_id for r in broker.take((worker, 0), 1000, 10.0)]

    threads = [threading.Thread(target=take, args=(w,)) for w in (0, 1)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while broker._takers < 2 and time.monotonic() < deadline:  # both wait inside take
        time.sleep(0.001)
    broker.put_many([_request(g) for g in range(8, 16)])
    for t in threads:
        t.join(10)
    assert sorted(len(v) for v in taken.values()) == [4, 4]
    assert sorted(taken[0] + taken[1]) == list(range(8, 16))
    assert all(v == list(range(v[0], v[0] + 4)) for v in taken.values())  # each a run, in order
    # A worker's engine batch still bounds its share.
    broker.put_many([_request(g) for g in range(16, 24)])
    assert [r.group_id for r in broker.take((0, 0), 8, 0)] == [16, 17]


def test_generator_supervision_config_is_checked():
    from async_rl.generators.base import GeneratorConfig

    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        GeneratorConfig(max_restarts=-1)
    with pytest.raises(ValueError, match="heartbeat_timeout_s > 0"):
        GeneratorConfig(heartbeat_timeout_s=0)


# ---------------------------------------------------------------------------------- real runs
def _cfg(tmp_path, name, *extra):
    return small_run_cfg(tmp_path, name, "trainer.mode=async", *extra)


def _held_by(loop, i: int, timeout_s: float = 60.0, stop: threading.Event | None = None) -> list[int]:
    """Wait until actor ``i`` holds a group that has not ended; its ids (with ``timeout_s = 0``:
    what it holds now, maybe nothing; an empty list too once ``stop`` is set)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        key = (i, loop.cluster.placed["generators"][i].get("incarnation", 0))
        held = [g for g in ray.get(loop.broker.claimed.remote()).get(key, []) if not loop.buffer.is_finished(g)]
        if held or timeout_s == 0 or (stop is not None and stop.is_set()):
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"actor {i} never held a group")
        time.sleep(0.01)


@pytest.mark.slow
def test_killed_and_hung_generator_actors_are_replaced_and_their_groups_reissued_once(tmp_path, ray_session,
                                                                                     monkeypatch):
    """Three SIGKILLs (one while the learner pushes weights) and one SIGSTOP, in an 8-step run with
    two actors: the run finishes, every group ends exactly once (the killed actors' open groups
    abandoned and re-issued, none trained twice), and every engine ends on the learner's weights."""
    import async_rl.loops.async_loop as async_loop
    from async_rl.trainer import train
    from async_rl.weight_sync import WeightPublisher

    total_steps = 8
    plan = {2: ("kill", 0), 3: ("kill_in_push", 1), 4: ("stop", 0), 6: ("kill", 1)}
    disrupted: list[tuple[int, str, list[int]]] = []
    trained_groups: list[int] = []
    trained_trajs: list[str] = []
    loops = []
    stopped: list[int] = []
    # A planned kill or stop waits for its actor to hold an open group on a thread of its own:
    # the loop's thread goes on meanwhile. Blocking it instead can wait forever: when every
    # admitted group has ended, new ones are admitted only once the loop publishes a version,
    # or handles the failure of a push whose actor the test just killed.
    disruptors: list[threading.Thread] = []
    errors: list[BaseException] = []
    run_over = threading.Event()

    def pid_of(loop, i):
        return int(loop.cluster.placed["generators"][i]["pid"])

    def disrupt(loop, step, what, previous):
        try:
            if previous is not None:
                previous.join()
            held = _held_by(loop, what[1], timeout_s=600.0, stop=run_over)
            if not held:
                return  # the run ended first: the assertion on ``disrupted`` names the miss
            pid = pid_of(loop, what[1])
            if what[0] == "stop":
                stopped.append(pid)
            os.kill(pid, signal.SIGKILL if what[0] == "kill" else signal.SIGSTOP)
            disrupted.append((step, what[0], held))
        except BaseException as e:  # noqa: BLE001 - raised again on the test's thread
            errors.append(e)

    original_step = async_loop.AsyncLoop.step

    def step(self, step):
        loops[:] = [self]
        what = plan.get(step)
        if what is not None and what[0] in ("kill", "stop"):
            previous = disruptors[-1] if disruptors else None
            disruptors.append(threading.Thread(target=disrupt, args=(self, step, what, previous), daemon=True))
            disruptors[-1].start()
        return original_step(self, step)

    original_push, original_start_push = WeightPublisher.push, WeightPublisher.start_push

    def kill_in_push(self, version):
        loop = loops[0] if loops else None
        what = plan.get(version)  # the push after step k publishes version k
        if loop is not None and what is not None and what[0] == "kill_in_push" and self is loop.publisher \
                and not any(d[1] == "kill_in_push" for d in disrupted):
            # The pool may be idle here (admission waits for this version): it may hold nothing.
            held = _held_by(loop, what[1], timeout_s=0.0)
            os.kill(pid_of(loop, what[1]), signal.SIGKILL)
            disrupted.append((version, "kill_in_push", held))

    def push(self, version, watch=None):
        kill_in_push(self, version)
        return original_push(self, version, watch)

    def start_push(self, version, watch=None, on_published=None, thread_cores=None):
        # weight_sync.overlap_push (the default): the actor dies while the background push runs.
        kill_in_push(self, version)
        return original_start_push(self, version, watch, on_published, thread_cores)

    original_learn_on = async_loop.learn_on

    def learn_on(ctx, step, ro, **kwargs):
        trained_groups.extend(sorted({t.group_id for t in ro.trajectories}))
        trained_trajs.extend(t.trajectory_id for t in ro.trajectories)
        return original_learn_on(ctx, step, ro, **kwargs)

    monkeypatch.setattr(async_loop.AsyncLoop, "step", step)
    monkeypatch.setattr(WeightPublisher, "push", push)
    monkeypatch.setattr(WeightPublisher, "start_push", start_push)
    monkeypatch.setattr(async_loop, "learn_on", learn_on)
    try:
        summary = train(_cfg(tmp_path, "chaos", f"trainer.total_steps={total_steps}", "generator.num_workers=2",
                             "generator.heartbeat_timeout_s=20", "weight_sync.probe_at_exit=true"))
    finally:
        run_over.set()
        for t in disruptors:
            t.join(30)
        for pid in stopped:  # never leave a stopped process behind, whatever failed
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    if errors:
        raise errors[0]
    # The two kills of actor 0 and 1 and the kill in a push may land in either order; each kind once.
    assert sorted(d[1] for d in disrupted) == ["kill", "kill", "kill_in_push", "stop"]
    assert summary["pipeline/generator_restarts"] == 4
    assert summary["generator_0/restarts"] == 2 and summary["generator_1/restarts"] == 2
    # Each disrupted actor held open groups; every one of them was abandoned and re-issued once.
    assert summary["pipeline/reissued"] == summary["pipeline/abandoned"] >= sum(bool(d[2]) for d in disrupted) >= 3
    held = {g for _, _, gs in disrupted for g in gs}
    assert not held & set(trained_groups), "a group held by a dead actor was also trained"
    # Exactly once: no group or sample trained twice, the ledger adds up, nothing lost in flight.
    assert len(trained_groups) == len(set(trained_groups)) == summary["pipeline/trained"] == total_steps * 4
    assert len(trained_trajs) == len(set(trained_trajs))
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] == 0
    assert summary["pipeline/dispatched"] == sum(summary[f"pipeline/{k}"] for k in (
        "trained", "rejected", "stale", "abandoned", "dynamic_sampling_dropped", "ready_unused",
        "partial_at_exit", "queued_at_exit", "spread_partly_trained_at_exit"))
    # The replacements sample with the learner's weights: their greedy probe equals the trainer's.
    assert summary["weight_sync/probe_token_mismatches"] == 0
    assert summary["weight_sync/probe_max_abs_logprob_diff"] < 1e-4
    placement = json.loads((tmp_path / "chaos" / "placement.json").read_text())
    assert [g["incarnation"] for g in placement["actors"]["generators"]] == [2, 2]
    steps = [json.loads(l) for l in (tmp_path / "chaos" / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1]["pipeline/generator_restarts"] == 4
    for pid in stopped:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.slow
def test_losing_every_generator_actor_stops_the_run_naming_each(tmp_path, ray_session, monkeypatch):
    import async_rl.loops.async_loop as async_loop
    from async_rl.trainer import train

    original_step = async_loop.AsyncLoop.step

    def step(self, step):
        if step == 2:
            for i in range(2):
                os.kill(int(self.cluster.placed["generators"][i]["pid"]), signal.SIGKILL)
        return original_step(self, step)

    monkeypatch.setattr(async_loop.AsyncLoop, "step", step)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"every generator actor is gone: actor 0 on \S+ \(pid \d+\) died .*; "
                                           r"actor 1 on \S+ \(pid \d+\) died"):
        train(_cfg(tmp_path, "lost", "trainer.total_steps=4", "generator.max_restarts=0", "generator.num_workers=2"))
    assert time.monotonic() - t0 < 300  # an error, not the stall timeout
