"""The FSDP2 learner on 2 gloo ranks equals 1 rank on the same batch: loss and updated weights,
for every aggregation mode, with sequence-count and token-budget micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from async_rl.algorithms.aggregation import LOSS_AGG_MODES

pytestmark = pytest.mark.slow


def _train(world: int, tmp_path, model_path: str, mode: str, **kw) -> dict:
    from multirank_worker import run

    tmp_path.mkdir(parents=True, exist_ok=True)
    init = tmp_path / f"init-{world}-{mode}"
    out = tmp_path / f"out-{world}-{mode}.pt"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(r, world, str(init), model_path, mode, str(out)), kwargs=kw)
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    return torch.load(out)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_two_ranks_equal_one_rank(tmp_path, tiny_model_path, mode):
    one = _train(1, tmp_path, tiny_model_path, mode)
    two = _train(2, tmp_path, tiny_model_path, mode)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    moved = 0.0
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    from transformers import AutoModelForCausalLM

    start = dict(AutoModelForCausalLM.from_pretrained(tiny_model_path).named_parameters())
    moved = max(float((w - start[n]).abs().max()) for n, w in one["weights"].items())
    assert moved > 1e-4  # the step changed the weights, so equality could fail


def test_two_ranks_with_token_budget_and_critic_equal_one_rank(tmp_path, tiny_model_path):
    one = _train(1, tmp_path, tiny_model_path, "token-mean", max_tokens=24, critic=True)
    two = _train(2, tmp_path, tiny_model_path, "token-mean", max_tokens=24, critic=True)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["vf"] == pytest.approx(one["vf"], rel=1e-5, abs=1e-7)
    # The largest ratio of any token, whatever the rank split and micro-batch cut (it was a
    # token-weighted mean of per-micro-batch maxima, which depends on both); the second
    # mini-batch moved it off 1.
    assert one["ratio_max"] > 1.0 + 1e-3
    assert two["ratio_max"] == pytest.approx(one["ratio_max"], rel=1e-5)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_two_packed_ranks_with_critic_equal_one_padded_rank(tmp_path, tiny_model_path):
    # Packing changes the micro-batch cut (sum of lengths) and the forward layout, not the update;
    # the uneven packed micro-batch counts per rank are evened out with empty passes.
    one = _train(1, tmp_path / "a", tiny_model_path, "token-mean", max_tokens=24, critic=True)
    two = _train(2, tmp_path / "b", tiny_model_path, "token-mean", max_tokens=24, critic=True, packing=True)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert two["vf"] == pytest.approx(one["vf"], rel=1e-5, abs=1e-7)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_two_rank_sft_step_equals_one_rank_at_half_the_tokens(tmp_path, tiny_model_path):
    one = _train(1, tmp_path / "a", tiny_model_path, "token-mean", sft=True)
    two = _train(2, tmp_path / "b", tiny_model_path, "token-mean", sft=True, packing=True, max_tokens=24)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    # Rank 0 ran its token-balanced share of the rows, not the whole batch (the "vf" slot
    # carries the real tokens it forwarded).
    assert one["vf"] == 94  # make_batch's 11 sequences
    assert 0 < two["vf"] < 0.75 * one["vf"]


def test_token_budget_micro_batches_equal_padded_ones(tmp_path, tiny_model_path):
    # Other micro-batch cuts and trimmed padding, same global normalisers: the same update.
    padded = _train(1, tmp_path / "a", tiny_model_path, "seq-mean-token-mean")
    budget = _train(1, tmp_path / "b", tiny_model_path, "seq-mean-token-mean", max_tokens=20)
    assert budget["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
    for name, w in padded["weights"].items():
        torch.testing.assert_close(budget["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_trainer_two_ranks_ppo_equals_one_rank(tmp_path):
    """The default job with learner.world_size=2 (a Ray-placed follower rank) and PPO + critic
    selected by config: the first step (same weights, same rollouts) gives the 1-rank losses."""
    from test_checkpoint import _cfg, _steps

    from async_rl.trainer import train

    extra = ("algorithm.name=ppo", "algorithm.kl_coef=0.01", "algorithm.use_kl_in_reward=false", "trainer.total_steps=2")
    one = train(_cfg(tmp_path, "one", *extra))
    two = train(_cfg(tmp_path, "two", *extra, "learner.world_size=2"))
    assert one["last_step"] == two["last_step"] == 2
    a, b = _steps(tmp_path / "one"), _steps(tmp_path / "two")
    # _cfg's reward (the length's parity) gives the first step a gradient: the second mini-batch's
    # ratios then compare one update, not two roundings (they differed by ~1e-4 with a reward of 0).
    assert 0 < a[1]["rollout/reward_mean"] < 1 and a[1]["actor/grad_norm"] > 0.1 and a[1]["loss/ratio_max"] > 1.001
    # Per-micro-batch metrics are token-weighted over both ranks' micro-batches, not rank 0's share.
    for key in ("loss/pg", "critic/vf_loss", "actor/grad_norm", "critic/grad_norm", "actor/entropy", "loss/kl",
                "loss/clip_frac", "critic/vf_clip_frac", "loss/ratio_max"):
        assert b[1][key] == pytest.approx(a[1][key], rel=1e-5, abs=1e-6), key
    assert b[1]["rollout/reward_mean"] == a[1]["rollout/reward_mean"]


def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, monkeypatch):
    """DCP reshards: a checkpoint written by 2 learner ranks resumes on 1 and continues like an
    uninterrupted 1-rank run."""
    import signal

    from test_checkpoint import _cfg, _interrupt_after, _steps

    from async_rl.loops.sync import SyncLoop
    from async_rl.trainer import train

    extra = ("trainer.total_steps=4",)
    train(_cfg(tmp_path, "full", *extra))
    with monkeypatch.context() as m:
        m.setattr(SyncLoop, "step", _interrupt_after(2, signal.SIGTERM))
        first = train(_cfg(tmp_path, "split", *extra, "learner.world_size=2"))
    assert first["interrupted"] == "SIGTERM"
    train(_cfg(tmp_path, "split", *extra, "trainer.resume=auto"))
    a, b = _steps(tmp_path / "full"), _steps(tmp_path / "split")
    assert all(0 < a[step]["rollout/reward_mean"] < 1 for step in range(1, 5))
    for step in range(1, 5):
        assert b[step]["loss/pg"] == pytest.approx(a[step]["loss/pg"], rel=1e-3, abs=1e-5), step


@pytest.mark.parametrize("backend", [(), ("learner.backend=megatron", "learner.megatron.tensor_parallel_size=2")],
                         ids=["fsdp2", "megatron-tp2"])
def test_torchrun_launch(tmp_path, backend):
    """``torchrun --nproc-per-node 2 -m async_rl.cli train ... learner.world_size=2``: rank 0 runs
    the trainer, rank 1 only its learner rank; the run finishes and saves a checkpoint (both
    learner backends)."""
    if backend:
        pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert torchrun, "torchrun ships with torch"
    proc = subprocess.run(
        # --log-dir: torchrun otherwise leaves an empty torchelastic_* directory in the temp dir per launch.
        [torchrun, "--nproc-per-node", "2", "--log-dir", str(tmp_path / "torchrun"), "-m", "async_rl.cli", "train", "--config", str(root / "configs/default.yaml"),
         f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.total_steps=2",
         "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.warm_start.steps=0",
         "data.val_max_prompts=4", "learner.world_size=2", "logging.progress=false", *backend],
        cwd=root, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.msgpack").exists()
    assert (tmp_path / "run" / "final_model" / "config.json").exists()


def test_exit_rank_process_keeps_status_output_and_atexit_handlers(tmp_path):
    """Ranks end through ``exit_rank_process`` (no interpreter finalization, where gloo's worker
    threads could abort a finished run): the status reaches the parent, buffered output is not
    lost, and atexit handlers (W&B, shared-memory cleanup) still run."""
    import subprocess
    import sys

    marker = tmp_path / "atexit.txt"
    code = ("import atexit, sys\n"
            "from async_rl.learners.launch import exit_rank_process\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').write('ran'))\n"
            "print('buffered on stdout', end='')\n"
            "sys.stderr.write('and on stderr')\n"
            "exit_rank_process(3)\n"
            "print('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout == "buffered on stdout"
    assert proc.stderr.endswith("and on stderr")
    assert marker.read_text() == "ran"


def test_two_ranks_equal_one_rank_on_the_moe_model(tmp_path):
    """FSDP2 shards a mixture-of-experts layer's stacked experts (``[E, 2I, H]``) like any
    parameter: two ranks take the one-rank step, experts and routers included."""
    from transformers import AutoModelForCausalLM

    from async_rl.data.builtin import resolve
    from async_rl.weight_sync import ModuleWeights

    path = resolve("builtin:tiny-qwen3-moe")
    one = _train(1, tmp_path / "a", path, "token-mean")
    two = _train(2, tmp_path / "b", path, "token-mean")
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
    assert "model.layers.1.mlp.experts.5.down_proj.weight" in one["weights"]
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
    start = dict(ModuleWeights(AutoModelForCausalLM.from_pretrained(path)).named_weights())
    moved = {n: float((w - start[n]).abs().max()) for n, w in one["weights"].items()}
    assert moved["model.layers.0.mlp.gate.weight"] > 1e-5 and max(moved.values()) > 1e-4
