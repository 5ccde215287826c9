"""The warm start reports its progress: ``warm_start(on_step=...)`` is called once per step with
that step's loss, which the trainer shows on a bar of its own (``MetricsLogger.phase``, tested in
test_metrics.py). A fake learner stands in for the real one, so this runs in a second."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from async_rl.step.evaluation import warm_start


class _Learner:
    """Records each supervised step's batch and returns a loss that falls by 0.5 per step."""

    def __init__(self) -> None:
        self.batches = []

    def sft_step(self, batch, lr):
        self.batches.append(batch)
        return {"sft/loss": torch.tensor(4.0 - 0.5 * len(self.batches)), "sft/grad_norm": torch.tensor(1.0)}


def test_warm_start_reports_every_step_with_its_loss(tiny_tokenizer):
    prompts = [SimpleNamespace(uid=f"t:{i}", prompt_ids=tiny_tokenizer("1+2=")["input_ids"], messages=[],
                               reference=str(i), extra_info={"answer": str(i)}) for i in range(3)]
    cfg = SimpleNamespace(steps=6, batch_size=2, lr=1e-3, response_field="extra_info.answer")
    learner, calls, lines = _Learner(), [], []
    warm_start(learner, SimpleNamespace(prompts=prompts), tiny_tokenizer, cfg, tiny_tokenizer.eos_token_id, 0,
               lines.append, on_step=lambda step, loss: calls.append((step, loss)))
    assert len(learner.batches) == 6
    assert calls == [(k, 4.0 - 0.5 * k) for k in range(1, 7)]
    assert all(isinstance(loss, float) for _, loss in calls)
    # The printed lines are unchanged: every fifth of the steps (here every step) and the last.
    assert lines[-1] == "warm start 6/6: loss 1.0000"


def test_hugging_face_bars_are_off_off_a_terminal_unless_the_user_chose(monkeypatch):
    """Off a terminal (stderr captured here) the CLI turns Hugging Face's progress bars off, for
    this process and, through the environment, the ones it starts; a user's setting is kept."""
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as transformers_logging

    from async_rl.cli import _no_progress_bars_off_a_terminal

    monkeypatch.setattr("sys.stderr.isatty", lambda: False, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "0")
    transformers_logging.enable_progress_bar()
    try:
        _no_progress_bars_off_a_terminal()
        assert transformers_logging.is_progress_bar_enabled()

        monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS")
        _no_progress_bars_off_a_terminal()
        import os

        assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
        assert not transformers_logging.is_progress_bar_enabled()
        assert hub_utils.are_progress_bars_disabled()
    finally:
        transformers_logging.enable_progress_bar()
        hub_utils.enable_progress_bars()
