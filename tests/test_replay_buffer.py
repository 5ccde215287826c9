"""Tests for async_rl.buffers.replay: group assembly, duplicates, staleness eviction, reuse, checkpointing
and the admission rule, with hand-computed counts.

Run with ``python -m pytest -q tests/test_replay_buffer.py`` (about a second).
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading
import time

import numpy as np
import pytest

from async_rl.buffers.replay import AdmissionController, ReplayBuffer, staleness
from async_rl.buffers.trajectory import Trajectory


def tr(group_id: int, index: int, version: int | list[int] = 0, num_tokens: int = 3) -> Trajectory:
    versions = version if isinstance(version, list) else [version] * num_tokens
    n = len(versions)
    return Trajectory(
        trajectory_id=f"{group_id}/{index}", group_id=group_id, prompt_uid=f"p{group_id}",
        prompt_ids=[1, 2], response_ids=list(range(10, 10 + n)), behavior_logprobs=[-0.5] * n,
        loss_mask=[1] * n, finish_reason="stop", policy_version=versions, reward=float(index),
        reward_extras={"acc": 1.0}, response_text=f"r{index}")


def ids(groups) -> list[list[str]]:
    return [[t.trajectory_id for t in g] for g in groups]


# ------------------------------------------------------------------------------------- assembly
def test_interleaved_groups_assemble_and_serve_in_completion_order():
    buf = ReplayBuffer(group_size=3, max_staleness=0)
    order = [(1, 0), (0, 0), (2, 0), (1, 1), (2, 1), (0, 1), (2, 2), (0, 2), (1, 2)]
    for g, i in order[:-1]:
        assert buf.add(tr(g, i))
    assert buf.get_groups(3, 0) is None  # only groups 2 and 0 are complete: all or nothing
    assert buf.metrics()["buffer/num_groups_ready"] == 2.0 and buf.metrics()["buffer/num_partial_groups"] == 1.0
    assert buf.add(tr(1, 2))
    assert ids(buf.get_groups(3, 0)) == [["2/0", "2/1", "2/2"], ["0/0", "0/1", "0/2"], ["1/0", "1/1", "1/2"]]
    assert buf.get_groups(1, 0) is None
    m = buf.metrics()
    assert (m["buffer/num_samples"], m["buffer/completed_groups"], m["buffer/served_samples"]) == (0.0, 3.0, 9.0)


def test_group_closed_with_fewer_completes_before_or_after_its_samples():
    buf = ReplayBuffer(group_size=4, max_staleness=0)
    buf.add(tr(5, 0))
    buf.add(tr(5, 2))
    buf.close_group(5, 2)  # after its samples: completes at once
    buf.close_group(6, 3)  # before its samples: completes at the third
    buf.add(tr(6, 0))
    buf.add(tr(6, 1))
    assert buf.metrics()["buffer/num_groups_ready"] == 1.0
    buf.add(tr(6, 3))
    assert ids(buf.get_groups(2, 0)) == [["5/0", "5/2"], ["6/0", "6/1", "6/3"]]
    buf.close_group(6, 3)  # repeating is a no-op
    assert not buf.add(tr(6, 2))  # a sample the producer said was rejected
    assert buf.dropped == {"duplicate": 0, "late": 1, "stale": 0, "abandoned": 0}
    assert buf.counters["rejected_samples"] == 2 + 1


def test_group_closed_with_zero_counts_as_rejected_and_is_never_served():
    buf = ReplayBuffer(group_size=2, max_staleness=0)
    buf.close_group(3, 0)
    buf.close_group(3, 0)
    assert buf.dropped_groups == {"stale": 0, "rejected": 1, "abandoned": 0}
    assert buf.counters["rejected_samples"] == 2
    assert not buf.add(tr(3, 0))
    assert buf.get_groups(1, 0) is None
    assert buf.metrics()["buffer/rejected_groups"] == 1.0


def test_full_group_then_close_with_group_size_is_a_no_op():
    buf = ReplayBuffer(group_size=2, max_staleness=0)
    buf.add(tr(0, 0))
    buf.add(tr(0, 1))
    buf.close_group(0, 2)
    assert buf.counters["rejected_samples"] == 0 and len(buf.get_groups(1, 0)) == 1


def test_abandon_group_drops_a_partial_group_and_tells_whether_to_reissue():
    buf = ReplayBuffer(group_size=3, max_staleness=0)
    buf.add(tr(0, 0)), buf.add(tr(0, 1))
    for i in range(3):
        buf.add(tr(1, i))
    assert buf.abandon_group(0) is True   # partial: re-issue its prompt
    assert buf.abandon_group(1) is False  # complete: keep it, nothing to re-issue
    assert buf.abandon_group(2) is True   # never seen
    assert not buf.add(tr(0, 2)) and not buf.add(tr(2, 0))  # stragglers of the dead generator
    buf.close_group(0, 3)  # a close that raced the abandonment: no-op
    assert buf.dropped == {"duplicate": 0, "late": 2, "stale": 0, "abandoned": 2}
    assert buf.dropped_groups == {"stale": 0, "rejected": 0, "abandoned": 2}
    assert ids(buf.get_groups(1, 0)) == [["1/0", "1/1", "1/2"]] and buf.get_groups(1, 0) is None
    assert buf.metrics()["buffer/num_partial_groups"] == 0.0


@pytest.mark.parametrize("setup, call, match", [
    (lambda b: None, lambda b: b.close_group(0, 3), r"expected must be in \[0, 2\]"),
    (lambda b: None, lambda b: b.close_group(0, -1), r"expected must be in \[0, 2\]"),
    (lambda b: b.close_group(0, 1), lambda b: b.close_group(0, 2), "already closed or completed with 1"),
    (lambda b: [b.add(tr(0, 0)), b.add(tr(0, 1))], lambda b: b.close_group(0, 1), "completed with 2"),
    (lambda b: b.add(tr(0, 0)), lambda b: b.close_group(0, 0), "1 trajectories of it are already stored"),
])
def test_close_group_rejects_contradictions(setup, call, match):
    buf = ReplayBuffer(group_size=2, max_staleness=0)
    setup(buf)
    with pytest.raises(ValueError, match=match):
        call(buf)


def test_duplicates_are_dropped_before_and_after_serving():
    buf = ReplayBuffer(group_size=2, max_staleness=0)
    assert buf.add(tr(0, 0))
    assert not buf.add(tr(0, 0))  # before the group completes
    assert buf.add(tr(0, 1))
    assert not buf.add(tr(0, 1))  # after it completes, before serving
    assert ids(buf.get_groups(1, 0)) == [["0/0", "0/1"]]
    assert not buf.add(tr(0, 0))  # after serving
    assert buf.dropped["duplicate"] == 3
    assert buf.get_groups(1, 0) is None
    assert buf.metrics()["buffer/dropped_duplicate"] == 3.0


# ------------------------------------------------------------------------------------ staleness
def test_staleness_helper():
    assert staleness(tr(0, 0, [3, 4, 5]), 7) == 4
    assert staleness(tr(0, 0, 7), 7) == 0


def test_stale_groups_are_evicted_with_exact_counts():
    buf = ReplayBuffer(group_size=2, max_staleness=1)
    # group: versions of its two samples -> staleness at v = 3 is 3 - min(version)
    buf.add(tr(0, 0, 1)), buf.add(tr(0, 1, 2))          # min 1 -> 2: stale
    buf.add(tr(1, 0, 2)), buf.add(tr(1, 1, [1, 2, 3]))  # a mid-generation update: min 1 -> stale
    buf.add(tr(2, 0, 2)), buf.add(tr(2, 1, 3))          # min 2 -> 1: kept
    buf.add(tr(3, 0, 3)), buf.add(tr(3, 1, 3))          # 0: kept
    buf.add(tr(4, 0, 0))                                # partial groups are not evicted
    assert buf.get_groups(3, 3) is None  # eviction happens even when not enough are left
    assert buf.dropped == {"duplicate": 0, "late": 0, "stale": 4, "abandoned": 0}
    assert buf.dropped_groups == {"stale": 2, "rejected": 0, "abandoned": 0}
    got = buf.get_groups(2, 3)
    assert [g[0].group_id for g in got] == [2, 3]
    m = buf.metrics()
    assert (m["staleness/hist_0"], m["staleness/hist_1"]) == (3.0, 1.0) and "staleness/hist_2" not in m
    assert (m["buffer/dropped_stale"], m["buffer/dropped_stale_groups"], m["buffer/num_partial_groups"]) == (4.0, 2.0, 1.0)


def test_version_must_not_decrease_or_run_behind_the_samples():
    buf = ReplayBuffer(group_size=1, max_staleness=2)
    buf.get_groups(1, 5)
    with pytest.raises(ValueError, match="current_version 4 < previous 5"):
        buf.get_groups(1, 4)
    buf.add(tr(0, 0, 9))
    with pytest.raises(ValueError, match="policy version 9, newer than current_version 5"):
        buf.get_groups(1, 5)


def _stream(rng: random.Random, num_groups: int, group_size: int, max_lag: int, jitter: float = 3.0):
    """Events ``(time, kind, ...)`` of a run whose learner is at version ``int(time / 3)``.

    Group ``g`` starts at time ``g`` with samples up to ``max_lag`` versions old; its samples
    (some rejected, then a ``close``) and a few re-sends arrive within ``jitter`` time units.
    The learner asks for 1-2 groups every time unit.
    """
    events = []
    for g in range(num_groups):
        version = g // 3
        kept = rng.choice([group_size] * 3 + [group_size - 1, 1, 0])
        for i in range(kept):
            lo = max(0, version - rng.choice([0, 0, 0, max_lag]))  # mostly fresh, sometimes too old
            traj = tr(g, i, sorted(rng.randint(lo, version) for _ in range(3)))
            events.append((g + rng.uniform(0, jitter), "add", traj))
            if rng.random() < 0.1:
                events.append((g + rng.uniform(0, jitter), "add", traj))  # a re-send
        if kept < group_size:
            events.append((g + rng.uniform(0, jitter), "close", g, kept))
    events += [(t + 0.5, "get", rng.randint(1, 2), t // 3) for t in range(num_groups + 4)]
    return [e[1:] for e in sorted(events, key=lambda e: e[0])]


def _play(buf, events):
    served = []
    for e in events:
        if e[0] == "add":
            buf.add(e[1])
        elif e[0] == "close":
            buf.close_group(e[1], e[2])
        else:
            served.append(buf.get_groups(e[1], e[2]) or [])
    return served


@pytest.mark.parametrize("max_staleness, max_reuse", [(0, 1), (1, 1), (2, 3), (4, 2)])
def test_never_serves_staleness_above_max_property(max_staleness, max_reuse):
    rng = random.Random(1234 + max_staleness)
    events = _stream(rng, num_groups=200, group_size=4, max_lag=max_staleness + 1)
    kept = {e[1].group_id for e in events if e[0] == "add"}
    buf = ReplayBuffer(group_size=4, max_staleness=max_staleness, max_reuse=max_reuse)
    num_served = 0
    for e in events:
        if e[0] != "get":
            _play(buf, [e])
            continue
        for group in buf.get_groups(e[1], e[2]) or []:
            num_served += 1
            assert max(staleness(t, e[2]) for t in group) <= max_staleness
            assert len({t.group_id for t in group}) == 1 and group[0].group_id in kept
    c = buf.counters
    assert num_served == c["served_groups"] >= 10 and c["stale_groups"] > 0, c  # the property was exercised
    assert c["rejected_groups"] > 0 and c["duplicate"] > 0


def test_accounting_is_exact_without_reuse():
    rng = random.Random(7)
    buf = ReplayBuffer(group_size=2, max_staleness=1)
    served_ids = []
    for step in range(60):
        g = step
        buf.add(tr(g, 0, step // 3)), buf.add(tr(g, 1, step // 3))
        for group in buf.get_groups(rng.randint(1, 2), step // 2) or []:
            served_ids += [t.trajectory_id for t in group]
    c, m = buf.counters, buf.metrics()
    assert len(served_ids) == len(set(served_ids)) == c["served_samples"]
    assert c["completed_groups"] == c["served_groups"] + c["stale_groups"] + m["buffer/num_groups_ready"]


# ---------------------------------------------------------------------------------------- reuse
def test_max_reuse_serves_each_group_up_to_n_times_fresh_first():
    buf = ReplayBuffer(group_size=1, max_staleness=1, max_reuse=2)
    for g in range(3):
        buf.add(tr(g, 0, 0))
    served = [[t.group_id for t in grp] for grp in buf.get_groups(2, 0)]
    assert served == [[0], [1]]
    assert [grp[0].group_id for grp in buf.get_groups(3, 0)] == [2, 0, 1]
    assert [grp[0].group_id for grp in buf.get_groups(1, 0)] == [2]
    assert buf.get_groups(1, 0) is None
    assert buf.counters["served_groups"] == 6


def test_reused_group_still_obeys_staleness():
    buf = ReplayBuffer(group_size=1, max_staleness=1, max_reuse=3)
    buf.add(tr(0, 0, 0))
    assert buf.get_groups(1, 0) and buf.get_groups(1, 1)
    assert buf.get_groups(1, 2) is None
    assert buf.counters["reuse_expired_groups"] == 1
    assert buf.dropped["stale"] == 0  # it was trained on: not lost data


# ------------------------------------------------------------------------------------- blocking
def test_get_groups_waits_for_a_producer_thread_and_times_out_otherwise():
    buf = ReplayBuffer(group_size=2, max_staleness=0)
    t0 = time.monotonic()
    assert buf.get_groups(1, 0, timeout_s=0.1) is None
    assert 0.09 < time.monotonic() - t0 < 1.0

    def produce():
        time.sleep(0.1)
        buf.add(tr(0, 0))
        buf.add(tr(0, 1))

    threading.Thread(target=produce).start()
    assert ids(buf.get_groups(1, 0, timeout_s=5.0)) == [["0/0", "0/1"]]


def test_concurrent_producers_and_consumer_account_for_every_sample():
    buf = ReplayBuffer(group_size=4, max_staleness=0)

    def produce(offset):
        for g in range(offset, offset + 200, 2):
            for i in range(4):
                buf.add(tr(g, i))

    threads = [threading.Thread(target=produce, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    got = []
    while len(got) < 200:
        batch = buf.get_groups(5, 0, timeout_s=10.0)
        assert batch is not None
        got += batch
    for t in threads:
        t.join()
    assert sorted(g[0].group_id for g in got) == list(range(200))


# ------------------------------------------------------------------------------------ checkpoint
def test_state_dict_round_trip_mid_stream_continues_identically():
    events = _stream(random.Random(1), num_groups=40, group_size=3, max_lag=1)
    cut = len(events) // 2
    straight = ReplayBuffer(group_size=3, max_staleness=1, max_reuse=2)
    expected = _play(straight, events)

    first = ReplayBuffer(group_size=3, max_staleness=1, max_reuse=2)
    served = _play(first, events[:cut])
    state = first.state_dict()
    assert state["partial"] and state["seen_ids"] and any(g["times_served"] for g in state["ready"])
    restored = ReplayBuffer(group_size=3, max_staleness=1, max_reuse=2)
    restored.load_state_dict(json.loads(json.dumps(state)))  # plain Python: survives JSON
    assert restored.state_dict() == state and restored.metrics() == first.metrics()
    served += _play(restored, events[cut:])

    assert served == expected and sum(map(len, expected)) > 10
    assert restored.state_dict() == straight.state_dict()
    assert restored.metrics() == straight.metrics()


def test_state_dict_round_trip_keeps_teacher_logprobs_bit_exact():
    """A distillation run's held trajectories (partial and ready, served or not) come back from a
    JSON checkpoint with the teacher's log-probs bit for bit; one without them stays without."""
    teacher = {(0, 0): [-0.0, -5e-324, -1.0000000000000002], (0, 1): [-1e308, -0.1, -2.5],
               (1, 0): [-0.3333333333333333, -7.0, -1e-310]}
    buf = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    for (g, i), values in teacher.items():
        buf.add(dataclasses.replace(tr(g, i), teacher_logprobs=values))
    buf.add(tr(2, 0))  # no teacher: stays empty
    state = buf.state_dict()
    assert state["ready"][0]["trajectories"][0]["teacher_logprobs"] == teacher[0, 0]
    restored = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    restored.close_group(1, 1)  # the partial groups, completed short so they are served
    restored.close_group(2, 1)
    groups = restored.get_groups(3, 0)
    assert [[t.trajectory_id for t in g] for g in groups] == [["0/0", "0/1"], ["1/0"], ["2/0"]]
    got = [t for g in groups for t in g]
    assert [_bits(t.teacher_logprobs) for t in got] == [_bits(teacher[k]) for k in teacher] + [[]]
    assert all(t.teacher_logprobs.dtype == np.float64 for t in got)
    assert got[:2] == [dataclasses.replace(tr(0, i), teacher_logprobs=teacher[0, i]) for i in (0, 1)]


def test_state_dict_round_trip_keeps_the_teacher_top_k():
    """A top-k distillation run's held trajectories come back from a JSON checkpoint with their
    [R, K] teacher ids and float32 log-probs exactly; one without a top-k stays [0, 0]."""
    ids = np.array([[3, 1], [0, 7], [2, 2]], np.int32)
    lps = np.array([[-0.1, -2.5], [-1e-7, -30.0], [-0.7, -0.7]], np.float32)
    buf = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    buf.add(dataclasses.replace(tr(0, 0), teacher_topk_ids=ids, teacher_topk_logprobs=lps))
    buf.add(tr(0, 1))
    state = buf.state_dict()
    restored = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    first, second = restored.get_groups(1, 0)[0]
    assert first.teacher_topk_ids.dtype == np.int32 and first.teacher_topk_logprobs.dtype == np.float32
    np.testing.assert_array_equal(first.teacher_topk_ids, ids)
    assert first.teacher_topk_logprobs.tobytes() == lps.tobytes()
    assert second.teacher_topk_ids.shape == (0, 0)


def test_state_dict_keeps_each_top_k_bit_exact_in_partial_and_served_groups():
    """Every awkward float32 (-0.0, a subnormal, the most negative, the 1e-6 round-off) and int32
    id comes back from a JSON checkpoint bit for bit, whatever K a trajectory has (the buffer
    does not care that a run has one K), in a partial group and in a served one kept for reuse."""
    lps = np.array([[-0.0, 0.0, -1e-45], [-3.4028235e38, 1e-6, -1.0000001]], np.float32)
    ids = np.array([[0, 2**31 - 1, 7], [1, 2, 3]], np.int32)
    top = {(0, 0): (ids, lps), (0, 1): (ids[:, :1], lps[:, 2:]), (1, 0): (ids[:, ::-1].copy(), -lps)}
    buf = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    for (g, i), (k_ids, k_lps) in top.items():
        buf.add(dataclasses.replace(tr(g, i, num_tokens=2), teacher_topk_ids=k_ids, teacher_topk_logprobs=k_lps))
    assert buf.get_groups(1, 0) is not None  # group 0 served once, kept for reuse
    state = buf.state_dict()
    assert state["format"] == 4 and state["partial"][0][1][0]["teacher_topk_ids"] == top[1, 0][0].tolist()
    restored = ReplayBuffer(group_size=2, max_staleness=1, max_reuse=2)
    restored.load_state_dict(json.loads(json.dumps(state)))
    assert restored.state_dict() == state
    restored.close_group(1, 1)
    got = [t for g in restored.get_groups(2, 0) for t in g]
    assert [t.trajectory_id for t in got] == ["0/0", "0/1", "1/0"]
    for t, (k_ids, k_lps) in zip(got, top.values()):
        assert t.teacher_topk_ids.dtype == np.int32 and t.teacher_topk_ids.tobytes() == k_ids.tobytes()
        assert t.teacher_topk_logprobs.dtype == np.float32 and t.teacher_topk_logprobs.tobytes() == k_lps.tobytes()
        assert t.teacher_topk_logprobs.shape == k_lps.shape


@pytest.mark.parametrize("old", [1, 2, 3])
def test_an_older_format_state_resumes_without_what_it_lacked(old):
    """Format 1 (before the teacher's top-k) has no top-k keys, format 2 no routing and format 3
    no observation images; a run checkpointed then resumes, its trajectories without them, and
    saves format 4 from then on."""
    buf = ReplayBuffer(group_size=2, max_staleness=1)
    buf.add(tr(0, 0))
    state = json.loads(json.dumps(buf.state_dict()))
    for t in state["partial"][0][1]:
        del t["observation_pixel_values"], t["observation_image_grid_thw"]
        if old <= 2:
            del t["routed_experts"]
        if old == 1:
            del t["teacher_topk_ids"], t["teacher_topk_logprobs"]
    restored = ReplayBuffer(group_size=2, max_staleness=1)
    restored.load_state_dict({**state, "format": old})
    assert restored.state_dict() == buf.state_dict() and restored.state_dict()["format"] == 4
    restored.close_group(0, 1)
    (got,), = restored.get_groups(1, 0)
    assert got == tr(0, 0) and got.teacher_topk_ids.shape == (0, 0) and got.routed_experts.shape == (0, 0, 0)
    assert got.observation_pixel_values.shape == (0, 0) and got.observation_image_grid_thw.shape == (0, 3)


def test_state_dict_keeps_observation_images_bit_exact():
    """An episode's observation images (float32 patches, int64 grids) come back from a JSON
    checkpoint bit for bit."""
    pixels = np.array([[-0.0, 1e-45, 3.4028235e38, -1.7920929], [0.5, -2.0, 1.25, 7.0]], np.float32)
    buf = ReplayBuffer(group_size=2, max_staleness=1)
    buf.add(dataclasses.replace(tr(0, 0), observation_pixel_values=pixels,
                                observation_image_grid_thw=np.array([[1, 1, 2]], np.int64)))
    state = json.loads(json.dumps(buf.state_dict()))
    restored = ReplayBuffer(group_size=2, max_staleness=1)
    restored.load_state_dict(state)
    restored.close_group(0, 1)
    (got,), = restored.get_groups(1, 0)
    assert got.observation_pixel_values.dtype == np.float32 and got.observation_pixel_values.tobytes() == pixels.tobytes()
    assert got.observation_image_grid_thw.tolist() == [[1, 1, 2]] and got.observation_image_grid_thw.dtype == np.int64


def test_state_dict_keeps_routed_experts_exactly():
    """Routing replay's [P + R - 1, layers, k] int16 routing comes back from a JSON checkpoint as it went."""
    t = tr(0, 0, num_tokens=2)
    routed = np.arange((len(t.prompt_ids) + 1) * 3 * 2, dtype=np.int16).reshape(-1, 3, 2)
    buf = ReplayBuffer(group_size=2, max_staleness=1)
    buf.add(dataclasses.replace(t, routed_experts=routed))
    restored = ReplayBuffer(group_size=2, max_staleness=1)
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    restored.close_group(0, 1)
    (got,), = restored.get_groups(1, 0)
    assert got.routed_experts.dtype == np.int16 and np.array_equal(got.routed_experts, routed)


def _bits(xs) -> list[int]:
    return np.asarray(xs, dtype=np.float64).view(np.int64).tolist()


def test_load_state_dict_checks_format_and_group_size():
    state = ReplayBuffer(group_size=3, max_staleness=1).state_dict()
    with pytest.raises(ValueError, match="group_size 3, this buffer 4"):
        ReplayBuffer(group_size=4, max_staleness=1).load_state_dict(state)
    with pytest.raises(ValueError, match="state format 99, this code reads 1, 2, 3"):
        ReplayBuffer(group_size=3, max_staleness=1).load_state_dict({**state, "format": 99})


# ------------------------------------------------------------------------------------- admission
def test_admission_boundary_values():
    ac = AdmissionController(groups_per_step=4, max_staleness=1)
    assert ac.capacity(0) == 8 and ac.capacity(1) == 12
    # num_started_groups counts groups already started; the new one makes it + 1.
    assert ac.can_start(7, 0) and not ac.can_start(8, 0)  # the 8th may start, the 9th may not
    assert ac.can_start(11, 1) and not ac.can_start(12, 1)
    assert ac.can_start(8, 0, num_discarded_groups=1) and not ac.can_start(9, 0, num_discarded_groups=1)


def test_admission_with_zero_staleness_is_synchronous():
    ac = AdmissionController(groups_per_step=2, max_staleness=0)
    assert [ac.can_start(n, 0) for n in range(4)] == [True, True, False, False]
    assert [ac.can_start(n, 1) for n in range(5)] == [True, True, True, True, False]


@pytest.mark.parametrize("kw", [dict(groups_per_step=0, max_staleness=0), dict(groups_per_step=1, max_staleness=-1)])
def test_invalid_configs_raise(kw):
    with pytest.raises(ValueError):
        AdmissionController(**kw)
    with pytest.raises(ValueError):
        ReplayBuffer(group_size=kw["groups_per_step"], max_staleness=kw["max_staleness"])


# ------------------------------------------------------------------------------- resident size
def _recount(buf: ReplayBuffer) -> dict[str, float]:
    """The resident size counted from the buffer's contents (what the kept counters must equal)."""
    state = buf.state_dict()
    groups = [m for _, m in state["partial"]] + [g["trajectories"] for g in state["ready"]]
    return {"buffer/num_samples": float(sum(len(m) for m in groups)),
            "buffer/num_tokens": float(sum(len(t["prompt_ids"]) + len(t["response_ids"]) for m in groups for t in m))}


def test_resident_size_and_peak_follow_every_change():
    # Samples of 2 prompt + 3 response tokens: 5 tokens each.
    buf = ReplayBuffer(group_size=2, max_staleness=0, max_reuse=2)
    buf.add(tr(0, 0)), buf.add(tr(0, 1)), buf.add(tr(1, 0)), buf.add(tr(2, 0, version=1))
    m = buf.metrics()
    assert (m["buffer/num_samples"], m["buffer/num_tokens"]) == (4.0, 20.0)
    assert (m["buffer/peak_groups"], m["buffer/peak_samples"], m["buffer/peak_tokens"]) == (3.0, 4.0, 20.0)
    assert not buf.add(tr(0, 0))  # a duplicate is not stored
    assert buf.abandon_group(1)  # its one sample leaves
    assert _recount(buf)["buffer/num_samples"] == buf.metrics()["buffer/num_samples"] == 3.0
    assert buf.get_groups(1, 0) is not None  # served once, kept for reuse
    assert buf.metrics()["buffer/num_samples"] == 3.0
    buf.add(tr(2, 1, version=1))
    assert buf.get_groups(1, 1) is not None  # version 1 evicts group 0 (reuse expired), serves group 2
    m = buf.metrics()
    assert m == {**m, **_recount(buf)} and m["buffer/num_samples"] == 2.0
    assert buf.get_groups(1, 1) is not None  # group 2's second serve: it leaves
    m = buf.metrics()
    assert (m["buffer/num_samples"], m["buffer/num_tokens"], m["buffer/peak_samples"]) == (0.0, 0.0, 4.0)
    # The peak survives a checkpoint; the resident size is recounted from the contents.
    buf.add(tr(3, 0, version=1))
    restored = ReplayBuffer(group_size=2, max_staleness=0, max_reuse=2)
    restored.load_state_dict(json.loads(json.dumps(buf.state_dict())))
    assert restored.metrics() == buf.metrics()


@pytest.mark.parametrize("max_staleness", [0, 1, 3])
def test_admission_bounds_the_resident_groups(max_staleness):
    """A pipeline whose generators are always ready: admission starts every group it allows,
    groups finish in random order (some rejected whole, some abandoned), and the learner takes
    ``B`` groups per version and publishes at once. The buffer never holds more than
    ``AdmissionController.max_resident_groups()`` groups, and reaches it."""
    rng = random.Random(99 + max_staleness)
    B, n = 3, 2
    ac = AdmissionController(groups_per_step=B, max_staleness=max_staleness)
    buf = ReplayBuffer(group_size=n, max_staleness=max_staleness)
    started, in_engine, version, peak = 0, [], 0, 0
    while version < 30:
        while ac.can_start(started, version, sum(buf.dropped_groups.values())):
            in_engine.append((started, version))
            started += 1
        # Engines finish a random share of what they hold, in random order.
        rng.shuffle(in_engine)
        for _ in range(rng.randint(0, len(in_engine))):
            g, v = in_engine.pop()
            fate = rng.random()
            if fate < 0.1:
                buf.close_group(g, 0)
            elif fate < 0.15:
                buf.add(tr(g, 0, v))
                buf.abandon_group(g)
            else:
                buf.add(tr(g, 0, v)), buf.add(tr(g, 1, v))
        peak = max(peak, buf.metrics()["buffer/num_groups_ready"] + buf.metrics()["buffer/num_partial_groups"])
        if buf.get_groups(B, version) is not None:
            version += 1
    m = buf.metrics()
    assert m["buffer/peak_groups"] == peak == ac.max_resident_groups() == (max_staleness + 1) * B
    assert m["buffer/peak_samples"] <= ac.max_resident_groups() * n


# ---------------------------------------------------------------------------------- serve order
def _served(groups) -> list[int]:
    return [g[0].group_id for g in groups]


def test_dispatch_order_never_lets_a_later_group_overtake_one_still_in_flight():
    buf = ReplayBuffer(group_size=2, max_staleness=1, serve_order="dispatch")
    buf.note_dispatched([0, 1, 2, 3])
    for g in (3, 1, 2):  # the short groups finish first, group 0 is still being sampled
        buf.add(tr(g, 0)), buf.add(tr(g, 1))
    assert buf.get_groups(1, 0) is None
    buf.add(tr(0, 0))
    assert buf.get_groups(1, 0, timeout_s=0.05) is None  # half of group 0 is not group 0
    buf.add(tr(0, 1))
    assert _served(buf.get_groups(2, 0)) == [0, 1]
    assert _served(buf.get_groups(2, 0)) == [2, 3]
    # The same arrivals served by completion: the late group 0 comes last.
    buf = ReplayBuffer(group_size=2, max_staleness=1, serve_order="completion")
    for g in (3, 1, 2, 0):
        buf.add(tr(g, 0)), buf.add(tr(g, 1))
    assert _served(buf.get_groups(4, 0)) == [3, 1, 2, 0]


def test_dispatch_order_moves_past_rejected_abandoned_and_evicted_groups():
    buf = ReplayBuffer(group_size=2, max_staleness=1, serve_order="dispatch")
    buf.note_dispatched([0, 1, 2, 3])
    buf.add(tr(3, 0, 2)), buf.add(tr(3, 1, 2))
    assert buf.get_groups(1, 2) is None
    buf.close_group(0, 0)  # rejected whole
    assert buf.abandon_group(1)  # its generator died: re-issued under a new id
    buf.note_dispatched([4])
    assert buf.get_groups(1, 2) is None  # group 2 is still in flight
    buf.add(tr(2, 0, 0)), buf.add(tr(2, 1, 0))  # too old at version 2: evicted, not waited for
    assert _served(buf.get_groups(1, 2)) == [3]
    assert buf.dropped_groups == {"stale": 1, "rejected": 1, "abandoned": 1}
    assert buf.get_groups(1, 2) is None  # the re-issued group 4 is in flight


def test_dispatch_order_wakes_a_waiting_learner_when_the_frontier_group_ends():
    buf = ReplayBuffer(group_size=1, max_staleness=0, serve_order="dispatch")
    buf.note_dispatched([0, 1])
    buf.add(tr(1, 0))
    threading.Timer(0.1, buf.close_group, args=(0, 0)).start()  # group 0 is rejected meanwhile
    t0 = time.monotonic()
    assert _served(buf.get_groups(1, 0, timeout_s=5.0)) == [1]
    assert time.monotonic() - t0 < 2.0


def test_dispatch_order_serves_reused_groups_after_fresh_ones_and_unannounced_groups_by_id():
    buf = ReplayBuffer(group_size=1, max_staleness=1, max_reuse=2, serve_order="dispatch")
    for g in (2, 0, 1):  # nothing announced: served by id
        buf.add(tr(g, 0))
    assert _served(buf.get_groups(2, 0)) == [0, 1]
    assert _served(buf.get_groups(3, 0)) == [2, 0, 1]


def _simulate_long_tail(serve_order: str, seed: int, ticks: int = 3000) -> dict[str, float]:
    """A discrete-time async run: admission starts groups (``B = 4``, ``η = 1``) at the learner's
    version, each group completes ``length`` ticks after it starts (a long-tailed length, as
    worked answers have), and the learner takes ``B`` groups whenever it can, training 3 ticks."""
    rng = random.Random(seed)
    B, eta, train_ticks = 4, 1, 3
    admission = AdmissionController(B, eta)
    buf = ReplayBuffer(group_size=1, max_staleness=eta, serve_order=serve_order)
    lengths, started, version, busy_until = {}, 0, 0, 0
    finishing: dict[int, list[Trajectory]] = {}
    trained: list[int] = []
    for t in range(ticks):
        for traj in finishing.pop(t, []):
            buf.add(traj)
        while admission.can_start(started, version, sum(buf.dropped_groups.values())):
            g, started = started, started + 1
            lengths[g] = 1 if rng.random() < 0.8 else 12
            buf.note_dispatched([g])
            finishing.setdefault(t + lengths[g], []).append(tr(g, 0, version, num_tokens=lengths[g]))
        if t >= busy_until and (groups := buf.get_groups(B, version)) is not None:
            trained += _served(groups)
            version += 1
            busy_until = t + train_ticks
    long_share = lambda gs: sum(lengths[g] > 1 for g in gs) / len(gs)  # noqa: E731
    return {"evicted": buf.dropped_groups["stale"], "steps": version, "trained": trained,
            "long_trained": long_share(trained), "long_started": long_share(list(lengths))}


@pytest.mark.parametrize("seed", [0, 1])
def test_serving_by_completion_evicts_the_long_groups_and_dispatch_order_none(seed):
    by_completion = _simulate_long_tail("completion", seed)
    in_order = _simulate_long_tail("dispatch", seed)
    # By completion the learner runs ahead on the short groups; the long ones come back past
    # max_staleness and are evicted, so it trains on fewer long answers than it started.
    assert by_completion["evicted"] > 0
    assert by_completion["long_trained"] < by_completion["long_started"] - 0.05
    # In dispatch order every group is trained, in the order it started, none evicted.
    assert in_order["evicted"] == 0
    assert in_order["trained"] == list(range(len(in_order["trained"])))
    assert in_order["steps"] > 100


def test_an_unknown_serve_order_is_refused():
    with pytest.raises(ValueError, match="serve_order must be one of"):
        ReplayBuffer(group_size=1, max_staleness=0, serve_order="lifo")
