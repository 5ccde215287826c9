"""Environment rollouts: episodes of an ``async_rl.envs.Environment``, advanced turn by turn on an engine.

One episode per sample. ``reset`` gives the first observation (the prompt's messages); each turn
the engine continues the episode's token ids up to the chat template's end-of-turn token; the
turn's text (special tokens removed) goes to the environment's ``step``, whose observation
messages are appended as tokens and the engine continues. The episode ends when the environment
says ``done`` (finish reason ``stop``), at ``env.max_turns`` assistant turns (``max_turns``) or
when the response reaches ``env.max_response_tokens`` (``length``: a turn cut mid-way is not sent
to the environment, and an observation that would pass the budget is left out; one that fills it
exactly is appended, and the episode ends). The episode's
return, the sum of its turns' rewards, is the sample's reward.

Token-in, token-out (``async_rl.step.agent``): generated ids are kept exactly
as sampled, and only the observations are tokenised, as the difference between two renders of
the chat template (``tool_turn_ids``), so the sequence equals the template's rendering of the
whole conversation whenever the model wrote what the template would have. Per response token the
episode keeps the id, the behavior log-prob (0 on observation tokens), the loss mask (1 on
generated tokens, 0 on observations) and the policy version.

A vision-language policy's episodes carry images: the prompt's go with every turn, and an
observation may show more (image parts in its messages, ``async_rl.envs.EnvStep``). Those are
decoded and processed once, as a dataset row's are (the run's ``ImageProcessing``), their
placeholders expanded to one token per merged patch in the observation's ids (counted by
``env.max_response_tokens`` like any observation token), and they go with every later turn after
the prompt's, in the order of their placeholders; the trajectory carries them to the learner
(``Trajectory.observation_pixel_values``). A picture that cannot be used rejects the episode
(``malformed``).

The environments' coroutines run on an event loop of the ``EpisodeLoop``'s own (one thread): all
resets of a batch run concurrently, then each turn is sampled in one engine batch and each
episode taken on the moment its turn is sampled: its ``step`` (and, once it ends, its ``close``
and its hand-on to be scored) runs while the engine decodes the others, each under
``env.step_timeout_s``.
Faults reject the episode, counted with the reason (``env/rejected_<reason>``), never a reward
0: ``error`` (``reset`` or ``step`` raised), ``timeout``, ``malformed`` (not a list of messages
or an ``EnvStep``: ``async_rl.envs.check_step``), ``prompt_too_long`` (a first observation over
``data.max_prompt_tokens``). A rejected episode leaves its group as a rejected reward does. An
episode whose server went away (``EnvironmentLost``) starts over, once, in its group's slot
(``env/reissued_episodes``); lost a second time it is rejected (``lost``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Sequence

from async_rl.data.images import BadImageError, concat_images, decode_image, expand_image_tokens
from async_rl.envs.base import (EnvironmentLost, MalformedEnvStepError, Task, check_messages, check_step, has_images,
                                make_env)
from async_rl.generators.base import mix_seed
from async_rl.step.agent import Conversation, Episode, EpisodeCounters, cap_tokens, render_ids, tool_turn_ids

logger = logging.getLogger(__name__)

REJECT_REASONS = ("error", "timeout", "malformed", "prompt_too_long", "lost")
"""Why an episode is rejected (``env/rejected_<reason>``)."""


@dataclass
class EnvConfig:
    """Episodes of an environment (``env.*``); off while ``name`` is unset."""

    name: str | None = None
    """The environment's spec: a built-in name (``guess_number``, ``gym``), an import path
    (``my_pkg.envs:MyEnv``) or a file path (``path/to/envs.py:MyEnv``) of an ``Environment``
    subclass or a function returning one (``async_rl.envs``). ``None``: no environment."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment's class or function, one fresh object per episode."""
    max_turns: int = 4
    """Most assistant turns per episode (>= 1); the last turn's step still gives its reward."""
    max_response_tokens: int = 512
    """Most response tokens per episode, generated and observation tokens together (>= 1)."""
    step_timeout_s: float = 30.0
    """Seconds one ``reset`` or ``step`` may take (> 0); past it the episode is rejected (``timeout``)."""
    max_observation_tokens: int | None = None
    """An observation message (a tool's output, a game's feedback) longer than this many tokens is
    cut to at most this many (whole characters) and marked `` ...[truncated]``, so one
    observation cannot fill the episode's budget (>= 1); ``None``: kept whole."""

    def __post_init__(self) -> None:
        for key in ("max_turns", "max_response_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"env.{key} must be >= 1, got {getattr(self, key)}")
        if self.max_observation_tokens is not None and self.max_observation_tokens < 1:
            raise ValueError(f"env.max_observation_tokens must be >= 1 or null, got {self.max_observation_tokens}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"env.step_timeout_s must be > 0 seconds, got {self.step_timeout_s}")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are episodes of an environment."""
        return bool(self.name)


class _Timeout(Exception):
    """A coroutine of an environment ran past ``env.step_timeout_s``."""


class EpisodeLoop(EpisodeCounters):
    """Runs episodes of one environment on any generator backend (the ``agent`` of a rollout).

    Counters (``pop_metrics``): ``env/episodes``, ``env/rejected_<reason>``, ``env/reissued_episodes``,
    ``env/close_errors``, ``env/observation_images`` (pictures the observations showed); with tools
    ``tools/calls``, ``tools/ok``, ``tools/error_<kind>``.

    Args:
        cfg: ``env`` settings.
        tokenizer: the policy's tokenizer (with a chat template).
        stop_token_ids: ids that end an assistant turn (EOS / end-of-turn).
        max_prompt_tokens: most tokens of a first observation (``data.max_prompt_tokens``).
        factory: makes one ``Environment`` per episode; default ``make_env(cfg.name, cfg.args)``.
        images: a vision-language policy's ``async_rl.data.images.ImageProcessing`` (the
            dataset's: same processor and pixel bounds): observations may then hold images,
            processed here; ``None``: a text policy, whose observations are text.

    Raises:
        ValueError: the spec names no environment, or it cannot be made with ``cfg.args``.
    """

    def __init__(self, cfg: EnvConfig, tokenizer, stop_token_ids: Sequence[int], max_prompt_tokens: int,
                 factory: Callable[[], Any] | None = None, images: Any = None) -> None:
        super().__init__()
        self.cfg, self.tokenizer, self.images = cfg, tokenizer, images
        self.stop_token_ids = tuple(stop_token_ids)
        self.max_prompt_tokens = max_prompt_tokens
        self.factory = factory if factory is not None else make_env(cfg.name, cfg.args)
        self.schemas = getattr(self.factory(), "tools", None)
        self._special: list[str] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        # Fast tokenizers refuse concurrent use ("Already borrowed"): a turn is decoded on the
        # engine's thread while another episode's observation is tokenized on the event loop.
        self._tokenizer_lock = threading.Lock()
        self._hand_on_lock = threading.Lock()

    # ------------------------------------------------------------------ the environments' event loop
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="env-loop", daemon=True).start()
                self._loop = loop
            return self._loop

    async def _timed(self, coro: Coroutine, late_is_timeout: bool = True) -> Any:
        """``coro``'s value, or the exception it raised (``_Timeout`` past ``env.step_timeout_s``,
        also for one that returned late unless ``late_is_timeout`` is false: a ``close``, whose
        lateness may be another episode's blocking and costs its own episode nothing)."""
        timeout = self.cfg.step_timeout_s
        t0 = time.monotonic()
        try:
            # asyncio.timeout, not wait_for: no task of its own per call (wait_for makes one on 3.11).
            async with asyncio.timeout(timeout):
                result = await coro
        except TimeoutError:
            return _Timeout(f"past env.step_timeout_s={timeout} s")
        except Exception as e:  # noqa: BLE001 - the environment's fault, reported per episode
            return e
        # A coroutine that blocked the loop finishes before wait_for can cancel it: late is late.
        elapsed = time.monotonic() - t0
        late = late_is_timeout and elapsed > timeout
        return _Timeout(f"took {elapsed:.1f} s, past env.step_timeout_s={timeout} s") if late else result

    def _blocked_loop_s(self) -> float:
        """Seconds past which a call's coroutines count as stuck behind a blocked event loop."""
        return 2 * self.cfg.step_timeout_s + 5

    def _loop_blocked(self) -> None:
        logger.error("an environment blocked its event loop past %.0f s (synchronous work in a coroutine?); "
                     "a new loop serves the next episodes", self._blocked_loop_s())
        with self._lock:
            self._loop = None

    def _run_all(self, coros: list[Coroutine], timed: bool = True) -> list[Any]:
        """Run ``coros`` concurrently on the event loop, each under ``env.step_timeout_s``
        (``timed``; else they bound their own awaits); each result is the coroutine's value or
        the exception it raised (``_Timeout`` past the limit, also for one that returned late).
        A coroutine that blocks the loop itself (synchronous work inside ``async def``) cannot
        be cancelled: past twice the limit the loop is given up (its thread left to end) and
        every coroutine of the call counts as timed out."""
        if not coros:
            return []

        async def gather():
            return await asyncio.gather(*(self._timed(c) if timed else c for c in coros))

        future = asyncio.run_coroutine_threadsafe(gather(), self._event_loop())
        try:
            return future.result(timeout=self._blocked_loop_s())
        except TimeoutError:
            future.cancel()
            self._loop_blocked()
            return [_Timeout("the environment blocked its event loop")] * len(coros)

    def _reject(self, c: Episode, error: BaseException) -> None:
        reason = ("timeout" if isinstance(error, _Timeout) else "lost" if isinstance(error, EnvironmentLost) else
                  "malformed" if isinstance(error, MalformedEnvStepError) else "error")
        c.rejected = reason
        c.finish_reason = "stop"
        if self._count(f"env/rejected_{reason}") == 1:  # the first of each reason, then counted only
            logger.warning("environment %s: episode rejected (%s): %s: %s", self.cfg.name, reason,
                           type(error).__name__, error)

    # ------------------------------------------------------------------ episodes
    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The rendered prompt with the environment's tool schemas and a generation prompt."""
        return render_ids(self.tokenizer, messages, self.schemas, add_generation_prompt=True)

    def run_groups(self, generator, requests: Sequence[Any], n: int, params, seeds: Sequence[int] | None,
                   on_sample: Callable[[int, int, Episode], None] | None = None) -> list[list[Episode]]:
        """``n`` episodes per request (``GroupRequest``), advanced turn by turn in one engine batch.

        The ``n`` episodes of a group reset with the same environment seed (the group's seed;
        unseeded groups, as in evaluation, use a hash of the prompt's uid), so the group's
        baseline compares episodes that started alike.

        Args:
            generator: a ``Generator`` (HF, vLLM, SGLang).
            requests: the groups; their rows are the episodes' ``Task``.
            n: episodes per group.
            params: ``SamplingParams`` of one assistant turn.
            seeds: one per request; episode j's turn k is sampled with ``mix_seed(seeds[i], j, k)``.
            on_sample: called as ``on_sample(i, j, episode)`` when an episode ends or is rejected.

        Returns:
            One list of ``n`` finished ``Episode`` per request.
        """
        tasks, env_seeds, rows = [], [], []
        for i, r in enumerate(requests):
            env_seeds.append((seeds[i] if seeds is not None else zlib.crc32(r.prompt_uid.encode())) % 2**31)
            tasks.append(Task(r.prompt_uid, [dict(m) for m in r.messages], r.data_source, r.ground_truth,
                              dict(r.extra_info)))
            rows.append([self._new_episode(r, seeds, i, j) for j in range(n)])
        self._count("env/episodes", n * len(requests))
        starting = [(i, j) for i in range(len(requests)) for j in range(n)]
        while starting:
            # Resets first (all at once), then one turn of every live episode per engine batch. An
            # episode whose server was lost starts over here, once, in its group's slot.
            firsts = self._run_all([rows[i][j].env.reset(tasks[i], env_seeds[i]) for i, j in starting])
            for (i, j), first in zip(starting, firsts):
                self._start(rows[i][j], requests[i], first)
            ended = [(i, j) for i, j in starting if rows[i][j].finish_reason is not None]
            starting = self._finish(ended, rows, requests, seeds, on_sample)
            while not starting:
                active = [(i, j) for i, row in enumerate(rows) for j, c in enumerate(row) if c.finish_reason is None]
                if not active:
                    break
                # Each episode generates up to its own remaining budget, the
                # batch runs to the largest and each sample is cut to its own.
                budgets = [min(params.max_tokens, self.cfg.max_response_tokens - len(rows[i][j].response_ids))
                           for i, j in active]
                turn_params = dataclasses.replace(params, max_tokens=max(budgets))
                turn_seeds = ([mix_seed(rows[i][j].seed, rows[i][j].num_turns) for i, j in active]
                              if seeds is not None else None)
                starting = self._turn(generator, active, budgets, turn_params, turn_seeds, rows, requests, seeds,
                                      on_sample)
        return rows

    def _new_episode(self, request, seeds: Sequence[int] | None, i: int, j: int, restarted: bool = False) -> Episode:
        seed = mix_seed(seeds[i], j) if seeds is not None else -1
        return Episode(list(request.prompt_ids), [], seed, env=self.factory(), restarted=restarted,
                       multi_turn=self.cfg.max_turns > 1, images=getattr(request, "images", None))

    def _checked(self, c: Episode, result: Any, check: Callable[[Any], Any]) -> Any:
        """``check(result)`` of an environment's answer, or ``None`` once the answer ended the
        episode: its server lost (``c.lost``), an exception or a malformed answer (rejected)."""
        if isinstance(result, EnvironmentLost):
            c.lost, c.finish_reason = result, "stop"
            return None
        if isinstance(result, BaseException):
            return self._reject(c, result)
        try:
            return check(result)
        except MalformedEnvStepError as e:
            return self._reject(c, e)

    def _start(self, c: Episode, request, first: Any) -> None:
        messages = self._checked(c, first, lambda m: check_messages(m, "reset()", ("system", "user", "assistant", "tool"),
                                                                    parts=self.images is not None))
        if messages is None:
            return
        c.messages = messages
        c.reward_from_run = bool(getattr(c.env, "reward_from_run", False))
        if c.messages != list(request.messages):
            c.prompt_ids = self.prompt_ids(c.messages)
            if not self._place_row_images(c, request):
                return
            if len(c.prompt_ids) > self.max_prompt_tokens:
                c.rejected, c.finish_reason = "prompt_too_long", "stop"
                self._count("env/rejected_prompt_too_long", 1)

    def _place_row_images(self, c: Episode, request) -> bool:
        """A first observation of the environment's own (re-rendered ``c.prompt_ids``) shows the
        row's images at its image parts, in order, each expanded to its patches; one without
        image parts shows none (the episode then goes without them). Whether the episode goes
        on: a number of image parts other than the row's images rejects it (``malformed``)."""
        if not has_images(c.messages):
            c.images = None
            return True
        try:
            if request.images is None:
                raise BadImageError("image_count_mismatch", "the first observation has image parts, but the row "
                                                            "has no image")
            c.prompt_ids = expand_image_tokens(c.prompt_ids, request.images, self.images.image_token_id)
        except BadImageError as e:
            self._reject(c, MalformedEnvStepError(f"reset(): {e}"))
            return False
        return True

    def _generated(self, c: Episode, sample, budget: int) -> bool:
        """Append a generated turn; whether it goes to the environment (it ended at an end-of-turn token)."""
        c.num_turns += 1
        ids = list(sample.response_ids)[:budget]
        c.append(ids, list(sample.logprobs)[:budget], 1, list(sample.policy_version)[:budget] or [0] * len(ids))
        routed = getattr(sample, "routed_experts", None)
        # Routing replay covers one-turn rollouts: a later turn's routing would cover its own
        # context only, so a multi-turn episode carries none (and its batch is refused whole).
        c.routed_experts = (routed[: len(c.prompt_ids) + len(ids) - 1]
                            if routed is not None and c.num_turns == 1 else None)
        ended = bool(ids) and ids[-1] in self.stop_token_ids
        body = ids[:-1] if ended else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True).strip()
        # An environment that parses markup the tokenizer makes special tokens (tool-call tags)
        # reads the turn as generated, special tokens kept.
        action = (self.tokenizer.decode(body, skip_special_tokens=False, spaces_between_special_tokens=False)
                  if getattr(c.env, "keep_special_tokens", False) else text)
        # The class's hook, called through the class: an environment that keeps its expected
        # answer in ``self.answer`` (a natural name) must not shadow the hook with a string.
        answer = type(c.env).answer(c.env, action)
        c.final_text = text if answer is None else self._without_special_tokens(answer)
        if not ended:
            c.finish_reason = "length"  # cut mid-turn: the environment never sees half an answer
            return False
        c.messages.append({"role": "assistant", "content": text})
        c.action = action
        return True

    def _without_special_tokens(self, text: str) -> str:
        if self._special is None:
            tok = self.tokenizer
            special = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if t.special}
            # Longest first, so a special token that contains another is removed whole.
            self._special = sorted({*special, *tok.all_special_tokens} - {""}, key=len, reverse=True)
        for token in self._special:
            text = text.replace(token, "")
        return text.strip()

    def _after_step(self, c: Episode, step: Any) -> None:
        step = self._checked(c, step, lambda s: check_step(s, images=self.images is not None))
        if step is None:
            return
        c.turn_rewards.append(float(step.reward))
        c.env_return += float(step.reward)
        for k, v in step.info.items():
            c.info[k] = c.info.get(k, 0.0) + float(v)
        if self.schemas:
            self._count_tool_calls(c, step.info)
        if step.done:
            c.finish_reason = "stop"
            return
        if c.num_turns >= self.cfg.max_turns:
            c.finish_reason = "max_turns"
            return
        if self.cfg.max_observation_tokens is not None:
            step.observation = [{**m, "content": self._capped(m["content"])} for m in step.observation]
        observation, inputs = self._observation_images(c, step.observation)
        if observation is None:
            return
        ids = tool_turn_ids(self.tokenizer, c.messages, observation, self.schemas, self.stop_token_ids)
        if inputs is not None:
            try:
                ids = expand_image_tokens(ids, inputs, self.images.image_token_id)
            except BadImageError as e:  # a template that leaves out some image parts (of a role it drops)
                return self._reject(c, MalformedEnvStepError(f"EnvStep.observation: {e}"))
        room = self.cfg.max_response_tokens - len(c.response_ids)
        if len(ids) > room:  # the observation would pass the budget: left out
            c.finish_reason = "length"
            return
        c.messages.extend(observation)
        if inputs is not None:
            c.observation_images.append(inputs)
            c.images = concat_images([c.images, inputs])
            self._count("env/observation_images", len(inputs.image_grid_thw))
        version = c.policy_version[-1] if c.policy_version else 0
        c.append(ids, [0.0] * len(ids), 0, [version] * len(ids))
        if len(ids) == room:  # within the budget, which it fills: nothing left to generate with
            c.finish_reason = "length"

    def _capped(self, content: Any) -> Any:
        """A message's content with its text (each text part) cut to ``env.max_observation_tokens``."""
        limit = self.cfg.max_observation_tokens
        if isinstance(content, str):
            return cap_tokens(self.tokenizer, content, limit)
        return [{**p, "text": cap_tokens(self.tokenizer, p["text"], limit)} if p.get("type") == "text" else p
                for p in content]

    def _observation_images(self, c: Episode, observation: list[dict]) -> tuple[list[dict] | None, Any]:
        """An observation's messages as the template renders them (each image part ``{"type":
        "image"}``) and its pictures decoded and processed once, as the dataset processes a row's
        (``ImageInputs``; ``None`` without images); ``(None, None)`` when a picture cannot be used:
        the episode is rejected (``malformed``, the reason in the log)."""
        if self.images is None or not has_images(observation):
            return observation, None
        pictures, shown = [], []
        try:
            for m in observation:
                if isinstance(m["content"], str):
                    shown.append(m)
                    continue
                for part in m["content"]:
                    if part["type"] == "image":
                        pictures.append(decode_image(part["image"]))
                shown.append({**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]})
            return shown, self.images.process(pictures)
        except BadImageError as e:
            self._reject(c, MalformedEnvStepError(f"EnvStep.observation: an image ({e.reason}): {e}"))
            return None, None

    def _count_tool_calls(self, c: Episode, info: dict[str, float]) -> None:
        """A tool environment's step reports its calls in ``info`` (``tool_calls``, ``tool_errors``,
        ``error_<kind>``: ``async_rl.envs.tools``): they are the conversation's counts and this
        loop's ``tools/*`` counters (kept per loop, so evaluation counted apart and two runs in one
        process stay apart)."""
        calls, errors = int(info.get("tool_calls", 0)), int(info.get("tool_errors", 0))
        c.num_tool_calls += calls
        c.num_tool_errors += errors
        if calls:
            self._count("tools/calls", calls)
            self._count("tools/ok", calls - errors)
        for key, value in info.items():
            if key.startswith("error_") and value:
                self._count(f"tools/{key}", int(value))

    def _turn(self, generator, active: list[tuple[int, int]], budgets: list[int], params, turn_seeds,
              rows: list[list[Episode]], requests, seeds, on_sample) -> list[tuple[int, int]]:
        """One assistant turn of every ``active`` episode in one engine batch. Each episode is taken
        on the moment its turn is sampled (the engine's ``on_sample``): its ``step``, and once it
        ends its ``close`` and hand-on, run on the event loop while the engine decodes the others,
        so an episode that ends is scored while the batch still decodes, as a plain sample
        would be. Returns the slots to reset (episodes whose server was lost)."""
        loop = self._event_loop()
        futures: dict[int, concurrent.futures.Future] = {}
        restart: list[tuple[int, int]] = []
        taken: collections.deque[tuple[int, bool]] = collections.deque()

        def settle(task: asyncio.Task, future: concurrent.futures.Future) -> None:
            if not task.cancelled() and task.exception() is not None:
                future.set_exception(task.exception())
            else:
                future.set_result(None)

        def start_taken() -> None:
            while taken:
                k, acted = taken.popleft()
                i, j = active[k]
                task = loop.create_task(self._after_turn(i, j, acted, rows, requests, seeds, on_sample, restart))
                task.add_done_callback(lambda t, f=futures[k]: settle(t, f))

        def sampled(k: int, _index: int, sample) -> None:
            if k in futures:
                return
            i, j = active[k]
            with self._tokenizer_lock:
                acted = self._generated(rows[i][j], sample, budgets[k])
            futures[k] = concurrent.futures.Future()
            taken.append((k, acted))
            # One wake-up of the loop per burst of finished samples, not one per sample.
            if len(taken) == 1:
                loop.call_soon_threadsafe(start_taken)

        # A vision-language episode's images go with every turn: its prompt's, then its observations'.
        images = [rows[i][j].images for i, j in active]
        samples = generator.generate([rows[i][j].prompt_ids + rows[i][j].response_ids for i, j in active], 1,
                                     params, seeds=turn_seeds, on_sample=sampled,
                                     **({"images": images} if any(x is not None for x in images) else {}))
        for k, (sample,) in enumerate(samples):  # an engine that returned a sample without its callback
            sampled(k, 0, sample)
        done, stuck = concurrent.futures.wait(list(futures.values()), timeout=self._blocked_loop_s())
        if stuck:
            self._loop_blocked()
            for k, future in futures.items():
                if future in stuck and active[k] not in restart:
                    self._give_up(*active[k], rows, on_sample)
        for future in done:
            if future.exception() is not None:  # a fault of ours (on_sample), not the environment's
                raise future.exception()
        return restart

    async def _after_turn(self, i: int, j: int, acted: bool, rows: list[list[Episode]], requests, seeds, on_sample,
                          restart: list[tuple[int, int]]) -> None:
        """Step the episode in slot ``(i, j)`` with its turn (``acted``: the turn ended at an
        end-of-turn token) and end it if it is over."""
        c = rows[i][j]
        if acted:
            step = await self._timed(c.env.step(c.action))
            with self._tokenizer_lock:
                self._after_step(c, step)
        if c.finish_reason is not None:
            await self._end(i, j, rows, requests, seeds, on_sample, restart)

    async def _end(self, i: int, j: int, rows: list[list[Episode]], requests, seeds, on_sample,
                   restart: list[tuple[int, int]]) -> None:
        """Close the environment of the episode that ended in slot ``(i, j)``; an episode whose
        server was lost gets a fresh one in its slot (once: a second loss rejects it, ``lost``)
        and its slot joins ``restart``; any other is handed on."""
        c = rows[i][j]
        closed = await self._timed(c.env.close(), late_is_timeout=False)
        if isinstance(closed, BaseException):
            self._count("env/close_errors", 1)
        c.env = None
        if c.handed_on:  # given up while its loop was blocked
            return
        if c.lost is not None and not c.restarted:
            self._count("env/reissued_episodes", 1)
            logger.warning("environment %s: episode %d/%d starts over: %s", self.cfg.name, requests[i].group_id,
                           j, c.lost)
            rows[i][j] = self._new_episode(requests[i], seeds, i, j, restarted=True)
            restart.append((i, j))
            return
        if c.lost is not None:
            self._reject(c, c.lost)
        self._hand_on(i, j, c, on_sample)

    def _hand_on(self, i: int, j: int, c: Episode, on_sample, blocked: bool = False) -> None:
        """Give episode ``c`` (slot ``(i, j)``) to ``on_sample``, once; ``blocked``: rejected
        first, its coroutine stuck behind a blocked event loop."""
        with self._hand_on_lock:
            if c.handed_on:
                return
            c.handed_on = True
        if blocked:
            self._reject(c, _Timeout("the environment blocked its event loop"))
            c.env = None
        if on_sample is not None:
            on_sample(i, j, c)

    def _give_up(self, i: int, j: int, rows: list[list[Episode]], on_sample) -> None:
        """Reject and hand on the episode of slot ``(i, j)`` if its coroutine has not (a blocked loop)."""
        self._hand_on(i, j, rows[i][j], on_sample, blocked=True)

    def _finish(self, ended: list[tuple[int, int]], rows: list[list[Episode]], requests, seeds,
                on_sample) -> list[tuple[int, int]]:
        """End the episodes that ended at their reset (``_end``). Returns the slots to reset."""
        restart: list[tuple[int, int]] = []
        results = self._run_all([self._end(i, j, rows, requests, seeds, on_sample, restart) for i, j in ended],
                                timed=False)
        for (i, j), result in zip(ended, results):
            if isinstance(result, _Timeout) and (i, j) not in restart:
                self._give_up(i, j, rows, on_sample)
        return restart


def env_gives_reward(env_cfg: EnvConfig) -> bool:
    """Whether the run's environment scores its episodes itself (its return is the reward), so
    the rows' ``data_source`` need no reward function; ``False`` without an environment or with
    one that leaves the reward to the run (``Environment.reward_from_run``: ``single_turn``,
    ``tools``). A rollout function (``rollout_env_config`` of ``endpoint.rollout``) returns its
    reward: ``True``."""
    from async_rl.endpoint.rollouts import ENDPOINT_ENV
    from async_rl.envs import ENVIRONMENTS

    if env_cfg.name == ENDPOINT_ENV:
        return True
    return env_cfg.enabled and getattr(ENVIRONMENTS.get(env_cfg.name), "reward_from_run", False) is not True


def rollout_env_config(cfg) -> EnvConfig:
    """The environment a run's rollouts are episodes of: ``env`` when ``env.name`` is set, the
    ``tools`` environment when ``agent.tools`` is (``agent.*`` is its spelling), else
    ``single_turn`` (one prompt, one response of up to ``generator.max_response_tokens``, scored
    by the run's reward): every rollout takes the episode road.

    ``agent.max_tool_response_tokens`` becomes ``env.max_observation_tokens``, and one step may
    take as long as its calls run in waves of the executor's workers, each under its tool's own
    ``timeout_s`` (a call past it is answered with an error, not a rejected episode), plus 30 s.

    A rollout function (``endpoint.rollout``) travels as the environment ``openai_endpoint`` whose
    ``args`` are the ``endpoint`` settings (``make_episode_loop`` turns it into an
    ``async_rl.endpoint.EndpointLoop``).

    Raises:
        ValueError: an unknown tool spec or parser.
    """
    endpoint = getattr(cfg, "endpoint", None)
    if endpoint is not None and endpoint.enabled:
        from async_rl.endpoint.rollouts import ENDPOINT_ENV

        return EnvConfig(name=ENDPOINT_ENV, args=dataclasses.asdict(endpoint), max_turns=endpoint.max_turns,
                         max_response_tokens=endpoint.max_response_tokens, step_timeout_s=endpoint.timeout_s)
    if cfg.env.enabled:
        return cfg.env
    if cfg.agent.enabled:
        return tools_env_config(cfg.agent)
    return EnvConfig(name="single_turn", max_turns=1, max_response_tokens=cfg.generator.max_response_tokens)


def tools_env_config(agent, registry=None) -> EnvConfig:
    """The ``env`` settings of the ``tools`` environment that ``agent`` (``AgentConfig``) spells
    (see ``rollout_env_config``); ``registry``: a ``ToolRegistry`` built in code instead of
    ``agent.tools``' specs.

    Raises:
        ValueError: an unknown tool spec or parser, or no tool.
    """
    from async_rl.envs.tools import toolbox

    executor, _, _ = toolbox(tuple(agent.tools), agent.parser, registry)
    waves = -(-agent.max_tool_calls_per_turn // executor.max_workers)
    step_timeout_s = 30.0 + waves * max(tool.timeout_s for tool in executor.registry)
    args = {"tools": list(agent.tools), "parser": agent.parser, "max_tool_calls_per_turn": agent.max_tool_calls_per_turn}
    if registry is not None:
        args["registry"] = registry
    return EnvConfig(name="tools", args=args, max_turns=agent.max_turns, max_response_tokens=agent.max_response_tokens,
                     step_timeout_s=step_timeout_s, max_observation_tokens=agent.max_tool_response_tokens)


def make_episode_loop(env_cfg: EnvConfig, tokenizer, stop_token_ids: Sequence[int], max_prompt_tokens: int,
                      params=None, images: Any = None):
    """The loop that runs episodes of ``env_cfg``: an ``EpisodeLoop``, or for a rollout function
    (``openai_endpoint``) an ``async_rl.endpoint.EndpointLoop`` with its endpoint (``params``:
    the run's ``SamplingParams``, the endpoint's default ``max_tokens`` and stop ids).
    ``images``: a vision-language policy's ``ImageProcessing`` (``EpisodeLoop``'s ``images``).

    Raises:
        ValueError: as ``EpisodeLoop`` or ``EndpointLoop``.
    """
    from async_rl.endpoint.rollouts import ENDPOINT_ENV, EndpointConfig, EndpointLoop

    if env_cfg.name == ENDPOINT_ENV:
        return EndpointLoop(EndpointConfig(**env_cfg.args), tokenizer, stop_token_ids, max_prompt_tokens, params)
    return EpisodeLoop(env_cfg, tokenizer, stop_token_ids, max_prompt_tokens, images=images)


def make_rollout_agent(cfg, tokenizer, stop_token_ids: Sequence[int], images: Any = None):
    """The loop that turns a run's samples into episodes (``make_episode_loop`` of
    ``rollout_env_config``: ``endpoint.rollout``, ``env.name``, the tools of ``agent.tools``, else
    ``single_turn``).

    Args:
        cfg: the run's ``Config`` (its ``endpoint``, ``env``, ``agent``, ``generator`` and
            ``data.max_prompt_tokens``).
        images: a vision-language policy's ``ImageProcessing`` (``data.dataset.image_processing_for``),
            so observations may hold images; ``None`` for a text policy.

    Raises:
        ValueError: as ``EpisodeLoop`` or ``EndpointLoop``.
    """
    from async_rl.generators.base import SamplingParams

    params = SamplingParams.from_config(cfg.generator, stop_token_ids)
    return make_episode_loop(rollout_env_config(cfg), tokenizer, stop_token_ids, cfg.data.max_prompt_tokens, params,
                             images=images)


ENV_ROWS_PREFIX = "env:"
"""A data file ``env:<split>`` (``env:train``, ``env:val``) holds the environment's own task rows."""


def env_task_rows(env_cfg: EnvConfig, split: str) -> list[dict[str, Any]]:
    """The task rows the environment of ``env_cfg`` offers for ``split``: its class's
    ``task_rows(split, **env.args)`` (``async_rl.envs.reasoning_gym.task_rows``), or for a
    rollout function (``rollout_env_config`` of ``endpoint.rollout``) the function's
    ``task_rows(split, **endpoint.args)`` (``async_rl.endpoint.verifiers.task_rows``).

    Raises:
        ValueError: ``env.name`` unset, an environment without ``task_rows``, or its own error.
    """
    from async_rl.endpoint.rollouts import ENDPOINT_ENV, ROLLOUT_FUNCTIONS
    from async_rl.envs import ENVIRONMENTS

    if not env_cfg.enabled:
        raise ValueError(f"data file {ENV_ROWS_PREFIX}{split} takes the rows of an environment, but env.name is unset")
    if env_cfg.name == ENDPOINT_ENV:  # a rollout function's rows (the built-in ``verifiers``: its taskset's)
        spec = env_cfg.args["rollout"]
        rows_fn = getattr(ROLLOUT_FUNCTIONS.get(spec), "task_rows", None)
        if rows_fn is None:
            raise ValueError(f"data file {ENV_ROWS_PREFIX}{split}: rollout function {spec!r} offers no task rows "
                             "(no task_rows); name data files of your own instead")
        return rows_fn(split, **env_cfg.args.get("args", {}))
    rows_fn = getattr(ENVIRONMENTS.get(env_cfg.name), "task_rows", None)
    if rows_fn is None:
        raise ValueError(f"data file {ENV_ROWS_PREFIX}{split}: environment {env_cfg.name!r} offers no task rows "
                         "(no task_rows); name data files of your own instead")
    return rows_fn(split, **env_cfg.args)


def data_file(uri: str, env_cfg: EnvConfig) -> str:
    """The local path of a data file entry: ``env:<split>`` writes the environment's task rows
    (``env_task_rows``) as JSON lines under the artefact cache (``$ASYNC_RL_CACHE/env_rows``,
    named by a hash of the environment, its arguments and the split; written whole, then
    renamed, so a reader never sees half a file) and returns that file; a ``builtin:`` URI is
    built (``async_rl.data.builtin.resolve``); any other string is returned unchanged.

    Raises:
        ValueError: as ``env_task_rows`` and ``resolve``.
    """
    import hashlib
    import json
    import os

    from async_rl.data.builtin import cache_dir, resolve

    if not uri.startswith(ENV_ROWS_PREFIX):
        return resolve(uri)
    split = uri[len(ENV_ROWS_PREFIX):]
    rows = env_task_rows(env_cfg, split)
    key = hashlib.sha256(json.dumps([env_cfg.name, env_cfg.args, split], sort_keys=True, default=str).encode())
    path = cache_dir() / "env_rows" / f"{split}-{key.hexdigest()[:16]}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    os.replace(tmp, path)
    return str(path)


@contextlib.contextmanager
def environment_services(env_cfg: EnvConfig, host: str):
    """Run what the environment needs for the run's length: its class's ``services(args, host)``
    context manager (servers bind ``host``, the run's loopback default, unless their own
    arguments say otherwise) (``OpenEnvEnv.services`` starts and supervises OpenEnv servers), whose
    yielded arguments replace ``env.args`` meanwhile (the generator actors get them). Nothing
    for an environment without ``services``, or with none configured.

    Raises:
        ValueError: the services could not start (a server that never became healthy).
    """
    from async_rl.envs import ENVIRONMENTS

    serve = getattr(ENVIRONMENTS.get(env_cfg.name), "services", None) if env_cfg.enabled else None
    if serve is None:
        yield
        return
    original = env_cfg.args
    with serve(dict(original), host) as args:
        env_cfg.args = args
        try:
            yield
        finally:
            env_cfg.args = original
