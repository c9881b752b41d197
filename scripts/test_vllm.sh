#!/usr/bin/env bash
# prepfuse's pass inside vLLM's own pass manager (tests/integrations), with the real vLLM
# 0.33.0, on the CPU, in a venv of its own: $PREPFUSE_VLLM_VENV, default .venv-vllm.
#
# vLLM pins torch 2.14.0; its wheel is the CUDA build, so the CUDA libraries `import torch`
# loads are installed beside it (--no-deps: torch's pins name cuda-bindings, which the
# index does not hold). vLLM itself comes --no-deps, then its Requires-Dist read
# from the installed metadata (no extras) less the GPU kernel packages, which have no use
# and often no wheel here: vLLM's compilation passes, configs and pass manager import
# without them (pip then lists them as unmet requirements of vllm: expected). Idempotent:
# a second run installs nothing new.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PREPFUSE_VLLM_VENV:-.venv-vllm}
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
py="$venv/bin/python"
if ! "$py" -c "import torch, vllm, sys; sys.exit(torch.__version__.split('+')[0] != '2.14.0' or vllm.__version__ != '0.33.0')" \
        >/dev/null 2>&1; then
    "$py" -m pip install -q --no-deps torch==2.14.0 cuda-toolkit==13.0.3 cuda-pathfinder \
        nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13==9.24.0.43 \
        nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13==0.8.1 \
        nvidia-nccl-cu13==2.30.7 nvidia-nvjitlink nvidia-nvshmem-cu13==3.4.5 nvidia-nvtx vllm==0.33.0
    "$py" -m pip install -q filelock "typing-extensions>=4.10" "setuptools>=77.0.3,<81" "sympy>=1.13.3" \
        "networkx>=2.5.1" jinja2 "fsspec>=0.8.5"
fi
if ! "$py" -c "import vllm.config, vllm.compilation.passes.pass_manager" >/dev/null 2>&1; then
    req=$(mktemp)
    trap 'rm -f "$req"' EXIT
    # vLLM's requirements without extras, less torch's own family and the GPU kernel packages
    "$py" - "$req" <<'PY'
import importlib.metadata, re, sys
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "tilelang", "nvidia-cudnn-frontend",
        "nvtx", "fastsafetensors", "instanttensor", "nvidia-cutlass-dsl", "quack-kernels", "tokenspeed-mla",
        "humming-kernels", "numba", "transformers"}
with open(sys.argv[1], "w") as out:
    for req in importlib.metadata.requires("vllm"):
        name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-").replace(".", "-")
        if "extra ==" not in req and name not in skip and not name.startswith("flashinfer"):
            out.write(req + "\n")
PY
    "$py" -m pip install -q -r "$req" "transformers==5.17.0" "setuptools<81"
fi
if ! "$py" -c "import prepfuse, pytest, xdist, expecttest, hypothesis, numpy" >/dev/null 2>&1; then
    "$py" -m pip install -q "pytest>=7" "pytest-xdist>=3" "expecttest>=0.2" "hypothesis>=6" numpy
    "$py" -m pip install -q --no-deps -e .
fi
"$py" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, '(prepfuse inside vLLM)')"
# the CPU platform: no CUDA device here, and vLLM's config needs a platform to build on
export VLLM_TARGET_DEVICE=cpu
exec bash scripts/pytest_or_fail.sh "$py" -q -p no:cacheprovider tests/integrations "$@"
