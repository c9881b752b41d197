#!/usr/bin/env bash
# The pass tests on another torch (`bash scripts/test_torch.sh 2.15.0 [pytest args]`), in a
# venv of its own (.venv-torch<version>), on the CPU: the post-grad graphs the passes read
# change between torch versions (decompositions, Inductor's joint-graph rewrites), so CI runs
# them on each supported torch it can install besides the README's 2.13. Of the corpus,
# transformers' modules only (tests/corpus/test_transformers.py: HF Qwen3, Llama, Gemma-3 and
# the others; test_transformers_dsv4.py): the engines', references', zoo and padded-projection
# cases run on 2.13 alone, to keep CI near half an hour.
#
# torch comes from the machine's package index as its CUDA build: `import torch` loads cuDNN,
# cuBLAS and the other CUDA libraries even on a CPU machine, so torch's own requirements are
# installed from its metadata, less triton and cuda-bindings (the index may not hold the
# pinned ones; neither is needed here: without triton the kernels' interpreter tests skip,
# and the passes, the op references and the corpus run). A pip constraint file capping torch
# (/etc/xdg/pip here) is not applied to this venv. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/test_torch.sh TORCH_VERSION [pytest args]}
shift
venv=.venv-torch$version
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" >/dev/null 2>&1; then
    PIP_CONSTRAINT=/dev/null "$py" -m pip install -q --no-deps "torch==$version"
    req=$(mktemp)
    trap 'rm -f "$req"' EXIT
    "$py" - "$req" <<'PY'
import importlib.metadata, re, sys
skip = {"triton", "cuda-bindings"}
with open(sys.argv[1], "w") as out:
    for req in importlib.metadata.requires("torch"):
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
        if "extra ==" not in req and name not in skip:
            out.write(req + "\n")
PY
    PIP_CONSTRAINT=/dev/null "$py" -m pip install -q -r "$req"
fi
if ! "$py" -c "import prepfuse, pytest, xdist, expecttest, hypothesis, numpy, transformers" >/dev/null 2>&1; then
    "$py" -m pip install -q "pytest>=7" "pytest-xdist>=3" "expecttest>=0.2" "hypothesis>=6" numpy "transformers==5.17.0"
    "$py" -m pip install -q --no-deps -e .
fi
"$py" -c "import torch; print('torch', torch.__version__, '(another torch: the pass tests)')"
exec bash scripts/pytest_or_fail.sh "$py" -q -n "$(bash scripts/test_workers.sh)" -p no:cacheprovider tests/fx_passes \
    tests/corpus/test_transformers.py tests/corpus/test_transformers_dsv4.py tests/test_compat.py \
    tests/test_backend.py "$@"
