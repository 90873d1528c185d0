#!/usr/bin/env bash
# Which XLA GPU options shorten hkserve's decode step (docs/benchmarks.md, "GPU"): the random Llama 3.2 1B
# at 1 slot, timed by scripts/device_profile.py under each setting, one process (and compile) each.
# The H200 trace showed three copies of the layer's MLP weights per layer (the scanned layer stack's
# dynamic slices), a host-driven while loop over layers, and the sampler's lax.cond waiting on the device.
# usage (on the GPU machine, wheels installed): bash scripts/device-xla-flags.sh [SECONDS_EACH]
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EACH=${1:-35}
CB=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE
NAMES=(baseline dynamic-slice-fusion graphs-with-loops unroll-layers unroll+graphs)
FLAGS=(
    ""
    "--xla_gpu_enable_dynamic_slice_fusion=true"
    "--xla_gpu_enable_command_buffer=$CB"
    "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL"
    "--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL --xla_gpu_enable_command_buffer=$CB"
)
for i in "${!NAMES[@]}"; do
    start=$(date +%s)
    line=$(XLA_FLAGS="${FLAGS[$i]}" timeout "$EACH" "$PY" scripts/device_profile.py --random "${RANDOM_MODEL:-llama3.2-1b}" \
        --slots 1 --max-len "${MAX_LEN:-2048}" --steps 32 --trace-steps 0 --out "/tmp/xla-flags/${NAMES[$i]}" 2>/dev/null | head -n 1)
    echo "${NAMES[$i]} ($(($(date +%s) - start)) s): ${line:-failed or out of time}"
done
