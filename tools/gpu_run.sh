#!/usr/bin/env bash
# Everything to run on a lent GPU machine, in one command from the repository root, with the machine's own python3
# (nothing installed):
#
#     bash tools/gpu_run.sh
#
# 1. the machine: nvidia-smi, python, torch, CUDA, cuDNN, NCCL, C compiler (torch.compile's Triton needs one);
# 2. the GPU tests: python3 -m pytest tests/test_gpu.py -m gpu -x -q;
# 3. a flower_photos-shaped folder of 3,670 JPEGs in /tmp (tools/make_flower_jpegs.py; drawn while the tests run);
# 4. tools/benchmark.py on the GPU at batch 16 (the README's setting), then, while time is left, at batch 64, and at
#    batch 256 in one process (--skip-ddp).
# Results go to $OUT (default /tmp/gpu_out), 7 files at most: summary.log (machine, every step's exit status),
# gpu_tests.log, bench.log (benchmark output and every benchmark run's log), benchmark_b16.json, benchmark_b64.json,
# benchmark_b256.json, benchmark_b16.png. A failing step is recorded and the next one still runs; the command ends
# with status 0 only if the tests and every benchmark that ran succeeded. Each step runs under `timeout`, from a
# budget of GPU_RUN_BUDGET seconds for the whole command (default 560: under 9.5 minutes).
set -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-/tmp/gpu_out}
BUDGET=${GPU_RUN_BUDGET:-560}
# For a dry run elsewhere: another interpreter, a smaller JPEG folder (e.g. PYTHON=.venv/bin/python
# GPU_RUN_DATA=/tmp/flowers_small GPU_RUN_JPEG_SCALE=0.01 bash tools/gpu_run.sh)
PY=${PYTHON:-python3}
DATA=${GPU_RUN_DATA:-/tmp/flower_photos_synthetic}
JPEG_SCALE=${GPU_RUN_JPEG_SCALE:-1}
SUMMARY=$OUT/summary.log
BENCH_LOG=$OUT/bench.log
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
: >"$SUMMARY"
: >"$BENCH_LOG"
failed=0

left() { echo $((BUDGET - SECONDS)); }
note() { echo "[gpu_run +${SECONDS}s] $*" | tee -a "$SUMMARY"; }

# 1. The machine
{
    date -u
    if command -v nvidia-smi >/dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    "$PY" - <<'EOF'
import sys

import torch
import torchvision

print("python", sys.version.split()[0], "| torch", torch.__version__, "| torchvision", torchvision.__version__)
print("CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version(), "| GPU visible:", torch.cuda.is_available())
if torch.cuda.is_available():
    nccl = torch.cuda.nccl.version()
    print("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i), "capability", torch.cuda.get_device_capability(i))
EOF
    echo "CPU cores: $(nproc); C compiler: $(command -v cc || command -v gcc || command -v clang || echo none)"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
} 2>&1 | tee -a "$SUMMARY"
if ! "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
    note "torch sees no CUDA GPU: the GPU tests will all skip and the benchmark cannot run"
    failed=1
fi

# 3 (started first, on the CPU, niced): the benchmark's JPEG folder, drawn while the tests run on the GPU
timeout 240 nice -n 10 "$PY" tools/make_flower_jpegs.py "$DATA" --scale "$JPEG_SCALE" >"$OUT/.jpegs.log" 2>&1 &
jpegs_pid=$!

# 2. The GPU tests (SIGINT on timeout: pytest then still prints what failed so far)
test_limit=$(($(left) - 200)) # what the benchmark at batch 16 needs is kept for it
[ "$test_limit" -ge 60 ] || test_limit=60
note "GPU tests: $PY -m pytest tests/test_gpu.py -m gpu -x -q (at most $test_limit s)"
timeout -s INT -k 30 "$test_limit" "$PY" -m pytest tests/test_gpu.py -m gpu -x -q --durations=0 2>&1 |
    tee "$OUT/gpu_tests.log"
tests_status=$?
note "GPU tests: exit status $tests_status$([ "$tests_status" = 124 ] && echo ' (timed out)')"
[ "$tests_status" = 0 ] || failed=1

wait "$jpegs_pid"
jpegs_status=$?
cat "$OUT/.jpegs.log" >>"$SUMMARY" && rm -f "$OUT/.jpegs.log"
note "JPEG folder $DATA: exit status $jpegs_status, $(find "$DATA" -name '*.jpg' 2>/dev/null | wc -l) JPEGs"

# 4. The benchmark. bench NAME SECONDS_NEEDED DIR_SUFFIX FLAGS...: runs if about SECONDS_NEEDED are left (else
# returns 1: without the batch-16 row, the others are skipped too), under a timeout of what is left; its benchmark.json
# comes back as benchmark_NAME.json, its output and run logs go into bench.log (progress bars left out but for their
# 100 % lines).
bench() {
    local name=$1 need=$2 dir=/tmp/bench_gpu$3
    shift 3
    local limit=$(($(left) - 10))
    if [ "$limit" -lt "$need" ]; then
        note "benchmark $name: skipped, $limit s left (needs about $need s)"
        return 1
    fi
    rm -rf "$dir"
    local command=("$PY" tools/benchmark.py --device cuda --data-path "$DATA" --output-dir "$dir" "$@")
    note "benchmark $name: ${command[*]} (at most $limit s)"
    echo "===== benchmark $name: ${command[*]}" >>"$BENCH_LOG"
    timeout -k 20 "$limit" "${command[@]}" 2>&1 | tee -a "$BENCH_LOG"
    local status=$?
    note "benchmark $name: exit status $status$([ "$status" = 124 ] && echo ' (timed out)')"
    [ "$status" = 0 ] || failed=1
    cp "$dir/benchmark.json" "$OUT/benchmark_$name.json" 2>/dev/null
    for log in "$dir"/logs/*.log; do
        [ -f "$log" ] || continue
        echo "----- $log"
        tr '\r' '\n' <"$log" | grep -Ev '(^|[^0-9])[0-9]{1,2}%\|'
    done >>"$BENCH_LOG"
    return 0
}

if [ "$jpegs_status" = 0 ]; then
    if bench b16 150 ""; then
        cp /tmp/bench_gpu/benchmark.png "$OUT/benchmark_b16.png" 2>/dev/null
        bench b64 120 _b64 --batch-size 64
        bench b256 75 _b256 --batch-size 256 --skip-ddp
    fi
else
    note "benchmark: skipped, no JPEG folder"
    failed=1
fi

note "done in ${SECONDS}s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$failed"
