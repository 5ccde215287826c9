"""What the tests of the real async pipeline share: a small run of the default job; the bench
scripts as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from async_rl.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def small_run(tmp_path, name: str, *extra: str) -> list[str]:
    """Dotted overrides that cut the default job to a run of seconds: 3 steps of 4 groups of 4
    samples, a 30-step warm start, 8 held-out prompts, no periodic eval, no export; then ``extra``
    (later overrides win)."""
    return [f"trainer.output_dir={tmp_path}", f"trainer.run_name={name}", "trainer.total_steps=3",
            "trainer.prompts_per_step=4", "trainer.samples_per_prompt=4", "trainer.eval_every_steps=0",
            "trainer.warm_start.steps=30", "trainer.warm_start.batch_size=16", "data.val_max_prompts=8",
            "trainer.export_model=false", "logging.progress=false", "generator.max_batch_size=8", *extra]


def small_run_cfg(tmp_path, name: str, *extra: str):
    """The default config with ``small_run``'s overrides, loaded."""
    return load_config(ROOT / "configs/default.yaml", small_run(tmp_path, name, *extra))


def bench_module(name: str):
    """The script ``bench/<name>.py`` imported as module ``name`` (registered in ``sys.modules``
    first: its dataclasses look their module up), once per test session."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
