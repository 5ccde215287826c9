"""Mixture-of-experts routers of transformers models: recording the experts each token was routed
to (an engine), replaying recorded routing in a forward pass (a learner), and the router
statistics both report.

Routing replay (R3: Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training
and Inference Routers", sec. 3): the inference engine records which experts each token was
routed to, and the learner's forward passes (proximal, current and reference) use those experts
instead of its own router's top-k, while the gating weights still come from the learner's router,
``softmax(logits)`` at the replayed experts (renormalised over them where the model renormalises
its top-k), so the router keeps its gradient. A router that picks other experts in training than
in inference is the largest single source of train-inference mismatch in MoE RL; replay removes
it for every token the engine recorded.

Routing layout everywhere: ``[tokens, num_moe_layers, top_k]`` expert indices, layers in model
order, each token's experts in the router's order (highest score first); ``-1`` rows (a token the
engine did not record) are routed by the learner's own router.

Supported routers (softmax then top-k, optionally renormalised over the top-k, one linear layer
with no bias): transformers' ``Qwen2MoeTopKRouter``, ``Qwen3MoeTopKRouter``, ``OlmoeTopKRouter``
and ``MixtralTopKRouter`` (always renormalised). Each returns ``(router_logits, router_scores,
router_indices)`` for the ``[tokens, hidden]`` rows of its layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

REPLAYABLE_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "OlmoeTopKRouter", "MixtralTopKRouter")
"""Router classes whose forward ``replay_routing`` reproduces exactly (tested against each class's own
forward) and can replace with recorded experts."""

ROUTED_EXPERTS_DTYPE = np.dtype("<i2")
"""Expert indices as stored and sent: int16 (models of up to 32,767 experts a layer)."""


class RoutingReplayError(ValueError):
    """Routing replay asked of a model it cannot serve (no MoE layers, an unsupported router) or
    given routing of the wrong shape; one line naming what and the value."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The router modules of ``model``'s mixture-of-experts layers, in layer order: every module
    whose class name ends in ``TopKRouter`` and has ``top_k`` and ``weight`` (``[]`` for a dense
    model). Under FSDP2 or a LoRA wrapper the same modules are found (names are not read)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("TopKRouter") and hasattr(m, "top_k") and hasattr(m, "weight")]


def moe_shape(hf_config) -> tuple[int, int, int] | None:
    """``(num_moe_layers, num_experts, top_k)`` of a Hugging Face config (an object or a dict),
    ``None`` for a dense model. MoE layers: every layer but ``mlp_only_layers``, with
    ``decoder_sparse_step`` (Qwen2/3-MoE's every-k-th-layer rule) where the config has it."""
    get = (lambda k, d=None: hf_config.get(k, d)) if isinstance(hf_config, dict) else (
        lambda k, d=None: getattr(hf_config, k, d))
    experts = get("num_experts") or get("num_local_experts")
    top_k = get("num_experts_per_tok")
    if not experts or not top_k:
        return None
    layers = int(get("num_hidden_layers"))
    only_mlp = set(get("mlp_only_layers") or [])
    step = int(get("decoder_sparse_step") or 1)
    moe = [i for i in range(layers) if i not in only_mlp and (i + 1) % step == 0]
    return len(moe), int(experts), int(top_k)


def check_replayable(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The routers of ``model`` when routing replay can run on it.

    Raises:
        RoutingReplayError: ``model`` has no MoE layer, or a router of a class not in
            ``REPLAYABLE_ROUTERS`` (its routing rule is not the softmax top-k replayed here).
    """
    found = routers(model)
    if not found:
        raise RoutingReplayError(f"routing replay (algorithm.routing_replay, record_routing) needs a "
                                 f"mixture-of-experts model; {type(model).__name__} has no router")
    bad = sorted({type(r).__name__ for r in found} - set(REPLAYABLE_ROUTERS))
    if bad:
        raise RoutingReplayError(f"algorithm.routing_replay supports the routers {', '.join(REPLAYABLE_ROUTERS)}; "
                                 f"this model has {', '.join(bad)}")
    return found


def _renormalises(router: torch.nn.Module) -> bool:
    # Mixtral's router always renormalises its top-k and has no flag.
    return bool(getattr(router, "norm_topk_prob", True))


@dataclass
class RouterStats:
    """What the routers did in the passes of one ``replay_routing`` context, summed over its
    forward passes.

    Attributes:
        num_experts: experts per layer.
        load: ``[num_moe_layers, num_experts]`` int64: tokens routed to each expert (the experts
            used: replayed ones where replayed), real tokens only.
        recorded: token-layer pairs that carried recorded routing.
        agreeing: of ``recorded * top_k`` recorded picks, how many the learner's own router also
            picked (its top-k as a set, whether or not replay used them).
    """

    num_experts: int
    load: torch.Tensor
    recorded: int = 0
    agreeing: int = 0
    top_k: int = 1

    def metrics(self, prefix: str = "moe/") -> dict[str, float]:
        """``router_agreement`` (share of the engine's picks the learner's router also made;
        absent without recorded routing), ``load_max`` and ``load_min`` (the most and least
        loaded expert's share of its layer's picks, averaged over layers: ``1 / num_experts``
        both for a balanced router) and ``load_cv`` (the coefficient of variation of the
        per-expert load, averaged over layers)."""
        out: dict[str, float] = {}
        if self.recorded:
            out[f"{prefix}router_agreement"] = self.agreeing / (self.recorded * self.top_k)
        totals = self.load.sum(dim=1, keepdim=True).clamp(min=1).double()
        share = self.load.double() / totals
        if int(self.load.sum()):
            out[f"{prefix}load_max"] = float(share.max(dim=1).values.mean())
            out[f"{prefix}load_min"] = float(share.min(dim=1).values.mean())
            mean = share.mean(dim=1, keepdim=True)
            out[f"{prefix}load_cv"] = float((share.std(dim=1, unbiased=False, keepdim=True) / mean).mean())
        return out


def load_balancing_loss(probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """The auxiliary load-balancing loss of one layer: ``E * sum_j sum_e f_je * P_e``, with
    ``f_je`` the share of tokens whose j-th expert is ``e`` and ``P_e`` the mean router
    probability of ``e`` (Switch Transformer, Fedus et al. 2022, eq. 4, in the top-k form of
    transformers' ``load_balancing_loss_func``); ``k`` when perfectly balanced.

    Args:
        probs: ``[N, E]`` float32 router softmax of N tokens.
        chosen: ``[N, k]`` int64 experts used.

    Returns:
        A scalar, differentiable in ``probs`` (``f`` is a count).
    """
    experts = probs.shape[-1]
    share = torch.nn.functional.one_hot(chosen, experts).to(probs.dtype).mean(dim=0)  # [k, E]
    return experts * (share * probs.mean(dim=0)).sum()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """The router z-loss of one layer: ``mean_n logsumexp(logits_n)^2`` (ST-MoE, Zoph et al.
    2022, eq. 5), which keeps router logits small. ``logits``: ``[N, E]``; returns a scalar."""
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


@dataclass
class _ReplayState:
    routed: torch.Tensor | None  # [N, num_moe_layers, top_k] int64 or None
    replay: bool
    real: torch.Tensor | None  # [N] bool: rows that are real tokens (statistics only)
    stats: RouterStats
    aux: list | None = None  # when a list: (load-balancing, z) loss terms of each layer are appended


def _routed_forward(router: torch.nn.Module, state: _ReplayState, index: int):
    renorm = _renormalises(router)

    def forward(hidden_states: torch.Tensor):
        hidden = hidden_states.reshape(-1, router.weight.shape[1])
        logits = torch.nn.functional.linear(hidden, router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        own = torch.topk(probs, router.top_k, dim=-1).indices
        chosen = own
        if state.routed is not None:
            given = state.routed[:, index].to(own.device)
            if given.shape != own.shape:
                raise RoutingReplayError(f"routed experts for {given.shape[0]} tokens x top-{given.shape[1]} "
                                         f"but layer {index}'s router got {own.shape[0]} x top-{own.shape[1]}")
            recorded = given[:, 0] >= 0
            if state.replay:
                chosen = torch.where(recorded.unsqueeze(-1), given, own)
            with torch.no_grad():
                real = recorded if state.real is None else recorded & state.real.to(own.device)
                hits = (given.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum(-1)
                state.stats.recorded += int(real.sum())
                state.stats.agreeing += int(hits[real].sum())
        with torch.no_grad():
            used = chosen if state.real is None else chosen[state.real.to(own.device)]
            state.stats.load[index] += torch.bincount(used.reshape(-1).cpu(), minlength=state.stats.num_experts)
        if state.aux is not None:
            keep = slice(None) if state.real is None else state.real.to(own.device)
            state.aux.append((load_balancing_loss(probs[keep], chosen[keep]), router_z_loss(logits[keep])))
        scores = probs.gather(-1, chosen)
        if renorm:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        # Qwen2/3-MoE and OLMoE hand the expert stack scores in the logits' dtype; Mixtral in float32.
        if type(router).__name__ != "MixtralTopKRouter":
            scores = scores.to(logits.dtype)
        return logits, scores, chosen

    return forward


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, routed: torch.Tensor | None, replay: bool = True,
                   real: torch.Tensor | None = None, stats: RouterStats | None = None,
                   aux: list | None = None) -> Iterator[RouterStats]:
    """Run ``model``'s forward passes within the block with recorded routing.

    Each router's forward is replaced for the block by the same softmax top-k computed here, in
    which ``replay`` swaps the router's own top-k for the recorded experts (rows with ``-1`` keep
    the router's own), with gating weights ``softmax(logits)`` at the experts used, renormalised
    where the router renormalises (R3, sec. 3: the router is still trained through them). With
    ``replay=False`` the forward is the router's own, bit for bit, and only the statistics are
    taken (agreement of the router with the recorded routing, per-expert load).

    Args:
        model: a transformers MoE model (possibly FSDP2-sharded or LoRA-wrapped).
        routed: ``[N, num_moe_layers, top_k]`` int64 expert indices in the row order every router
            sees (a ``[B, L]`` padded batch flattened row-major; a packed row's tokens), ``-1``
            where not recorded; ``None``: no recorded routing (statistics of the load only).
        replay: use the recorded experts (else only compare with them).
        real: ``[N]`` bool, the rows that are real tokens (padding counts in no statistic);
            ``None``: all.
        stats: a ``RouterStats`` to add to (several passes in one); a new one when ``None``.
        aux: a list to append each layer's ``(load_balancing_loss, router_z_loss)`` over the real
            rows to (differentiable scalars), for auxiliary losses; ``None``: not computed.

    Yields:
        The ``RouterStats`` the block's passes add to.

    Raises:
        RoutingReplayError: no router, an unsupported router (``check_replayable``), or routing
            whose shape is not ``[rows each router sees, num_moe_layers, top_k]`` (raised by the
            forward pass).
    """
    found = check_replayable(model)
    if routed is not None and (routed.dim() != 3 or routed.shape[1] != len(found)):
        raise RoutingReplayError(f"routed experts must be [tokens, {len(found)} MoE layers, top_k]; got "
                                 f"{list(routed.shape)}")
    if stats is None:
        stats = RouterStats(num_experts=int(found[0].weight.shape[0]),
                            load=torch.zeros(len(found), int(found[0].weight.shape[0]), dtype=torch.int64),
                            top_k=int(found[0].top_k))
    state = _ReplayState(routed=None if routed is None else routed.long(), replay=replay,
                         real=None if real is None else real.reshape(-1).bool(), stats=stats, aux=aux)
    saved = []
    try:
        for i, router in enumerate(found):
            saved.append((router, router.__dict__.get("forward")))
            router.forward = _routed_forward(router, state, i)
        yield stats
    finally:
        for router, before in saved:
            if before is None:
                del router.forward
            else:
                router.forward = before


class RoutingRecorder:
    """Records the experts each row of every forward pass of ``model`` was routed to (an
    engine's side of routing replay), through forward hooks on the routers; the model computes
    exactly what it computes without it.

    Use: ``with RoutingRecorder(model) as rec: model(...); routing = rec.take()``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self._pending: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles: list = []

    def __enter__(self) -> "RoutingRecorder":
        def hook(i: int):
            def record(module, args, output):
                self._pending[i] = output[2].detach()
            return record

        self._handles = [r.register_forward_hook(hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def take(self) -> torch.Tensor | None:
        """``[rows, num_moe_layers, top_k]`` int16 (on CPU) of the last forward pass, rows in the
        order the routers saw them (``[B, T]`` flattened row-major), then forgotten; ``None``
        when no pass ran since the last ``take`` (or a layer's router did not run)."""
        if any(p is None for p in self._pending):
            return None
        out = torch.stack([p.to("cpu", torch.int16) for p in self._pending], dim=1)
        self._pending = [None] * len(self.routers)
        return out
