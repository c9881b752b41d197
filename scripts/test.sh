#!/usr/bin/env bash
# The README's test command: set up, then run the whole suite on pytest-xdist workers
# (scripts/test_workers.sh; `-n 0` after it runs in one process). On a machine without a
# GPU, GPU-marked tests are skipped and triton kernels run under TRITON_INTERPRET=1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
exec bash scripts/pytest_or_fail.sh python -q -n "$(bash scripts/test_workers.sh)" "$@"
