"""GPU check of the SGLang generator: each weight path against a fresh engine, on CUDA.

For each path an ``SGLangGenerator`` started on the base weights loads a perturbed copy and its
log-probs on fixed sequences (``prompt_logprobs``) are compared with those of a fresh engine
started from the perturbed copy (PASS when the largest difference is below ``--tol``; the base
engine's own difference is printed too, so a check that cannot fail shows up). Rows:

* ``colocated``: ``update_weights`` -> SGLang's ``update_weights_from_tensor`` (the hybrid
  engine's path; CUDA IPC handles on GPU);
* ``shm``: a ``WeightPublisher`` over ``/dev/shm`` slots, staged and loaded with
  ``update_weights_from_tensor``;
* ``broadcast``: a ``WeightPublisher`` of protocol ``sglang`` (NCCL on CUDA): the engine's
  scheduler joins through ``init_weights_update_group`` and receives each bucket with
  ``update_weights_from_distributed(load_format="flattened_bucket")``. With ONE GPU the learner's
  sender and the engine share the device, which NCCL refuses (``Duplicate GPU detected``): the row
  then records the error, and is expected to fail there; it runs last.
* ``keep`` / ``abort``: an update landing mid-generation, then the same comparison.
* ``lora``: a LoRA engine loading a second adapter against a fresh one loading it first.

Also printed: engine start seconds and SGLang's tokens/s on one batch.

How to run, in an environment with SGLang for CUDA installed (``pip install sglang``; the repo's
``.venv-sglang`` is the CPU route), from the repo root::

    PYTHONUNBUFFERED=1 python bench/gpu_sglang_check.py 2>&1 | tee $OUT/gpu_sglang.log

``--device cpu`` runs the same rows on CPU (gloo instead of NCCL): the smoke test of this script,
run in the CPU venv. Exit status: 0 all PASS, 1 a FAIL, 2 SGLang missing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22, 23], [3, 30, 40, 50, 60, 70, 80, 90]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        print(f"SKIP: SGLang is not installed ({e})")
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.data.builtin import resolve
    from async_rl.generators.base import GeneratorConfig, SamplingParams
    from async_rl.generators.sglang import SGLangGenerator
    from async_rl.weight_sync import LocalTarget, NamedTensors, WeightPublisher, WeightSyncConfig

    base = resolve("builtin:tiny-qwen2")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    w0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    w1 = {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    tied = bool(model.config.tie_word_embeddings)
    if tied:
        w1["lm_head.weight"] = w1["model.embed_tokens.weight"]
    tmp = Path(tempfile.mkdtemp(prefix="gpu-sglang-"))
    model.load_state_dict(w1)
    model.save_pretrained(tmp / "w1")

    def engine(path, **kw):
        t0 = time.perf_counter()
        e = SGLangGenerator(str(path), GeneratorConfig(backend="sglang", max_response_tokens=128, **kw),
                            device=args.device, num_threads=2)
        return e, time.perf_counter() - t0

    fresh, start_s = engine(tmp / "w1")
    want = fresh.prompt_logprobs(SEQS)
    fresh.close()
    print(f"engine start {start_s:.1f} s on {args.device}")

    def diff(e):
        return max(abs(a - b) for got, ref in zip(e.prompt_logprobs(SEQS), want) for a, b in zip(got, ref))

    dev = "cuda" if args.device.startswith("cuda") else "cpu"
    on_dev = lambda w: [(n, t.to(dev)) for n, t in w.items() if not (tied and n == "lm_head.weight")]  # noqa: E731
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
    results = []

    def row(name, fn):
        e, _ = engine(base)
        try:
            before = diff(e)
            t0 = time.perf_counter()
            fn(e)
            secs = time.perf_counter() - t0
            after = diff(e)
            ok = after < args.tol < before
            results.append(ok)
            print(f"{'PASS' if ok else 'FAIL'} {name:10s} max |dlogp| {after:.2e} (before the update {before:.2e}), "
                  f"{secs:.2f} s")
        except Exception as err:  # noqa: BLE001 - a row's failure is its result
            results.append(False)
            print(f"FAIL {name:10s} {type(err).__name__}: {err}")
        finally:
            e.close()

    def colocated(e):
        e.update_weights(on_dev(w1), 1)

    def bucket(transport):
        def go(e):
            pub = WeightPublisher(WeightSyncConfig(transport=transport, bucket_size_mb=1), transport,
                                  NamedTensors(on_dev(w1), aliases), [LocalTarget(e)], device=dev, protocol="sglang")
            try:
                pub.push(1)
            finally:
                pub.close()
        return go

    def mid_generation(mode):
        def go(e):
            e.cfg.partial_rollout = mode
            params = SamplingParams(temperature=1.0, max_tokens=128, stop_token_ids=(10**6,))
            out = {}
            t = threading.Thread(target=lambda: out.update(s=e.generate([[5, 6, 7]] * 8, 2, params)))
            t.start()
            while e._active == 0:
                time.sleep(0.001)
            e.update_weights(on_dev(w1), 1)
            t.join()
            n = sum(len(s.response_ids) for r in out["s"] for s in r)
            print(f"     {mode}: {n} tokens, {e.num_weight_updates_in_flight} in-flight updates, "
                  f"{e.num_reissued} re-issued")
        return go

    row("colocated", colocated)
    row("shm", bucket("shm"))
    row("keep", mid_generation("keep"))
    row("abort", mid_generation("abort"))
    row("broadcast", bucket("broadcast"))

    # LoRA: an adapter loaded into a running engine against one loaded into a fresh engine.
    from async_rl.utils.lora import LoRAConfig

    def lora_engine():
        return SGLangGenerator(str(base), GeneratorConfig(backend="sglang"), device=args.device, num_threads=2,
                               lora=LoRAConfig(rank=8))

    try:
        ref = lora_engine()
        g2 = torch.Generator().manual_seed(2)
        adapter = [(n, (0.1 * torch.randn(shape, generator=g2)).to(dev)) for n, (_, shape) in ref.weight_specs().items()]
        ref.update_weights(adapter, 1)
        want_lora = ref.prompt_logprobs(SEQS)
        ref.close()
        e = lora_engine()
        g1 = torch.Generator().manual_seed(1)
        e.update_weights([(n, (0.1 * torch.randn(t.shape, generator=g1)).to(dev)) for n, t in adapter], 1)
        t0 = time.perf_counter()
        e.update_weights(adapter, 2)
        secs = time.perf_counter() - t0
        got = e.prompt_logprobs(SEQS)
        e.close()
        d = max(abs(a - b) for g_, w_ in zip(got, want_lora) for a, b in zip(g_, w_))
        results.append(d < args.tol)
        print(f"{'PASS' if d < args.tol else 'FAIL'} {'lora':10s} max |dlogp| {d:.2e} against a fresh engine, {secs:.2f} s")
    except Exception as err:  # noqa: BLE001 - the row's failure is its result
        results.append(False)
        print(f"FAIL lora       {type(err).__name__}: {err}")

    e, _ = engine(base)
    try:
        params = SamplingParams(temperature=1.0, max_tokens=128, stop_token_ids=(10**6,))
        e.generate([[5, 6, 7]] * 4, 1, params)
        t0 = time.perf_counter()
        n = sum(len(s.response_ids) for r in e.generate([[5, 6, 7]] * 64, 1, params) for s in r)
        print(f"generation: {n / (time.perf_counter() - t0):.0f} tok/s (64 samples x up to 128 tokens)")
    finally:
        e.close()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
