"""The commands beside ``train`` (``async_rl.commands``, ``async_rl.commands.plot``): ``eval`` and ``generate``
on a tiny trained run's model and checkpoints, ``plot`` on metrics files, ``config --keys``, the
commented config, ``--version`` and ``--help``; and the console's throughput labels."""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from async_rl.cli import main
from async_rl.config import load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = str(ROOT / "configs/default.yaml")
VAL = ["data.val_max_prompts=16"]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step sync run with a checkpoint after each step and its final model. Its reward
    (response length odd or even) differs within a group whatever the model knows, so both steps
    change the policy."""
    from async_rl.trainer import train

    out = tmp_path_factory.mktemp("runs")
    reward = out / "parity_reward.py"
    reward.write_text("def reward(data_source, response_text, ground_truth, extra_info):\n"
                      "    return float(len(response_text) % 2)\n")
    cfg = load_config(DEFAULT, [f"reward.fn={reward}:reward",
        f"trainer.output_dir={out}", "trainer.run_name=tiny", "trainer.total_steps=2",
        "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
        "trainer.warm_start.steps=20", "trainer.warm_start.batch_size=16", "data.val_max_prompts=8",
        "trainer.checkpoint.every_steps=1", "logging.progress=false"])
    train(cfg)
    steps = [json.loads(line) for line in (out / "tiny" / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(s["actor/grad_norm"] > 0 for s in steps)
    return out / "tiny"


def _in_process_eval(model_dir: str, cfg) -> dict[str, float]:
    """What a run's held-out evaluation computes for ``model_dir``, built here by hand."""
    from transformers import AutoTokenizer

    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset
    from async_rl.step.evaluation import evaluate
    from async_rl.generators import make_generator
    from async_rl.generators.base import SamplingParams
    from async_rl.rewards import RewardScorer
    from async_rl.step.rollout import reward_function, stop_token_ids

    tok = AutoTokenizer.from_pretrained(model_dir)
    stops = stop_token_ids(tok, model_dir)
    ds = PromptDataset([resolve(f) for f in cfg.data.val_files], tok, cfg.data.max_prompt_tokens, 0, False,
                       limit=cfg.data.val_max_prompts)
    engine = make_generator(cfg.generator, model_dir, tok.pad_token_id)
    try:
        return evaluate(engine, ds, SamplingParams.from_config(cfg.generator, stops, greedy=True),
                        RewardScorer(reward_function(cfg.reward.fn), on_error="zero"), tok)
    finally:
        engine.close()


def _tree(path: Path) -> set[str]:
    return {str(p.relative_to(path)) for p in path.rglob("*")}


@pytest.mark.slow
def test_eval_equals_the_in_process_evaluation_and_makes_no_run_dir(run, tmp_path, capsys):
    before = _tree(run)
    out = tmp_path / "eval.json"
    argv = ["eval", "--config", DEFAULT, "--model", str(run / "final_model"), "--out", str(out),
            f"trainer.output_dir={tmp_path / 'runs'}", *VAL]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    expected = _in_process_eval(str(run / "final_model"), load_config(DEFAULT, VAL))
    assert 0.0 <= result["eval/accuracy"] <= 1.0
    assert result["eval/num_prompts"] == 16
    assert {k: v for k, v in result.items() if k.startswith("eval/")} == expected
    printed = capsys.readouterr().out
    assert f"accuracy              {expected['eval/accuracy']:.4f}" in printed
    # Nothing written but --out: no run directory, the evaluated run untouched.
    assert not (tmp_path / "runs").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]
    assert _tree(run) == before


def test_eval_without_config_scores_a_run_on_its_own_config(run, tmp_path, capsys):
    # The run's task (its reward, its held-out set) comes with it: the default config would score
    # it on another task without a word.
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(run), "--out", str(out)]) == 0
    assert f"config: {run / 'config.yaml'} (the run's own" in capsys.readouterr().out
    expected = _in_process_eval(str(run / "final_model"), load_config(run / "config.yaml"))
    result = json.loads(out.read_text())
    assert {k: v for k, v in result.items() if k.startswith("eval/")} == expected
    assert result["eval/num_prompts"] == 8  # the run's data.val_max_prompts, not the default's
    assert main(["generate", "--model", str(run / "final_model"), "-n", "1"]) == 0
    assert "config: " in capsys.readouterr().out
    # A model that is not a run's needs --config: one line, a config error.
    assert main(["eval", "--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("async-rl: config error: eval: --config is required unless --model") and err.count("\n") == 1


@pytest.mark.slow
def test_a_checkpoint_loads_the_policy_it_saved(run):
    from safetensors.torch import load_file

    from async_rl.commands import PolicySource, find_policy, policy_dir, run_eval

    cfg = load_config(DEFAULT, VAL)
    final = load_file(str(run / "final_model" / "model.safetensors"))
    base = load_file(str(Path(find_policy(None, cfg).path) / "model.safetensors"))
    ckpts = sorted((run / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_000001", "step_000002"]
    # A run directory with a final model stands for it; a checkpoint directory is a checkpoint.
    assert find_policy(str(run), cfg).path == str(run / "final_model")
    assert find_policy(str(ckpts[-1]), cfg).kind == "checkpoint"
    loaded = {}
    for ckpt in ckpts:
        with policy_dir(PolicySource(str(ckpt), "checkpoint", ckpt.name), cfg, None) as path:
            loaded[ckpt.name] = load_file(str(Path(path) / "model.safetensors"))
        assert not Path(path).exists()  # the temporary export is removed
    last, first = loaded["step_000002"], loaded["step_000001"]
    assert last.keys() == final.keys()
    assert all(torch.equal(last[k], final[k]) for k in final)
    # Step 1's policy is another one, and neither is the untrained base model.
    assert any(not torch.equal(first[k], final[k]) for k in final)
    assert any(not torch.equal(first[k], base[k]) for k in base)
    by_checkpoint = run_eval(cfg, str(ckpts[-1]))
    by_model = run_eval(cfg, str(run / "final_model"))
    assert {k: v for k, v in by_checkpoint.items() if k.startswith("eval/")} == \
        {k: v for k, v in by_model.items() if k.startswith("eval/")}


@pytest.mark.slow
def test_generate_prints_n_held_out_responses_and_free_prompts(run, capsys, tiny_tokenizer):
    from async_rl.data.builtin import resolve
    from async_rl.data.dataset import PromptDataset

    assert main(["generate", "--config", DEFAULT, "--model", str(run), "-n", "3"]) == 0
    blocks = capsys.readouterr().out.split("--- [")[1:]
    assert len(blocks) == 3
    val = PromptDataset([resolve("builtin:arithmetic/test")], tiny_tokenizer, 32, shuffle=False, limit=3)
    for i, (block, prompt) in enumerate(zip(blocks, val.prompts)):
        assert block.startswith(f"{i}] reward ") and f"ground truth {prompt.ground_truth!r}" in block
        assert f"prompt:   {prompt.messages[-1]['content']}\n" in block and "response: " in block
    assert main(["generate", "--config", DEFAULT, "--model", str(run), "--prompt", "1+2=", "--prompt", "hello"]) == 0
    blocks = capsys.readouterr().out.split("--- [")[1:]
    assert [b.splitlines()[1] for b in blocks] == ["prompt:   1+2=", "prompt:   hello"]
    assert all(b.startswith(f"{i}] reward - |") for i, b in enumerate(blocks))


def test_eval_and_generate_refuse_a_path_that_holds_no_model(tmp_path, capsys):
    assert main(["eval", "--config", DEFAULT, "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"async-rl: error: --model {tmp_path}: neither") and err.count("\n") == 1
    assert main(["generate", "--config", DEFAULT, "--model", str(tmp_path / "nope")]) == 1
    assert "neither a model directory" in capsys.readouterr().err
    # Config problems are config errors (status 2), as for train.
    assert main(["eval", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err == f"async-rl: config error: config file not found: {tmp_path / 'missing.yaml'}\n"
    assert main(["generate", "--config", DEFAULT, "trainer.totl_steps=3"]) == 2
    assert "did you mean 'trainer.total_steps'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ plot
def _write_run(path: Path, steps: int, with_eval: bool, scale: float) -> dict[str, list[float]]:
    """A metrics.jsonl as a run writes it; returns the per-step reward and staleness written."""
    path.mkdir(parents=True)
    rewards = [scale * s / steps for s in range(1, steps + 1)]
    lines = [{"step": 0, "time_s": 0.1, "eval/accuracy": 0.1}] if with_eval else []
    for s, r in zip(range(1, steps + 1), rewards):
        lines.append({"step": s, "time_s": float(s), "rollout/reward_mean": r, "actor/entropy": 1.0 - r,
                      "loss/approx_kl": 1e-3 * s, "staleness/mean": float(s % 2), "perf/gen_tokens_per_s": 500.0 + s,
                      "perf/train_tokens_per_s": 900.0})
        if with_eval and s % 2 == 0:
            lines.append({"step": s, "time_s": float(s), "eval/accuracy": r / 2})
    (path / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))
    return {"reward": rewards}


def test_plot_overlays_runs_with_a_legend_and_reports_missing_quantities(tmp_path):
    from async_rl.commands.plot import QUANTITIES, plot_runs

    a = _write_run(tmp_path / "a", 10, with_eval=True, scale=1.0)
    b = _write_run(tmp_path / "b", 6, with_eval=False, scale=0.5)
    fig, missing = plot_runs([tmp_path / "a", tmp_path / "b"])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["a", "b"]
    titles = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    by_key = {q.key: q.title for q in QUANTITIES}
    # No run logged a KL to the reference or to a teacher: no panel; the others have one each.
    assert by_key["loss/kl"] not in titles and by_key["distill/reverse_kl"] not in titles
    assert by_key["loss/distill_kl"] not in titles
    assert len(titles) == len(QUANTITIES) - 3
    reward = titles[by_key["rollout/reward_mean"]]
    lines = {line.get_label(): line for line in reward.get_lines()}
    assert list(lines["a"].get_xdata()) == list(range(1, 11)) and list(lines["a"].get_ydata()) == a["reward"]
    assert list(lines["b"].get_ydata()) == b["reward"]
    assert [line.get_label() for line in titles[by_key["eval/accuracy"]].get_lines()] == ["a"]
    kl = [f"{by_key['loss/kl']} (loss/kl)", f"{by_key['distill/reverse_kl']} (distill/reverse_kl)",
          f"{by_key['loss/distill_kl']} (loss/distill_kl)"]
    assert missing == {"a": kl, "b": [f"{by_key['eval/accuracy']} (eval/accuracy)", *kl]}


def test_plot_command_writes_a_png_and_says_what_is_missing(tmp_path, capsys):
    from matplotlib.image import imread

    _write_run(tmp_path / "a", 8, with_eval=True, scale=1.0)
    _write_run(tmp_path / "b", 8, with_eval=False, scale=0.5)
    assert main(["plot", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    png = tmp_path / "a" / "curves.png"
    out = capsys.readouterr().out
    assert f"curves written to {png}" in out and "b: not logged: held-out accuracy (eval/accuracy)" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = imread(png)
    height, width = pixels.shape[:2]
    assert 600 <= height <= 3000 and 800 <= width <= 3000
    assert pixels[..., :3].std() > 0.05  # not a blank canvas
    assert main(["plot", str(tmp_path / "a"), "--out", str(tmp_path / "x.png")]) == 0 and (tmp_path / "x.png").exists()


def test_plot_refuses_a_directory_without_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["plot", str(tmp_path / "empty")]) == 1
    err = capsys.readouterr().err
    assert err == f"async-rl: error: {tmp_path / 'empty'}: no metrics.jsonl (not a run directory, or logging.jsonl=false)\n"


# ---------------------------------------------------------------------------------------- config
def _flat(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for k, v in node.items():
        keys.append(prefix + k)
        if isinstance(v, dict):
            keys += _flat(v, prefix + k + ".")
    return keys


def test_config_keys_documents_every_key_of_the_resolved_config(capsys):
    from async_rl.commands import attribute_docs
    from async_rl.loops.base import TrainerConfig

    assert main(["config", "--keys"]) == 0
    out = capsys.readouterr().out
    listed = {line.split(":")[0] for line in out.splitlines() if line and not line.startswith((" ", "["))}
    sections = {line[1:].split("]")[0] for line in out.splitlines() if line.startswith("[")}
    wanted = _flat(to_dict(load_config(DEFAULT)))
    assert wanted and not [k for k in wanted if k not in listed | sections]
    lines = out.splitlines()
    i = lines.index(f"trainer.total_steps: int = {TrainerConfig().total_steps}")
    assert lines[i + 1].strip().split()[:3] == attribute_docs(TrainerConfig)["total_steps"].split()[:3]
    assert "model.tokenizer_path: str | None = null" in lines
    # With a config, the keys it changes show their value there.
    assert main(["config", "--keys", "--config", DEFAULT, "trainer.total_steps=7"]) == 0
    assert f"trainer.total_steps: int = {TrainerConfig().total_steps}   (here: 7)" in capsys.readouterr().out.splitlines()


def test_config_prints_a_commented_config_that_loads_back(capsys):
    overrides = ["trainer.mode=async", "trainer.total_steps=7"]
    assert main(["config", "--config", DEFAULT, *overrides]) == 0
    text = capsys.readouterr().out
    assert OmegaConf.to_container(OmegaConf.create(text)) == to_dict(load_config(DEFAULT, overrides))
    lines = text.splitlines()
    at = lines.index("  total_steps: 7")
    assert lines[at - 1].startswith("  # Training steps")
    assert sum(line.lstrip().startswith("#") for line in lines) > len(_flat(to_dict(load_config(DEFAULT)))) / 2


def test_config_without_a_file_or_keys_is_one_line(capsys):
    assert main(["config"]) == 1
    assert capsys.readouterr().err == "async-rl: error: config: give --config FILE (to print the resolved config) or --keys\n"


# ------------------------------------------------------------------------------ version and help
def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"async-rl {version('async-rl')}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "async-rl config --keys" in text and "trainer.total_steps=20" in text
    for command in ("train", "eval", "generate", "plot", "config", "build-default"):
        assert f"    {command}" in text


# ------------------------------------------------------------------------- console throughput labels
def test_console_names_what_each_throughput_measures(tmp_path, capsys):
    from async_rl.runtime.metrics import LoggingConfig, MetricsLogger

    with MetricsLogger(LoggingConfig(progress=False, jsonl=False), tmp_path, total_steps=1) as log:
        log.log({"perf/gen_tokens_per_s": 630.0, "perf/train_tokens_per_s": 5300.0,
                 "perf/engine_tokens_per_s": 9000.0}, step=1)
        log.advance(1)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "| gen_tok/s 630 | train_tok/s 5300" in line and "tok/s 9000" not in line
