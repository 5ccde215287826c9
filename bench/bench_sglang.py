"""Our SGLang generator against raw SGLang, side by side in one run, on one engine.

Both sides sample the same prompts with the same settings (temperature 1, ``--max-tokens``,
``--n`` samples per prompt, the built-in tiny model's stop ids) from the same ``sglang.Engine``:

* ``raw``: one ``Engine.async_generate`` call with every sample as a row of ``input_ids``
  (``return_logprob=True``), the way a script would drive SGLang directly;
* ``ours``: ``SGLangGenerator.generate`` (one request per sample with its own seed, per-version
  cache salt, behavior log-probs and per-token policy versions parsed into ``Sample``s).

Rounds alternate (raw, ours, raw, ours...) after one warm-up of each, so both see the same
machine load. Printed: generated tokens/s of each (median over rounds) and ours / raw.
Run from the SGLang venv (``envs/sglang-cpu/build.sh``):

    .venv-sglang/bin/python bench/bench_sglang.py [--prompts 16] [--n 4] [--max-tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.sglang import SGLangGenerator

    path = resolve("builtin:tiny-qwen2")
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok(f"{i}+{i * 7 % 50}=")["input_ids"] for i in range(args.prompts)]
    stops = (tok.eos_token_id,)
    gen = SGLangGenerator(path, GeneratorConfig(backend="sglang", max_batch_size=256,
                                                max_response_tokens=args.max_tokens), num_threads=args.threads)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=stops)
    rows = [p for p in prompts for _ in range(args.n)]
    sp = {"temperature": 1.0, "max_new_tokens": args.max_tokens, "stop_token_ids": list(stops), "no_stop_trim": True}

    def raw() -> int:
        async def go():
            return await gen.engine.async_generate(input_ids=rows, sampling_params=sp, return_logprob=True)

        outs = asyncio.run_coroutine_threadsafe(go(), gen.loop).result()
        return sum(len(o["output_ids"]) for o in outs)

    def ours() -> int:
        groups = gen.generate(prompts, args.n, params, seeds=list(range(len(prompts))))
        return sum(len(s.response_ids) for g in groups for s in g)

    rates: dict[str, list[float]] = {"raw": [], "ours": []}
    try:
        raw(), ours()  # warm-up
        for _ in range(args.rounds):
            for name, fn in (("raw", raw), ("ours", ours)):
                t0 = time.perf_counter()
                tokens = fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
    finally:
        gen.close()
    r, o = statistics.median(rates["raw"]), statistics.median(rates["ours"])
    print(f"{args.prompts} prompts x {args.n} samples, up to {args.max_tokens} tokens, {args.threads} threads, "
          f"{args.rounds} rounds (median)")
    print(f"raw SGLang async_generate: {r:8.0f} tok/s")
    print(f"SGLangGenerator.generate : {o:8.0f} tok/s   ours / raw = {o / r:.2f}x")


if __name__ == "__main__":
    main()
