#!/usr/bin/env bash
# Every GPU check in one command of at most 9 minutes on one H100/H200.
#
#   make gpu                                   (bash benchmarks/gpu.sh)
#   bash benchmarks/gpu.sh --cpu-dry-run       every part at a tiny size on CPU
#   bash benchmarks/gpu.sh --parts compare_modes,fp8 --results DIR
#   bash benchmarks/gpu.sh --plan              the parts, their time boxes; runs nothing
#
# The parts run one at a time, in the order below: the GPU parts first, each alone on the
# machine (XLA:GPU compiles its autotuning candidates on a thread pool sized to the host:
# nothing else may load the cores then), and the CPU suite last, on every core. Each runs
# under timeout(1) in its own time box, cut to what is left of the budget: a part whose
# box no longer fits is recorded as not run (budget), so the run ends within BUDGET
# seconds whatever the parts do. A part that fails or hangs is recorded (exit code, tail
# of its log) and the next one runs. A benchmark that hangs gets SIGABRT, so Python's
# faulthandler prints where it was; pytest gets SIGINT, so it still writes its report.
# Results: RESULTS/gpu-<device>.json and .md (RESULTS defaults to benchmarks/results;
# for a dry run, $TMPDIR/mpfunc-gpu-dry-run), logs in RESULTS/gpu-logs/; with $OUT set,
# the JSON, the markdown and a tarball of the logs are copied there too. No install: the
# checkout runs from PYTHONPATH. The recorded commit is $MPFUNC_COMMIT when set, else
# git's when the checkout is its own repository. Exit status: 0 when every part passed.
set -uo pipefail
{ # the whole script is read before it runs: editing the checkout meanwhile is harmless
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
    -h | --help) sed -n '2,21p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
# The parts, in the order they run, with their time boxes (s): what each took alone on an
# idle H200 where that was measured, else its CPU time here scaled, with about 1.5x
# headroom (BENCHMARKS.md, "make gpu"). MIN is the least box worth starting it with.
# fp8 is benchmarks/fp8.py's eager torch variants (stacked Linears and the GPT decoder);
# trainers is benchmarks/hf_trainer.py (HF Trainer fp16 vs AmpTrainer on GPT-2 small, its
# own 55 s budget). A missing script is recorded as failed. cpu_suite's box is whatever
# the budget has left (0 below).
PARTS=(import_time gpu_tests jax_gpu_compile compare_modes fp8 trainers torch_modes
       jax_scale_cost jax_loss_scale unscale_bandwidth precision_report cpu_suite)
declare -A BOX=([import_time]=40 [gpu_tests]=75 [jax_gpu_compile]=240 [compare_modes]=150
                [fp8]=90 [trainers]=75 [torch_modes]=30 [jax_scale_cost]=40
                [jax_loss_scale]=25 [unscale_bandwidth]=20 [precision_report]=20
                [cpu_suite]=0)
declare -A MIN=([import_time]=15 [gpu_tests]=30 [jax_gpu_compile]=60 [compare_modes]=60
                [fp8]=30 [trainers]=30 [torch_modes]=15 [jax_scale_cost]=20
                [jax_loss_scale]=10 [unscale_bandwidth]=10 [precision_report]=10
                [cpu_suite]=60)
# BUDGET: the whole run. RESERVE: the environment at the start and the report at the
# end. Every part's box ends KILL_AFTER s before BUDGET - RESERVE (a KILL may follow
# its signal that much later). GPU_SH_BUDGET / GPU_SH_BOX_<PART> override (tests).
BUDGET=${GPU_SH_BUDGET:-540} RESERVE=30 KILL_AFTER=5
if [ $PLAN = 1 ]; then
  echo "budget $BUDGET"; echo "reserve $RESERVE"; echo "kill_after $KILL_AFTER"
  for p in "${PARTS[@]}"; do echo "part $p ${BOX[$p]} ${MIN[$p]}"; done
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
CACHE=$RESULTS/jax-cache  # JAX's persistent compilation cache: empty at the start
rm -rf "$RUN" "$CACHE" && mkdir -p "$RUN" "$CACHE" || exit 2
STARTED=$(date +%s.%N)
SECONDS=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# torch and JAX share the GPU in one process (compare_modes): JAX must not take 75% of it.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export MPFUNC_JAX_CACHE=$CACHE
ulimit -c 0  # SIGABRT at a time box: a traceback, no core file

selected() { [ -z "$ONLY" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# part NAME RESULT_JSON CMD...: runs CMD under `timeout` in NAME's time box (cut to the
# budget left), logs to $RUN/NAME.log and records how it ended (or that it did not run).
# SIG (default ABRT) is sent at the time box.
part() {
  local name=$1 result=$2 sig=${SIG:-ABRT} missing="" skipped="" arg t0 rc override box left
  shift 2
  selected "$name" || return 0
  override=GPU_SH_BOX_${name^^}
  box=${!override:-${BOX[$name]}}
  left=$((BUDGET - RESERVE - KILL_AFTER - SECONDS))
  if [ "$box" = 0 ] || [ "$box" -gt "$left" ]; then box=$left; fi
  for arg in "$@"; do  # a script that is not there yet is a failed part, not a stop
    if [[ $arg == *.py && ! -e $arg ]]; then missing=$arg; fi
  done
  if [ -z "$missing" ] && [ "$box" -lt "${MIN[$name]}" ] && [ -z "${!override:-}" ]; then
    skipped="time budget: ${left} s left of ${BUDGET} s, it needs at least ${MIN[$name]} s"
  fi
  t0=$(date +%s.%N)
  if [ -n "$skipped" ]; then
    echo "[gpu.sh] $(date +%T) $name: not run ($skipped)"
    : >"$RUN/$name.log"
    rc=0 box=0
  elif [ -n "$missing" ]; then
    echo "gpu.sh: $missing is missing" >"$RUN/$name.log"
    rc=127
  else
    echo "[gpu.sh] $(date +%T) $name (time box ${box} s):$(printf ' %q' "$@")"
    timeout -s "$sig" -k $KILL_AFTER "$box" "$@" >"$RUN/$name.log" 2>&1
    rc=$?
    echo "[gpu.sh] $(date +%T) $name: exit $rc"
  fi
  "$PY" benchmarks/gpu_report.py record --run "$RUN" --name "$name" --rc $rc --started "$t0" \
    --timeout "$box" --signal "$sig" ${result:+--result "$result"} \
    ${missing:+--missing "$missing"} ${skipped:+--skipped "$skipped"} -- "$@"
}

# -- the environment (and, on a GPU run, a check that there is a GPU)
timeout 60 "$PY" benchmarks/gpu_report.py env --run "$RUN" --started "$STARTED" \
  $([ $DRY = 1 ] && echo --dry-run) || exit $?

mapfile -t GPU_TEST_FILES < <(grep -l "pytest.mark.gpu" tests/test_*.py)
NCPU=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 2)
if [ $DRY = 1 ]; then
  DEV=cpu JAXP=cpu
  SUITE=(tests/test_scale_config.py)
  IMPORTS=(--rounds 1)
  GPU_COMPILE=(--device cpu --modes fp32 --forms scanned --options default,no_triton_gemm
               --window 1)
  # Two modes besides fp32 (the pipeline, not the modes: tests/test_examples.py runs
  # every mode on CPU); all nine compiled twice took 146 s of a slow 2-core machine.
  COMPARE=(--device cpu --layers 1 --width 32 --heads 2 --context 16 --batch 2 --steps 4
           --rounds 1 --window 2 --modes naive,bf16-remainder)
  SCALE_COST=(--depths 1 --batch 2 --rounds 1 --iters 1 --only "mode naive")
  LOSS_SCALE=(--batch 8 --width 32 --depth 1 --rounds 1 --iters 1)
  UNSCALE=(--mib 1 --reps 2)
  TORCH_MODES=(--width 16 --depth 1 --batch 4 --rounds 1 --iters 1 --peak none)
  FP8=(--quick --model linear,gpt --frameworks torch --recipes tensorwise --no-compile
       --time-budget 10 --time-limit 20)
  TRAINERS=(--device cpu --tiny --steps 3 --warmup 1 --batch 2 --time-budget 30)
  REPORT=(--batch 8 --width 32 --depth 1 --rounds 1 --iters 1 --torch-width 32
          --torch-batch 4 --torch-iters 1)
else
  # JAX_PLATFORMS=cuda,cpu: the GPU tests compare with the CPU (jax.devices("cpu")).
  DEV=cuda JAXP=cuda,cpu
  SUITE=()
  IMPORTS=(--rounds 3)
  # Its own budget, inside its box: the option sets in children, what fits (4 min at most).
  GPU_COMPILE=(--device cuda --time-budget 225 --xla-vlog --logs "$RUN/jax_gpu_compile")
  # The demo's 12-layer GPU model in every mode, fewer steps than the demo's default.
  COMPARE=(--device cuda --layers 12 --width 768 --heads 12 --context 512 --batch 8
           --steps 12 --rounds 3 --window 4)
  # 24 layers: where naive's donated step peaked at 1.107x the unscaled step (once).
  # Compiles in this process: a fresh process per compile would re-initialise CUDA.
  SCALE_COST=(--depths 24 --batch 32 --rounds 5 --iters 5 --only "mpfunc.dynamic_scale(adam)"
              "mode torch" "mode naive" "mode bf16" --no-compile-cache)
  LOSS_SCALE=(--batch 512 --width 1024 --depth 4 --rounds 10 --iters 10)
  UNSCALE=(--mib 512 --reps 20)
  TORCH_MODES=(--width 2048 --depth 8 --batch 8192 --rounds 5 --iters 5)
  # Eager torch only (compiled torch and JAX fp8 compile for minutes: a GPU session of
  # their own runs them, see BENCHMARKS.md): 4 x Linear(8192) in three recipes and the
  # demo's GPT (width 2048, 16 layers, sequence 2048) in bf16 and tensorwise fp8.
  # --time-limit stops a variant still running 75 s after the imports; the JSON is
  # rewritten after every variant.
  FP8=(--model linear,gpt --sizes 8192 --frameworks torch --recipes tensorwise,delayed,rowwise
       --gpt-recipes tensorwise --no-compile --steps 10 --warmup 2 --time-budget 50
       --time-limit 75)
  TRAINERS=(--device cuda --time-budget 55)
  # The 10M-param MLP of BENCHMARKS.md section 9, torch and bf16 modes (torch only, to fit
  # its box: the JAX report is fused by XLA into the step's own kernels).
  REPORT=(--framework torch --rounds 5 --torch-iters 10)
fi

# -- the GPU parts, one at a time, nothing beside them
part import_time import_time.json \
  "$PY" benchmarks/import_time.py "${IMPORTS[@]}" --json "$RUN/import_time.json"
SIG=INT part gpu_tests "" env JAX_PLATFORMS=$JAXP \
  "$PY" -m pytest -m gpu -p no:cacheprovider -q -rs -o faulthandler_timeout=60 \
  --junitxml="$RUN/gpu_tests.xml" "${GPU_TEST_FILES[@]}"
part jax_gpu_compile jax_gpu_compile.json \
  "$PY" benchmarks/jax_gpu_compile.py "${GPU_COMPILE[@]}" --json "$RUN/jax_gpu_compile.json"
part compare_modes compare_modes.json \
  "$PY" examples/compare_modes.py "${COMPARE[@]}" --quiet --json "$RUN/compare_modes.json"
part fp8 fp8.json \
  "$PY" benchmarks/fp8.py --device $DEV "${FP8[@]}" --out "$RUN/fp8.json"
part trainers trainers.json \
  "$PY" benchmarks/hf_trainer.py "${TRAINERS[@]}" --json "$RUN/trainers.json"
part torch_modes torch_modes.json \
  "$PY" benchmarks/torch_modes.py --device $DEV "${TORCH_MODES[@]}" \
  --json "$RUN/torch_modes.json"
part jax_scale_cost jax_scale_cost.json \
  "$PY" benchmarks/jax_scale_cost.py "${SCALE_COST[@]}" --compile-repeats 1 \
  --compile-in-process --json "$RUN/jax_scale_cost.json"
part jax_loss_scale jax_loss_scale.json \
  "$PY" benchmarks/jax_loss_scale.py "${LOSS_SCALE[@]}" --json "$RUN/jax_loss_scale.json"
part unscale_bandwidth unscale_bandwidth.json \
  "$PY" benchmarks/unscale_bandwidth.py --device $DEV "${UNSCALE[@]}" \
  --json "$RUN/unscale_bandwidth.json"
part precision_report precision_report.json \
  "$PY" benchmarks/precision_report.py --device $DEV "${REPORT[@]}" \
  --json "$RUN/precision_report.json"

# -- then the non-slow suite on every core, the GPU hidden, in what the budget has left
SIG=INT part cpu_suite "" env CUDA_VISIBLE_DEVICES= JAX_PLATFORMS=cpu \
  "$PY" -m pytest -n "$NCPU" -m "not slow" -p no:cacheprovider -q -o faulthandler_timeout=240 \
  --junitxml="$RUN/cpu_suite.xml" "${SUITE[@]}"

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
}
