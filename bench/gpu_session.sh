#!/usr/bin/env bash
# Everything one device-tool call does on the GPU machine, in order, logging under $OUT:
#   env  - GPU, driver, torch and triton versions
#   tests - the GPU-marked tests on CUDA, on PREPFUSE_GPU_TEST_WORKERS (8) xdist workers (632 in 4 min on
#           an H200; the whole suite in one process did not finish in a 10-minute call: the CPU tests are CI's);
#           PREPFUSE_TEST_MARK="" runs every test, PREPFUSE_TEST_PATHS picks files
#   sanitize - compute-sanitizer memcheck and racecheck on small shapes of each op (bench/sanitize_*.py;
#           PREPFUSE_SANITIZE_SCRIPTS names fewer, e.g. the changed op's and bench/sanitize_duplicate_slots.py)
#   sweep - the launch-configuration sweep of the fused kernel
#   bench - the benchmark (JSON, PNG, benchmarks.md into $OUT)
#   e2e   - one layer's prep as model code: backend=prepfuse vs torch.compile default
#   gqa   - the GQA op's benchmark, head dim 128 models (JSON, PNG, benchmarks_gqa.md into $OUT; ~200 s)
#   gqa-operands - the operands real code needs (int32 and wrapped indices, one kv head, partial rotary, v_scale,
#           uint8 caches), each beside the row it extends (..._operands.json, benchmarks_gqa_operands.md)
#   gqa-head-dims - the same for the other head dims, 64 and 256 (..._head_dims.json, benchmarks_gqa_head_dims.md; ~120 s)
#   gqa-sweep - the GQA kernel's launch-configuration sweep (PREPFUSE_GQA_SWEEP_ARGS replaces its shapes and configs)
#   indexer - the DeepSeek-V4 indexer ops' benchmark (JSON, PNG, benchmarks_indexer.md into $OUT)
#   indexer-sweep - the indexer kernel's launch-configuration sweep
#   clients - the corpus (transformers' attention modules, engines' spellings), backend=prepfuse vs
#             inductor (benchmarks_clients.md into $OUT); PREPFUSE_CLIENT_CASES=a,b limits the cases
#             and PREPFUSE_CLIENT_SUFFIX names the JSON of such a partial run
#             (all 14 fused cases at T = 1, 64, 4096 take longer than one 10-minute call)
#   dupes - duplicated slots: torn rows with no dedupe, the scan and the row locks, and what each
#           costs (bench/duplicate_slots.py; JSON and benchmarks_duplicate_slots.md into $OUT)
#   micro - two micro-batches on two streams, each with its own scratch lane: overlap vs serial (JSON into $OUT)
#   compile - the passes' compile-time cost, validation on and off (bench/compile_overhead.py)
#   demo  - the README's main command's python part
# Usage (from a checkout, on the GPU machine): bash bench/gpu_session.sh tests sanitize bench
# No pip there: pure-python wheels carried in .whl/ are unpacked to /tmp/site.
set -uo pipefail
OUT=${OUT:-/tmp/prepfuse_out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
log="$OUT/session.log"
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
    tests)
        step tests
        # the whole log stays under $OUT; the reply shows the failures' names and the summary
        # shellcheck disable=SC2086
        python3 -m pytest -q -rfEs -p no:cacheprovider -n "${PREPFUSE_GPU_TEST_WORKERS:-8}" \
            ${PREPFUSE_TEST_MARK--m gpu} ${PREPFUSE_TEST_PATHS:-tests} >"$OUT/tests.log" 2>&1 || status=1
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
