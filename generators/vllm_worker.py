"""Code that runs inside vLLM's worker processes: our weight-transfer engine and worker extension.

vLLM loads this module in every worker because the engine is created with
``worker_extension_cls="generators.vllm_worker.AsyncRLWorkerExtension"``; importing it registers
the ``async_rl`` backend with vLLM's ``WeightTransferEngineFactory`` before the worker builds its
weight-transfer engine (``weight_transfer_config={"backend": "async_rl"}``). The engine then
follows vLLM's native RL weight-update lifecycle, driven from ``AsyncLLM``:

* ``init_weight_transfer_engine``: connect a ``WeightReceiver`` (shm slots or a gloo/NCCL group);
* ``start_weight_update``: vLLM's layerwise reload begins (kernels that repack weights, such as
  the CPU build's oneDNN linears, are restored to checkpoint layout and re-processed once a
  module has all its weights, or at finalize; one update thus spans several buckets in one
  session, unlike separate ``reload_weights`` calls, which must not split a layer);
* ``update_weights``: load bucket by bucket with the model's own ``load_weights`` (HF names; the
  loader fuses q/k/v and gate/up and converts dtypes), from copies of the bucket (the reload may
  keep tensors until finalize, while the bucket's memory is reused); the names were checked
  against the model (``map_to_engine``) by ``async_rl_check_update`` before the reload began;
* ``finish_weight_update``: finalize the layerwise reload.

Tensors never travel through ``collective_rpc`` (vLLM cannot pickle them intact there); only the
plan (names, dtypes, shapes, offsets) does.

**LoRA** (engine started with ``enable_lora``): the base weights never change; an update carries
only the adapter matrices (``learners.lora``) and bypasses the reload lifecycle. At start-up
``async_rl_init_lora`` registers a zero adapter under one fixed id (the engine then computes
exactly the base model), which every request names. ``async_rl_load_lora`` receives an update's
buckets through the same ``WeightReceiver``, builds vLLM's ``LoRAModel`` from the tensors in
memory (``LoRAModel.from_lora_tensors``, the loader behind vLLM's adapter directories, which
fuses q/k/v and gate/up) and swaps it in under the same id: the slot is freed and refilled, so no
adapter of an older version stays in memory and requests frozen by a ``keep`` pause continue on
the new adapter, exactly as they would continue on new full weights. vLLM's own ``add_lora``
path needs a directory on disk per version; this one never touches the disk.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from async_rl.weight_sync import UpdatePlan, WeightReceiver, map_to_engine

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
    required: without it vLLM's CPU build keeps the old head, see ``../shared/MEASURED.md``).
    """
    names = [n for n, _ in model.named_parameters()]
    packed = {k: list(v) for k, v in (getattr(model, "packed_modules_mapping", None) or {}).items()}
    config = getattr(model, "config", None)
    tied = {}
    if getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in names:
        embed = next((n for n in names if n.endswith("embed_tokens.weight")), None)
        if embed is not None:
            tied["lm_head.weight"] = embed
    return names, packed, tied


class AsyncRLWeightTransferEngine(WeightTransferEngine[AsyncRLInitInfo, AsyncRLUpdateInfo]):
    """vLLM weight-transfer engine receiving ``async_rl.weight_sync`` buckets (see module docstring)."""

    init_info_cls = AsyncRLInitInfo
    update_info_cls = AsyncRLUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.receiver: WeightReceiver | None = None
        # Names are read before any reload (a reload swaps parameters for meta tensors).
        self.names, self.packed, self.tied = engine_weight_names(self.model)
        self.num_updates = 0

    def init_transfer_engine(self, init_info: AsyncRLInitInfo) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = WeightReceiver(init_info.info, init_info.rank)
        self.receiver.connect()

    def check(self, names: list[str]) -> None:
        """Raise unless ``names`` map one-to-one onto this model's parameters (``map_to_engine``)."""
        map_to_engine(names, self.names, self.packed, self.tied)
        missing_alias = [n for n in self.tied if n not in names]
        if missing_alias:
            raise ValueError(f"tied model: {missing_alias} must be sent (as an alias of {self.tied[missing_alias[0]]!r})")

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: AsyncRLUpdateInfo) -> None:
        if self.receiver is None:
            raise RuntimeError("update_weights before init_weight_transfer_engine")
        plan = UpdatePlan.from_dict(update_info.plan)
        # The names were checked by ``async_rl_check_update`` before the reload began.
        for bucket in self.receiver.receive(plan):
            # The layerwise reload may keep a module's tensors until finalize (a tied output head
            # is only completed there), and the bucket's memory is reused by the next bucket:
            # hand it copies. Measured: without them a multi-bucket update diverged from a fresh
            # engine (tests/test_vllm.py).
            self.model.load_weights([(name, t.clone()) for name, t in bucket])
        self.num_updates += 1

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None


if BACKEND not in getattr(WeightTransferEngineFactory, "_registry", {}):
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, AsyncRLWeightTransferEngine)
    except ValueError:  # already registered by an earlier import in this process
        pass


def lora_request():
    """The ``LoRARequest`` of the policy's adapter (``LORA_ID``), attached to every request."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(LORA_NAME, LORA_ID, LORA_PATH)


class AsyncRLWorkerExtension:
    """Methods mixed into vLLM's worker (``worker_extension_cls``), called via ``collective_rpc``."""

    def async_rl_weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``engine_weight_names`` of the served model (for the name-mapping check)."""
        return engine_weight_names(self.model_runner.get_model())

    def async_rl_lora_names(self, lora: dict[str, Any]) -> list[str]:
        """The adapter names an update must carry for LoRA settings ``lora`` (``learners.lora.spec``):
        one ``lora_A``/``lora_B`` pair per targeted HF projection of vLLM's LoRA modules."""
        from learners.lora import expected_vllm_adapter_names

        manager = self.model_runner.lora_manager._adapter_manager
        return expected_vllm_adapter_names(list(manager.modules), dict(manager.packed_modules_mapping),
                                           list(lora["target_modules"]))

    def async_rl_init_lora(self, rank: int) -> None:
        """Register a zero adapter of ``rank`` under ``LORA_ID`` (the base model, until an update)."""
        self.model_runner.lora_manager.add_dummy_lora(lora_request(), rank)

    def async_rl_load_lora(self, plan: dict[str, Any], lora: dict[str, Any]) -> None:
        """Receive an adapter update (``UpdatePlan.to_dict()``) and swap it in under ``LORA_ID``.

        Raises:
            RuntimeError: no weight receiver connected, or vLLM rejects the adapter (rank above
                ``max_lora_rank``).
        """
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        eng = self.weight_transfer_engine
        if eng.receiver is None:
            raise RuntimeError("adapter update before init_weight_transfer_engine")
        tensors = {}
        for bucket in eng.receiver.receive(UpdatePlan.from_dict(plan)):
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
        # Same id: removing frees its slot, activating copies the new matrices into it.
        manager.remove_adapter(LORA_ID)
        manager.add_adapter(adapter)
        manager.activate_adapter(LORA_ID)
        eng.num_updates += 1

    def async_rl_check_update(self, plan: dict[str, Any], lora: dict[str, Any] | None = None) -> None:
        """Check an update's names against the model before any byte moves (``map_to_engine``;
        with LoRA settings ``lora``: exactly the adapter names, ``async_rl_lora_names``); on
        failure the sender is told (it raises at once) and this raises."""
        from learners.lora import check_adapter_names

        eng = self.weight_transfer_engine
        update = UpdatePlan.from_dict(plan)
        try:
            if lora is not None:
                check_adapter_names(update.names, self.async_rl_lora_names(lora))
            else:
                eng.check(update.names)
        except Exception as e:
            if eng.receiver is not None:
                eng.receiver.fail(update, f"{type(e).__name__}: {e}")
            raise

    def async_rl_num_updates(self) -> int:
        """Updates this worker's engine has loaded."""
        eng = getattr(self, "weight_transfer_engine", None)
        return getattr(eng, "num_updates", 0)
