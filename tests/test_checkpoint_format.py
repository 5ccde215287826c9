"""Checkpoint files unpickle no code: trainer and learner state round-trip through msgpack and
safetensors (RNG states exactly), DCP directories load through the allow-listed index reader, a
crafted pickle in any checkpoint file is refused without running, a format-1 checkpoint is refused
in one line, and a whole resume runs with unrestricted unpickling switched off."""

from __future__ import annotations

import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from async_rl.runtime.checkpoint import is_checkpoint, latest_checkpoint, load_trainer_state, rng_state, set_rng_state
from async_rl.utils.checkpoint_format import (CheckpointFormatError, dcp_reader_and_planner, load_learner_state,
                                              load_state, safe_dcp_reads, save_state)

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this creates ``marker``: proof that a loader ran code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def test_rng_states_and_plain_state_round_trip_exactly(tmp_path):
    random.seed(3), np.random.seed(4), torch.manual_seed(5)
    random.random(), np.random.normal(), torch.randn(3)  # mid-stream: a cached Gaussian, a moved position
    saved = rng_state()
    state = {"rng": saved, "ids": {7: (1, "a"), "x": [1.5, float("inf"), None, True, b"\x00"]},
             "np": np.float64(0.1), "weights": torch.arange(6, dtype=torch.bfloat16).view(2, 3)[:, 1:]}
    save_state(tmp_path, "s", state)
    back = load_state(tmp_path, "s")
    assert back["ids"] == {7: (1, "a"), "x": [1.5, float("inf"), None, True, b"\x00"]}
    assert back["np"] == 0.1 and torch.equal(back["weights"], state["weights"])
    assert back["rng"]["python"] == saved["python"] and isinstance(back["rng"]["python"][1], tuple)
    expected = (random.random(), np.random.normal(), torch.randn(3))
    set_rng_state(back["rng"])
    got = (random.random(), np.random.normal(), torch.randn(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_state_that_is_not_plain_data_is_refused_at_save(tmp_path):
    from async_rl.step.rollout import GroupRequest

    request = GroupRequest(0, [1], "u", "s", None, {}, 1, None)
    with pytest.raises(TypeError, match="async_rl.step.rollout.GroupRequest"):
        save_state(tmp_path, "s", {"outstanding": [request]})


def test_another_format_version_is_refused(tmp_path):
    import msgpack

    (tmp_path / "s.msgpack").write_bytes(msgpack.packb({"format_version": 99, "state": {}}))
    with pytest.raises(CheckpointFormatError, match="format_version 99, this code reads 2"):
        load_state(tmp_path, "s")


def test_a_format_1_checkpoint_is_refused_in_one_line_without_running_its_pickle(tmp_path):
    marker = tmp_path / "ran"
    ckpt = tmp_path / "run" / "checkpoints" / "step_000002"
    (ckpt / "learner").mkdir(parents=True)
    torch.save({"format": 1, "step": 2, "rng": _Payload(marker)}, ckpt / "trainer_state.pt")
    torch.save({"version": _Payload(marker)}, ckpt / "learner" / "learner_state.pt")
    (ckpt.parent / "latest").write_text(ckpt.name)
    # Still found as a checkpoint, so that resuming it says why it cannot be.
    assert is_checkpoint(ckpt) and latest_checkpoint(tmp_path / "run") == ckpt
    for load, old in ((load_trainer_state, "trainer_state.pt"), (load_learner_state, "learner_state.pt")):
        path = ckpt if old == "trainer_state.pt" else ckpt / "learner"
        with pytest.raises(CheckpointFormatError) as e:
            load(path)
        line = str(e.value)
        assert "\n" not in line and line.startswith(f"{path}: a checkpoint in format 1 ({old}, a pickle)"), line
        assert "reads format 2" in line and "the async-rl release that wrote it" in line
    assert not marker.exists()


def test_resuming_a_format_1_checkpoint_is_one_line_from_the_cli(tmp_path, capsys):
    from async_rl.cli import main

    marker = tmp_path / "ran"
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    ckpt.mkdir(parents=True)
    torch.save({"format": 1, "step": 1, "rng": _Payload(marker)}, ckpt / "trainer_state.pt")
    (ckpt.parent / "latest").write_text(ckpt.name)
    rc = main(["train", "--config", str(ROOT / "configs/default.yaml"), f"trainer.output_dir={tmp_path}",
               "trainer.run_name=run", "trainer.resume=auto"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1, err
    assert err[0].startswith(f"async-rl: error: {ckpt}: a checkpoint in format 1 (trainer_state.pt, a pickle)"), err
    assert not marker.exists()


def _dcp_checkpoint(path: Path) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    return model, optimizer


def _dcp_load(path: Path, model, optimizer) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    reader, planner = dcp_reader_and_planner(str(path))
    dcp.load(state, storage_reader=reader, planner=planner)
    return state


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_dcp_loads_through_the_safe_reader_and_refuses_code_in_its_index(tmp_path):
    model, optimizer = _dcp_checkpoint(tmp_path / "ok")
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh(torch.randn(1, 3)).sum().backward()
    fresh_opt.step()
    state = _dcp_load(tmp_path / "ok", fresh, fresh_opt)
    assert torch.equal(state["model"]["weight"], model.weight.detach())
    assert state["optim"]["param_groups"][0]["lr"] == 0.01  # a non-tensor entry, read with weights_only

    # The same checkpoint with an index that would run code when unpickled plainly.
    marker = tmp_path / "ran"
    _dcp_checkpoint(tmp_path / "bad")
    (tmp_path / "bad" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    refused = r"the checkpoint index names (io|builtins)\.open, which a DCP index never holds"
    with pytest.raises(BaseException, match=refused):
        _dcp_load(tmp_path / "bad", fresh, fresh_opt)
    assert not marker.exists()
    # A non-tensor entry that would run code (DCP stores it with torch.save) is refused too.
    import torch.distributed.checkpoint as dcp

    dcp.save({"extra": _Payload(marker)}, checkpoint_id=str(tmp_path / "bytes"))
    reader, planner = dcp_reader_and_planner(str(tmp_path / "bytes"))
    with pytest.raises(BaseException, match="Weights only load failed"):
        dcp.load({"extra": None}, storage_reader=reader, planner=planner)
    assert not marker.exists()
    # megatron-core builds its own reader: the context swaps in the same one.
    from torch.distributed.checkpoint import FileSystemReader

    with safe_dcp_reads(), pytest.raises(CheckpointFormatError, match=r"(io|builtins)\.open"):
        FileSystemReader(str(tmp_path / "bad")).read_metadata()
    assert not marker.exists()


@pytest.mark.slow
def test_a_full_resume_runs_no_unrestricted_unpickling(tmp_path, monkeypatch):
    """Every way the old checkpoints ran code is switched off while a run resumes; the resumed
    run still finishes. Restricted loaders (``torch.load(weights_only=True)``, the DCP index
    reader, which subclasses the real ``pickle.Unpickler``) keep working."""
    from async_rl.config import load_config
    from async_rl.trainer import train

    def cfg(*extra):
        return load_config(ROOT / "configs/default.yaml", [
            f"trainer.output_dir={tmp_path}", "trainer.run_name=run", "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2", "trainer.eval_every_steps=0", "trainer.warm_start.steps=0",
            "data.val_max_prompts=2", "logging.progress=false", *extra])

    assert train(cfg("trainer.total_steps=1"))["last_step"] == 1

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled without restriction")

    real_torch_load = torch.load

    def torch_load(*args, weights_only=None, **kwargs):
        if weights_only is False:
            refuse()
        return real_torch_load(*args, weights_only=True, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(pickle, "load", refuse)
        m.setattr(pickle, "loads", refuse)
        m.setattr(pickle, "Unpickler", refuse)
        m.setattr(torch, "load", torch_load)
        resumed = train(cfg("trainer.total_steps=2", "trainer.resume=auto"))
    assert resumed["last_step"] == 2 and "interrupted" not in resumed
