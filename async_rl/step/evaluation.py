"""Held-out evaluation and the supervised warm start: the two passes of a run outside its RL steps."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import random
from dataclasses import dataclass
from typing import Any, Callable

from async_rl.step.agent import demonstration_ids
from async_rl.buffers.trajectory import Trajectory, collate
from async_rl.step.eval_metrics import answer_key, at_k_metrics
from async_rl.step.rollout import rollout

EVAL_FIRST_GROUP_ID = -(10**9)
"""Evaluation groups are numbered from here, far from any training group id."""


@dataclass(frozen=True)
class EvalAtK:
    """Evaluation at k: ``samples`` responses per held-out prompt, sampled with ``params``
    (``trainer.eval_samples``, ``trainer.eval_temperature``; metrics in ``async_rl.step.eval_metrics``)."""

    samples: int
    params: Any  # SamplingParams

    @classmethod
    def from_config(cls, trainer_cfg, params) -> "EvalAtK | None":
        """The plan of a run's ``trainer`` config from its rollouts' ``SamplingParams``; ``None``
        when ``trainer.eval_samples`` is 0."""
        if not trainer_cfg.eval_samples:
            return None
        temperature = trainer_cfg.eval_temperature if trainer_cfg.eval_temperature is not None else params.temperature
        return cls(trainer_cfg.eval_samples, dataclasses.replace(params, greedy=False, temperature=temperature))


def correctness(t: Trajectory) -> float:
    """A trajectory's correctness in [0, 1]: the reward's ``acc`` field where present, else
    ``reward >= 1``."""
    return float(min(1.0, max(0.0, t.reward_extras.get("acc", float(t.reward >= 1.0)))))


def accuracy_of(trajectories: list[Trajectory]) -> float:
    """Fraction correct: the reward's ``acc`` field where present, else ``reward >= 1``; NaN for none."""
    if not trajectories:
        return float("nan")
    hits = [t.reward_extras.get("acc", float(t.reward >= 1.0)) for t in trajectories]
    return sum(hits) / len(hits)


def at_k_of(trajectories: list[Trajectory], dataset, n: int, seed: int = 0) -> dict[str, float]:
    """``at_k_metrics`` of the ``n``-sample trajectories of ``dataset``'s prompts, overall
    (``eval/pass@k`` ...) and, with several data sources, per source (``eval/<source>/pass@k`` ...).
    A prompt whose samples were all rejected counts as all wrong."""
    by_prompt: dict[str, list[Trajectory]] = {p.uid: [] for p in dataset}
    for t in trajectories:
        by_prompt[t.prompt_uid].append(t)
    sources = {p.uid: p.data_source for p in dataset}

    def rows(uids) -> list:
        return [([answer_key(t.response_text) for t in by_prompt[u]], [correctness(t) for t in by_prompt[u]])
                for u in uids]

    out = at_k_metrics(rows(list(by_prompt)), n, "eval/", seed=seed)
    if len(set(sources.values())) > 1:
        for source in sorted(set(sources.values())):
            out.update(at_k_metrics(rows([u for u in by_prompt if sources[u] == source]), n, f"eval/{source}/", seed=seed))
    return out


def evaluate(generator, dataset, params, scorer, tokenizer, agent=None, at_k: EvalAtK | None = None) -> dict[str, float]:
    """Held-out accuracy and mean reward of one response per prompt (greedy or sampled), and with
    ``at_k`` pass@k, mean@k and maj@k of ``at_k.samples`` sampled responses per prompt.

    With an agent, one multi-turn conversation per prompt, whose tool use is reported as
    ``eval/tool_calls_mean``, ``eval/turns_mean``, ``eval/tool_errors_mean`` (per conversation)
    and kept out of the training steps' ``tools/*`` counters.

    Returns:
        ``eval/accuracy``, ``eval/reward_mean``, ``eval/response_length_mean`` (tokens),
        ``eval/num_prompts``; with prompts of several data sources also ``eval/<source>/accuracy``,
        ``eval/<source>/reward_mean`` and ``eval/<source>/num_prompts`` per source;
        ``eval/policy_version``: the version of the weights the engine held (the policy measured);
        with ``at_k`` the keys of ``at_k_of`` (``eval/pass@1``, ``eval/pass@1_se``, ...,
        ``eval/mean@k``, ``eval/maj@k``).
    """
    version = int(getattr(generator, "policy_version", 0))
    with (agent.counted_apart() if agent is not None else contextlib.nullcontext()):
        result = rollout(generator, list(dataset), 1, params, scorer, tokenizer, EVAL_FIRST_GROUP_ID, agent=agent)
        sampled = (rollout(generator, list(dataset), at_k.samples, at_k.params, scorer, tokenizer,
                           EVAL_FIRST_GROUP_ID + len(dataset), agent=agent) if at_k is not None else None)
    return eval_metrics(result.trajectories, dataset, version,
                        (sampled.trajectories, at_k.samples) if sampled is not None else None)


def eval_metrics(trajs: list[Trajectory], dataset, version: float,
                 sampled: tuple[list[Trajectory], int] | None = None) -> dict[str, float]:
    """``evaluate``'s metrics of an evaluation's trajectories, wherever they were sampled (the
    colocated engine, or the async pool: ``async_rl.loops.evaluation``).

    A prompt whose sample was rejected (a reward that failed under ``reward.on_error=reject``, an
    environment's episode rejected for a fault) counts as wrong in ``eval/accuracy``, as in
    pass@k: a failure never raises a score, and an evaluation whose every sample was rejected
    scores 0, not NaN. ``eval/rejected`` counts them; ``eval/num_prompts``, ``reward_mean`` and
    ``response_length_mean`` are over the scored ones.

    Args:
        trajs: one trajectory per prompt (the greedy or single-sample pass); prompts whose sample
            was rejected are absent.
        dataset: the held-out prompts (``uid``, ``data_source``).
        version: the policy version measured (``eval/policy_version``).
        sampled: ``(trajectories, n)`` of evaluation at k, or ``None``.
    """
    n = max(1, len(trajs))
    asked = list(dataset)
    out = {
        "eval/accuracy": _accuracy_of_asked(trajs, len(asked)),
        "eval/reward_mean": sum(t.reward for t in trajs) / n,
        "eval/response_length_mean": sum(len(t.response_ids) for t in trajs) / n,
        "eval/num_prompts": float(len(trajs)),
        "eval/rejected": float(max(0, len(asked) - len(trajs))),
        "eval/policy_version": float(version),
    }
    if sampled is not None:
        out.update(at_k_of(sampled[0], dataset, sampled[1]))
    for key in ("agent/turns", "agent/tool_calls", "agent/tool_errors"):
        if any(key in t.reward_extras for t in trajs):  # an environment's episodes count no tool calls
            out[f"eval/{key.split('/')[1]}_mean"] = sum(t.reward_extras.get(key, 0.0) for t in trajs) / n
    sources = {p.uid: p.data_source for p in asked}
    if len(set(sources.values())) > 1:  # tasks or environments mixed: each one's held-out figures too
        by_source: dict[str, list[Trajectory]] = {source: [] for source in sources.values()}
        for t in trajs:
            by_source[sources[t.prompt_uid]].append(t)
        for source, group in sorted(by_source.items()):
            out[f"eval/{source}/accuracy"] = _accuracy_of_asked(group, sum(v == source for v in sources.values()))
            out[f"eval/{source}/reward_mean"] = sum(t.reward for t in group) / max(1, len(group))
            out[f"eval/{source}/num_prompts"] = float(len(group))
    return out


def _accuracy_of_asked(trajs: list[Trajectory], asked: int) -> float:
    """Fraction of the ``asked`` prompts answered correctly (a prompt without a trajectory, its
    sample rejected, is wrong); ``accuracy_of(trajs)`` when nothing was asked (a caller without
    the dataset's size)."""
    if asked <= 0:
        return accuracy_of(trajs)
    return sum(t.reward_extras.get("acc", float(t.reward >= 1.0)) for t in trajs) / max(asked, len(trajs))


def _reference(prompt) -> Any:
    # The dataset reads references when it loads (PromptDataset(reference_fields=...)), so a row
    # without one has already stopped the run; a dataset loaded without them is a caller's bug.
    if prompt.reference is None:
        raise ValueError(f"warm start: row {prompt.uid} has no reference response: load the train set with "
                         "PromptDataset(reference_fields=trainer.warm_start.reference_fields())")
    return prompt.reference


def _demonstration(value: Any, agent) -> list[dict] | None:
    """The demonstration (messages after the prompt) a reference holds, or ``None`` for the
    answer of one turn. With an environment (tool use included) a reference is a demonstration
    when it is a list of messages or JSON text of such a list, else the answer of a single turn
    (a task's reference answer, even one that reads as JSON)."""
    if agent is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return value
    return None


def warm_start(learner, dataset, tokenizer, cfg, eos_id: int, seed: int, log: Callable[[str], None],
               agent=None, on_step: Callable[[int, float], None] | None = None) -> None:
    """Supervised warm start: ``cfg.steps`` NLL steps on ``prompt -> reference response + EOS``.

    The reference of each prompt is ``Prompt.reference``, read from its row's
    ``cfg.response_field`` (``WarmStartConfig.reference_fields``) when the dataset was loaded.
    With an environment (``EpisodeLoop``, tool use included) the field may hold a demonstration
    instead: the messages after the prompt (assistant turns and tool calls, observations as user
    or tool messages, the final answer) as a list or its JSON text; it is tokenised turn by turn
    as a rollout would be (``agent.demonstration_ids``), and only the assistant turns are
    trained. Any other reference is the answer of one turn. Prompts are drawn with their own
    seeded RNG so the RL data stream is not advanced.

    Args:
        learner: the ``Learner`` (its ``sft_step``).
        dataset: the train ``PromptDataset``, loaded with ``reference_fields=cfg.reference_fields()``.
        cfg: ``WarmStartConfig``.
        eos_id: appended to single-turn references.
        seed: the run seed.
        log: prints a progress line (five in all, and the last step's).
        agent: the run's ``EpisodeLoop`` (environment or tool-use runs), or ``None``.
        on_step: called after every step with ``(step, loss)``: the 1-based step and its mean NLL
            per trained token (nats), e.g. to move a progress bar; ``None`` = not called.

    Raises:
        ValueError: a prompt without a reference (the dataset was loaded without
            ``reference_fields``), or a demonstration the chat template cannot render.
    """
    rng = random.Random(seed + 17)
    for step in range(1, cfg.steps + 1):
        trajs = []
        chosen = rng.choices(dataset.prompts, k=cfg.batch_size)
        for k, p in enumerate(chosen):
            demo = _demonstration(_reference(p), agent)
            if demo is not None:
                ids, mask = demonstration_ids(tokenizer, p.messages, demo, agent.schemas, agent.stop_token_ids)
            else:
                ids = tokenizer(str(_reference(p)), add_special_tokens=False)["input_ids"] + [eos_id]
                mask = [1] * len(ids)
            trajs.append(Trajectory(
                trajectory_id=f"sft/{step}/{k}", group_id=k, prompt_uid=p.uid, prompt_ids=p.prompt_ids,
                response_ids=ids, behavior_logprobs=[0.0] * len(ids), loss_mask=mask,
                finish_reason="stop", policy_version=[0] * len(ids)))
        images = [getattr(p, "images", None) for p in chosen]
        metrics = learner.sft_step(collate(trajs, tokenizer.pad_token_id,
                                           images=images if any(x is not None for x in images) else None), cfg.lr)
        if on_step is not None:
            on_step(step, float(metrics["sft/loss"]))
        if step % max(1, cfg.steps // 5) == 0 or step == cfg.steps:
            log(f"warm start {step}/{cfg.steps}: loss {float(metrics['sft/loss']):.4f}")
