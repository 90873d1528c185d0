#!/usr/bin/env bash
# hkserve on a lent GPU machine (one H100 or H200, JAX with CUDA, torch, transformers; no network), in
# about 8 minutes: the golden SmolLM2 and HTTP tests on the GPU, then `hkserve bench engine` in bf16 on a
# random Llama 3.2 1B and on SmolLM2 at 1, 16 and 64 slots beside transformers on the same GPU, with the
# measured HBM bandwidth and the share of it reached at batch 1, then SmolLM2's paged decode step through
# the Pallas kernel vs XLA's gather, int8 and int4 weights through XLA (x·W alone, then the 1B model's
# decode in bf16, int8 and int4) after serve's cold and warm start on SmolLM2 (the last stages are skipped
# past the budget; DEVICE_CHECK_ONLY="startup quant-weights" runs them alone, in the script's order). Every stage
# has its own time limit and a failure does not stop the next; a summary ends the run. JSON (and the log)
# go to $OUT when it is set.
#
# The two-call procedure (docs/benchmarks.md, "GPU"). SmolLM2's GGUF (94 MiB) is more than one call
# carries (64 MiB), so:
#   0. here, with network:  bash scripts/device-wheels.sh   (.whl/, .dev/part1, .dev/part2, .dev/shared)
#   1. run(command="bash scripts/device-check.sh --stage 1", carry=[".dev/part1"], timeout_s=120)
#        stashes part 1 in /tmp/hkserve-dev/ on the machine and names the GPU; nothing else
#   2. at once (a machine stays warm 30 s after a call; a fresh one has lost part 1):
#      run(command="bash scripts/device-check.sh", carry=[".whl", ".dev/part2", ".dev/shared"], timeout_s=590)
#        installs the wheels, joins the halves (sha256 checked), converts SmolLM2 into a store, runs it all
# Without part 1 on the machine, call 2 still runs everything that needs no real weights and says what it
# skipped.
#
# DEVICE_CHECK_DRY_RUN=1: the same stages on JAX's CPU backend at toy sizes (a tiny random model, 1 and 2
# slots, few steps; SmolLM2 only if its parts are present), using the current Python environment, for
# tests/test_device_check.py. DEVICE_CHECK_ONLY="STAGE ..." runs those stages alone (with setup and
# convert-smollm2, which they need), e.g. to rerun a failed one in a second lease. Other settings: DEVICE_CHECK_DEV (default .dev), DEVICE_CHECK_STASH (default
# /tmp/hkserve-dev), DEVICE_CHECK_BUDGET_S (default 560), DEVICE_CHECK_LIMITS (per-stage limits, e.g.
# "startup=420"), PYTHON (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
DRY=${DEVICE_CHECK_DRY_RUN:-0}
DEV=$(realpath -m "${DEVICE_CHECK_DEV:-.dev}")
STASH=$(realpath -m "${DEVICE_CHECK_STASH:-/tmp/hkserve-dev}")
BUDGET=${DEVICE_CHECK_BUDGET_S:-560}
PY=${PYTHON:-python3}
MODEL=smollm2-135m-instruct
export PYTHONUNBUFFERED=1 HKSERVE_HOME=$STASH/home
if ((DRY)); then
    export JAX_PLATFORMS=cpu OMP_NUM_THREADS=1  # one torch thread: spinning OpenMP threads stall on a busy CPU
    RANDOM_MODEL=tiny-llama
    SIZES=(--slots 1,2 --hf-batches 1,2 --steps 3 --repeats 1 --max-len 128 --bandwidth-mb 64 --matmul-n 256)
    SMOLLM2_SLOTS=(--slots 1,2 --hf-batches 1,2)
    PROFILE=(--slots 1,2 --max-len 128 --steps 4 --trace-steps 2)
    TESTS=(-k "models_lists or second_pull")  # the plumbing (store, fixtures, CLI), not minutes of CPU decoding
    PAGED=(--rows 1,2 --context 40 --max-len 128 --block-size 16 --steps 3 --repeats 1)
    QUANT_DOT=(--k 256 --n 512 --layers 2 --rows 1,2 --iters 2 --repeats 1)
    QUANT_SIZES=(--slots 1,2 --hf-batches 1 --steps 3 --repeats 1 --max-len 128 --bandwidth-mb 64 --matmul-n 256)
    QUANT_ENGINES=(bf16 int4-pallas)  # the loop's two kinds of run (int8 and int4 differ from them by --dtype alone)
    # float32: bf16 programs compile slowly on a CPU; 1 slot of 32 tokens: the fewest programs a cold start
    # compiles (tests/test_startup.py checks cold and warm starts of serve's usual tiny shape)
    STARTUP=(--weights f32 --slots 1 --max-len 32)
else
    export PYTHONPATH=/tmp/site:$REPO${PYTHONPATH:+:$PYTHONPATH}
    RANDOM_MODEL=llama3.2-1b
    SIZES=(--slots 1,16,64 --hf-batches 1,16,64 --steps 32 --repeats 3 --max-len 2048 --bandwidth-mb 4096)
    SMOLLM2_SLOTS=(--slots 1,64 --hf-batches 1,64)  # the whole 1/16/64 set took over 140 s on an H200
    PROFILE=(--slots 1,64 --max-len 2048 --steps 64 --trace-steps 8)
    TESTS=()
    PAGED=(--rows 16,64 --context 1024 --max-len 2048 --block-size 32 --steps 32 --repeats 3)
    QUANT_DOT=(--k 2048 --n 8192 --layers 16 --rows 1,16,64)
    QUANT_SIZES=(--slots 1,64 --hf-batches 1 --steps 32 --repeats 3 --max-len 2048 --bandwidth-mb 4096)
    QUANT_ENGINES=(bf16 int8 int4 int4-pallas)
    STARTUP=(--weights bf16 --slots 16 --max-len 2048)  # serve's defaults on a GPU
fi

# -- the stages' bodies; each runs as `device-check.sh --run NAME ...` under `timeout` ------------------
install_wheels() {
    if ((DRY)); then
        echo "dry run: the current Python environment stands in for the carried wheels"
    elif compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    else
        echo "no .whl/ carried: hkserve's imports may fail (run scripts/device-wheels.sh, carry .whl)"
    fi
    "$PY" scripts/device_check_report.py env "$RESULTS/env.json"
}

convert_smollm2() {  # joins the stashed half and the carried one, checks the sha256, converts once
    local gguf=$STASH/smollm2.gguf
    if [[ -f $HKSERVE_HOME/models/$MODEL/config.json ]]; then
        echo "$MODEL already in $HKSERVE_HOME (an earlier run on this machine)"
        return 0
    fi
    cat "$STASH/smollm2.gguf.part1" "$DEV/part2/smollm2.gguf.part2" >"$gguf"
    echo "$(cat "$DEV/part2/smollm2.gguf.sha256")  $gguf" | sha256sum -c - || return 1
    "$PY" -m hkserve.cli.main convert "$gguf" --name "$MODEL" --quiet
}

golden_tests() {
    # The golden references are float32 (transformers on a CPU); JAX's GPU default for float32 matmuls
    # is TF32, so the tests ask for float32 matmuls.
    HKSERVE_TEST_HOME=$HKSERVE_HOME HKSERVE_SHARED=$DEV/shared JAX_DEFAULT_MATMUL_PRECISION=highest \
        "$PY" -m pytest -q -p no:cacheprovider --junitxml="$WORK/tests.xml" \
        tests/test_smollm2.py tests/test_api_live.py "${TESTS[@]}"
}

bench() {  # bench JSON_NAME ARGS...: `hkserve bench engine --json`, its JSON line into $RESULTS
    local name=$1 rc
    shift
    "$PY" -m hkserve.cli.main bench engine --dtype bf16 --json --bandwidth-method device "${SIZES[@]}" "$@" \
        | tee "$WORK/$name.out"
    rc=${PIPESTATUS[0]}
    ((rc == 0)) && tail -n 1 "$WORK/$name.out" >"$RESULTS/$name.json"
    return "$rc"
}

profile() {  # where a decode step's time goes: scripts/device_profile.py
    "$PY" scripts/device_profile.py --random "$RANDOM_MODEL" "${PROFILE[@]}" --out "$RESULTS"
}

paged_attention() {  # SmolLM2's paged decode step, Pallas kernel vs XLA's gather: scripts/device_paged_attention.py
    # (its JSON stays in $WORK, for summary.json: one call brings back 8 files)
    "$PY" scripts/device_paged_attention.py --model "$MODEL" "${PAGED[@]}" --out "$WORK/paged-attention.json"
}

quant_weights() {  # int8 and int4 weights on the device: scripts/device_quant_dot.py, then the random
    # model's decode in bf16, int8 and int4 (`bench engine --dtype`); the JSONs stay in $WORK, for summary.json
    "$PY" scripts/device_quant_dot.py "${QUANT_DOT[@]}" --out "$WORK/quant-dot.json"
    local dtype rc=0
    local kernel=pallas
    ((DRY)) && kernel=interpret
    for dtype in "${QUANT_ENGINES[@]}"; do  # int4-pallas: int4 through model/int4_pallas.py
        HKSERVE_INT4_MATMUL=$([[ $dtype == int4-pallas ]] && echo "$kernel" || echo auto) \
            "$PY" -m hkserve.cli.main bench engine --random "$RANDOM_MODEL" --dtype "${dtype%-pallas}" --json \
            --bandwidth-method device "${QUANT_SIZES[@]}" | tee "$WORK/quant-$dtype.out"
        ((PIPESTATUS[0] == 0)) && tail -n 1 "$WORK/quant-$dtype.out" >"$WORK/quant-$dtype.json" || rc=1
    done
    return "$rc"
}

startup() {  # `hkserve bench startup`: serve's start to /health 200, cold then warm, SmolLM2
    # On the GPU, JAX logs every program's trace, lowering and compile seconds into the server log that
    # --server-log echoes: the H200's cold start did not answer within 370 s, and where it went is unknown.
    local logged=()
    ((DRY)) || logged=(JAX_LOG_COMPILES=1)
    env "${logged[@]}" "$PY" -m hkserve.cli.main bench startup --model "$MODEL" --warm-starts 1 "${STARTUP[@]}" --server-log --json \
        | tee "$WORK/startup.out"
    local rc=${PIPESTATUS[0]}
    ((rc == 0)) && tail -n 1 "$WORK/startup.out" >"$WORK/startup.json"
    return "$rc"
}

case ${1:-} in
    --stage)
        [[ ${2:-} == 1 ]] || { echo "usage: $0 [--stage 1]" >&2; exit 2; }
        mkdir -p "$STASH"
        cp "$DEV"/part1/* "$STASH"/ || { echo "stage 1: no $DEV/part1 (run scripts/device-wheels.sh, carry .dev/part1)"; exit 1; }
        echo "stage 1: stashed $(du -sh "$STASH" | cut -f1) in $STASH; now call 2, at once"
        command -v nvidia-smi >/dev/null && nvidia-smi -L
        exit 0 ;;
    --run)
        shift
        "$@"
        exit $? ;;
    "") ;;
    *) echo "usage: $0 [--stage 1]" >&2; exit 2 ;;
esac

# -- the run ---------------------------------------------------------------------------------------
WORK=$(mktemp -d)
RESULTS=${OUT:-$WORK/out}
export WORK RESULTS
mkdir -p "$RESULTS"
LOG=$RESULTS/device-check.log
STAGES=$WORK/stages.tsv
DEADLINE=$(($(date +%s) + BUDGET))
: >"$STAGES"

note() { echo "== $*" | tee -a "$LOG"; }

# stage NAME LIMIT_S FUNCTION ARGS...: runs the function in a child with at most LIMIT_S seconds (or the
# DEVICE_CHECK_LIMITS entry NAME=S; less when the budget is nearly spent), logs it, records name, exit status and seconds; skipped when under
# 20 s of the budget are left.
stage() {
    local name=$1 limit=$2 left start rc
    shift 2
    if [[ -n ${DEVICE_CHECK_ONLY:-} && $name != setup && $name != convert-smollm2 && " $DEVICE_CHECK_ONLY " != *" $name "* ]]; then
        skip "$name" "not in DEVICE_CHECK_ONLY"
        return
    fi
    for pair in ${DEVICE_CHECK_LIMITS:-}; do  # "startup=420 quant-weights=120": this lease's own limits
        [[ ${pair%%=*} == "$name" ]] && limit=${pair#*=}
    done
    left=$((DEADLINE - $(date +%s)))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        skip "$name" "out of time"
        return
    fi
    note "$name (at most ${limit} s)"
    start=$(date +%s)
    timeout -k 10 "$limit" bash "$REPO/scripts/device-check.sh" --run "$@" 2>&1 | tee -a "$LOG"
    rc=${PIPESTATUS[0]}
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$( ((rc == 124)) && echo timed out)" >>"$STAGES"
}
skip() {  # skip NAME REASON
    note "$1: skipped, $2"
    printf '%s\tskipped\t0\t%s\n' "$1" "$2" >>"$STAGES"
}

note "device-check: $( ((DRY)) && echo 'DRY RUN (CPU, toy sizes)' || echo GPU), budget ${BUDGET} s, results in $RESULTS"
stage setup 90 install_wheels
if [[ -f $HKSERVE_HOME/models/$MODEL/config.json || (-f $STASH/smollm2.gguf.part1 && -f $DEV/part2/smollm2.gguf.part2) ]]; then
    stage convert-smollm2 120 convert_smollm2
else
    skip convert-smollm2 "SmolLM2's halves are not both here (no stage 1 on this machine, or .dev/part2 not carried)"
fi
HAVE_SMOLLM2=0
[[ -f $HKSERVE_HOME/models/$MODEL/config.json ]] && HAVE_SMOLLM2=1
if ((HAVE_SMOLLM2)); then
    stage golden-tests 200 golden_tests
else
    skip golden-tests "no SmolLM2 store"
fi
stage bench-llama-1b 240 bench bench-llama-1b --random "$RANDOM_MODEL"
stage profile-llama-1b 90 profile
if ((HAVE_SMOLLM2)); then
    stage bench-smollm2 150 bench bench-smollm2 --model "$MODEL" "${SMOLLM2_SLOTS[@]}"
else
    skip bench-smollm2 "no SmolLM2 store"
fi
if ((HAVE_SMOLLM2)); then
    stage paged-attention 120 paged_attention
else
    skip paged-attention "no SmolLM2 store"
fi
if ((HAVE_SMOLLM2)); then  # before quant-weights: a GPU start-up is the figure still missing (issue 37)
    stage startup 300 startup
else
    skip startup "no SmolLM2 store"
fi
stage quant-weights 240 quant_weights

"$PY" scripts/device_check_report.py summary "$STAGES" "$WORK/tests.xml" "$RESULTS" "$WORK" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
rm -rf "$WORK"
exit "$rc"
