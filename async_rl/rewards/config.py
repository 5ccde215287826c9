"""Reward configuration (``reward.*`` keys)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from async_rl.rewards.model import MODEL_KINDS, validate_model_dir
from async_rl.rewards.scorer import ON_ERROR_MODES


@dataclass
class RewardConfig:
    """Which reward function and/or reward model scores responses, and what happens when it fails."""

    fn: str | None = None
    """A built-in name (``arithmetic``, ``chainsum``, ``gsm8k``, ``math``), ``pkg.module:function`` or
    ``path/to/file.py:function``; ``None`` picks the built-in for each row's ``data_source``
    (with ``model`` set: no function, the reward is the model's alone)."""
    on_error: str = "zero"
    """When the function (or the reward model) raises or returns a non-finite or malformed value:
    ``zero`` (the sample gets reward 0, or model term 0, and is trained on) or ``reject`` (the
    sample is dropped and counted)."""
    num_workers: int = 1
    """Reward-function worker processes per scorer (>= 0). Each generator actor (async mode) and
    the trainer (sync mode and evaluation) has its own pool, started on its first call, so the
    count multiplies: 1 keeps an async job of 2 actors at 3 small processes (one actor, the
    default on 2 cores: 2), and a built-in reward (microseconds to a few ms a call) keeps up
    with generation from one worker; raise it for a slow function (it then scores several
    samples at once). 0 scores in-process on the engine's thread, as before, with no timeout:
    for debugging (``pdb``) only."""
    timeout_s: float = 30.0
    """Seconds one reward-function call may take (> 0; needs ``num_workers`` >= 1). Past it the
    worker is killed and replaced and the sample rejected (``reward/timeouts``). 30 s is far above
    a math-verify check (seconds at worst on a loaded machine) and well below a step, so only a
    hang hits it, and one costs a step at most a few such waits."""
    model: str | None = None
    """A local Hugging Face model directory (or ``builtin:tiny-qwen2-reward``) that scores
    (prompt, response) as a judge (``async_rl.rewards.model``); ``None``: no reward model."""
    model_kind: str = "classifier"
    """``classifier``: a sequence-classification model with one label, its scalar output is the
    score; ``judge``: a causal LM, the score is the probability (0 to 1) of ``judge_token`` after
    ``judge_template``."""
    model_weight: float = 1.0
    """Coefficient of the model score: reward = fn + model_weight * score (``weight * score``
    without ``fn``)."""
    model_batch_size: int = 8
    """Most samples per forward pass of the reward model (>= 1); a batch takes what has finished
    and never waits to fill up."""
    model_max_tokens: int = 1024
    """Longest reward-model input in tokens (>= 1); a longer one loses its first tokens (the start
    of the prompt) and is counted as ``reward/model_truncated``."""
    model_num_threads: int = 0
    """Torch threads of the reward actor in async mode (0: one share of the cores, as a generator
    worker gets); sync mode scores in the trainer's process with its threads."""
    judge_template: str = ("Question: {prompt}\nAnswer: {response}\n"
                           "Is the answer correct? Answer yes or no:")
    """The judge's prompt (``model_kind=judge``): ``str.format`` text with ``{prompt}`` (the prompt's
    message contents) and ``{response}``."""
    judge_token: str = " yes"
    """Text whose first token's next-token probability is the judge's score."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR_MODES:
            raise ValueError(f"reward.on_error must be one of {ON_ERROR_MODES}, got {self.on_error!r}")
        if self.model_kind not in MODEL_KINDS:
            raise ValueError(f"reward.model_kind must be one of {MODEL_KINDS}, got {self.model_kind!r}")
        if self.num_workers < 0:
            raise ValueError(f"reward.num_workers must be >= 0 (0: score in-process), got {self.num_workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0 seconds, got {self.timeout_s}")
        if self.num_workers == 0 and self.timeout_s != RewardConfig.timeout_s:
            logging.getLogger(__name__).warning("reward.timeout_s has no effect with reward.num_workers=0 "
                                                "(in-process scoring has no deadline)")
        for key in ("model_batch_size", "model_max_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"reward.{key} must be >= 1, got {getattr(self, key)}")
        if self.model_num_threads < 0:
            raise ValueError(f"reward.model_num_threads must be >= 0, got {self.model_num_threads}")
        if self.model_kind == "judge":
            try:
                self.judge_template.format(prompt="", response="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"reward.judge_template: only {{prompt}} and {{response}} may be filled in "
                                 f"(bad placeholder {e})") from None
            if not self.judge_token:
                raise ValueError("reward.judge_token must not be empty")
        if self.model is not None and not self.model.startswith("builtin:"):
            # A missing directory stops the run at load, before any training (a built-in one is
            # built, or its unknown name refused, when the run starts).
            validate_model_dir(self.model)
