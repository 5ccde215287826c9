"""Command line: ``async-rl train --config FILE [dotted.key=value ...]``.

Examples::

    async-rl train --config configs/default.yaml
    async-rl train --config configs/default.yaml trainer.total_steps=20 algorithm.name=dr_grpo
    async-rl config --config configs/default.yaml      # print the resolved config (commented) and exit
    async-rl config --keys                             # every key: type, default, meaning
    async-rl eval --config configs/default.yaml --model runs/NAME     # held-out accuracy of a run's model
    async-rl generate --config configs/default.yaml --model runs/NAME -n 5
    async-rl plot runs/A runs/B --out curves.png       # curves from metrics.jsonl
    async-rl build-default                             # build the tiny model and data, print paths
    async-rl --version

A configuration error prints one line naming the key and exits with status 2; other bad input
(a missing file, a run directory without metrics.jsonl) one line and status 1. ``eval``,
``generate``, ``plot`` and ``config`` live in ``async_rl.commands``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


EPILOG = """\
Settings come from the YAML file, then dotted key=value overrides on the command line:
  async-rl train --config configs/default.yaml trainer.total_steps=20 algorithm.name=dr_grpo
  async-rl train --config configs/default.yaml trainer.mode=async 'data.val_files=[my_val.jsonl]'
Every key, with its type, default and meaning:  async-rl config --keys
A resolved config, commented:                   async-rl config --config FILE [overrides]
After a run:  async-rl eval --config FILE --model runs/NAME   |   async-rl plot runs/NAME [runs/OTHER]
"""

_OVERRIDES_HELP = "dotted.key=value overrides, e.g. trainer.total_steps=20 (see: async-rl config --keys)"
_MODEL_HELP = ("policy to load: a Hugging Face model directory (a run's final_model/), a checkpoint "
               "(RUN/checkpoints/step_NNNNNN) or a run directory (its final_model/, else its latest "
               "checkpoint); default: the config's model.path")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("async-rl")
    except PackageNotFoundError:  # a source tree used without `pip install -e .`
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async-rl", description="Asynchronous RL post-training for LLMs.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    s = sub.add_parser("train", help="run a training job", epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--config", required=True, help="YAML config file")
    s.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)
    s = sub.add_parser("eval", help="held-out accuracy and mean reward of a model or checkpoint (no run directory)")
    s.add_argument("--config", help="YAML config file (data.val_files, generator, reward); default: the run's "
                                    "own config.yaml when --model names a run or checkpoint")
    s.add_argument("--model", help=_MODEL_HELP)
    s.add_argument("--out", help="also write the result as JSON to this file")
    s.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)
    s = sub.add_parser("generate", help="print responses and rewards for a few prompts, to eyeball a model")
    s.add_argument("--config", help="YAML config file; default: the run's own config.yaml when --model names a "
                                    "run or checkpoint")
    s.add_argument("--model", help=_MODEL_HELP)
    s.add_argument("--prompt", action="append", help="a prompt text (repeatable; unscored); default: held-out prompts")
    s.add_argument("-n", type=int, default=3, help="how many held-out prompts, from the first (default 3)")
    s.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)
    s = sub.add_parser("plot", help="PNG curves (reward, accuracy, KL, entropy, staleness, tokens/s) of runs")
    s.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directories with a metrics.jsonl")
    s.add_argument("--out", help="PNG file (default: <first RUN_DIR>/curves.png)")
    s = sub.add_parser("config", help="print the resolved config (commented), or --keys: every key documented")
    s.add_argument("--config", help="YAML config file (required unless --keys)")
    s.add_argument("--keys", action="store_true",
                   help="list every key with its type, default and meaning (with --config: its value there)")
    s.add_argument("overrides", nargs="*", help=_OVERRIDES_HELP)
    sub.add_parser("build-default", help="build the built-in tiny model and dataset; print their paths")
    return p


def main(argv: list[str] | None = None, end_process: bool = False) -> int:
    """Entry point of the ``async-rl`` console script; returns the exit status.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
        end_process: a ``train`` run that used a learner group of several ranks (torchrun or
            Ray-placed) ends the process itself through ``exit_rank_process``, skipping the
            interpreter finalization in which gloo's threads can abort a finished run. The
            console script and ``python -m async_rl.cli`` set it; in-process callers get the status.
    """
    # First: torch's OpenMP reads its wait policy once, when torch is imported (async_rl.utils.cpu_threads).
    from async_rl.utils.cpu_threads import openmp_wait_defaults

    openmp_wait_defaults(os.environ)
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("ASYNC_RL_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _no_progress_bars_off_a_terminal()
    _ray_token_auth_chosen()
    if args.command == "build-default":
        from async_rl.data.builtin import resolve

        for uri in ("builtin:tiny-qwen2", "builtin:arithmetic/train", "builtin:arithmetic/test"):
            print(f"{uri} -> {resolve(uri)}")
        return 0
    if args.command in ("eval", "generate", "plot", "config"):
        from async_rl.commands import run_command

        return run_command(args)

    from async_rl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"async-rl: config error: {e}", file=sys.stderr)
        return 2
    from async_rl.learners.launch import exit_rank_process, launched_by_torchrun

    status = _train(cfg)
    if end_process and (launched_by_torchrun() or cfg.learner.world_size > 1):
        exit_rank_process(status)
    return status


def _no_progress_bars_off_a_terminal() -> None:
    """Turn Hugging Face's progress bars (weight loading, saving, downloads; transformers and
    huggingface_hub read ``HF_HUB_DISABLE_PROGRESS_BARS``) off when stderr is not a terminal,
    unless that variable is set: in a log file every redraw is a line of its own, repeated by each
    process that loads the model. The processes a run starts (learner ranks, generator actors,
    engine processes) inherit it through the environment."""
    if sys.stderr.isatty() or "HF_HUB_DISABLE_PROGRESS_BARS" in os.environ:
        return
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    # Both read the variable when first imported: an in-process caller may have imported them.
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


def _ray_token_auth_chosen() -> None:
    """Choose Ray's token authentication explicitly (``RAY_AUTH_MODE=token``, Ray's documented
    setting): Ray >= 2.59 turns it on by default for the cluster a run starts and says so on every
    start ("Token authentication is enabled for this Ray cluster..."); chosen, it stays on, without
    the notice. A cluster joined with ``trainer.ray_address`` / ``RAY_ADDRESS`` and started by
    ``ray start`` has it on too, and a driver without it cannot connect ("Authentication token is
    missing"), while a token-mode driver also joins a cluster that runs without (measured with
    Ray 2.60). Set at process start because Ray reads it once per process. Left alone when the
    user set it."""
    if "RAY_AUTH_MODE" not in os.environ:
        os.environ["RAY_AUTH_MODE"] = "token"


def _train(cfg) -> int:
    from async_rl.learners.launch import launched_by_torchrun
    from async_rl.trainer import train

    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        # torchrun ranks 1..N-1 run only their learner rank; rank 0 runs the trainer.
        from async_rl.trainer import learner_args
        from async_rl.data.builtin import resolve
        from async_rl.learners.launch import follow_from_env

        follow_from_env(*learner_args(cfg, resolve(cfg.model.path)))
        return 0
    import signal

    from async_rl.runtime.checkpoint import forced_stop_signal
    from async_rl.generators.model_support import EngineDied
    from async_rl.learners.launch import LearnerRankDied
    from async_rl.loops.base import GeneratorsGone

    try:
        summary = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        # Bad input (a malformed dataset row, a missing file): one actionable line, no traceback.
        # ASYNC_RL_LOG_LEVEL=DEBUG shows the traceback.
        logging.getLogger(__name__).debug("training failed", exc_info=True)
        print(f"async-rl: error: {e}", file=sys.stderr)
        return 1
    except (LearnerRankDied, EngineDied, GeneratorsGone) as e:
        # Named by rank 0 (rank, process, how it ended, the checkpoint to resume from), an
        # engine's death with the root cause its processes logged, or (async mode) every
        # generator actor's end with its root cause: one line.
        logging.getLogger(__name__).debug("a learner rank or an engine died", exc_info=True)
        print(f"async-rl: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        # SIGINT before the first training step (trainer.RunInterrupted says where; nothing was
        # saved), or a second SIGINT that stopped a run at once: one line, 128 + SIGINT.
        logging.getLogger(__name__).debug("interrupted", exc_info=True)
        print(f"async-rl: {e or 'interrupted: stopped at once, without saving'}", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    except BaseException as e:
        # Not `Exception`: DCP's CheckpointException derives from BaseException.
        forced = forced_stop_signal()
        if forced is None or isinstance(e, SystemExit):
            raise
        # The second signal's KeyboardInterrupt was wrapped by the code it landed in (a DCP save
        # raises CheckpointException): still a stop at once, not a failure of the run.
        logging.getLogger(__name__).debug("interrupted", exc_info=True)
        print(f"async-rl: interrupted by a second {signal.Signals(forced).name}: stopped at once "
              f"({type(e).__name__} where it landed); the last complete checkpoint is kept", file=sys.stderr)
        return 128 + forced
    if "interrupted" in summary:
        # Stopped by a signal after saving: the shell convention 128 + signal number, so a job
        # scheduler sees the run did not finish (resume with trainer.resume=auto).
        return 128 + int(signal.Signals[summary["interrupted"]])
    return 0


def entry() -> None:
    """The ``async-rl`` console script."""
    sys.exit(main(end_process=True))


if __name__ == "__main__":
    entry()
