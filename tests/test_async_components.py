"""The async loop's components without a Ray session: dispatch (admission, the broker feed, the
re-issue queue), intake (routing and refusal counters) and the generator pool (supervision's
restart bookkeeping), each driven through fakes of the broker, the receiver and the actors."""

from __future__ import annotations

import threading
import types

import pytest

from async_rl.buffers.replay import AdmissionController, ReplayBuffer
from async_rl.buffers.trajectory import Trajectory
from async_rl.buffers.transport import GroupClosed
from async_rl.loops.actors import RequestBroker
from async_rl.loops.dispatch import Dispatcher
from async_rl.loops.intake import Intake
from async_rl.loops.pool import GeneratorPool
from async_rl.step.rollout import GroupRequest, group_seed

N = 2  # samples per group


# ------------------------------------------------------------------ dispatch
def _prompt(k: int):
    return types.SimpleNamespace(prompt_ids=[k], uid=f"p{k}", data_source="arithmetic", ground_truth=str(k),
                                 extra_info={}, messages=[])


class _Feed:
    """The broker's side of dispatch: a real ``RequestBroker`` called in this process."""

    def __init__(self) -> None:
        self.broker = RequestBroker()
        self.batches: list[list[int]] = []
        self.forgotten: list[int] = []

    def put_many(self, batch: list[GroupRequest]) -> None:
        self.batches.append([r.group_id for r in batch])
        self.broker.put_many(batch)

    def forget(self, ids: list[int]) -> None:
        self.forgotten.extend(ids)
        self.broker.forget(ids)


def _dispatcher(feed: _Feed, version: list[int], discarded: list[int], staleness: int = 0, seed: int = 7):
    prompts = iter(range(1000))
    return Dispatcher(AdmissionController(2, staleness), feed=feed.put_many, forget=feed.forget,
                      next_prompt=lambda: _prompt(next(prompts)), group_size=N, seed=seed,
                      published_version=lambda: version[0], num_discarded=lambda: discarded[0])


def test_the_loop_announces_each_dispatched_group_to_the_buffer_before_the_broker_has_it(monkeypatch):
    from async_rl.loops import async_loop

    order = []
    buffer = ReplayBuffer(group_size=1, max_staleness=1, serve_order="dispatch")
    buffer.note_dispatched = lambda ids, note=buffer.note_dispatched: (order.append(("buffer", ids)), note(ids))
    broker = types.SimpleNamespace(put_many=types.SimpleNamespace(
        remote=lambda batch: order.append(("broker", [r.group_id for r in batch]))))
    monkeypatch.setattr(async_loop.ray, "get", lambda ref: ref)
    loop = types.SimpleNamespace(buffer=buffer, broker=broker)
    async_loop.AsyncLoop._feed(loop, [GroupRequest.of(_prompt(k), k, 1, 0) for k in (0, 1)])
    assert order == [("buffer", [0, 1]), ("broker", [0, 1])]
    buffer.add(_traj(1, 0))
    assert buffer.get_groups(1, 0) is None  # group 0 was announced and is still in flight


def test_dispatch_starts_what_admission_allows_in_one_feed_and_opens_with_each_version():
    feed, version, discarded = _Feed(), [-1], [0]
    d = _dispatcher(feed, version, discarded, staleness=1)
    # B = 2, η = 1, v = 0 (before the first push counts as 0): (1 + 0 + 1) · 2 = 4 groups.
    assert [r.group_id for r in d.dispatch_admitted()] == [0, 1, 2, 3]
    assert feed.batches == [[0, 1, 2, 3]] and d.num_dispatched == 4 and not d.admitted()
    discarded[0] = 1  # a rejected group frees its slot
    assert [r.group_id for r in d.dispatch_admitted()] == [4]
    version[0] = 1
    assert [r.group_id for r in d.dispatch_admitted()] == [5, 6]
    requests = feed.broker.take((0, 0), 1000, 0)
    assert [r.group_id for r in requests] == list(range(7))
    assert [r.seed for r in requests] == [group_seed(7, g) for g in range(7)]
    assert [r.prompt_uid for r in requests] == [f"p{k}" for k in range(7)] and all(r.n == N for r in requests)
    assert d.knows(6) and not d.knows(7) and not d.knows(-1)


def test_a_dead_actors_groups_are_reissued_first_in_group_order_under_new_ids_and_seeds():
    feed, version, discarded = _Feed(), [0], [0]
    d = _dispatcher(feed, version, discarded, staleness=1)
    first = d.dispatch_admitted()  # groups 0..3
    held = feed.broker.take((1, 0), 1000, 0)
    # Group 0 completed before the actor died (nothing to abandon); groups 1..3 did not.
    reissued = d.requeue(list(reversed(held)), abandon=lambda gid: gid != 0)
    assert reissued == 3 and d.num_reissued == 3 and list(d.outstanding) == []
    version[0], discarded[0] = 1, 3  # the abandoned groups free their slots
    again = d.dispatch_admitted()
    assert [r.group_id for r in again] == [4, 5, 6, 7, 8]
    # The re-issued prompts come first, oldest group first, as new groups with those groups'
    # seeds; then new prompts.
    assert [r.prompt_uid for r in again] == [first[g].prompt_uid for g in (1, 2, 3)] + ["p4", "p5"]
    assert [r.seed for r in again] == [group_seed(7, g) for g in range(4, 9)]


def test_dispatch_forgets_what_ended_and_a_checkpoint_reissues_the_rest():
    feed, version, discarded = _Feed(), [0], [0]
    d = _dispatcher(feed, version, discarded)
    d.dispatch_admitted()
    assert d.forget_finished(lambda gid: gid == 0) == [0] and feed.forgotten == [0]
    assert d.forget_finished(lambda gid: False) == [] and feed.forgotten == [0]  # no empty broker call
    d.reissue.append(GroupRequest(9, [9], "p9", "arithmetic", "9", {}, N, 0))
    with d.lock:
        pending = d.pending(lambda gid: False)
    assert [r.group_id for r in pending] == [1, 9]
    resumed = _dispatcher(_Feed(), [2], [1])  # room for two more groups
    abandoned: list[int] = []
    assert resumed.restore(5, 3, pending, abandoned.append) == 2
    assert abandoned == [1, 9] and resumed.num_dispatched == 5 and resumed.num_reissued == 5
    again = resumed.dispatch_admitted()
    assert [(r.group_id, r.prompt_uid) for r in again] == [(5, "p1"), (6, "p9")]
    assert not resumed.reissue


def test_the_dispatcher_thread_waits_for_admission_and_wakes_on_each_change():
    feed, version, discarded = _Feed(), [0], [0]
    d = _dispatcher(feed, version, discarded)
    stop = threading.Event()
    th = threading.Thread(target=d.run, args=(stop,), daemon=True)
    th.start()
    try:
        _wait(lambda: d.num_dispatched == 2)
        version[0] = 1
        d.wake()
        _wait(lambda: d.num_dispatched == 4)
        assert feed.batches == [[0, 1], [2, 3]]
    finally:
        stop.set()
        d.wake()
        th.join(timeout=5)
    assert not th.is_alive()


def _wait(cond, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


# ------------------------------------------------------------------ intake
def _traj(gid: int, j: int, version: int = 0, tid: str | None = None) -> Trajectory:
    return Trajectory(trajectory_id=tid or f"{gid}/{j}", group_id=gid, prompt_uid=f"p{gid}", prompt_ids=[1, 2],
                      response_ids=[3, 4], behavior_logprobs=[-0.5, -0.5], loss_mask=[1, 1], finish_reason="stop",
                      policy_version=[version, version], reward=1.0)


class _Receiver:
    def __init__(self, batches: list[list]) -> None:
        self.batches = batches
        self.num_malformed = 3

    def recv_many(self, max_items: int, timeout_s: float | None = None) -> list:
        return self.batches.pop(0) if self.batches else []


def test_intake_routes_this_runs_messages_and_counts_each_refusal_by_reason():
    buffer = ReplayBuffer(group_size=N, max_staleness=0)
    woken: list[int] = []
    intake = Intake(_Receiver([]), buffer, knows_group=lambda gid: 0 <= gid < 2, group_size=N,
                    learner_version=lambda: 0, on_messages=lambda: woken.append(1))
    assert intake.route(_traj(0, 0)) is None and intake.route(_traj(0, 1)) is None
    assert buffer.is_finished(0)
    assert intake.route(_traj(5, 0)) == "unknown_group"
    assert intake.route(GroupClosed(7, 0)) == "unknown_group"
    assert intake.route(_traj(1, 0, tid="0/1")) == "trajectory_id_of_another_group"
    assert intake.route(_traj(1, N)) == "index_outside_group"
    assert intake.route(_traj(1, 0, version=1)) == "future_policy_version"
    assert intake.route(_traj(1, 0)) is None
    assert intake.route(GroupClosed(1, 5)) == "contradicting_group_closed"  # one sample of two is there
    assert intake.route(GroupClosed(1, 1)) is None and buffer.is_finished(1)
    assert intake.summary() == {
        "pipeline/malformed_messages": 3, "pipeline/refused_messages": 6,
        "pipeline/refused_messages_contradicting_group_closed": 1,
        "pipeline/refused_messages_future_policy_version": 1, "pipeline/refused_messages_index_outside_group": 1,
        "pipeline/refused_messages_trajectory_id_of_another_group": 1, "pipeline/refused_messages_unknown_group": 2}
    assert woken == []


def test_the_receiver_thread_wakes_dispatch_after_each_batch_and_drain_routes_the_rest():
    buffer = ReplayBuffer(group_size=N, max_staleness=0)
    woken: list[int] = []
    receiver = _Receiver([[_traj(0, 0)], [_traj(0, 1), GroupClosed(0, 2)], [], [_traj(1, 0)]])
    stop = threading.Event()
    intake = Intake(receiver, buffer, lambda gid: gid < 2, N, lambda: 0, on_messages=lambda: woken.append(1))

    def once(max_items, timeout_s=None):  # one pass of the thread's loop, then stop
        stop.set()
        return _Receiver.recv_many(receiver, max_items, timeout_s)

    receiver.recv_many = once
    intake.run(stop)
    assert woken == [1] and not buffer.is_finished(0)
    del receiver.recv_many
    intake.drain()
    # Up to the first quiet wait: what comes after is not the stopped generators'.
    assert buffer.is_finished(0) and len(receiver.batches) == 1 and intake.refused == {}


# ------------------------------------------------------------------ the generator pool
class _Ref:
    def __init__(self, value=None, error: Exception | None = None) -> None:
        self.value, self.error, self.done = value, error, False


class _Method:
    def __init__(self, fn) -> None:
        self.fn = fn

    def remote(self, *args):
        return self.fn(*args)


class _Actor:
    """A generator actor's handle: ``run`` ends (``_Ref.done``) when the test kills it."""

    def __init__(self, i: int, incarnation: int) -> None:
        self.i, self.incarnation = i, incarnation
        self.run_ref = _Ref()
        self.run = _Method(lambda broker: self.run_ref)
        self.heartbeat = _Method(lambda: _Ref({"since_progress_s": 0.0}))
        self.get_stats = _Method(lambda: _Ref({"samples": 10.0 * (self.i + 1)}))


class _Ray:
    """``ray.get`` / ``wait`` / ``kill`` over ``_Ref``s."""

    def __init__(self) -> None:
        self.killed: list[_Actor] = []

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if ref.error is not None:
            raise ref.error
        return ref.value

    def wait(self, refs, num_returns=1, timeout=None):
        done = [r for r in refs if r.done]
        return done, [r for r in refs if not r.done]

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)


class _Cluster:
    def __init__(self, n: int) -> None:
        self.placed = {"generators": [{"node_ip": "10.0.0.1", "pid": 100 + i, "incarnation": 0} for i in range(n)]}
        self.saves = 0

    def record(self, role, actors):
        return self.placed[role]

    def check_reachable(self, role, spots):
        pass

    def record_replacement(self, role, i, actor, incarnation):
        self.placed[role][i] = {"node_ip": "10.0.0.1", "pid": 200 + i, "incarnation": incarnation}
        return self.placed[role][i]

    def save(self, run_dir):
        self.saves += 1


def _pool(max_restarts: int, held: dict[tuple[int, int], list[GroupRequest]]):
    n = 2
    lines: list[str] = []
    placed: list[tuple[int, int]] = []
    reissued: list[list[int]] = []
    ctx = types.SimpleNamespace(
        cfg=types.SimpleNamespace(generator=types.SimpleNamespace(heartbeat_timeout_s=60, max_restarts=max_restarts),
                                  weight_sync=types.SimpleNamespace(overlap_push=False)),
        learner=types.SimpleNamespace(version=3), log=types.SimpleNamespace(print=lines.append), run_dir=None,
        service_cores=[])

    def place(indices=None, incarnation=0):
        indices = list(range(n)) if indices is None else indices
        placed.extend((i, incarnation) for i in indices)
        return [_Actor(i, incarnation) for i in indices]

    def lost(requests):
        reissued.append([r.group_id for r in requests])
        return len(requests)

    broker = types.SimpleNamespace(reclaim=_Method(lambda worker: _Ref(held.pop(worker, []))))
    pool = GeneratorPool(ctx, _Cluster(n), broker, place, lost, on_published=lambda: None, ray_api=_Ray())
    pool.place_all()
    pool.run_refs = [w.run.remote(broker) for w in pool.workers]
    # Weight pushes are the weight sync layer's (tests/test_weight_sync_overlap.py): counted here.
    pushes: list[int] = []
    pool.connect = lambda supervised=True: None
    pool._publish = lambda background=False: pushes.append(ctx.learner.version) or {}
    return pool, lines, placed, reissued, pushes


def test_a_dead_actor_is_replaced_under_its_next_incarnation_its_claims_reissued_and_the_pool_pushed_again():
    held = {(1, 0): [GroupRequest(4, [1], "p4", "arithmetic", "4", {}, N, 0)]}
    pool, lines, placed, reissued, pushes = _pool(max_restarts=2, held=held)
    pool.stats()  # actor 1's counters so far: kept when it dies
    dead = pool.workers[1]
    dead.run_ref.done, dead.run_ref.error = True, RuntimeError("ActorDiedError: the actor died unexpectedly\nmore")
    pool.supervise()
    assert reissued == [[4]] and pool.restarts == [0, 1] and placed[-1] == (1, 1)
    assert pool.workers[1] is not dead and pool._ray.killed == [dead] and pushes == [3]
    assert pool.cluster.saves == 1 and pool.run_refs[1] is pool.workers[1].run_ref and not pool._starting
    assert lines == ["generator actor 1 on 10.0.0.1 (pid 101) died (RuntimeError: ActorDiedError: the actor died "
                     "unexpectedly); 1 groups re-issued; restarting it (1/2)"]
    # The dead actor's counters stay in the pool's totals beside its replacement's.
    assert pool.stats() == {"samples": 10.0 + 20.0 + 20.0}
    # The replacement dies too: the broker is asked for the claims of incarnation 1.
    held[(1, 1)] = [GroupRequest(6, [1], "p6", "arithmetic", "6", {}, N, 0)]
    pool.workers[1].run_ref.done = True
    pool.supervise()
    assert reissued == [[4], [6]] and pool.restarts == [0, 2] and placed[-1] == (1, 2) and pushes == [3, 3]
    assert "stopped unexpectedly" in lines[-1] and "(2/2)" in lines[-1]


def test_an_actor_past_max_restarts_is_retired_and_losing_the_last_names_each_end():
    pool, lines, placed, reissued, pushes = _pool(max_restarts=0, held={})
    pool.workers[0].run_ref.done = True
    pool.supervise()
    assert pool.workers[0] is None and pool.active() == [1] and pool.restarts == [0, 0] and pushes == [3]
    assert lines[-1].endswith("retired after 0 restarts (generator.max_restarts=0)")
    pool.workers[1].run_ref.done, pool.workers[1].run_ref.error = True, RuntimeError("OOM")
    with pytest.raises(RuntimeError, match=r"every generator actor is gone: actor 0 on 10\.0\.0\.1 \(pid 100\) "
                                           r"stopped unexpectedly; actor 1 on 10\.0\.0\.1 \(pid 101\) died "
                                           r"\(RuntimeError: OOM\)"):
        pool.supervise()
    assert placed == [(0, 0), (1, 0)]  # nothing was restarted


class _RayTaskError(RuntimeError):
    """Ray's wrapper of an exception raised inside an actor: its text starts with the actor's
    traceback header, its ``cause`` is what the actor raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"ray::GeneratorWorker.run() (pid=101, ip=10.0.0.1)\n  File \"x.py\", line 1\n{cause!r}")
        self.cause = cause


def test_an_engine_that_dies_in_an_actor_ends_the_run_in_one_line_naming_its_root_cause():
    from async_rl.generators.model_support import EngineDied
    from async_rl.loops.pool import GeneratorsGone

    pool, lines, placed, reissued, pushes = _pool(max_restarts=0, held={})
    died = EngineDied("the vLLM engine died: RuntimeError: Unsupported CPU attention configuration: head_dim=16")
    for actor in pool.workers:
        actor.run_ref.done, actor.run_ref.error = True, _RayTaskError(died)
    with pytest.raises(GeneratorsGone) as info:
        pool.supervise()
    message = str(info.value)
    assert "\n" not in message and "ray::" not in message
    assert message.count("died (EngineDied: the vLLM engine died: RuntimeError: Unsupported CPU attention "
                         "configuration: head_dim=16)") == 2


def test_a_hung_actor_is_killed_and_reported_with_the_heartbeat_reason():
    pool, lines, placed, reissued, pushes = _pool(max_restarts=1, held={})
    actor = pool.workers[0]
    actor.heartbeat = _Method(lambda: _Ref({"since_progress_s": 120.0}))
    assert pool.hung() == []  # the first probe is only sent
    pool._beats[0][0].done = True
    hung = pool.hung()
    assert hung == [(0, "made no progress for 120 s (generator.heartbeat_timeout_s=60)")]
    assert pool._ray.killed == [actor]
    actor.run_ref.done = True  # killed: its run ends, and supervision reports it with that reason
    pool.supervise()
    assert "made no progress for 120 s" in lines[-1] and pool.restarts == [1, 0] and pushes == [3]


def test_a_receiver_listening_beyond_the_runs_host_says_so_only_then(caplog):
    from async_rl.loops.intake import warn_if_exposed

    with caplog.at_level("WARNING", logger="async_rl.loops.intake"):
        assert not warn_if_exposed(None, "tcp://127.0.0.1:5555", "127.0.0.1")  # the default: the run's host
        assert not warn_if_exposed("tcp://127.0.0.2:*", "tcp://127.0.0.2:5555", "127.0.0.1")  # loopback
        assert not warn_if_exposed("ipc:///tmp/x", "ipc:///tmp/x", "127.0.0.1")
        assert warn_if_exposed("tcp://0.0.0.0:*", "tcp://0.0.0.0:5555", "127.0.0.1")
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.zmq_address=tcp://0.0.0.0:*: the trajectory receiver listens on 0.0.0.0, reachable from that "
        "network, not only from this machine"]


def test_a_steps_metrics_merge_over_its_policy_versions_by_kind():
    from async_rl.loops.common import merge_version_metrics

    first = {"loss/pg": 0.2, "loss/ratio_max": 1.5, "actor/optimizer_steps": 1.0, "rollout/num_trajectories": 16.0,
             "timing/train_s": 1.0, "perf/train_tokens_per_s": 100.0, "policy/version": 5.0, "staleness/max": 1.0,
             "loss/ratio_min": 0.7, "data/epoch": 0.0}
    second = {"loss/pg": 0.4, "loss/ratio_max": 1.2, "actor/optimizer_steps": 1.0, "rollout/num_trajectories": 16.0,
              "timing/train_s": 3.0, "perf/train_tokens_per_s": 300.0, "policy/version": 6.0, "staleness/max": 0.0,
              "loss/ratio_min": 0.9, "data/epoch": 1.0, "rollout/dynamic_sampling_rounds": 2.0}
    out = merge_version_metrics([first, second])
    assert out["loss/pg"] == pytest.approx(0.3)  # a mean
    assert out["loss/ratio_max"] == 1.5 and out["loss/ratio_min"] == 0.7 and out["staleness/max"] == 1.0
    assert out["actor/optimizer_steps"] == 2.0 and out["rollout/num_trajectories"] == 32.0  # counts
    assert out["timing/train_s"] == 4.0
    assert out["perf/train_tokens_per_s"] == pytest.approx((100.0 * 1 + 300.0 * 3) / 4)  # tokens over time
    assert out["policy/version"] == 6.0 and out["data/epoch"] == 1.0  # the last version's
    assert out["rollout/dynamic_sampling_rounds"] == 2.0  # only the version that reports it
    assert merge_version_metrics([first]) == pytest.approx(first)
    with pytest.raises(ValueError, match="at least one policy version"):
        merge_version_metrics([])
