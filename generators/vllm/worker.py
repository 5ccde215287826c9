"""Code that runs inside vLLM's worker processes: our weight-transfer engine and worker extension.

vLLM loads this module in every worker because the engine is created with
``worker_extension_cls="async_rl.generators.vllm.worker.AsyncRLWorkerExtension"``; importing it registers
the ``async_rl`` backend with vLLM's ``WeightTransferEngineFactory`` before the worker builds its
weight-transfer engine (``weight_transfer_config={"backend": "async_rl"}``). The engine then
follows vLLM's native RL weight-update lifecycle, driven from ``AsyncLLM``:

* ``init_weight_transfer_engine``: connect a ``WeightReceiver`` (shm slots or a gloo/NCCL group);
* ``start_weight_update``: vLLM's layerwise reload begins (kernels that repack weights, such as
  the CPU build's oneDNN linears, are restored to checkpoint layout and re-processed once a
  module has all its weights, or at finalize; one update thus spans several buckets in one
  session, unlike separate ``reload_weights`` calls, which must not split a layer);
* ``update_weights``: load bucket by bucket with the model's own ``load_weights`` (HF names; the
  loader fuses q/k/v and gate/up and converts dtypes), straight from the bucket's views: a layer
  whose weights are all in the bucket (every decoder layer: a plan never splits one) is loaded
  and processed within the call; only the tensors the reload still holds afterwards (a layer
  completed at finalize, such as a tied head or a padded embedding) are copied out of the bucket
  before its memory is reused (``own_pending``); the whole plan was checked
  against the model (``check_update``: names, coverage, full shapes from ``engine_weight_specs``,
  dtypes, tied aliases) by ``async_rl_check_update`` before the reload began;
* ``finish_weight_update``: finalize the layerwise reload.

A failure after the reload began cannot be rolled back: processed layers (and biases, which
load in place at once) already hold the new values. ``async_rl_abort_update`` unwinds the rest
(every layer still waiting gets its own old tensors back, the reload state is cleared, vLLM's
update session ends) and reports whether any bucket had reached the model; the generator then
refuses to sample until a complete update (``async_rl.generators.vllm``, ``async_rl.weight_sync``'s *All
or nothing*).

**Mixture of experts**: an update carries each expert's projections under the checkpoint's names
(``mlp.experts.3.gate_proj.weight``); ``engine_expert_names`` maps them onto vLLM's stacked
``routed_experts.w13_weight``/``w2_weight`` by inverting vLLM's own expert mapping, and the check
refuses an update that leaves any expert of a stack out. The CPU build's expert kernel reads a
prepacked layout vLLM does not rebuild on a weight update; ``_repack_cpu_experts_on_update``
rebuilds it. ``RoutingRecorder`` records the experts each token was routed to (vLLM's own
option does not run on the CPU build).

**Multimodal models** (Qwen2-VL): an update carries checkpoint names (``visual.*``, ``model.*``);
vLLM nests the language model (``language_model.model.*``). The check maps the names sent through
the model's own ``hf_to_vllm_mapper`` renaming rules (``CheckpointNames``) and reports problems
under the names sent; the loader gets the names as sent (``load_weights`` renames them itself).

Tensors never travel through ``collective_rpc`` (vLLM cannot pickle them intact there); only the
plan (names, dtypes, shapes, offsets) does.

**LoRA** (engine started with ``enable_lora``): the base weights never change; an update carries
only the adapter matrices (``async_rl.utils.lora``) and bypasses the reload lifecycle. At start-up
``async_rl_init_lora`` registers a zero adapter under one fixed id (the engine then computes
exactly the base model), which every request names. ``async_rl_load_lora`` receives an update's
buckets through the same ``WeightReceiver``, builds vLLM's ``LoRAModel`` from the tensors in
memory (``LoRAModel.from_lora_tensors``, the loader behind vLLM's adapter directories, which
fuses q/k/v and gate/up) and swaps it in under the same id: the slot is freed and refilled, so no
adapter of an older version stays in memory and requests frozen by a ``keep`` pause continue on
the new adapter, exactly as they would continue on new full weights. vLLM's own ``add_lora``
path needs a directory on disk per version; this one never touches the disk. The update is
staged: all of it is received and the adapter built before the one in use is removed, so only a
failure inside the swap leaves the engine without a whole adapter.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from async_rl.generators.model_support import unloaded_aliases
from async_rl.utils.lora import PEFT_PREFIX, expected_vllm_adapter_names
from async_rl.weight_sync import UpdatePlan, WeightReceiver, WeightUpdateError, check_update, dtype_name

BACKEND = "async_rl"
LORA_ID = 1
"""The one adapter id every request names (a version is swapped in under it)."""
LORA_NAME = "async-rl-policy"
LORA_PATH = "in-memory://async-rl-policy"
"""``LoRARequest`` requires a path; this adapter is never loaded from one (see the module docstring)."""

# The layerwise reload warns "RotaryEmbedding: Failed to load weights" on every update (a module
# with no weights); our own name check is the authority on what an update must contain.
logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)


@dataclass
class AsyncRLInitInfo(WeightTransferInitInfo):
    """``WeightSender.init_info()`` and this engine's receiver rank."""

    info: dict[str, Any] = field(default_factory=dict)
    rank: int = 0


@dataclass
class AsyncRLUpdateInfo(WeightTransferUpdateInfo):
    """One update's ``UpdatePlan.to_dict()``."""

    plan: dict[str, Any] = field(default_factory=dict)


def engine_weight_names(model) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
    """``(parameter names, packed_modules_mapping, tied aliases)`` of a vLLM model.

    A model whose output head is tied to its input embedding (``tie_word_embeddings``) has no
    ``lm_head.weight`` of its own; the HF name is accepted as an alias of the embedding (and is
    required: without it vLLM's CPU build silently keeps the old head, logging only a warning).
    """
    from vllm.model_executor.utils import get_packed_modules_mapping

    names = [n for n, _ in model.named_parameters()]
    # vLLM's own lookup: a multimodal model (Qwen2-VL) declares none itself; its language model does.
    packed = {k: list(v) for k, v in get_packed_modules_mapping(model).items()}
    config = getattr(model, "config", None)
    tied = {}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            tied["lm_head.weight"] = embed
    return names, packed, tied


class CheckpointNames:
    """The renaming vLLM's loader applies to a multimodal model's checkpoint names before they
    reach its modules, for checking an update against the model's parameters by their names.

    A multimodal model nests its parts under other paths than the checkpoint (Qwen2-VL: the
    checkpoint's ``model.layers.0...`` or transformers 5's ``model.language_model.layers.0...``
    are vLLM's ``language_model.model.layers.0...``; ``lm_head.weight`` is
    ``language_model.lm_head.weight``); its ``load_weights`` renames them with the model's
    ``hf_to_vllm_mapper``. This applies that mapper's renaming rules (prefixes, suffixes,
    substrings, regexes), not its fusing ones (``orig_to_new_stacked``: q/k/v into ``qkv_proj``),
    which the check resolves itself (``packed_modules_mapping``). A text model, or one without a
    mapper, keeps every name (``identity``). Updates still load under the names sent: the model's
    ``load_weights`` renames them itself.
    """

    def __init__(self, model) -> None:
        from vllm.model_executor.models.interfaces import supports_multimodal
        from vllm.model_executor.models.utils import WeightsMapper

        mapper = getattr(model, "hf_to_vllm_mapper", None) if supports_multimodal(model) else None
        self.mapper = None if mapper is None else WeightsMapper(
            orig_to_new_renaming=list(mapper.orig_to_new_renaming), orig_to_new_regex=dict(mapper.orig_to_new_regex),
            orig_to_new_substr=dict(mapper.orig_to_new_substr), orig_to_new_prefix=dict(mapper.orig_to_new_prefix),
            orig_to_new_suffix=dict(mapper.orig_to_new_suffix))

    @property
    def identity(self) -> bool:
        """Whether every name stays as it is."""
        return self.mapper is None

    def __call__(self, name: str) -> str:
        """The engine-side name of checkpoint name ``name`` (``name`` itself where no rule applies;
        a name the mapper would drop stays, so the check reports it as unknown)."""
        if self.mapper is None:
            return name
        return self.mapper.map_name(name) or name

    def unloaded_aliases(self, model, tied: dict[str, str]) -> set[str]:
        """``model_support.unloaded_aliases`` where the alias names the module it loads under
        after renaming: Qwen2-VL's ``lm_head.weight`` loads into ``language_model.lm_head``
        (which must be loaded: the CPU build re-processes its tied head only then)."""
        if self.identity:
            return unloaded_aliases(model, tied)
        out = set()
        for alias in tied:
            try:
                model.get_submodule(self(alias).rpartition(".")[0])
            except AttributeError:
                out.add(alias)
        return out

    @staticmethod
    def readable(message: str, renamed: dict[str, str]) -> str:
        """``message`` (a ``check_update`` error) with engine-side names written as the sender's:
        ``renamed`` is ``{sent name: engine-side name}``; each engine prefix seen in it (the part
        before the longest common ending, ``language_model.`` for ``model.layers.0.x`` ->
        ``language_model.model.layers.0.x``) is turned back wherever a quoted name starts with
        it, so names the update left out read as the sender would write them too."""
        back: dict[str, str] = {}
        for sent, engine in renamed.items():
            common = 0
            while common < min(len(sent), len(engine)) and sent[-1 - common] == engine[-1 - common]:
                common += 1
            engine_prefix, sent_prefix = engine[: len(engine) - common], sent[: len(sent) - common]
            if engine_prefix != sent_prefix:
                back.setdefault(engine_prefix, sent_prefix)
        for engine_prefix in sorted(back, key=len, reverse=True):
            message = message.replace(f"'{engine_prefix}", f"'{back[engine_prefix]}")
        return message


def _routed_experts_modules(model) -> list[tuple[str, Any]]:
    # ``(module path, RoutedExperts)`` of every expert stack, in model order. vLLM 0.32 keeps every
    # fused-MoE layer's expert weights in a ``RoutedExperts`` module (``w13_weight``/``w2_weight``
    # and, for some models, biases and scales); an older vLLM without it has no stacks found here.
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def _stack_leaves(module) -> list[str]:
    # The stack parameters of a RoutedExperts module the expert mapping can load (``w13_weight``,
    # ``w2_weight``, ``w13_bias``...): ``param_name`` of vLLM's mapping is ``experts.w13_``/``experts.w2_``.
    return [n for n, _ in module.named_parameters(recurse=False) if n.startswith(("w13_", "w2_"))]


def engine_expert_names(model) -> dict[str, tuple[str, str]]:
    """``{per-expert HF name: (engine stack parameter, shard)}`` of every expert of every
    mixture-of-experts layer of a vLLM model (``{}`` for a dense model): the names an update
    carries for its experts and the fused parameter each loads into, for ``check_update``.

    An update sends each expert's projections under the checkpoint's names
    (``model.layers.0.mlp.experts.3.gate_proj.weight`` ``[I, H]``, ``up_proj`` ``[I, H]``,
    ``down_proj`` ``[H, I]``); vLLM stacks them into ``...mlp.experts.routed_experts.w13_weight``
    ``[E, 2I, H]`` (gate and up) and ``w2_weight`` ``[E, H, I]``. The table is the inverse of the
    mapping vLLM's own loader applies (``RoutedExperts.get_expert_mapping()``:
    ``(param_name, weight_name, expert_id, shard_id)``, ``qual_name.replace(weight_name,
    param_name)``), so it names exactly what ``load_weights`` accepts; the shard is the expert's
    part, ``"experts.3.gate_proj"``. Stacked checkpoint layouts (transformers 5's
    ``experts.gate_up_proj`` ``[E, 2I, H]``) are not in it: the wire carries per-expert tensors.
    Read it before any reload (a reload swaps parameters for meta tensors; names survive).
    """
    table: dict[str, tuple[str, str]] = {}
    for path, module in _routed_experts_modules(model):
        runner_path = path.rpartition(".")[0]
        layer = getattr(module, "layer_name", runner_path)
        mapping = module.get_expert_mapping()
        for leaf in _stack_leaves(module):
            qual = f"{layer}.{leaf}"
            for param_name, weight_name, _, _ in mapping:
                # ``param_name`` is the stack's name inside the layer (``experts.w13_``), ``weight_name``
                # the checkpoint's (``experts.3.gate_proj.``): vLLM maps the latter onto the former.
                # Only per-expert entries (an expert id after ``experts.``) are taken.
                if param_name not in qual or not weight_name.partition(".")[2].partition(".")[0].isdigit():
                    continue
                hf_in_layer = qual.replace(param_name, weight_name)
                if not hf_in_layer.startswith(layer + "."):
                    continue
                hf = f"{runner_path}.{hf_in_layer.removeprefix(layer + '.')}" if runner_path else \
                    hf_in_layer.removeprefix(layer + ".")
                table.setdefault(hf, (f"{path}.{leaf}", weight_name.rstrip(".")))
    return table


def _expert_specs(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    # Full (unsharded, unpadded) shapes of each expert's projections, from the layer's MoE config:
    # the stack itself is sharded by tensor parallelism, padded and repacked by the CPU kernels.
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    table = engine_expert_names(model)
    by_stack: dict[str, Any] = {f"{path}.{leaf}": (m, leaf) for path, m in _routed_experts_modules(model)
                                for leaf in _stack_leaves(m)}
    for hf, (stack, _) in table.items():
        module, leaf = by_stack[stack]
        cfg = module.moe_config
        hidden = int(getattr(cfg, "hidden_dim_unpadded", None) or cfg.hidden_dim)
        inter = int(cfg.intermediate_size)
        down = leaf.startswith("w2_")
        if leaf.endswith("_weight"):
            shape = (hidden, inter) if down else (inter, hidden)
        elif leaf.endswith("_bias"):
            shape = (hidden,) if down else (inter,)
        else:
            continue  # quantization scales: no per-expert shape rule here, no shape check
        specs[hf] = (dtype_name(getattr(module, leaf).dtype), shape)
    return specs


def _hf_output_sizes(module) -> list[int] | None:
    # Full (unsharded) output size of each HF projection a fused linear holds, in packed order.
    # vLLM's layer classes (QKVParallelLinear, MergedColumnParallelLinear...) differ by model and
    # version; they are told apart by the attributes they carry.
    if all(hasattr(module, a) for a in ("total_num_heads", "total_num_kv_heads", "head_size")):
        v = getattr(module, "v_head_size", module.head_size)
        return [module.total_num_heads * module.head_size, module.total_num_kv_heads * module.head_size,
                module.total_num_kv_heads * v]
    sizes = getattr(module, "output_sizes", None)
    return list(sizes) if sizes else None


def engine_weight_specs(model) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{HF name: (dtype name, full shape)}`` of every tensor a vLLM model loads, by the names an
    update carries (fused q/k/v and gate/up split into their HF projections, the tied head as an
    alias of the embedding).

    Shapes come from the layers' own full sizes (``input_size``/``output_size``/``output_sizes``
    of linear layers, ``org_vocab_size``/``embedding_dim`` of vocabulary embeddings), never from
    the parameters themselves: tensor parallelism shards them, the vocabulary is padded, and the
    CPU build repacks linear weights into oneDNN kernels (their parameters then have shape
    ``[0]``). Each expert of a mixture-of-experts stack gets its own projections' shapes
    (``engine_expert_names``; ``gate_proj``/``up_proj`` ``[I, H]``, ``down_proj`` ``[H, I]``, from
    the layer's ``moe_config``). Other parameters (norms) are replicated and keep their
    checkpoint shape. Read it before any reload (a reload swaps parameters for meta tensors).
    """
    _, packed, tied = engine_weight_names(model)
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    stacks = {e for e, _ in engine_expert_names(model).values()}
    for name, p in model.named_parameters():
        if name in stacks:
            continue  # an expert stack: each expert's projections get their own specs, below
        module = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        # An engine serving LoRA wraps each linear (``qkv_proj.base_layer.weight``): its base
        # weights keep their HF names (the adapters' shapes derive from them, ``adapter_specs``).
        module_name, _, leaf = name.replace(".base_layer.", ".").rpartition(".")
        hf_name = f"{module_name}.{leaf}" if module_name else leaf
        prefix, _, last = module_name.rpartition(".")
        dtype = dtype_name(p.dtype)
        is_linear = leaf in ("weight", "bias") and hasattr(module, "input_size") and hasattr(module, "output_size")
        sizes = _hf_output_sizes(module) if last in packed else None
        # Vocabulary embeddings (and the head) also carry input/output sizes, padded ones: first.
        if leaf == "weight" and hasattr(module, "org_vocab_size") and hasattr(module, "embedding_dim"):
            specs[hf_name] = (dtype, (module.org_vocab_size, module.embedding_dim))
        elif is_linear and sizes is not None and len(sizes) == len(packed[last]):
            for part, out in zip(packed[last], sizes):
                hf = f"{prefix}.{part}.{leaf}" if prefix else f"{part}.{leaf}"
                specs[hf] = (dtype, (out, module.input_size) if leaf == "weight" else (out,))
        elif is_linear:
            full = (module.output_size, module.input_size) if leaf == "weight" else (module.output_size,)
            specs[hf_name] = (dtype, full)
        else:
            specs[hf_name] = (dtype, tuple(p.shape))
    specs.update(_expert_specs(model))
    for alias, target in tied.items():
        if target in specs:
            specs[alias] = specs[target]
    return specs


def adapter_specs(names: list[str], base_specs: dict[str, tuple[str, tuple[int, ...]]],
                  rank: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``{adapter sync name: (dtype name, shape)}``: ``lora_A`` ``[rank, in]`` and ``lora_B``
    ``[out, rank]`` of each targeted HF projection, ``in``/``out`` from its base weight's shape in
    ``base_specs`` (``engine_weight_specs``). Names without a base weight there get no spec."""
    out = {}
    for n in names:
        module = n.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)[0]
        base = base_specs.get(f"{module}.weight")
        if base is None or len(base[1]) != 2:
            continue
        rows, cols = base[1]
        out[n] = (base[0], (rank, cols) if ".lora_A." in n else (rows, rank))
    return out


class AsyncRLWeightTransferEngine(WeightTransferEngine[AsyncRLInitInfo, AsyncRLUpdateInfo]):
    """vLLM weight-transfer engine receiving ``async_rl.weight_sync`` buckets (see module docstring).

    ``intact`` is False from the first bucket handed to the model's loader until the update is
    finished: the model then mixes two versions (the layerwise reload writes processed layers in
    place) and must not be sampled from (``abort_weight_update``).
    """

    init_info_cls = AsyncRLInitInfo
    update_info_cls = AsyncRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: WeightReceiver | None = None
        # Read before any reload (a reload swaps parameters for meta tensors).
        self.names, self.packed, self.tied = engine_weight_names(self.model)
        self.experts = engine_expert_names(self.model)
        """Per-expert HF names of the model's expert stacks (``{}`` for a dense model)."""
        self.specs = engine_weight_specs(self.model)
        self.rename = CheckpointNames(self.model)
        """Checkpoint names onto the model's own (a multimodal model's nesting), for the check."""
        self.unloaded = self.rename.unloaded_aliases(self.model, self.tied)
        """Tied aliases the check accepts but ``load_weights`` cannot take (vLLM's Gemma2 head)."""
        self.num_updates = 0
        self.intact = True
        self.metrics: dict[str, float] = {}
        """Phase seconds of the last update (``AsyncRLWorkerExtension.async_rl_update_metrics``)."""
        self._process_s = [0.0]
        self.repacked = _repack_cpu_experts_on_update(self.model)
        """Expert stacks whose CPU kernel layout a reload now rebuilds (``_repack_cpu_experts_on_update``)."""
        _time_processing(self.model, self._process_s)
        self._views = _reload_internals()
        """Load straight from the bucket's views (``own_pending`` then copies what the reload keeps),
        or, where vLLM's reload internals differ, from copies of the whole bucket."""

    def init_transfer_engine(self, init_info: AsyncRLInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(init_info.info, init_info.rank)
        self.receiver.connect()

    def check(self, plan: UpdatePlan) -> None:
        """Raise unless ``plan`` loads whole into this model (``check_update``: names, coverage,
        full shapes, dtypes, tied aliases, every expert of every expert stack), and carries the
        tied head (vLLM's CPU build keeps the old head otherwise, with only a log warning)."""
        metas = [m for b in plan.buckets for m in b]
        renamed = {m.name: self.rename(m.name) for m in metas}
        # Checked by the names the model's loader gives them (``CheckpointNames``); a tied alias
        # is a checkpoint name (``lm_head.weight``) renamed likewise.
        tied = {self.rename(alias): target for alias, target in self.tied.items()}
        specs = self.specs if self.rename.identity else \
            {**self.specs, **{self.rename(a): self.specs[t] for a, t in self.tied.items() if t in self.specs}}
        try:
            check_update([(renamed[m.name], m.dtype, m.shape, m.alias_of and self.rename(m.alias_of)) for m in metas],
                         self.names, self.packed, tied, specs, self.experts)
        except WeightUpdateError as e:
            if self.rename.identity:
                raise
            raise type(e)(CheckpointNames.readable(str(e), renamed)) from None
        names = {renamed[m.name] for m in metas}
        missing_alias = [n for n in self.tied if self.rename(n) not in names]
        if missing_alias:
            raise ValueError(f"tied model: {missing_alias} must be sent (as an alias of {self.tied[missing_alias[0]]!r})")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: AsyncRLUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        plan = UpdatePlan.from_dict(update_info.plan)
        t0 = time.perf_counter()
        load_s = own_s = 0.0
        self._process_s[0] = 0.0
        # The plan was checked by ``async_rl_check_update`` before the reload began.
        for bucket in self.receiver.receive(plan):
            self.intact = False
            try:
                t1 = time.perf_counter()
                loadable = [(n, t) for n, t in bucket if n not in self.unloaded]
                self.model.load_weights(loadable if self._views else [(n, t.clone()) for n, t in loadable])
                t2 = time.perf_counter()
                # The bucket's memory is reused by the next bucket: what the reload still holds
                # of it must be copied first. Measured: with views left in the reload, a
                # multi-bucket update diverged from a fresh engine (tests/test_vllm.py).
                if self._views:
                    own_pending(bucket)
                load_s += t2 - t1
                own_s += time.perf_counter() - t2
            except Exception as e:
                self.receiver.fail(plan, f"loading a bucket failed: {type(e).__name__}: {e}")
                raise
        self.num_updates += 1
        self.metrics = {"weight_sync/engine_recv_s": time.perf_counter() - t0,
                        "weight_sync/engine_load_s": load_s - self._process_s[0],
                        "weight_sync/engine_process_s": self._process_s[0], "weight_sync/engine_own_s": own_s}

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        t0, before = time.perf_counter(), self._process_s[0]
        finalize_layerwise_reload(self.model, self.model_config)
        self.intact = True
        self.metrics["weight_sync/engine_finalize_s"] = time.perf_counter() - t0
        self.metrics["weight_sync/engine_process_s"] = self.metrics.get("weight_sync/engine_process_s", 0.0) + \
            self._process_s[0] - before

    def abort_weight_update(self) -> bool:
        """Unwind a reload that will not be finished; returns ``intact``.

        Every layer still waiting for weights gets its own tensors back (old values, untouched by
        the reload) and its reload state is cleared, so the model is whole again and the next
        ``start_weight_update`` begins from scratch (vLLM would otherwise skip layers it still
        believes in progress and process them with the failed update's buffered tensors). Layers
        already processed, and biases (loaded in place at once), keep the new values: unless
        ``intact``, the model mixes two versions. Uses vLLM 0.32's layerwise-reload internals.
        """
        from vllm.model_executor.model_loader.reload import layerwise
        from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

        model = self.model
        # vLLM's reload patches this method on the model for the update's duration (torchao models).
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload
        for layer in model.modules():
            info = layerwise.LAYERWISE_INFO.get(layer)
            if info is None or not info.can_load():
                continue
            if info.kernel_tensors is not None:
                layerwise._place_kernel_tensors(layer, info)
            for t in get_layer_tensors(layer).values():
                if layerwise._get_weight_loader(t).__name__ == "online_process_loader":
                    t.weight_loader = layerwise._get_original_loader(t)
            info.reset()
        layerwise.LOADING_LAYERS.clear()
        return self.intact

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


if BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, AsyncRLWeightTransferEngine)
    except ValueError:  # already registered by an earlier import in this process
        pass


def own_pending(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Copy out of ``bucket`` the tensors vLLM's layerwise reload still holds after loading it;
    returns the bytes copied.

    The reload buffers a layer's tensors (the loader's arguments, views into the bucket) until
    the layer has all its weights, then loads and processes it and drops them. A layer left
    incomplete after a bucket (completed only at finalize: a tied output head, a padded
    embedding) would otherwise read the next bucket's bytes. Every other layer was processed
    inside ``load_weights`` and holds nothing of the bucket. Uses vLLM 0.32's layerwise-reload
    internals (``LAYERWISE_INFO``; ``_reload_internals`` tells whether they are there: without
    them the engine hands the loader copies of the whole bucket instead)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storages = {t.untyped_storage().data_ptr() for _, t in bucket}
    pending = [bound for info in list(LAYERWISE_INFO.values()) for _, bound in info.loaded_weights]
    nbytes = 0
    for bound in pending:
        for key, value in bound.arguments.items():
            if isinstance(value, torch.Tensor) and not value.is_meta and \
                    value.untyped_storage().data_ptr() in storages:
                bound.arguments[key] = value.clone()
                nbytes += value.numel() * value.element_size()
    return nbytes


def _reload_internals() -> bool:
    """Whether vLLM's layerwise reload buffers a layer's tensors where ``own_pending`` looks."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo
    except ImportError:
        return False
    return hasattr(LAYERWISE_INFO, "values") and "loaded_weights" in getattr(LayerReloadingInfo,
                                                                             "__dataclass_fields__", {})


def _repack_cpu_experts_on_update(model) -> int:
    """Make a weight update rebuild the CPU build's expert-kernel layout; returns the stacks concerned.

    vLLM 0.32's ``UnquantizedFusedMoEMethod._setup_kernel``
    (``vllm/model_executor/layers/fused_moe/unquantized_fused_moe_method.py``, lines 187-205)
    treats any call after the first as a weight update: it copies the new ``w13_weight`` and
    ``w2_weight`` into the existing parameters and skips ``fused_experts.
    process_weights_after_loading``, which on CPU (``CPUUnquantizedExperts``,
    ``experts/cpu_moe.py`` lines 208-217) pads and prepacks the stacks into the grouped-GEMM
    layout the kernel reads. The layerwise reload then copies the unpacked values over the packed
    ones: measured, an update of a tiny Qwen3-MoE "succeeded" yet generated other tokens than a
    fresh engine on the same weights, and pushing the original weights back did not restore it.
    Wrapped here (an instance attribute over the bound method, like ``_time_processing``): after
    a reprocess, the stacks are prepacked again, so the reload copies the packed layout back.
    """
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return 0
    count = 0
    for _, module in _routed_experts_modules(model):
        method = module.quant_method
        kernel = getattr(method, "moe_kernel", None)
        if type(method).__name__ != "UnquantizedFusedMoEMethod" or \
                not isinstance(getattr(kernel, "fused_experts", None), CPUUnquantizedExperts):
            continue
        inner = method.process_weights_after_loading

        def repacking(layer, _inner=inner, _method=method):
            out = _inner(layer)
            # Always an update here: the first processing ran when the engine loaded the model.
            _method.moe_kernel.fused_experts.process_weights_after_loading(layer)
            return out

        method.process_weights_after_loading = repacking
        count += 1
    return count


def _time_processing(model, total: list[float]) -> None:
    # Each layer's quant method re-processes its weights after a (re)load (the CPU build packs
    # linears into oneDNN kernels): time it, as an instance attribute over the bound method
    # (the reload calls ``quant_method.process_weights_after_loading(layer)``).
    seen: set[int] = set()
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is None or id(method) in seen or not hasattr(method, "process_weights_after_loading"):
            continue
        seen.add(id(method))
        inner = method.process_weights_after_loading

        def timed(layer, _inner=inner):
            t0 = time.perf_counter()
            try:
                return _inner(layer)
            finally:
                total[0] += time.perf_counter() - t0

        method.process_weights_after_loading = timed


ROUTING_KEY = "async_rl_routing"
"""``SamplingParams.extra_args`` key by which a request asks our worker to record the experts its
tokens are routed to; its value is the id the rows are kept under (``RoutingRecorder.take``)."""


class RoutingRecorder:
    """Records, for the requests that ask for it, the experts every forwarded token was routed to,
    inside a vLLM worker of the CPU build (whose model runner cannot return them; see
    ``async_rl.generators.vllm.engine``'s *Routed experts*).

    Each mixture-of-experts layer's router (``MoERunner.router``, a vLLM ``BaseRouter``) gets its
    ``_compute_routing`` wrapped (an instance attribute over the bound method): while a step
    forwards a recorded request, the ``top_k`` expert ids it returns (logical ids, before any
    expert-parallel placement) are kept, each row ordered by routing weight, highest first. The
    model runner's ``_model_forward`` is wrapped too: it knows the step's batch (``input_batch``
    order, ``query_start_loc``) and the ``positions`` passed to the model, so each request's rows
    are stored at their token positions (a recomputed token overwrites its row). A request asks
    by ``extra_args[ROUTING_KEY] = key``; it must not read the prefix cache
    (``skip_reading_prefix_cache``): cached prompt tokens are never forwarded, so their routing
    would be missing (``take`` reports the gap).

    Args:
        model_runner: the worker's V1 model runner (``GPUModelRunner`` or the CPU build's subclass).
        max_kept: requests whose rows are kept until taken; beyond it the oldest are dropped (a
            caller that never takes cannot grow memory without bound).

    Raises:
        ValueError: the model has no mixture-of-experts layer, a layer's experts route inside a
            monolithic kernel (no router to wrap), or the model is compiled (``enforce_eager``
            off: the wrappers would be traced, not run).
    """

    def __init__(self, model_runner, max_kept: int = 4096) -> None:
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        if not getattr(model_runner.model_config, "enforce_eager", False):
            raise ValueError("recording routed experts needs an eager model (generator.vllm.enforce_eager: true): "
                             "under torch.compile the router wrappers would be traced instead of run")
        model = model_runner.get_model()
        self.layers = [m for m in model.modules() if isinstance(m, MoERunner)]
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no mixture-of-experts layer: no routed experts to return")
        for m in self.layers:
            if m.is_monolithic or not hasattr(m.router, "_compute_routing"):
                raise ValueError(f"MoE layer {m.layer_name} routes inside its kernel ({type(m.router).__name__}, "
                                 f"monolithic={m.is_monolithic}): its routed experts cannot be recorded")
        self.top_k = int(self.layers[0].router.top_k)
        self.runner = model_runner
        self.max_kept = max_kept
        self.kept: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        """``{key: (rows [capacity, num_layers, top_k] int16, recorded [capacity] bool)}``."""
        self._step: list[torch.Tensor | None] = [None] * len(self.layers)
        self._active = False
        for i, m in enumerate(self.layers):
            m.router._compute_routing = self._wrap_routing(m.router._compute_routing, i)
        self._inner_forward = model_runner._model_forward
        model_runner._model_forward = self._forward

    def _wrap_routing(self, inner, index: int):
        def routing(*args, **kwargs):
            weights, ids = inner(*args, **kwargs)
            if self._active:
                order = torch.argsort(weights, dim=-1, descending=True, stable=True)
                self._step[index] = torch.gather(ids, 1, order).to(torch.int16)
            return weights, ids

        return routing

    def _recorded_requests(self) -> list[tuple[int, str]]:
        # ``(index in the step's batch, key)`` of the batch's requests that asked to be recorded.
        batch = self.runner.input_batch
        out = []
        for i, req_id in enumerate(batch.req_ids[: batch.num_reqs]):
            state = self.runner.requests.get(req_id)
            extra = getattr(getattr(state, "sampling_params", None), "extra_args", None) or {}
            if ROUTING_KEY in extra:
                out.append((i, str(extra[ROUTING_KEY])))
        return out

    def _forward(self, *args, **kwargs):
        recorded = self._recorded_requests()
        if not recorded:
            return self._inner_forward(*args, **kwargs)
        self._step = [None] * len(self.layers)
        self._active = True
        try:
            out = self._inner_forward(*args, **kwargs)
        finally:
            self._active = False
        positions = kwargs["positions"] if "positions" in kwargs else args[1]
        if positions.dim() != 1:
            raise RuntimeError("recording routed experts: multi-dimensional positions (M-RoPE) are not supported")
        missing = [m.layer_name for m, t in zip(self.layers, self._step) if t is None]
        if missing:
            raise RuntimeError(f"recording routed experts: layers {missing} routed no tokens in this step")
        step = torch.stack(self._step, dim=1).cpu().numpy()  # [step tokens (padded), num_layers, top_k]
        starts = self.runner.query_start_loc.np
        pos = positions.cpu().numpy()
        for i, key in recorded:
            a, b = int(starts[i]), int(starts[i + 1])
            self._store(key, pos[a:b], step[a:b])
        return out

    def _store(self, key: str, positions: np.ndarray, rows: np.ndarray) -> None:
        need = int(positions.max()) + 1 if len(positions) else 0
        rec = self.kept.get(key)
        if rec is None or len(rec[1]) < need:
            cap = max(need, 64, 2 * (len(rec[1]) if rec else 0))
            grown = (np.zeros((cap, len(self.layers), self.top_k), np.int16), np.zeros(cap, bool))
            if rec is not None:
                grown[0][: len(rec[1])], grown[1][: len(rec[1])] = rec
            rec = self.kept[key] = grown
            while len(self.kept) > self.max_kept:
                self.kept.pop(next(iter(self.kept)))
        rec[0][positions] = rows
        rec[1][positions] = True

    def take(self, key: str) -> tuple[bytes, tuple[int, int, int], int] | None:
        """Remove and return what was recorded under ``key``: ``(bytes of int16 [n, num_layers,
        top_k], shape, positions below n never forwarded)``, ``n`` being one past the last
        position recorded; ``None`` if nothing was (or it was dropped, ``max_kept``). Raw bytes:
        ``collective_rpc`` results cross a process boundary."""
        rec = self.kept.pop(key, None)
        if rec is None:
            return None
        rows, recorded = rec
        n = int(np.flatnonzero(recorded)[-1]) + 1 if recorded.any() else 0
        return rows[:n].tobytes(), (n, len(self.layers), self.top_k), int((~recorded[:n]).sum())


def lora_request():
    """The ``LoRARequest`` of the policy's adapter (``LORA_ID``), attached to every request."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, LORA_PATH)


class AsyncRLWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``), called via ``collective_rpc``."""

    def async_rl_weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``engine_weight_names`` of the served model (for the name-mapping check)."""
        return engine_weight_names(self.model_runner.get_model())

    def async_rl_record_routing(self) -> tuple[int, int] | str:
        """Start recording routed experts for the requests that ask (``RoutingRecorder``; once,
        later calls return at once); returns ``(num_moe_layers, top_k)``, or why it cannot (the
        ``RoutingRecorder`` error: no MoE layer, a monolithic kernel, a compiled model) as a
        string: raised here, vLLM's engine core would log the refusal as a worker failure with
        its traceback."""
        rec = getattr(self, "_async_rl_routing", None)
        if rec is None:
            try:
                rec = self._async_rl_routing = RoutingRecorder(self.model_runner)
            except ValueError as e:
                return str(e)
        return len(rec.layers), rec.top_k

    def async_rl_take_routing(self, key: str) -> tuple[bytes, tuple[int, int, int], int] | None:
        """``RoutingRecorder.take(key)`` (``None`` if recording never started)."""
        rec = getattr(self, "_async_rl_routing", None)
        return None if rec is None else rec.take(key)

    def async_rl_expert_names(self) -> dict[str, tuple[str, str]]:
        """``engine_expert_names`` of the served model (``{}`` for a dense model)."""
        return engine_expert_names(self.model_runner.get_model())

    def async_rl_lora_names(self, lora: dict[str, Any]) -> list[str]:
        """The adapter names an update must carry for LoRA settings ``lora`` (``async_rl.utils.lora.spec``):
        one ``lora_A``/``lora_B`` pair per targeted HF projection of vLLM's LoRA modules."""
        manager = self.model_runner.lora_manager._adapter_manager
        return expected_vllm_adapter_names(list(manager.modules), dict(manager.packed_modules_mapping),
                                           list(lora["target_modules"]))

    def async_rl_init_lora(self, rank: int) -> None:
        """Register a zero adapter of ``rank`` under ``LORA_ID`` (the base model, until an update)."""
        self.model_runner.lora_manager.add_dummy_lora(lora_request(), rank)

    def async_rl_load_lora(self, plan: dict[str, Any], lora: dict[str, Any]) -> None:
        """Receive an adapter update (``UpdatePlan.to_dict()``) and swap it in under ``LORA_ID``.

        Staged: every bucket is received (copied) and vLLM's ``LoRAModel`` built before the
        adapter in use is touched, so a failure up to there leaves it serving the old adapter
        (``intact`` stays True); only a failure inside the swap itself leaves ``intact`` False.

        Raises:
            RuntimeError: no weight receiver connected, the transfer failed (sender error,
                timeout), or vLLM rejects the adapter (rank above ``max_lora_rank``).
        """
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        eng = self.weight_transfer_engine
        if eng.receiver is None:
            raise RuntimeError("adapter update before init_weight_transfer_engine")
        update = UpdatePlan.from_dict(plan)
        tensors = {}
        for bucket in eng.receiver.receive(update):
            tensors.update((name, t.clone()) for name, t in bucket)  # the bucket's memory is reused
        worker_manager = self.model_runner.lora_manager
        helper = PEFTHelper.from_dict({"r": int(lora["rank"]), "lora_alpha": float(lora["alpha"]),
                                       "target_modules": list(lora["target_modules"])})
        helper.validate_legal(worker_manager.lora_config)
        model = self.model_runner.get_model()
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        adapter = LoRAModel.from_lora_tensors(
            LORA_ID, tensors, helper, device="cpu", dtype=worker_manager.lora_config.lora_dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None)
        manager = worker_manager._adapter_manager
        # Same id: removing frees its slot, activating copies the new matrices into it. Between
        # the two no complete adapter is loaded.
        eng.intact = False
        manager.remove_adapter(LORA_ID)
        manager.add_adapter(adapter)
        manager.activate_adapter(LORA_ID)
        eng.intact = True
        eng.num_updates += 1

    def async_rl_check_update(self, plan: dict[str, Any], lora: dict[str, Any] | None = None) -> None:
        """Check a whole update against the model before any byte moves (``check_update``: names,
        coverage, full shapes, dtypes, tied aliases; with LoRA settings ``lora``: exactly the
        adapter names, ``async_rl_lora_names``, with ``lora_A`` ``[rank, in]`` and ``lora_B``
        ``[out, rank]``); on failure the sender is told (it raises at once) and this raises."""
        eng = self.weight_transfer_engine
        update = UpdatePlan.from_dict(plan)
        try:
            if lora is not None:
                names = self.async_rl_lora_names(lora)
                # A multimodal model's adapters arrive under the learner's module paths
                # (Qwen2-VL: model.language_model.layers...), vLLM's slots are under its own.
                rename = CheckpointNames(self.model_runner.get_model())
                sent = [(PEFT_PREFIX + rename(m.name.removeprefix(PEFT_PREFIX)) if m.name.startswith(PEFT_PREFIX)
                         else m.name, m.dtype, m.shape, m.alias_of) for b in update.buckets for m in b]
                check_update(sent, names, specs=adapter_specs(names, eng.specs, int(lora["rank"])))
            else:
                eng.check(update)
        except Exception as e:
            if eng.receiver is not None:
                eng.receiver.fail(update, f"{type(e).__name__}: {e}")
            raise

    def async_rl_abort_update(self) -> bool:
        """After a failed update: unwind it (``AsyncRLWeightTransferEngine.abort_weight_update``)
        and end vLLM's update session; returns whether the model still holds its previous version
        whole (no byte of the failed update reached it)."""
        eng = self.weight_transfer_engine
        # vLLM ends its session itself when a chunk fails, but not when finishing fails.
        self._weight_update_active = False
        eng.reset_weight_update_target()
        return eng.abort_weight_update()  # a LoRA update has no reload to unwind: just ``intact``

    def async_rl_update_metrics(self) -> dict[str, float]:
        """Phase seconds of this worker's last full-weight update: ``weight_sync/engine_recv_s``
        (``update_weights``: waiting for buckets, loading, processing, copying what the reload
        keeps), ``engine_load_s`` (the model's ``load_weights`` less the processing in it),
        ``engine_process_s`` (the quant methods' re-processing, e.g. the oneDNN re-pack, during
        the load and at finalize), ``engine_own_s`` (``own_pending``), ``engine_finalize_s``."""
        eng = getattr(self, "weight_transfer_engine", None)
        return dict(getattr(eng, "metrics", {}))

    def async_rl_num_updates(self) -> int:
        """Updates this worker's engine has loaded."""
        eng = getattr(self, "weight_transfer_engine", None)
        return getattr(eng, "num_updates", 0)
