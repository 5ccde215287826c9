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
    for name, w in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_token_budget_micro_batches_equal_padded_ones(tmp_path, tiny_model_path):
    # Other micro-batch cuts and trimmed padding, same global normalisers: the same update.
    padded = _train(1, tmp_path / "a", tiny_model_path, "seq-mean-token-mean")
    budget = _train(1, tmp_path / "b", tiny_model_path, "seq-mean-token-mean", max_tokens=20)
    assert budget["loss"] == pytest.approx(padded["loss"], rel=1e-5, abs=1e-7)
    for name, w in padded["weights"].items():
        torch.testing.assert_close(budget["weights"][name], w, rtol=1e-5, atol=1e-6, msg=name)
