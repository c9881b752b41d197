#!/usr/bin/env bash
# The GPU runs as named steps, run in the order given (default: env tests sanitize bench), from
# a checkout on a CUDA machine: bash bench/gpu_steps.sh tests sanitize bench
# Each step's summary goes to $OUT/steps.log and its files into $OUT (default /tmp/prepfuse_out);
# bench/README.md says what each script measures.
#   env                     GPU, driver, torch and triton versions
#   vllm                    whether vLLM's op library and indexer kernels load (the vLLM columns of the
#                           benchmark pages), and the parity tests against them
#                           (tests/ops/test_vllm_parity.py, tests/ops/test_vllm_indexer_parity.py)
#   tests                   the GPU-marked tests on PREPFUSE_GPU_TEST_WORKERS (8) xdist workers, but
#                           the vLLM parity tests (the vllm step runs them alone: at T=16384, H=128
#                           they need more GPU memory than 8 workers leave, and each worker would
#                           compile vLLM's indexer kernels again);
#                           PREPFUSE_TEST_MARK="" runs every test, PREPFUSE_TEST_PATHS picks files
#   sanitize                compute-sanitizer memcheck and racecheck over bench/sanitize_*.py
#                           (PREPFUSE_SANITIZE_SCRIPTS names fewer)
#   sweep smoke bench       the DeepSeek-V4 op: launch sweep, a short run, docs/benchmarks.md's run
#   e2e                     one layer's prep, backend="prepfuse" against torch.compile's default
#   gqa gqa-operands gqa-head-dims gqa-sweep
#                           the GQA op: its three pages' runs and its launch sweep
#                           (PREPFUSE_GQA_SWEEP_ARGS replaces the sweep's shapes and configurations)
#   indexer indexer-sweep   the DeepSeek-V4 indexer ops: the page's run and the launch sweep
#   clients                 transformers' attention modules run engine-style; PREPFUSE_CLIENT_CASES=a,b
#                           limits the cases, PREPFUSE_CLIENT_SUFFIX names such a partial run's JSON
#   dupes                   duplicated slots: torn rows, and what the scan and the row locks cost
#                           (PREPFUSE_DUPES_ARGS, its arguments)
#   micro                   two micro-batches on two streams against serial
#   compile                 the passes' compile time
#   demo                    python -m prepfuse.demo
# PREPFUSE_SWEEP_ARGS passes arguments to the sweep and indexer-sweep steps. Wheels in .whl/
# are installed first without an index (a machine with no package index: bench/README.md).
# vLLM's op library, carried as .vllm/vllm_ops_sm90.so.xz (or named by $PREPFUSE_VLLM_LIB), is
# unpacked first, once, so that test workers and benchmarks all find it (bench/vllm_ops.py); so
# are the parts of vLLM's indexer kernels carried in .vllm/cutedsl/ (bench/vllm_indexer.py).
set -uo pipefail
OUT=${OUT:-/tmp/prepfuse_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c 'import sys; sys.path.insert(0, "bench"); import vllm_ops; f = vllm_ops.library_file(); f and vllm_ops.unpacked(f)' \
    || echo "vLLM's op library could not be unpacked" >&2
python3 -c 'import sys; sys.path.insert(0, "bench"); import vllm_indexer; vllm_indexer.unpack()' \
    || echo "vLLM's indexer kernels could not be unpacked" >&2
log="$OUT/steps.log"
status=0
step() { echo "=== $1 ($(date +%T))" | tee -a "$log"; }
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(env tests sanitize bench)
for what in "${steps[@]}"; do
    case "$what" in
    env)
        step env
        nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>&1 | tee -a "$log"
        python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" 2>&1 | tee -a "$log"
        ;;
    vllm)
        step vllm
        python3 -c 'import sys; sys.path.insert(0, "bench"); import vllm_ops, vllm_indexer; ops = vllm_ops.load()
print("vLLM ops:", ops.path if ops else vllm_ops.absent_reason())
kernels = vllm_indexer.load()
print("vLLM indexer kernels:", kernels.site if kernels else vllm_indexer.absent_reason())' 2>&1 | tee -a "$log"
        python3 -m pytest -q -rfEs -p no:cacheprovider -m gpu tests/ops/test_vllm_parity.py \
            tests/ops/test_vllm_indexer_parity.py >"$OUT/vllm_parity.log" 2>&1 || status=1
        grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/vllm_parity.log" | tail -n 40 | tee -a "$log"
        ;;
    tests)
        step tests
        # the whole log is $OUT/tests.log; steps.log gets the failures' names and the summary
        # shellcheck disable=SC2086
        python3 -m pytest -q -rfEs -p no:cacheprovider -n "${PREPFUSE_GPU_TEST_WORKERS:-8}" \
            ${PREPFUSE_TEST_MARK--m gpu} ${PREPFUSE_TEST_PATHS:-tests --ignore=tests/ops/test_vllm_parity.py --ignore=tests/ops/test_vllm_indexer_parity.py} \
            >"$OUT/tests.log" 2>&1 || status=1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/tests.log" | tail -n 40 | tee -a "$log"
        ;;
    sanitize)
        for tool in memcheck racecheck; do
            step "sanitize $tool"
            for script in ${PREPFUSE_SANITIZE_SCRIPTS:-bench/sanitize_*.py}; do
                compute-sanitizer --tool "$tool" --error-exitcode 3 python3 "$script" 2>&1 \
                    | tail -n 15 | tee -a "$log" || status=1
            done
        done
        ;;
    sweep)
        step sweep
        python3 bench/bench_dsv4_qnorm_rope_kv_insert.py --sweep-config ${PREPFUSE_SWEEP_ARGS:-} --out-dir "$OUT" 2>&1 | tail -n 40 | tee -a "$log" || status=1
        ;;
    smoke)
        step smoke
        python3 bench/bench_dsv4_qnorm_rope_kv_insert.py --tokens 1,512,16384 --heads 64 --block-sizes 64 \
            --no-docs --name-suffix _smoke --out-dir "$OUT" 2>&1 | tail -n 30 | tee -a "$log" || status=1
        ;;
    bench)
        step bench
        python3 bench/bench_dsv4_qnorm_rope_kv_insert.py --out-dir "$OUT" 2>&1 | tail -n 60 | tee -a "$log" || status=1
        ;;
    e2e)
        step e2e
        python3 bench/bench_dsv4_prep_e2e.py --out-dir "$OUT" --docs "$OUT/benchmarks_e2e.md" 2>&1 | tail -n 20 | tee -a "$log" || status=1
        ;;
    gqa)
        step gqa
        python3 bench/bench_gqa_qknorm_rope_kv_insert.py --out-dir "$OUT" --docs "$OUT/benchmarks_gqa.md" 2>&1 | tail -n 40 | tee -a "$log" || status=1
        ;;
    gqa-operands)
        step gqa-operands
        python3 bench/bench_gqa_qknorm_rope_kv_insert.py --models "$(python3 -c 'import sys; sys.path.insert(0, "bench"); import bench_gqa_qknorm_rope_kv_insert as b; print(",".join(b.OPERAND_MODELS))')" \
            --name-suffix _operands --out-dir "$OUT" --docs "$OUT/benchmarks_gqa_operands.md" 2>&1 | tail -n 40 | tee -a "$log" || status=1
        ;;
    gqa-head-dims)
        step gqa-head-dims
        python3 bench/bench_gqa_qknorm_rope_kv_insert.py --models llama3.2-1b,llama3.2-1b-fp8,gemma3-12b,gemma3-12b-fp8 \
            --name-suffix _head_dims --out-dir "$OUT" --docs "$OUT/benchmarks_gqa_head_dims.md" 2>&1 | tail -n 30 | tee -a "$log" || status=1
        ;;
    gqa-sweep)
        step gqa-sweep
        python3 bench/bench_gqa_qknorm_rope_kv_insert.py --sweep-config ${PREPFUSE_GQA_SWEEP_ARGS:---tokens 1,64,4096,16384 --models qwen3-8b,qwen3-8b-fp8} --out-dir "$OUT" 2>&1 | tail -n 20 | tee -a "$log" || status=1
        ;;
    indexer)
        step indexer
        python3 bench/bench_dsv4_indexer_rope_quant_insert.py --out-dir "$OUT" --docs "$OUT/benchmarks_indexer.md" 2>&1 | tail -n 40 | tee -a "$log" || status=1
        ;;
    indexer-sweep)
        step indexer-sweep
        python3 bench/tools/sweep_dsv4_indexer_launch.py --out-dir "$OUT" ${PREPFUSE_SWEEP_ARGS:-} 2>&1 | tail -n 20 | tee -a "$log" || status=1
        ;;
    clients)
        step clients
        python3 bench/bench_clients.py --out-dir "$OUT" --docs "$OUT/benchmarks_clients.md" \
            ${PREPFUSE_CLIENT_CASES:+--cases "$PREPFUSE_CLIENT_CASES"} ${PREPFUSE_CLIENT_SUFFIX:+--name-suffix "$PREPFUSE_CLIENT_SUFFIX"} 2>&1 | tail -n 30 | tee -a "$log" || status=1
        ;;
    dupes)
        step dupes
        python3 bench/duplicate_slots.py --out-dir "$OUT" --docs "$OUT/benchmarks_duplicate_slots.md" ${PREPFUSE_DUPES_ARGS:-} 2>&1 | tail -n 80 | tee -a "$log" || status=1
        ;;
    micro)
        step micro
        python3 bench/bench_micro_batches.py --out-dir "$OUT" 2>&1 | tail -n 12 | tee -a "$log" || status=1
        ;;
    compile)
        step compile
        python3 bench/compile_overhead.py --repeats 2 2>&1 | tail -n 12 | tee -a "$log" || status=1
        ;;
    demo)
        step demo
        python3 -m prepfuse.demo 2>&1 | tail -n 40 | tee -a "$log" || status=1
        ;;
    *)
        echo "unknown step $what" | tee -a "$log"; status=2
        ;;
    esac
done
exit $status
