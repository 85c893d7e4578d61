#!/usr/bin/env bash
# Everything to run on a lent GPU machine, in one command from the repository root, with the machine's own python3
# (nothing installed):
#
#     bash tools/gpu_run.sh
#
# The machine's commands are stopped at 10 minutes, so the figures wanted most come first, and each result reaches
# $OUT as soon as it exists:
# 1. the machine: nvidia-smi, python, torch, CUDA, cuDNN, NCCL, C compiler (torch.compile's Triton needs one), while
#    a flower_photos-shaped folder of 3,670 JPEGs is drawn in /tmp (tools/make_flower_jpegs.py, on all cores);
# 2. tools/benchmark.py on the GPU at batch 256, then at batch 64: the model-only rows and train_single_gpu.py end to
#    end (--rows model-only,auto: one process, no DDP, no demo);
# 3. tools/benchmark.py at batch 16 (the README's setting), every row; its DDP and demo rows come last and are
#    measured if time is left;
# 4. the GPU tests: python3 -m pytest tests/test_gpu.py -m gpu -n 0 -q, every test (no -x) in the time left, in one
#    process (with -n 0 tests/conftest.py pins no cores: the scripts the tests start get all of them).
# tools/benchmark.py rewrites its benchmark.json after every row. While a benchmark runs, that file is copied to $OUT
# every few seconds, and again when it ends or is timed out, so a stop at any moment leaves the finished rows in $OUT.
#
# Results go to $OUT (default /tmp/gpu_out), 7 files at most, in the order they appear: summary.log (the machine,
# every step and its exit status), bench.log (the benchmarks' output, and each benchmark's run logs once it ends),
# benchmark_b256.json, benchmark_b64.json, benchmark_b16.json, benchmark_b16.png (if that benchmark finished),
# gpu_tests.log. A failing step is recorded and the next one still runs; the command ends with status 0 only if
# every step succeeded. Each step runs under `timeout`, from a budget of GPU_RUN_BUDGET seconds for the whole command
# (default 560: under 9.5 minutes). GPU_RUN_TEST_RESERVE seconds of it (default 150) are kept for the tests: each
# benchmark but the last may take half of what is left before that reserve, the last all of it, the tests the rest.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-/tmp/gpu_out}
BUDGET=${GPU_RUN_BUDGET:-560}
TEST_RESERVE=${GPU_RUN_TEST_RESERVE:-150}
# For a dry run elsewhere: another interpreter, a smaller JPEG folder, other batch sizes (the last one gets the full
# benchmark), flags added to every benchmark (they come last, so they override), e.g.
#     PYTHON=.venv/bin/python GPU_RUN_DATA=/tmp/flowers_small GPU_RUN_JPEG_SCALE=0.01 GPU_RUN_BATCHES="16 8 4" \
#     GPU_RUN_BENCH_FLAGS="--device cpu --img-size 32 --epochs 2 --steps 2 --loader-images 16" bash tools/gpu_run.sh
PY=${PYTHON:-python3}
DATA=${GPU_RUN_DATA:-/tmp/flower_photos_synthetic}
JPEG_SCALE=${GPU_RUN_JPEG_SCALE:-1}
read -r -a BATCHES <<<"${GPU_RUN_BATCHES:-256 64 16}"
read -r -a BENCH_FLAGS <<<"${GPU_RUN_BENCH_FLAGS:-}"
SUMMARY=$OUT/summary.log
BENCH_LOG=$OUT/bench.log
export PYTHONUNBUFFERED=1
if [ "${#BATCHES[@]}" -lt 1 ] || [ "${#BATCHES[@]}" -gt 3 ]; then
    echo "GPU_RUN_BATCHES: 1 to 3 batch sizes (the device returns 8 files at most)" >&2
    exit 2
fi
mkdir -p "$OUT"
: >"$SUMMARY"
: >"$BENCH_LOG"
failed=0

left() { echo $((BUDGET - SECONDS)); }
note() { echo "[gpu_run +${SECONDS}s] $*" | tee -a "$SUMMARY"; }
ended() { # ended NAME STATUS: the step's exit status in summary.log; a failed step makes the command fail
    note "$1: exit status $2$([ "$2" = 124 ] && echo ' (timed out)')"
    [ "$2" = 0 ] || failed=1
}

# 1. The machine, while the benchmark's JPEG folder is drawn on the CPU
timeout 180 "$PY" tools/make_flower_jpegs.py "$DATA" --scale "$JPEG_SCALE" >"$OUT/.jpegs.log" 2>&1 &
jpegs_pid=$!
{
    date -u
    if command -v nvidia-smi >/dev/null; then timeout 30 nvidia-smi; else echo "nvidia-smi: not found"; fi
    timeout 60 "$PY" - <<'EOF'
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
else:
    sys.exit(3)
EOF
    gpu_status=$?
    echo "CPU cores: $(nproc); C compiler: $(command -v cc || command -v gcc || command -v clang || echo none)"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
    exit "$gpu_status"
} 2>&1 | tee -a "$SUMMARY"
gpu_status=$?
if [ "$gpu_status" = 3 ]; then
    note "torch sees no CUDA GPU: the GPU tests will all skip, and the benchmark runs only if GPU_RUN_BENCH_FLAGS has --device cpu"
    failed=1
else
    ended "machine" "$gpu_status"
fi

wait "$jpegs_pid"
jpegs_status=$?
cat "$OUT/.jpegs.log" >>"$SUMMARY" && rm -f "$OUT/.jpegs.log"
ended "JPEG folder $DATA, $(find "$DATA" -name '*.jpg' 2>/dev/null | wc -l) JPEGs" "$jpegs_status"

# 2 and 3. The benchmarks. bench NAME LIMIT FLAGS...: tools/benchmark.py under a timeout of LIMIT seconds (skipped
# below 45), its output into bench.log, its benchmark.json copied to $OUT/benchmark_NAME.json whenever it changes
# (every 3 s) and once more at the end, then its run logs into bench.log (progress bars left out but for their
# 100 % lines).
copy_new() { # copy_new FROM TO: FROM, if it exists and differs from TO, copied whole to TO (written beside it, renamed)
    [ -f "$1" ] && ! cmp -s "$1" "$2" && cp "$1" "$OUT/.copying" && mv -f "$OUT/.copying" "$2"
}
bench() {
    local name=$1 limit=$2 dir=/tmp/bench_gpu_$1
    shift 2
    if [ "$limit" -lt 45 ]; then
        note "benchmark $name: skipped, $limit s for it"
        return
    fi
    rm -rf "$dir" "$dir.ended"
    local command=("$PY" tools/benchmark.py --device cuda --data-path "$DATA" --output-dir "$dir")
    command+=("$@" "${BENCH_FLAGS[@]}")
    note "benchmark $name: ${command[*]} (at most $limit s)"
    echo "===== benchmark $name: ${command[*]}" >>"$BENCH_LOG"
    while [ ! -e "$dir.ended" ]; do # the rows finished so far, in $OUT while the benchmark runs
        copy_new "$dir/benchmark.json" "$OUT/benchmark_$name.json"
        sleep 3
    done &
    local copier=$!
    timeout -k 10 "$limit" "${command[@]}" 2>&1 | tee -a "$BENCH_LOG"
    local status=$?
    touch "$dir.ended"
    wait "$copier"
    rm -f "$dir.ended"
    rm -f "$dir.ended"
    copy_new "$dir/benchmark.json" "$OUT/benchmark_$name.json"
    local rows complete
    rows=$(grep -s -c '"kind"' "$OUT/benchmark_$name.json")
    complete=$(grep -s -q '"complete": true' "$OUT/benchmark_$name.json" && echo "complete" || echo "not complete")
    ended "benchmark $name (benchmark_$name.json: rows ${rows:-0}, $complete)" "$status"
    for log in "$dir"/logs/*.log; do
        [ -f "$log" ] || continue
        echo "----- $log"
        tr '\r' '\n' <"$log" | grep -Ev '(^|[^0-9])[0-9]{1,2}%\|'
    done >>"$BENCH_LOG"
}

if [ "$jpegs_status" = 0 ]; then
    last=$((${#BATCHES[@]} - 1))
    for i in "${!BATCHES[@]}"; do
        # what is left before the tests, less what a timed-out benchmark takes to stop and be copied (15 s) and what
        # the tests' own timeout adds (20 s)
        before_tests=$(($(left) - TEST_RESERVE - 35))
        if [ "$i" -lt "$last" ]; then
            bench "b${BATCHES[$i]}" $((before_tests / 2)) --batch-size "${BATCHES[$i]}" --rows model-only,auto
        else
            bench "b${BATCHES[$i]}" "$before_tests" --batch-size "${BATCHES[$i]}"
            cp "/tmp/bench_gpu_b${BATCHES[$i]}/benchmark.png" "$OUT/benchmark_b${BATCHES[$i]}.png" 2>/dev/null
        fi
    done
else
    note "benchmark: skipped, no JPEG folder"
fi

# 4. The GPU tests, all of them, in what is left (SIGINT on timeout: pytest then still reports every test it ran)
test_limit=$(($(left) - 20)) # 20: the timeout's grace to stop, and the last lines
if [ "$test_limit" -lt 30 ]; then
    note "GPU tests: skipped, $test_limit s left"
    failed=1
else
    note "GPU tests: $PY -m pytest tests/test_gpu.py -m gpu -n 0 -q (at most $test_limit s)"
    timeout -s INT -k 15 "$test_limit" "$PY" -m pytest tests/test_gpu.py -m gpu -n 0 -q --durations=0 2>&1 |
        tee "$OUT/gpu_tests.log"
    ended "GPU tests" "$?"
fi

rm -f "$OUT/.copying"
note "done in ${SECONDS}s; files in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
exit "$failed"
