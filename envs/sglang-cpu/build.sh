#!/usr/bin/env bash
# Build the SGLang CPU venv (default: .venv-sglang at the repository root) in which
# generator.backend=sglang runs and its tests run. SGLang has no supported CPU wheel: its registry
# metadata pins a CUDA torch and the CUDA-only sglang-kernel. This is a route measured to work on a
# 2-core CPU machine, made reproducible: the project and torch 2.13.0+cpu as in README command 1,
# sglang==0.5.23 with --no-deps, its Python dependencies pinned (requirements.txt), and two
# adjustments (adjust.py): a stand-in for sglang-kernel's import-time names, each of which raises
# if called, and torchvision's fake-op registrations made to skip the ops its CUDA build cannot load.
# About 4 minutes and 3.5 GB on 2 cores with pip's cache warm. Idempotent: rerun to repair.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-sglang}"
HERE=envs/sglang-cpu

python3 -m venv "$VENV"
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints-cpu.txt -e '.[dev]'
python -m pip install -q -c constraints-cpu.txt -r "$HERE/requirements.txt"
python -m pip install -q --no-deps sglang==0.5.23 torchvision==0.28.0
python "$HERE/adjust.py"
python -c "import sglang, sgl_kernel, transformers, torch; from sglang.srt.entrypoints.engine import Engine; \
print('sglang', sglang.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__, \
'sgl_kernel', sgl_kernel.__version__)"
