"""Rollouts through the OpenAI-compatible endpoint against the in-process road, side by side.

The same batch of the default job's groups (``configs/default.yaml``: the built-in arithmetic
train rows, ``--prompts`` prompts x ``--n`` samples, up to ``--tokens`` response tokens,
temperature 1) is sampled by ``async_rl.step.rollout.sample_groups`` two ways, on one engine of
the chosen backend (``--backend hf`` or ``vllm``):

* **in-process**: the ``single_turn`` environment of the episode loop (``env.name:
  single_turn``), the road every built-in rollout takes: token ids straight to the engine.
* **endpoint**: a rollout function (``one_call`` below, ``endpoint.rollout``) that makes one
  ``chat.completions`` call per episode through the ``openai`` client: HTTP on loopback, the chat
  template rendered by the endpoint, the call recorded and assembled into a trajectory.

Each row is warmed up, then both run interleaved ``--reps`` times (the order alternating) so they
see the same machine load; the median generated tokens per wall second and per CPU second (this
process and its descendants: the engine's processes) are printed with ``endpoint / in-process``
against the target ``>= 0.8`` (issue 34, acceptance 4). Both rows must keep every sample.

A call costs the endpoint road about 2 ms of CPU (the ``openai`` client's and the server's), so
the ratio depends on the engine's cost per response: the figures for the target are taken on
``--model builtin:small-qwen2`` (4.8M parameters); the default job's 0.8M model generates a
response in a few milliseconds, and its ratio shows that fixed cost (docs/own-agent.md, Measured).

Run (HF about 2 minutes on 2 cores; vLLM adds its start-up)::

    ASYNC_RL_CACHE=/tmp/arl-cache python bench/bench_endpoint.py [--backend hf|vllm]
        [--prompts 32] [--n 8] [--tokens 64] [--reps 5]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGET = 0.8
"""endpoint / in-process generated tokens per second we aim for (issue 34, acceptance 4)."""


async def one_call(client, task, max_tokens: int = 64) -> float:
    """One chat call per episode; reward 1 for the right sum (the default job's task)."""
    from async_rl.rewards.arithmetic import arithmetic_reward

    r = await client.chat.completions.create(model="policy", messages=task.messages, max_tokens=max_tokens)
    return arithmetic_reward(task.data_source, r.choices[0].message.content or "", task.ground_truth, None)["score"]


def main() -> None:
    from side_by_side import default_job_parser, interleaved, ratio_table

    parser = default_job_parser(__doc__.split("\n\n")[0], tokens=64, reps=5)
    args = parser.parse_args()

    from async_rl.commands import eval_parts
    from async_rl.config import load_config
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.generators import make_generator
    from async_rl.step.rollout import GroupRequest, group_seed, sample_groups
    from async_rl.utils.cpu_threads import available_cores

    overrides = [f"generator.backend={args.backend}", f"generator.max_response_tokens={args.tokens}"]
    local_cfg = load_config(ROOT / "configs" / "default.yaml",
                            [*overrides, "env.name=single_turn", f"env.max_response_tokens={args.tokens}"])
    endpoint_cfg = load_config(ROOT / "configs" / "default.yaml", [
        *overrides, f"endpoint.rollout={Path(__file__).resolve()}:one_call", f"endpoint.args.max_tokens={args.tokens}",
        f"endpoint.max_response_tokens={args.tokens}"])
    model = resolve(args.model or local_cfg.model.path)
    local, endpoint = eval_parts(local_cfg, model, model), eval_parts(endpoint_cfg, model, model)
    params = local.params.__class__.from_config(local_cfg.generator, local.stops, greedy=False)
    ds = PromptDataset([resolve(f) for f in local_cfg.data.train_files], local.tokenizer,
                       local_cfg.data.max_prompt_tokens, seed=0, shuffle=False, limit=args.prompts)
    engine = make_generator(local_cfg.generator, model, local.tokenizer.pad_token_id, num_threads=available_cores())
    group_id = [0]

    def run(parts) -> tuple[int, int, float]:
        requests = []
        for p in ds.prompts[: args.prompts]:
            requests.append(GroupRequest.of(p, group_id[0], args.n, group_seed(0, group_id[0])))
            group_id[0] += 1
        kept: list = []
        counts = sample_groups(engine, requests, params, parts.tokenizer, parts.scorer, parts.agent, kept.append)
        if len(kept) != len(requests) * args.n or counts.rejected_samples:
            raise SystemExit(f"a road lost samples: kept {len(kept)} of {len(requests) * args.n}, "
                             f"{counts.rejected_samples} rejected")
        return len(kept), counts.generated_tokens, statistics.fmean(t.reward for t in kept)

    rows = {"in-process (env single_turn)": local, "endpoint (openai client)": endpoint}
    took: dict[str, int] = {}

    def one(name: str) -> tuple[float, float]:
        driver = getattr(rows[name].agent, "endpoint", None)
        before = driver.driver.batches if driver is not None else 0
        n, tokens, _ = run(rows[name])
        if driver is not None:  # the engine batches the run took (1: every call shared one)
            took[name] = driver.driver.batches - before
        return tokens, tokens / n

    def batches(name: str) -> str:
        return f", {took[name]} engine batches" if name in took else ""

    try:
        runs = interleaved(list(rows), one, args.reps, batches)
    finally:
        endpoint.agent.close()
        engine.close()
        local.scorer.close()
        endpoint.scorer.close()
    ratio_table(runs, "tokens", "tokens/sample", TARGET,
                f"{args.backend}: {args.prompts} prompts x {args.n} samples x up to {args.tokens} tokens, temperature 1; "
                f"median of {args.reps} interleaved runs after a warm-up")

if __name__ == "__main__":
    main()
