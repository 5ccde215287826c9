"""Weight-sync throughput and vLLM generation overhead, side by side with their ceilings, in one run.

What it measures (all on one host, CPU):

1. **memcpy**: ``dst.copy_(src)`` of a 256 MB uint8 tensor, best of 5, in this run: the ceiling
   every weight-sync figure is compared with.
2. **Weight sync, end to end**: a "learner" (a random-init Qwen2 of about 110M parameters,
   float32, tied embeddings; the exact count is printed) pushes its weights through
   ``async_rl.weight_sync.WeightPublisher``. One sync is timed from the learner's export start
   (``push`` begins with ``named_weights()``) to the moment every engine has loaded the weights
   (every receiver's ``receive_weights`` call returned); GB/s = model bytes (10^9) / that time.
   Receivers:

   * ``colocated``: one ``HFGenerator`` in this process (``LocalTarget``), tensors handed over by
     name: the in-process copy reference;
   * ``shm`` and ``broadcast`` (gloo) into two ``HFGenerator`` engines in two Ray actors
     (``RayTarget``), one row per bucket size (``--buckets-mb``);
   * ``shm`` and ``broadcast`` into one real vLLM engine (``VLLMGenerator`` in this process,
     ``LocalTarget``) at ``--vllm-bucket-mb``: this includes vLLM's layerwise reload and its
     re-processing of the weights (the CPU build repacks linears into oneDNN kernels).

   Each row: one "cold" push (first use of the slots or the group; printed, not in best or
   median), then ``--reps`` timed pushes; best and median are printed.

   **Copy bound.** Each row is also compared with what its copies allow: ``copies`` counts the
   full passes over the model's bytes that the transport's code makes on a push's critical path
   (``COPIES``, printed with the reasons), and the bound is memcpy GB/s / copies. Counted:
   the sender's pack (learner tensor -> slot or broadcast buffer: 1); for ``broadcast``, one
   socket write per receiver at the sender (gloo over loopback TCP; each receiver's read runs
   at the same time as its write, on its own core, and is not counted again); the HF engine's
   copy out of the bucket into its staging tensors (1; the two engines copy at the same time,
   each on its own core: counted once) and its swap at a step boundary (``param.data =
   staged``: 0); vLLM's layerwise reload: its loader's copy of the bucket's views into the
   re-materialised layer (1) and the re-processing (1: the CPU build re-packs each linear into
   a oneDNN kernel; other layers are copied back into their kernel tensors). So colocated 1,
   shm into HF 2, broadcast into 2 HF 4, shm into vLLM 3, broadcast into vLLM 4. Not counted:
   fresh memory (vLLM materialises each layer and its packed kernel anew per update, and pages
   faulted in cost more than a copy on CPU), Python per tensor, the control plane. With two
   slots the engines' copies of bucket i overlap the pack of bucket i+1, so a row may beat its
   bound; on 2 cores the sender and two engines share two cores, so the bound is optimistic.
   Targets (issue 20): shm into HF >= 0.7 of the bound; into vLLM >= 0.25x memcpy.

   **Profile** of each row's fastest push (seconds): ``pack`` (``weight_sync/pack_s``, the
   sender's timer), ``send`` (``send_s`` + ``slot_wait_s``: announcing a slot and waiting for
   the engines to free one, or the broadcasts), ``e.load`` (the engine's copies out of the
   bucket: the HF engine's ``engine_copy_s``; vLLM's ``engine_load_s`` + ``engine_own_s``),
   ``e.proc`` (vLLM's re-processing, ``engine_process_s``), ``e.swap`` (the HF engine's
   ``engine_apply_s``) and ``rest`` = best - those (control plane: Ray calls, plan checks,
   vLLM's pause/resume, store round trips, waits; negative where copies overlapped). Engine
   phases come from the engines' own timers (``last_weight_sync_metrics``), read after each push
   outside the timed span; the slowest engine's are shown, and the whole set under each row.
   Correctness is checked once per receiver kind and transport after a push of perturbed
   weights: the HF engines' parameters must equal the learner's bit for bit (SHA-1 of every
   parameter) with the tie intact; the vLLM engine's greedy tokens and log-probs must match an
   HF forward of the learner's model (teacher-forced), and must not have matched before the push
   (so the check can fail).
3. **Generation**: our ``VLLMGenerator.generate`` against raw vLLM on the built-in tiny model,
   same prompts, same per-request seeds and the same sampling params (temperature 1,
   ``ignore_eos``, stop ids, ``max_tokens``, ``logprobs=0``, ``detokenize=False``); ours asks for
   final-only outputs with flat log-probs and reads each token's policy version from vLLM's
   weight-version spans, the raw rows use vLLM's default outputs (``bench/bench_engine.py``
   isolates this overhead). Raw rows: ``vllm.LLM.generate`` (its own engine with the
   same engine args minus our worker extension) and ``AsyncLLM.generate`` called directly on the
   very engine ours wraps. All three are warmed up, then run interleaved ``--gen-reps`` times;
   tokens/s is each one's best, and the token ids of the three must be identical.

The machine has 2 cores and may be shared: the load average is printed with the results.

Run (about 5 minutes on 2 cores; ``--quick`` about 3, 2.5 with ``--skip-generation``: a ~10M
model, 16 MB buckets so that every push spans several, one timed push per row)::

    ASYNC_RL_CACHE=/tmp/arl-cache python bench/bench_weight_sync.py [--quick]
        [--buckets-mb 64,256,1024] [--reps 3] [--vllm-bucket-mb 256] [--skip-vllm] [--skip-generation]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FULL_MODEL = dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=32000)
QUICK_MODEL = dict(hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                   num_key_value_heads=6, vocab_size=8000)


# ---------------------------------------------------------------------------------------- helpers
def memcpy_gbps(nbytes: int = 256 * 2**20, reps: int = 5) -> float:
    """Best ``dst.copy_(src)`` rate of a ``nbytes`` uint8 tensor in GB/s (10^9 bytes/s)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst's pages
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / 1e9 / best


def build_model(out_dir: str, spec: dict, tiny_path: str):
    """A random-init tied Qwen2 saved to ``out_dir`` with the tiny model's tokenizer; returns the model."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_path)
    if spec["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size {spec['vocab_size']} is smaller than the tokenizer's {len(tok)}")
    config = Qwen2Config(**spec, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=None,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, torch_dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    return model


def perturb(model, seed: int, scale: float = 0.02) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def digests(model) -> dict[str, str]:
    """SHA-1 of every (canonical) parameter's bytes."""
    return {n: hashlib.sha1(p.detach().contiguous().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}


class HFEngineActor:
    """An ``HFGenerator`` in its own process (wrapped with ``ray.remote``): the receiving half of
    ``async_rl.loops.actors.GeneratorWorker`` without its sampling loop."""

    def __init__(self, model_path: str, pad_token_id: int, num_threads: int) -> None:
        torch.set_num_threads(num_threads)
        from async_rl.generators.base import GeneratorConfig
        from async_rl.generators.hf import HFGenerator

        self.engine = HFGenerator(model_path, GeneratorConfig(max_batch_size=8), pad_token_id)

    def connect_weight_sync(self, init_info: dict, rank: int) -> None:
        self.engine.connect_weight_sync(init_info, rank)

    def receive_weights(self, plan: dict, version: int) -> float:
        return self.engine.receive_weights(plan, version)

    def metrics(self) -> dict[str, float]:
        """The engine's phase seconds of its last ``receive_weights``."""
        return self.engine.last_weight_sync_metrics()

    def check(self) -> tuple[int, dict[str, str], bool]:
        """``(policy_version, parameter digests, whether lm_head is still the embedding)``."""
        m = self.engine.model
        return (self.engine.policy_version, digests(m),
                m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr())


def time_pushes(pub, reps: int, version: int, probe=None) -> tuple[float, list[float], dict[str, float]]:
    """``(cold seconds, [timed seconds], metrics of the fastest timed push)`` of ``1 + reps``
    pushes (versions ``version``...). ``probe()``, called after each push (untimed), returns
    the engines' own phase seconds of it (``last_weight_sync_metrics``), merged into its metrics."""
    times, metrics = [], []
    for k in range(1 + reps):
        t0 = time.perf_counter()
        m = pub.push(version + k)
        times.append(time.perf_counter() - t0)
        metrics.append({**m, **(probe() if probe is not None else {})})
    best = min(range(1, len(times)), key=times.__getitem__)
    return times[0], times[1:], metrics[best]


def max_metrics(per_engine: list[dict[str, float]]) -> dict[str, float]:
    """Each key's largest value over the engines (the slowest engine sets the push's pace)."""
    keys = {k for m in per_engine for k in m}
    return {k: max(m.get(k, 0.0) for m in per_engine) for k in keys}


COPIES = {
    # (transport, engine kind): full passes over the model's bytes on a push's critical path.
    # Copies that the two HF engines make at the same time, each on its own core, count once.
    ("colocated", "hf"): (1, "learner param -> engine param (update_weights; same dtype, nothing staged)"),
    ("shm", "hf"): (2, "pack: learner -> slot; engine: slot -> staging tensor; swap in: 0 bytes"),
    ("broadcast", "hf"): (4, "pack: learner -> buffer; gloo: a socket write per engine at the sender "
                             "(2, in turn; each engine's read overlaps its write); engine: buffer -> staging; swap in: 0"),
    ("shm", "vllm"): (3, "pack: learner -> slot; load_weights: slot views -> the re-materialised layer; "
                         "re-process: linears re-packed into oneDNN kernels, other layers copied back into theirs"),
    ("broadcast", "vllm"): (4, "pack; gloo: one socket write (the engine's read overlaps it); load; re-pack/copy back"),
}
"""Copies per row of this code (see the module docstring); each row's copy bound is memcpy / copies."""

TARGETS = {("shm", "hf"): ("bound", 0.7), ("shm", "vllm"): ("memcpy", 0.25), ("broadcast", "vllm"): ("memcpy", 0.25)}
"""Issue 20's targets: shm >= 0.7 of the copy bound; into vLLM on CPU >= 0.25x memcpy."""

PHASES = (  # (column, metric keys summed); engine keys are the slowest engine's
    ("pack", ("weight_sync/pack_s",)),
    ("send", ("weight_sync/send_s", "weight_sync/slot_wait_s")),
    ("e.load", ("weight_sync/engine_copy_s", "weight_sync/engine_load_s", "weight_sync/engine_own_s")),
    ("e.proc", ("weight_sync/engine_process_s",)),
    ("e.swap", ("weight_sync/engine_apply_s",)),
)


class Table:
    """One row per (transport, receivers, bucket size): times, GB/s, the copy bound and the
    profile of the fastest push.

    ``copies``: ``COPIES``; ``bound``: memcpy GB/s / copies; ``x bound``: the row's best GB/s over
    its bound. Profile (seconds of the fastest push): ``pack`` the sender's copies into slots /
    the broadcast buffer (``weight_sync/pack_s``), ``send`` announcing slots and waiting for one
    to be free, or the broadcasts (``send_s + slot_wait_s``), ``e.load`` the engine's copies out
    of the bucket (HF: into staging; vLLM: its ``load_weights`` less re-processing, plus the
    copies of what the reload keeps), ``e.proc`` vLLM's re-processing (the oneDNN re-pack),
    ``e.swap`` the HF engine's swap at a step boundary; ``rest`` = best - all of these: control
    plane (Ray calls, plan checks, pause/resume, store round trips, waits); negative when the
    engines' copies overlap the sender's packing (two slots)."""

    HEAD = (f"{'transport':10s} {'receivers':16s} {'MB':>5s} {'bkts':>4s} {'cold s':>7s} {'best s':>7s} "
            f"{'med s':>7s} {'GB/s':>6s} {'x memcpy':>8s} {'copies':>6s} {'bound':>6s} {'x bound':>7s} "
            f"{'target':>19s} | " + " ".join(f"{name:>6s}" for name, _ in PHASES) + f" {'rest':>6s}")

    def __init__(self, model_bytes: int, memcpy: float) -> None:
        self.rows: list[str] = []
        self.model_bytes, self.memcpy = model_bytes, memcpy

    def add(self, transport: str, receivers: str, kind: str, bucket_mb, buckets, cold: float, timed: list[float],
            metrics: dict[str, float]) -> None:
        best, med = min(timed), statistics.median(timed)
        gbps = self.model_bytes / 1e9 / best
        copies = COPIES[(transport, kind)][0]
        bound = self.memcpy / copies
        target = ""
        if (transport, kind) in TARGETS:
            ref, want = TARGETS[(transport, kind)]
            got = gbps / bound if ref == "bound" else gbps / self.memcpy
            target = f"{'ok' if got >= want else 'MISS'} >={want} {ref}"
        phases = [sum(metrics.get(k, 0.0) for k in keys) for _, keys in PHASES]
        cells = " ".join(f"{v:6.3f}" if any(k in metrics for k in keys) else f"{'-':>6s}"
                         for v, (_, keys) in zip(phases, PHASES))
        row = (f"{transport:10s} {receivers:16s} {str(bucket_mb):>5s} {str(buckets):>4s} {cold:7.3f} {best:7.3f} "
               f"{med:7.3f} {gbps:6.2f} {gbps / self.memcpy:8.3f} {copies:6d} {bound:6.2f} {gbps / bound:7.2f} "
               f"{target:>19s} | {cells} {best - sum(phases):6.3f}")
        self.rows.append(row)
        print(row, flush=True)
        extra = {k: round(v, 4) for k, v in sorted(metrics.items()) if k.startswith("weight_sync/engine")
                 or k.endswith("slot_wait_s")}
        if extra:
            self.rows.append(f"{'':12s}engine phases (slowest engine): {extra}")
            print(self.rows[-1], flush=True)

    @staticmethod
    def legend() -> list[str]:
        """How each row's copies were counted."""
        return [f"  copies {n} = {t} {k}: {why}" for (t, k), (n, why) in COPIES.items()]


# ---------------------------------------------------------------------------------------- part 2
def bench_hf(args, model, model_path: str, pad: int, table: Table, checks: list[str]) -> None:
    import ray

    from async_rl.weight_sync import LocalTarget, RayTarget, ModuleWeights, WeightPublisher, WeightSyncConfig
    from async_rl.generators.base import GeneratorConfig
    from async_rl.generators.hf import HFGenerator

    learner = ModuleWeights(model)
    version = 1
    # colocated: the in-process copy reference.
    local = HFGenerator(model_path, GeneratorConfig(max_batch_size=8), pad)
    pub = WeightPublisher(WeightSyncConfig(transport="colocated"), "colocated", learner, [LocalTarget(local)])
    perturb(model, seed=version)
    cold, timed, m = time_pushes(pub, args.reps, version)
    version += 1 + args.reps
    table.add("colocated", "1 HF in-process", "hf", "-", "-", cold, timed, m)
    same = digests(local.model) == digests(model)
    tie = local.model.lm_head.weight.data_ptr() == local.model.model.embed_tokens.weight.data_ptr()
    checks.append(f"{'PASS' if same and tie else 'FAIL'}  colocated -> HF in-process: every parameter bit-equal "
                  f"to the learner's: {same}; tie intact: {tie}")
    del pub, local
    gc.collect()

    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False,
             log_to_driver=False)
    try:
        actor_cls = ray.remote(num_cpus=0, max_concurrency=2)(HFEngineActor)
        actors = [actor_cls.remote(model_path, pad, 1) for _ in range(2)]
        ray.get([a.check.remote() for a in actors])  # loaded
        for transport in ("shm", "broadcast"):
            for k, mb in enumerate(args.buckets_mb):
                cfg = WeightSyncConfig(transport=transport, bucket_size_mb=mb)
                pub = WeightPublisher(cfg, transport, learner, [RayTarget(a) for a in actors])
                verify = k == len(args.buckets_mb) - 1
                if verify:
                    perturb(model, seed=version)
                nb = len(pub.sender.plan(list(learner.named_weights()), 0, learner.weight_aliases()).buckets)
                cold, timed, m = time_pushes(pub, args.reps, version,
                                             lambda: max_metrics(ray.get([a.metrics.remote() for a in actors])))
                last = version + args.reps
                version += 1 + args.reps
                table.add(transport, "2 HF Ray actors", "hf", mb, nb, cold, timed, m)
                if verify:
                    want = digests(model)
                    results = ray.get([a.check.remote() for a in actors])
                    ok = [v == last and d == want and tie for v, d, tie in results]
                    checks.append(f"{'PASS' if all(ok) else 'FAIL'}  {transport} -> 2 HF Ray actors ({mb} MB "
                                  f"buckets): every parameter bit-equal to the learner's, tie intact, version "
                                  f"{last}: {ok}")
                pub.close()
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------- vLLM
def _hf_check(model, prompts: list[list[int]], groups) -> tuple[float, float]:
    """Teacher-forced HF forward of ``model`` on each greedy sample: ``(max |logprob diff|, max
    margin by which the engine's token falls short of HF's argmax)``."""
    lp_diff = margin = 0.0
    with torch.no_grad():
        for prompt, group in zip(prompts, groups):
            s = group[0]
            ids = torch.tensor([prompt + s.response_ids])
            lp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)[len(prompt) - 1 : -1]
            tok = torch.tensor(s.response_ids)
            chosen = lp.gather(-1, tok[:, None])[:, 0]
            lp_diff = max(lp_diff, (chosen - torch.tensor(s.logprobs)).abs().max().item())
            margin = max(margin, (lp.max(-1).values - chosen).max().item())
    return lp_diff, margin


def bench_vllm_sync(args, model, model_path: str, eos: int, table: Table, checks: list[str]) -> None:
    from async_rl.weight_sync import LocalTarget, ModuleWeights, WeightPublisher, WeightSyncConfig
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.vllm import VLLMGenerator

    learner = ModuleWeights(model)
    t0 = time.perf_counter()
    gen = VLLMGenerator(model_path, GeneratorConfig(backend="vllm", max_batch_size=16), num_threads=2)
    print(f"  (vLLM engine for the {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M model started in "
          f"{time.perf_counter() - t0:.0f} s)", flush=True)
    prompts = [[(7 * i + j) % 250 for j in range(12 + i)] for i in range(4)]
    greedy = SamplingParams(greedy=True, max_tokens=16, stop_token_ids=(eos,))
    version = 1000
    try:
        for transport in ("shm", "broadcast"):
            mb = args.vllm_bucket_mb
            pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=mb), transport, learner,
                                  [LocalTarget(gen)])
            nb = len(pub.sender.plan(list(learner.named_weights()), 0, learner.weight_aliases()).buckets)
            perturb(model, seed=version)
            before = _hf_check(model, prompts, gen.generate(prompts, 1, greedy))
            cold, timed, m = time_pushes(pub, args.vllm_reps, version, gen.last_weight_sync_metrics)
            version += 1 + args.vllm_reps
            table.add(transport, "1 vLLM engine", "vllm", mb, nb, cold, timed, m)
            after_groups = gen.generate(prompts, 1, greedy)
            after = _hf_check(model, prompts, after_groups)
            ok = after[0] < 1e-3 and after[1] < 1e-4 and before[0] > 1e-2 and gen.policy_version == version - 1 \
                and all(set(g[0].policy_version) == {version - 1} for g in after_groups)
            checks.append(f"{'PASS' if ok else 'FAIL'}  {transport} -> vLLM ({mb} MB buckets): greedy tokens vs "
                          f"HF forward of the learner: max |logprob diff| {after[0]:.1e}, argmax shortfall "
                          f"{after[1]:.1e} (before the sync: {before[0]:.2f}, {before[1]:.2f})")
            pub.close()
    finally:
        gen.close()
        del gen
        gc.collect()


# ---------------------------------------------------------------------------------------- part 3
def _count(groups) -> int:
    return sum(len(s.response_ids) for g in groups for s in g)


def bench_generation(args, tiny_path: str) -> list[str]:
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VSP

    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.base import mix_seed
    from async_rl.generators.vllm import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(tiny_path)
    n_prompts, n_tokens = args.gen_prompts, args.gen_tokens
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": f"{i % 97}+{i // 97 + 3}="}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False))
               for i in range(n_prompts)]
    seeds = list(range(n_prompts))
    params = SamplingParams(temperature=1.0, max_tokens=n_tokens, stop_token_ids=(tok.eos_token_id,))
    warm = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tok.eos_token_id,))

    def vsp(p: SamplingParams, seed: int) -> VSP:  # what VLLMGenerator._sample builds, default outputs
        return VSP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                   seed=mix_seed(seed, 0), stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0,
                   detokenize=False, skip_special_tokens=False)

    # The engine processes inherit these (VLLMGenerator sets the same for itself).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = "2"
    rates: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}

    def timed(name: str, run) -> None:
        t0 = time.perf_counter()
        out = run()
        rate = sum(len(t) for t in out) / (time.perf_counter() - t0)
        rates[name], tokens[name] = max(rates.get(name, 0.0), rate), out
        print(f"  {name:44s} {rate:9,.0f} tok/s", flush=True)

    # Raw 1: vllm.LLM, its own engine with the same engine args (no worker extension). Both
    # engines stay up so the three rows can be interleaved (an idle engine waits, it does not spin).
    llm = LLM(model=tiny_path, dtype="float32", seed=0, max_num_seqs=256, gpu_memory_utilization=0.3,
              enforce_eager=True, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
              enable_chunked_prefill=False, max_num_batched_tokens=8192, disable_log_stats=True)

    def run_llm(p: SamplingParams) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], [vsp(p, s) for s in seeds], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    # Ours, and raw 2: AsyncLLM.generate on the very engine ours wraps.
    gen = VLLMGenerator(tiny_path, GeneratorConfig(backend="vllm", max_batch_size=256, seed=0), num_threads=2)
    try:
        def run_ours(p: SamplingParams) -> list[list[int]]:
            return [g[0].response_ids for g in gen.generate(prompts, 1, p, seeds=seeds)]

        async def _raw_async(p: SamplingParams) -> list[list[int]]:
            import asyncio
            import uuid

            async def one(q, s):
                final = None
                async for out in gen.engine.generate({"prompt_token_ids": q}, vsp(p, s), request_id=uuid.uuid4().hex):
                    final = out
                return list(final.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(q, s) for q, s in zip(prompts, seeds))))

        def run_raw_async(p: SamplingParams) -> list[list[int]]:
            return gen._call(_raw_async(p))

        for run in (run_llm, run_raw_async, run_ours):
            run(warm)
        for _ in range(args.gen_reps):  # interleaved: all three see the same machine conditions
            timed("raw vllm.LLM.generate", lambda: run_llm(params))
            timed("raw AsyncLLM.generate (same engine)", lambda: run_raw_async(params))
            timed("ours VLLMGenerator.generate", lambda: run_ours(params))
    finally:
        gen.close()
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    same = tokens["ours VLLMGenerator.generate"] == tokens["raw vllm.LLM.generate"] == \
        tokens["raw AsyncLLM.generate (same engine)"]
    lines = [f"generation: built-in tiny model, {n_prompts} prompts x up to {n_tokens} tokens (stop at <|im_end|>), "
             f"temperature 1, per-request seeds, logprobs=0; best of {args.gen_reps} runs after a warm-up",
             f"{'engine':44s} {'tok/s':>9s} {'ours / this':>11s}"]
    ours = rates["ours VLLMGenerator.generate"]
    for name, r in rates.items():
        lines.append(f"{name:44s} {r:9,.0f} {ours / r:11.2f}")
    lines.append(f"{'PASS' if same else 'FAIL'}  same seeds -> identical token ids in all three: {same} "
                 f"({sum(len(t) for t in tokens['ours VLLMGenerator.generate'])} tokens)")
    return lines


# ---------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="~10M model, 16 MB buckets (several per push), 1 timed push per row, fewer prompts")
    parser.add_argument("--buckets-mb", default=None, help="comma-separated bucket sizes in MiB (default 64,256,1024)")
    parser.add_argument("--reps", type=int, default=3, help="timed pushes per row, after one cold push")
    parser.add_argument("--vllm-bucket-mb", type=float, default=256.0)
    parser.add_argument("--vllm-reps", type=int, default=3)
    parser.add_argument("--skip-vllm", action="store_true", help="only memcpy and the HF rows")
    parser.add_argument("--skip-generation", action="store_true", help="no generation part (part 3)")
    parser.add_argument("--gen-prompts", type=int, default=None, help="generation prompts (default 256)")
    parser.add_argument("--gen-tokens", type=int, default=None, help="max tokens per response (default 64)")
    parser.add_argument("--gen-reps", type=int, default=3)
    args = parser.parse_args()
    if min(args.reps, args.vllm_reps, args.gen_reps) < 1:
        parser.error("--reps, --vllm-reps and --gen-reps must be >= 1")
    as_mb = lambda x: int(x) if float(x) == int(float(x)) else float(x)  # noqa: E731  (64, not 64.0)
    args.buckets_mb = [as_mb(x) for x in (args.buckets_mb or ("16" if args.quick else "64,256,1024")).split(",")]
    if args.quick and args.vllm_bucket_mb == parser.get_default("vllm_bucket_mb"):
        args.vllm_bucket_mb = 16.0
    args.vllm_bucket_mb = as_mb(args.vllm_bucket_mb)
    args.gen_prompts = args.gen_prompts or (64 if args.quick else 256)
    args.gen_tokens = args.gen_tokens or (32 if args.quick else 64)
    if args.quick:
        args.reps, args.vllm_reps, args.gen_reps = 1, 1, 1

    from async_rl.data.builtin import resolve

    wall0 = time.perf_counter()
    tiny_path = resolve("builtin:tiny-qwen2")
    mem = memcpy_gbps()
    print(f"memcpy: torch dst.copy_(src), 256 MB uint8, best of 5: {mem:.2f} GB/s", flush=True)
    work = tempfile.mkdtemp(prefix="bench-weight-sync-")
    checks: list[str] = []
    gen_lines: list[str] = []
    try:
        spec = QUICK_MODEL if args.quick else FULL_MODEL
        model = build_model(work, spec, tiny_path)
        n_params = sum(p.numel() for p in model.parameters())
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        print(f"learner: random-init Qwen2 {spec}, tied embeddings, float32: {n_params:,} parameters, "
              f"{model_bytes / 1e6:.1f} MB", flush=True)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(work)
        table = Table(model_bytes, mem)
        print(Table.HEAD, flush=True)
        bench_hf(args, model, work, tok.pad_token_id, table, checks)
        if not args.skip_vllm:
            bench_vllm_sync(args, model, work, tok.eos_token_id, table, checks)
            if not args.skip_generation:
                gen_lines = bench_generation(args, tiny_path)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print("\n==== results " + "=" * 90)
    print(f"memcpy (torch copy_, 256 MB uint8, best of 5): {mem:.2f} GB/s")
    print(f"learner: {n_params:,} parameters, {model_bytes / 1e6:.1f} MB float32; sync time = learner export "
          f"start -> every engine loaded; GB/s = 10^9 model bytes / s; 1 cold push + {args.reps} timed "
          f"({args.vllm_reps} for vLLM)")
    print(Table.HEAD)
    for row in table.rows:
        print(row)
    print(f"copy bound = memcpy {mem:.2f} GB/s / copies; copies counted on a push's critical path (copies the "
          f"engines make at the same time, each on its own core, count once):")
    for line in Table.legend():
        print(line)
    for c in checks:
        print(c)
    for line in gen_lines:
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; wall {time.perf_counter() - wall0:.0f} s")


if __name__ == "__main__":
    main()
