"""Multi-turn rollouts' token bookkeeping, and the ``agent.*`` settings of tool use.

Tool use runs as an environment of the episode protocol (``async_rl.envs.tools``, driven by
``async_rl.step.episodes.EpisodeLoop``): ``agent.tools`` is its spelling
(``rollout_env_config``). This module holds what every multi-turn rollout shares:

Token-in, token-out. Generated ids are kept exactly as sampled: the text is decoded only to find
tool calls (or to give an environment its action) and is never re-encoded. Only an appended
observation (tool responses, an environment's feedback) is tokenised, as the difference between
two renders of the chat template (``tool_turn_ids``): the conversation up to the assistant turn,
cut right after that turn's end-of-turn token, and the conversation with the observation messages
and the next generation prompt. The appended ids therefore hold exactly the template's glue (the
newline after the end-of-turn token, the tool role header, the tool response, the next assistant
header), so the whole sequence equals the template's rendering of the whole conversation when
the model wrote what the template would have, and no BOS is repeated.

Per response token a ``Conversation`` keeps: the id, the behavior log-prob (0 on observation
tokens), the loss mask (1 on generated tokens, 0 on observations and template glue) and the
policy version (observation tokens carry the version of the turn before them); the lists have the
same length after every turn (checked); an ``Episode`` adds what the episode returned. A demonstration (``demonstration_ids``) is tokenised the
same way for the warm start; ``cap_tokens`` cuts an observation to a token budget.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

logger = logging.getLogger(__name__)


@dataclass
class AgentConfig:
    """Multi-turn tool use in rollouts (``agent.*``); off while ``tools`` is empty."""

    tools: list[str] = field(default_factory=list)
    """Tools offered to the model: built-in names (``calculator``, ``python``) or import paths
    (``my_pkg.tools:search``, ``path/to/file.py:my_tool``) of a ``Tool``, a function or a list of
    tools. Their schemas are passed to the chat template (``tools=``)."""
    parser: str = "hermes"
    """Tool-call format of the model's chat template (``async_rl.tools.parsers.PARSERS``)."""
    max_turns: int = 4
    """Most assistant turns per conversation (>= 1); a tool call in the last one still runs (as
    any environment's last step does: ``tools/*`` count it), its output is not shown."""
    max_response_tokens: int = 512
    """Most response tokens per conversation, generated and tool tokens together (>= 1); a
    conversation that reaches it ends with finish reason ``length`` (a tool turn that would leave
    no room for a next turn is left out)."""
    max_tool_response_tokens: int = 128
    """A tool output longer than this many tokens is cut to at most this many (whole characters,
    its text before rendering) and marked `` ...[truncated]``, so one tool output cannot fill the
    context (>= 1); one of exactly this many is kept whole."""
    max_tool_calls_per_turn: int = 4
    """Calls run per assistant turn (>= 1); each further call is answered with an error
    observation (``tools/error_too_many_calls``) instead of running."""

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_response_tokens", "max_tool_response_tokens", "max_tool_calls_per_turn"):
            if getattr(self, key) < 1:
                raise ValueError(f"agent.{key} must be >= 1, got {getattr(self, key)}")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn (some tool is configured)."""
        return bool(self.tools)


def render_ids(tokenizer, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template's rendering of ``messages`` (with ``tools`` schemas).

    Rendered as text, then tokenised without special tokens (as ``apply_chat_template`` does)
    and without the tokenizer's "longer than the model's maximum" warning: a conversation may
    render longer than the context for a moment (a degenerate turn's many error responses) and
    is then ended by ``agent.max_response_tokens``, never fed to the model whole.
    """
    text = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)
    return list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])


def tool_turn_ids(tokenizer, messages: list[dict], tool_messages: list[dict], tools: list[dict] | None,
                  end_of_turn_ids: Sequence[int]) -> list[int]:
    """Ids to append after a generated assistant turn: the template's glue, the tool responses and
    the next assistant generation prompt.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the conversation up to and including the assistant message with its
            ``tool_calls`` (the parsed form of the generated turn).
        tool_messages: ``{"role": "tool", "name": ..., "content": ...}`` messages, one per call.
        tools: tool schemas passed to the template, as for the prompt.
        end_of_turn_ids: ids that end an assistant turn (the stop tokens).

    Returns:
        The ids that follow the assistant turn's end-of-turn token in the rendering of
        ``messages + tool_messages`` with a generation prompt.

    Raises:
        ValueError: the template renders an earlier part of the conversation differently once
            more messages follow (not prefix-stable), or puts no end-of-turn token after the
            assistant turn; incremental tokenisation would then not equal the full rendering.
    """
    before = render_ids(tokenizer, messages, tools, add_generation_prompt=False)
    stops = set(end_of_turn_ids)
    cut = max((i for i, t in enumerate(before) if t in stops), default=-1) + 1
    if cut == 0:
        raise ValueError("the chat template puts no end-of-turn token (stop token) after an assistant turn")
    after = render_ids(tokenizer, messages + tool_messages, tools, add_generation_prompt=True)
    if after[:cut] != before[:cut]:
        raise ValueError("the chat template is not prefix-stable: adding tool messages changes how the earlier "
                         "conversation renders, so appended tool turns cannot be tokenised incrementally")
    return after[cut:]


def demonstration_ids(tokenizer, prompt_messages: list[dict], demonstration: list[dict], tools: list[dict] | None,
                      end_of_turn_ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Response ids and loss mask of a whole demonstrated conversation, built turn by turn as a
    rollout would build it (supervised warm start of tool use).

    Assistant turns are the template's rendering of each assistant message up to and including
    its end-of-turn token (loss mask 1); tool turns are ``tool_turn_ids`` (loss mask 0).

    Args:
        tokenizer: tokenizer with a tool-aware chat template.
        prompt_messages: the prompt's messages (rendered with a generation prompt before this).
        demonstration: the messages after the prompt: assistant (with ``tool_calls``), tool, ...,
            ending with the final assistant message (an environment's observations are user
            messages).
        tools: tool schemas passed to the template.
        end_of_turn_ids: ids that end an assistant turn.

    Returns:
        ``(response_ids, loss_mask)``, equal length; prompt ids + response ids equal the
        template's rendering of the whole conversation up to the last end-of-turn token.

    Raises:
        ValueError: a demonstration that does not end with an assistant message, a message
            role other than assistant/tool/user, or a template that is not prefix-stable.
    """
    if not demonstration or demonstration[-1].get("role") != "assistant":
        raise ValueError("a demonstration must end with an assistant message")
    stops = set(end_of_turn_ids)
    messages = [dict(m) for m in prompt_messages]
    context = render_ids(tokenizer, messages, tools, add_generation_prompt=True)
    ids: list[int] = []
    mask: list[int] = []
    k = 0
    while k < len(demonstration):
        message = demonstration[k]
        if message.get("role") == "assistant":
            full = render_ids(tokenizer, messages + [message], tools, add_generation_prompt=False)
            end = max((i for i, t in enumerate(full) if t in stops), default=-1) + 1
            if full[: len(context)] != context or end <= len(context):
                raise ValueError("the chat template is not prefix-stable for assistant turns")
            turn = full[len(context) : end]
            messages.append(message)
            k += 1
            mask_value = 1
        elif message.get("role") in ("tool", "user"):
            # An environment's observations are user messages, a tool environment's tool messages:
            # either is appended as the template renders it, untrained.
            tool_messages = []
            while k < len(demonstration) and demonstration[k].get("role") in ("tool", "user"):
                tool_messages.append(demonstration[k])
                k += 1
            turn = tool_turn_ids(tokenizer, messages, tool_messages, tools, end_of_turn_ids)
            messages.extend(tool_messages)
            mask_value = 0
        else:
            raise ValueError(f"demonstration message {k} has role {message.get('role')!r}; expected assistant, tool "
                             "or user")
        ids += turn
        mask += [mask_value] * len(turn)
        context = context + turn
    return ids, mask


def cap_tokens(tokenizer, text: str, limit: int) -> str:
    """``text`` whole if it has at most ``limit`` tokens, else cut to at most that many tokens at a
    character boundary plus `` ...[truncated]`` (a tool's output, an environment's observation),
    so one observation cannot fill the context."""
    # Tokenise only a prefix, so a huge output is never tokenised whole: common vocabularies'
    # tokens cover far fewer than 16 characters. A prefix that still fits is widened (tokens
    # longer than that, e.g. runs of spaces), never returned as if whole.
    window = 16 * limit + 16
    while True:
        ids = tokenizer(text[:window], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) > limit:
            break
        if window >= len(text):
            return text
        window *= 4
    # A cut inside a multi-byte character decodes to U+FFFD: step back to the last whole one (at
    # most 3 tokens for UTF-8 bytes). A tokenizer whose decoding is not a prefix of the text
    # (normalisation) keeps the plain cut.
    head = tokenizer.decode(ids[:limit])
    for keep in range(limit, max(limit - 4, -1), -1):
        candidate = tokenizer.decode(ids[:keep])
        if text.startswith(candidate):
            head = candidate
            break
    return head + " ...[truncated]"


@dataclass
class Conversation:
    """One sample's multi-turn rollout state (response side: everything after the prompt).

    ``response_ids``, ``logprobs``, ``loss_mask`` and ``policy_version`` are per response token
    and always the same length. ``final_text`` is the last assistant turn's text outside its tool
    calls, without special tokens or tool-call tags: the answer the reward scores.
    """

    prompt_ids: list[int]
    messages: list[dict]
    seed: int
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    policy_version: list[int] = field(default_factory=list)
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    finish_reason: str | None = None
    final_text: str = ""
    routed_experts: Any = None
    """The engine's routing of a one-turn rollout (``Sample.routed_experts``, cut to the tokens
    kept: ``[P + R - 1, layers, k]`` int16), for routing replay; ``None`` otherwise."""

    def append(self, ids: list[int], logprobs: list[float], mask: int, versions: list[int]) -> None:
        """Extend the response; the four per-token lists stay aligned (checked)."""
        self.response_ids += ids
        self.logprobs += logprobs
        self.loss_mask += [mask] * len(ids)
        self.policy_version += versions
        if not len(self.response_ids) == len(self.logprobs) == len(self.loss_mask) == len(self.policy_version):
            raise AssertionError("per-token lists out of step: ids/logprobs/mask/versions "
                                 f"{len(self.response_ids)}/{len(self.logprobs)}/{len(self.loss_mask)}/"
                                 f"{len(self.policy_version)}")


@dataclass
class Episode(Conversation):
    """One sample's episode: a ``Conversation`` (per-token ids, log-probs, loss mask, versions)
    plus what the environment returned (``async_rl.step.episodes``), or what a rollout
    function returned (``async_rl.endpoint``: its session's trained chain, its reward).

    Attributes:
        env_return: the sum of ``turn_rewards``; the sample's reward.
        turn_rewards: one reward per ``step`` answered.
        info: the steps' ``info`` numbers, summed.
        rejected: why the episode was rejected (one of ``REJECT_REASONS``), or ``None``.
        env: the episode's ``Environment`` until it ends (``None`` after).
        lost: the ``EnvironmentLost`` that ended it, if its server went away.
        restarted: this is the episode's second start (its first one's server was lost).
        reward_from_run: the run's reward scores the episode's answer (``final_text``), its
            environment having no reward of its own (``Environment.reward_from_run``).
    """

    env_return: float = 0.0
    turn_rewards: list[float] = field(default_factory=list)
    info: dict[str, float] = field(default_factory=dict)
    rejected: str | None = None
    env: Any = None
    lost: BaseException | None = None
    restarted: bool = False
    reward_from_run: bool = False
    action: str = ""
    """The last assistant turn as its ``step`` receives it."""
    handed_on: bool = False
    """The episode went to ``on_sample`` (exactly once)."""
    multi_turn: bool = True
    """Its environment allows more than one turn (``env.max_turns > 1``); a single-turn episode
    (a plain prompt dataset's ``single_turn``) reports no turn counts."""
    images: Any = None
    """A vision-language episode's images so far (``async_rl.data.images.ImageInputs``): its
    prompt's, then those its observations added, in the order of their placeholders in
    ``prompt_ids + response_ids``; what every turn is generated with. ``None``: none."""
    observation_images: list[Any] = field(default_factory=list)
    """The ``ImageInputs`` of each observation that held images, in order: what the trajectory
    carries to the learner (the prompt's own images the trainer holds)."""


class EpisodeCounters:
    """The counters of a loop that runs episodes (``EpisodeLoop``, ``async_rl.endpoint.EndpointLoop``):
    ``_counts`` holds them since the start; ``pop_metrics`` gives what moved since its last call,
    and a ``counted_apart`` block (evaluation between two training steps) stays out of it.

    Thread-safe: counts move through ``_count`` under a lock and every read copies under it. A
    generator actor reads them on its control thread (``get_stats``) while its rollout thread and
    the environments' event loop add to them: iterating the dict while another thread adds a key
    raises ``RuntimeError: dictionary changed size during iteration``, and two unlocked ``+=``
    on one key may lose one."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._popped: Counter[str] = Counter()
        self._counts_lock = threading.Lock()

    def _count(self, key: str, n: int = 1) -> int:
        """Add ``n`` to counter ``key``; returns its new value."""
        with self._counts_lock:
            self._counts[key] += n
            return self._counts[key]

    def _snapshot(self) -> Counter[str]:
        with self._counts_lock:
            return Counter(self._counts)

    def pop_metrics(self) -> dict[str, float]:
        """Counters since the last call, those that moved."""
        now = self._snapshot()
        out = {k: float(v - self._popped[k]) for k, v in now.items() if v > self._popped[k]}
        self._popped = now
        return out

    @contextlib.contextmanager
    def counted_apart(self):
        """A block whose episodes stay out of ``pop_metrics``; yields a dict that holds the block's
        own counters on exit (the caller runs no other episodes meanwhile)."""
        before = self._snapshot()
        own: dict[str, float] = {}
        try:
            yield own
        finally:
            now = self._snapshot()
            own.update({k: float(v - before[k]) for k, v in now.items() if v > before[k]})
            self._popped.update({k: v - before[k] for k, v in now.items() if v > before[k]})

    def counts(self) -> dict[str, float]:
        """Counters since the start (cumulative; a generator pool reports deltas of these)."""
        return {k: float(v) for k, v in self._snapshot().items() if v}
