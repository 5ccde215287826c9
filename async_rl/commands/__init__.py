"""The ``async-rl`` commands beside ``train``: ``eval``, ``generate``, ``plot`` and ``config``.

::

    async-rl eval --config configs/default.yaml --model runs/x/final_model          # held-out accuracy
    async-rl eval --config configs/default.yaml --model runs/x/checkpoints/step_000100 --out eval.json
    async-rl generate --config configs/default.yaml --model runs/x -n 5              # eyeball responses
    async-rl generate --config configs/default.yaml --prompt "What is 2 + 3?"
    async-rl plot runs/sync runs/async --out curves.png                              # metrics.jsonl curves
    async-rl config --keys                                                           # every key, documented
    async-rl config --config configs/default.yaml trainer.mode=async                 # resolved, with comments

``eval`` and ``generate`` load the policy from a Hugging Face directory (a run's ``final_model/``),
a checkpoint (``<run_dir>/checkpoints/step_NNNNNN/``: the learner is rebuilt from the run's
``config.yaml``, the checkpoint loaded into it and the policy exported to a temporary directory),
a run directory (its ``final_model/``, else its latest checkpoint), or, by default, the config's
``model.path``. They sample, score and count exactly as a run's held-out evaluation does
(``async_rl.step.evaluation.evaluate`` with the config's generator, reward and ``trainer.eval_greedy``)
and write nothing but the ``--out`` file: no run directory.

Each ``*_command`` function takes the parsed arguments and returns the exit status; bad input
raises ``ValueError`` / ``FileNotFoundError`` / ``ConfigError``, which the CLI prints as one line.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import json
import logging
import random
import tempfile
import textwrap
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml
from omegaconf import OmegaConf

from async_rl.config import Config, load_config, to_dict

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------- the policy to load
@dataclass
class PolicySource:
    """Where ``eval``/``generate`` take the policy from.

    Attributes:
        path: a Hugging Face model directory (or hub name / ``builtin:`` URI for ``model.path``), or
            a checkpoint directory (``kind == "checkpoint"``).
        kind: ``"model"`` (a Hugging Face model directory or name) or ``"checkpoint"``.
        label: how the command names it (``runs/x/checkpoints/step_000008 (checkpoint, step 8)``).
    """

    path: str
    kind: str
    label: str


def find_policy(spec: str | None, cfg: Config) -> PolicySource:
    """Resolve ``--model`` (``None``: the config's ``model.path``) to a ``PolicySource``.

    A directory with a trainer state (``checkpoint.is_checkpoint``) is a checkpoint; one with ``config.json`` a Hugging Face
    model; a run directory stands for its ``final_model/`` or, without one, its latest checkpoint.

    Raises:
        FileNotFoundError: ``spec`` is none of these.
        ValueError: an unknown ``builtin:`` name.
    """
    from async_rl.runtime.checkpoint import is_checkpoint, latest_checkpoint
    from async_rl.data.builtin import resolve

    if spec is None:
        return PolicySource(resolve(cfg.model.path), "model", f"{cfg.model.path} (model.path)")
    if spec.startswith("builtin:"):
        return PolicySource(resolve(spec), "model", spec)
    path = Path(spec)
    if is_checkpoint(path):
        return PolicySource(str(path), "checkpoint", f"{path} (checkpoint)")
    if (path / "config.json").exists():
        return PolicySource(str(path), "model", str(path))
    if (path / "final_model" / "config.json").exists():
        return PolicySource(str(path / "final_model"), "model", f"{path / 'final_model'} (the run's final model)")
    ckpt = latest_checkpoint(path)
    if ckpt is not None:
        return PolicySource(str(ckpt), "checkpoint", f"{ckpt} (the run's latest checkpoint)")
    raise FileNotFoundError(f"--model {spec}: neither a model directory (config.json), a checkpoint "
                            "(checkpoints/step_NNNNNN with trainer_state.msgpack) nor a run directory with final_model/ "
                            "or a checkpoint")


def checkpoint_run_config(ckpt: str | Path, cfg: Config) -> Config:
    """The config that wrote checkpoint ``ckpt``: ``<run_dir>/config.yaml`` two levels up (its
    learner, algorithm, LoRA and model settings must match the checkpoint), else ``cfg``."""
    run_config = Path(ckpt).resolve().parents[1] / "config.yaml"
    if run_config.exists():
        return load_config(run_config)
    logger.warning("%s: no config.yaml two levels up; rebuilding the learner from --config", ckpt)
    return cfg


@contextlib.contextmanager
def policy_dir(source: PolicySource, cfg: Config, tokenizer) -> Iterator[str]:
    """A Hugging Face directory holding ``source``'s policy, for as long as the context lasts.

    A checkpoint is loaded into a one-process learner built as the run built it
    (``checkpoint_run_config``; FSDP2 and Megatron checkpoints load on any world size) and
    exported, LoRA merged, into a temporary directory removed on exit.

    Raises:
        FileNotFoundError, ValueError: the checkpoint is incomplete or does not fit the run's model.
    """
    if source.kind != "checkpoint":
        yield source.path
        return
    from async_rl.data.builtin import resolve
    from async_rl.learners.launch import launch_learner
    from async_rl.trainer import learner_args

    run_cfg = checkpoint_run_config(source.path, cfg)
    lrn = run_cfg.learner
    megatron = dataclasses.replace(lrn.megatron, tensor_parallel_size=1, pipeline_parallel_size=1)
    run_cfg = dataclasses.replace(run_cfg, learner=dataclasses.replace(lrn, world_size=1, megatron=megatron))
    learner, handle = launch_learner(*learner_args(run_cfg, resolve(run_cfg.model.path)))
    with tempfile.TemporaryDirectory(prefix="async-rl-policy-") as tmp:
        try:
            learner.load_checkpoint(str(Path(source.path) / "learner"))
            learner.export_hf(tmp, tokenizer)
        finally:
            handle.close()
        del learner  # its weights, optimizer and reference model are not needed while the engine serves
        yield tmp


# ----------------------------------------------------------------------------------- eval, generate
@dataclass
class EvalParts:
    """What a held-out pass needs besides the engine (as ``trainer.build`` makes them)."""

    tokenizer: Any
    stops: list[int]
    agent: Any
    scorer: Any
    params: Any


def eval_parts(cfg: Config, model_dir: str, tokenizer_dir: str) -> EvalParts:
    """Tokenizer, stop ids, agent, the evaluation's reward scorer (``on_error="zero"``) and
    sampling params (``trainer.eval_greedy``) of a run with ``cfg``.

    Raises:
        ValueError: a bad reward spec.
    """
    from transformers import AutoTokenizer

    from async_rl.data.dataset import image_processing_for
    from async_rl.step.episodes import make_rollout_agent
    from async_rl.generators.base import SamplingParams
    from async_rl.step.rollout import make_scorer, stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    stops = stop_token_ids(tokenizer, model_dir, cfg.generator.extra_stop_token_ids)
    agent = make_rollout_agent(cfg, tokenizer, stops, images=image_processing_for(model_dir, cfg.data))
    params = SamplingParams.from_config(cfg.generator, stops, greedy=cfg.trainer.eval_greedy)
    # The reward function runs in its worker processes under reward.timeout_s, as in a run: a
    # hanging reward costs its sample, not the command. The reward model is a run's alone.
    scorer = make_scorer(dataclasses.replace(cfg.reward, model=None), "zero")
    return EvalParts(tokenizer, stops, agent, scorer, params)


def held_out_prompts(cfg: Config, parts: EvalParts, limit: int | None = None):
    """The held-out ``PromptDataset`` (``data.val_files``, at most ``data.val_max_prompts``, or
    ``limit`` when given), rendered as training renders it.

    Raises:
        ValueError: ``data.val_files`` is empty, a malformed row, or a data source without a
            reward function.
    """
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset, image_processing_for
    from async_rl.step.episodes import data_file, env_gives_reward, rollout_env_config
    from async_rl.rewards import default_reward_for

    if not cfg.data.val_files:
        raise ValueError("data.val_files is empty: nothing held out to evaluate on (set data.val_files=[FILE])")
    tools = parts.agent.schemas if parts.agent is not None else None
    rows_env = rollout_env_config(cfg)  # an environment's or a rollout function's
    ds = PromptDataset([data_file(f, rows_env) for f in cfg.data.val_files], parts.tokenizer, cfg.data.max_prompt_tokens,
                       cfg.trainer.seed, False, limit=cfg.data.val_max_prompts if limit is None else limit, tools=tools,
                       on_bad_row=cfg.data.on_bad_row,
                       # The base model's config and image processor: an exported policy has the same.
                       images=image_processing_for(resolve(cfg.model.path), cfg.data))
    if not cfg.reward.fn and not env_gives_reward(rows_env):  # an environment's return is the reward
        for source in {p.data_source for p in ds.prompts}:
            default_reward_for(source)
    return ds


@contextlib.contextmanager
def loaded_policy(cfg: Config, model: str | None,
                  select: Callable[[EvalParts], Any]) -> Iterator[tuple[Any, EvalParts, PolicySource, Any]]:
    """``(engine, parts, source, selected)``: the config's generator serving ``--model``'s policy
    (closed on exit) and what ``select(parts)`` returned (the prompts), called before any model
    loads so a bad data file stops at once.

    The tokenizer is the model directory's own when it has one (a run's ``final_model/`` does),
    else the config's (``model.tokenizer_path`` or ``model.path``).
    """
    import torch

    from async_rl.data.builtin import resolve
    from async_rl.utils.cpu_threads import available_cores, user_num_threads
    from async_rl.generators import make_generator

    source = find_policy(model, cfg)
    own = source.kind == "model" and (Path(source.path) / "tokenizer_config.json").exists()
    tokenizer_dir = source.path if own else resolve(cfg.model.tokenizer_path or cfg.model.path)
    # Seeded as a run is, so a sampled evaluation (trainer.eval_greedy=false) repeats.
    random.seed(cfg.trainer.seed)
    torch.manual_seed(cfg.trainer.seed)
    parts = eval_parts(cfg, resolve(cfg.model.path) if source.kind == "checkpoint" else source.path, tokenizer_dir)
    try:
        selected = select(parts)
        with policy_dir(source, cfg, parts.tokenizer) as path:
            engine = make_generator(cfg.generator, path, parts.tokenizer.pad_token_id, num_threads=user_num_threads() or available_cores())
            try:
                yield engine, parts, source, selected
            finally:
                engine.close()
    finally:
        parts.scorer.close()


def run_eval(cfg: Config, model: str | None = None) -> dict[str, Any]:
    """Held-out accuracy and mean reward of a policy, as a run's evaluation computes them.

    Args:
        cfg: the run's config (data, generator, reward, ``trainer.eval_greedy``, ``trainer.seed``).
        model: ``--model`` (see ``find_policy``); ``None`` = ``model.path``.

    Returns:
        ``evaluate``'s ``eval/*`` metrics plus ``model`` (what was loaded) and ``val_files``.

    Raises:
        ValueError, FileNotFoundError: see ``find_policy``, ``held_out_prompts``, ``policy_dir``.
    """
    from async_rl.runtime.cluster import LOOPBACK
    from async_rl.step.episodes import environment_services
    from async_rl.step.evaluation import EvalAtK, evaluate

    # An environment's servers (env.args.serve) run while the policy plays it, as in a run.
    with environment_services(cfg.env, LOOPBACK), \
            loaded_policy(cfg, model, lambda parts: held_out_prompts(cfg, parts)) as (engine, parts, source, ds):
        at_k = EvalAtK.from_config(cfg.trainer, dataclasses.replace(parts.params, greedy=False))
        metrics = evaluate(engine, ds, parts.params, parts.scorer, parts.tokenizer, parts.agent, at_k)
    return {"model": source.label, "val_files": list(cfg.data.val_files),
            "greedy": cfg.trainer.eval_greedy, "samples": cfg.trainer.eval_samples,
            "temperature": at_k.params.temperature if at_k is not None else None, **metrics}


def print_eval_table(result: dict[str, Any]) -> None:
    """Print ``eval/*`` metrics one per line, each ``*_se`` beside its value as ``± se``; the
    metrics of one data source (``eval/<source>/...``) under that source's name."""
    skip = {"eval/num_prompts", "eval/num_prompts_at_k"} | ({"eval/rejected"} if not result.get("eval/rejected") else set())
    keys = [k for k in result if k.startswith("eval/") and k not in skip and not k.endswith("_se")]
    groups: dict[str, list[str]] = {}
    for key in keys:
        parts = key.split("/")
        groups.setdefault(parts[1] if len(parts) > 2 else "", []).append(key)
    width = max((len(k.rsplit("/", 1)[1]) for k in keys), default=0)
    for source, members in groups.items():
        if source:
            print(f"  {source}:")
        for key in members:
            se = result.get(f"{key}_se")
            value = f"{result[key]:.4f}" + (f" ± {se:.4f}" if se is not None else "")
            print(f"  {'  ' if source else ''}{key.rsplit('/', 1)[1]:<{width}}  {value}")


def eval_command(args) -> int:
    """``async-rl eval``: print the held-out metrics; ``--out`` also writes them as JSON."""
    cfg = _load(args)
    result = run_eval(cfg, args.model)
    print(f"model: {result['model']}")
    print(f"held out: {int(result['eval/num_prompts'])} prompts of {', '.join(result['val_files'])}, "
          f"{'greedy' if result['greedy'] else 'sampled'}")
    if result["samples"]:
        print(f"at k: {result['samples']} samples a prompt at temperature {result['temperature']:g}; "
              f"± is the bootstrap standard error over prompts")
    print_eval_table(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"written to {args.out}")
    return 0


def free_prompts(texts: list[str], cfg: Config, parts: EvalParts) -> list[Any]:
    """``Prompt``s of ``--prompt`` texts: one user message each, rendered as dataset rows are.

    Raises:
        ValueError: a prompt longer than ``data.max_prompt_tokens``.
    """
    from async_rl.data.dataset import Prompt, render_prompt

    tools = parts.agent.schemas if parts.agent is not None else None
    prompts = []
    for i, text in enumerate(texts):
        messages = [{"role": "user", "content": text}]
        ids = render_prompt(parts.tokenizer, messages, tools)
        if len(ids) > cfg.data.max_prompt_tokens:
            raise ValueError(f"--prompt {text[:40]!r}: {len(ids)} tokens rendered, more than "
                             f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
        prompts.append(Prompt(ids, messages, "unknown", None, {}, f"prompt:{i}"))
    return prompts


def run_generate(cfg: Config, model: str | None, texts: list[str] | None, n: int) -> list[dict[str, Any]]:
    """One response per prompt: ``texts`` (unscored: they have no ground truth), or the first ``n``
    held-out prompts (scored with the run's reward).

    Returns:
        One ``{"prompt", "response", "reward", "ground_truth", "finish_reason"}`` per prompt, in
        order; ``reward`` and ``ground_truth`` are ``None`` for ``texts``.

    Raises:
        ValueError: ``n < 1``, or see ``held_out_prompts`` / ``free_prompts``.
    """
    from async_rl.step.evaluation import EVAL_FIRST_GROUP_ID
    from async_rl.rewards import RewardScorer
    from async_rl.step.rollout import rollout

    if not texts and n < 1:
        raise ValueError(f"-n {n}: ask for at least one prompt")

    def select(parts: EvalParts) -> list[Any]:
        return free_prompts(texts, cfg, parts) if texts else held_out_prompts(cfg, parts, limit=n).prompts

    with loaded_policy(cfg, model, select) as (engine, parts, _, prompts):
        # Free prompts have no ground truth: scored 0 only so rollout keeps them, and shown unscored.
        scorer = RewardScorer(lambda *a: 0.0) if texts else parts.scorer
        with (parts.agent.counted_apart() if parts.agent is not None else contextlib.nullcontext()):
            trajs = rollout(engine, prompts, 1, parts.params, scorer, parts.tokenizer, EVAL_FIRST_GROUP_ID,
                            agent=parts.agent).trajectories
    by_group = {t.group_id - EVAL_FIRST_GROUP_ID: t for t in trajs}
    out = []
    for i, p in enumerate(prompts):
        t = by_group.get(i)
        out.append({"prompt": p.messages[-1]["content"], "response": t.response_text if t else None,
                     "reward": None if texts or t is None else t.reward, "ground_truth": p.ground_truth,
                     "finish_reason": t.finish_reason if t else "rejected"})
    return out


def generate_command(args) -> int:
    """``async-rl generate``: print prompt, response and reward of each prompt."""
    cfg = _load(args)
    for i, row in enumerate(run_generate(cfg, args.model, args.prompt, args.n)):
        reward = "-" if row["reward"] is None else f"{row['reward']:.4g}"
        truth = "" if row["ground_truth"] is None else f" | ground truth {row['ground_truth']!r}"
        print(f"--- [{i}] reward {reward}{truth} | {row['finish_reason']}")
        print(f"prompt:   {row['prompt']}")
        print(f"response: {row['response']}")
    return 0


def plot_command(args) -> int:
    """``async-rl plot``: write the runs' curves to a PNG and print its path and what was missing."""
    from async_rl.commands.plot import plot_runs

    out = Path(args.out) if args.out else Path(args.run_dirs[0]) / "curves.png"
    fig, missing = plot_runs(args.run_dirs)
    fig.savefig(out, dpi=110)
    for run, quantities in missing.items():
        print(f"{run}: not logged: {', '.join(quantities)}")
    print(f"curves written to {out}")
    return 0


# ------------------------------------------------------------------------------------ config --keys
@dataclass
class KeyDoc:
    """One config key: ``trainer.total_steps``, ``int``, its schema default and its docstring."""

    key: str
    type: str
    default: Any
    doc: str
    is_section: bool


def attribute_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass: the string literal after each annotated field (PEP 257
    attribute docstrings, the house convention), base classes included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                    and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) and not typing.get_args(hint) else str(hint).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"


def describe_keys(cls: type = Config, prefix: str = "") -> list[KeyDoc]:
    """Every key of the config schema, sections first then their fields, in declaration order.

    A section's doc is its class docstring's first paragraph; its default is ``None``.
    """
    hints, docs = typing.get_type_hints(cls), attribute_docs(cls)
    out = []
    for f in dataclasses.fields(cls):
        key, hint = prefix + f.name, hints[f.name]
        if dataclasses.is_dataclass(hint):
            summary = inspect.cleandoc(hint.__doc__ or "").split("\n\n")[0].replace("\n", " ")
            out.append(KeyDoc(key, hint.__name__, None, summary, True))
            out.extend(describe_keys(hint, key + "."))
        else:
            out.append(KeyDoc(key, _type_name(hint), _default(f), docs.get(f.name, ""), False))
    return out


def _leaf_values(cfg: Config) -> dict[str, Any]:
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            flat[prefix + k] = v
            if isinstance(v, dict):
                walk(v, prefix + k + ".")

    walk(to_dict(cfg), "")
    return flat


def format_keys(cfg: Config | None = None) -> str:
    """``async-rl config --keys``: each key with type, default, the value in ``cfg`` where it
    differs, and the docstring indented below."""
    values = _leaf_values(cfg) if cfg is not None else {}
    lines = []
    for d in describe_keys():
        if d.is_section:
            lines += ["", f"[{d.key}]  {d.doc.replace('``', '`')}"]
            continue
        line = f"{d.key}: {d.type} = {_inline(to_plain(d.default))}"
        if d.key in values and values[d.key] != to_plain(d.default):
            line += f"   (here: {_inline(values[d.key])})"
        lines.append(line)
        lines += ["    " + row for row in _wrap(d.doc, 96)] if d.doc else []
    return "\n".join(lines).lstrip("\n") + "\n"


def _wrap(doc: str, width: int) -> list[str]:
    # Docstrings are reST (``code``); a terminal or a YAML comment reads `code` better.
    text = " ".join(doc.replace("``", "`").split())
    return textwrap.wrap(text, width, break_on_hyphens=False, break_long_words=False)


def _inline(value: Any) -> str:
    # One line of YAML flow style: [a, b], {k: v}, null, .inf, '???'.
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    return text.removesuffix("...").strip()


def to_plain(value: Any) -> Any:
    """A schema default as the resolved config holds it (dataclass instances as dicts)."""
    if dataclasses.is_dataclass(value):
        return OmegaConf.to_container(OmegaConf.structured(value))
    return value


def commented_yaml(cfg: Config) -> str:
    """The resolved config as YAML with each key's docstring (first paragraph) as a comment above
    it; loads back to the same values as ``config.to_yaml``."""
    docs = {d.key: d for d in describe_keys()}

    def emit(node: dict, prefix: str, indent: str) -> list[str]:
        lines = []
        for name, value in node.items():
            d = docs.get(prefix + name)
            if d is not None and d.doc:
                lines += [f"{indent}# {row}" for row in _wrap(d.doc.split("\n\n")[0], 100 - len(indent))]
            if d is not None and d.is_section:
                lines.append(f"{indent}{name}:")
                lines += emit(value, prefix + name + ".", indent + "  ")
            else:
                body = OmegaConf.to_yaml({name: value}).rstrip("\n").split("\n")
                lines += [indent + row for row in body]
        return lines

    return "\n".join(emit(to_dict(cfg), "", "")) + "\n"


def config_command(args) -> int:
    """``async-rl config``: the resolved config with comments, or ``--keys``: every key documented."""
    if args.config is None and not args.keys:
        raise ValueError("config: give --config FILE (to print the resolved config) or --keys")
    cfg = _load(args) if args.config is not None else None
    print(format_keys(cfg) if args.keys else commented_yaml(cfg), end="")
    return 0


def run_config_of(model: str | None) -> Path | None:
    """The ``config.yaml`` of the run that ``--model`` names: a run directory, one of its
    checkpoints (``checkpoints/step_NNNNNN``) or its ``final_model/``; ``None`` for anything else."""
    if model is None or model.startswith("builtin:"):
        return None
    path = Path(model)
    for candidate in (path, path.parent, path.parents[1] if len(path.parents) > 1 else path):
        if (candidate / "config.yaml").exists() and (candidate / "metrics.jsonl").exists():
            return candidate / "config.yaml"
    return None


def _load(args) -> Config:
    """The config of ``--config`` and the overrides; a missing file is a config error, as for
    ``train``. Without ``--config`` (``eval``, ``generate``), the config of the run ``--model``
    names, so a run is scored on its own task, data and reward (printed as ``config: ...``).

    Raises:
        ConfigError: no ``--config`` and ``--model`` names no run; a bad config or override.
    """
    from async_rl.config import ConfigError

    path = args.config
    if path is None:
        path = run_config_of(getattr(args, "model", None))
        if path is None:
            raise ConfigError(f"{args.command}: --config is required unless --model names a run directory, "
                              "one of its checkpoints or its final_model/ (their run's config.yaml is used)")
        print(f"config: {path} (the run's own; --config to use another)")
    try:
        return load_config(path, args.overrides)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


COMMANDS = {"eval": eval_command, "generate": generate_command, "plot": plot_command, "config": config_command}


def run_command(args) -> int:
    """Run ``args.command`` (a key of ``COMMANDS``); a bad input prints one line (``async-rl: ...``)
    and returns 2 for a config error, 1 otherwise (``ASYNC_RL_LOG_LEVEL=DEBUG`` logs the traceback)."""
    import sys

    from async_rl.config import ConfigError

    try:
        return COMMANDS[args.command](args)
    except ConfigError as e:
        print(f"async-rl: config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, ImportError) as e:
        logger.debug("%s failed", args.command, exc_info=True)
        print(f"async-rl: error: {e}", file=sys.stderr)
        return 1
