"""Single-turn rollouts through the episode protocol against the plain single-turn road, side by side.

The same batch of the default job's groups (``configs/default.yaml``: the built-in arithmetic
train rows, ``--prompts`` prompts x ``--n`` samples, up to ``--tokens`` response tokens,
temperature 1) is sampled and scored by ``async_rl.step.rollout.sample_groups`` two ways, on one
engine of the chosen backend (``--backend hf`` or ``vllm``) with the run's reward scorer:

* **plain**: ``agent=None``, the road a prompt dataset takes without an environment: one engine
  call of ``n`` samples per prompt, each sample scored as it finishes.
* **protocol**: ``agent=EpisodeLoop`` over the ``single_turn`` environment (``env.name:
  single_turn``): every sample an episode (``reset``, one generated turn, ``step``, ``close``
  on the episode loop's event loop), scored by the same reward function
  (``Environment.reward_from_run``).

Each row is warmed up, then both run interleaved ``--reps`` times (the order alternating) so they
see the same machine load; the median samples per wall second and per CPU second (this process
and its descendants: the engine's processes, the reward workers) are printed with
``protocol / plain`` against the target ``>= 0.95``. Both rows must keep every sample
(checked); their mean rewards are printed (the two roads seed samples differently, so they
draw different responses from the same distribution).

Run (about 2 minutes on 2 cores with the HF engine)::

    ASYNC_RL_CACHE=/tmp/arl-cache python bench/bench_env_throughput.py [--backend hf|vllm]
        [--prompts 32] [--n 8] [--tokens 8] [--reps 7] [--model RUN/final_model]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

TARGET = 0.95
"""protocol / plain samples per second we aim for (issue 33, acceptance 5)."""

from side_by_side import default_job_parser, interleaved, ratio_table  # noqa: E402


def main() -> None:
    parser = default_job_parser(__doc__.split("\n\n")[0], tokens=8, reps=7)
    args = parser.parse_args()

    from async_rl.commands import eval_parts
    from async_rl.config import load_config
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.generators import make_generator
    from async_rl.step.rollout import GroupRequest, group_seed, sample_groups
    from async_rl.utils.cpu_threads import available_cores

    overrides = [f"generator.backend={args.backend}", f"generator.max_response_tokens={args.tokens}",
                 f"env.max_response_tokens={args.tokens}"]
    plain_cfg = load_config(ROOT / "configs" / "default.yaml", overrides)
    env_cfg = load_config(ROOT / "configs" / "default.yaml", [*overrides, "env.name=single_turn"])
    model = resolve(args.model or plain_cfg.model.path)
    plain, protocol = eval_parts(plain_cfg, model, model), eval_parts(env_cfg, model, model)
    params = protocol.params.__class__.from_config(plain_cfg.generator, plain.stops, greedy=False)
    ds = PromptDataset([resolve(f) for f in plain_cfg.data.train_files], plain.tokenizer,
                       plain_cfg.data.max_prompt_tokens, seed=0, shuffle=False, limit=args.prompts)
    engine = make_generator(plain_cfg.generator, model, plain.tokenizer.pad_token_id, num_threads=available_cores())
    group_id = [0]

    def run(parts) -> tuple[int, float]:
        requests = []
        for p in ds.prompts[: args.prompts]:
            requests.append(GroupRequest.of(p, group_id[0], args.n, group_seed(0, group_id[0])))
            group_id[0] += 1
        kept: list = []
        counts = sample_groups(engine, requests, params, parts.tokenizer, parts.scorer, parts.agent, kept.append)
        if len(kept) != len(requests) * args.n or counts.rejected_samples:
            raise SystemExit(f"a road lost samples: kept {len(kept)} of {len(requests) * args.n}, "
                             f"{counts.rejected_samples} rejected")
        return len(kept), statistics.fmean(t.reward for t in kept)

    rows = {"plain (agent=None)": plain, "protocol (env single_turn)": protocol}
    try:
        runs = interleaved(list(rows), lambda name: run(rows[name]), args.reps)
    finally:
        engine.close()
        plain.scorer.close()
        protocol.scorer.close()
    ratio_table(runs, "samples", "mean reward", TARGET,
                f"{args.backend}: {args.prompts} prompts x {args.n} samples x up to {args.tokens} tokens, temperature 1; "
                f"median of {args.reps} interleaved runs after a warm-up")

if __name__ == "__main__":
    main()
