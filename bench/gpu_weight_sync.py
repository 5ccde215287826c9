"""GPU check of the weight sync layer: correctness and GB/s on one (or more) NVIDIA GPUs.

What it checks, each printed as PASS / FAIL / SKIP with its GB/s (10^9 model bytes per second
from the learner's export start to every engine having loaded the weights), next to the
device-to-device and host<->device copy rates measured in the same run:

torch only (needs torch + transformers; no vLLM, Ray, omegaconf or ZeroMQ):

* ``colocated``: an ``HFGenerator`` on the GPU in this process, loaded by name (the in-process
  reference);
* ``shm``: the learner's GPU tensors through ``/dev/shm`` slots into two ``HFGenerator`` engines
  on the GPU, each in its own process;
* ``cuda-ipc``: the learner's GPU tensors shared by CUDA IPC handles
  (``torch.multiprocessing.reductions.reduce_tensor``, one handle per tensor, exactly what vLLM's
  ``ipc`` engine does in its unpacked mode) into the same two engines, which copy them into
  their parameters;
* ``broadcast`` on NCCL: ``WeightSender(cfg, n, device="cuda")`` (``_new_group`` makes a raw
  ``ProcessGroupNCCL``) into the same engines. With ONE GPU every rank sits on the same device,
  which NCCL does not support (``ncclInvalidUsage: Duplicate GPU detected``): the row then
  records what happened, and is expected to fail. With two or more GPUs the learner stays on
  ``cuda:0`` and receiver k runs on ``cuda:(1 + k % (n_gpus - 1))``.

After each, every parameter of every engine is compared with the learner's bit for bit (SHA-1
of the bytes), with the tied embedding still tied.

vLLM (only when ``import vllm`` works with a CUDA build):

* our ``VLLMGenerator(device="cuda")`` (``async_rl.generators.vllm``, our ``async_rl`` weight-transfer
  backend) receiving over ``shm`` and then over ``broadcast`` on NCCL (same one-GPU caveat: run
  last, since a failed load leaves that engine's weights undefined);
* a raw ``AsyncLLM`` built with ``weight_transfer_config={"backend": "ipc"}`` fed by vLLM's own
  trainer side (``WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0), ...)``,
  ``IPCTrainerWeightTransferEngine.send_weights()``) through an in-process client;
* after each sync, greedy tokens and log-probs of the engine against a teacher-forced HF forward
  of the learner's model (and against the engine before the sync, so the check can fail).

How to run (repo root, on the GPU machine; the hard overall limit is ``--timeout-s``, default
420 s, after which it prints the results so far and exits 3; a 0.5B float32 model; estimated 2-4
minutes on one H200 without vLLM, never measured)::

    PYTHONUNBUFFERED=1 python3 bench/gpu_weight_sync.py 2>&1 | tee $OUT/gpu_weight_sync.log

Flags:
``--small`` (a ~10M model), ``--model-dir DIR`` (a Qwen2 directory to load instead),
``--skip-vllm``, ``--skip-broadcast``, ``--device cpu`` (a CPU smoke test of the torch-only
plumbing: gloo instead of NCCL, no IPC). ``bench/gpu_check.py`` runs this script as its
``weight-sync-check`` stage (``--skip-vllm --skip-broadcast`` on its 0.5B model).

What is untested (honestly): nothing here has run on a GPU yet. The torch-only plumbing
(subprocess receivers, ``shm``, ``broadcast`` on gloo, ``colocated``, the bit-equality checks)
ran on CPU with ``--device cpu``. The CUDA IPC row, the NCCL row and every vLLM row have never
run. This workplace's H200 image has no vLLM (KINDS.md's package list) and its CUDA wheel is far
above the 64 MiB a call can carry, so there the vLLM rows print SKIP; they need a machine with a
CUDA build of vLLM (>= 0.32) matching its torch.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# vLLM's worker processes import async_rl.generators.vllm.worker (our worker extension) by module path.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])

FULL_MODEL = dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000)
SMALL_MODEL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                   num_key_value_heads=6, vocab_size=8000)
_CHILDREN: list[mp.Process] = []
RESULTS: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)


def result(status: str, what: str) -> None:
    RESULTS.append(f"{status:5s} {what}")
    log(f"{status:5s} {what}")


def start_watchdog(seconds: float) -> None:
    """Hard overall limit: print what we have, kill our receiver processes, exit 3."""
    def fire() -> None:
        log(f"\nWATCHDOG: {seconds:.0f} s overall limit reached; results so far:")
        for r in RESULTS:
            log(r)
        for p in _CHILDREN:
            if p.is_alive():
                p.kill()
        os._exit(3)

    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()


# ---------------------------------------------------------------------------------------- references
def copy_rates(device: str) -> str:
    """Device-to-device, host-to-device (pinned and pageable) and device-to-host GB/s, 256 MiB."""
    n = 256 * 2**20
    if device == "cpu":
        a = torch.empty(n, dtype=torch.uint8)
        b = torch.empty_like(a)
        b.copy_(a)
        best = min(_timed(lambda: b.copy_(a), device) for _ in range(5))
        return f"memcpy {n / 1e9 / best:.1f} GB/s"
    d1 = torch.empty(n, dtype=torch.uint8, device=device)
    d2 = torch.empty_like(d1)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    rates = {}
    for name, fn in {"D2D": lambda: d2.copy_(d1), "H2D pinned": lambda: d1.copy_(pinned),
                     "H2D pageable": lambda: d1.copy_(pageable), "D2H pageable": lambda: pageable.copy_(d1)}.items():
        fn()
        rates[name] = n / 1e9 / min(_timed(fn, device) for _ in range(5))
    return ", ".join(f"{k} {v:.1f} GB/s" for k, v in rates.items()) + " (D2D counts bytes once, not read+write)"


def _timed(fn, device: str) -> float:
    if device != "cpu":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------- model
def build_model(out_dir: str, spec: dict):
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from async_rl.data.builtin import resolve

    tok = AutoTokenizer.from_pretrained(resolve("builtin:tiny-qwen2"))
    config = Qwen2Config(**spec, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).float().eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return model, tok


def perturb(model, seed: int, scale: float = 0.02) -> None:
    g = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, device=p.device) * scale)


def digests(model) -> dict[str, str]:
    return {n: hashlib.sha1(p.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
            for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------- receivers
def _receiver_main(conn, model_path: str, device: str, pad: int) -> None:
    """A receiver process: one HFGenerator on ``device``, driven by (method, args) messages."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))  # "cuda" in the sender's init_info means this one
    else:
        torch.set_num_threads(1)
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator, load_named_weights

    engine = HFGenerator(model_path, GeneratorConfig(max_batch_size=8), pad, device=device)

    def ipc_load(items, version):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        index = torch.cuda.current_device()
        named = []
        for name, args in items:
            args = list(args)
            args[6] = index  # the storage device, as vLLM's IPC engine overrides it
            named.append((name, rebuild_cuda_tensor(*args)))
        load_named_weights(engine.model, named)
        torch.cuda.synchronize()
        engine.policy_version = version
        del named

    def check():
        m = engine.model
        return engine.policy_version, digests(m), m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()

    methods = {"connect_weight_sync": engine.connect_weight_sync, "receive_weights": engine.receive_weights,
               "ipc_load": ipc_load, "check": check, "ping": lambda: os.getpid()}
    while True:
        msg = conn.recv()
        if msg is None:
            return
        method, args = msg
        try:
            out = methods[method](*args)
            if method == "receive_weights" and device.startswith("cuda"):
                torch.cuda.synchronize()  # "loaded" means on the device, not just enqueued
            conn.send(("ok", out))
        except BaseException as e:  # reported to the driver, which decides
            conn.send(("err", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}"))


class ProcTarget:
    """A receiver process as a ``WeightPublisher`` target (the protocol of ``LocalTarget``)."""

    def __init__(self, model_path: str, device: str, pad: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_receiver_main, args=(child, model_path, device, pad), daemon=True)
        self.proc.start()
        _CHILDREN.append(self.proc)
        self._pool = ThreadPoolExecutor(max_workers=1)

    def call(self, method: str, *args):
        def run():
            self.conn.send((method, args))
            status, out = self.conn.recv()
            if status != "ok":
                raise RuntimeError(out)
            return out

        return self._pool.submit(run)

    def connect(self, init_info: dict, rank: int):
        return self.call("connect_weight_sync", init_info, rank)

    def receive(self, plan: dict, version: int):
        return self.call("receive_weights", plan, version)

    in_process = False  # the engine lives in its own process: bucket transports only

    @staticmethod
    def wait(handles: list, timeout_s: float) -> list:
        """Futures, as ``LocalTarget``'s (``ThreadPoolExecutor`` calls)."""
        from async_rl.weight_sync import LocalTarget

        return LocalTarget.wait(handles, timeout_s)

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()


def check_receivers(targets, learner_digests: dict, version: int, label: str, timeout_s: float) -> None:
    outs = ProcTarget.wait([t.call("check") for t in targets], timeout_s)
    ok = [v == version and d == learner_digests and tie for v, d, tie in outs]
    bad = [[n for n in learner_digests if d.get(n) != learner_digests[n]][:3] for _, d, _ in outs]
    result("PASS" if all(ok) else "FAIL", f"{label}: every parameter bit-equal to the learner's, tie intact, "
           f"version {version}: {ok}" + ("" if all(ok) else f" (first differing: {bad})"))


def time_push(push, sync) -> float:
    sync()
    t0 = time.perf_counter()
    push()
    return time.perf_counter() - t0


def _sync(dev: str):
    return torch.cuda.synchronize if dev != "cpu" else (lambda: None)


def _row(name: str, times: list[float], model_bytes: int) -> str:
    """``times``: the cold push first, then the timed ones (best over those)."""
    best = min(times[1:] or times)
    return (f"{name}: best {best:.3f} s = {model_bytes / 1e9 / best:.2f} GB/s "
            f"(cold {times[0]:.3f} s; timed {', '.join(f'{t:.3f}' for t in times[1:])})")


def publisher_on(cfg, learner, targets: list, device: str):
    """A connected ``WeightPublisher`` over ``targets`` whose sender runs on ``device``
    (``cuda``: ``broadcast`` goes over NCCL).

    Raises:
        TimeoutError: a target did not connect within ``cfg.timeout_s``.
    """
    from async_rl.weight_sync import WeightPublisher

    return WeightPublisher(cfg, cfg.transport, learner, targets, device=device)


# ---------------------------------------------------------------------------------------- torch-only
def torch_only(args, model, model_path: str, pad: int, model_bytes: int) -> None:
    from async_rl.weight_sync import LocalTarget, ModuleWeights, WeightPublisher, WeightSyncConfig
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

    dev = args.device
    sync = _sync(dev)
    learner = ModuleWeights(model)
    version = 1
    row = lambda name, times: _row(name, times, model_bytes)  # noqa: E731

    # colocated
    local = HFGenerator(model_path, GeneratorConfig(max_batch_size=8), pad, device=dev)
    pub = WeightPublisher(WeightSyncConfig(transport="colocated"), "colocated", learner, [LocalTarget(local)])
    perturb(model, version)
    times = []
    for _ in range(1 + args.reps):
        times.append(time_push(lambda: (pub.push(version), sync()), sync))
        version += 1
    want = digests(model)
    ok = digests(local.model) == want
    result("PASS" if ok else "FAIL", f"colocated -> HF in-process on {dev}: bit-equal {ok}; " + row("colocated", times))
    del local, pub
    if dev != "cpu":
        torch.cuda.empty_cache()

    recv_dev = dev
    targets = [ProcTarget(model_path, recv_dev, pad) for _ in range(args.num_receivers)]
    ProcTarget.wait([t.call("ping") for t in targets], 300)
    log(f"  {len(targets)} receiver processes loaded the model on {recv_dev}")

    # shm
    for mb in args.buckets_mb:
        pub = WeightPublisher(WeightSyncConfig(transport="shm", bucket_size_mb=mb, timeout_s=120), "shm", learner,
                              targets)
        perturb(model, version)
        times = []
        for _ in range(1 + args.reps):
            times.append(time_push(lambda: pub.push(version), sync))
            version += 1
        check_receivers(targets, digests(model), version - 1, f"shm ({mb} MB buckets) -> {len(targets)} HF "
                        f"processes on {recv_dev}; " + row("shm", times), 300)
        pub.close()

    # CUDA IPC, one handle per tensor (vLLM's unpacked ipc mode), into the same processes
    if dev != "cpu":
        from torch.multiprocessing.reductions import reduce_tensor

        perturb(model, version)
        times = []
        for _ in range(1 + args.reps):
            def push():
                items = [(n, reduce_tensor(t.contiguous())[1]) for n, t in learner.named_weights()]
                ProcTarget.wait([t.call("ipc_load", items, version) for t in targets], 300)

            times.append(time_push(push, sync))
            version += 1
        torch.cuda.ipc_collect()
        check_receivers(targets, digests(model), version - 1, f"cuda-ipc -> {len(targets)} HF processes on "
                        f"{recv_dev}; " + row("cuda-ipc", times), 300)
    else:
        result("SKIP", "cuda-ipc: needs CUDA")

    return targets, version


def torch_broadcast(args, model, model_path: str, pad: int, model_bytes: int, targets, version: int) -> None:
    """``broadcast`` (NCCL on GPU, gloo with ``--device cpu``) into the receiver processes. Run
    last: with one GPU NCCL refuses (or, worse, hangs until the watchdog), and may wedge them."""
    from async_rl.weight_sync import ModuleWeights, WeightSyncConfig

    dev = args.device
    sync = _sync(dev)
    learner = ModuleWeights(model)
    n_gpus = torch.cuda.device_count() if dev != "cpu" else 0

    if dev != "cpu" and n_gpus >= 2:
        for t in targets:
            t.close()
        targets = [ProcTarget(model_path, f"cuda:{1 + k % (n_gpus - 1)}", pad) for k in range(args.num_receivers)]
        ProcTarget.wait([t.call("ping") for t in targets], 300)
        where = f"{len(targets)} HF processes on cuda:1..{n_gpus - 1} (learner cuda:0)"
    else:
        where = f"{len(targets)} HF processes on the learner's device {dev}"
    mb = args.buckets_mb[-1]
    try:
        cfg = WeightSyncConfig(transport="broadcast", bucket_size_mb=mb, timeout_s=args.nccl_timeout_s)
        pub = publisher_on(cfg, learner, targets, "cuda" if dev != "cpu" else "cpu")
        perturb(model, version)
        times = []
        for _ in range(1 + args.reps):
            times.append(time_push(lambda: pub.push(version), sync))
            version += 1
        check_receivers(targets, digests(model), version - 1, f"broadcast ({'NCCL' if dev != 'cpu' else 'gloo'}, "
                        f"{mb} MB buckets) -> {where}; " + _row("broadcast", times, model_bytes), 300)
    except Exception as e:
        expected = dev != "cpu" and n_gpus < 2
        note = " [expected with one GPU: NCCL forbids two ranks on one device]" if expected else ""
        result("FAIL", f"broadcast ({'NCCL' if dev != 'cpu' else 'gloo'}) -> {where}: {type(e).__name__}: "
               f"{str(e)[:400]}{note}")
    for t in targets:
        t.close()


# ---------------------------------------------------------------------------------------- vLLM
def _hf_check(model, prompts, outputs) -> tuple[float, float]:
    """Teacher-forced HF forward: (max |logprob diff|, max argmax shortfall) over ``outputs``
    (``[(token ids, logprobs)]``, one per prompt)."""
    lp_diff = margin = 0.0
    dev = next(model.parameters()).device
    with torch.no_grad():
        for prompt, (toks, lps) in zip(prompts, outputs):
            ids = torch.tensor([prompt + toks], device=dev)
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
            tok = torch.tensor(toks, device=dev)
            chosen = lp.gather(-1, tok[:, None])[:, 0]
            lp_diff = max(lp_diff, (chosen - torch.tensor(lps, device=dev)).abs().max().item())
            margin = max(margin, (lp.max(-1).values - chosen).max().item())
    return lp_diff, margin


def _verdict(label: str, before, after, extra: str = "") -> None:
    ok = after[0] < 1e-2 and after[1] < 1e-3 and before[0] > 0.1
    result("PASS" if ok else "FAIL", f"{label}: greedy vs HF forward of the learner: max |logprob diff| "
           f"{after[0]:.1e}, argmax shortfall {after[1]:.1e} (before the sync {before[0]:.2f}, {before[1]:.2f}){extra}")


class _LoopClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over an ``AsyncLLM`` running on ``loop``."""

    def __init__(self, engine, loop) -> None:
        self.engine, self.loop = engine, loop

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(300)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def shutdown_weight_transfer_engine(self) -> None:
        self._run(self.engine.shutdown_weight_transfer_engine())

    def start_weight_update(self) -> None:
        self._run(self.engine.start_weight_update())

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._run(self.engine.finish_weight_update(weight_version))


def vllm_part(args, model, model_path: str, eos: int, model_bytes: int) -> None:
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    from async_rl.weight_sync import LocalTarget, ModuleWeights, WeightPublisher, WeightSyncConfig
    from async_rl.generators.base import GeneratorConfig, SamplingParams, VLLMConfig
    from async_rl.generators.vllm import VLLMGenerator

    # vLLM's IPC update carries torch classes in its handles: its RPC encoder needs pickle for them.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    learner = ModuleWeights(model)
    prompts = [[(7 * i + j) % 250 for j in range(12 + i)] for i in range(4)]
    greedy = SamplingParams(greedy=True, max_tokens=16, stop_token_ids=(eos,))
    sync = torch.cuda.synchronize
    version = 100

    # (1) raw AsyncLLM with vLLM's built-in ipc engine, fed by vLLM's own trainer side.
    class AliasedSource(WeightSource):
        """``named_parameters(remove_duplicate=False)``: the tied ``lm_head.weight`` is sent too
        (without it vLLM's CPU build keeps the old head, with only a log warning)."""

        def metadata(self):
            return [ParamMeta(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters(remove_duplicate=False)]

        def __iter__(self):
            return ((n, p.detach()) for n, p in model.named_parameters(remove_duplicate=False))

    try:
        from vllm import SamplingParams as VSP
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()

        async def start():
            return AsyncLLM.from_engine_args(AsyncEngineArgs(
                model=model_path, dtype="float32", seed=0, max_model_len=512, max_num_seqs=64,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=True,
                logprobs_mode="processed_logprobs", weight_transfer_config={"backend": "ipc"},
                disable_log_stats=True))

        engine = asyncio.run_coroutine_threadsafe(start(), loop).result(600)

        def gen_raw():
            import uuid

            async def one(p):
                final = None
                sp = VSP(n=1, temperature=0.0, max_tokens=16, logprobs=0, detokenize=False, ignore_eos=True)
                async for out in engine.generate({"prompt_token_ids": p}, sp, request_id=uuid.uuid4().hex):
                    final = out
                c = final.outputs[0]
                return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]

            async def all_():
                return await asyncio.gather(*(one(p) for p in prompts))

            return asyncio.run_coroutine_threadsafe(all_(), loop).result(300)

        trainer = WeightTransferTrainerFactory.trainer_init(
            IPCTrainerInitInfo(rank=0, packed=False), client=_LoopClient(engine, loop), source=AliasedSource())
        perturb(model, version)
        before = _hf_check(model, prompts, gen_raw())
        times = [time_push(trainer.send_weights, sync) for _ in range(1 + args.reps)]
        _verdict("vLLM ipc engine (raw AsyncLLM, vLLM's IPCTrainerWeightTransferEngine)", before,
                 _hf_check(model, prompts, gen_raw()), "; " + _row("ipc", times, model_bytes))
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
    except Exception as e:
        result("FAIL", f"vLLM ipc engine: {type(e).__name__}: {str(e)[:400]}")
    torch.cuda.empty_cache()

    # (2) our VLLMGenerator on CUDA: shm, then broadcast on NCCL (last: a failed load leaves it undefined).
    gen = None
    try:
        cfg = GeneratorConfig(backend="vllm", max_batch_size=64,
                              vllm=VLLMConfig(max_model_len=512, gpu_memory_utilization=args.gpu_memory_utilization))
        gen = VLLMGenerator(model_path, cfg, device="cuda")

        def gen_ours():
            return [(g[0].response_ids, g[0].logprobs) for g in gen.generate(prompts, 1, greedy)]

        for transport in ("shm", "broadcast"):
            n_gpus = torch.cuda.device_count()
            label = f"our VLLMGenerator (cuda) over {transport}" + (" on NCCL" if transport == "broadcast" else "")
            try:
                wcfg = WeightSyncConfig(transport=transport, bucket_size_mb=args.buckets_mb[-1],
                                        timeout_s=args.nccl_timeout_s)
                if transport == "shm":
                    pub = WeightPublisher(wcfg, transport, learner, [LocalTarget(gen)])
                else:
                    pub = publisher_on(wcfg, learner, [LocalTarget(gen)], "cuda")
                perturb(model, version)
                before = _hf_check(model, prompts, gen_ours())
                times = []
                for _ in range(1 + args.reps):
                    times.append(time_push(lambda: pub.push(version), sync))
                    version += 1
                _verdict(label, before, _hf_check(model, prompts, gen_ours()), "; " + _row(transport, times, model_bytes))
                pub.close()
            except Exception as e:
                note = " [expected with one GPU: NCCL forbids two ranks on one device]" \
                    if transport == "broadcast" and n_gpus < 2 else ""
                result("FAIL", f"{label}: {type(e).__name__}: {str(e)[:400]}{note}")
    except Exception as e:
        result("FAIL", f"our VLLMGenerator on cuda: {type(e).__name__}: {str(e)[:400]}")
    finally:
        if gen is not None:
            gen.close()


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--small", action="store_true", help="a ~10M model instead of ~0.5B")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-broadcast", action="store_true",
                        help="no torch broadcast row (with one GPU NCCL refuses it: bench/gpu_check.py skips it)")
    parser.add_argument("--model-dir", help="load this Hugging Face Qwen2 directory (float32) instead of "
                                            "building a random model (bench/gpu_check.py passes its 0.5B one)")
    parser.add_argument("--buckets-mb", default="256,1024", help="comma-separated bucket sizes (MiB)")
    parser.add_argument("--reps", type=int, default=2, help="timed pushes after the first (cold) one")
    parser.add_argument("--num-receivers", type=int, default=2)
    parser.add_argument("--nccl-timeout-s", type=float, default=60.0, help="weight_sync.timeout_s of broadcast rows")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.2)
    parser.add_argument("--timeout-s", type=float, default=420.0, help="hard overall limit")
    args = parser.parse_args()
    args.buckets_mb = [float(x) for x in args.buckets_mb.split(",")]
    start_watchdog(args.timeout_s)
    t0 = time.perf_counter()

    if args.device == "cuda" and not torch.cuda.is_available():
        log("no CUDA device: run with --device cpu for the CPU smoke test")
        sys.exit(2)
    try:
        import vllm

        have_vllm = f"vllm {vllm.__version__}"
    except Exception as e:  # noqa: BLE001  (any import failure means: no usable vLLM)
        have_vllm = None
        vllm_error = f"{type(e).__name__}: {e}"
    import transformers

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if args.device == "cuda" else []
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, {have_vllm or 'no vLLM'}; "
        f"device {args.device} {gpus}; python {sys.version.split()[0]}")
    log(f"copy rates: {copy_rates(args.device)}")

    if args.model_dir:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        work = args.model_dir
        model = AutoModelForCausalLM.from_pretrained(work, dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(work)
    else:
        work = tempfile.mkdtemp(prefix="gpu-weight-sync-")
        model, tok = build_model(work, SMALL_MODEL if args.small else FULL_MODEL)
    model = model.to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(f"learner: random-init tied Qwen2, {n_params:,} parameters, {model_bytes / 1e9:.2f} GB float32, on "
        f"{args.device}; {args.reps} timed pushes after a cold one; GB/s = 10^9 model bytes / s from the "
        f"learner's export start to every engine loaded")

    targets, version = torch_only(args, model, work, tok.pad_token_id, model_bytes)
    if args.skip_vllm or args.device == "cpu":
        result("SKIP", "vLLM rows (--skip-vllm or --device cpu)")
    elif have_vllm is None:
        result("SKIP", f"vLLM rows: vLLM is not importable here ({vllm_error[:200]})")
    else:
        vllm_part(args, model, work, tok.eos_token_id, model_bytes)
    if args.skip_broadcast:
        result("SKIP", "broadcast row (--skip-broadcast)")
        for t in targets:
            t.close()
    else:
        torch_broadcast(args, model, work, tok.pad_token_id, model_bytes, targets, version)

    log("\n==== summary " + "=" * 80)
    for r in RESULTS:
        log(r)
    log(f"wall {time.perf_counter() - t0:.0f} s")
    for p in _CHILDREN:
        if p.is_alive():
            p.kill()
    os._exit(0 if not any(r.startswith("FAIL") and "expected" not in r for r in RESULTS) else 1)


if __name__ == "__main__":
    main()
