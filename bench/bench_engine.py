"""Engine overhead: our generators against the raw engine they wrap, same model, prompts and settings.

What it measures (one host, CPU, the built-in tiny Qwen2, ``builtin:tiny-qwen2``):

* **vLLM**: ``VLLMGenerator.generate`` against ``AsyncLLM.generate`` called directly on the very
  engine ours wraps (same process, same engine, same loop thread), and optionally against
  ``vllm.LLM.generate`` (an engine of its own with the same engine args minus our worker
  extension; ``--with-llm``). Every sample is its own request (``n=1``) seeded with
  ``mix_seed(seed_i, j)`` as ours seeds them, temperature 1, top-p 1, top-k off, ``ignore_eos``
  with the EOS as stop id, ``logprobs=0``, ``detokenize=False``, ``max_tokens``; the raw rows
  ask for final-only outputs (``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` does and ours
  does) and read nothing from them but the token ids (a
  reference row asks for ``flat_logprobs`` as ours does: the same log-probs in flat lists
  instead of a dict per token, cheaper for vLLM's output processor too). Ours runs
  in both ``partial_rollout`` modes (``keep``, the default, and ``abort``); no weight update
  arrives during the bench, so the two rows measure the same sampling path twice.
* **HF**: ``HFGenerator.generate`` against plain ``model.generate`` on a second copy of the
  model: ``do_sample=True``, temperature 1, ``top_k=0``, ``top_p=1``, the same left-padded rows
  (each prompt repeated ``n`` times), ``max_new_tokens``, EOS as stop id. Ours samples with its
  own per-row generators and records behavior log-probs and versions; plain ``generate`` draws
  from the global RNG and records nothing.

tokens/s counts the tokens each run actually produced (up to and including the first stop token;
the vLLM rows must produce identical token ids, which is checked). Each row is warmed up, then
all rows of an engine run interleaved ``--reps`` times so they see the same machine load; the
median is reported, with ``ours / raw`` against the target ``>= 0.95``, both per wall second and
per CPU second of this process and its descendants (the engine's processes): on a machine shared
with other jobs the wall rate swings with their load, the CPU rate much less. The load average
is printed.

Run (about 5 minutes on 2 loaded cores; ``--skip-hf`` about 3)::

    ASYNC_RL_CACHE=/tmp/arl-cache python bench/bench_engine.py [--prompts 32] [--n 4] [--tokens 128]
        [--reps 5] [--skip-vllm] [--skip-hf] [--with-llm] [--profile] [--generator-file FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGET = 0.95
"""ours / raw tokens/s we aim for (issue 20, part 3)."""


def _prompts(tok, num_prompts: int) -> list[list[int]]:
    return [list(tok.apply_chat_template([{"role": "user", "content": f"{i % 97}+{i // 97 + 3}="}],
                                         add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(num_prompts)]


def _cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every live descendant (the
    vLLM engine core and its workers)."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


class Rows:
    """Interleaved timed rows: ``time(name, run)`` with ``run() -> list of token id lists``.

    Two rates per run: tokens per wall second, and tokens per CPU second of this process and its
    descendants (``_cpu_s``). On a machine shared with other jobs the wall rate of a run swings
    with their load (a factor 2 between identical runs was seen here); the CPU rate counts only
    the work the run itself did, so it is what compares overheads there."""

    def __init__(self) -> None:
        self.rates: dict[str, list[float]] = {}
        self.cpu_rates: dict[str, list[float]] = {}
        self.own_cpu: dict[str, list[float]] = {}
        """CPU seconds of this process alone per run: where a wrapper's own work shows (the
        engine's processes do the same work for the same requests)."""
        self.tokens: dict[str, list[list[int]]] = {}

    def time(self, name: str, run) -> None:
        import psutil

        me = psutil.Process()
        c0, p0, t0 = _cpu_s(), sum(me.cpu_times()[:2]), time.perf_counter()
        out = run()
        dt, dc, dp = time.perf_counter() - t0, _cpu_s() - c0, sum(me.cpu_times()[:2]) - p0
        n = sum(len(t) for t in out)
        self.rates.setdefault(name, []).append(n / dt)
        self.cpu_rates.setdefault(name, []).append(n / dc)
        self.own_cpu.setdefault(name, []).append(dp)
        self.tokens[name] = out
        print(f"  {name:48s} {n / dt:9,.0f} tok/s {n / dc:9,.0f} tok/CPU-s  ({n} tokens, {dt:.2f} s, "
              f"{dc:.2f} CPU-s, {dp:.2f} in this process)", flush=True)

    def interleave(self, runs: dict, reps: int) -> None:
        """``reps`` rounds over ``runs`` (name -> zero-argument run), the order rotated each round
        so no row always follows the same one."""
        names = list(runs)
        for rep in range(reps):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                self.time(name, runs[name])

    def report(self, raw: str, ours: list[str]) -> list[str]:
        med = {name: (statistics.median(self.rates[name]), statistics.median(self.cpu_rates[name]))
               for name in self.rates}
        own = {name: statistics.median(v) for name, v in self.own_cpu.items()}
        lines = [f"{'row':48s} {'tok/s':>8s} {'ours/raw':>8s} {'tok/CPU-s':>9s} {'ours/raw':>8s} {'own CPU-s':>9s}"
                 f"  target"]
        for name in [raw, *ours, *(n for n in self.rates if n != raw and n not in ours)]:
            (w, c), (rw, rc) = med[name], med[raw]
            if name == raw:
                lines.append(f"{name:48s} {w:8,.0f} {'':>8s} {c:9,.0f} {'':>8s} {own[name]:9.2f}")
                continue
            verdict = (f">= {TARGET}: wall {'PASS' if w / rw >= TARGET else 'MISS'}, "
                       f"CPU {'PASS' if c / rc >= TARGET else 'MISS'}" if name in ours else "(reference)")
            lines.append(f"{name:48s} {w:8,.0f} {w / rw:8.3f} {c:9,.0f} {c / rc:8.3f} {own[name]:9.2f}  {verdict}")
        return lines


def _profile_loop_thread(gen, run, top: int = 25) -> None:
    """cProfile of one ``run()``, taken in the generator's loop thread (where our per-request
    coroutines and vLLM's output handler run; cProfile sees only the thread that enabled it)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    gen.loop.call_soon_threadsafe(prof.enable)
    time.sleep(0.1)
    run()
    done = threading.Event()
    gen.loop.call_soon_threadsafe(lambda: (prof.disable(), done.set()))
    done.wait(10)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def bench_vllm(args, tiny_path: str, tok, prompts: list[list[int]]) -> list[str]:
    import asyncio
    import uuid

    from vllm import SamplingParams as VSP
    from vllm.sampling_params import RequestOutputKind

    from async_rl.generators.base import GeneratorConfig, SamplingParams, mix_seed
    from async_rl.generators.vllm import VLLMGenerator

    seeds = list(range(len(prompts)))
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, stop_token_ids=(tok.eos_token_id,))
    warm = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(tok.eos_token_id,))

    def vsp(p: SamplingParams, seed: int, flat: bool = False) -> VSP:  # what VLLMGenerator._sample builds
        return VSP(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens, seed=seed,
                   stop_token_ids=list(p.stop_token_ids), ignore_eos=True, logprobs=0, detokenize=False,
                   skip_special_tokens=False, flat_logprobs=flat, output_kind=RequestOutputKind.FINAL_ONLY)

    requests = [(q, mix_seed(s, j)) for q, s in zip(prompts, seeds) for j in range(args.n)]
    # The engine processes inherit these (VLLMGenerator sets the same for itself).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    rows = Rows()
    llm = None
    if args.with_llm:
        from vllm import LLM

        llm = LLM(model=tiny_path, dtype="float32", seed=0, max_num_seqs=256, gpu_memory_utilization=0.3,
                  enforce_eager=True, enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  enable_chunked_prefill=False, max_num_batched_tokens=8192, disable_log_stats=True)

    def run_llm(p: SamplingParams) -> list[list[int]]:
        outs = llm.generate([{"prompt_token_ids": q} for q, _ in requests], [vsp(p, s) for _, s in requests],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    if args.generator_file:  # another version of the generator (e.g. an older commit's), same bench
        import importlib.util

        spec = importlib.util.spec_from_file_location("bench_vllm_generator", args.generator_file)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        VLLMGenerator = module.VLLMGenerator  # noqa: N806
    gen = VLLMGenerator(tiny_path, GeneratorConfig(backend="vllm", max_batch_size=256, seed=0),
                        num_threads=args.threads)
    try:
        def run_ours(p: SamplingParams, mode: str) -> list[list[int]]:
            gen.cfg.partial_rollout = mode
            return [s.response_ids for g in gen.generate(prompts, args.n, p, seeds=seeds) for s in g]

        async def _raw_async(p: SamplingParams, flat: bool, salted: bool = False) -> list[list[int]]:
            async def one(q, s):
                final = None
                request = {"prompt_token_ids": q}
                if salted:  # the request exactly as ours renders it: a cache salt, rendered first
                    (request,) = gen.engine.renderer.render_cmpl([{**request, "cache_salt": gen._cache_salt()}])
                async for out in gen.engine.generate(request, vsp(p, s, flat), request_id=uuid.uuid4().hex):
                    final = out
                return list(final.outputs[0].token_ids)

            return list(await asyncio.gather(*(one(q, s) for q, s in requests)))

        def run_raw(p: SamplingParams, flat: bool = False, salted: bool = False) -> list[list[int]]:
            return gen._call(_raw_async(p, flat, salted))

        runs = {"raw AsyncLLM.generate (same engine)": run_raw,
                "raw AsyncLLM.generate, flat_logprobs": lambda p: run_raw(p, True),
                "raw AsyncLLM.generate, flat, salted as ours": lambda p: run_raw(p, True, True),
                "ours VLLMGenerator.generate (keep)": lambda p: run_ours(p, "keep"),
                "ours VLLMGenerator.generate (abort)": lambda p: run_ours(p, "abort")}
        if llm is not None:
            runs["raw vllm.LLM.generate (own engine)"] = run_llm
        for run in runs.values():
            run(warm)
        rows.interleave({name: (lambda run=run: run(params)) for name, run in runs.items()}, args.reps)
        if args.profile:
            print("---- cProfile of ours (keep), loop thread, by own time")
            _profile_loop_thread(gen, lambda: run_ours(params, "keep"))
    finally:
        gen.close()
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
    ours = ["ours VLLMGenerator.generate (keep)", "ours VLLMGenerator.generate (abort)"]
    ref = rows.tokens["raw AsyncLLM.generate (same engine)"]
    same = all(rows.tokens[name] == ref for name in rows.tokens)
    lines = [f"vLLM: {len(prompts)} prompts x {args.n} samples x up to {args.tokens} tokens, temperature 1, "
             f"per-request seeds, logprobs=0; median of {args.reps} interleaved runs after a warm-up"]
    lines += rows.report("raw AsyncLLM.generate (same engine)", ours)
    lines.append(f"{'PASS' if same else 'FAIL'}  identical token ids in every vLLM row: {same} "
                 f"({sum(len(t) for t in ref)} tokens)")
    return lines


def bench_hf(args, tiny_path: str, tok, prompts: list[list[int]]) -> list[str]:
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.generators.base import GeneratorConfig, SamplingParams, cut_at_stop
    from async_rl.generators.hf import HFGenerator

    pad, eos = tok.pad_token_id, tok.eos_token_id
    params = SamplingParams(temperature=1.0, max_tokens=args.tokens, stop_token_ids=(eos,))
    warm = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=(eos,))
    gen = HFGenerator(tiny_path, GeneratorConfig(max_batch_size=256, seed=0), pad_token_id=pad)
    model = AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    rows_in = [q for q in prompts for _ in range(args.n)]
    width = max(len(q) for q in rows_in)
    input_ids = torch.full((len(rows_in), width), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, q in enumerate(rows_in):  # left padding, as ours pads
        input_ids[i, width - len(q):] = torch.tensor(q)
        mask[i, width - len(q):] = 1

    @torch.inference_mode()
    def run_plain(p: SamplingParams) -> list[list[int]]:
        out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=p.max_tokens, eos_token_id=list(p.stop_token_ids),
                             pad_token_id=pad)
        new = out[:, width:].tolist()
        return [t[: cut_at_stop(t, p.stop_token_ids)[0]] for t in new]

    def run_ours(p: SamplingParams) -> list[list[int]]:
        return [s.response_ids for g in gen.generate(prompts, args.n, p, seeds=list(range(len(prompts)))) for s in g]

    runs = {"raw transformers model.generate": run_plain, "ours HFGenerator.generate": run_ours}
    rows = Rows()
    torch.manual_seed(0)
    for run in runs.values():
        run(warm)
    rows.interleave({name: (lambda run=run: run(params)) for name, run in runs.items()}, args.reps)
    if args.profile:
        import cProfile
        import pstats

        print("---- cProfile of ours, by own time")
        prof = cProfile.Profile()
        prof.runcall(run_ours, params)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    lines = [f"HF: {len(prompts)} prompts x {args.n} samples x up to {args.tokens} tokens, temperature 1, "
             f"{torch.get_num_threads()} torch thread(s); median of {args.reps} interleaved runs after a warm-up"]
    return lines + rows.report("raw transformers model.generate", ["ours HFGenerator.generate"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--tokens", type=int, default=128, help="max tokens per response")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per row (median reported)")
    parser.add_argument("--threads", type=int, default=2, help="OpenMP threads of the vLLM engine process")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--with-llm", action="store_true", help="also time vllm.LLM.generate (its own engine)")
    parser.add_argument("--generator-file", default=None,
                        help="time VLLMGenerator from this file instead (e.g. `git show HEAD~1:generators/vllm/engine.py`)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of one run of ours per engine")
    args = parser.parse_args()
    if min(args.prompts, args.n, args.tokens, args.reps) < 1:
        parser.error("--prompts, --n, --tokens and --reps must be >= 1")

    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve

    wall0 = time.perf_counter()
    tiny_path = resolve("builtin:tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(tiny_path)
    prompts = _prompts(tok, args.prompts)
    lines: list[str] = []
    if not args.skip_hf:
        lines += bench_hf(args, tiny_path, tok, prompts)
    if not args.skip_vllm:
        lines += bench_vllm(args, tiny_path, tok, prompts)
    print("\n==== results " + "=" * 70)
    for line in lines:
        print(line)
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; wall {time.perf_counter() - wall0:.0f} s")


if __name__ == "__main__":
    main()
