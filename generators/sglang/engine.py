"""SGLang generator: an offline ``sglang.Engine`` per generator, driven through SGLang's RL interfaces.

The engine is SGLang's offline ``Engine`` created inside the owning process (a generator actor,
or the trainer process in sync mode), not its HTTP server beside it: the generator already lives
in its own process, so a server would add an HTTP hop and JSON (de)serialisation per request and
a port per actor for nothing; the offline engine speaks the same ``TokenizerManager`` interfaces
(``update_weights_from_tensor``, ``init_weights_update_group``, ``update_weights_from_distributed``,
``pause_generation``/``continue_generation``, ``flush_cache``) and keeps its scheduler and
detokenizer in subprocesses. Those coroutines run on an asyncio loop in a background thread of
the owning process, so ``generate`` and ``receive_weights`` may come from different threads
(weights arrive while a batch decodes), as with the vLLM engine.

* **Sampling**: every sample is its own request seeded with ``sampling_seed = mix_seed(seed, j)``.
  On GPU the engine runs SGLang's deterministic inference, whose sampler draws each position from
  the seed and the position only, so sample j of a prompt does not depend on its batch. SGLang
  refuses deterministic inference with its CPU attention backend (``torch_native``), so on CPU
  samples come from the engine's seeded global generator: a run is reproducible only as a whole,
  and a sample depends on what else the engine was sampling. Behavior log-probs are those of the distribution the
  token was drawn from: with temperature only SGLang's ``return_logprob`` values
  (``log_softmax(logits / T)``); with top-k or top-p SGLang's ``return_sampling_mask`` in
  ``selected`` mode, the sampled token's log-prob after truncation and renormalisation (what the
  HF engine and vLLM's ``processed_logprobs`` report; Fu et al., AReaL, arXiv 2505.24298, sec. 4).
* **Weights** (the engine's ``model.load_weights`` takes Hugging Face names): ``colocated``
  (``update_weights``) and ``shm`` hand named tensors to ``update_weights_from_tensor``;
  ``broadcast`` joins the learner's group with ``init_weights_update_group`` and loads each
  bucket with ``update_weights_from_distributed(load_format="flattened_bucket")`` while the
  learner broadcasts it (``async_rl.weight_sync.wire``, protocol ``sglang``). Every update is
  checked whole against the checkpoint's names, shapes and dtypes before a byte moves. ``shm``
  buckets are staged in this process and loaded in one call, so a sender failure mid-stream
  leaves the engine on its old weights; ``broadcast`` buckets load as they arrive, so a failure
  after the first leaves the engine unusable (``generate`` raises) until a complete update.
* **In-flight requests** (``partial_rollout``): ``keep`` pauses with
  ``pause_generation(mode="in_place")`` (requests and their KV stay), loads, and continues; SGLang
  tags each output token with the ``weight_version`` it was sampled under. ``abort`` pauses with
  ``mode="abort"``, flushes the cache, and re-issues each unfinished sample with its partial
  tokens appended to the prompt (PipelineRL arXiv 2509.19128; AReaL 2505.24298).
* **LoRA** (``lora`` with ``rank > 0``): the engine starts with SGLang's LoRA enabled; each update
  carries only the adapter matrices (peft's saved names, ``async_rl.utils.lora``), checked whole, and is
  loaded as a new adapter (``load_lora_adapter_from_tensors``) that new requests use. A running
  request keeps the adapter it started with (SGLang cannot swap it underneath), so in ``keep``
  mode its tokens keep the old version; ``abort`` re-issues it on the new adapter. An adapter is
  unloaded once no request uses it. Over ``colocated`` and ``shm`` only.
* **Prefix cache**: each request carries ``cache_salt = "v<version>.<loads>"`` (``loads``: complete
  updates so far, since a version can be pushed twice with different weights: the warm start's
  weights go out as version 0 again), so no request reuses KV computed under older weights (``keep``'s frozen requests keep their own KV: that is what keep
  means); ``abort`` updates also ``flush_cache``.
* **Images** (a vision-language model; Qwen2-VL): ``generate``'s ``images`` go through SGLang's
  own multimodal path as its ``processor_output`` input: our patches and grids, with the prompt
  ids already expanded, so SGLang re-processes nothing and its vision tower encodes them.
  SGLang's cache of vision-tower outputs (keyed by image content, never cleared by a weight
  update, and not saltable per request in 0.5.23) is off: each request encodes its images
  (``async_rl.generators.sglang.vision``); the prefix cache is salted per weights as for text.
  The input-only markup (``async_rl.utils.vision.input_only_token_ids``) gets a ``-inf``
  ``logit_bias``, which SGLang adds before sampling and before computing the returned
  log-probs, so behaviour log-probs are renormalised over the other tokens as the learner's
  are. On CPU, ``async_rl.generators.sglang.vision`` fixes what SGLang's Qwen2-VL needs there
  (a renamed config field, kernel names its processor module looks up at import).
* **CPU**: SGLang has no supported CPU wheel; the repository's ``envs/sglang-cpu/build.sh`` builds the test venv
  (``--no-deps`` install beside the +cpu torch, with two stand-ins; see that script). On CPU the engine runs fp32 with ``attention_backend=torch_native``.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import json
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from async_rl.generators.base import (GeneratorConfig, Sample, SamplingParams, check_request, mix_seed, row_seeds,
                                      sample_rows)
from async_rl.generators.capabilities import EngineCapabilities
from async_rl.generators.sglang.lora import SGLangAdapters
from async_rl.generators.sglang.process import engine_files, engine_kwargs, engine_sockets, quiet_warnings, stop_processes
from async_rl.generators.sglang.vision import (ENGINE_ENVIRONMENT, image_offsets, image_request,
                                               register_kernel_stand_ins)
from async_rl.utils.lora import lora_enabled, spec
from async_rl.utils.vision import check_images, image_token_id, input_only_token_ids


def checkpoint_specs(model_path: str, dtype: str) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, str]]:
    """``({HF name: (engine dtype name, shape)}, tied aliases)`` of a Hugging Face checkpoint, read
    from its safetensors headers (no tensor is loaded): what an SGLang engine started from it loads.

    Args:
        model_path: model directory (``*.safetensors`` and ``config.json``).
        dtype: the engine's dtype name (``float32``, ``bfloat16``...); ``auto`` keeps each tensor's.

    Raises:
        FileNotFoundError: no ``*.safetensors`` file in ``model_path``.
    """
    from safetensors import safe_open

    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {model_path}: the SGLang engine's weights cannot be checked")
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                kept = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}.get(sl.get_dtype(), sl.get_dtype())
                specs[name] = (kept if dtype == "auto" else dtype, tuple(int(s) for s in sl.get_shape()))
    config = json.loads((Path(model_path) / "config.json").read_text())
    tied = {}
    if config.get("tie_word_embeddings") and "lm_head.weight" not in specs and "model.embed_tokens.weight" in specs:
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
        specs["lm_head.weight"] = specs["model.embed_tokens.weight"]
    return specs, tied


class SGLangGenerator(SGLangAdapters):
    """An SGLang offline ``Engine`` used as a rollout engine (see the module docstring).

    Args:
        model_path: Hugging Face model directory of the starting weights.
        cfg: generator settings (``cfg.sglang`` for the engine; ``max_batch_size`` caps the
            engine's running requests).
        pad_token_id: unused (SGLang does not pad); kept for the common constructor signature.
        device: ``cpu`` or ``cuda``.
        num_threads: CPU: OpenMP threads of the engine's scheduler process (0 = torch's default).
        lora: the learner's ``LoRAConfig``; with ``rank > 0`` the engine serves the base model plus
            that adapter (SGLang's LoRA, loaded from tensors by peft name) and updates carry only
            the adapter matrices, over ``colocated`` or ``shm``. ``None`` = no LoRA.

    Raises:
        ImportError: SGLang is not installed (on CPU: the async-rl repository's ``envs/sglang-cpu/build.sh``).
        ValueError: LoRA with a vision-language model (not served yet).
        RuntimeError: the engine failed to start (its error).
    """

    # In the learner's process it takes tensors (update_weights_from_tensor); across processes its
    # schedulers join a broadcast group themselves (protocol "sglang"), and adapters travel only
    # as tensors, so LoRA cannot ride the broadcast.
    capabilities = EngineCapabilities(name="SGLang", colocated=True, separate_processes=True, protocol="sglang",
                                      lora_transports=frozenset({"colocated", "shm"}),
                                      context_key="sglang.context_length", picks_device=True, library="sglang",
                                      install="on CPU build its venv with envs/sglang-cpu/build.sh and run from it",
                                      serves_images=True)

    def __init__(self, model_path: str, cfg: GeneratorConfig, pad_token_id: int | None = None,
                 device: str = "cpu", num_threads: int = 0, lora=None) -> None:
        quiet_warnings()
        import sglang  # noqa: F401  (fail early with the real ImportError)

        self.lora = spec(lora) if lora_enabled(lora) else None
        self.cfg, self.scfg = cfg, cfg.sglang
        self.model_path, self.device = model_path, device
        self.policy_version = 0
        self.num_weight_updates_in_flight = 0
        self.num_loads = 0
        """Complete weight updates loaded so far (part of the prefix-cache salt)."""
        self.num_reissued = 0
        """Samples aborted by a weight update and issued again (``partial_rollout: abort``)."""
        self._calls = itertools.count()
        self._active = 0
        self._update_pauses = 0
        """Pauses for a weight update so far: a request aborted by one (``partial_rollout: abort``)
        sees the count move past the value it started with, however late its abort is noticed."""
        self._unusable: str | None = None
        self._specs, self._tied = checkpoint_specs(model_path, self.scfg.dtype)
        self.image_token_id, self._logit_bias = _vision_tokens(model_path)
        """The image placeholder id of a vision-language model (``None`` for a text model), and the
        ``logit_bias`` that gives its input-only markup probability 0 (``None``: nothing to suppress)."""
        if self.lora is not None and self.image_token_id is not None:
            # Untested: SGLang's adapter loader would get the learner's vision-language module paths.
            raise ValueError(f"the SGLang engine does not serve LoRA adapters of a vision-language model "
                             f"({model_path}) yet; use generator.backend=vllm or hf, or learner.lora.rank=0")
        self._adapter: str | None = None
        """The LoRA adapter new requests use (``None``: none loaded yet, i.e. the zero adapter)."""
        self._adapter_version: dict[str, int] = {}
        self._adapter_users: dict[str, int] = {}
        self._receiver = None
        self._group: str | None = None
        self.engine = None
        self._child_pids: list[int] = []
        if device == "cpu":
            os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
            if num_threads:
                # The scheduler subprocess inherits these; SGLang binds cores itself only on AMX CPUs.
                os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sglang-loop", daemon=True)
        self._thread.start()
        self._resumed: asyncio.Event | None = None
        try:
            self.engine = self._call(self._start(), timeout=900)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ plumbing
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        import psutil
        import sglang as sgl

        self._resumed = asyncio.Event()
        self._resumed.set()
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        kwargs = engine_kwargs(self.model_path, self.cfg, self.device, self.lora)
        if self.image_token_id is not None:
            # SGLang's multimodal processors are imported here, in the TokenizerManager's process;
            # the environment is read by the scheduler process, which inherits it when spawned.
            register_kernel_stand_ins()
            os.environ.update(ENGINE_ENVIRONMENT)
        # Built on this loop's thread: the engine adopts the running loop, and SGLang then
        # installs no signal handlers (a SIGQUIT handler that kills this whole process tree).
        engine = sgl.Engine(**kwargs)
        # Python's resource tracker is shared by the whole process (SGLang's spawn may be what
        # started it): killed with the engine, it would be restarted at exit and print a traceback
        # for every segment unregistered there.
        from multiprocessing import resource_tracker

        tracker = getattr(resource_tracker._resource_tracker, "_pid", None)
        self._child_pids = [p.pid for p in psutil.Process().children(recursive=True)
                            if p.pid not in before and p.pid != tracker]
        # The engine's exit hook kills every child of this process (Ray's, the learner's, the
        # resource tracker, whose loss turns each later semaphore cleanup into a traceback):
        # at exit only this engine's own processes are stopped.
        atexit.unregister(engine.shutdown)
        atexit.register(self.close)
        return engine

    def close(self) -> None:
        """Stop the engine's subprocesses (only its own: ``Engine.shutdown`` would kill every child
        of this process, Ray's and the learner's included) and the loop thread. Idempotent."""
        atexit.unregister(self.close)
        if self._receiver is not None:
            self._receiver.close()
            self._receiver = None
        leftovers: list[str] = []
        sockets: list = []
        if self.engine is not None:
            watchdog = getattr(self.engine.tokenizer_manager, "_subprocess_watchdog", None)
            if watchdog is not None:
                watchdog.stop()
            leftovers = engine_files(self.engine)
            sockets = engine_sockets(self.engine)
            self.engine = None
        stop_processes(self._child_pids)
        self._child_pids = []
        # Stopped processes skip SGLang's own cleanup: its IPC socket files (under the temp dir)
        # and its load-snapshot segment (/dev/shm) would be left behind by every engine.
        for path in leftovers:
            try:
                os.unlink(path)
            except OSError:
                pass
        if self.loop.is_running():
            async def cancel_pending() -> None:
                # SGLang's result-handling tasks live on this loop; cancelled and awaited here,
                # they do not die pending (with a warning per task) when the loop stops.
                tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                # Closed here, on the loop that owns them, without lingering: left to the garbage
                # collector, a context whose socket still queues a message for the stopped
                # scheduler blocks forever in zmq_ctx_term, in whatever thread collects it (it
                # hung the next engine's start in a test run).
                for sock in sockets:
                    sock.close(linger=0)

            try:
                self._call(cancel_pending(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort: the processes are gone already
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        for sock in sockets:
            if not sock.closed:  # the loop was gone or did not answer: closed from here instead
                sock.close(linger=0)

    def _cache_salt(self) -> str:
        return f"v{self.policy_version}.{self.num_loads}"

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(self._unusable)

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_sample: Callable[[int, int, Sample], None] | None = None,
                 images: Sequence[Any] | None = None) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt (same contract as ``HFGenerator.generate``).

        ``on_sample`` is called from the engine's loop thread as each sample finishes.
        ``images``: one ``async_rl.data.images.ImageInputs`` or ``None`` per prompt (a
        vision-language model); the prompt ids hold one placeholder per merged patch, and SGLang
        takes them as they are with the images' patches (``vision.image_request``).

        Raises:
            ValueError: ``n < 1``, no stop token ids, ``seeds`` or ``images`` of the wrong length,
                images for a text model, or a prompt whose placeholders do not match its images.
            RuntimeError: the engine is unusable (a weight update failed after its first loaded
                bucket) until a complete update succeeds, or SGLang ended a request with an error.
        """
        check_request(n, params)
        images = check_images(images, len(prompts), self.image_token_id, f"SGLang's model {self.model_path}")
        self._check_usable()
        if images is not None:  # refused here, in one line, before any request starts
            for prompt, x in zip(prompts, images):
                if x is not None:
                    image_offsets(prompt, x.tokens_per_image, self.image_token_id)
        seeds_of_rows = row_seeds(self.cfg.seed, self._calls, n, len(prompts), seeds)
        # ``sample_rows`` hands each row its prompt's ids; a row finds its images by prompt index.
        return self._call(sample_rows(
            lambda row, seed: self._sample(prompts[row[0]], params, seed, images[row[0]] if images else None),
            [[i] for i in range(len(prompts))], n, seeds_of_rows, on_sample))

    def _image_fields(self, prompt: list[int], images) -> dict[str, Any]:
        # A request's multimodal fields (none for a prompt without images).
        if images is None or not len(images.image_grid_thw):
            return {}
        return image_request(prompt, images, self.image_token_id)

    async def _sample(self, prompt: list[int], params: SamplingParams, seed: int, images=None) -> Sample:
        from sglang.srt.managers.io_struct import GenerateReqInput

        processed = not params.greedy and (params.top_k > 0 or params.top_p < 1.0)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        while True:
            await self._resumed.wait()
            self._check_usable()
            sp = {"max_new_tokens": params.max_tokens - len(tokens),
                  "temperature": 0.0 if params.greedy else params.temperature,
                  "top_p": 1.0 if params.greedy else params.top_p,
                  "top_k": -1 if params.greedy or params.top_k == 0 else params.top_k,
                  # A re-issued (aborted) sample cannot continue its old RNG stream: derive a new one.
                  "sampling_seed": mix_seed(seed, len(tokens)) if tokens else seed,
                  "stop_token_ids": list(params.stop_token_ids), "no_stop_trim": True,
                  "skip_special_tokens": False, "logit_bias": self._logit_bias}
            adapter = self._adapter
            # The images' placeholders are all in the prompt: tokens sampled so far stay text.
            obj = GenerateReqInput(input_ids=prompt + tokens, sampling_params=sp, return_logprob=True,
                                   return_sampling_mask=processed or None,
                                   sampling_logprobs_mode="selected" if processed else None,
                                   top_logprobs_num=params.top_logprobs,
                                   cache_salt=self._cache_salt(), rid=uuid.uuid4().hex, lora_path=adapter,
                                   **self._image_fields(prompt, images))
            version_at_start, pauses_at_start = self.policy_version, self._update_pauses
            self._active += 1
            if adapter is not None:
                self._adapter_users[adapter] = self._adapter_users.get(adapter, 0) + 1
            try:
                out = await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()
            finally:
                self._active -= 1
                if adapter is not None:
                    self._adapter_users[adapter] -= 1
                    await self._unload_unused()
            meta = out["meta_info"]
            ids = [int(t) for t in out["output_ids"]]
            if processed:
                lps = [float(x) for x in meta.get("output_token_sampling_logprobs", [])]
            else:
                lps = [float(x[0]) for x in meta.get("output_token_logprobs", [])]
            if len(lps) != len(ids):
                raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} log-probs")
            tokens += ids
            logprobs += lps
            if params.top_logprobs:
                # Per position [(log-prob, token id, text)], most likely first.
                got = meta.get("output_top_logprobs") or []
                if len(got) != len(ids):
                    raise RuntimeError(f"SGLang returned top log-probs for {len(got)} of {len(ids)} tokens")
                tops += [[(int(t[1]), float(t[0])) for t in position or []] for position in got]
            if self.lora is None:
                versions += _token_versions(meta, len(ids), version_at_start)
            else:
                # A running request keeps the adapter it started with: its tokens are that version's.
                versions += [self._adapter_version.get(adapter, 0) if adapter else 0] * len(ids)
            finish = (meta.get("finish_reason") or {}).get("type")
            if finish == "abort":
                self._check_usable()  # aborted because an update failed half-loaded
                if self._update_pauses > pauses_at_start and len(tokens) < params.max_tokens:
                    self.num_reissued += 1
                    continue
            if finish not in ("stop", "length"):
                raise RuntimeError(f"SGLang request ended with finish reason {meta.get('finish_reason')!r}")
            return Sample(response_ids=tokens, logprobs=logprobs, finish_reason=finish, policy_version=versions,
                          top_logprobs=tops)

    def prompt_logprobs(self, sequences: list[list[int]], images: Sequence[Any] | None = None) -> list[list[float]]:
        """Log-prob of each token of each sequence given the tokens before it (temperature 1,
        nothing suppressed), from the engine's prefill: ``len(seq) - 1`` floats per sequence.
        What the fresh-engine checks compare between an updated engine and one started from the
        same weights.

        ``images``: one ``ImageInputs`` or ``None`` per sequence, as ``generate``'s (the
        sequence's placeholders are those of its images). A position whose token is an image
        placeholder of a row with images gets 0.0: SGLang scores there the hash-derived pad id it
        puts in place of the placeholder, which means nothing (as the learner's
        ``zero_input_only_labels``).

        Raises:
            ValueError: a sequence shorter than 2 tokens, or images as ``generate`` refuses them.
            RuntimeError: the engine is unusable.
        """
        from sglang.srt.managers.io_struct import GenerateReqInput

        if any(len(s) < 2 for s in sequences):
            raise ValueError("prompt_logprobs needs sequences of at least 2 tokens")
        images = check_images(images, len(sequences), self.image_token_id, f"SGLang's model {self.model_path}")
        self._check_usable()

        async def one(seq: list[int], x) -> list[float]:
            fields = self._image_fields(list(seq), x)
            obj = GenerateReqInput(input_ids=list(seq), sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                   return_logprob=True, logprob_start_len=0, lora_path=self._adapter,
                                   cache_salt=f"score-{uuid.uuid4().hex}", rid=uuid.uuid4().hex, **fields)
            out = await self.engine.tokenizer_manager.generate_request(obj, None).__anext__()
            lps = [float(x[0]) for x in out["meta_info"]["input_token_logprobs"][1:]]
            return [0.0 if fields and t == self.image_token_id else v for t, v in zip(seq[1:], lps)]

        async def all_rows():
            return list(await asyncio.gather(*(one(s, images[i] if images else None) for i, s in enumerate(sequences))))

        return self._call(all_rows())

    # ------------------------------------------------------------------ weights
    def weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``(HF parameter names, {}, tied aliases)`` of the served checkpoint: SGLang's
        ``load_weights`` takes HF names and fuses q/k/v and gate/up itself. With LoRA ``(adapter
        names, {}, {})``: peft's saved-adapter names (``async_rl.utils.lora``), what SGLang's adapter
        loader parses."""
        if self.lora is not None:
            return list(self._adapter_specs()), {}, {}
        return [n for n in self._specs if n not in self._tied], {}, dict(self._tied)

    def weight_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """``{name: (engine dtype name, shape)}`` of every name an update may carry (with LoRA the
        adapter matrices: ``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``)."""
        return self._adapter_specs() if self.lora is not None else dict(self._specs)

    def _check(self, sent: list[tuple[str, Any, Sequence[int], str | None]]) -> None:
        from async_rl.weight_sync import check_update

        names, packed, tied = self.weight_names()
        check_update(sent, names, packed, tied, self.weight_specs())

    async def _pause(self) -> bool:
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        keep = self.cfg.partial_rollout == "keep"
        in_flight = self._active > 0
        self._update_pauses += 1
        self._resumed.clear()
        await self.engine.tokenizer_manager.pause_generation(
            PauseGenerationReqInput(mode="in_place" if keep else "abort"))
        return in_flight and keep

    async def _continue(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        self._resumed.set()
        await self.engine.tokenizer_manager.continue_generation(ContinueGenerationReqInput())

    async def _load_tensors(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
        from sglang.srt.utils import MultiprocessingSerializer

        obj = UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[MultiprocessingSerializer.serialize(named)],
            # keep: frozen requests hold KV in the cache, which SGLang refuses to flush; the
            # per-version cache salt keeps new requests off older entries instead.
            flush_cache=self.cfg.partial_rollout == "abort", weight_version=str(version))
        ok, message = await self.engine.tokenizer_manager.update_weights_from_tensor(obj, None)
        if not ok:
            raise RuntimeError(message)

    async def _apply(self, version: int, load) -> None:
        # Pause per partial_rollout, load, adopt the version, continue. ``load`` is the coroutine
        # that writes into the model; a failure inside it leaves the engine unusable.
        from sglang.srt.managers.io_struct import BeginWeightUpdateReqInput, EndWeightUpdateReqInput

        counted = await self._pause()
        try:
            try:
                # SGLang's weight-update session: restores loader state before, post-processes
                # the weights into kernel layout after.
                ok, message = await self.engine.tokenizer_manager.begin_weight_update(BeginWeightUpdateReqInput())
                if not ok:
                    raise RuntimeError(message)
                try:
                    await load()
                finally:
                    ok, message = await self.engine.tokenizer_manager.end_weight_update(EndWeightUpdateReqInput())
                if not ok:
                    raise RuntimeError(message)
            except Exception as e:
                self._unusable = (f"SGLang engine: weight update v{version} failed while loading ({type(e).__name__}: "
                                  f"{e}); its weights may mix two versions, so it refuses to sample until a complete "
                                  f"update succeeds")
                raise RuntimeError(self._unusable) from e
            self.policy_version = version
            self.num_loads += 1
            self._unusable = None
            self.num_weight_updates_in_flight += int(counted)
        finally:
            await self._continue()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load full tensors by Hugging Face name and adopt ``version``: SGLang's
        ``update_weights_from_tensor`` (the ``colocated`` transport's call), checked whole first.

        A tied model's head may be sent only if it equals the embedding (it is then dropped:
        SGLang's model shares it).

        Raises:
            KeyError, ValueError: refused before any byte moved (``check_update``; the message
                names the weights); the engine is untouched.
            RuntimeError: SGLang failed while loading (the engine is unusable until a complete update).
        """
        named = [(n, t.detach()) for n, t in named_tensors]
        if self.lora is not None:
            self._check([(n, t.dtype, tuple(t.shape), None) for n, t in named])
            self._call(self._apply_adapter([(n, t.contiguous()) for n, t in named], version))
            return
        by_name = dict(named)
        head, embed = by_name.get("lm_head.weight"), by_name.get("model.embed_tokens.weight")
        sent = [(n, t.dtype, tuple(t.shape), None) for n, t in named]
        if self._tied and head is not None and embed is not None and head.shape == embed.shape and torch.equal(head, embed):
            sent = [(n, d, s, "model.embed_tokens.weight" if n == "lm_head.weight" else None) for n, d, s, _ in sent]
        self._check(sent)
        named = [(n, t) for n, t in named if not (self._tied and n in self._tied)]
        self._call(self._apply(version, lambda: self._load_tensors(named, version)))

    def connect_weight_sync(self, init_info: dict[str, Any], rank: int) -> None:
        """Connect to a ``WeightSender`` (receiver ``rank``). ``broadcast`` (the sender's
        ``protocol`` must be ``sglang``): the engine's scheduler joins the learner's group through
        ``init_weights_update_group`` (rank ``rank + 1``), blocking until every member joined."""
        from async_rl.weight_sync import WeightReceiver

        if self._receiver is not None:
            self._receiver.close()
        self._receiver = WeightReceiver(init_info, rank)
        if self._receiver.transport == "broadcast":  # this rank's own (a sglang sender never mixes)
            if self.lora is not None:
                raise ValueError("an SGLang engine receives LoRA adapters over shm or colocated, not broadcast "
                                 "(SGLang loads adapters from tensors, not from a process group)")
            if init_info.get("protocol") != "sglang":
                raise ValueError("an SGLang engine joins a broadcast sender of protocol 'sglang' only")
            from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput

            self._group = init_info["group_name"]
            obj = InitWeightsUpdateGroupReqInput(
                master_address=init_info["host"], master_port=int(init_info["port"]),
                rank_offset=self._receiver.group_rank,
                world_size=int(init_info["world_size"]), group_name=self._group,
                backend="nccl" if str(init_info["device"]).startswith("cuda") else "gloo")
            ok, message = self._call(self.engine.tokenizer_manager.init_weights_update_group(obj, None))
            if not ok:
                raise RuntimeError(f"SGLang engine could not join the weight broadcast group: {message}")
        else:
            self._receiver.connect()

    def receive_weights(self, plan: dict[str, Any], version: int) -> float:
        """Load one update (``UpdatePlan.to_dict()``) from the connected sender; returns seconds.

        The plan is checked whole first (a refused plan leaves the engine untouched and tells the
        sender). ``shm``: every bucket is copied out of the slots, then loaded in one
        ``update_weights_from_tensor`` call (a sender failure midway leaves the engine on its old
        weights). ``broadcast``: each bucket is received by the engine's scheduler with
        ``update_weights_from_distributed`` while the sender broadcasts it; a failure after the
        first leaves the engine unusable until a complete update.

        Raises:
            RuntimeError: refused (untouched) or failed midway (the message says which).
            TimeoutError: a bucket did not arrive within ``weight_sync.timeout_s``.
        """
        from async_rl.weight_sync import UpdatePlan

        t0 = time.perf_counter()
        p = UpdatePlan.from_dict(plan)
        receiver = self._receiver
        if receiver is None:
            raise RuntimeError("receive_weights before connect_weight_sync")
        check = lambda names: self._check([(m.name, m.dtype, m.shape, m.alias_of) for b in p.buckets for m in b])  # noqa: E731
        try:
            if receiver.transport == "shm":
                staged: list[tuple[str, torch.Tensor]] = []
                for bucket in receiver.receive(p, check=check):
                    staged += [(n, t.clone()) for n, t in bucket if not (self._tied and n in self._tied)]
                if self.lora is not None:
                    self._call(self._apply_adapter(staged, version))
                else:
                    self._call(self._apply(version, lambda: self._load_tensors(staged, version)))
            else:
                try:
                    check(None)
                except Exception as e:
                    receiver.fail(p, f"{type(e).__name__}: {e}")
                    raise
                self._call(self._apply(version, lambda: self._load_broadcast(receiver, p, version)))
        except RuntimeError:
            raise
        except Exception as e:
            raise RuntimeError(f"SGLang engine: weight update v{version} refused or failed ({type(e).__name__}: "
                               f"{e}); serving v{self.policy_version}" + (" (now unusable)" if self._unusable else "")) from e
        return time.perf_counter() - t0

    async def _load_broadcast(self, receiver, plan, version: int) -> None:
        from sglang.srt.managers.io_struct import UpdateWeightsFromDistributedReqInput

        # The store protocol of ``WeightReceiver.receive`` (ready, acks, errors) without its
        # collective: the engine's scheduler joins each broadcast itself.
        receiver.store.add(f"{plan.update_id}/ready", 1)
        for i, metas in enumerate(plan.buckets):
            own = [m for m in metas if m.alias_of is None]
            obj = UpdateWeightsFromDistributedReqInput(
                names=[m.name for m in own], dtypes=[m.dtype for m in own], shapes=[list(m.shape) for m in own],
                group_name=self._group, load_format="flattened_bucket",
                flush_cache=self.cfg.partial_rollout == "abort" and i == len(plan.buckets) - 1,
                weight_version=str(version) if i == len(plan.buckets) - 1 else None)
            ok, message = await self.engine.tokenizer_manager.update_weights_from_distributed(obj, None)
            if not ok:
                receiver.fail(plan, f"bucket {i}: {message}")
                raise RuntimeError(message)
            receiver.store.add(f"{plan.update_id}/ack{i}", 1)


def _token_versions(meta: dict, n: int, default: int) -> list[int]:
    # SGLang tags output-token spans with the weight_version they were sampled under.
    spans = meta.get("weight_versions") or []
    out = [default] * n
    for span in spans:
        try:
            v = int(span["version"])
        except (KeyError, TypeError, ValueError):
            continue
        for k in range(max(0, int(span["start"])), min(n, int(span["end"]))):
            out[k] = v
    return out


def _vision_tokens(model_path: str) -> tuple[int | None, dict[str, float] | None]:
    """``(image placeholder id, logit_bias)`` of the model at ``model_path``: the placeholder of a
    vision-language model (``None`` for a text model), and SGLang's ``logit_bias`` (``{token id
    as str: -inf}``) of its input-only markup (``utils.vision.input_only_token_ids``), ``None``
    when there is none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    suppressed = input_only_token_ids(config)
    return image_token_id(config), ({str(t): float("-inf") for t in suppressed} if suppressed else None)
