#!/usr/bin/env bash
# The pass tests on a second torch, 2.14.1, in a venv of its own (.venv-torch2.14), on the
# CPU: the post-grad graphs the passes read change between torch versions (decompositions,
# Inductor's joint-graph rewrites), so CI runs them on 2.13 (scripts/test.sh) and 2.14.
# Of the corpus, transformers' modules only (tests/corpus/test_transformers.py: HF Qwen3,
# Llama, Gemma-3 and the others; test_transformers_dsv4.py): the engines', references',
# zoo and padded-projection cases run on 2.13 alone, to keep CI near half an hour (the
# whole corpus on both torches took it past an hour).
#
# torch 2.14.1 is installed from the file the machine's package index holds. Its wheel is
# the CUDA build: `import torch` loads cuDNN, cuBLAS and the other CUDA libraries even on a
# CPU machine, so those wheels are installed too (--no-deps: torch's pins name
# cuda-bindings and triton 3.8, which the index does not hold; neither is needed here).
# Without triton the kernels' interpreter tests skip; the passes, the op references and the
# corpus run. Idempotent: a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=.venv-torch2.14
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.1')" >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps torch==2.14.1 cuda-toolkit==13.0.3 cuda-pathfinder \
        nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13==9.24.0.43 \
        nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13==0.8.1 \
        nvidia-nccl-cu13==2.30.7 nvidia-nvjitlink nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx
    "$py" -m pip install -q filelock "typing-extensions>=4.10" "setuptools>=77.0.3" "sympy>=1.13.3" \
        "networkx>=2.5.1" jinja2 "fsspec>=0.8.5"
fi
if ! "$py" -c "import prepfuse, pytest, xdist, expecttest, hypothesis, numpy, transformers" >/dev/null 2>&1; then
    "$py" -m pip install -q "pytest>=7" "pytest-xdist>=3" "expecttest>=0.2" "hypothesis>=6" numpy "transformers==5.17.0"
    "$py" -m pip install -q --no-deps -e .
fi
"$py" -c "import torch; print('torch', torch.__version__, '(second torch: the pass tests)')"
exec bash scripts/pytest_or_fail.sh "$py" -q -n "$(bash scripts/test_workers.sh)" -p no:cacheprovider tests/fx_passes \
    tests/corpus/test_transformers.py tests/corpus/test_transformers_dsv4.py tests/test_compat.py \
    tests/test_backend.py "$@"
