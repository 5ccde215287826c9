"""Async mode's weight push overlapped with training (``weight_sync.overlap_push``):
``WeightPublisher.start_push`` stages the weights and returns, a background thread pushes the
staged copy; the version is published only once every engine has loaded it, one push is pending
at a time, a background failure is raised at the next push (or step) with the engine's own text,
and what must see the pool settled (close, a checkpoint, an evaluation) waits for it. Engines
here are in-process fakes that receive through a real ``WeightReceiver`` over shared memory and
hold each update until the test opens their gate (a slow engine). No timing is asserted: orders
and counts only; the waits' timeouts only keep a broken build from hanging."""

from __future__ import annotations

import threading
import types

import pytest
import torch

from async_rl.weight_sync import (LocalTarget, NamedTensors, UpdatePlan, WeightPublisher, WeightReceiver,
                                  WeightSyncConfig)

REFUSAL = "unknown weight 'model.extra.weight' (test engine)"


class _GatedEngine:
    """An engine that holds each update, before any byte of it moves, until ``start`` is set,
    receives it through a real ``WeightReceiver``, and holds it again, before it counts as loaded,
    until ``finish`` is set (a slow engine); ``gate`` is both. It refuses its first ``refuse``
    updates the way ``check_update`` does. Appends ``("begin"|"loaded", name, version)`` to the
    shared ``log``."""

    def __init__(self, log: list, name: str, refuse: int = 0) -> None:
        self.log, self.name, self.refuse = log, name, refuse
        self.start, self.finish = threading.Event(), threading.Event()
        self.gate = types.SimpleNamespace(set=lambda: (self.start.set(), self.finish.set()))
        self.weights: dict[str, torch.Tensor] = {}
        self.policy_version: int | None = None

    def connect_weight_sync(self, init_info, rank) -> None:
        self.receiver = WeightReceiver(init_info, rank)
        self.receiver.connect()

    def receive_weights(self, plan, version: int) -> None:
        self.log.append(("begin", self.name, version))
        assert self.start.wait(60), "the test never let the update start"

        def check(names) -> None:
            if self.refuse:
                self.refuse -= 1
                raise ValueError(REFUSAL)

        got = {}
        for bucket in self.receiver.receive(UpdatePlan.from_dict(plan), check=check):
            got.update({n: t.clone() for n, t in bucket})
        assert self.finish.wait(60), "the test never let the load finish"
        self.weights, self.policy_version = got, version
        self.log.append(("loaded", self.name, version))


class _Learner(NamedTensors):
    """A learner's weight side: named tensors (changed in place, as an optimizer step does) and a version."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        super().__init__([(f"model.layers.{i}.w", torch.randn(32, 17, generator=g)) for i in range(6)])
        self.version = 0

    def optimizer_step(self) -> None:
        for _, t in self.named:
            t.add_(1.0)
        self.version += 1


def _publisher(learner, engines, transport: str = "shm") -> WeightPublisher:
    cfg = WeightSyncConfig(transport=transport, bucket_size_mb=0.004, timeout_s=60)
    return WeightPublisher(cfg, transport, learner, [LocalTarget(e) for e in engines])


def _wait_for(predicate, what: str) -> None:
    event = threading.Event()
    for _ in range(600):
        if predicate():
            return
        event.wait(0.1)
    raise AssertionError(f"never happened: {what}")


def _in_thread(fn, log: list, label):
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - asserted by the test
            out["error"] = e
        log.append(label)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th, out


@pytest.mark.parametrize("transport", ["shm", "broadcast"])
def test_start_push_publishes_the_staged_weights_only_once_every_engine_loaded_them(transport):
    log: list = []
    engines = [_GatedEngine(log, "a"), _GatedEngine(log, "b")]
    learner = _Learner()
    pub = _publisher(learner, engines, transport)
    published: list[int] = []
    learner.optimizer_step()
    sent = {n: t.clone() for n, t in learner.named}
    metrics = pub.start_push(learner.version, on_published=published.append)
    assert set(metrics) == {"timing/weight_sync_s", "weight_sync/stage_s", "weight_sync/bytes"}
    assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
    assert pub.pending_version == 1 and pub.published_version is None and published == []
    learner.optimizer_step()  # the next step changes the parameters while the push is pending
    engines[0].gate.set()
    engines[1].start.set()  # b receives every byte but has not finished loading
    _wait_for(lambda: ("loaded", "a", 1) in log, "engine a loads v1")
    # One engine holds v1, the other does not yet: nothing is published.
    assert not pub.pending_done() and pub.published_version is None and published == []
    engines[1].gate.set()
    done = pub.wait()
    assert published == [1] and pub.published_version == 1 and pub.pending_version is None
    assert done["weight_sync/bytes"] > 0 and done["weight_sync/publish_lag_s"] >= 0
    for e in engines:  # the weights as staged, not as the next step left them
        assert e.policy_version == 1 and e.weights.keys() == sent.keys()
        assert all(torch.equal(e.weights[n], sent[n]) for n in sent)
    pub.close()


def test_the_next_push_waits_until_the_pending_one_is_loaded():
    log: list = []
    engine = _GatedEngine(log, "a")
    learner = _Learner()
    pub = _publisher(learner, [engine])
    learner.optimizer_step()
    pub.start_push(learner.version)
    learner.optimizer_step()
    second = {n: t.clone() for n, t in learner.named}
    th, out = _in_thread(lambda: pub.start_push(learner.version), log, ("returned", 2))
    th.join(timeout=1.0)  # time for a push that did not wait to overtake the first one
    engine.gate.set()
    th.join(timeout=60)
    assert "error" not in out, out
    pub.wait()
    assert log.index(("loaded", "a", 1)) < log.index(("returned", 2)) < log.index(("loaded", "a", 2)), log
    assert log.index(("loaded", "a", 1)) < log.index(("begin", "a", 2)), log
    assert engine.policy_version == 2 and all(torch.equal(engine.weights[n], second[n]) for n in second)
    pub.close()


def test_a_background_failure_is_raised_at_the_next_push_with_the_text_a_blocking_push_raises():
    learner = _Learner()
    learner.optimizer_step()
    blocking = _GatedEngine([], "a", refuse=1)
    blocking.gate.set()
    pub = _publisher(learner, [blocking])
    with pytest.raises(RuntimeError) as direct:
        pub.push(learner.version)
    pub.close()

    engine = _GatedEngine([], "a", refuse=1)
    engine.gate.set()
    pub = _publisher(learner, [engine])
    published: list[int] = []
    pub.start_push(learner.version, on_published=published.append)  # returns: the failure comes later
    _wait_for(pub.pending_done, "the background push ends")
    with pytest.raises(RuntimeError) as later:
        pub.start_push(learner.version + 1)
    assert REFUSAL in str(later.value) and str(later.value) == str(direct.value)
    assert published == [] and pub.published_version is None and pub.pending_version is None
    pub.start_push(learner.version + 1, on_published=published.append)  # collected once: the next one runs
    pub.wait()
    assert published == [2] and engine.policy_version == 2
    pub.close()


def test_close_waits_for_the_pending_push():
    log: list = []
    engine = _GatedEngine(log, "a")
    learner = _Learner()
    pub = _publisher(learner, [engine])
    pub.start_push(1)
    th, _ = _in_thread(pub.close, log, "closed")
    th.join(timeout=1.0)
    engine.gate.set()
    th.join(timeout=60)
    assert log.index(("loaded", "a", 1)) < log.index("closed") and pub.published_version == 1


class _InProcessEngine:
    """A colocated engine: takes the learner's tensors by reference (``update_weights``)."""

    def __init__(self) -> None:
        self.loaded: list[int] = []

    def update_weights(self, named, version: int) -> None:
        list(named)
        self.loaded.append(version)


def test_colocated_cannot_overlap_and_start_push_blocks():
    engine = _InProcessEngine()
    pub = _publisher(_Learner(), [engine], transport="colocated")
    published: list[int] = []
    assert not pub.can_overlap
    pub.start_push(3, on_published=published.append)
    assert engine.loaded == [3] and published == [3] and pub.pending_version is None


def test_overlap_push_config_key():
    from async_rl.config import load_config

    assert WeightSyncConfig().overlap_push is True
    assert load_config("configs/default.yaml", ["weight_sync.overlap_push=false"]).weight_sync.overlap_push is False
    with pytest.raises(ValueError, match="weight_sync.overlap_push"):
        WeightSyncConfig(overlap_push="sometimes")


# ------------------------------------------------------------------ the async loop's side
def _loop(learner, engines, overlap: bool = True):
    """An ``AsyncLoop`` with only what its publishing path reads: no Ray, no generator actors
    (supervision finds none dead or hung), the pool's engines in this process."""
    from async_rl.loops.async_loop import AsyncLoop
    from async_rl.loops.dispatch import Dispatcher
    from async_rl.loops.pool import GeneratorPool

    loop = AsyncLoop.__new__(AsyncLoop)
    eval_pushes: list[int] = []
    loop.ctx = types.SimpleNamespace(
        learner=learner, cfg=types.SimpleNamespace(generator=types.SimpleNamespace(heartbeat_timeout_s=60),
                                                   weight_sync=types.SimpleNamespace(overlap_push=overlap)),
        publisher=types.SimpleNamespace(push=eval_pushes.append), train_ds=types.SimpleNamespace(state_dict=dict),
        service_cores=[])
    loop._errors = []
    loop.buffer = types.SimpleNamespace(is_finished=lambda g: True, state_dict=dict)
    loop.dispatch = Dispatcher(None, feed=None, forget=None, next_prompt=None, group_size=1, seed=0,
                               published_version=lambda: loop.pool.published_version, num_discarded=lambda: 0)
    loop.pool = GeneratorPool(loop.ctx, cluster=None, broker=None, place=None, lost=None,
                              on_published=loop.dispatch.wake)
    loop.pool.publisher = _publisher(learner, engines)
    loop.pool.published_version = 0
    loop.num_dynamic_dropped = loop.num_trained_groups = 0
    loop.trained_by_generator, loop._last_rejected_samples = {}, 0
    loop.spread, loop._spread_pending = 1, []
    return loop, eval_pushes


def test_the_loop_publishes_a_version_for_admission_only_when_every_engine_holds_it():
    log: list = []
    engines = [_GatedEngine(log, "a"), _GatedEngine(log, "b")]
    learner = _Learner()
    loop, _ = _loop(learner, engines)
    learner.optimizer_step()
    metrics = loop.pool.publish()  # the learner's next step may start now
    assert metrics["timing/weight_sync_s"] >= 0 and loop.pool.published_version == 0
    engines[0].gate.set()
    engines[1].start.set()
    _wait_for(lambda: ("loaded", "a", 1) in log, "engine a loads v1")
    loop._check_health()  # the next step's wait for data: nothing has ended, nothing to raise
    assert loop.pool.published_version == 0
    engines[1].gate.set()
    _wait_for(lambda: loop.pool.published_version == 1, "v1 published from the push's thread")
    loop._check_health()  # collects it
    assert loop.publisher.pending_version is None and "weight_sync/publish_lag_s" in loop.pool.push_metrics
    loop.publisher.close()


@pytest.mark.parametrize("where", ["next_push", "wait_for_data"])
def test_a_background_failure_surfaces_at_the_next_step_with_the_engines_message(where):
    engine = _GatedEngine([], "a", refuse=1)
    engine.gate.set()
    learner = _Learner()
    loop, _ = _loop(learner, [engine])
    learner.optimizer_step()
    loop.pool.publish()
    _wait_for(loop.publisher.pending_done, "the background push ends")
    learner.optimizer_step()
    with pytest.raises(RuntimeError, match=r"receiver 0: ValueError: unknown weight 'model.extra.weight'"):
        loop.pool.publish() if where == "next_push" else loop._check_health()
    assert loop.pool.published_version == 0
    loop.pool.publish()  # the failure was raised once; the next push goes through
    loop.pool.settle()
    assert loop.pool.published_version == 2 and engine.policy_version == 2
    loop.publisher.close()


@pytest.mark.parametrize("call", ["state_dict", "sync_eval_engine"])
def test_a_checkpoint_and_an_evaluation_wait_for_the_pending_push(call):
    log: list = []
    engine = _GatedEngine(log, "a")
    learner = _Learner()
    loop, eval_pushes = _loop(learner, [engine])
    learner.optimizer_step()
    loop.pool.publish()
    th, out = _in_thread(getattr(loop, call), log, call)
    th.join(timeout=1.0)
    engine.gate.set()
    th.join(timeout=60)
    assert "error" not in out, out
    assert log.index(("loaded", "a", 1)) < log.index(call) and loop.pool.published_version == 1
    assert eval_pushes == ([1] if call == "sync_eval_engine" else [])
    loop.publisher.close()


def test_without_overlap_the_loop_publishes_before_the_step_returns():
    engine = _GatedEngine([], "a")
    engine.gate.set()
    learner = _Learner()
    loop, _ = _loop(learner, [engine], overlap=False)
    learner.optimizer_step()
    metrics = loop.pool.publish()
    assert loop.pool.published_version == 1 and loop.publisher.pending_version is None
    assert metrics["weight_sync/publish_lag_s"] >= 0 and "weight_sync/bytes" in metrics
    loop.publisher.close()


def test_a_layer_larger_than_a_bucket_grows_the_slots_before_the_background_push_starts(monkeypatch):
    """Planning a push whose largest layer exceeds the bucket grows the shm slots. ``start_push``
    plans on the caller's thread (for the step's ``weight_sync/bytes``) and the background push
    plans again: the caller's plan must come first, so that two threads never resize the slots
    while one of them sends through them. The big layer then arrives intact."""
    import async_rl.weight_sync.publisher as publisher_mod

    log: list = []
    engines = [_GatedEngine(log, "a")]
    learner = _Learner()
    learner.named.append(("model.big.w", torch.randn(64, 64, generator=torch.Generator().manual_seed(1))))
    pub = _publisher(learner, engines)
    big_bytes = 64 * 64 * 4
    sender = pub._transport.sender
    assert sender._slot_bytes < big_bytes  # 0.004 MB buckets: the layer cannot fit as they are
    started_with: list[int] = []
    real = publisher_mod._in_background

    def record(fn, name):
        started_with.append(sender._slot_bytes)
        return real(fn, name)

    monkeypatch.setattr(publisher_mod, "_in_background", record)
    learner.optimizer_step()
    sent = {n: t.clone() for n, t in learner.named}
    metrics = pub.start_push(learner.version)
    assert started_with and started_with[0] >= big_bytes
    assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
    engines[0].gate.set()
    pub.wait()
    assert engines[0].weights.keys() == sent.keys()
    assert all(torch.equal(engines[0].weights[n], sent[n]) for n in sent)
    pub.close()
