"""The Megatron learner against the FSDP2 learner (issue 15): one training step on the same batch
gives the same loss and updated weights within 1e-5 (fp32) at tensor-parallel sizes 1 and 2 and
with two pipeline stages, for token-mean and seq-mean-token-sum-norm; the critic, the supervised step and data parallelism
agree too; checkpoints resume exactly and load at another tensor-parallel size; what the backend
cannot do is refused in one line.

Every multi-rank run is a set of spawned gloo ranks (``multirank_worker.run``, the FSDP2 tests'
worker), one torch thread each.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

pytestmark = pytest.mark.slow

MODES = ("token-mean", "seq-mean-token-sum-norm")


def _train(world: int, tmp_path, model_path: str, mode: str, tag: str, **kw) -> dict:
    """One step on ``world`` spawned ranks (``test_learner_multirank._train``), in a folder of its own."""
    from test_learner_multirank import _train as train_ranks

    return train_ranks(world, tmp_path / tag, model_path, mode, **kw)


def _assert_same_step(got: dict, want: dict, start: dict) -> None:
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5, abs=1e-7)
    # The largest token ratio (NaN for the supervised step, which has none) whatever the layout.
    assert got["ratio_max"] == pytest.approx(want["ratio_max"], rel=1e-5, nan_ok=True)
    assert list(got["weights"]) == list(want["weights"])  # names and order: what the engines receive
    for name, w in want["weights"].items():
        torch.testing.assert_close(got["weights"][name], w, rtol=1e-5, atol=1e-5, msg=name)
    # The step moved the weights, so equality could fail.
    assert max(float((w - start[n]).abs().max()) for n, w in want["weights"].items()) > 1e-4


@pytest.fixture(scope="module")
def start_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    return {n: p.detach() for n, p in AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_megatron_step_equals_fsdp2(tmp_path, tiny_model_path, start_weights, mode):
    fsdp = _train(1, tmp_path, tiny_model_path, mode, "fsdp")
    # Tensor-parallel sizes 1 and 2, and two pipeline stages (a tied embedding across them).
    for world, tp, pp in ((1, 1, 1), (2, 2, 1), (2, 1, 2)):
        mg = _train(world, tmp_path, tiny_model_path, mode, f"mg-{tp}-{pp}", backend="megatron", tp=tp, pp=pp)
        _assert_same_step(mg, fsdp, start_weights)


def test_megatron_data_parallel_with_critic_and_temperature_equals_fsdp2(tmp_path, tiny_model_path, start_weights):
    # Two data-parallel replicas (tensor-parallel size 1), the PPO critic and a sampling
    # temperature: the same global normalisers, value loss and log-probs as one FSDP2 rank.
    kw = dict(max_tokens=24, critic=True, temperature=0.7)
    fsdp = _train(1, tmp_path, tiny_model_path, "token-mean", "fsdp", **kw)
    mg = _train(2, tmp_path, tiny_model_path, "token-mean", "mg-dp2", backend="megatron", tp=1, **kw)
    _assert_same_step(mg, fsdp, start_weights)
    assert mg["vf"] == pytest.approx(fsdp["vf"], rel=1e-5, abs=1e-7)


def test_megatron_pipeline_with_critic_steps_and_reloads(tmp_path, tiny_model_path, start_weights):
    # Two pipeline stages of the tied built-in model with the critic (its value head on the last
    # stage only): the step equals FSDP2's, and the stepped policy, critic and AdamW state survive a
    # save and a load into a fresh learner (the last stage's copy of the tied embedding included).
    fsdp = _train(1, tmp_path, tiny_model_path, "token-mean", "fsdp", critic=True)
    mg = _train(2, tmp_path, tiny_model_path, "token-mean", "mg", backend="megatron", pp=2, critic=True, reload=True)
    _assert_same_step(mg, fsdp, start_weights)
    assert mg["vf"] == pytest.approx(fsdp["vf"], rel=1e-5, abs=1e-7)


def test_megatron_sft_step_equals_fsdp2(tmp_path, tiny_model_path, start_weights):
    fsdp = _train(1, tmp_path, tiny_model_path, "token-mean", "fsdp", sft=True)
    mg = _train(2, tmp_path, tiny_model_path, "token-mean", "mg", sft=True, backend="megatron", tp=2)
    _assert_same_step(mg, fsdp, start_weights)


def test_vocab_parallel_logprobs_equal_the_full_softmax():
    """At tensor-parallel size 1 the decomposition is exactly the full log-softmax and entropy
    (pure tensor math; the two-rank split is covered by the TP=2 steps above), with padding
    vocabulary rows beyond ``vocab_size`` ignored."""
    from async_rl.algorithms.logprobs import entropy_from_logits, logprobs_from_logits
    from async_rl.learners.base import init_single_process_group
    from async_rl.learners.megatron.ops import vocab_parallel_logprobs
    from async_rl.learners.megatron.model import init_model_parallel

    init_single_process_group()
    init_model_parallel(1, 1, 0, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 40, generator=g) * 4
    padded = torch.cat([logits, torch.full((3, 5, 2), 50.0)], -1)  # padding rows must not count
    labels = torch.randint(0, 40, (3, 5), generator=g)
    for temp in (1.0, 0.6):
        lp, ent = vocab_parallel_logprobs(padded, labels, temp, 40, with_entropy=True)
        torch.testing.assert_close(lp, logprobs_from_logits(logits, labels, temp), rtol=0, atol=1e-5)
        # Against float64 (logits of magnitude ~20 leave float32 roundoff of ~2e-5 in the library's
        # unshifted form; the shifted one here is closer).
        exact = torch.log_softmax(logits.double() / temp, -1)
        torch.testing.assert_close(ent.double(), -(exact.exp() * exact).sum(-1), rtol=0, atol=1e-5)
        assert float((ent - entropy_from_logits(logits, temp)).abs().max()) < 1e-4


@pytest.mark.parametrize("overrides, message", [
    (["learner.lora.rank=4"], "learner.lora.rank > 0 needs learner.backend=fsdp2"),
    (["learner.world_size=3", "learner.megatron.tensor_parallel_size=2"], "learner.world_size=3 is not a multiple"),
    (["learner.cpu_offload=true"], "learner.cpu_offload=true is an FSDP2 option"),
    (["learner.megatron.tensor_parallel_size=0"], "learner.megatron.tensor_parallel_size must be >= 1"),
    (["learner.backend=deepspeed"], "learner.backend must be one of"),
    # 256 sequences per step in 4 mini-batches of 64: 128 data-parallel ranks cannot all get one.
    (["learner.world_size=256", "learner.megatron.tensor_parallel_size=2"],
     "the 128 data-parallel rank.s. of learner.world_size=256 .* exceeds the 64 sequences"),
])
def test_megatron_refuses_what_it_cannot_do_at_load(overrides, message):
    from pathlib import Path

    from async_rl.config import ConfigError, load_config

    default = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    overrides = overrides if overrides[0].startswith("learner.backend") else ["learner.backend=megatron", *overrides]
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        load_config(default, overrides)


def test_megatron_packed_with_critic_equals_fsdp2_padded(tmp_path, tiny_model_path, start_weights):
    # One packed row per micro-batch with a block-diagonal mask at tensor-parallel size 2 scores
    # and trains like FSDP2's padded rows.
    kw = dict(max_tokens=24, critic=True)
    fsdp = _train(1, tmp_path, tiny_model_path, "token-mean", "fsdp", **kw)
    mg = _train(2, tmp_path, tiny_model_path, "token-mean", "mg", backend="megatron", tp=2, packing=True, **kw)
    _assert_same_step(mg, fsdp, start_weights)
    assert mg["vf"] == pytest.approx(fsdp["vf"], rel=1e-5, abs=1e-7)


def test_trainer_megatron_resumes_and_reshards_like_fsdp2(tmp_path, monkeypatch, private_tmpdir):
    """The default job with PPO, a critic and a KL term on ``learner.backend=megatron``: tensor
    parallel size 2 (a Ray-placed second rank) is interrupted after step 2 and resumed at size 2,
    interrupted again after step 3 and resumed at size 1 (the distributed checkpoint resharded),
    and every step's losses equal an uninterrupted 1-rank FSDP2 run's. The second rank, killed by
    its launcher once stopped, leaves nothing in its temp dir (it held megatron-core's W&B temp
    dirs and saved checkpoints)."""
    import signal

    from test_checkpoint import _cfg, _interrupt_after, _steps

    from async_rl.loops.sync import SyncLoop
    from async_rl.trainer import train

    extra = ("trainer.total_steps=4", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
             "algorithm.use_kl_in_reward=false")
    mg = ("learner.backend=megatron",)
    tp2 = (*mg, "learner.world_size=2", "learner.megatron.tensor_parallel_size=2")
    # The Megatron learner runs every row's whole prompt: so does the FSDP2 run it is held to
    # (a shared prompt rounds differently, and a sample can flip a token).
    train(_cfg(tmp_path, "fsdp", *extra, "learner.shared_prefix=false"))
    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", _interrupt_after(2, signal.SIGTERM))
        assert train(_cfg(tmp_path, "mg", *extra, *tp2))["interrupted"] == "SIGTERM"
    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", _interrupt_after(3, signal.SIGTERM))
        assert train(_cfg(tmp_path, "mg", *extra, *tp2, "trainer.resume=auto"))["interrupted"] == "SIGTERM"
    assert train(_cfg(tmp_path, "mg", *extra, *mg, "trainer.resume=auto"))["last_step"] == 4
    assert sorted(p.name for p in private_tmpdir.iterdir()) == []
    a, b = _steps(tmp_path / "fsdp"), _steps(tmp_path / "mg")
    assert all(0 < a[step]["rollout/reward_mean"] < 1 for step in range(1, 5))  # _cfg's reward: a signal to compare
    for step in range(1, 5):
        for key in ("loss/pg", "critic/vf_loss", "loss/kl", "actor/grad_norm", "critic/grad_norm", "actor/entropy"):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-3, abs=1e-5), (step, key)
    # The exported Hugging Face model is the FSDP2 run's.
    from transformers import AutoModelForCausalLM

    want = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "final_model").state_dict()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "mg" / "final_model").state_dict()
    assert list(got) == list(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("packing", [False, True])
def test_rows_padded_for_sequence_parallelism_score_the_same(tiny_model_path, monkeypatch, packing):
    """Sequence parallelism (CUDA, TP > 1) needs rows of a multiple of the tensor-parallel size;
    the extra pad tokens must change nothing. Forced here at TP=1 on CPU with a multiple of 5."""
    from multirank_worker import make_batch

    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.megatron import MegatronLearner

    algo = AlgorithmConfig(name="ppo", loss_horizon_tokens=16).apply_preset()
    cfg = LearnerConfig(backend="megatron", micro_batch_size=4, packing=packing)
    learner = MegatronLearner(cfg, algo, tiny_model_path, temperature=1.0, total_optimizer_steps=2)
    torch.nn.init.normal_(learner.critic.model.output_layer.weight)  # a fresh head predicts 0 everywhere
    batch = make_batch()
    plain = learner.compute_logprobs(batch)
    plain_values = learner._score_rows(batch, learner.critic.values, learner.critic.model)
    monkeypatch.setattr(learner, "_sequence_multiple", lambda: 5)
    learner.critic.sequence_multiple = 5
    assert batch.input_ids.shape[1] % 5 and int(batch.attention_mask.sum()) % 5  # padding really happens
    torch.testing.assert_close(learner.compute_logprobs(batch), plain, rtol=0, atol=1e-6)
    assert float(plain_values.abs().max()) > 0.1
    torch.testing.assert_close(learner._score_rows(batch, learner.critic.values, learner.critic.model), plain_values,
                               rtol=0, atol=1e-5)


def test_a_collective_failing_on_rank_0_alone_ends_the_run_with_its_error(tmp_path, monkeypatch, private_tmpdir):
    """Rank 0's checkpoint save fails before its first collective while the Ray-placed second
    rank is already inside the save's collectives: the run must end with rank 0's error (the
    follower killed, not waited for forever) and leave no complete checkpoint behind. The killed
    follower's W&B temp dirs carry its pid, so the next start's sweep removes them."""
    import time

    from test_checkpoint import _cfg

    import async_rl.learners.megatron.checkpoint as mc
    from async_rl.runtime.checkpoint import resolve_resume
    from async_rl.utils.leftovers import WANDB_TEMP, pid_alive, sweep_wandb_temp_dirs
    from async_rl.trainer import train

    def disk_full(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(mc, "_checkpoint_state", disk_full)  # the trainer process (rank 0) only
    cfg = _cfg(tmp_path, "run", "trainer.total_steps=1", "trainer.warm_start.steps=0", "learner.backend=megatron",
               "learner.world_size=2", "learner.megatron.tensor_parallel_size=2")
    with pytest.raises(OSError, match="No space left on device"):
        train(cfg)
    assert resolve_resume("auto", str(tmp_path), "run") is None
    left = sorted(p.name for p in private_tmpdir.iterdir())
    assert all(WANDB_TEMP.fullmatch(name) for name in left), left
    deadline = time.monotonic() + 30  # Ray ends the killed actor's process asynchronously
    while any(pid_alive(int(WANDB_TEMP.fullmatch(n)["pid"])) for n in left) and time.monotonic() < deadline:
        time.sleep(0.2)
    sweep_wandb_temp_dirs(min_age_s=0, directory=str(private_tmpdir))
    assert sorted(p.name for p in private_tmpdir.iterdir()) == []
