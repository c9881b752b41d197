#!/usr/bin/env bash
# The README's main command: set up, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python -m prepfuse.demo "$@"
