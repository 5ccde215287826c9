"""Typed policy-loss options (issue 31): one frozen dataclass per loss, built once from the
algorithm config with one-line errors naming the key, and passed to whichever loss the config
names, with no loss a special case of the caller."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from async_rl.algorithms import (POLICY_LOSSES, CISPOOptions, GSPOOptions, LossOptions, OffPolicyCorrection,
                                 PolicyLossInputs, PPOClipOptions, register_policy_loss)
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
BUILTIN_OPTIONS = {"ppo_clip": PPOClipOptions, "gspo": GSPOOptions, "cispo": CISPOOptions}


def _load(*overrides: str):
    return load_config(ROOT / "configs/default.yaml", list(overrides))


def _inputs(n: int = 3) -> PolicyLossInputs:
    lp = torch.zeros(1, n, requires_grad=True)
    return PolicyLossInputs(lp, torch.zeros(1, n), torch.zeros(1, n), torch.ones(1, n), torch.ones(1, n),
                            agg_mode="token-mean", num_global_tokens=n, num_global_seqs=1)


def test_every_builtin_loss_declares_its_own_options_type():
    assert set(POLICY_LOSSES.names()) == set(BUILTIN_OPTIONS)
    for name, options_type in BUILTIN_OPTIONS.items():
        assert POLICY_LOSSES.get(name).options_type is options_type
        assert dataclasses.is_dataclass(options_type) and options_type.__dataclass_params__.frozen


@pytest.mark.parametrize("name", sorted(BUILTIN_OPTIONS))
def test_the_config_builds_exactly_the_loss_s_options_type(name):
    options = _load(f"algorithm.policy_loss={name}").algorithm.loss_options()
    assert type(options) is BUILTIN_OPTIONS[name]
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.clip_ratio_low = 0.5


@pytest.mark.parametrize("name", sorted(BUILTIN_OPTIONS))
def test_a_loss_refuses_another_loss_s_options(name):
    fn = POLICY_LOSSES.get(name)
    loss, _ = fn(_inputs(), OffPolicyCorrection(), fn.options_type())
    assert torch.isfinite(loss)
    other = next(t for n, t in BUILTIN_OPTIONS.items() if n != name)
    with pytest.raises(TypeError, match=f"takes {fn.options_type.__name__}, got {other.__name__}"):
        fn(_inputs(), OffPolicyCorrection(), other())


@pytest.mark.parametrize("options_type, field, bad", [
    (PPOClipOptions, "clip_ratio_c", 0.5), (PPOClipOptions, "clip_ratio_c", math.nan),
    (PPOClipOptions, "clip_ratio_low", 0.0), (PPOClipOptions, "clip_ratio_low", 1.5),
    (PPOClipOptions, "clip_ratio_high", -0.1), (PPOClipOptions, "clip_ratio_high", True),
    (GSPOOptions, "clip_ratio_high", 0.0), (GSPOOptions, "clip_ratio_low", "0.1"),
    (CISPOOptions, "clip_ratio_low", -0.5), (CISPOOptions, "clip_ratio_high", math.nan),
])
def test_options_refuse_a_bad_value_in_one_line_naming_the_field(options_type, field, bad):
    with pytest.raises(ValueError) as info:
        options_type(**{field: bad})
    message = str(info.value)
    assert message.startswith(f"{options_type.__name__}.{field} must be ") and "\n" not in message


def test_the_options_accept_their_edges():
    assert PPOClipOptions(clip_ratio_low=1.0, clip_ratio_c=math.inf).clip_ratio_c == math.inf
    assert CISPOOptions(clip_ratio_low=0.0).clip_ratio_low == 0.0  # weight floor 1: CISPO drops no token


@pytest.mark.parametrize("overrides, message", [
    (("algorithm.loss_kwargs.clip_ratio_c=0.5",), "algorithm.loss_kwargs.clip_ratio_c must be > 1 (dual clip) or null, got 0.5"),
    (("algorithm.policy_loss=gspo", "algorithm.loss_kwargs.clip_ratio_c=3"),
     "algorithm.loss_kwargs.clip_ratio_c: policy loss 'gspo' takes no option 'clip_ratio_c' "
     "(its options: clip_ratio_low, clip_ratio_high)"),
    (("algorithm.policy_loss=cispo", "algorithm.loss_kwargs.clip_ratio_high=-1"),
     "algorithm.loss_kwargs.clip_ratio_high must be a number > 0, got -1.0"),
])
def test_a_bad_loss_option_stops_at_load_in_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        _load(*overrides)
    assert str(info.value) == message


def test_options_come_from_defaults_then_the_fields_the_loss_reads_then_loss_kwargs():
    # ppo_clip reads algorithm.clip_ratio_*; loss_kwargs wins over them.
    ppo = _load("algorithm.clip_ratio_high=0.28", "algorithm.loss_kwargs.clip_ratio_low=0.1").algorithm
    assert ppo.loss_options() == PPOClipOptions(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=None)
    # GSPO's ratio is a sequence mean on another scale: algorithm.clip_ratio_* is not read.
    gspo = _load("algorithm.policy_loss=gspo", "algorithm.clip_ratio_high=0.28").algorithm
    assert gspo.loss_options() == GSPOOptions()
    gspo = _load("algorithm.policy_loss=gspo", "algorithm.loss_kwargs.clip_ratio_high=5e-4").algorithm
    assert gspo.loss_options() == GSPOOptions(clip_ratio_high=5e-4)


def _plugin(tmp_path: Path) -> Path:
    path = tmp_path / "my_losses.py"
    path.write_text(
        "import dataclasses\n"
        "from async_rl.algorithms import LossOptions\n\n"
        "def scaled(inputs, correction, scale=1.0, *, shift=0.0):\n"
        "    return inputs.logprobs.sum() * scale + shift, {}\n\n"
        "@dataclasses.dataclass(frozen=True)\n"
        "class HalfOptions(LossOptions):\n"
        "    weight: float = 0.5\n\n"
        "def half(inputs, correction, options):\n"
        "    return inputs.logprobs.sum() * options.weight, {}\n\n"
        "half.options_type = HalfOptions\n"
    )
    return path


def test_a_plain_keyword_user_loss_gets_its_parameters_as_typed_options(tmp_path):
    spec = f"{_plugin(tmp_path)}:scaled"
    algo = AlgorithmConfig(policy_loss=spec, loss_kwargs={"scale": 2.0}).apply_preset()
    fn = algo.policy_loss_fn
    options = algo.loss_options()
    # Every lookup of the spec yields the same options class (the learner and the config look it up apart).
    assert type(options) is fn.options_type is POLICY_LOSSES.get(spec).options_type
    assert (options.scale, options.shift) == (2.0, 0.0) and isinstance(options, LossOptions)
    inputs = _inputs()
    inputs.logprobs.data.fill_(1.0)
    assert fn(inputs, OffPolicyCorrection(), options)[0].item() == 6.0
    assert fn(inputs, OffPolicyCorrection(), shift=1.0)[0].item() == 4.0  # the keyword call still works
    with pytest.raises(ValueError, match="algorithm.loss_kwargs.scael: policy loss .* takes no option 'scael' "
                                         r"\(its options: scale, shift\)"):
        AlgorithmConfig(policy_loss=spec, loss_kwargs={"scael": 2.0}).apply_preset().loss_options()


def test_a_user_loss_may_declare_its_options_type(tmp_path):
    spec = f"{_plugin(tmp_path)}:half"
    algo = AlgorithmConfig(policy_loss=spec, loss_kwargs={"weight": 0.25}).apply_preset()
    assert algo.policy_loss_fn.options_type.__name__ == "HalfOptions"
    assert algo.loss_options().weight == 0.25
    (tmp_path / "bad_losses.py").write_text("def f(inputs, correction, options):\n    pass\n\nf.options_type = dict\n")
    with pytest.raises(ValueError, match="options_type must be a subclass of .*LossOptions"):
        POLICY_LOSSES.get(f"{tmp_path / 'bad_losses.py'}:f")


def test_register_policy_loss_sets_the_options_type():
    @dataclasses.dataclass(frozen=True)
    class NoOptions(LossOptions):
        pass

    try:
        @register_policy_loss("test_registered_zero", NoOptions)
        def zero(inputs, correction, options):
            return inputs.logprobs.sum() * 0, {}

        algo = AlgorithmConfig(policy_loss="test_registered_zero").apply_preset()
        assert POLICY_LOSSES.get("test_registered_zero") is zero and type(algo.loss_options()) is NoOptions
        with pytest.raises(ValueError, match="LossOptions subclass"):
            register_policy_loss("test_registered_bad", dict)
    finally:
        POLICY_LOSSES.pop("test_registered_zero")


@pytest.mark.parametrize("name", [*sorted(BUILTIN_OPTIONS), "user"])
def test_the_learner_passes_every_loss_exactly_its_options(name, tiny_model_path, tmp_path, monkeypatch):
    # The caller has no special case: whatever the config names, the learner's one call passes
    # the options the config built, of that loss's own type.
    from multirank_worker import make_batch

    from async_rl.learners.base import LearnerConfig
    from async_rl.learners.fsdp import FSDPLearner

    spec = f"{_plugin(tmp_path)}:scaled" if name == "user" else name
    kwargs = {"scale": 3.0} if name == "user" else {"clip_ratio_high": 0.3}
    algo = AlgorithmConfig(policy_loss=spec, loss_kwargs=kwargs, loss_horizon_tokens=16).apply_preset()
    learner = FSDPLearner(LearnerConfig(lr=1e-3, micro_batch_size=4), algo, tiny_model_path, temperature=1.0,
                          total_optimizer_steps=1)
    seen = []
    fn = learner.policy_loss

    def spy(inputs, correction, options):
        seen.append(options)
        return fn(inputs, correction, options)

    monkeypatch.setattr(learner, "policy_loss", spy)
    batch = make_batch()
    learner.prepare(batch)
    learner.train_step(batch)
    want = fn.options_type(**kwargs) if name == "user" else algo.loss_options()
    assert want == dataclasses.replace(fn.options_type(), **kwargs) or name == "ppo_clip"
    assert seen and all(type(o) is fn.options_type and o == want for o in seen)
    assert all(o is seen[0] for o in seen)  # built once per learner, not per call
