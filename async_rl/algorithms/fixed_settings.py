"""Settings that a policy loss's or an advantage estimator's definition fixes.

Some objectives are defined with one particular value of a setting that the config also exposes:
GSPO's sequence-level objective is averaged over sequences (``algorithm.loss_agg_mode`` must be
``seq-mean-token-mean``), Dr. GRPO neither divides advantages by the group's std nor normalises by
sequence length. With any other value the run would train a different objective than the one
the user selected, so each built-in loss and estimator declares what its definition fixes, as a
map from a dotted config key to a ``FixedSetting`` (``{}`` when it fixes nothing):

    @register_policy_loss("gspo", GSPOOptions, fixed_settings={"algorithm.loss_agg_mode": FixedSetting(
        "seq-mean-token-mean", "GSPO averages its sequence-level objective over sequences; Zheng et al. 2025")})

``load_config`` resolves the declarations of the loss and estimator a config selects: a fixed key
the user did not set (in the YAML file or on the command line) takes the fixed value, over the
preset's and the schema's; a fixed key the user set to another value, or two declarations fixing
one key to different values, stop the run with one line naming both keys.

A user loss or estimator named by spec declares nothing unless it opts in: ``fn.fixed_settings =
{...}`` (or ``register_policy_loss(..., fixed_settings=...)``) for a loss, ``EstimatorSpec(fn,
fixed_settings={...})`` (or ``register_estimator(..., fixed_settings=...)``) for an estimator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["FixedSetting", "check_fixed_settings", "fixed_settings_of"]


@dataclass(frozen=True)
class FixedSetting:
    """One config value a loss's or estimator's definition requires.

    Attributes:
        value: the value the config key must hold (as the config holds it: ``False``, not
            ``"false"``).
        source: why, with the paper (and equation or figure, where it has one) that defines
            it, as a clause for a message (``"CISPO divides by the group's token count,
            1/sum_i |o_i|; MiniMax 2025, arXiv 2506.13585, eq. 4"``).

    Raises:
        ValueError: (at construction) ``source`` is empty: a fixed setting names its source.
    """

    value: Any
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"FixedSetting({self.value!r}) needs a source (why the definition fixes it)")


def check_fixed_settings(owner: str, settings: Mapping[str, FixedSetting] | None) -> dict[str, FixedSetting] | None:
    """``settings`` as a new dict after checking its form, or ``None`` (declares nothing).

    Whether each key exists in the config schema is checked when a config selects ``owner``
    (``load_config``): the algorithms package does not know the whole schema.

    Args:
        owner: what declares them, for the message (``"policy loss 'gspo'"``).
        settings: dotted config key (``"algorithm.loss_agg_mode"``) -> ``FixedSetting``.

    Raises:
        ValueError: ``settings`` is not a mapping, a key is not a dotted ``section.field`` string,
            or a value is not a ``FixedSetting``; one line naming ``owner``.
    """
    if settings is None:
        return None
    if not isinstance(settings, Mapping):
        raise ValueError(f"{owner}: fixed_settings must map dotted config keys to FixedSetting, "
                         f"got {type(settings).__name__}")
    for key, fixed in settings.items():
        if not isinstance(key, str) or "." not in key or not all(key.split(".")):
            raise ValueError(f"{owner}: fixed_settings key {key!r} is not a dotted config key "
                             "such as 'algorithm.loss_agg_mode'")
        if not isinstance(fixed, FixedSetting):
            raise ValueError(f"{owner}: fixed_settings[{key!r}] must be a FixedSetting(value, source), "
                             f"got {fixed!r}")
    return dict(settings)


def fixed_settings_of(obj: Any, owner: str = "") -> dict[str, FixedSetting]:
    """What ``obj`` (a policy loss function or an ``EstimatorSpec``) fixes: its ``fixed_settings``
    attribute, ``{}`` when it declares none.

    Args:
        obj: the loss or estimator.
        owner: how a message names it (default ``repr(obj)``).

    Raises:
        ValueError: the declaration is malformed (as ``check_fixed_settings``).
    """
    return check_fixed_settings(owner or repr(obj), getattr(obj, "fixed_settings", None)) or {}
