"""Typed options of the policy losses: one frozen dataclass per loss, built once per run.

A policy loss is called as ``fn(inputs, correction, options)`` (``PolicyLoss``): ``options`` is an
instance of ``fn.options_type``, a ``LossOptions`` subclass holding exactly the options that loss
takes (PPO's clip range and dual-clip bound; GSPO's and CISPO's clip ranges). The learner builds it
once from the algorithm config (``AlgorithmConfig.loss_options()`` -> ``LossOptions.from_algorithm``)
and passes it on every call, whichever loss the config names: no loss is a special case of the
caller.

Where a value comes from, in order:

1. the options class's own defaults (each loss's paper values);
2. the ``algorithm.*`` fields the class lists in ``config_keys`` (``ppo_clip`` reads
   ``algorithm.clip_ratio_low``, ``clip_ratio_high`` and ``clip_ratio_c``; GSPO and CISPO read none,
   their ratios live on other scales);
3. ``algorithm.loss_kwargs``, which must name fields of the class.

Every value is checked as the options are built; an error is one ``ValueError`` line naming the
config key (``algorithm.loss_kwargs.clip_ratio_c must be > 1 (dual clip) or null, got 0.5``), or,
for options built directly, the class and field.

A user loss named by spec (``pkg.module:fn``, ``file.py:fn``) either declares its options, as the
built-ins do (``fn.options_type = MyOptions``, a ``LossOptions`` subclass, and ``fn(inputs,
correction, options)``), or is a plain function ``fn(inputs, correction, **params)``: then its
keyword parameters with their defaults become a generated options class (``keyword_loss``) and it
is called with the options' fields as keywords.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, TypeVar

from torch import Tensor

if TYPE_CHECKING:
    from async_rl.algorithms.config import AlgorithmConfig
    from async_rl.algorithms.losses import OffPolicyCorrection, PolicyLossInputs

__all__ = ["CISPOOptions", "GSPOOptions", "LossOptions", "PPOClipOptions", "PolicyLoss", "as_policy_loss",
           "check_options", "keyword_loss"]

O = TypeVar("O", bound="LossOptions")


def _is_number(value: Any) -> bool:
    # bool is an int subclass: True would silently be a clip range of 1.
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class LossOptions:
    """Base of every policy loss's options: a frozen dataclass whose fields are the loss's options.

    Subclasses add fields (with defaults: the loss's paper values), list in ``config_keys`` the
    fields read from ``algorithm.<field>`` of the same name, and describe what is wrong with a
    value in ``problem``. Construction checks every field.

    Raises:
        ValueError: (at construction) a field's value is out of range or of the wrong type; one
            line naming the class and the field.
    """

    config_keys: ClassVar[tuple[str, ...]] = ()
    """Fields taken from the ``AlgorithmConfig`` field of the same name (before ``loss_kwargs``)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            problem = self.problem(f.name, value)
            if problem is not None:
                raise ValueError(f"{type(self).__name__}.{f.name} {problem}, got {value!r}")

    @classmethod
    def problem(cls, name: str, value: Any) -> str | None:
        """What is wrong with ``value`` for field ``name``, completing "<key> ..." (``"must be >
        0"``), or ``None`` when it is fine. The base class accepts everything."""
        return None

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options this class holds, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    def as_kwargs(self) -> dict[str, Any]:
        """The options as keyword arguments (for a plain keyword-style user loss)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_algorithm(cls: type[O], algo: "AlgorithmConfig") -> O:
        """The options of ``algo``'s policy loss: defaults, then the ``algorithm.*`` fields in
        ``config_keys``, then ``algo.loss_kwargs``. ``algo`` must be resolved (``apply_preset``).

        Raises:
            ValueError: one line naming the key: a ``loss_kwargs`` key the loss does not take (the
                message lists those it does), a value out of range or of the wrong type, or an
                option without default that ``loss_kwargs`` does not set.
        """
        loss = algo.policy_loss
        names = cls.option_names()
        values: dict[str, Any] = {}
        where: dict[str, str] = {}
        for name in cls.config_keys:
            values[name], where[name] = getattr(algo, name), f"algorithm.{name}"
        for name, value in dict(algo.loss_kwargs).items():
            if name not in names:
                raise ValueError(f"algorithm.loss_kwargs.{name}: policy loss {loss!r} takes no option {name!r} "
                                 f"(its options: {', '.join(names) or 'none'})")
            values[name], where[name] = value, f"algorithm.loss_kwargs.{name}"
        for name, value in values.items():
            problem = cls.problem(name, value)
            if problem is not None:
                raise ValueError(f"{where[name]} {problem}, got {value!r}")
        required = [f.name for f in dataclasses.fields(cls) if f.name not in values and
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if required:
            raise ValueError(f"algorithm.loss_kwargs.{required[0]}: policy loss {loss!r} needs this option "
                             "(it has no default)")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class _ClipRange(LossOptions):
    """The clip range ``[1 - clip_ratio_low, 1 + clip_ratio_high]`` of a ratio-clipping loss.

    Attributes:
        clip_ratio_low: eps_low, in (0, 1] (dimensionless; the ratio's floor is ``1 - eps_low``).
        clip_ratio_high: eps_high > 0 (clip-higher, DAPO arXiv 2503.14476 Sec. 3.1).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2

    @classmethod
    def problem(cls, name: str, value: Any) -> str | None:
        """``clip_ratio_low`` must be in (0, 1], ``clip_ratio_high`` > 0 (numbers, not bool)."""
        if name == "clip_ratio_low" and not (_is_number(value) and 0 < value <= 1):
            return "must be a number in (0, 1]"
        if name == "clip_ratio_high" and not (_is_number(value) and value > 0):
            return "must be a number > 0"
        return None


@dataclasses.dataclass(frozen=True)
class PPOClipOptions(_ClipRange):
    """Options of ``ppo_clip_loss`` (PPO, Schulman et al. 2017, arXiv 1707.06347, eq. 7).

    Attributes:
        clip_ratio_low, clip_ratio_high: eps_low in (0, 1], eps_high > 0; read from
            ``algorithm.clip_ratio_low`` / ``clip_ratio_high``.
        clip_ratio_c: dual-clip bound c > 1 on the loss of negative-advantage tokens (Ye et al.
            2020, arXiv 1912.09729); ``None`` or ``inf``: no dual clip. Read from
            ``algorithm.clip_ratio_c``.

    Raises:
        ValueError: (at construction) a value out of range, naming the field.
    """

    clip_ratio_c: float | None = None

    config_keys: ClassVar[tuple[str, ...]] = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c")

    @classmethod
    def problem(cls, name: str, value: Any) -> str | None:
        """The clip range's checks, and ``clip_ratio_c`` None or > 1 (``inf`` allowed, NaN not)."""
        if name == "clip_ratio_c" and value is not None and not (_is_number(value) and value > 1):
            return "must be > 1 (dual clip) or null"
        return super().problem(name, value)


@dataclasses.dataclass(frozen=True)
class GSPOOptions(_ClipRange):
    """Options of ``gspo_loss``: the clip range of the sequence ratio. The defaults eps_low 3e-4,
    eps_high 4e-4 are the paper's (Zheng et al. 2025, arXiv 2507.18071); ``algorithm.clip_ratio_*``
    is on the token ratio's scale and is not read, ``algorithm.loss_kwargs`` sets them.

    Attributes:
        clip_ratio_low: in (0, 1]. clip_ratio_high: > 0.
    """

    clip_ratio_low: float = 3e-4
    clip_ratio_high: float = 4e-4


@dataclasses.dataclass(frozen=True)
class CISPOOptions(_ClipRange):
    """Options of ``cispo_loss``: the bounds of its detached importance weight. The paper (MiniMax
    2025, arXiv 2506.13585, eqs. 4-5) leaves the lower bound off, hence ``clip_ratio_low = 1.0``
    (weight floor 0); ``algorithm.clip_ratio_*`` is not read, ``algorithm.loss_kwargs`` sets them.

    Attributes:
        clip_ratio_low: in [0, 1] (0: the weight never drops below 1). clip_ratio_high: > 0.
    """

    clip_ratio_low: float = 1.0
    clip_ratio_high: float = 0.2

    @classmethod
    def problem(cls, name: str, value: Any) -> str | None:
        """As the clip range, but a floor of 1 (``clip_ratio_low = 0``) is allowed: CISPO drops no
        token, so the weight's floor is only a bound."""
        if name == "clip_ratio_low":
            return None if _is_number(value) and 0 <= value <= 1 else "must be a number in [0, 1]"
        return super().problem(name, value)


class PolicyLoss(Protocol):
    """What ``POLICY_LOSSES.get(spec)`` returns and the learner calls.

    Attributes:
        options_type: the ``LossOptions`` subclass this loss takes.
    """

    options_type: type[LossOptions]

    def __call__(self, inputs: "PolicyLossInputs", correction: "OffPolicyCorrection",
                 options: Any = ...) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of one micro-batch: ``(0-dim float32 loss with grad, detached 0-dim metrics)``.
        ``options`` is an instance of ``options_type`` (its defaults when omitted)."""


def _options_class_of(fn: Callable[..., Any]) -> type[LossOptions]:
    """A frozen ``LossOptions`` subclass whose fields are ``fn``'s parameters after the first two
    (inputs, correction) that can be passed by keyword, with their defaults; ``**kwargs`` is not
    an option (a loss_kwargs key must name a parameter)."""
    params = list(inspect.signature(fn).parameters.values())[2:]
    fields = []
    for p in params:
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            spec = dataclasses.field() if p.default is p.empty else dataclasses.field(default=p.default)
            fields.append((p.name, Any, spec))
    # Fields without a default first: dataclasses refuses a required field after a defaulted one.
    fields.sort(key=lambda f: f[2].default is not dataclasses.MISSING)
    name = "".join(part.capitalize() for part in getattr(fn, "__name__", "loss").split("_")) + "Options"
    return dataclasses.make_dataclass(name, fields, bases=(LossOptions,), frozen=True)


@functools.lru_cache(maxsize=None)
def keyword_loss(fn: Callable[..., tuple[Tensor, dict[str, Tensor]]]) -> PolicyLoss:
    """``fn(inputs, correction, **params)`` as a ``PolicyLoss``: its options class is generated
    from ``fn``'s keyword parameters (``_options_class_of``), and a call passes the options' fields
    as keywords. One wrapper per function (cached), so every lookup of a spec yields the same
    options class.

    The wrapper also takes the keywords themselves (``loss(inputs, correction, scale=2.0)``), as
    ``fn`` did, building its options from them.

    Raises:
        ValueError: ``fn``'s signature cannot be read (a builtin without one).
    """
    try:
        options_type = _options_class_of(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"cannot read the signature of policy loss {fn!r}: {e}") from None

    @functools.wraps(fn)
    def call(inputs: Any, correction: Any, options: LossOptions | None = None,
             **params: Any) -> tuple[Tensor, dict[str, Tensor]]:
        if options is None:
            options = options_type(**params)
        elif params:
            raise TypeError(f"{fn.__name__}: pass options or keyword parameters, not both")
        return fn(inputs, correction, **options.as_kwargs())

    call.options_type = options_type  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def as_policy_loss(kind: str, spec: str, obj: Any) -> PolicyLoss:
    """The ``coerce`` of ``POLICY_LOSSES``: ``obj`` itself when it declares ``options_type`` (a
    ``LossOptions`` subclass), else ``keyword_loss(obj)``.

    Raises:
        ValueError: ``obj`` is not callable, or its ``options_type`` is not a ``LossOptions``
            subclass; one line naming kind and spec.
    """
    if not callable(obj):
        raise ValueError(f"{kind} {spec!r} is not callable (got {type(obj).__name__})")
    declared = getattr(obj, "options_type", None)
    if declared is None:
        try:
            return keyword_loss(obj)
        except TypeError:  # an unhashable callable object: not cached
            return keyword_loss.__wrapped__(obj)
    if not (isinstance(declared, type) and issubclass(declared, LossOptions)):
        raise ValueError(f"{kind} {spec!r}: options_type must be a subclass of "
                         f"async_rl.algorithms.loss_options.LossOptions, got {declared!r}")
    return obj


def check_options(options: Any, expected: type[O], loss: str) -> O:
    """``options`` if it is an ``expected`` instance (a loss's guard against another loss's options).

    Raises:
        TypeError: ``options`` is of another type; one line naming the loss and both types.
    """
    if not isinstance(options, expected):
        raise TypeError(f"{loss} takes {expected.__name__}, got {type(options).__name__}")
    return options

