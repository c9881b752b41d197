#!/usr/bin/env bash
# How many pytest-xdist workers the test scripts start: PREPFUSE_TEST_WORKERS if set, else
# the machine's cores up to four (each worker imports torch and compiles on its own, so
# more than a few cost memory for little gain; CI's two cores run the suite in 6 minutes
# instead of 10).
set -euo pipefail
if [ -n "${PREPFUSE_TEST_WORKERS:-}" ]; then
    echo "$PREPFUSE_TEST_WORKERS"
else
    cores=$(nproc 2>/dev/null || echo 1)
    echo $(( cores < 4 ? cores : 4 ))
fi
