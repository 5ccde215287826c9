"""Routing replay for the Megatron learner's MoE layers (R3: Ma et al. 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers"), and a recorder of the
routing a forward pass used.

The inference engine records, per token, the experts each MoE layer sent it to; replaying them in
the learner's forward removes the largest source of train-inference mismatch in MoE RL. The
learner's router still computes its logits and still gets a gradient: the gating weights are its
own, at the replayed experts (for Qwen3-MoE's ``norm_topk_prob``: the softmax over the router
logits of those k experts, i.e. the full softmax renormalised over them).

megatron-core 0.16.1 has a router-replay hook (``transformer/moe/router_replay.py``,
``RouterReplay``, enabled by ``TransformerConfig.moe_enable_routing_replay``): each ``TopKRouter``
gets a ``router_replay`` object whose ``get_replay_topk(scores, topk, num_groups, group_topk,
default_compute_topk)`` replaces the top-k selection inside ``topk_routing_with_score_function``
(``moe_utils.py:700-706``); in ``REPLAY_FORWARD`` mode it gathers ``scores`` at the target indices
(``router_replay.py:146-152``), and with ``moe_router_pre_softmax=False`` (our Qwen3-MoE mapping)
megatron then takes the softmax of those gathered logits: exactly R3's gating. Its instances go
into a class-level list that grows with every model built in the process (policy, reference,
critic) and is addressed by position, and it replays whole layers only (no per-token "not
recorded"). So this module keeps megatron's hook (the same ``get_replay_topk`` interface on each
router's ``router_replay`` attribute) but sets it per model, for the duration of a ``with`` block,
with per-token fallback to the learner's own routing where the engine recorded nothing (-1).

Token order: a router sees the hidden states ``[s, b, h]`` flattened to ``[s * b, E]`` logits
(``TopKRouter.routing``), so token ``(row i, position t)`` is router row ``t * b + i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


def stage_routers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(global layer index, TopKRouter)`` of every MoE layer of this pipeline stage, in layer order."""
    from megatron.core.transformer.moe.router import TopKRouter

    out = []
    for layer in getattr(getattr(model, "decoder", None), "layers", []):
        router = getattr(getattr(layer, "mlp", None), "router", None)
        if isinstance(router, TopKRouter):
            out.append((layer.layer_number - 1, router))
    return out


class _TokenReplay:
    """megatron's ``RouterReplay.get_replay_topk`` interface: the given experts where recorded (and
    ``replay``), the router's own top-k elsewhere; with ``stats``, the router's statistics.

    Args:
        target: ``[tokens, k]`` int64 expert ids in the router's token order; a row with any -1 is
            routed by the router itself. ``None``: nothing recorded.
        replay: use the recorded experts (``False``: only compare the router's own with them).
        stats: an ``async_rl.utils.moe.RouterStats`` to add this layer's load and agreement to,
            or ``None``.
        layer: the layer's row in ``stats.load``.
        real: ``[tokens]`` bool, the tokens that count in the statistics (not padding), or ``None``: all.
    """

    def __init__(self, target: torch.Tensor | None, replay: bool = True, stats=None, layer: int = 0,
                 real: torch.Tensor | None = None) -> None:
        self.target, self.replay, self.stats, self.layer, self.real = target, replay, stats, layer, real

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores at the chosen experts [tokens, k], chosen experts [tokens, k] int64)``."""
        own_scores, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        out_scores, chosen = own_scores, own
        if self.target is not None:
            target = self.target.to(scores.device)
            if tuple(target.shape) != tuple(own.shape):
                raise ValueError(f"routing replay: the router has {tuple(own.shape)} (tokens, top_k) picks, the "
                                 f"replayed experts are {tuple(target.shape)}")
            recorded = (target >= 0).all(dim=1, keepdim=True)
            if self.replay:
                chosen = torch.where(recorded, target, own)
                # Gathered from the live scores, so the router's gradient flows through the replayed picks.
                out_scores = torch.where(recorded, scores.gather(1, chosen.clamp(min=0)), own_scores)
            if self.stats is not None:
                with torch.no_grad():
                    counted = recorded[:, 0] if self.real is None else recorded[:, 0] & self.real.to(own.device)
                    hits = (target.unsqueeze(-1) == own.unsqueeze(-2)).any(-1).sum(-1)
                    self.stats.recorded += int(counted.sum())
                    self.stats.agreeing += int(hits[counted].sum())
        if self.stats is not None:
            with torch.no_grad():
                used = chosen if self.real is None else chosen[self.real.to(own.device)]
                self.stats.load[self.layer] += torch.bincount(used.reshape(-1).cpu(),
                                                              minlength=self.stats.num_experts)
        return out_scores, chosen


def _check(routed_experts: torch.Tensor, routers: list, model: nn.Module) -> None:
    """ValueError for a ``routed_experts`` that cannot be this model's."""
    if routed_experts.dtype not in (torch.int64, torch.int32) or routed_experts.dim() != 4:
        raise ValueError(f"routed_experts must be an int64 tensor [B, L, num_moe_layers, top_k], got "
                         f"{routed_experts.dtype} {tuple(routed_experts.shape)}")
    cfg = model.config
    layers_needed = max(layer for layer, _ in routers) + 1
    if routed_experts.shape[2] < layers_needed or routed_experts.shape[3] != cfg.moe_router_topk:
        raise ValueError(f"routed_experts has {routed_experts.shape[2]} layers x top {routed_experts.shape[3]}; "
                         f"the model needs >= {layers_needed} layers x top {cfg.moe_router_topk}")
    low, high = int(routed_experts.min()), int(routed_experts.max())
    if low < -1 or high >= cfg.num_moe_experts:
        raise ValueError(f"routed_experts holds expert ids in [{low}, {high}]; valid: -1 (not recorded) and "
                         f"0..{cfg.num_moe_experts - 1}")


@contextlib.contextmanager
def routing_replay(model: nn.Module, routed_experts: torch.Tensor | None, replay: bool = True, stats=None,
                   real: torch.Tensor | None = None) -> Iterator[None]:
    """Within the block, ``model``'s MoE layers route each token to the experts ``routed_experts`` gives.

    Args:
        model: a ``GPTModel`` (this rank's pipeline stage) with MoE layers (``build_model``).
        routed_experts: ``[B, L, num_moe_layers, top_k]`` int64 (int32 accepted), aligned with the
            forward's ``input_ids`` ``[B, L]`` rows as passed to the model (packed rows: pack it the
            same way); entry ``[i, t, layer]`` = the experts of input token ``t`` of row ``i`` in
            MoE layer ``layer`` (model layer order, global index: every Qwen3-MoE layer is sparse);
            ``-1`` anywhere in a token's ``top_k`` = not recorded: that token is routed by the
            router itself in that layer. ``None``: no replay.
            Its ``[B, L]`` must equal the forward's batch shape; every forward inside the block
            uses it (proximal, current and reference passes of one micro-batch).
        replay: use the recorded experts; ``False``: route as the router does and only compare
            (``stats``).
        stats: an ``async_rl.utils.moe.RouterStats`` (``load`` rows indexed by global MoE layer)
            the block's passes add the per-expert load and the agreement with ``routed_experts``
            to; ``None``: none taken. With neither replay nor statistics the block changes nothing.
        real: ``[B, L]`` bool, the tokens the statistics count (not padding); ``None``: all.

    Gating weights are the router's own at the given experts (``moe_router_pre_softmax=False``:
    softmax over those k logits, Qwen3-MoE's ``norm_topk_prob``; ``True``: the full-softmax
    probabilities at them), so the router keeps its gradient. Order within a token's ``top_k``
    does not matter.

    Raises:
        ValueError: ``model`` has no MoE layer; ``routed_experts`` has the wrong dtype, rank, layer
            count, top-k, or expert ids outside ``[-1, E)``; (at forward time) its ``B * L`` is not
            the forward's token count.
    """
    if (routed_experts is None or not replay) and stats is None:
        yield
        return
    routers = stage_routers(model)
    if not routers:
        raise ValueError("routing replay needs a mixture-of-experts model; this one has no MoE layer")
    if routed_experts is not None:
        _check(routed_experts, routers, model)
    # [B, L] -> the router's [L * B] token order (sequence-major).
    order = (lambda t: t.transpose(0, 1).reshape(-1, *t.shape[2:]))  # noqa: E731
    saved = [router.router_replay for _, router in routers]
    try:
        for layer, router in routers:
            target = None if routed_experts is None else order(routed_experts[:, :, layer, :].long())
            router.router_replay = _TokenReplay(target, replay=replay, stats=stats, layer=layer,
                                                real=None if real is None else order(real.bool()))
        yield
    finally:
        for (_, router), before in zip(routers, saved):
            router.router_replay = before


@contextlib.contextmanager
def recorded_routing(model: nn.Module, rows: int) -> Iterator[dict[int, torch.Tensor]]:
    """Record the experts every MoE layer of ``model`` used in the forward passes inside the block.

    Args:
        model: a ``GPTModel`` stage with MoE layers.
        rows: ``B``, the forward's batch size (to turn the router's ``[L * B]`` tokens back into rows).

    Yields:
        A dict filled as forwards run: global layer index -> ``[B, L, top_k]`` int64 expert ids of
        the last forward, sorted ascending per token (the routing map has no order within a token).

    Raises:
        ValueError: ``model`` has no MoE layer.
    """
    routers = stage_routers(model)
    if not routers:
        raise ValueError("recorded_routing needs a mixture-of-experts model; this one has no MoE layer")
    seen: dict[int, torch.Tensor] = {}
    handles = []

    def hook(layer: int):
        def record(_module, _inputs, output) -> None:
            routing_map = output[1].detach()  # [L * B, E] bool
            k = int(routing_map[0].sum())
            experts = routing_map.nonzero()[:, 1].reshape(-1, k)  # row-major: ascending per token
            seen[layer] = experts.reshape(-1, rows, k).transpose(0, 1).contiguous()
        return record

    for layer, router in routers:
        handles.append(router.register_forward_hook(hook(layer)))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


__all__ = ["recorded_routing", "routing_replay", "stage_routers"]
