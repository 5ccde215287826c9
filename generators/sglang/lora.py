"""LoRA adapters on an SGLang engine: the adapter matrices an update must carry, and loading each
update as a new adapter (SGLang's ``load_lora_adapter_from_tensors``) while requests started on
the previous one finish on it. A mixin of ``SGLangGenerator``, which holds the state it reads."""

from __future__ import annotations

import torch

from async_rl.utils.lora import PEFT_PREFIX, targets


class SGLangAdapters:
    """The LoRA half of ``SGLangGenerator`` (mixed in; not an engine on its own).

    Reads the generator's ``lora`` (``async_rl.utils.lora.spec``), ``_specs`` / ``_tied`` (the
    checkpoint's ``{name: (dtype, shape)}`` and tied aliases), ``engine``, ``cfg``, the version
    counters and the pause hooks ``_pause`` / ``_continue``; owns ``_adapter`` (the adapter new
    requests use), ``_adapter_version`` (adapter name -> policy version) and ``_adapter_users``
    (adapter name -> running requests).
    """

    def _adapter_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        # lora_A [r, in] and lora_B [out, r] of every targeted 2-D weight, in the engine's dtype.
        r, out = self.lora["rank"], {}
        for name, (dtype, shape) in self._specs.items():
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and len(shape) == 2 and name not in self._tied and \
                    targets(module, self.lora["target_modules"]):
                out[f"{PEFT_PREFIX}{module}.lora_A.weight"] = (dtype, (r, shape[1]))
                out[f"{PEFT_PREFIX}{module}.lora_B.weight"] = (dtype, (shape[0], r))
        return out

    async def _load_adapter(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        # A new adapter under a new name: requests started on the previous one finish on it (an
        # adapter cannot change under a running request); it is unloaded once none uses it.
        from sglang.srt.managers.io_struct import LoadLoRAAdapterFromTensorsReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        name = f"v{version}.{self.num_loads + 1}"
        config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.lora["rank"],
                  "lora_alpha": self.lora["alpha"], "lora_dropout": 0.0, "bias": "none",
                  "target_modules": list(self.lora["target_modules"])}
        obj = LoadLoRAAdapterFromTensorsReqInput(
            lora_name=name, config_dict=config,
            serialized_named_tensors=[MultiprocessingSerializer.serialize(dict(named))])
        result = await self.engine.tokenizer_manager.load_lora_adapter_from_tensors(obj, None)
        if not result.success:
            raise RuntimeError(f"SGLang refused LoRA adapter v{version}: {result.error_message}")
        self._adapter_version[name] = version
        self._adapter = name

    async def _unload_unused(self) -> None:
        from sglang.srt.managers.io_struct import UnloadLoRAAdapterReqInput

        for name in [n for n in self._adapter_version if n != self._adapter and not self._adapter_users.get(n)]:
            del self._adapter_version[name]
            self._adapter_users.pop(name, None)
            await self.engine.tokenizer_manager.unload_lora_adapter(UnloadLoRAAdapterReqInput(lora_name=name), None)

    async def _apply_adapter(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        # The base weights are untouched: no weight-update session. ``abort`` aborts the running
        # requests so they are re-issued on the new adapter; ``keep`` lets them finish on theirs.
        try:
            await self._load_adapter(named, version)
        except Exception as e:
            raise RuntimeError(f"SGLang engine: LoRA update v{version} failed ({type(e).__name__}: {e}); still "
                               f"serving v{self.policy_version}") from e
        if self.cfg.partial_rollout == "abort" and self._active:
            await self._pause()
            await self._continue()
        self.policy_version = version
        self.num_loads += 1
        await self._unload_unused()
