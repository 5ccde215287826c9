"""Rank 0 drives the other learner ranks: each collective learner call runs on every rank.

The trainer (its loop, the colocated engine, the weight publisher) lives in one process, learner rank 0. The
FSDP2 learner's passes are collectives (parameter all-gathers, gradient reduce-scatters,
normaliser all-reduces, DCP saves), so every rank must make the same calls in the same order.
Instead of running the whole trainer on every rank (torchrun style, with data fanned out from
rank 0), rank 0 forwards each collective call: a method marked ``@collective`` first broadcasts
``[method name, {argument name: value}]`` over the learner's process group, then runs; ranks
1..N-1 sit in ``serve_commands``, receive the same call and make it with the same arguments (a
whole ``TrainBatch`` travels inside the broadcast). The call is msgpack with tensors as raw bytes
(``async_rl.learners.wire``), never pickle: nothing a follower receives is executed. Arguments
only rank 0 uses (a tokenizer to save beside the exported weights) are named in
``@collective(local=...)`` and stay on rank 0; followers get the parameter's default. Return
values of followers are dropped: every metric a learner returns is already reduced across ranks.

A follower that dies breaks the group: rank 0's next (or current) collective fails with gloo's
"Connection closed by peer". A launcher that watches its followers sets the learner's
``_follower_failure`` (``LearnerCore``): the outermost collective call on rank 0 then raises the
launcher's error naming the rank, chained to gloo's (``launch.RankMonitor``).

A call made from inside another collective call (``train_step`` computing proximal log-probs
itself, for example) is not forwarded again: the followers make the nested call themselves.
Generator methods (``named_weights``) are drained to the end on followers; rank 0's caller must
drain them too (the weight publisher does), or the ranks' all-gathers fall out of step.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
from collections.abc import Iterator
from typing import Callable

import torch.distributed as dist

from async_rl.learners import wire

logger = logging.getLogger(__name__)

_STOP = "__stop__"

COMMAND_TIMEOUT = datetime.timedelta(days=30)
"""Followers wait for the next call on a group of their own with this timeout: rank 0 may
generate or evaluate for longer than any collective's timeout between two learner calls."""

_command_group = None


def _commands():
    """The gloo group commands travel on (created on first use, by every rank in the same order)."""
    global _command_group
    if _command_group is None:
        _command_group = dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)
    return _command_group


def collective(method: Callable | None = None, *, local: tuple[str, ...] = ()) -> Callable:
    """Mark a learner method that every rank must call: on a driving rank 0 it is broadcast first.
    Use as ``@collective`` or ``@collective(local=("tokenizer",))``.

    The instance must have ``_drives_followers`` (bool) and ``_command_depth`` (int)
    attributes; ``_drives_followers`` is set by ``drive_followers``.

    Args:
        local: parameters only rank 0 uses; they are not sent (followers get their default).

    Raises:
        TypeError: (when called on a driving rank 0) an argument that is not in ``local`` cannot
            travel (``wire.pack``: the method and the argument are named).
    """
    if method is None:
        return functools.partial(collective, local=local)
    signature = inspect.signature(method)
    unknown = sorted(set(local) - set(signature.parameters))
    if unknown:
        raise TypeError(f"@collective(local={local}) names no parameter of {method.__name__}: {unknown}")

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        driving = self._command_depth == 0 and self._drives_followers
        try:
            if driving:
                bound = signature.bind(self, *args, **kwargs).arguments
                sent = {k: v for k, v in list(bound.items())[1:] if k not in local}
                try:  # packed before anything is sent: the followers keep waiting for a valid call
                    wire.broadcast([method.__name__, sent], src=0, group=_commands())
                except TypeError as e:
                    raise TypeError(f"learner.{method.__name__}: {e}; name the argument in @collective(local=...) "
                                    "if only rank 0 needs it") from None
            self._command_depth += 1
            try:
                result = method(self, *args, **kwargs)
            finally:
                self._command_depth -= 1
        except RuntimeError as e:  # gloo's errors are RuntimeErrors (DistBackendError among them)
            if driving:
                _raise_follower_failure(self, e)
            raise
        if driving and isinstance(result, Iterator):  # named_weights: its all-gathers run as it is drained
            return _watched(self, result)
        return result

    wrapper.is_collective = True
    return wrapper


def _raise_follower_failure(learner, error: RuntimeError) -> None:
    """If a follower rank died, raise the launcher's error naming it (from ``error``); else return."""
    failure = getattr(learner, "_follower_failure", None)
    named = failure() if failure is not None else None
    if named is not None:
        raise named from error


def _watched(learner, items: Iterator) -> Iterator:
    try:
        yield from items
    except RuntimeError as e:
        _raise_follower_failure(learner, e)
        raise


def drive_followers(learner) -> None:
    """Make ``learner`` (rank 0 of a group of more than one rank) forward its collective calls."""
    if dist.get_rank() != 0:
        raise RuntimeError("only rank 0 drives the other learner ranks")
    learner._drives_followers = dist.get_world_size() > 1
    if learner._drives_followers:
        _commands()


def stop_followers(learner) -> None:
    """Release the followers from ``serve_commands`` (call once, on rank 0, at shutdown)."""
    if learner._drives_followers:
        learner._drives_followers = False
        wire.broadcast([_STOP, {}], src=0, group=_commands())


def serve_commands(learner) -> int:
    """Follower loop (ranks 1..N-1): make every collective call rank 0 makes, until it stops us.

    Returns:
        The number of calls served.

    Raises:
        RuntimeError: rank 0 asked for a method that is not marked ``@collective`` (the two
            sides run different code versions); any exception of a call is raised here too
            (rank 0 sees the same failure, or a broken process group).
    """
    served = 0
    group = _commands()
    while True:
        name, kwargs = wire.broadcast(None, src=0, group=group)
        if name == _STOP:
            return served
        method = getattr(learner, name, None)
        if not getattr(method, "is_collective", False):
            raise RuntimeError(f"rank 0 asked for {name!r}, which is not a collective learner method")
        result = method(**kwargs)
        if isinstance(result, Iterator):  # a generator method (named_weights): run it to the end
            for _ in result:  # keep the all-gathers in step with rank 0's consumer
                pass
        served += 1


def forget_command_group() -> None:
    """Drop the cached command group (after ``dist.destroy_process_group``, before a new run)."""
    global _command_group
    _command_group = None
