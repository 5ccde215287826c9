"""Checks that a run's inputs exist before anything loads: the data files and the model.

Without them a missing input surfaces late or deep: a dataset file is read only after the model
has been fetched, transformers reads a missing local directory as a hub repo id, and a hub id
while offline is retried for most of a minute before a hundred-line traceback. ``check_inputs``
runs at the start of ``async_rl.trainer.train``, before the run directory is made, and names each
problem in one line in well under a second (one short hub request at most, for a hub id that is
not in the local cache).

A model spec is, in this order: ``builtin:NAME`` (built locally, never checked here), an
existing local directory (it must hold ``config.json``), a hub repo id (``Qwen/Qwen2.5-0.5B``)
found in the Hugging Face cache, or a hub repo id that the hub, asked once with a
``HUB_TIMEOUT_S`` timeout, knows. Anything else is refused; a path that cannot be a repo id
(absolute, ``./``, ``~``, two slashes) is refused as a missing directory.

Last, the generator engine judges the model (``async_rl.generators.check_model``): one it cannot
serve on this platform, such as a head size vLLM's CPU attention does not run, is refused in one
line before any engine starts, instead of killing the engine at its first forward pass.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from async_rl.algorithms.distill import teacher_key
from async_rl.data.builtin import BUILTIN_PREFIX
from async_rl.generators import check_model as engine_check_model

HUB_TIMEOUT_S = 10.0
"""Seconds the one hub request of ``check_model`` may take before the hub counts as unreachable."""

DATA_SUFFIXES = (".parquet", ".jsonl", ".json")
"""File types ``async_rl.data.dataset.read_rows`` reads."""


def check_inputs(cfg: Any) -> None:
    """Check a run's data files (first: they are cheap, and a missing one is the likelier mistake)
    and then its model and tokenizer.

    Args:
        cfg: the run's ``Config``.

    Raises:
        FileNotFoundError: data files missing (every missing one named, with its key), or a
            model path naming no directory.
        ValueError: a data file of a type the dataset reader does not read, or a model that is
            neither local, nor cached, nor (when the hub answers) on the hub.
        UnservableModelError: (a ``ValueError``) a model the generator engine cannot serve on this
            platform (``async_rl.generators.check_model``), in one line.
        FileNotFoundError, ValueError: a distillation teacher that does not load (``check_teacher``).
    """
    check_data_files({"data.train_files": cfg.data.train_files, "data.val_files": cfg.data.val_files})
    check_model("model.path", cfg.model.path)
    if cfg.model.tokenizer_path:
        check_model("model.tokenizer_path", cfg.model.tokenizer_path, needs_config=False)
    # The engine's own verdict on the model (head sizes it runs here...), before any engine starts.
    engine_check_model(cfg.generator, cfg.model.path)
    check_vision_language(cfg)
    for source, spec in cfg.algorithm.distill.routes.items():
        check_teacher(teacher_key(source), spec)


def check_vision_language(cfg: Any) -> None:
    """Refuse in one line what a vision-language policy cannot do yet: a learner backend that
    does not train one (``LearnerCapabilities.vision_language``), rollouts of an OpenAI-compatible
    endpoint (``endpoint.rollout``: its chat requests would carry images the endpoint does not
    take yet), or a teacher or reward model (they score token ids without the images). The
    engine's side is the engine's check (``async_rl.generators.check_model``:
    ``EngineCapabilities.serves_images``). Environments and tools run: an observation may hold
    images (``async_rl.envs.EnvStep``).

    Raises:
        ValueError: one of those, naming the key to change.
    """
    from async_rl.data.builtin import resolve
    from async_rl.generators.model_support import read_hf_config
    from async_rl.learners.capabilities import learner_capabilities, learners_that

    if not read_hf_config(resolve(cfg.model.path)).get("vision_config"):
        return
    if not learner_capabilities(cfg.learner.backend).vision_language:
        raise ValueError(f"learner.backend={cfg.learner.backend} does not train vision-language models yet "
                         f"({cfg.model.path}); use learner.backend={learners_that(lambda c: c.vision_language)}")
    if cfg.endpoint.enabled:
        raise ValueError(f"{cfg.model.path} is a vision-language model: rollouts of an OpenAI-compatible endpoint "
                         "(endpoint.rollout) do not take images yet; use an environment (env.name) or tools "
                         "(agent.tools)")
    # A teacher or a reward model scores the prompt's token ids, not its images: it would read
    # placeholders where the pictures were.
    if cfg.algorithm.distill.routes or cfg.reward.model:
        key = "algorithm.distill" if cfg.algorithm.distill.routes else "reward.model"
        raise ValueError(f"{cfg.model.path} is a vision-language model: {key} does not pass the prompts' images to "
                         "its model yet; use a reward function (reward.fn)")


def check_teacher(key: str, spec: str) -> None:
    """Check that a distillation teacher names a model that loads here: a ``builtin:`` model, a
    Hugging Face model directory, or a run directory with ``final_model/`` (the teacher is local:
    it must share the student's tokenizer, checked when it loads).

    Raises:
        FileNotFoundError: no such directory.
        ValueError: a file, or a directory that is neither of the two.
    """
    if spec.startswith(BUILTIN_PREFIX):
        return
    path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{key}={spec}: no such directory ({path.absolute()})")
    if not ((path / "config.json").is_file() or (path / "final_model" / "config.json").is_file()):
        raise ValueError(f"{key}={spec}: neither a Hugging Face model directory (config.json) nor a run "
                         "directory with final_model/")


def check_data_files(files_by_key: dict[str, list[str]]) -> None:
    """Check that every non-built-in data file exists and has a type the reader reads.

    Args:
        files_by_key: ``{"data.train_files": [...], ...}``: the key names each problem.

    Raises:
        FileNotFoundError: some files do not exist; one line names them all.
        ValueError: a file that is a directory or of an unread type.
    """
    missing, wrong = [], []
    for key, files in files_by_key.items():
        for f in files:
            if f.startswith((BUILTIN_PREFIX, "env:")):  # built, or the environment's own rows
                continue
            path = Path(f)
            if not path.exists():
                missing.append(f"{key}: {f}")
            elif path.is_dir():
                wrong.append(f"{key}: {f} is a directory, not a data file")
            elif path.suffix.lower() not in DATA_SUFFIXES:
                wrong.append(f"{key}: {f} is not a {'/'.join(DATA_SUFFIXES)} file")
    if missing:
        where = "" if all(Path(m.split(": ", 1)[1]).is_absolute() for m in missing) else f" (relative to {Path.cwd()})"
        raise FileNotFoundError(f"dataset file{'s' if len(missing) > 1 else ''} not found{where}: {'; '.join(missing)}")
    if wrong:
        raise ValueError("; ".join(wrong))


def check_model(key: str, spec: str, needs_config: bool = True) -> None:
    """Check that a model (or tokenizer) spec names something that can load (see the module
    docstring for the order of the forms).

    Args:
        key: the config key, for the messages (``model.path``).
        spec: its value.
        needs_config: a local directory must hold ``config.json`` (a model; not a tokenizer).

    Raises:
        FileNotFoundError: a local path that does not exist and cannot be a hub repo id.
        ValueError: a file instead of a directory, a directory without ``config.json``, or a hub
            id that is not cached while the hub is offline, unreachable, or does not have it.
    """
    if spec.startswith(BUILTIN_PREFIX):
        return
    path = Path(spec).expanduser()
    if path.is_dir():
        if needs_config and not (path / "config.json").is_file():
            hint = (f" (a run directory: its trained model is {path / 'final_model'})"
                    if (path / "final_model" / "config.json").is_file() else "")
            raise ValueError(f"{key}={spec}: {path} holds no config.json: not a Hugging Face model directory{hint}")
        return
    if path.exists():
        raise ValueError(f"{key}={spec}: {path} is a file, not a model directory")
    if not _is_repo_id(spec):
        raise FileNotFoundError(f"{key}={spec}: no such directory ({path.absolute()})")
    problem = _hub_problem(spec)
    if problem is not None:
        raise ValueError(f"{key}={spec}: no local directory of that name, {problem}; point {key} at a local "
                         "model directory, or fetch the model first where the hub is reachable")


def _is_repo_id(spec: str) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(spec)
    except HFValidationError:
        return False
    return True


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_problem(repo_id: str) -> str | None:
    """``None`` if ``repo_id`` is in the local Hugging Face cache or the hub has it, else why not."""
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
        return None
    except LocalEntryNotFoundError:
        pass
    cache = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    if constants.is_offline_mode() or _env_true("HF_HUB_OFFLINE") or _env_true("TRANSFORMERS_OFFLINE"):
        return f"{cache}, and the hub is offline (HF_HUB_OFFLINE is set)"
    try:
        HfApi(endpoint=constants.ENDPOINT).model_info(repo_id, timeout=HUB_TIMEOUT_S)
        return None
    except GatedRepoError:
        return f"{cache}, and the hub's {repo_id} is gated: accept its terms on the hub and log in (hf auth login)"
    except RepositoryNotFoundError:
        return f"{cache}, and the hub has no model {repo_id} (or it is private: log in with hf auth login)"
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", "?") if getattr(e, "response", None) is not None else "?"
        return f"{cache}, and the hub ({constants.ENDPOINT}) answered HTTP {status}"
    except Exception as e:  # noqa: BLE001 - any transport failure (DNS, refused, timeout) means unreachable
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"{cache}, and the hub ({constants.ENDPOINT}) is unreachable ({reason})"
