"""Async vs sync speed-up on a long-tailed response-length workload, side by side in one run.

Both modes train the same number of samples (steps x prompts x samples per prompt) with the real
pipeline (``async_rl.trainer.train``): the HF generator, the FSDP2 learner, and in async mode
the Ray generator pool, the ZMQ transport and the replay buffer. The workload: the built-in tiny
model at its random initialisation samples nearly uniformly over its 262-token vocabulary, and
``--stop-ids`` of those tokens end a response, so lengths are geometric (mean about 262 /
stop-ids tokens, capped at ``--max-tokens``): most responses are short and a few are many times
longer, the long tail that makes a sync step wait for its slowest sample.

Two measurements, each a table:

* **End to end** (``--sections e2e``): sync mode uses every core for each phase (its colocated
  engine, then its learner), async mode splits them between the actors and the learner
  (``thread_budget``). What a user of this machine gets; the bound below is not attainable by
  construction here, since sync gets twice the cores per phase.
* **Same placement** (``--sections placement``): in both modes generation runs on core A and the
  learner on core B, one torch thread each (``generator.cpu_affinity=[A]``,
  ``learner.cpu_affinity=[B]``; sync mode moves between them per phase), so sync pays G + T per
  step and async max(G, T) plus its overheads. The rows: async with in-flight weight updates
  continued (``generator.partial_rollout=keep``) and aborted and re-issued (``abort``).
* **Weight push** (``--sections push``): async mode in the same placement, with
  ``weight_sync.overlap_push`` off (every push blocks the learner until every engine loaded it)
  and on (the learner stages its weights and trains on while a background thread pushes them).
  Per row: the learner's blocking seconds ``timing/weight_sync_s`` as a share of its step
  ``timing/step_s``, the seconds until a version is published (``weight_sync/publish_lag_s``)
  and the RL wall time; then the share with overlap on divided by the share with it off.

* **Co-run interference** (``--sections corun``): the generator's work (``HFGenerator.generate``
  on the same workload) pinned to core A and the learner's (forward, backward and AdamW step of
  the same model on a [32, 60] batch) pinned to core B, one thread each, each timed alone and
  then both at once. Async mode can only reach max(G, T) if neither slows the other down; the
  slowdowns a (generation) and b (training) measured here, with no run-queue wait (each has its
  own core), are the hardware's share (caches, memory bandwidth, the host's scheduling of the
  two virtual CPUs), and (G + T) / max(a G, b T) is the bound that remains (G, T: the placement
  table's, when it ran).

Each table prints wall-clock seconds of the RL phase per mode, the speed-up sync / async, and the
ideal overlap bound (G + T) / max(G, T) from that table's sync run: its mean generation time G
and training + weight sync time T per step (the first step, which pays one-off warm-up costs,
left out). The placement table adds the efficiency speed-up / bound against the target 0.90 and,
per async run, where its steps' time went (``timing/*`` means per step: waiting for data,
training, weight sync, the rest) and how busy the generator was (``perf/generator_busy_frac``);
the train phase of each mode is split into the training thread's CPU time, its wait for a core
and the rest, blocked (``timing/train_cpu_s``, ``timing/train_runqueue_s``).

    python bench/bench_async.py [--steps 8] [--workers 1,2] [--max-staleness 1] [--cores 0,1]
        [--sections e2e,placement,push,corun] [--repeats 1] [--corun-s 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _overrides(args, out: str, name: str) -> list[str]:
    stops = list(range(100, 100 + args.stop_ids))
    return [
        f"trainer.output_dir={out}", f"trainer.run_name={name}", f"trainer.total_steps={args.steps}",
        f"trainer.prompts_per_step={args.prompts}", f"trainer.samples_per_prompt={args.samples}",
        "trainer.warm_start.steps=0", "trainer.eval_every_steps=0", "data.val_files=[]",
        "trainer.export_model=false", "logging.progress=false", "logging.console_every_steps=1000",
        f"generator.max_response_tokens={args.max_tokens}", f"generator.extra_stop_token_ids={stops}",
        "learner.num_mini_batches=2", "learner.micro_batch_size=32", "learner.warmup_steps=0",
    ]


def _step_metrics(out: str, names: list[str]) -> list[dict]:
    """The per-step metrics rows of runs ``names``, each without its first step (one-off warm-up
    costs)."""
    rows = []
    for name in names:
        lines = [json.loads(l) for l in (Path(out) / name / "metrics.jsonl").read_text().splitlines()]
        rows += [l for l in lines if l.get("step", 0) >= 1 and "timing/step_s" in l][1:]
    return rows


def _mean(steps: list[dict], key: str) -> float:
    """Mean of ``key`` over the steps that report it (0.0 when none does)."""
    values = [l[key] for l in steps if key in l]
    return statistics.mean(values) if values else 0.0


def _table(title: str, rows: list[tuple[str, list[float]]], samples: int, G: float, T: float) -> float:
    """Print one table (median wall per row, each run's in brackets); returns the bound
    (G + T) / max(G, T), with G and T the sync runs' mean seconds per step."""
    bound = (G + T) / max(G, T)
    base = statistics.median(rows[0][1])
    print(f"\n{title}")
    print(f"sync step breakdown: generate G = {G:.2f} s, train + weight sync T = {T:.2f} s")
    print(f"{'mode':50s} {'RL wall s':>10s} {'samples/s':>10s} {'speed-up':>9s}  runs (s)")
    for name, walls in rows:
        wall = statistics.median(walls)
        print(f"{name:50s} {wall:10.1f} {samples / wall:10.1f} {base / wall:8.2f}x  "
              + ", ".join(f"{w:.1f}" for w in walls))
    print(f"ideal overlap bound (G + T) / max(G, T) = {bound:.2f}x")
    return bound


def _train_split(steps: list[dict]) -> str:
    """Where the training thread's ``timing/train_s`` went: its CPU time, its wait for a core
    (run queue) and the rest, blocked (GIL, locks, I/O); means per step."""
    train_s, cpu = _mean(steps, "timing/train_s"), _mean(steps, "timing/train_cpu_s")
    queued = _mean(steps, "timing/train_runqueue_s")
    return f"CPU {cpu:.2f} + run queue {queued:.2f} + blocked {train_s - cpu - queued:.2f}"


def _breakdown(label: str, steps: list[dict], speedup: float, bound: float, G: float, T: float) -> None:
    """One async row's efficiency against the target and where its steps' time went."""
    eff = speedup / bound
    wait, train_s = _mean(steps, "timing/wait_for_data_s"), _mean(steps, "timing/train_s")
    sync_s, step_s = _mean(steps, "timing/weight_sync_s"), _mean(steps, "timing/step_s")
    print(f"{label}: efficiency speed-up / bound = {eff:.2f} (target >= 0.90: {'met' if eff >= 0.9 else 'NOT met'})")
    print(f"  per step {step_s:.2f} s (max(G, T) = {max(G, T):.2f}) = wait for data {wait:.2f} + train {train_s:.2f} "
          f"({_train_split(steps)}) + weight sync {sync_s:.2f} + rest {step_s - wait - train_s - sync_s:.2f}; generator busy "
          f"{_mean(steps, 'perf/generator_busy_frac'):.2f}, engine {_mean(steps, 'perf/engine_tokens_per_s'):.0f} "
          f"tokens/s busy, staleness mean "
          f"{_mean(steps, 'staleness/mean'):.2f}")


def _push_table(title: str, rows: list[tuple[str, list[float], list[dict]]]) -> None:
    """The weight push section: per row (label, RL walls, step metrics) the learner's blocking
    weight-sync seconds as a share of its step, the lag until published and the wall time; the
    first row (overlap off) is the baseline."""
    print(f"\n{title}")
    print(f"{'mode':50s} {'RL wall s':>10s} {'step s':>7s} {'weight sync s':>14s} {'share':>6s} "
          f"{'publish lag s':>14s} {'speed-up':>9s}")
    base = statistics.median(rows[0][1])
    shares = []
    for label, walls, steps in rows:
        step_s, sync_s = _mean(steps, "timing/step_s"), _mean(steps, "timing/weight_sync_s")
        lag = [l["weight_sync/publish_lag_s"] for l in steps if "weight_sync/publish_lag_s" in l]
        shares.append(sync_s / max(step_s, 1e-9))
        wall = statistics.median(walls)
        print(f"{label:50s} {wall:10.1f} {step_s:7.3f} {sync_s:14.4f} {shares[-1]:6.1%} "
              f"{statistics.mean(lag) if lag else float('nan'):14.4f} {base / wall:8.2f}x")
    print(f"weight sync share of a step, overlap on / off = {shares[1]:.1%} / {shares[0]:.1%} = "
          f"{shares[1] / max(shares[0], 1e-12):.2f}x")


def _corun_worker(role: str, core: int, seconds: float, max_tokens: int, stop_ids: int, conn) -> None:
    """One side of the co-run section, in its own process pinned to ``core`` with one thread:
    ``role`` ``generate`` (tokens) or ``train`` (tokens through a forward, backward and optimizer
    step). Sends ``ready`` after a warm-up, waits for the go, runs for ``seconds`` and sends
    ``(units per second, CPU seconds per unit)``."""
    import time

    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)
    from async_rl.data.builtin import resolve

    path = resolve("builtin:tiny-qwen2")
    if role == "generate":
        from transformers import AutoTokenizer

        from async_rl.generators.base import GeneratorConfig, SamplingParams
        from async_rl.generators.hf import HFGenerator

        tok = AutoTokenizer.from_pretrained(path)
        gen = HFGenerator(path, GeneratorConfig(max_batch_size=256, seed=0), pad_token_id=tok.pad_token_id)
        prompts = [[3 + i, 40 + i, 7, 9 + i] for i in range(8)]
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens,
                                stop_token_ids=tuple(range(100, 100 + stop_ids)))

        def unit() -> int:
            return sum(len(s.response_ids) for g in gen.generate(prompts, 4, params) for s in g)
    else:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        ids = torch.randint(0, model.config.vocab_size, (32, 60), generator=torch.Generator().manual_seed(0))

        def unit() -> int:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            return ids.numel()

    unit()
    conn.send("ready")
    conn.recv()
    t0, c0, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t0 < seconds:
        n += unit()
    conn.send((n / (time.perf_counter() - t0), (time.process_time() - c0) / max(n, 1)))


def _corun(args, cores: list[int], G: float | None, T: float | None) -> None:
    """The co-run section (see the module docstring): prints each role's rate alone and together,
    the slowdowns, and the bound they leave."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def run(roles: list[str]) -> dict[str, tuple[float, float]]:
        procs, conns = [], {}
        for role in roles:
            parent, child = ctx.Pipe()
            core = cores[0] if role == "generate" else cores[-1]
            p = ctx.Process(target=_corun_worker, args=(role, core, args.corun_s, args.max_tokens, args.stop_ids,
                                                        child), daemon=True)
            p.start()
            procs.append(p)
            conns[role] = parent
        for c in conns.values():
            assert c.recv() == "ready"
        for c in conns.values():
            c.send("go")
        out = {role: c.recv() for role, c in conns.items()}
        for p in procs:
            p.join(60)
        return out

    alone = {**run(["generate"]), **run(["train"])}
    together = run(["generate", "train"])
    print(f"\nCO-RUN INTERFERENCE (generation on core {cores[0]}, a training step on core {cores[-1]}, one thread "
          f"each, {args.corun_s:.0f} s per run)")
    print(f"{'role':10s} {'alone/s':>10s} {'together/s':>11s} {'slowdown':>9s} {'CPU s/unit alone':>17s} "
          f"{'together':>9s}")
    slow = {}
    for role, unit in (("generate", "tokens"), ("train", "tokens")):
        (ra, ca), (rt, ct) = alone[role], together[role]
        slow[role] = ra / rt
        print(f"{role:10s} {ra:10,.0f} {rt:11,.0f} {slow[role]:8.2f}x {ca * 1e6:15.1f}us {ct * 1e6:7.1f}us  ({unit})")
    if G and T:
        bound, corun = (G + T) / max(G, T), (G + T) / max(slow["generate"] * G, slow["train"] * T)
        print(f"bound (G + T) / max(G, T) = {bound:.2f}x; with the co-run slowdowns, (G + T) / max(a G, b T) = "
              f"{corun:.2f}x ({corun / bound:.2f} of the bound: the most any overlap reaches on these cores)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--stop-ids", type=int, default=10)
    parser.add_argument("--workers", default="1,2", help="comma-separated generator pool sizes to try (e2e)")
    parser.add_argument("--max-staleness", type=int, default=1)
    parser.add_argument("--cores", default=None,
                        help="A,B: the generator's core and the learner's (placement); default the first two "
                             "this process may use")
    parser.add_argument("--sections", default="e2e,placement,push", help="comma-separated: e2e, placement, push, corun")
    parser.add_argument("--corun-s", type=float, default=10.0, help="seconds per run of the corun section")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each row, interleaved (a round runs every row once), so a machine whose load "
                             "changes treats the modes alike; the median wall is printed")
    args = parser.parse_args()
    sections = args.sections.split(",")
    if not set(sections) <= {"e2e", "placement", "push", "corun"}:
        parser.error(f"--sections: any of e2e, placement, push, corun, got {args.sections}")

    from async_rl.config import load_config
    from async_rl.trainer import train

    out = tempfile.mkdtemp(prefix="bench-async-")
    samples = args.steps * args.prompts * args.samples
    async_cfg = ["trainer.mode=async", f"trainer.max_staleness={args.max_staleness}"]
    tables = []  # (section, title, [(label, run name, overrides)]); the first row is the sync baseline
    if "e2e" in sections:
        rows = [("sync", "sync", [])] + [
            (f"async, {w} worker(s), max_staleness {args.max_staleness}", f"async{w}",
             async_cfg + [f"generator.num_workers={w}"]) for w in [int(x) for x in args.workers.split(",")]]
        tables.append(("e2e", "END TO END (sync: all cores per phase; async: cores split by the thread budget)", rows))
    cores = [int(c) for c in args.cores.split(",")] if args.cores else sorted(os.sched_getaffinity(0))[:2]
    pinned = [f"generator.cpu_affinity=[{cores[0]}]", f"learner.cpu_affinity=[{cores[-1]}]",
              "generator.threads_per_worker=1", "learner.num_threads=1"]
    if ({"placement", "push", "corun"} & set(sections)) and len(cores) != 2:
        raise SystemExit(f"--cores: the placement, push and corun sections need two cores, got {cores}")
    if "placement" in sections:
        rows = [("sync, pinned", "sync_pinned", pinned)] + [
            (f"async, pinned, max_staleness {args.max_staleness}, partial_rollout={mode}", f"async_pinned_{mode}",
             pinned + async_cfg + ["generator.num_workers=1", f"generator.partial_rollout={mode}"])
            for mode in ("keep", "abort")]
        tables.append(("placement", f"SAME PLACEMENT (generator on core {cores[0]}, learner on core {cores[1]}, "
                                    "1 torch thread each, both modes)", rows))

    if "push" in sections:
        rows = [(f"async, pinned, max_staleness {args.max_staleness}, overlap_push={on}", f"async_push_{on}",
                 pinned + async_cfg + ["generator.num_workers=1", "generator.partial_rollout=keep",
                                       f"weight_sync.overlap_push={on}"])
                for on in ("false", "true")]
        tables.append(("push", f"WEIGHT PUSH (async, generator on core {cores[0]}, learner on core {cores[-1]}, "
                               "1 torch thread each; weight sync = the learner's blocking seconds)", rows))

    walls: dict[str, list[float]] = {}
    done: dict[str, list[str]] = {}  # row -> its runs that completed
    for r in range(args.repeats):
        for _, _, rows in tables:
            for _, name, extra in rows:
                try:
                    summary = train(load_config(ROOT / "configs/default.yaml",
                                                _overrides(args, out, f"{name}_{r}") + extra))
                except Exception as e:  # noqa: BLE001 - e.g. Ray's start-up timing out on a loaded machine
                    print(f"run {name}_{r} failed, left out of its row: {type(e).__name__}: {e}")
                    continue
                if "async" in name:
                    assert summary["pipeline/trained"] == args.steps * args.prompts
                walls.setdefault(name, []).append(summary["rl_wall_s"])
                done.setdefault(name, []).append(f"{name}_{r}")

    print(f"\nworkload: {samples} trained samples ({args.steps} steps x {args.prompts} prompts x {args.samples}), "
          f"{args.repeats} run(s) per row; geometric response lengths (mean about {262 // args.stop_ids} tokens), "
          f"cap {args.max_tokens}; run directories under {out}")
    placement_GT: tuple[float | None, float | None] = (None, None)  # G, T of the placement table's sync run
    for section, title, rows in tables:
        if any(name not in walls for _, name, _ in rows):
            print(f"\n{title}: a row has no completed run; see the failures above")
            continue
        if section == "push":
            _push_table(title, [(label, walls[name], _step_metrics(out, done[name])) for label, name, _ in rows])
            continue
        sync_steps = _step_metrics(out, done[rows[0][1]])
        G = _mean(sync_steps, "timing/generate_s")
        T = _mean(sync_steps, "timing/train_s") + _mean(sync_steps, "timing/weight_sync_s")
        bound = _table(title, [(label, walls[name]) for label, name, _ in rows], samples, G, T)
        if section == "placement":
            base = statistics.median(walls[rows[0][1]])
            print(f"sync engine {_mean(sync_steps, 'perf/engine_tokens_per_s'):.0f} tokens/s while generating; "
                  f"train {_mean(sync_steps, 'timing/train_s'):.2f} s ({_train_split(sync_steps)})")
            for label, name, _ in rows[1:]:
                _breakdown(label, _step_metrics(out, done[name]), base / statistics.median(walls[name]), bound, G, T)
            placement_GT = (G, T)
    if "corun" in sections:
        _corun(args, cores, *placement_GT)


if __name__ == "__main__":
    main()
