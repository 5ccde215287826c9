"""Sharded checkpoints of the Megatron learner: models and their AdamW state, any (TP, PP, DP) layout.

``save_sharded`` writes, with megatron-core's distributed checkpointing (``torch_dist`` backend, a
``torch.distributed.checkpoint`` directory plus megatron's ``metadata.json`` and ``common.pt``):

* each model's ``sharded_state_dict()`` under its role prefix (``policy.``, ``reference.``,
  ``critic.``): every ``ShardedTensor`` names its place in the *global* tensor (TP shard offsets,
  global layer number under PP, which replica writes), so the library can cut it again at another
  layout when loading;
* each optimizer's per-parameter state (``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with
  amsgrad) mapped onto its parameter's ``ShardedTensor`` (key ``optimizer.state.exp_avg.<param key>``)
  with megatron's ``get_param_id_to_sharded_param_map`` / ``optim_state_to_sharding_state``, as
  megatron's ``FP32Optimizer.sharded_state_dict`` does; the Adam ``step`` (shared by all parameters)
  and the ``param_groups`` hyperparameters (``lr`` as the LR schedule left it, betas, weight decay)
  go into the common part (rank 0 writes it, every rank reads it).

``common.pt`` is read by megatron with ``torch.load``'s default ``weights_only=True`` (torch >= 2.6)
and the DCP index under ``checkpoint_format.safe_dcp_reads``: loading unpickles no code.

``load_sharded`` builds the same structure at the current layout (zero Adam state first, for a fresh
optimizer) and lets megatron cut the stored global tensors for it. Tested on CPU/gloo
(tests/test_megatron_checkpoint.py): exact resume at TP=2; TP 2 -> 1, TP 1 -> 2, PP 2 -> (TP 2, PP 1)
-> PP 2, and 2 ranks -> 1 process, weights and moments bit-equal after reassembly, logits within
3e-7; a critic whose ``output_layer`` is a plain ``nn.Linear``-like value head. Not carried: the LR
scheduler's counter (``LambdaLR.last_epoch``: keep ``scheduler.state_dict()`` with the trainer
state and load it after ``load_sharded``) and RNG states.

Layout on disk (``path``)::

    metadata.json     {"sharded_backend": "torch_dist", ...}   written last: marks a complete save
    common.pt         {"meta": {"format", "models", "optimizers", "optimizer_has_state"},
                       "optimizers": {role: {"param_groups": [...], "state": {"common_step": 2.0}}}}
    __0_0.distcp ...  tensor data, one file per writing rank and thread (torch.distributed.checkpoint)
    .metadata         DCP's global index: every ShardedTensor key with its global shape and chunks

For example a TP=2 policy stores ``policy.decoder.layers.self_attention.linear_qkv.weight`` once, as
a global ``[num_layers, qkv_rows, hidden]`` tensor (layers stacked by global number, TP shards at
their row offsets), and its first moment as ``optimizer.state.exp_avg.policy.decoder.layers...``.

CPU: beyond the learner's three adjustments for building a ``GPTModel`` (seeding, ``torch.cuda.current_device`` and the causal mask; see ``learners/megatron/learner.py``),
megatron's ``torch_dist`` save calls ``torch.cuda.synchronize()`` (raises without CUDA) and makes a
flag tensor on ``torch.cuda.current_device()``; ``cpu_cuda_calls`` covers both, only while a save
or load runs and only when CUDA is absent. Cost: every save forks writer processes (megatron's
``FileSystemWriterAsync``, run synchronously here); a save of a small model takes ~0.3 s, a load
~0.15 s. The writers' results come back through an in-process queue (``in_process_write_results``),
not the ``multiprocessing`` manager megatron would start for them (~4 s at a process's first save).
PP is tested here with an untied output layer; the tied case (the last stage's copy of the
embedding, built on CPU under ``async_rl.learners.megatron.cpu.cpu_model_construction``) is tested
through the learner (``tests/test_megatron_learner.py``).

Source: megatron-core 0.16 ``megatron/core/dist_checkpointing`` (``serialization.save/load``,
``optimizer.py``) and ``megatron/core/optimizer/optimizer.py`` (``FP32Optimizer``); docs:
https://docs.nvidia.com/megatron-core/developer-guide/latest/apidocs/core/core.dist_checkpointing.serialization.html
"""

from __future__ import annotations

import os
import queue
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from async_rl.utils.checkpoint_format import safe_dcp_reads

FORMAT = "async_rl.megatron_checkpoint/1"


@contextmanager
def cpu_cuda_calls() -> Iterator[None]:
    """Make the two CUDA calls of megatron's ``torch_dist`` save/load path harmless when CUDA is absent.

    * ``torch.cuda.synchronize()``: ``FileSystemWriterAsync.preload_tensors`` waits for its
      (non-blocking) device-to-host copies; on a CPU-only torch it raises "Torch not compiled with
      CUDA enabled". CPU tensors are not copied (``.to("cpu")`` returns them), so there is nothing
      to wait for: a no-op.
    * ``torch.cuda.current_device()``: the save-failure flag of ``save_state_dict_async_finalize`` is
      made on it; pointed at the CPU (the learner usually did that already, for RoPE).

    Both are restored on exit; with CUDA this does nothing. Not thread-safe (it swaps module
    attributes): run saves and loads from one thread per process.

    Source: megatron-core 0.16 ``dist_checkpointing/strategies/filesystem_async.py`` and
    ``state_dict_saver.py`` (the source of the installed package; its docs do not list device
    requirements).
    """
    if torch.cuda.is_available():
        yield
        return
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


@contextmanager
def in_process_write_results() -> Iterator[None]:
    """Let megatron's writer collect a synchronous save's results in a plain in-process queue.

    megatron's ``FileSystemWriterAsync`` hands each save's write results to a queue made once per
    process by ``filesystem_async._get_write_results_queue``: a ``multiprocessing`` manager's queue
    (a spawned server process, ~4 s to start), so that an asynchronous save's background process
    can fill it. ``save_sharded`` saves synchronously: the writer processes are forked, joined and
    their results put into that queue and read back by the saving process itself, within the save.
    The manager's server, a child of the rank, listens on a socket in a ``pymp-*`` directory of the
    temp dir that only its own clean exit removes; a rank that ends without exit handlers (Ray
    kills its children first) leaves it. Here no manager is started: the module's queue is a
    ``queue.Queue`` while the save runs, then whatever it was before.

    Does nothing with a megatron-core without that module queue (the manager is then megatron's
    business again). Not thread-safe: one save at a time per process.

    Source: megatron-core 0.16 ``dist_checkpointing/strategies/filesystem_async.py``
    (``_results_queue``, ``write_preloaded_data_multiproc``, ``retrieve_write_results``) and
    ``async_utils.AsyncRequest.execute_sync``.
    """
    try:
        from megatron.core.dist_checkpointing.strategies import filesystem_async
    except ImportError:
        filesystem_async = None
    if filesystem_async is None or not hasattr(filesystem_async, "_results_queue"):
        yield
        return
    saved = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = saved


def init_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state a zero Adam state (``step`` 0, zero moments), in place.

    A fresh optimizer has empty state; loading needs the tensors to load into (megatron's
    ``FP32Optimizer`` does the same through its ``init_state_fn``). Shapes follow the (local) params.

    Raises:
        TypeError: ``optimizer`` is not ``torch.optim.Adam``/``AdamW`` (other state layouts are not
            mapped onto parameter shards here).

    Starting from this zero state is the same as torch's lazy first-step init (``step`` a float32
    scalar tensor, moments ``zeros_like(p)``), so calling it before training changes nothing.

    Source: torch ``Adam._init_group`` (torch 2.13); megatron-core 0.16
    ``megatron/core/optimizer/__init__.py`` (``init_state_fn`` of ``FP32Optimizer``).
    """
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"megatron checkpoints carry Adam/AdamW state only, got {type(optimizer).__name__}")
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            # torch's single-tensor/foreach Adam keeps step as a float32 scalar tensor on the CPU.
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _optimizer_sharded_state(optimizer: torch.optim.Optimizer, model_state: dict, with_state: bool) -> dict:
    """The optimizer's ``state_dict()`` with per-parameter tensors as ShardedTensors (in place of
    plain tensors) and the common ``step`` pulled out, as ``FP32Optimizer.sharded_state_dict``;
    only ``param_groups`` when ``with_state`` is false (a checkpoint of an optimizer that never stepped)."""
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    state = optimizer.state_dict()
    if not with_state:
        state["state"] = {}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    id_map = get_param_id_to_sharded_param_map(model_state, params)
    if 0 < len(state["state"]) < len(params):
        raise ValueError(f"{len(params) - len(state['state'])} of {len(params)} parameters have no optimizer state "
                         "(no gradient at any step so far); megatron checkpoints keep one step per optimizer")
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise ValueError(f"optimizer step differs between parameters ({sorted(steps)}); "
                         "megatron checkpoints keep one step per optimizer")
    step = next((s["step"] for s in state["state"].values() if "step" in s), None)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if step is not None:
        state["state"]["common_step"] = step
    return state


def _tensor_keys(model_state: dict) -> list[str]:
    """Every ShardedTensor (or factory) key of one model on *all* ranks (PP stages hold different
    ones); the set does not depend on the layout. Collective."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    from async_rl.learners import wire

    local = {v.key for v in nested_values(model_state) if hasattr(v, "key")}
    everyone = wire.all_gather(sorted(local))
    return sorted(set().union(*everyone))


def _checkpoint_state(models: dict, optimizers: dict, with_state: dict[str, bool] | None = None) -> dict:
    """The whole sharded state dict: ``{"meta", "models": {role: ...}, "optimizers": {role: ...}}``.
    ``with_state``: role -> whether its optimizer state is included (default: it has state). Collective."""
    unknown = sorted(set(optimizers) - set(models))
    if unknown:
        raise ValueError(f"optimizers {unknown} have no model of the same key (models: {sorted(models)})")
    other = sorted(f"{k} ({type(o).__name__})" for k, o in optimizers.items()
                   if not isinstance(o, (torch.optim.Adam, torch.optim.AdamW)))
    if other:
        raise TypeError(f"megatron checkpoints carry Adam/AdamW state only, got optimizers {other}")
    with_state = with_state or {key: bool(opt.state) for key, opt in optimizers.items()}
    # Children that are not Megatron modules (a critic's value head put where ``output_layer`` was)
    # go through megatron's ``sharded_state_dict_default``: ShardedTensors replicated over TP and DP
    # (``make_sharded_tensors_for_checkpoint``), written once by TP rank 0 / DP rank 0.
    model_states = {key: m.sharded_state_dict(prefix=f"{key}.") for key, m in models.items()}
    optim_states = {key: _optimizer_sharded_state(opt, model_states[key], with_state[key])
                    for key, opt in optimizers.items()}
    meta = {"format": FORMAT, "models": sorted(models), "optimizers": sorted(optimizers),
            "optimizer_has_state": with_state, "keys": {key: _tensor_keys(st) for key, st in model_states.items()}}
    return {"meta": meta, "models": model_states, "optimizers": optim_states}


def save_sharded(path: str, models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> None:
    """Write ``models`` and ``optimizers`` as one megatron distributed checkpoint into ``path``.

    Collective: every rank of the default process group calls it with its local modules (its TP
    shard, its PP stage; DP replicas write nothing twice: each ShardedTensor's ``replica_id`` picks
    one writer). ``path`` is created; a complete checkpoint there is overwritten (write to a fresh
    directory and rename it for atomicity).

    Args:
        path: checkpoint directory (shared by all ranks).
        models: role -> megatron ``GPTModel`` (or any ``MegatronModule``) with this rank's local
            parameters, fp32 or bf16; the role prefixes the checkpoint keys (``"policy"`` ->
            ``policy.decoder.layers.mlp.linear_fc1.weight``, layers stacked by global number).
        optimizers: role -> ``torch.optim.Adam``/``AdamW`` over that role's model parameters; an
            optimizer that has not stepped yet is saved without moments (only ``param_groups``).

    Raises:
        ValueError: an optimizer key has no model; the optimizer holds a parameter that is not in its
            model's sharded state dict; some parameters have Adam state and others not, or their
            steps differ (megatron keeps one step per optimizer).
        TypeError: an optimizer is not ``torch.optim.Adam``/``AdamW``.

    Source: ``megatron.core.dist_checkpointing.save`` (megatron-core 0.16 docs, "dist_checkpointing
    package"); optimizer mapping as ``megatron.core.optimizer.FP32Optimizer.sharded_state_dict``.
    """
    from megatron.core import dist_checkpointing

    state = _checkpoint_state(models, optimizers)
    os.makedirs(path, exist_ok=True)
    with cpu_cuda_calls(), in_process_write_results():
        dist_checkpointing.save(state, path)


def _check_fits(path: str, models: dict, optimizers: dict) -> dict:
    """Read the common part of the checkpoint at ``path`` and check the requested roles are there.

    Returns the common state dict. Raises FileNotFoundError / ValueError as ``load_sharded``.
    """
    from megatron.core import dist_checkpointing

    if not os.path.isdir(path) or not dist_checkpointing.check_is_distributed_checkpoint(path):
        raise FileNotFoundError(f"no megatron distributed checkpoint (metadata.json) at {path}")
    common = dist_checkpointing.load_common_state_dict(path)
    meta = common.get("meta", {}) if isinstance(common, dict) else {}
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path} is a megatron checkpoint but not one of save_sharded ({meta.get('format')!r})")
    missing = sorted(set(models) - set(meta["models"])) + [f"optimizer {k}" for k in sorted(optimizers)
                                                            if k not in meta["optimizers"]]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing} (it holds models {meta['models']}, "
                         f"optimizers {meta['optimizers']})")
    return common


def load_sharded(path: str, models: dict[str, torch.nn.Module], optimizers: dict[str, torch.optim.Optimizer]) -> None:
    """Restore in place what ``save_sharded`` wrote, resharded to this run's (TP, PP, DP) layout.

    Collective: every rank of the default process group calls it. Parameters are copied into the
    models (``load_state_dict(strict=True)``); each optimizer gets its Adam moments (the local slice
    of the global moment tensors), the common ``step``, and the saved ``param_groups``
    hyperparameters (``lr``, ``betas``, ``weight_decay``, ...); parameter identity is this run's.
    Roles in the checkpoint that are not requested are left on disk (loading only the policy of a
    policy+critic checkpoint is fine).

    Args:
        path: a directory written by ``save_sharded``.
        models: role -> model built at this run's layout with the saved architecture.
        optimizers: role -> ``torch.optim.Adam``/``AdamW`` over that role's parameters (fresh or not).

    Raises:
        FileNotFoundError: ``path`` holds no megatron checkpoint (no ``metadata.json``).
        ValueError: the checkpoint does not fit: a requested role is missing, the role's tensor
            keys differ (another architecture), global shapes differ (another size; chained to
            megatron's ``CheckpointingException`` / DCP's ``CheckpointException``), or it was not
            written by ``save_sharded``.
        TypeError: an optimizer is not ``torch.optim.Adam``/``AdamW``.

    Source: ``megatron.core.dist_checkpointing.load`` with ``StrictHandling.RAISE_UNEXPECTED``
    (megatron-core 0.16 docs); optimizer restore as ``FP32Optimizer.load_state_dict``.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    saved = _check_fits(path, models, optimizers)["meta"]
    had_state = {key: saved["optimizer_has_state"][key] for key in optimizers}
    for key, opt in optimizers.items():
        if had_state[key]:
            init_adam_state(opt)
    state = _checkpoint_state(models, optimizers, had_state)
    for key in models:
        _check_same_keys(path, key, saved["keys"][key], state["meta"]["keys"][key])
    try:
        # safe_dcp_reads: DCP's index and non-tensor entries are read without unpickling code.
        with cpu_cuda_calls(), safe_dcp_reads(), warnings.catch_warnings():
            # torch's DCP flags ShardedTensor and load_state_dict as deprecated on every load; megatron
            # 0.16 uses both. Nothing for our callers to act on.
            warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|megatron)\.")
            loaded = dist_checkpointing.load(state, path, strict=StrictHandling.RAISE_UNEXPECTED)
    except (CheckpointingException, CheckpointException) as e:
        raise ValueError(f"checkpoint {path} does not fit these models: {_one_line(e)}") from e
    for key, model in models.items():
        prefix = f"{key}."
        weights = {k[len(prefix):]: v for k, v in loaded["models"][key].items()}
        model.load_state_dict(weights, strict=True)
    for key, opt in optimizers.items():
        _restore_optimizer(opt, loaded["optimizers"][key], had_state[key])


def _check_same_keys(path: str, role: str, saved: list[str], wanted: list[str]) -> None:
    """Raise ValueError when the checkpoint's tensors of ``role`` are not this model's (another
    architecture: a value head in place of a tied output layer, other layer types, ...)."""
    only_saved, only_here = sorted(set(saved) - set(wanted)), sorted(set(wanted) - set(saved))
    if only_saved or only_here:
        raise ValueError(f"checkpoint {path} does not fit model {role!r}: {len(only_saved)} tensors only in the "
                         f"checkpoint {only_saved[:3]}, {len(only_here)} only in the model {only_here[:3]}")


def _one_line(error: BaseException) -> str:
    """The first failure's message of a megatron or DCP checkpoint error, on one line.

    DCP's ``CheckpointException`` (a ``BaseException``, raised on every rank when any rank's load
    plan failed, e.g. megatron's global-shape check) prints a traceback per rank; its
    ``failures`` hold the exceptions themselves.
    """
    failures = getattr(error, "failures", None)
    if failures:
        error = next(iter(failures.values()))[0]
    text = " ".join(str(error).split())
    return (text[:400] + " ...") if len(text) > 400 else text


def _restore_optimizer(optimizer: torch.optim.Optimizer, saved: dict, had_state: bool) -> None:
    """``optimizer.load_state_dict`` of a loaded optimizer part, the common step spread back."""
    step = saved["state"].pop("common_step", None)
    if not had_state:
        optimizer.state.clear()
        saved = {"state": {}, "param_groups": saved["param_groups"]}
    elif step is not None:
        for param_state in saved["state"].values():
            param_state["step"] = step.clone() if isinstance(step, torch.Tensor) else step
    optimizer.load_state_dict(saved)
