"""vLLM's log, less the warnings that say nothing about this run.

An engine start on the CPU build prints about fifteen ``WARNING`` lines from its three processes
(this one, the engine core, the worker) about choices this project makes on purpose or about
hardware features a CPU run does without. :data:`KNOWN_WARNINGS` lists each with the reason it is
harmless here; :class:`KnownWarnings` drops exactly those, and every other warning or error still
shows.

vLLM spawns its engine-core and worker processes, so a filter set up in this process would not
reach them; each of them configures its logging from the ``dictConfig`` file named by
``VLLM_LOGGING_CONFIG_PATH``. :func:`use_quiet_config` points that variable at
:data:`CONFIG_FILE` (``logging.json`` beside this module: vLLM's own handler, format, level
``WARNING`` and stream, plus this filter) and applies it here too, before vLLM is imported, so
the import's own warnings pass through the filter as well.

A user who configures vLLM's logging (``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH`` or
``VLLM_CONFIGURE_LOGGING=0``) gets vLLM's behaviour unchanged: ``VLLM_LOGGING_LEVEL=WARNING``
shows all of them again.

Not reachable from here: lines a spawned process writes before vLLM configures its logging (its
import-time "Triton is installed, but doesn't include CPU backend", printed by Python's
last-resort handler) and torch's C++ warning about NUMA memory binding.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from pathlib import Path

CONFIG_FILE = Path(__file__).with_name("logging.json")
"""The ``dictConfig`` file every vLLM process reads (``VLLM_LOGGING_CONFIG_PATH``)."""

KNOWN_WARNINGS: tuple[tuple[str, str, str], ...] = (
    # (logger, start of the message template, why it is harmless here)
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill",
     "disabled on purpose (VLLMGenerator._start): seeded requests whose prompt is split across steps "
     "crash the CPU build's sampler; no prompt is ever split"),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile",
     "generator.vllm.enforce_eager (default true) asks for eager mode: compiling costs minutes at "
     "start and needs a C++ toolchain on CPU"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings",
     "the same choice (enforce_eager) seen from the compilation settings"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton",
     "the V1 model runner it falls back to is the one the CPU build runs"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected",
     "triton-cpu only speeds up some CPU kernels; vLLM uses its torch kernels without it"),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend",
     "the GPU triton xgrammar pulls in has no CPU backend; vLLM disables it and runs without"),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32",
     "a Mamba (SSM) setting; the models trained here have no SSM layers"),
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD",
     "tcmalloc / Intel OpenMP preloading is a throughput tweak for large CPU models, not needed "
     "for correct results"),
    ("vllm.utils.torch_utils", "OMP_NUM_THREADS=%s is set; leaving Torch threads",
     "set on purpose (VLLMGenerator, num_threads): the cores are split between engines and the learner"),
)


class KnownWarnings(logging.Filter):
    """Drops the records :data:`KNOWN_WARNINGS` lists (matched by logger name and the start of the
    unformatted message), and only those, whatever their level. An error record carrying an
    exception also has its root cause recorded (``model_support.record_fatal``: vLLM logs an
    engine core's fatal error in that process, while the run only sees ``EngineDeadError``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR and record.exc_info and record.exc_info[1] is not None:
            # An engine process logging its fatal error: keep the root cause for the run's one line.
            from async_rl.generators.model_support import record_fatal

            record_fatal(record.exc_info[1])
        msg = record.msg if isinstance(record.msg, str) else ""
        return not any(record.name == name and msg.startswith(start) for name, start, _ in KNOWN_WARNINGS)


def use_quiet_config(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> bool:
    """Point vLLM (this process and the ones it spawns) at :data:`CONFIG_FILE` and apply it here,
    unless the user configured vLLM's logging; returns whether it did.

    Call it before ``import vllm``. Idempotent.
    """
    ours = str(CONFIG_FILE)
    if (environ.get("VLLM_LOGGING_CONFIG_PATH", ours) != ours or "VLLM_LOGGING_LEVEL" in environ
            or environ.get("VLLM_CONFIGURE_LOGGING", "1") == "0"):
        return False
    environ["VLLM_LOGGING_CONFIG_PATH"] = str(CONFIG_FILE)
    logging.config.dictConfig(json.loads(CONFIG_FILE.read_text()))
    return True
