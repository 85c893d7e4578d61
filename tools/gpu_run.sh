#!/usr/bin/env bash
# What a lent GPU machine runs with its own python3: the steps given, each one argument ("tests NAME LIMIT PYTEST_ARGS";
# "bench NAME LIMIT FLAGS", into $OUT/benchmark_NAME.json and profile_NAME.json.gz; "run NAME LIMIT SCRIPT FLAGS"),
# or DEFAULT_STEPS. docs/gpu-runs.md, "The runner".
set -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-/tmp/gpu_out}
BUDGET=${GPU_RUN_BUDGET:-560}
PY=${PYTHON:-python3}
DATA=${GPU_RUN_DATA:-/tmp/flower_photos_synthetic}
JPEG_SCALE=${GPU_RUN_JPEG_SCALE:-1}
DEVICE=${GPU_RUN_DEVICE:-cuda}
SUMMARY=$OUT/summary.log
export PYTHONUNBUFFERED=1
# The first of the next session's two commands (docs/gpu-runs.md, "The next GPU session"), with GPU_RUN_BUDGET=330
DEFAULT_STEPS=(
    "tests device 100 tests/test_host_syncs.py tests/test_gpu.py -m gpu -k 'host_sync or made_on_the_gpu or streamed_to'"
    "run e30 60 train_single_gpu.py --epochs 30 --batch-size 256 --amp bf16 --channels-last --workers 0 --batches device"
    "bench b256 170 --batch-size 256 --rows model-only,paths,profile,auto --profile-steps 11"
)
[ $# -gt 0 ] || set -- "${DEFAULT_STEPS[@]}"
mkdir -p "$OUT"
for file in "$SUMMARY" "$OUT/tests.log" "$OUT/bench.log"; do : >"$file"; done
failed=0

note() { echo "[gpu_run +${SECONDS}s] $*" | tee -a "$SUMMARY"; }
ended() { # NAME STATUS STARTED: into summary.log; a failure fails the command
    local why=""
    case $2 in
    124 | 137) why=" (timed out)" ;;
    5) why=" (no test selected)" ;; # pytest's, when nothing was collected: a wrong -k, say
    esac
    note "$1: exit status $2$why, $((SECONDS - $3)) s"
    [ "$2" = 0 ] || failed=1
}
limit_of() { # LIMIT, or what is left of the budget less 15 s, whichever is less
    local left=$((BUDGET - SECONDS - 15)); echo $(($1 < left ? $1 : left))
}
copy_new() { # FROM TO: FROM, if it exists and differs from TO, copied whole (written beside, renamed)
    [ -f "$1" ] && ! cmp -s "$1" "$2" && cp "$1" "$OUT/.copying" && mv -f "$OUT/.copying" "$2"
}
run_logs() { # LOGS...: into bench.log, progress bars left out but for their 100 % lines
    for log in "$@"; do
        [ -f "$log" ] || continue
        echo "----- $log"
        tr '\r' '\n' <"$log" | grep -Ev '(^|[^0-9])[0-9]{1,2}%\|'
    done >>"$OUT/bench.log"
}

# The machine; the JPEG folder is drawn meanwhile
jpegs_log=$(mktemp)
nice -n 10 timeout 300 "$PY" -m dataset.demo "$DATA" "$JPEG_SCALE" >"$jpegs_log" 2>&1 &
jpegs_pid=$! jpegs_status=
{
    date -u
    if command -v nvidia-smi >/dev/null; then timeout 30 nvidia-smi; else echo "nvidia-smi: not found"; fi
    timeout 60 "$PY" - <<'EOF'
import sys, torch, torchvision
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torchvision", torchvision.__version__)
print("CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version(), "| GPU visible:", torch.cuda.is_available())
if torch.cuda.is_available():
    nccl = torch.cuda.nccl.version()
    print("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    for i in range(torch.cuda.device_count()):
        print(f"cuda:{i}", torch.cuda.get_device_name(i), "capability", torch.cuda.get_device_capability(i))
EOF
    echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2) x $(nproc); C compiler: $(command -v cc || command -v gcc || echo none)"
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}; steps: $*"
} 2>&1 | tee -a "$SUMMARY"

jpeg_folder() { # waits, once, for the JPEG folder drawn since the start; fails if it could not be drawn
    if [ -z "$jpegs_status" ]; then
        wait "$jpegs_pid"
        jpegs_status=$?
        cat "$jpegs_log" >>"$SUMMARY" && rm -f "$jpegs_log"
        note "JPEG folder $DATA: $(find "$DATA" -name '*.jpg' 2>/dev/null | wc -l) JPEGs, exit status $jpegs_status"
    fi
    [ "$jpegs_status" = 0 ]
}

tests_step() {
    local name=$1 limit=$2 started=$SECONDS log=$OUT/tests.log
    shift 2
    local command=("$PY" -m pytest "$@" -n 0 -q --durations=0)
    note "tests $name: ${command[*]} (at most $limit s)"
    echo "===== $name: ${command[*]}" >>"$log"
    local before=$(wc -l <"$log")
    timeout -s INT -k 15 "$limit" "${command[@]}" 2>&1 | tee -a "$log"
    local status=$? outcome # outcome: pytest's last line
    outcome=$(tail -n +$((before + 1)) "$log" |
        grep -E '(passed|failed|skipped|error|deselected|no tests ran).* in [0-9.]+s' | tail -n 1)
    ended "tests $name (${outcome:-no outcome})" "$status" "$started"
}

bench_step() {
    local name=$1 limit=$2 dir=/tmp/bench_gpu_$1 started=$SECONDS
    shift 2
    jpeg_folder || { ended "bench $name (no JPEG folder)" 1 "$started" && return; }
    rm -rf "$dir" "$dir.ended"
    local command=("$PY" tools/benchmark.py --device "$DEVICE" --data-path "$DATA" --output-dir "$dir" "$@")
    note "bench $name: ${command[*]} (at most $limit s)"
    echo "===== bench $name: ${command[*]}" >>"$OUT/bench.log"
    while [ ! -e "$dir.ended" ]; do # the rows finished so far, in $OUT while the benchmark runs
        copy_new "$dir/benchmark.json" "$OUT/benchmark_$name.json"
        sleep 3
    done &
    local copier=$!
    timeout -k 10 "$limit" "${command[@]}" 2>&1 | tee -a "$OUT/bench.log"
    local status=$? rows
    touch "$dir.ended"
    wait "$copier"
    rm -f "$dir.ended"
    copy_new "$dir/benchmark.json" "$OUT/benchmark_$name.json"
    copy_new "$dir/profile_trace.json.gz" "$OUT/profile_$name.json.gz"
    rows=$(grep -s -c '"kind"' "$OUT/benchmark_$name.json")
    ended "bench $name (benchmark_$name.json: ${rows:-0} rows)" "$status" "$started"
    run_logs "$dir"/logs/*.log
}

run_step() {
    local name=$1 limit=$2 script=$3 dir=/tmp/run_gpu_$1 started=$SECONDS
    shift 3
    jpeg_folder || { ended "run $name (no JPEG folder)" 1 "$started" && return; }
    rm -rf "$dir"
    local command=("$PY" "$script" --device "$DEVICE" --data-path "$DATA" --output-dir "$dir/run" "$@")
    note "run $name: ${command[*]} (at most $limit s)"
    mkdir -p "$dir"
    local begun=$EPOCHREALTIME
    # each line of its output stamped with the time it came (seconds since the epoch): the gaps between epochs' lines
    timeout -k 10 "$limit" "${command[@]}" 2>&1 | "$PY" -u -c 'import sys, time
for line in sys.stdin:
    print(f"{time.time():.3f} {line}", end="")' >"$dir/log"
    local status=${PIPESTATUS[0]} seconds
    seconds=$(awk "BEGIN { printf \"%.1f\", $EPOCHREALTIME - $begun }")
    copy_new "$dir/run/metrics.jsonl" "$OUT/run_$name.jsonl"
    note "run $name: ${seconds} s from the command to its end; last weights file $(ls -l --time-style=+%T.%N "$dir/run/weights/last.pth" 2>/dev/null | awk '{print $6}')"
    ended "run $name" "$status" "$started"
    run_logs "$dir/log"
}

for step in "$@"; do
    eval "words=($step)" # the step's words, quotes honoured
    kind=${words[0]} name=${words[1]} asked=${words[2]}
    limit=$(limit_of "$asked")
    [ "$limit" -lt 30 ] && { note "$kind $name: skipped, $limit s left for it"; failed=1; continue; }
    case $kind in
    tests | bench | run) "${kind}_step" "$name" "$limit" "${words[@]:3}" ;;
    *) note "unknown step kind: $kind (tests, bench or run)"; failed=1 ;;
    esac
done

rm -f "$OUT/.copying"
note "done in ${SECONDS}s; files in $OUT: $(cd "$OUT" && printf '%s ' *)"
exit "$failed"
