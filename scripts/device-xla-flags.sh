#!/usr/bin/env bash
# Which layer mode and XLA GPU options shorten hkserve's decode step (docs/benchmarks.md, "GPU"): the random
# Llama 3.2 1B at 1 and 64 slots, timed by scripts/device_profile.py under each setting, one process (and
# compile) each. The first H200 trace showed three copies of the layer's MLP weights per layer (the scanned
# layer stack's dynamic slices: `--layers loop` reads per-layer weights instead, hkserve/model/layer_loop.py),
# a host-driven while loop over layers, and the sampler's lax.cond waiting on the device (command buffers
# with conditionals and loops run those on the GPU).
# usage (on the GPU machine, wheels installed): bash scripts/device-xla-flags.sh [SECONDS_EACH]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EACH=${1:-45}
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE"
# name|layers|XLA_FLAGS
VARIANTS=(
    "scan|scan|"
    "loop|loop|"
    "scan+command-buffers|scan|$CB"
    "loop+command-buffers|loop|$CB"
)
for variant in "${VARIANTS[@]}"; do
    IFS="|" read -r name layers flags <<<"$variant"
    start=$(date +%s)
    lines=$(XLA_FLAGS="$flags" timeout "$EACH" "$PY" scripts/device_profile.py --random "${RANDOM_MODEL:-llama3.2-1b}" \
        --layers "$layers" --slots "${SLOTS:-1,64}" --max-len "${MAX_LEN:-2048}" --steps 32 --trace-steps 0 \
        --out "/tmp/xla-flags/$name" 2>/dev/null | grep '^{"' | tr '\n' ' ')
    echo "$name ($(($(date +%s) - start)) s): ${lines:-failed or out of time}"
done
