"""Exact capture: a rollout session's calls, kept token-in token-out, and the trajectory they make.

Every call of a session is recorded as the engine saw and sampled it: the prompt ids it was given,
the ids it sampled, their behavior log-probs and policy versions. A finished choice is a ``Node``:
the whole token sequence from the session's first prompt through that choice's last sampled id,
with a loss mask (1 on sampled ids, 0 on everything else) and per-token log-probs and versions.

**The prefix rule.** A call continues an earlier node when what it sends extends that node
exactly:

- a chat call, when its messages start with the node's messages (the earlier call's messages
  plus the assistant message the endpoint returned, compared in normalized form:
  ``protocol.normalize_messages``) and it offers the same tools. Only the new messages are
  tokenized, as the difference between two renders of the chat template (the glue after the
  assistant's end-of-turn token, the new messages, the next generation prompt); the earlier
  tokens are the ones sampled, never re-tokenized. A turn that ended without an end-of-turn
  token (``length``, a ``stop`` string) gets the template's end-of-turn token first, masked.
- a completions call, when its prompt ids (the ids sent, or the text tokenized) start with the
  node's ids.

The call's prompt is then the node's ids plus the new ids (masked), and its choices become new
nodes that extend it. A call that continues no node (the session's first call, or a history the
agent rewrote, or a template that re-tokenizes an earlier turn differently) starts a new chain
from its own rendering; after the session's first call this is counted
(``endpoint/rewritten_calls``).

**The trajectory a session trains** is the chain that ends at its last call's first choice: the
call that produced the session's final answer and everything it extends. Calls off that chain
(an abandoned branch, a rewritten history's earlier chain, the other choices of an ``n > 1`` call)
are counted (``endpoint/untrained_calls``) and not trained: their tokens are real samples, but the
reward the rollout function returns is the outcome of the final chain.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

from async_rl.step.agent import render_ids

from .protocol import ProtocolError, template_messages

__all__ = ["Node", "Plan", "Session", "chat_plan_tokens"]


@dataclass(frozen=True)
class Node:
    """One finished choice and the chain of calls it ends.

    Attributes:
        ids: every token id from the chain's first prompt through this choice's last sampled id.
        prompt_len: how many of ``ids`` are the first call's prompt (the trajectory's prompt).
        logprobs: per response-side id (``ids[prompt_len:]``): behavior log-prob (nats) of a
            sampled id, 0.0 elsewhere.
        mask: per response-side id: 1 on sampled ids, 0 on glue and messages the caller sent.
        versions: per response-side id: the policy version that sampled it (glue: the version of
            the turn before it).
        messages: chat: the conversation through this choice's assistant message (normalized);
            ``None`` for a completions call.
        tools_key: the tools offered, as a canonical string (chat).
        ended_turn: the choice ended with a stop token (its turn is closed in the token stream).
        calls: the calls on this chain (this one included).
        index: the order in which the session made it (0-based).
        text: the choice's text (its content outside tool calls for chat).
    """

    ids: tuple[int, ...]
    prompt_len: int
    logprobs: tuple[float, ...]
    mask: tuple[int, ...]
    versions: tuple[int, ...]
    messages: tuple[Any, ...] | None
    tools_key: str | None
    ended_turn: bool
    calls: int
    index: int
    text: str
    chain: tuple[int, ...] = ()
    """The ``index`` of every node this one extends, oldest first, then its own."""


@dataclass
class Plan:
    """What one call sends to the engine, and what it extends.

    Attributes:
        prompt_ids: the engine's prompt.
        base: the node the call continues, or ``None`` (a new chain).
        glue: how many ids after ``base.ids`` the call added (masked).
        max_tokens: most tokens each choice may sample (the request's, within the session's budget).
        refused: ``max_turns`` or ``length`` when the call is answered without sampling (the
            session's turn or token budget is spent), else ``None``.
        messages: chat: the call's messages (normalized), for its nodes.
        tools_key: chat: the tools offered.
    """

    prompt_ids: list[int]
    base: Node | None
    glue: int
    max_tokens: int
    refused: str | None = None
    messages: list[dict[str, Any]] | None = None
    tools_key: str | None = None


def chat_plan_tokens(tokenizer, base: Node, messages: list[dict[str, Any]], tools: list[dict] | None,
                     stop_token_ids: Sequence[int]) -> list[int] | None:
    """The ids that extend ``base`` to the prompt of a chat call with ``messages`` (which start
    with ``base.messages``), or ``None`` when the template cannot extend it exactly (no
    end-of-turn token after the assistant turn, or an earlier part renders differently once the
    new messages follow)."""
    before = render_ids(tokenizer, template_messages(list(base.messages)), tools, add_generation_prompt=False)
    stops = set(stop_token_ids)
    cut = max((i for i, t in enumerate(before) if t in stops), default=-1) + 1
    if cut == 0:
        return None
    after = render_ids(tokenizer, template_messages(messages), tools, add_generation_prompt=True)
    if after[:cut] != before[:cut]:
        return None
    glue = after[cut:]
    return glue if base.ended_turn else [before[cut - 1]] + glue


@dataclass
class Session:
    """One rollout episode's calls (one run of the rollout function).

    Args:
        sid: the session id (in the base URL: ``/s/<sid>/v1``).
        seed: the session's seed; call k without a ``seed`` of its own samples with
            ``mix_seed(seed, k)``, one with ``seed`` s with ``mix_seed(seed, s)`` (the same s gives
            the same sample within the session).
        max_turns: most calls that sample (>= 1); later calls are answered empty with finish
            reason ``length`` and the episode ends ``max_turns``.
        max_response_tokens: most response-side tokens of a chain (sampled and glue together);
            a call's ``max_tokens`` is cut to what is left, and a call with nothing left is
            answered empty (``length``).
        max_prompt_tokens: most tokens of a chain's first prompt (``data.max_prompt_tokens``).
    """

    sid: str
    seed: int
    max_turns: int
    max_response_tokens: int
    max_prompt_tokens: int
    nodes: list[Node] = field(default_factory=list)
    last: Node | None = None
    calls: int = 0
    issued: int = 0
    started: bool = False
    open_streams: int = 0
    """Streamed answers started and not yet delivered whole."""
    waiting: int = 0
    """Calls of the session waiting for the engine."""
    last_event: float = 0.0
    """``time.monotonic()`` when the session started or last got an answer (batching)."""
    refused: str | None = None
    fault: str | None = None
    closed: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, key: str, k: int = 1) -> None:
        """Add ``k`` to counter ``endpoint/<key>``."""
        self.counts[key] = self.counts.get(key, 0) + k

    def check_open(self) -> None:
        """Raises ``ProtocolError`` (409) once the session has ended."""
        if self.closed:
            raise ProtocolError(f"session {self.sid} has ended", status=409)

    def set_fault(self, reason: str) -> None:
        """Mark the session faulted (its episode is rejected with ``reason``); the first fault counts."""
        with self.lock:
            if self.fault is None:
                self.fault = reason

    # ------------------------------------------------------------------ planning a call
    def _budget(self, prompt_ids: list[int], base: Node | None, glue: int, requested: int) -> Plan:
        if base is None and len(prompt_ids) > self.max_prompt_tokens:
            self.set_fault("prompt_too_long")
            raise ProtocolError(f"the prompt has {len(prompt_ids)} tokens, more than data.max_prompt_tokens="
                                f"{self.max_prompt_tokens}", param="messages")
        prompt_len = base.prompt_len if base is not None else len(prompt_ids)
        room = self.max_response_tokens - (len(prompt_ids) - prompt_len)
        plan = Plan(prompt_ids, base, glue, max(0, min(requested, room)))
        if self.calls >= self.max_turns:
            plan.refused = "max_turns"
        elif room <= 0:
            plan.refused = "length"
        return plan

    def plan_chat(self, tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None, tools_key: str,
                  stop_token_ids: Sequence[int], requested: int) -> Plan:
        """The prompt of a chat call: the longest node it extends plus the new messages' ids, or
        a new chain. Raises ``ProtocolError`` for a first prompt over ``max_prompt_tokens``."""
        self.check_open()
        base, glue = None, None
        for node in sorted(self.nodes, key=lambda n: len(n.ids), reverse=True):
            if (node.messages is not None and node.tools_key == tools_key and len(messages) > len(node.messages)
                    and tuple(messages[: len(node.messages)]) == node.messages):
                glue = chat_plan_tokens(tokenizer, node, messages, tools, stop_token_ids)
                if glue is not None:
                    base = node
                    break
        if base is None:
            prompt = render_ids(tokenizer, template_messages(messages), tools, add_generation_prompt=True)
            glue = []
            if self.nodes:
                self.count("rewritten_calls")
        else:
            prompt = list(base.ids) + glue
        plan = self._budget(prompt, base, len(glue), requested)
        plan.messages, plan.tools_key = messages, tools_key
        return plan

    def plan_completion(self, prompt_ids: list[int], requested: int) -> Plan:
        """The prompt of a completions call: the longest node whose ids it starts with, or a new
        chain. Raises ``ProtocolError`` for a first prompt over ``max_prompt_tokens``."""
        self.check_open()
        base = None
        for node in sorted(self.nodes, key=lambda n: len(n.ids), reverse=True):
            if len(prompt_ids) > len(node.ids) and tuple(prompt_ids[: len(node.ids)]) == node.ids:
                base = node
                break
        if base is None and self.nodes:
            self.count("rewritten_calls")
        glue = len(prompt_ids) - len(base.ids) if base is not None else 0
        return self._budget(list(prompt_ids), base, glue, requested)

    # ------------------------------------------------------------------ recording
    def record(self, plan: Plan, choices: list[tuple[list[int], list[float], list[int], bool, str,
                                                      dict[str, Any] | None]]) -> list[Node]:
        """Record a call's choices as nodes, atomically: all of them, or none once the session
        has ended (``ProtocolError`` 409: its rollout function finished or timed out meanwhile).

        Args:
            plan: the call's plan.
            choices: per choice ``(ids, logprobs, versions, ended_turn, text, assistant_message)``:
                the sampled ids kept, their log-probs and versions, whether the last id is a
                stop token, its text, and (chat) its assistant message in normalized form.
        """
        with self.lock:
            self.check_open()
            self.calls += 1
            base = plan.base
            prefix_ids = list(base.ids) if base is not None else []
            prompt_len = base.prompt_len if base is not None else len(plan.prompt_ids)
            glue_ids = plan.prompt_ids[len(prefix_ids):] if base is not None else []
            made = []
            for ids, logprobs, versions, ended, text, assistant in choices:
                before_version = base.versions[-1] if base is not None and base.versions else (versions[0] if versions else 0)
                messages = (tuple(plan.messages) + (assistant,)) if plan.messages is not None and assistant else None
                node = Node(
                    ids=tuple(plan.prompt_ids) + tuple(ids), prompt_len=prompt_len,
                    logprobs=(base.logprobs if base else ()) + (0.0,) * len(glue_ids) + tuple(logprobs),
                    mask=(base.mask if base else ()) + (0,) * len(glue_ids) + (1,) * len(ids),
                    versions=(base.versions if base else ()) + (before_version,) * len(glue_ids) + tuple(versions),
                    messages=messages, tools_key=plan.tools_key, ended_turn=ended,
                    calls=(base.calls if base else 0) + 1, index=len(self.nodes), text=text,
                    chain=(base.chain if base else ()) + (len(self.nodes),))
                self.nodes.append(node)
                made.append(node)
            if made:
                self.last = made[0]
            return made

    def refuse(self, reason: str) -> None:
        """A call answered without sampling (``max_turns`` or ``length``): the episode ends so."""
        with self.lock:
            self.check_open()
            self.refused = reason

    def close(self) -> None:
        """End the session: later calls get 409, late results are not recorded."""
        with self.lock:
            self.closed = True

    def trained_chain(self) -> Node | None:
        """The node whose chain is trained (the last call's first choice), or ``None`` (no call
        sampled anything)."""
        return self.last

    def untrained_calls(self) -> int:
        """Nodes off the trained chain (abandoned branches, other choices)."""
        if self.last is None:
            return len(self.nodes)
        return len(self.nodes) - len(self.last.chain)
