"""What a run asks the Ray cluster for: each role's bundle (``PlacementConfig``), the checks of
its placement keys, and the logical CPUs a Ray of the run's own must offer.

A role (the learner ranks, the generator actors) is one Ray placement group of one bundle per
actor, ``{"CPU": num_cpus, "GPU": num_gpus}`` with optional node labels; ``Cluster.place``
(``async_rl.runtime.cluster``) reserves it. This module holds the request, not the Ray calls, so the
configuration can check it without Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
"""Ray placement group strategies (``ray.util.placement_group``)."""

PLACEMENT_TIMEOUT_S = 300.0
"""How long a placement group may wait for the cluster's resources before the run stops with
what it asked for and what the cluster has (seconds; ``trainer.placement_timeout_s``)."""


@dataclass
class PlacementConfig:
    """The Ray resources of one role's actors, from ``generator.{num_cpus_per_worker,
    num_gpus_per_worker, node_labels, placement_strategy}`` or the learner's ``*_per_rank`` keys
    (``of_generators``, ``of_learner``).

    Attributes:
        num_cpus: CPUs Ray reserves per actor (>= 0).
        num_gpus: GPUs per actor (>= 0); ``None`` = 1 where the role runs on CUDA, else 0.
        node_labels: Ray node labels every actor's node must carry; empty = any node.
        strategy: Ray placement strategy (``PLACEMENT_STRATEGIES``).
    """

    num_cpus: float
    num_gpus: float | None
    node_labels: dict[str, str] = field(default_factory=dict)
    strategy: str = "PACK"

    @classmethod
    def of_generators(cls, g_cfg) -> "PlacementConfig":
        """The generator actors' placement (``GeneratorConfig``)."""
        return cls(g_cfg.num_cpus_per_worker, g_cfg.num_gpus_per_worker, dict(g_cfg.node_labels),
                   g_cfg.placement_strategy)

    @classmethod
    def of_learner(cls, l_cfg) -> "PlacementConfig":
        """The learner ranks' placement (``LearnerConfig``; ranks 1..N-1, rank 0 is the trainer)."""
        return cls(l_cfg.num_cpus_per_rank, l_cfg.num_gpus_per_rank, dict(l_cfg.node_labels),
                   l_cfg.placement_strategy)

    def bundle(self, cuda: bool) -> dict[str, float]:
        """One actor's Ray resources.

        Raises:
            ValueError: neither CPUs nor GPUs asked for (Ray refuses an empty bundle).
        """
        gpus = self.num_gpus if self.num_gpus is not None else (1.0 if cuda else 0.0)
        out = {k: float(v) for k, v in (("CPU", self.num_cpus), ("GPU", gpus)) if v}
        if not out:
            raise ValueError("a placement needs num_cpus > 0 or num_gpus > 0 (Ray refuses an empty bundle)")
        return out


class PlacementError(ValueError):
    """The cluster cannot hold what a role asked for (resources, labels, strategy); a
    ``ValueError`` so the command line shows it as one line."""


def check_placement(section: str, unit: str, num_cpus: float, num_gpus: float | None, strategy: str) -> None:
    """Validate one role's placement keys (``<section>.num_cpus_per_<unit>``, ...).

    Raises:
        ValueError: a negative count, no resources at all, or an unknown strategy (one line).
    """
    if num_cpus < 0 or (num_gpus is not None and num_gpus < 0):
        raise ValueError(f"{section}.num_cpus_per_{unit} and num_gpus_per_{unit} must be >= 0, got {num_cpus} "
                         f"and {num_gpus}")
    if num_cpus == 0 and num_gpus == 0:
        raise ValueError(f"{section}.num_cpus_per_{unit} and num_gpus_per_{unit} are both 0: Ray places an actor "
                         "only with some resource (its threads are set apart from this)")
    if strategy not in PLACEMENT_STRATEGIES:
        raise ValueError(f"{section}.placement_strategy must be one of {PLACEMENT_STRATEGIES}, got {strategy!r}")


def ray_cpus_needed(cfg) -> int:
    """Logical CPUs a Ray of the run's own must offer to admit every actor it places: learner
    ranks 1..N-1 and, in async mode, the generator actors."""
    need = (cfg.learner.world_size - 1) * cfg.learner.num_cpus_per_rank
    if cfg.trainer.mode == "async":
        need += cfg.generator.num_workers * cfg.generator.num_cpus_per_worker
    return int(math.ceil(need))
