#!/usr/bin/env bash
# Everything to run on a lent GPU machine, in one command from the repository root, with the machine's own python3
# (nothing installed):
#
#     bash tools/gpu_run.sh
#
# The machine's commands are stopped at 10 minutes. So what would go wrong silently is checked first, the speed is
# measured next, the other GPU tests run in the time left, and each result reaches $OUT as soon as it exists:
# 1. the machine: nvidia-smi, python, torch, CUDA, cuDNN, NCCL, C compiler (torch.compile's Triton needs one). From
#    here on, a flower_photos-shaped folder of 3,670 JPEGs for the benchmarks is drawn in /tmp in the background
#    (tools/make_flower_jpegs.py, on all cores, at low priority), while steps 1 and 2 run;
# 2. the first tests, into gpu_tests_first.log: tests/test_host_syncs.py's GPU test (no more host synchronisations
#    in 4 training steps or validation batches than in 2, as torch.cuda.set_sync_debug_mode("warn") reports them,
#    in every precision), then tests/test_gpu.py's first group,
#    -k TestWhatBreaksSilently (every launch mode on nccl or gloo over CUDA, learning above chance and logging
#    alike; --model-ema; a DDP checkpoint resumed in one process; with two GPUs, two ranks on nccl and cuda:1);
# 3. tools/benchmark.py on the GPU at batch 256 (--rows model-only,auto: the model-only rows and train_single_gpu.py
#    end to end), then at batch 16, the README's setting, every row that fits in the time (its DDP and demo rows
#    come last);
# 4. the rest of tests/test_gpu.py, -k "not TestWhatBreaksSilently", into gpu_tests_rest.log (torch.compile's
#    test, the slowest, last).
# The tests run with -n 0, in one process, which tests/conftest.py does not pin to a share of the cores: the scripts
# they start get all of them. tools/benchmark.py rewrites its benchmark.json after every row; while a benchmark runs,
# that file is copied to $OUT every few seconds, and again when it ends or is timed out, so a stop at any moment
# leaves the finished rows in $OUT.
#
# Results go to $OUT (default /tmp/gpu_out), 7 files at most, in the order they appear: summary.log (the machine,
# every step with its time, exit status and, for tests, pytest's last line), gpu_tests_first.log, bench.log (the
# benchmarks' output, and each benchmark's run logs once it ends), benchmark_b256.json, benchmark_b16.json,
# benchmark_b16.png (if that benchmark finished), gpu_tests_rest.log. A step that fails is recorded and the next
# one still runs; the command ends with status 0 only if every step succeeded. Each step runs under `timeout`, from
# a budget of GPU_RUN_BUDGET seconds for the whole command (default 560: under 9.5 minutes): the host-sync test
# GPU_RUN_SYNC_LIMIT seconds at most (default 60), the first group GPU_RUN_FIRST_LIMIT (default 210);
# GPU_RUN_REST_RESERVE seconds (default 120) are kept for the rest of the tests, which get whatever is left; the
# benchmarks get what lies between: the first half of it, the last all that remains.
set -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-/tmp/gpu_out}
BUDGET=${GPU_RUN_BUDGET:-560}
SYNC_LIMIT=${GPU_RUN_SYNC_LIMIT:-60}
FIRST_LIMIT=${GPU_RUN_FIRST_LIMIT:-210}
REST_RESERVE=${GPU_RUN_REST_RESERVE:-120}
FIRST_GROUP=TestWhatBreaksSilently # the class of tests/test_gpu.py that runs first
# For a dry run elsewhere: another interpreter, a smaller JPEG folder, other batch sizes (the last one gets the full
# benchmark), flags added to every benchmark (they come last, so they override): see docs/performance.md.
PY=${PYTHON:-python3}
DATA=${GPU_RUN_DATA:-/tmp/flower_photos_synthetic}
JPEG_SCALE=${GPU_RUN_JPEG_SCALE:-1}
read -r -a BATCHES <<<"${GPU_RUN_BATCHES:-256 16}"
read -r -a BENCH_FLAGS <<<"${GPU_RUN_BENCH_FLAGS:-}"
SUMMARY=$OUT/summary.log
BENCH_LOG=$OUT/bench.log
export PYTHONUNBUFFERED=1
if [ "${#BATCHES[@]}" -lt 1 ] || [ "${#BATCHES[@]}" -gt 2 ]; then
    echo "GPU_RUN_BATCHES: 1 or 2 batch sizes (the device returns 8 files at most)" >&2
    exit 2
fi
mkdir -p "$OUT"
: >"$SUMMARY"
failed=0

left() { echo $((BUDGET - SECONDS)); }
at_most() { echo $(($1 < $2 ? $1 : $2)); } # at_most A B: the smaller
note() { echo "[gpu_run +${SECONDS}s] $*" | tee -a "$SUMMARY"; }
ended() { # ended NAME STATUS [STARTED]: the step's exit status (and seconds since STARTED) in summary.log; a
    # failed step makes the command fail
    local why=""
    case $2 in
    124 | 137) why=" (timed out)" ;;
    5) why=" (no test selected)" ;; # pytest's status when nothing was collected: a wrong -k, say
    esac
    note "$1: exit status $2$why${3:+, $((SECONDS - $3)) s}"
    [ "$2" = 0 ] || failed=1
}

# 1. The machine; the benchmark's JPEG folder is drawn meanwhile, and while the first tests run
jpegs_log=$(mktemp)
nice -n 10 timeout 300 "$PY" tools/make_flower_jpegs.py "$DATA" --scale "$JPEG_SCALE" >"$jpegs_log" 2>&1 &
jpegs_pid=$!
step_started=$SECONDS
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
    ended "machine" "$gpu_status" "$step_started"
fi

# 2 and 4. The tests. run_tests NAME LIMIT LOG PYTEST_ARGS...: python -m pytest PYTEST_ARGS -n 0 -q under a timeout
# of LIMIT seconds (SIGINT first: pytest then still reports every test it ran), its output added to $OUT/LOG as it
# comes, its last line and exit status in summary.log.
run_tests() {
    local name=$1 limit=$2 log=$OUT/$3 started=$SECONDS
    shift 3
    if [ "$limit" -lt 30 ]; then
        note "$name: skipped, $limit s for it" | tee -a "$log"
        failed=1
        return
    fi
    local command=("$PY" -m pytest "$@" -n 0 -q --durations=0)
    note "$name: ${command[*]} (at most $limit s)"
    echo "===== $name: ${command[*]}" >>"$log"
    local before # the log's lines before this step's
    before=$(wc -l <"$log")
    timeout -s INT -k 15 "$limit" "${command[@]}" 2>&1 | tee -a "$log"
    local status=$?
    local outcome # pytest's last line: its counts of passed, failed, skipped tests and its time
    outcome=$(tail -n +$((before + 1)) "$log" |
        grep -E '(passed|failed|skipped|error|deselected|no tests ran).* in [0-9.]+s' | tail -n 1)
    ended "$name (${outcome:-no outcome})" "$status" "$started"
}

FIRST_LOG=gpu_tests_first.log
: >"$OUT/$FIRST_LOG"
if [ -f tests/test_host_syncs.py ]; then
    run_tests "host-sync test" "$(at_most "$SYNC_LIMIT" $(($(left) - 20)))" "$FIRST_LOG" tests/test_host_syncs.py -m gpu
else
    note "host-sync test: tests/test_host_syncs.py not found, not run" | tee -a "$OUT/$FIRST_LOG"
    failed=1
fi
run_tests "GPU tests, first group" "$(at_most "$FIRST_LIMIT" $(($(left) - 20)))" "$FIRST_LOG" \
    tests/test_gpu.py -m gpu -k "$FIRST_GROUP"

# The JPEG folder, drawn since step 1
wait "$jpegs_pid"
jpegs_status=$?
cat "$jpegs_log" >>"$SUMMARY" && rm -f "$jpegs_log"
ended "JPEG folder $DATA, $(find "$DATA" -name '*.jpg' 2>/dev/null | wc -l) JPEGs" "$jpegs_status" # its time: above

# 3. The benchmarks. bench NAME LIMIT FLAGS...: tools/benchmark.py under a timeout of LIMIT seconds (skipped below
# 45), its output into bench.log, its benchmark.json copied to $OUT/benchmark_NAME.json whenever it changes (every
# 3 s) and once more at the end, then its run logs into bench.log (progress bars left out but for their 100 % lines).
copy_new() { # copy_new FROM TO: FROM, if it exists and differs from TO, copied whole to TO (written beside it, renamed)
    [ -f "$1" ] && ! cmp -s "$1" "$2" && cp "$1" "$OUT/.copying" && mv -f "$OUT/.copying" "$2"
}
bench() {
    local name=$1 limit=$2 dir=/tmp/bench_gpu_$1 started=$SECONDS
    shift 2
    rm -rf "$dir" "$dir.ended" # an earlier run's, whose benchmark.png must not pass for this one's
    if [ "$limit" -lt 45 ]; then
        note "benchmark $name: skipped, $limit s for it"
        failed=1
        return
    fi
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
    copy_new "$dir/benchmark.json" "$OUT/benchmark_$name.json"
    local rows complete
    rows=$(grep -s -c '"kind"' "$OUT/benchmark_$name.json")
    complete=$(grep -s -q '"complete": true' "$OUT/benchmark_$name.json" && echo "complete" || echo "not complete")
    ended "benchmark $name (benchmark_$name.json: rows ${rows:-0}, $complete)" "$status" "$started"
    for log in "$dir"/logs/*.log; do
        [ -f "$log" ] || continue
        echo "----- $log"
        tr '\r' '\n' <"$log" | grep -Ev '(^|[^0-9])[0-9]{1,2}%\|'
    done >>"$BENCH_LOG"
}

: >"$BENCH_LOG"
if [ "$jpegs_status" = 0 ]; then
    last=$((${#BATCHES[@]} - 1))
    for i in "${!BATCHES[@]}"; do
        # what is left before the rest of the tests, less what a timed-out benchmark takes to stop and be copied
        # (15 s) and what the tests' own timeout adds (20 s)
        before_rest=$(($(left) - REST_RESERVE - 35))
        if [ "$i" -lt "$last" ]; then
            bench "b${BATCHES[$i]}" $((before_rest / 2)) --batch-size "${BATCHES[$i]}" --rows model-only,auto
        else
            bench "b${BATCHES[$i]}" "$before_rest" --batch-size "${BATCHES[$i]}"
            cp "/tmp/bench_gpu_b${BATCHES[$i]}/benchmark.png" "$OUT/benchmark_b${BATCHES[$i]}.png" 2>/dev/null
        fi
    done
else
    note "benchmark: skipped, no JPEG folder"
fi

# 4. The rest of the GPU tests, in what is left (20 s: the timeout's grace to stop, and the last lines)
REST_LOG=gpu_tests_rest.log
: >"$OUT/$REST_LOG"
run_tests "GPU tests, the rest" $(($(left) - 20)) "$REST_LOG" tests/test_gpu.py -m gpu -k "not $FIRST_GROUP"

rm -f "$OUT/.copying"
note "done in ${SECONDS}s; files in $OUT: $(cd "$OUT" && printf '%s ' *)"
exit "$failed"
