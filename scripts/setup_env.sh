#!/usr/bin/env bash
# Shared set-up for the README's two commands: a .venv at the repo root, torch 2.13.0
# when no torch is importable there, then prepfuse itself in editable mode with its
# test extra. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
if ! python -c "import torch" >/dev/null 2>&1; then
    python -m pip install -q torch==2.13.0
fi
if ! python -c "import prepfuse, pytest, xdist, expecttest, hypothesis, numpy, transformers" >/dev/null 2>&1; then
    python -m pip install -q -e ".[test]"
fi
