"""Checking a whole update against an engine before any byte of it is written: HF names onto the
engine's parameters (fused shards, tied aliases), coverage, shapes and dtypes."""

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
               tied: dict[str, str] | None):
    # Every problem at once: (mapping, unknown names, names covering a target twice, uncovered).
    engine = set(engine_names)
    packed = packed_modules or {}
    part_to_fused = {part: fused for fused, parts in packed.items() for part in parts}
    tied = tied or {}
    out: dict[str, tuple[str, str | None]] = {}
    covered: dict[tuple[str, str | None], str] = {}
    unknown: list[str] = []
    twice: list[str] = []
    for name in hf_names:
        if name in tied and tied[name] in engine:
            out[name] = (tied[name], "tied")
            continue
        if name in engine:
            target = (name, None)
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
    missing = []
    for e in sorted(engine):
        module, _, leaf = e.rpartition(".")
        fused = module.rsplit(".", 1)[-1]
        if fused in packed and (e, None) not in covered:
            missing += [f"{e}[{p}]" for p in packed[fused] if (e, p) not in covered]
        elif fused not in packed and (e, None) not in covered:
            missing.append(e)
    return out, unknown, twice, missing


def map_to_engine(hf_names: Iterable[str], engine_names: Iterable[str],
                  packed_modules: dict[str, list[str]] | None = None,
                  tied: dict[str, str] | None = None) -> dict[str, tuple[str, str | None]]:
    """Map each Hugging Face weight name onto the engine parameter (and shard) that loads it.

    An engine may fuse HF tensors (vLLM: ``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``,
    ``gate_proj``/``up_proj`` into ``gate_up_proj``; ``packed_modules`` lists them as
    ``{fused: [parts]}``) and may drop a tied output head from its parameters (``tied``:
    ``{hf_name: engine_name}``, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``).
    Names only; ``check_update`` also checks shapes, dtypes and tied tensors.

    Returns:
        ``{hf_name: (engine_name, shard)}``, shard being the part name of a fused parameter,
        ``"tied"`` for a tied alias, or ``None``. Every engine parameter is covered, each shard of
        a fused one exactly once.

    Raises:
        KeyError: an HF name that maps to no engine parameter (named in the message).
        ValueError: an engine parameter (or a shard of one) that no HF name covers, or one
            covered twice (the leftovers are named).
    """
    out, unknown, twice, missing = _map_names(hf_names, engine_names, packed_modules, tied)
    if unknown:
        raise KeyError(f"weight {unknown[0]!r} maps to no parameter of the engine's model")
    if twice:
        raise ValueError(twice[0])
    if missing:
        raise ValueError(f"weight update leaves {len(missing)} engine parameters without a tensor: {missing[:8]}")
    return out


def _few(names: list[str], k: int = 8) -> str:
    return f"{names[:k]}" + (f" and {len(names) - k} more" if len(names) > k else "")


def check_update(sent: Iterable[tuple[str, torch.dtype | str, Sequence[int], str | None]], engine_names: Iterable[str],
                 packed_modules: dict[str, list[str]] | None = None, tied: dict[str, str] | None = None,
                 specs: dict[str, tuple[str, tuple[int, ...]]] | None = None) -> dict[str, tuple[str, str | None]]:
    """Validate a whole weight update against an engine, before any byte of it is written.

    Checks, reporting every problem at once: each name sent once; each name maps to an engine
    parameter (``map_to_engine``: fused shards, tied aliases); every engine
    parameter (each shard of a fused one) is covered exactly once; each tensor's shape equals the
    engine's for that name and its dtype converts to the engine's (``converts_to``); a tied
    parameter gets at most one tensor of its own (its other names must be aliases of it).

    Args:
        sent: ``(name, dtype, shape, alias_of)`` of every tensor of the update: the dtype as a
            ``torch.dtype`` or its wire name, the full (unsharded) shape, and ``alias_of`` the
            name whose bytes an alias shares (``None`` for a tensor of its own).
        engine_names, packed_modules, tied: the engine's parameter names, fused modules and tied
            aliases, as for ``map_to_engine``.
        specs: ``{HF name: (dtype name, full shape)}`` the engine loads under each name it accepts
            (fused parts and tied aliases included); a name missing here gets no shape or dtype
            check, ``None`` skips them all.

    Returns:
        ``map_to_engine``'s mapping of the names sent.

    Raises:
        UnknownWeightError: (a ``KeyError``) names that map to no engine parameter; the message
            also lists any other problem.
        WeightUpdateError: (a ``ValueError``) anything else: a name listed twice, an engine
            parameter left without a tensor or loaded twice, a shape or dtype mismatch (``'name':
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
    out, unknown, twice, missing = _map_names(dict.fromkeys(names), engine_names, packed_modules, tied)
    if unknown:
        problems.append(f"unknown weights (no engine parameter loads them): {_few(unknown)}")
    problems += twice[:8]
    if missing:
        problems.append(f"left {len(missing)} parameters unchanged (engine parameters without a tensor): "
                        f"{_few(missing)}")
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
