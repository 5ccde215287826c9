#!/usr/bin/env bash
# Build the verifiers venv (default: .venv-verifiers at the repository root) in which the built-in
# rollout function `verifiers` runs its worker (async_rl/endpoint/verifiers_worker.py). verifiers
# 0.4.0 needs openai<3, which the main venv's vLLM does not allow, so it gets a venv of its own; the
# worker imports nothing of async-rl and talks to the policy endpoint over HTTP. No torch: about
# 35 s and 600 MB on 2 cores. Idempotent: rerun to repair.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV="${1:-.venv-verifiers}"
HERE=envs/verifiers

python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q -r "$HERE/requirements.txt"
"$VENV/bin/python" -c "import verifiers, verifiers.v1, openai; print('verifiers', verifiers.__version__, 'openai', openai.__version__)"
