"""Command line: ``async-rl train --config FILE [dotted.key=value ...]``.

Examples::

    async-rl train --config configs/default.yaml
    async-rl train --config configs/default.yaml trainer.total_steps=20 algorithm.name=dr_grpo
    async-rl config --config configs/default.yaml      # print the resolved config and exit
    async-rl build-default                             # build the tiny model and data, print paths

A configuration error prints one line naming the key and exits with status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async-rl", description="Asynchronous RL post-training for LLMs.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "run a training job"), ("config", "print the resolved config")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--config", required=True, help="YAML config file")
        s.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
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
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("ASYNC_RL_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "build-default":
        from async_rl.data.builtin import resolve

        for uri in ("builtin:tiny-qwen2", "builtin:arithmetic/train", "builtin:arithmetic/test"):
            print(f"{uri} -> {resolve(uri)}")
        return 0

    from async_rl.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        print(f"async-rl: config error: {e}", file=sys.stderr)
        return 2
    if args.command == "config":
        print(to_yaml(cfg), end="")
        return 0
    from async_rl.learners.launch import exit_rank_process, launched_by_torchrun

    status = _train(cfg)
    if end_process and (launched_by_torchrun() or cfg.learner.world_size > 1):
        exit_rank_process(status)
    return status


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
    try:
        summary = train(cfg)
    except (ValueError, FileNotFoundError) as e:
        # Bad input (a malformed dataset row, a missing file): one actionable line, no traceback.
        # ASYNC_RL_LOG_LEVEL=DEBUG shows the traceback.
        logging.getLogger(__name__).debug("training failed", exc_info=True)
        print(f"async-rl: error: {e}", file=sys.stderr)
        return 1
    if "interrupted" in summary:
        # Stopped by a signal after saving: the shell convention 128 + signal number, so a job
        # scheduler sees the run did not finish (resume with trainer.resume=auto).
        import signal

        return 128 + int(signal.Signals[summary["interrupted"]])
    return 0


def entry() -> None:
    """The ``async-rl`` console script."""
    sys.exit(main(end_process=True))


if __name__ == "__main__":
    entry()
