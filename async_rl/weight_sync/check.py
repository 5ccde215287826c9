"""Checking a whole update against an engine before any byte of it is written: HF names onto the
engine's parameters (fused shards, tied aliases, per-expert weights of a fused expert stack),
coverage, shapes and dtypes."""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence

import torch

from async_rl.weight_sync.plan import DTYPES, converts_to, dtype_name


class WeightUpdateError(ValueError):
    """A weight update refused before any byte of it was written; the message (one line) names
    every offending weight and what was wrong with it."""


class UnknownWeightError(WeightUpdateError, KeyError):
    """A ``WeightUpdateError`` whose update carries names the engine has no parameter for (also
    a ``KeyError``, what a lookup by an unknown name raises)."""

    def __str__(self) -> str:
        # KeyError's own __str__ quotes its argument as if it were the missing key.
        return str(self.args[0]) if self.args else ""


def _map_names(hf_names: Iterable[str], engine_names: Iterable[str], packed_modules: dict[str, list[str]] | None,
               tied: dict[str, str] | None, experts: dict[str, tuple[str, str]] | None = None):
    # Every problem at once: (mapping, unknown names, names covering a target twice, uncovered
    # engine parameters or shards, per-expert HF names an expert stack still lacks).
    engine = set(engine_names)
    packed = packed_modules or {}
    part_to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    tied = tied or {}
    # Tuples: a table that crossed a process boundary (vLLM's RPC) arrives with lists.
    experts = {n: (t[0], t[1]) for n, t in (experts or {}).items() if t[0] in engine}
    # An expert stack is whole only when every one of its per-expert tensors arrived.
    stack_parts: dict[str, list[tuple[str, str]]] = {}
    for hf, (stack, shard) in experts.items():
        stack_parts.setdefault(stack, []).append((shard, hf))
    out: dict[str, tuple[str, str | None]] = {}
    covered: dict[tuple[str, str | None], str] = {}
    unknown: list[str] = []
    twice: list[str] = []
    for name in hf_names:
        if name in tied and tied[name] in engine:
            out[name] = (tied[name], "tied")
            continue
        if name in engine and name not in stack_parts:
            target = (name, None)
        elif name in experts:
            target = experts[name]
        else:
            target = None
            parts = name.split(".")
            for i, p in enumerate(parts):
                if p in part_to_fused:
                    fused = ".".join(parts[:i] + [part_to_fused[p]] + parts[i + 1 :])
                    if fused in engine:
                        target = (fused, p)
                    break
            if target is None:
                unknown.append(name)
                continue
        if target in covered:
            twice.append(f"weights {covered[target]!r} and {name!r} both load engine parameter {target[0]!r}"
                         + (f" shard {target[1]!r}" if target[1] else ""))
            continue
        covered[target] = name
        out[name] = target
    missing, experts_missing = [], []
    for e in sorted(engine):
        module, _, leaf = e.rpartition(".")
        fused = module.rsplit(".", 1)[-1]
        if e in stack_parts:
            # Named by the per-expert tensors left out: what the sender has to add.
            experts_missing += [hf for shard, hf in stack_parts[e] if (e, shard) not in covered]
        elif fused in packed and (e, None) not in covered:
            missing += [f"{e}[{p}]" for p in packed[fused] if (e, p) not in covered]
        elif fused not in packed and (e, None) not in covered:
            missing.append(e)
    return out, unknown, twice, missing, experts_missing


def _stack_gap(experts_missing: list[str], experts: dict[str, tuple[str, str]]) -> str:
    stacks = sorted({experts[n][0] for n in experts_missing})
    return (f"left {len(experts_missing)} expert weights unsent, so {len(stacks)} expert stacks would not be wholly "
            f"updated ({_few(stacks, 4)}): {_few(experts_missing)}")


def _expert_hint(unknown: list[str], experts: dict[str, tuple[str, str]] | None) -> str:
    # A stacked expert tensor (transformers 5's ``mlp.experts.gate_up_proj``) where the engine
    # takes one tensor per expert: say which names it takes instead.
    if not experts or not any(".experts." in n for n in unknown):
        return ""
    example = next(iter(experts))
    return (f" (this engine loads experts one tensor per expert and projection, as the checkpoint names them: "
            f"{example!r})")


def map_to_engine(hf_names: Iterable[str], engine_names: Iterable[str],
                  packed_modules: dict[str, list[str]] | None = None,
                  tied: dict[str, str] | None = None,
                  experts: dict[str, tuple[str, str]] | None = None) -> dict[str, tuple[str, str | None]]:
    """Map each Hugging Face weight name onto the engine parameter (and shard) that loads it.

    An engine may fuse HF tensors (vLLM: ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
    ``gate_proj``/``up_proj`` into ``gate_up_proj``; ``packed_modules`` lists them as
    ``{fused: [parts]}``), may drop a tied output head from its parameters (``tied``:
    ``{hf_name: engine_name}``, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``) and
    may stack a mixture-of-experts layer's experts into one parameter per projection group
    (``experts``: ``{per-expert HF name: (engine stack, shard)}``, e.g.
    ``"model.layers.0.mlp.experts.3.up_proj.weight"`` -> ``("model.layers.0.mlp.experts.
    routed_experts.w13_weight", "experts.3.up_proj")``; vLLM: ``async_rl.generators.vllm.worker.
    engine_expert_names``). Names only; ``check_update`` also checks shapes, dtypes and tied tensors.

    Returns:
        ``{hf_name: (engine_name, shard)}``, shard being the part name of a fused parameter (for
        an expert stack, the expert's part as in ``experts``), ``"tied"`` for a tied alias, or
        ``None``. Every engine parameter is covered, each shard of a fused one (each expert's
        projection of a stack) exactly once.

    Raises:
        KeyError: an HF name that maps to no engine parameter (named in the message).
        ValueError: an engine parameter (or a shard of one, or an expert's projection of a
            stack, named by its HF name) that no HF name covers, or one covered twice (the
            leftovers are named).
    """
    out, unknown, twice, missing, experts_missing = _map_names(hf_names, engine_names, packed_modules, tied,
                                                               experts)
    if unknown:
        raise KeyError(f"weight {unknown[0]!r} maps to no parameter of the engine's model"
                       + _expert_hint(unknown, experts))
    if twice:
        raise ValueError(twice[0])
    if missing:
        raise ValueError(f"weight update leaves {len(missing)} engine parameters without a tensor: {missing[:8]}")
    if experts_missing:
        raise ValueError(f"weight update {_stack_gap(experts_missing, experts)}")
    return out


def _few(names: list[str], k: int = 8) -> str:
    return f"{names[:k]}" + (f" and {len(names) - k} more" if len(names) > k else "")


def check_update(sent: Iterable[tuple[str, torch.dtype | str, Sequence[int], str | None]], engine_names: Iterable[str],
                 packed_modules: dict[str, list[str]] | None = None, tied: dict[str, str] | None = None,
                 specs: dict[str, tuple[str, tuple[int, ...]]] | None = None,
                 experts: dict[str, tuple[str, str]] | None = None) -> dict[str, tuple[str, str | None]]:
    """Validate a whole weight update against an engine, before any byte of it is written.

    Checks, reporting every problem at once: each name sent once; each name maps to an engine
    parameter (``map_to_engine``: fused shards, tied aliases, per-expert weights of an expert
    stack); every engine parameter (each shard of a fused one, each expert's projection of an
    expert stack) is covered exactly once, so a stack counts as updated only when every expert
    arrived; each tensor's shape equals the
    engine's for that name and its dtype converts to the engine's (``converts_to``); a tied
    parameter gets at most one tensor of its own (its other names must be aliases of it).

    Args:
        sent: ``(name, dtype, shape, alias_of)`` of every tensor of the update: the dtype as a
            ``torch.dtype`` or its wire name, the full (unsharded) shape, and ``alias_of`` the
            name whose bytes an alias shares (``None`` for a tensor of its own).
        engine_names, packed_modules, tied, experts: the engine's parameter names, fused
            modules, tied aliases and per-expert names of its expert stacks, as for
            ``map_to_engine``.
        specs: ``{HF name: (dtype name, full shape)}`` the engine loads under each name it accepts
            (fused parts and tied aliases included); a name missing here gets no shape or dtype
            check, ``None`` skips them all.

    Returns:
        ``map_to_engine``'s mapping of the names sent.

    Raises:
        UnknownWeightError: (a ``KeyError``) names that map to no engine parameter; the message
            also lists any other problem.
        WeightUpdateError: (a ``ValueError``) anything else: a name listed twice, an engine
            parameter left without a tensor or loaded twice (an expert stack missing some
            expert's projection: the per-expert HF names left out are listed), a shape or dtype mismatch (``'name':
            got (384, 128), engine expects (128, 384)``), two tensors for one tied parameter.
    """
    sent = [(n, dt if isinstance(dt, str) else dtype_name(dt), tuple(int(x) for x in shape), alias)
            for n, dt, shape, alias in sent]
    tied = tied or {}
    problems: list[str] = []
    names = [n for n, *_ in sent]
    dup = sorted(n for n, k in Counter(names).items() if k > 1)
    if dup:
        problems.append(f"listed twice: {_few(dup)}")
    out, unknown, twice, missing, experts_missing = _map_names(dict.fromkeys(names), engine_names, packed_modules,
                                                               tied, experts)
    if unknown:
        problems.append(f"unknown weights (no engine parameter loads them): {_few(unknown)}"
                        + _expert_hint(unknown, experts))
    problems += twice[:8]
    if missing:
        problems.append(f"left {len(missing)} parameters unchanged (engine parameters without a tensor): "
                        f"{_few(missing)}")
    if experts_missing:
        problems.append(_stack_gap(experts_missing, experts))
    aliases = {n: a for n, _, _, a in sent if a is not None}
    for alias, target in tied.items():
        if alias in out and target in out and aliases.get(alias) != target and aliases.get(target) != alias:
            problems.append(f"{alias!r} and {target!r} are one tied engine parameter but were sent as two "
                            f"tensors (send one, the other as its alias)")
    shapes, dtypes = [], []
    for name, dt, shape, _ in sent:
        spec = (specs or {}).get(name)
        if spec is None or name not in out:
            continue
        want_dtype, want_shape = spec[0], tuple(spec[1])
        if shape != want_shape:
            shapes.append(f"{name!r} got {shape}, engine expects {want_shape}")
        if not converts_to(dt, want_dtype):
            why = "the wire does not carry it" if dt not in DTYPES else "only floating-point weights convert"
            dtypes.append(f"{name!r} got {dt}, engine holds {want_dtype} ({why})")
    for what, found in (("wrong shape", shapes), ("wrong dtype", dtypes)):
        if found:
            problems.append(f"{what}: " + "; ".join(found[:8]) + (f" and {len(found) - 8} more" if len(found) > 8 else ""))
    if problems:
        cls = UnknownWeightError if unknown else WeightUpdateError
        raise cls("weight update refused before any byte was written: " + " | ".join(problems))
    return out
