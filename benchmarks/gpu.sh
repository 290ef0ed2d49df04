#!/usr/bin/env bash
# Every GPU check in one command of at most 8 minutes on one H100/H200.
#
#   make gpu                                   (bash benchmarks/gpu.sh)
#   bash benchmarks/gpu.sh --cpu-dry-run       every part at a tiny size on CPU
#   bash benchmarks/gpu.sh --parts compare_modes,fp8 --results DIR
#   bash benchmarks/gpu.sh --plan              the parts and their time boxes; runs nothing
#
# Each part runs under timeout(1) with its own time box; one that fails or hangs is
# recorded (exit code, tail of its log) and the next one runs. A benchmark that hangs
# gets SIGABRT, so Python's faulthandler prints where it was; pytest gets SIGINT, so
# it still writes its report. The non-slow suite runs on CPU cores, the GPU hidden,
# beside the GPU parts. Results: RESULTS/gpu-<device>.json and .md (RESULTS defaults
# to benchmarks/results; for a dry run, $TMPDIR/mpfunc-gpu-dry-run), logs in
# RESULTS/gpu-logs/; with $OUT set, the JSON, the markdown and a tarball of the logs
# are copied there too. No install: the checkout runs from PYTHONPATH (set
# MPFUNC_COMMIT where the copy has no .git). Exit status: 0 when every part passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
DRY=0
PLAN=0
RESULTS=""
ONLY=""
while [ $# -gt 0 ]; do
  case $1 in
    --cpu-dry-run) DRY=1 ;;
    --plan) PLAN=1 ;;
    --results) RESULTS=${2:?--results needs a folder}; shift ;;
    --parts) ONLY=${2:?--parts needs a comma-separated list}; shift ;;
    -h | --help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
# Time boxes (s). The GPU parts run one after another: 425 s, plus up to 5 s each for a
# KILL after the first signal, plus ~15 s for the environment and the report: <= 480 s.
# The CPU suite runs beside them in its own 420 s box. GPU_SH_BOX_<PART>=S overrides one
# (the tests use it to make a part time out).
PARTS=(gpu_tests compare_modes jax_scale_cost jax_loss_scale unscale_bandwidth torch_modes fp8
       precision_report cpu_suite)
declare -A BOX=([gpu_tests]=60 [compare_modes]=165 [jax_scale_cost]=50 [jax_loss_scale]=30
                [unscale_bandwidth]=20 [torch_modes]=35 [fp8]=45 [precision_report]=20
                [cpu_suite]=420)
KILL_AFTER=5 OVERHEAD=15 BUDGET=480
if [ $PLAN = 1 ]; then
  for p in "${PARTS[@]}"; do echo "$p ${BOX[$p]}"; done
  echo "kill_after $KILL_AFTER"; echo "overhead $OVERHEAD"; echo "budget $BUDGET"
  exit 0
fi
if [ -n "$ONLY" ]; then
  for p in ${ONLY//,/ }; do
    [ -n "${BOX[$p]:-}" ] || { echo "gpu.sh: unknown part '$p'; parts: ${PARTS[*]}" >&2; exit 2; }
  done
fi
if [ -z "$RESULTS" ]; then
  if [ $DRY = 1 ]; then RESULTS=${TMPDIR:-/tmp}/mpfunc-gpu-dry-run; else RESULTS=$ROOT/benchmarks/results; fi
fi
RUN=$RESULTS/gpu-logs
rm -rf "$RUN" && mkdir -p "$RUN" || exit 2
STARTED=$(date +%s.%N)

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# torch and JAX share the GPU in one process (compare_modes): JAX must not take 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
ulimit -c 0  # SIGABRT at a time box: a traceback, no core file

selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# part NAME RESULT_JSON CMD...: runs CMD under `timeout` in NAME's time box, logs to
# $RUN/NAME.log and records how it ended. SIG (default ABRT) is sent at the time box.
part() {
  local name=$1 result=$2 sig=${SIG:-ABRT} missing="" arg t0 rc override box
  shift 2
  override=GPU_SH_BOX_${name^^}
  box=${!override:-${BOX[$name]}}
  selected "$name" || return 0
  for arg in "$@"; do  # a script that is not there yet is a failed part, not a stop
    if [[ $arg == *.py && ! -e $arg ]]; then missing=$arg; fi
  done
  echo "[gpu.sh] $(date +%T) $name (time box ${box} s):$(printf ' %q' "$@")"
  t0=$(date +%s.%N)
  if [ -n "$missing" ]; then
    echo "gpu.sh: $missing is missing" >"$RUN/$name.log"
    rc=127
  else
    timeout -s "$sig" -k $KILL_AFTER "$box" "$@" >"$RUN/$name.log" 2>&1
    rc=$?
  fi
  echo "[gpu.sh] $(date +%T) $name: exit $rc"
  "$PY" benchmarks/gpu_report.py record --run "$RUN" --name "$name" --rc $rc --started "$t0" \
    --timeout "$box" --signal "$sig" ${result:+--result "$result"} \
    ${missing:+--missing "$missing"} -- "$@"
}

# -- the environment (and, on a GPU run, a check that there is a GPU)
timeout 60 "$PY" benchmarks/gpu_report.py env --run "$RUN" --started "$STARTED" \
  $([ $DRY = 1 ] && echo --dry-run) || exit $?

mapfile -t GPU_TEST_FILES < <(grep -l "pytest.mark.gpu" tests/test_*.py)
NCPU=$(nproc 2>/dev/null || echo 2)
if [ $DRY = 1 ]; then
  DEV=cpu JAXP=cpu XDIST=1
  SUITE=(tests/test_scale_config.py)
  COMPARE=(--device cpu --layers 1 --width 32 --heads 2 --context 16 --batch 2 --steps 4
           --rounds 1 --window 2)
  SCALE_COST=(--depths 1 --batch 2 --rounds 1 --iters 1 --only "mode naive")
  LOSS_SCALE=(--batch 8 --width 32 --depth 1 --rounds 1 --iters 1)
  UNSCALE=(--mib 1 --reps 2)
  TORCH_MODES=(--width 16 --depth 1 --batch 4 --rounds 1 --iters 1 --peak none)
  FP8_BUDGET=5
  REPORT=(--batch 8 --width 32 --depth 1 --rounds 1 --iters 1 --torch-width 32
          --torch-batch 4 --torch-iters 1)
else
  # Leave 6 cores to the GPU parts (their compiles, dispatch and data loading).
  DEV=cuda JAXP=cuda XDIST=$((NCPU > 7 ? NCPU - 6 : 1))
  SUITE=()
  COMPARE=(--device cuda --layers 12 --width 768 --heads 12 --context 512 --batch 8
           --steps 40 --rounds 3 --window 10)
  # 24 layers: where naive's donated step peaked at 1.107x the unscaled step (once).
  # Compiles in this process: a fresh process per compile would re-initialise CUDA.
  SCALE_COST=(--depths 24 --batch 32 --rounds 7 --iters 5 --only "mpfunc.dynamic_scale(adam)"
              "mpfunc.dynamic_scale(adam), float16 compute" "mode torch" "mode apex O2"
              "mode naive" "mode bf16")
  LOSS_SCALE=(--batch 512 --width 1024 --depth 4 --rounds 15 --iters 10)
  UNSCALE=(--mib 512 --reps 20)
  TORCH_MODES=(--width 2048 --depth 8 --batch 8192 --rounds 5 --iters 5)
  FP8_BUDGET=35
  # The 10M-param MLP of BENCHMARKS.md section 9, torch and bf16 modes (torch only, to fit
  # its box: the JAX report is fused by XLA into the step's own kernels).
  REPORT=(--framework torch --rounds 5 --torch-iters 10)
fi

# -- the non-slow suite on CPU cores, GPU hidden, in the background
SIG=INT part cpu_suite "" env CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu \
  "$PY" -m pytest -n "$XDIST" -m "not slow" -p no:cacheprovider -q -o faulthandler_timeout=240 \
  --junitxml="$RUN/cpu_suite.xml" "${SUITE[@]}" &
SUITE_PID=$!

# -- the GPU parts, one at a time
SIG=INT part gpu_tests "" env JAX_PLATFORMS=$JAXP \
  "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs -o faulthandler_timeout=50 \
  --junitxml="$RUN/gpu_tests.xml" "${GPU_TEST_FILES[@]}"
part compare_modes compare_modes.json \
  "$PY" examples/compare_modes.py "${COMPARE[@]}" --quiet --json "$RUN/compare_modes.json"
part jax_scale_cost jax_scale_cost.json \
  "$PY" benchmarks/jax_scale_cost.py "${SCALE_COST[@]}" --compile-repeats 1 \
  --compile-in-process --json "$RUN/jax_scale_cost.json"
part jax_loss_scale jax_loss_scale.json \
  "$PY" benchmarks/jax_loss_scale.py "${LOSS_SCALE[@]}" --json "$RUN/jax_loss_scale.json"
part unscale_bandwidth unscale_bandwidth.json \
  "$PY" benchmarks/unscale_bandwidth.py --device $DEV "${UNSCALE[@]}" \
  --json "$RUN/unscale_bandwidth.json"
part torch_modes torch_modes.json \
  "$PY" benchmarks/torch_modes.py --device $DEV "${TORCH_MODES[@]}" \
  --json "$RUN/torch_modes.json"
part fp8 fp8.json \
  "$PY" benchmarks/fp8.py --device $DEV --time-budget $FP8_BUDGET --out "$RUN/fp8.json"
part precision_report precision_report.json \
  "$PY" benchmarks/precision_report.py --device $DEV "${REPORT[@]}" \
  --json "$RUN/precision_report.json"

echo "[gpu.sh] $(date +%T) waiting for the CPU suite"
wait $SUITE_PID

# -- the report
JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES= timeout 60 "$PY" benchmarks/gpu_report.py assemble \
  --run "$RUN" --results "$RESULTS" --budget $BUDGET
status=$?
REPORT=()
[ -f "$RUN/outputs" ] && mapfile -t REPORT <"$RUN/outputs"  # the JSON and the markdown
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
  cp "${REPORT[@]}" "$OUT"/
  tar -czf "$OUT/gpu-logs.tar.gz" -C "$RESULTS" gpu-logs
  echo "[gpu.sh] copied ${REPORT[*]} and gpu-logs.tar.gz to $OUT"
fi
for f in "${REPORT[@]}"; do [[ $f == *.md ]] && { echo; cat "$f"; }; done
exit $status
