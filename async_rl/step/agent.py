"""Multi-turn tool-call rollouts: generate, parse tool calls, run the tools, append, continue.

One conversation per sample. Each turn the engine continues the conversation's token ids; the
assistant turn ends at the chat template's end-of-turn token (a stop token). The turn's text is
parsed for tool calls in the template's format (``agent.parser``: Hermes/Qwen
``<tool_call>{...}</tool_call>`` by default); when there are any, the tools run
(``async_rl.tools``) and their responses are appended as tokens, and the engine continues. The
conversation ends at a turn without tool calls (the answer), at ``agent.max_turns`` assistant
turns, or when the response reaches ``agent.max_response_tokens``: each turn may generate up to
the conversation's own remaining budget (and the engine's per-turn ``max_tokens``), and a tool
turn that exactly fills the budget is appended before the conversation ends with ``length``
(one that would exceed it is not).

Token-in, token-out. Generated ids are kept exactly as sampled: the text is decoded only to find
tool calls and is never re-encoded. Only the appended tool turn is tokenised, as the difference
between two renders of the chat template (``tool_turn_ids``): the conversation up to the
assistant turn, cut right after that turn's end-of-turn token, and the conversation with the
tool messages and the next generation prompt. The appended ids therefore hold exactly the
template's glue (the newline after the end-of-turn token, the tool role header, the tool
response, the next assistant header), so the whole sequence equals the template's rendering of
the whole conversation when the model wrote what the template would have, and no BOS is
repeated.

A turn is decoded for parsing with special tokens kept (only its end-of-turn token is left out):
tokenizers often make the tool-call tags special tokens, and arguments may hold special-token
text, so the calls are read from exactly what was generated. The answer (``final_text``, what the
reward scores) is the text outside the calls without any special token or tool-call tag.

Per response token the rollout keeps: the id, the behavior log-prob (0 on tool tokens), the loss
mask (1 on generated tokens, 0 on tool output and template glue) and the policy version (tool
tokens carry the version of the turn before them); the three lists have the same length after
every turn (checked).

Faults become observations: malformed or truncated tool-call JSON, non-object arguments, an
unknown tool, bad arguments, a tool that raises or runs past its timeout each return an error
message to the model as the tool's response, and are counted (``tools/*`` metrics).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from async_rl.generators.base import mix_seed
from async_rl.tools import ToolExecutor, ToolRegistry, ToolResult, get_parser

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
    """Most assistant turns per conversation (>= 1); a tool call in the last one is not run."""
    max_response_tokens: int = 512
    """Most response tokens per conversation, generated and tool tokens together (>= 1); a
    conversation that reaches it ends with finish reason ``length`` (a tool turn that would go
    past it is left out)."""
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
            # An environment's observations are user messages, a tool loop's tool messages:
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


class AgentLoop:
    """Runs multi-turn tool-call conversations on any generator backend.

    Args:
        cfg: ``agent`` settings.
        tokenizer: the policy's tokenizer (chat template with tool support).
        stop_token_ids: ids that end an assistant turn (EOS / end-of-turn).
        registry: the tools (``async_rl.tools.ToolRegistry``); built from ``cfg.tools`` if ``None``.

    Raises:
        ValueError: an unknown parser or tool spec.
    """

    def __init__(self, cfg: AgentConfig, tokenizer, stop_token_ids: Sequence[int], registry=None) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.registry = registry if registry is not None else ToolRegistry.from_specs(cfg.tools)
        self.schemas = self.registry.schemas()
        self.parser = get_parser(cfg.parser)
        self.executor = ToolExecutor(self.registry)
        self._too_many = self._too_many_popped = 0
        special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
        # Longest first, so a special token that contains another is removed whole.
        self._not_answer = sorted({*special, *tokenizer.all_special_tokens, *self.parser.tags} - {""},
                                  key=len, reverse=True)

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The rendered prompt with the tools' schemas and a generation prompt."""
        return render_ids(self.tokenizer, messages, self.schemas, add_generation_prompt=True)

    def run_groups(self, generator, requests: Sequence[Any], n: int, params, seeds: Sequence[int] | None,
                   on_sample: Callable[[int, int, Conversation], None] | None = None) -> list[list[Conversation]]:
        """``run`` over ``GroupRequest``s (their ``prompt_ids`` and ``messages``), as
        ``EpisodeLoop.run_groups``: the one call a rollout makes of either loop."""
        return self.run(generator, [(r.prompt_ids, r.messages) for r in requests], n, params, seeds, on_sample)

    def run(self, generator, prompts: Sequence[tuple[list[int], list[dict]]], n: int, params,
            seeds: Sequence[int] | None, on_sample: Callable[[int, int, Conversation], None] | None = None,
            ) -> list[list[Conversation]]:
        """``n`` conversations per prompt, advanced turn by turn in one engine batch.

        Args:
            generator: a ``Generator`` (HF, vLLM, ...).
            prompts: ``(prompt_ids, messages)`` per prompt; ``prompt_ids`` must be the rendering of
                ``messages`` with the tool schemas (``prompt_ids``).
            n: conversations per prompt (the group size).
            params: ``SamplingParams`` of one assistant turn (``max_tokens`` per turn; a turn
                also stops at its conversation's remaining ``agent.max_response_tokens``).
            seeds: one per prompt; conversation j's turn k is sampled with
                ``mix_seed(seeds[i], j, k)``, independent of the batch. ``None``: unseeded.
            on_sample: called as ``on_sample(i, j, conversation)`` when a conversation ends.

        Returns:
            One list of ``n`` finished ``Conversation`` per prompt.
        """
        convs = [[Conversation(list(ids), [dict(m) for m in msgs], mix_seed(seeds[i], j) if seeds is not None else -1)
                  for j in range(n)] for i, (ids, msgs) in enumerate(prompts)]
        flat = [(i, j, c) for i, row in enumerate(convs) for j, c in enumerate(row)]
        for turn in range(self.cfg.max_turns):
            active = [(i, j, c) for i, j, c in flat if c.finish_reason is None]
            if not active:
                break
            # Each conversation generates up to its own remaining budget (>= 1: one with none left
            # has ended with "length"). The batch runs to the largest and each sample is cut to its
            # own; per-sample seeds make the cut sample the one a smaller max_tokens would give, so
            # no conversation's turn depends on the others in its batch.
            budgets = [min(params.max_tokens, self.cfg.max_response_tokens - len(c.response_ids))
                       for _, _, c in active]
            turn_params = dataclasses.replace(params, max_tokens=max(budgets))
            turn_seeds = [mix_seed(c.seed, turn) for _, _, c in active] if seeds is not None else None
            samples = generator.generate([c.prompt_ids + c.response_ids for _, _, c in active], 1, turn_params,
                                         seeds=turn_seeds)
            for (i, j, c), budget, (sample,) in zip(active, budgets, samples):
                self._after_turn(c, sample, budget, last_turn=turn == self.cfg.max_turns - 1)
                if c.finish_reason is not None and on_sample is not None:
                    on_sample(i, j, c)
        for i, j, c in flat:
            if c.finish_reason is None:  # cannot happen: the last turn always finishes
                c.finish_reason = "length"
        return convs

    def _after_turn(self, c: Conversation, sample, budget: int, last_turn: bool) -> None:
        c.num_turns += 1
        ids = list(sample.response_ids)[:budget]
        c.append(ids, list(sample.logprobs)[:budget], 1, list(sample.policy_version)[:budget] or [0] * len(ids))
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        content, calls = self.parser.parse(self._turn_text(ids[:-1] if ended else ids))
        content = self._answer(content)
        if not ended:
            # Cut by the token budget mid-turn: a half-written call is not run.
            c.finish_reason, c.final_text = "length", content
            return
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {
                "name": call.name or "", "arguments": call.arguments if call.arguments is not None else {}}}
                for call in calls]
        c.messages.append(message)
        if not calls:
            c.finish_reason, c.final_text = "stop", content
            return
        if last_turn:
            c.finish_reason, c.final_text = "max_turns", content
            return
        limit = self.cfg.max_tool_calls_per_turn
        results = self.executor.execute(list(calls[:limit]))
        if len(calls) > limit:
            self._too_many += len(calls) - limit
            results += [ToolResult(name=call.name, ok=False, error_kind="too_many_calls",
                                   content=f"Error: at most {limit} tool calls per turn; this one was not run")
                        for call in calls[limit:]]
        c.num_tool_calls += len(results)
        c.num_tool_errors += sum(not r.ok for r in results)
        tool_messages = [{"role": "tool", "name": r.name or "", "content": self._cap(r.content)} for r in results]
        ids = tool_turn_ids(self.tokenizer, c.messages, tool_messages, self.schemas, self.stop_token_ids)
        room = self.cfg.max_response_tokens - len(c.response_ids)
        if len(ids) > room:
            c.finish_reason, c.final_text = "length", content
            return
        c.messages.extend(tool_messages)
        version = c.policy_version[-1] if c.policy_version else 0
        c.append(ids, [0.0] * len(ids), 0, [version] * len(ids))
        if len(ids) == room:  # nothing left to generate the next turn with
            c.finish_reason, c.final_text = "length", content

    def _turn_text(self, ids: list[int]) -> str:
        """The text of generated ids (end-of-turn token already left out), special tokens kept:
        the parser must see the tags even where the tokenizer makes them special tokens."""
        return self.tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)

    def _answer(self, content: str) -> str:
        """The answer text of a turn's content, as the reward should see it: without special tokens
        (as a decode with ``skip_special_tokens=True`` gives) and without the parser's tags, whether
        or not the tokenizer makes them special tokens."""
        for token in self._not_answer:
            content = content.replace(token, "")
        return content.strip()

    def _cap(self, text: str) -> str:
        return cap_tokens(self.tokenizer, text, self.cfg.max_tool_response_tokens)

    def pop_metrics(self) -> dict[str, float]:
        """Tool-execution counters since the last call (``tools/calls``, ``tools/error_*``, ...)."""
        out = {k: float(v) for k, v in self.executor.pop_counts().items()}
        if self._too_many > self._too_many_popped:
            out["tools/error_too_many_calls"] = float(self._too_many - self._too_many_popped)
            self._too_many_popped = self._too_many
        return out

    @contextlib.contextmanager
    def counted_apart(self):
        """A block whose tool executions stay out of ``pop_metrics`` (evaluation between two
        training steps must not show up in the next step's ``tools/*``). Yields a dict that
        holds the block's own counters on exit."""
        saved = self.pop_metrics()
        own: dict[str, float] = {}
        try:
            yield own
        finally:
            own.update(self.pop_metrics())
            too_many = int(saved.pop("tools/error_too_many_calls", 0))
            self._too_many_popped -= too_many
            self.executor.restore_counts({k: int(v) for k, v in saved.items()})

    def counts(self) -> dict[str, float]:
        """Tool-execution counters since the start (cumulative; a pool reports deltas of these)."""
        out = {k: float(v) for k, v in self.executor.counts().items()}
        if self._too_many:
            out["tools/error_too_many_calls"] = float(self._too_many)
        return out
