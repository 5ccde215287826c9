"""Hugging Face transformers generator: sampling with ``model.generate`` on CPU or GPU.

Sampling is done by our own last logits processor (``_StepHook``), and ``generate`` runs in
greedy mode so it simply appends the token the hook chose. The hook, once per decoding step:

* warps the logits exactly as the sampler's distribution is defined (temperature, then
  transformers' own top-k and top-p warpers) and draws each row's token from that row's own
  ``torch.Generator`` (inverse-CDF on one uniform per row). A row's tokens thus depend only on its
  seed and the weights, not on batch composition or order: the same group sampled alone or inside
  a batch, by one generator actor or another, gets the same tokens (up to float noise in the
  logits). This is what makes async mode with ``max_staleness: 0`` reproduce sync mode;
* records the behavior log-prob of the chosen token under that distribution (with temperature
  only it equals ``log_softmax(logits / T)``, exactly what the learner recomputes) and the policy
  version of the weights that computed the logits;
* hands finished rows to an ``on_sample`` callback at once, so a pool can stream them;
* stops the batch once ``generator.compact_batches`` of its rows have finished, and goes on
  with the unfinished ones (prompt + tokens so far, one prefill): ``model.generate`` alone keeps
  a finished row in every forward until the longest row ends;
* applies weights staged by ``update_weights`` from another thread between two decoding steps
  (``partial_rollout: keep``: in-flight rows continue on the new weights, their KV cache keeps
  the old prefix, and later tokens carry the new version), or stops the batch
  (``partial_rollout: abort``) so the unfinished rows are re-issued with their partial tokens as
  prompt extension after the new weights are loaded (a fresh KV cache under the new weights).
  Both are the in-flight update modes of PipelineRL (arXiv 2509.19128) and AReaL (2505.24298).

Weight updates are all or nothing (``async_rl.weight_sync``'s *All or nothing*): checked whole
before any write, staged, then written (``update_weights``) or swapped in (``receive_weights``)
at one step boundary; a write that fails midway (a device fault) leaves an engine that refuses
to sample until a complete update succeeds.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from async_rl.generators.base import GeneratorConfig, Sample, SamplingParams, check_request, row_seeds
from async_rl.utils.vision import (check_images, image_kwargs, image_token_id, input_only_token_ids, load_policy_model,
                                   suppress_input_only)
from async_rl.generators.capabilities import EngineCapabilities
from async_rl.utils.lora import adapter_parameters, lora_enabled, wrap


def _param_table(model: torch.nn.Module | Mapping[str, torch.nn.Parameter]):
    # (every name an update may carry -> parameter, canonical names, {tied name: canonical},
    # {checkpoint name: its Piece} for parameters kept in another layout than the checkpoint's).
    # A module's stacked experts load under their checkpoint names (``async_rl.weight_sync.layout``).
    pieces = {}
    if isinstance(model, torch.nn.Module):
        params = dict(model.named_parameters(remove_duplicate=False))
        canonical = {id(p): name for name, p in model.named_parameters()}
        layout = _layout_of(model)
        for name, owned in layout.pieces.items():
            p = params.pop(name)
            del canonical[id(p)]
            for piece in owned:
                params[piece.name] = p
                pieces[piece.name] = piece
            if len(owned) == 1:
                # Renamed whole (a vision-language model's language_model.embed_tokens is the
                # checkpoint's model.embed_tokens): a tied alias of it points at the new name.
                canonical[id(p)] = owned[0].name
    else:
        params = dict(model)
        canonical = {}
        for name, p in params.items():
            canonical.setdefault(id(p), name)
    tied = {n: canonical[id(p)] for n, p in params.items() if n not in pieces and canonical[id(p)] != n}
    return params, [n for n in params if n in pieces or canonical.get(id(params[n])) == n], tied, pieces


_LAYOUTS: "weakref.WeakKeyDictionary[torch.nn.Module, object]" = weakref.WeakKeyDictionary()


def _layout_of(model: torch.nn.Module):
    # Computed once per module: it reads only names and shapes, which an update never changes.
    from async_rl.weight_sync.layout import CheckpointLayout

    layout = _LAYOUTS.get(model)
    if layout is None:
        layout = _LAYOUTS[model] = CheckpointLayout(model)
    return layout


def _specs(params: Mapping[str, torch.nn.Parameter], pieces: Mapping) -> dict[str, tuple[str, tuple[int, ...]]]:
    # {name: (dtype name, shape)}: a checkpoint piece has its own shape, its parameter's dtype.
    return {n: (str(p.dtype).removeprefix("torch."), pieces[n].shape if n in pieces else tuple(p.shape))
            for n, p in params.items()}


def _stage(staged: dict, p: torch.nn.Parameter, name: str, t: torch.Tensor, pieces: Mapping,
           spare: dict | None = None) -> None:
    # Stage tensor ``t`` sent under ``name`` for parameter ``p``: the whole parameter, or one
    # checkpoint piece written into a staging tensor of the whole parameter (every piece of it
    # arrives: the update's coverage was checked).
    piece = pieces.get(name)
    if piece is None and spare is None:
        staged[id(p)] = (p, t.detach().to(dtype=p.dtype, device=p.device))
        return
    entry = staged.get(id(p))
    if entry is None:
        buf = spare.pop(id(p), None) if spare is not None else None
        if buf is None or buf.shape != p.shape or buf.dtype != p.dtype or buf.device != p.device:
            buf = torch.empty(p.shape, dtype=p.dtype, device=p.device)
        entry = staged[id(p)] = (p, buf)
    if piece is None:
        entry[1].copy_(t)  # converts to the parameter's dtype
    else:
        piece.put(entry[1], t)


def stage_named_weights(model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
                        named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Validate a whole update against ``model`` and convert it, writing nothing.

    The update is checked as a whole first (``async_rl.weight_sync.check_update``: every name a
    parameter of ``model``, every parameter covered, each shape equal to its
    parameter's, each dtype convertible under ``converts_to``); tied names (``lm_head.weight``
    aliasing ``model.embed_tokens.weight``) may both be sent only with equal tensors. A parameter
    transformers keeps in another layout than its checkpoint (a mixture-of-experts layer's
    stacked experts) is sent under its checkpoint names, one tensor per expert
    (``async_rl.weight_sync.layout``), and staged whole from them. Then each tensor is converted
    to its parameter's dtype and device (no copy where none is needed: the caller's tensors must
    stay unchanged until ``write_staged``).

    Args:
        model: a module, or ``{name: parameter}`` (LoRA: ``async_rl.utils.lora.adapter_parameters``).
        named_tensors: ``(name, tensor)`` by Hugging Face checkpoint name; consumed entirely
            before any check.

    Returns:
        ``(parameter, tensor)`` pairs ready for ``write_staged`` (each tied parameter once).

    Raises:
        async_rl.weight_sync.UnknownWeightError: (a ``KeyError``) a name that is not a parameter.
        async_rl.weight_sync.WeightUpdateError: (a ``ValueError``) parameters left without a
            tensor, a shape or dtype mismatch, two different tensors for one tied parameter.
    """
    from async_rl.weight_sync import check_update

    params, names, tied, pieces = _param_table(model)
    named = list(named_tensors)
    by_name = dict(named)
    sent = []
    for name, t in named:
        alias = None
        target = tied.get(name)
        other = by_name.get(target) if target is not None else None
        # One tied parameter sent twice: fine when the two are the same values (an alias).
        if other is not None and other.shape == t.shape and other.dtype == t.dtype and (
                other.data_ptr() == t.data_ptr() or torch.equal(other, t.to(other.device))):
            alias = target
        sent.append((name, t.dtype, tuple(t.shape), alias))
    check_update(sent, names, {}, tied, _specs(params, pieces))
    staged: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
    for name, t in named:
        _stage(staged, params[name], name, t, pieces)
    return list(staged.values())


def write_staged(staged: Iterable[tuple[torch.nn.Parameter, torch.Tensor]]) -> int:
    """Copy staged tensors (``stage_named_weights``) into their parameters; returns bytes written.

    Same shapes, dtypes and devices by construction, so only a device fault can stop it midway;
    then the parameters before it hold the new values and the caller must not sample from the
    model until a complete update (``HFGenerator`` marks itself unusable).
    """
    nbytes = 0
    with torch.no_grad():
        for param, t in staged:
            param.copy_(t)
            nbytes += t.numel() * t.element_size()
    return nbytes


def load_named_weights(model: torch.nn.Module | Mapping[str, torch.nn.Parameter],
                       named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy tensors into ``model``'s parameters by Hugging Face name, in place, all or nothing.

    The whole update is validated and converted to each parameter's dtype (``stage_named_weights``)
    before the first parameter is written, so a refused update leaves ``model`` untouched. Tied
    parameters may arrive under any of their names (for example ``lm_head.weight`` aliasing
    ``model.embed_tokens.weight``). ``model`` may also be a ``{name: parameter}`` mapping: the
    parameters an update targets (LoRA: the adapter matrices under their sync names,
    ``async_rl.utils.lora.adapter_parameters``).

    Returns:
        The number of bytes written (in the parameters' dtypes).

    Raises:
        KeyError: a name that is not a parameter of ``model`` (named in the message).
        ValueError: parameters that no tensor updated (listed), a shape or
            dtype mismatch (expected against got), two different tensors for one tied parameter.
    """
    return write_staged(stage_named_weights(model, named_tensors))


@dataclass
class _Row:
    """Per-row decoding state (one response being sampled)."""

    index: int
    prompt: list[int]
    rng: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    images: Any = None
    """The prompt's ``ImageInputs`` (``async_rl.data.images``), or ``None``."""
    routing: list[torch.Tensor] = field(default_factory=list)
    """``[tokens, num_moe_layers, top_k]`` int16 pieces of the experts each forwarded token was
    routed to (``SamplingParams.return_routed_experts``): the context's at the batch's prefill,
    then one row per decoding step."""
    done: bool = False
    finish_reason: str = ""


MIN_COMPACT_ROWS = 4
"""Smallest decoding batch that ``generator.compact_batches`` restarts with its unfinished rows."""


class _StepHook:
    """The last logits processor and the stopping criterion of one ``generate`` call (see the
    module docstring). ``rows`` are the live rows of the batch, in batch order."""

    def __init__(self, gen: "HFGenerator", rows: list[_Row], params: SamplingParams,
                 on_finish: Callable[[_Row], None]) -> None:
        from transformers import TopKLogitsWarper, TopPLogitsWarper

        self.gen, self.rows, self.params, self.on_finish = gen, rows, params, on_finish
        self.stops = set(params.stop_token_ids)
        self.warpers = []
        if not params.greedy and params.top_k > 0:
            self.warpers.append(TopKLogitsWarper(params.top_k))
        if not params.greedy and params.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(params.top_p))
        self.recorder = None
        """``RoutingRecorder`` of the batch's forward passes (``return_routed_experts``), set by
        the caller."""
        self.prefill = True
        self.abort = False
        self.compact = False
        """Stop the batch to go on with its unfinished rows (``generator.compact_batches``)."""
        # A batch of a few rows runs to its end: restarting it would cost a prefill to save
        # almost nothing (a step's cost barely depends on so few rows).
        self._compact_at = max(1, int(gen.cfg.compact_batches * len(rows) + 0.5)) \
            if gen.cfg.compact_batches < 1 and len(rows) >= MIN_COMPACT_ROWS else len(rows)
        self._num_done = sum(r.done for r in rows)

    def _record_routing(self) -> None:
        # The routers' picks of the forward pass that made these logits: the whole left-padded
        # context at the prefill (a row's real tokens are its last ones), then the one token fed.
        routing = self.recorder.take()
        if routing is None:
            return
        routing = routing.view(len(self.rows), -1, *routing.shape[1:])
        for b, r in enumerate(self.rows):
            if r.done:
                continue
            if self.prefill:
                r.routing = [routing[b, routing.shape[1] - len(r.prompt) - len(r.tokens):].clone()]
            else:
                r.routing.append(routing[b, -1:].clone())
        self.prefill = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.recorder is not None:
            self._record_routing()
        # -inf: a zero-probability token reached through round-off at the CDF's edge is caught below.
        logits = suppress_input_only(scores.float(), self.gen.input_only, float("-inf"))
        if not self.params.greedy:
            logits = logits / self.params.temperature
            for warp in self.warpers:
                logits = warp(input_ids, logits)
        logprobs = torch.log_softmax(logits, dim=-1)
        if self.params.greedy:
            chosen = logprobs.argmax(dim=-1)
        else:
            # One uniform per live row from that row's generator: batch-invariant sampling.
            u = torch.stack([torch.rand((), generator=r.rng) if not r.done else torch.zeros(()) for r in self.rows])
            cdf = logprobs.exp().cumsum(dim=-1)
            chosen = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1).to(cdf.device)).squeeze(-1)
            chosen = chosen.clamp(max=logits.shape[-1] - 1)
            # A zero-probability token can only be hit through float round-off at the CDF's edge.
            dead = torch.isinf(logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1))
            if bool(dead.any()):
                chosen = torch.where(dead, logprobs.argmax(dim=-1), chosen)
        chosen_lp = logprobs.gather(-1, chosen.unsqueeze(-1)).squeeze(-1).cpu()
        chosen_cpu = chosen.cpu()
        version = self.gen.policy_version
        tops = None
        if self.params.top_logprobs > 0:
            k = min(self.params.top_logprobs, logprobs.shape[-1])
            values, ids = logprobs.topk(k, dim=-1)
            tops = [list(zip(i, v)) for i, v in zip(ids.cpu().tolist(), values.cpu().tolist())]
        for b, (r, tok, lp) in enumerate(zip(self.rows, chosen_cpu.tolist(), chosen_lp.tolist())):
            if r.done:
                continue
            if tops is not None:
                r.top.append(tops[b])
            r.tokens.append(tok)
            r.logprobs.append(lp)
            r.versions.append(version)
            if tok in self.stops or len(r.tokens) >= self.params.max_tokens:
                r.done = True
                r.finish_reason = "stop" if tok in self.stops else "length"
                self._num_done += 1
                self.on_finish(r)
        # Enough rows finished (and some still live): the rest go on in a smaller batch.
        self.compact = self._compact_at <= self._num_done < len(self.rows)
        # Token t was computed with the weights of `version`; new weights apply from token t + 1.
        if self.gen._pending is not None:
            if self.gen.cfg.partial_rollout == "keep":
                self.gen._apply_pending(in_flight=True)
                # Half-written weights: not one more token from them (generate raises).
                self.abort = self.gen._unusable is not None
            else:
                self.abort = True
        out = torch.full_like(scores, float("-inf"))
        out.scatter_(-1, chosen.unsqueeze(-1), 0.0)
        return out


class _AbortCriteria:
    """Stopping criterion that ends the whole batch once the hook asked to abort for new weights,
    or to compact it (``generator.compact_batches``)."""

    def __init__(self, hook: _StepHook) -> None:
        self.hook = hook

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.hook.abort or self.hook.compact, dtype=torch.bool,
                          device=input_ids.device)


class HFGenerator:
    """A ``transformers`` causal LM used as a rollout engine.

    Args:
        model_path: Hugging Face model directory.
        cfg: generator settings (batch size, seed, partial-rollout mode, threads).
        pad_token_id: id used for left padding of prompts.
        device: torch device string (``make_generator`` passes ``generator.hf.device`` when its
            caller names none); the weights are held in ``generator.hf.dtype``.
        lora: the learner's ``LoRAConfig``; with ``rank > 0`` the model is wrapped with the same
            peft adapters (initialised as peft does, so the engine starts as the base model) and
            weight updates carry exactly the adapter matrices (``async_rl.utils.lora``); ``None`` = none.

    The model runs in eval mode under ``torch.inference_mode``. Sampling uses per-row generators
    seeded from the caller's seeds (or from ``cfg.seed`` and a call counter), never the global RNG,
    so a generator never disturbs the learner's RNG in colocated mode and a run is reproducible.
    ``update_weights`` may be called from another thread while ``generate`` runs: the weights are
    staged and applied between two decoding steps, and the call returns once they are in use.
    """

    # Decodes on the caller's threads, in its process: it can be the learner's colocated engine.
    capabilities = EngineCapabilities(name="HF", colocated=True, separate_processes=False, device_key="hf.device",
                                      records_routing=True, serves_images=True)

    def __init__(self, model_path: str, cfg: GeneratorConfig, pad_token_id: int, device: str = "cpu",
                 lora=None) -> None:
        self.cfg = cfg
        self.device = torch.device(device)
        model = load_policy_model(model_path, dtype=getattr(torch, cfg.hf.dtype))
        self.image_token_id: int | None = image_token_id(model.config)
        """The vision-language model's image placeholder id; ``None`` for a text model."""
        suppressed = input_only_token_ids(model.config)
        self.input_only = torch.tensor(suppressed, dtype=torch.long, device=self.device) if suppressed else None
        """Token ids sampled with probability 0 (``utils.vision.input_only_token_ids``), or ``None``."""
        self.lora = lora if lora_enabled(lora) else None
        if self.lora is not None:
            # peft draws the adapters' initial A from the global RNG: fork it, so building an
            # engine never shifts the learner's random stream in colocated mode.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)
                model = wrap(model, self.lora)
        self.model = model.to(self.device).eval()
        self.pad_token_id = pad_token_id
        self.policy_version = 0
        self._calls = itertools.count()
        self._lock = threading.Lock()
        self._generating = False
        self._pending: tuple[Callable[[], object], int, threading.Event] | None = None
        self._pending_error: BaseException | None = None
        self._unusable: str | None = None
        """Why the engine refuses to sample (an update failed after its first write), or None."""
        self._receiver = None
        self._spare: dict[int, torch.Tensor] = {}
        """Staging tensors of the next ``receive_weights`` by ``id(parameter)``: what the last
        update swapped out."""
        self._last_metrics: dict[str, float] = {}
        self.num_weight_updates_in_flight = 0
        """Weight updates applied between two decoding steps of a batch (``keep`` mode)."""

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights by name and adopt ``version``, all or nothing (colocated transport).

        The whole update is validated and converted before any parameter is written
        (``stage_named_weights``); a refused update leaves every parameter bit-identical and the
        version unchanged. Thread-safe: while ``generate`` runs in another thread the weights are
        written at the next decoding-step boundary and the call blocks until then, so on return
        every later token is produced by ``version``. Should the write itself fail midway (a
        device fault), the engine refuses to sample until a complete update succeeds.

        Raises:
            KeyError, ValueError: the update was refused (``stage_named_weights``), nothing written.
            RuntimeError: the write failed midway; the engine is unusable until the next complete
                update (``generate`` raises).
        """
        staged = stage_named_weights(self._targets(), named_tensors)
        self._run_update(lambda: self._write(staged, version), version)

    def _write(self, staged: list, version: int) -> None:
        try:
            write_staged(staged)
        except BaseException as e:
            self._unusable = (f"the HF engine refuses to sample: weight update v{version} failed after its first "
                              f"write ({type(e).__name__}: {e}), so its weights mix two versions; a complete "
                              f"update must succeed first")
            raise
        self._unusable = None

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(self._unusable)

    def _run_update(self, load: Callable[[], object], version: int) -> None:
        # Runs ``load`` now, or between two decoding steps of a running ``generate`` (staged).
        with self._lock:
            if not self._generating:
                load()
                self.policy_version = version
                return
            done = threading.Event()
            self._pending = (load, version, done)
        done.wait()
        if self._pending_error is not None:
            err, self._pending_error = self._pending_error, None
            raise err

    def _apply_pending(self, in_flight: bool = False) -> None:
        with self._lock:
            if self._pending is None:
                return
            load, version, done = self._pending
            self._pending = None
            try:
                load()
                self.policy_version = version
                self.num_weight_updates_in_flight += in_flight
            except BaseException as e:  # re-raised in the updating thread; generate checks _unusable
                self._pending_error = e
            finally:
                done.set()

    def _targets(self) -> torch.nn.Module | dict[str, torch.nn.Parameter]:
        # What an update writes: the whole model, or with LoRA only the adapter matrices.
        if self.lora is None:
            return self.model
        return adapter_parameters(self.model)

    # ------------------------------------------------------------------ weight sync layer
    def weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``(parameter names, packed modules, tied aliases)``: HF checkpoint names map
        one-to-one (stacked experts under one name per expert matrix), tied names
        (``lm_head.weight`` of a tied model) are aliases of the parameter they share. With LoRA:
        the adapter matrices' sync names only, no aliases."""
        if self.lora is not None:
            return list(self._targets()), {}, {}
        _, names, tied, _ = _param_table(self.model)
        return names, {}, tied

    def weight_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{name: (dtype name, shape)}`` of every name an update may carry (tied aliases
        included; one expert's matrix for stacked experts; with LoRA the adapter matrices:
        ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``)."""
        params, _, _, pieces = _param_table(self._targets())
        return _specs(params, pieces)

    def check_plan(self, plan) -> None:
        """Raise unless the ``UpdatePlan`` can load whole (``async_rl.weight_sync.check_update``:
        names, coverage, shapes, dtypes, tied aliases); nothing is touched either way."""
        from async_rl.weight_sync import check_update

        engine, packed, tied = self.weight_names()
        check_update([(m.name, m.dtype, m.shape, m.alias_of) for b in plan.buckets for m in b], engine, packed, tied,
                     self.weight_specs())

    def connect_weight_sync(self, init_info: dict, rank: int) -> None:
        """Connect a ``WeightReceiver`` (``WeightSender.init_info()``, receiver ``rank``)."""
        from async_rl.weight_sync import WeightReceiver

        self._receiver = WeightReceiver(init_info, rank)
        self._receiver.connect()

    def receive_weights(self, plan: dict, version: int) -> float:
        """Load one update (``UpdatePlan.to_dict()``) from the connected sender, all or nothing;
        returns seconds until the new weights are in use.

        The whole plan is checked before any byte moves (``check_plan``). The buckets are then
        copied, once each, into staging tensors (generation goes on meanwhile) and, once the last
        one arrived, swapped in between two decoding steps: each targeted parameter takes its
        staging tensor as its data (``param.data = staged``: no second copy, and the pause at the
        step boundary costs no byte), and the tensor it held becomes a staging tensor of the next
        update. A failure before the swap (the sender died or raised, a bucket timed out) leaves
        every parameter untouched: the engine keeps its old weights and version. A tied
        parameter's alias (``lm_head.weight`` riding on the embedding's bytes) is not copied
        twice. Memory: one copy of the targeted parameters (the whole model, or the adapters
        with LoRA) on the engine's device, kept between updates: fresh tensors each update would
        cost more than the copy itself on CPU (every page faulted in anew). Phase seconds of the
        last call: ``last_weight_sync_metrics``.

        Raises:
            KeyError, ValueError: the plan was refused (names, coverage, shapes, dtypes, ties).
            RuntimeError, TimeoutError: the transfer failed midway (the engine is unchanged), or
                the final swap failed (the engine is unusable until a complete update).
        """
        import time

        from async_rl.weight_sync import UpdatePlan

        t0 = time.perf_counter()
        update = UpdatePlan.from_dict(plan)
        targets = self._targets()
        params, _, _, pieces = _param_table(targets)
        aliases = {m.name for b in update.buckets for m in b if m.alias_of is not None}
        staged: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        copy_s = 0.0
        complete = False
        try:
            for bucket in self._receiver.receive(update, check=lambda _names: self.check_plan(update)):
                t1 = time.perf_counter()
                try:
                    for name, t in bucket:
                        p = params[name]
                        if name in aliases and id(p) in staged:
                            continue  # a tied parameter's alias: the same bytes, staged once
                        # A copy: the bucket's memory is reused for the next one.
                        _stage(staged, p, name, t, pieces, spare=self._spare)
                except Exception as e:  # (out of memory): tell the sender why before leaving the loop
                    self._receiver.fail(update, f"staging a bucket failed: {type(e).__name__}: {e}")
                    raise
                copy_s += time.perf_counter() - t1
            complete = True
        finally:
            if not complete:  # the staging tensors stay for the next update; the parameters are untouched
                self._spare.update({k: buf for k, (_, buf) in staged.items()})
        t2 = time.perf_counter()
        self._run_update(lambda: self._swap(list(staged.values()), version), version)
        t3 = time.perf_counter()
        self._last_metrics = {"weight_sync/engine_s": t3 - t0, "weight_sync/engine_copy_s": copy_s,
                              "weight_sync/engine_wait_s": t2 - t0 - copy_s, "weight_sync/engine_apply_s": t3 - t2}
        return t3 - t0

    def _swap(self, staged: list[tuple[torch.nn.Parameter, torch.Tensor]], version: int) -> None:
        # Same shapes, dtypes and devices by construction: only a fault can stop it midway.
        try:
            with torch.no_grad():
                for param, t in staged:
                    old = param.data
                    param.data = t
                    self._spare[id(param)] = old
        except BaseException as e:
            self._unusable = (f"the HF engine refuses to sample: weight update v{version} failed while swapping in "
                              f"({type(e).__name__}: {e}), so its weights mix two versions; a complete update must "
                              f"succeed first")
            raise
        self._unusable = None

    def last_weight_sync_metrics(self) -> dict[str, float]:
        """Phase seconds of the last ``receive_weights`` (``{}`` before the first):
        ``weight_sync/engine_s`` (the whole call), ``engine_wait_s`` (the plan check, waiting
        for buckets and acknowledging them), ``engine_copy_s`` (bucket -> staging copies),
        ``engine_apply_s`` (waiting for a decoding-step boundary and swapping the staged tensors in)."""
        return dict(self._last_metrics)

    def close(self) -> None:
        """Nothing to release: the model is freed with the object (part of the ``Generator``
        protocol, so callers close every engine alike)."""

    # ------------------------------------------------------------------ sampling
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_sample: Callable[[int, int, Sample], None] | None = None,
                 images: Sequence[Any] | None = None) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt.

        Args:
            prompts: prompt token id lists (image placeholders expanded, one per merged patch).
            n: samples per prompt (>= 1).
            params: sampling settings; ``params.stop_token_ids`` must not be empty.
            seeds: optional seed per prompt; sample j of prompt i then depends only on
                ``(seeds[i], j)`` and the weights, whatever the batch.
            on_sample: optional callback ``(prompt_index, sample_index, sample)`` called as soon
                as each sample finishes (from the decoding loop).
            images: one ``ImageInputs`` or ``None`` per prompt (a vision-language model).

        Returns:
            ``len(prompts)`` lists of ``n`` ``Sample``s, in prompt order.

        Raises:
            ValueError: ``n < 1``, no stop token ids, ``seeds`` or ``images`` of the wrong length,
                or images for a text model.
            RuntimeError: the engine is unusable: a weight update failed after its first write
                (before this call, or while it decoded; it stops then, returning nothing), until
                a complete update succeeds.
        """
        check_request(n, params)
        images = check_images(images, len(prompts), self.image_token_id, "the HF engine's model")
        self._check_usable()
        rows = [_Row(index=k, prompt=list(prompts[k // n]), rng=torch.Generator().manual_seed(seed),
                     images=images[k // n] if images is not None else None)
                for k, seed in enumerate(row_seeds(self.cfg.seed, self._calls, n, len(prompts), seeds))]
        results: list[Sample | None] = [None] * len(rows)

        def finish(row: _Row) -> None:
            sample = Sample(response_ids=list(row.tokens), logprobs=list(row.logprobs),
                            finish_reason=row.finish_reason, policy_version=list(row.versions),
                            top_logprobs=list(row.top),
                            routed_experts=torch.cat(row.routing).numpy() if params.return_routed_experts else None)
            results[row.index] = sample
            if on_sample is not None:
                on_sample(row.index // n, row.index % n, sample)

        with self._lock:
            self._generating = True
        try:
            for start in range(0, len(rows), self.cfg.max_batch_size):
                live = rows[start : start + self.cfg.max_batch_size]
                while live:
                    self._check_usable()
                    self._decode(live, params, finish)
                    # Rows cut short by an abort (or a compaction) resume from their partial tokens,
                    # on the new weights after an abort.
                    self._apply_pending()
                    self._check_usable()
                    live = [r for r in live if not r.done]
        finally:
            with self._lock:
                self._generating = False
            self._apply_pending()  # staged just as the last batch ended
        return [results[i * n : (i + 1) * n] for i in range(len(prompts))]  # type: ignore[misc]

    def _decode(self, rows: list[_Row], params: SamplingParams, finish: Callable[[_Row], None]) -> None:
        from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList

        contexts = [r.prompt + r.tokens for r in rows]
        P = max(len(c) for c in contexts)
        input_ids = torch.full((len(rows), P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), P), dtype=torch.long)
        for i, c in enumerate(contexts):
            input_ids[i, P - len(c) :] = torch.tensor(c, dtype=torch.long)
            attention_mask[i, P - len(c) :] = 1
        hook = _StepHook(self, rows, params, finish)
        recorder = contextlib.nullcontext()
        if params.return_routed_experts:
            from async_rl.utils.moe import RoutingRecorder

            recorder = hook.recorder = RoutingRecorder(self.model)
            if not recorder.routers:
                raise ValueError(f"the HF engine cannot return routed experts: {type(self.model).__name__} is not a "
                                 f"mixture-of-experts model (no router)")
        remaining = max(params.max_tokens - len(r.tokens) for r in rows)
        gen_cfg = GenerationConfig(
            do_sample=False, temperature=None, top_p=None, top_k=None, repetition_penalty=1.0,
            max_new_tokens=remaining, eos_token_id=list(params.stop_token_ids), pad_token_id=self.pad_token_id,
        )
        # Not for a vision-language model (its rotary positions are per axis, from the images,
        # which generate derives itself) nor while recording routed experts (the prefill would
        # run outside the recorder's steps).
        shared = {} if params.return_routed_experts or self.image_token_id is not None else \
            self._prefill_shared(contexts, input_ids, attention_mask)
        with recorder:
            self.model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                generation_config=gen_cfg, logits_processor=LogitsProcessorList([hook]),
                stopping_criteria=StoppingCriteriaList([_AbortCriteria(hook)]),
                **image_kwargs(input_ids, [r.images for r in rows], self.image_token_id, self.device), **shared,
            )

    @torch.no_grad()
    def _prefill_shared(self, contexts: list[list[int]], input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        ) -> dict[str, object]:
        """Run each distinct context of a decoding batch once (a group's samples start from the
        same prompt) and hand ``generate`` the key/value cache copied out to every row.

        ``input_ids`` and ``attention_mask`` are ``[R, P]`` int64, left-padded, one row per
        context; identical contexts have identical rows. All but each row's last token are run
        for the distinct rows only, at the positions ``generate`` gives them (the attention
        mask's cumulative sum), and the cache is indexed out to ``R`` rows; ``generate`` then
        runs the last token of every row on it, and samples as it would have (keys and values
        of a token depend on its own row only). Returns ``{"past_key_values": cache}``, or
        ``{}`` when every context is distinct or none is longer than one token (nothing to share)."""
        firsts: dict[tuple[int, ...], int] = {}
        row_of = [firsts.setdefault(tuple(c), len(firsts)) for c in contexts]
        if len(firsts) == len(contexts) or input_ids.shape[1] < 2:
            return {}
        distinct = torch.tensor([row_of.index(u) for u in range(len(firsts))])
        ids, mask = input_ids[distinct, :-1].to(self.device), attention_mask[distinct, :-1].to(self.device)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        cache = self.model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True).past_key_values
        cache.reorder_cache(torch.tensor(row_of, device=self.device))
        return {"past_key_values": cache}
