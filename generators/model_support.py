"""What models each engine serves on this platform, and the weight names it really holds.

Two things an engine knows and the rest of the system must ask it, before anything starts or
any byte moves:

* **Whether it serves a model here** (``check_model``, called at start by
  ``async_rl.runtime.inputs.check_inputs``): vLLM's CPU attention runs only some head sizes
  (``VLLM_CPU_HEAD_SIZES``); a model outside them used to start the engine, die in its worker with
  ``Unsupported CPU attention configuration: head_dim=16`` and end the run in an
  ``EngineDeadError`` traceback. vLLM's ``Gemma2ForCausalLM`` always computes its logits from the
  input embedding, so a Gemma2 checkpoint with an untied head would be served with another head
  than the learner trains. Both are refused in one line naming the engine, the value and what
  would work.
* **Which names it holds** (``unloaded_aliases``): a tied head (``lm_head.weight``) is accepted
  by the whole-update check as an alias of the embedding (``async_rl.generators.vllm.worker.engine_weight_names``), but
  a model with no head module at all (vLLM's Gemma2) cannot load it: its ``load_weights`` raises
  on the name. The engine's receiver drops such aliases before loading (their bytes are the
  embedding's, which the update carries under its own name).
* **Why an engine died** (``root_cause``): vLLM reports a dead engine core as ``EngineDeadError``
  ("EngineCore encountered an issue. See stack trace (above) for the root cause."), while the
  cause was logged in the engine's own process: the log filter every vLLM process installs
  (``async_rl.generators.vllm.logging_filter``) records it (``record_fatal``) in a file the engine names
  (``ERROR_FILE_ENV``), and ``engine_died`` quotes it in the run's one-line ``EngineDied``.

Nothing here imports vLLM: the checks run in the trainer before any engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Head sizes vLLM's CPU attention serves: ``CPUAttentionBackend.get_supported_head_sizes()`` of
``vllm/v1/attention/backends/cpu_attn.py`` (vLLM 0.32; ``tests/test_architectures.py`` compares
it with the installed vLLM). Any other size dies in the engine core at the first forward."""

VLLM_HEAD_IS_EMBEDDING = ("Gemma2ForCausalLM",)
"""vLLM model classes with no output-head module: logits come from the input embedding whatever
``tie_word_embeddings`` says (``vllm/model_executor/models/gemma2.py``'s ``compute_logits``)."""


ERROR_FILE_ENV = "ASYNC_RL_ENGINE_ERROR_FILE"
"""Environment variable naming the file an engine's processes write the root cause of a fatal
error to (``record_fatal``, from the log filter every vLLM process installs); set by the engine
for the processes it starts, read by ``root_cause`` when the engine reports itself dead."""


class EngineDied(RuntimeError):
    """An engine that died mid-run; the message is one line naming the engine and the root cause
    (``root_cause``), not vLLM's "See stack trace (above)"."""


class UnservableModelError(ValueError):
    """A model an engine cannot serve on this platform, refused before any engine starts; the
    message is one line naming the engine, the value and what would work."""


def read_hf_config(model_path: str) -> dict[str, Any]:
    """The ``config.json`` of a local Hugging Face model directory as a dict (``{}`` where the
    directory has none, e.g. a hub id not yet fetched: the engine then finds out itself)."""
    path = Path(model_path) / "config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def head_size(hf_config: dict[str, Any]) -> int | None:
    """Attention head size of a config dict: ``head_dim`` where set (Gemma2, Qwen3, Mistral),
    else ``hidden_size // num_attention_heads``; ``None`` if neither is known (the text
    config of a multimodal model is looked up under ``text_config``)."""
    cfg = hf_config.get("text_config") or hf_config
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def check_vllm_model(hf_config: dict[str, Any], model_path: str = "the model", cpu: bool = True) -> None:
    """Refuse a model vLLM would not serve correctly here (see the module docstring).

    Args:
        hf_config: the model's ``config.json`` as a dict.
        model_path: for the message.
        cpu: vLLM runs on its CPU build here (its CPU attention's head sizes apply).

    Raises:
        UnservableModelError: a head size outside ``VLLM_CPU_HEAD_SIZES`` on CPU, or a Gemma2 whose
            config unties its head (vLLM would serve the embedding as its head).
    """
    size = head_size(hf_config)
    if cpu and size is not None and size not in VLLM_CPU_HEAD_SIZES:
        sizes = ", ".join(map(str, VLLM_CPU_HEAD_SIZES))
        raise UnservableModelError(
            f"generator.backend=vllm cannot serve {model_path}: head_dim={size}; vLLM's CPU attention supports "
            f"head_dim in {{{sizes}}}; use generator.backend=hf or a model whose head size is one of those")
    arch = (hf_config.get("architectures") or [""])[0]
    if arch in VLLM_HEAD_IS_EMBEDDING and hf_config.get("tie_word_embeddings") is False:
        raise UnservableModelError(
            f"generator.backend=vllm cannot serve {model_path}: tie_word_embeddings=false, but vLLM's {arch} always "
            f"uses the input embedding as its output head; use generator.backend=hf or a {arch} with tied embeddings")


def unloaded_aliases(model, tied: dict[str, str]) -> set[str]:
    """The tied aliases (``{alias: target}`` of ``async_rl.generators.vllm.worker.engine_weight_names``) that
    ``model.load_weights`` cannot take: a head alias of a model with no head module (vLLM's
    Gemma2). Their bytes are the target's, which the update carries under its own name."""
    return {alias for alias in tied if alias.split(".")[0] == "lm_head" and getattr(model, "lm_head", None) is None}


def record_fatal(exc: BaseException, environ=None) -> None:
    """In an engine's own process: append ``exc``'s root cause (``root_cause``, one line) to the
    file ``$ASYNC_RL_ENGINE_ERROR_FILE`` names, if set; the file exists only once an engine failed.
    Never raises: it runs inside logging."""
    import os

    path = (environ if environ is not None else os.environ).get(ERROR_FILE_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            f.write(root_cause(exc) + "\n")
    except Exception:  # noqa: BLE001 - a log filter must not fail the log call
        pass


def is_engine_dead(error: BaseException) -> bool:
    """Whether ``error`` (or an exception it was raised from) is vLLM's ``EngineDeadError``."""
    e, seen = error, set()
    while e is not None and id(e) not in seen:
        if type(e).__name__ == "EngineDeadError":
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def engine_died(engine: str, error: BaseException, error_file: str | None) -> EngineDied:
    """The one-line ``EngineDied`` for ``error``: the first root cause the engine's processes
    recorded in ``error_file`` (``record_fatal``; the file is removed once read), else
    ``root_cause(error)``."""
    recorded = ""
    if error_file and Path(error_file).is_file():
        recorded = Path(error_file).read_text()
        Path(error_file).unlink(missing_ok=True)  # read once: nothing is left even if close never runs
    first = next((line for line in recorded.splitlines() if line.strip()), "")
    return EngineDied(f"the {engine} engine died: {first or root_cause(error)}")


def root_cause(error: BaseException) -> str:
    """One line naming why an engine failed: the innermost exception of ``error``'s
    ``__cause__``/``__context__`` chain that is not vLLM's ``EngineDeadError`` wrapper and has a
    message, as ``"ValueError: <first line of its message>"``; else ``error`` itself."""
    chain, seen = [], set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in reversed(chain):
        if type(e).__name__ != "EngineDeadError" and str(e).strip():
            return f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
    return f"{type(error).__name__}: {error}"
