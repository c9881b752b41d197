#!/usr/bin/env bash
# Runs pytest with the given python and arguments (`pytest_or_fail.sh PYTHON ARGS...`) and
# exits with pytest's status, except that "no tests collected" (5) is a failure: a CI run
# whose selection matched nothing must not pass.
set -uo pipefail
py=$1
shift
"$py" -m pytest "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as a failure" >&2
    exit 1
fi
exit "$rc"
