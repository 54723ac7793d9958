#!/usr/bin/env bash
# The prepared device check: one call, under 8 minutes on one H200 (docs/BENCHMARKS.md).
#
#   benchmarks/gpu_suite.sh            # on the GPU: 1B preset, bf16, the real worker
#   benchmarks/gpu_suite.sh --dry-run  # the same parts on the CPU, tiny preset, short windows
#
# Parts (each with its own time limit; a part that fails or is cut never stops the next):
#   1 equivalence  the CUDA cases of the kernel, chunked-CE, sampler, engine and async-save
#                  tests (fp32 and bf16 autocast bands), and determinism: two identical
#                  forwards, eager and compiled, bitwise equal with the same MoE routes, the
#                  compiled one within the compiled step's band          -> equivalence.txt
#   2 ladder       stages 1-5 of the shipped stages.yaml through scripts/fast4gpu_boost_v2.py:
#                  tok/s, peak memory, compile time, graph breaks, recompiles, the first
#                  compiled step against the eager one, time to first step, MFU; stage 1 vs
#                  the reference loop; the largest BATCH that fits, from the memory model's
#                  (benchmarks/gpu_ladder.py)                             -> ladder.json
#   3 async_save   the training thread's stall per checkpoint, async (pinned host buffers)
#                  vs synchronous (benchmarks/bench_async_save.py)        -> async_save.json
#   4 canary_band  the canary's bf16 band (benchmarks/bench_canary.py)   -> canary_band.json
#     ar_probe     one AR probe of the ladder's stage-1 checkpoint        -> probe.json
# Everything lands under $OUT (default ./gpu-results): the files above, env.txt (machine,
# driver, torch, Triton, CUDA, GPU name, compute capability), suite.log (every part's
# output) and summary.md: a row per stage, then a row per part, printed last.
# Exit status: 0 when every part passed, 1 when any failed or was cut, 2 for a bad argument.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument '$arg' (expected --dry-run or nothing)" >&2; exit 2 ;;
    esac
done

OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-suite.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout, installed or not
LOG="$OUT/suite.log"
: >"$LOG"

if [ "$DRY" = 1 ]; then
    # About 1.5 minutes of CPU in all (20 short processes, each importing torch), plus stage
    # 4's compile (inductor on the CPU: 1-3 minutes). The limits only catch a hung part: the
    # dry run proves the script, not a speed, and a loaded CI machine must still run every
    # part to its end.
    TITLE="GPU suite (dry run: CPU, tiny preset, COMPILE=0 but stage 4)"
    EQ_LIMIT=300
    LADDER=(--preset tiny --device cpu --seq 32 --steps 4 --no-compile --compile-stage 4
            --fit-max 8 --fit-seconds 600 --run-timeout 900); LADDER_LIMIT=1800
    ASYNC=(--preset tiny --device cpu --threads 1 --timeout 290); ASYNC_LIMIT=300
    CANARY=(--device cpu --model tiny --switches 1-2 --steps 3 --train-steps 3); CANARY_LIMIT=600
    PROBE_DEVICE=cpu; PROBE_LIMIT=300
else
    TITLE="GPU suite (CUDA, 1B preset)"
    EQ_LIMIT=75
    LADDER=(--preset 1b --device cuda --steps 8 --fit-seconds 60 --run-timeout 150)
    LADDER_LIMIT=240
    ASYNC=(--preset 1b --device cuda --threads 8 --timeout 50); ASYNC_LIMIT=60
    CANARY=(--device cuda --model small); CANARY_LIMIT=50
    PROBE_DEVICE=cuda; PROBE_LIMIT=30
fi

PARTS=()
# run_part NAME LIMIT_S OUTPUT COMMAND...: the command's stdout and stderr go to OUTPUT, then
# into suite.log; its status and seconds to the summary. `timeout` signals the part's
# process group (a worker the part started in a group of its own is the part's to stop:
# gpu_ladder.py does on SIGTERM); -k 10 kills what is left 10 s later.
run_part() {
    local name=$1 limit=$2 output=$3 start=$SECONDS rc
    shift 3
    echo "== $name (limit ${limit}s): $*" >>"$LOG"
    timeout -k 10 "$limit" "$@" >"$output" 2>&1
    rc=$?
    cat "$output" >>"$LOG"
    PARTS+=(--part "$name=$rc:$((SECONDS - start))")
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
}

{
    echo "date: $(date -u +%FT%TZ)  dry_run: $DRY"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    nvidia-smi --query-gpu=driver_version,name,compute_cap --format=csv 2>&1 || true
    "$PY" - 2>&1 <<'PYEOF'
import importlib.util, platform, torch
triton = importlib.util.find_spec("triton") and __import__("triton").__version__
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(0), "compute_capability",
          "%d.%d" % torch.cuda.get_device_capability(0))
PYEOF
} >"$OUT/env.txt"

run_part equivalence "$EQ_LIMIT" "$OUT/equivalence.txt" \
    "$PY" -m pytest -q -p no:cacheprovider -k cuda -rs tests/test_attention_kernels.py \
    tests/test_ce.py tests/test_engine.py tests/test_async_save.py tests/test_compile_determinism.py

run_part ladder "$LADDER_LIMIT" "$WORK/ladder.out" "$PY" -m benchmarks.gpu_ladder "${LADDER[@]}" \
    --work "$WORK/ladder" --json "$OUT/ladder.json"

run_part async_save "$ASYNC_LIMIT" "$WORK/async.out" "$PY" benchmarks/bench_async_save.py \
    "${ASYNC[@]}" --json "$OUT/async_save.json"

run_part canary_band "$CANARY_LIMIT" "$WORK/canary.out" "$PY" benchmarks/bench_canary.py --band \
    "${CANARY[@]}" --json "$OUT/canary_band.json"

# Its JSON is the last line of probe.json (a warning or an error line may come before it).
run_part ar_probe "$PROBE_LIMIT" "$OUT/probe.json" "$PY" -m fractus.eval.probe --json \
    --device "$PROBE_DEVICE" --checkpoint "$WORK/ladder/stage1/fractus_1b_gpu0.pt" \
    --shard "$WORK/ladder/shard.npy"

"$PY" -m benchmarks.gpu_summary --out "$OUT" --title "$TITLE" "${PARTS[@]}"
