#!/usr/bin/env bash
# `make docker-check`: build the image and serve from it, as a user would, on a machine with no Docker
# Hub (Debian 12, root): a Debian base made here with mmdebstrap, the Dockerfile built on it with buildah,
# then `hkserve serve` run inside (CPU) with a model store mounted. Checks /health, the golden SmolLM2
# chat reply through the openai client, the server's user, the image's HEALTHCHECK command, and a clean
# exit on SIGTERM; prints the image size and each step's time. Not part of `make test` (minutes, root).
#
# Env: DOCKER_CHECK_DIR (work dir, default .docker-check: buildah's own image storage, the model store,
# logs), DOCKER_CHECK_CLEAN=1 (remove all of it first: a fresh machine's run),
# DOCKER_CHECK_CUDA=1 (also build the ACCEL=cuda12 image: several GB of wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=${DOCKER_CHECK_DIR:-$ROOT/.docker-check}
BASE_IMAGE=localhost/hkserve-debian-base:bookworm
IMAGE=localhost/hkserve:cpu
CUDA_IMAGE=localhost/hkserve:cuda12
CA=/etc/ssl/certs/ca-certificates.crt  # pip in a build reaches PyPI only with the host's CA bundle
PY=$ROOT/.venv/bin/python
# Its own storage: its images and layer cache are apart from any other buildah user's, and a clean run
# removes exactly them.
BUILDAH=(buildah --root "$WORK/storage" --runroot "$WORK/runroot" --storage-driver overlay)
RUN=("${BUILDAH[@]}" run --isolation chroot)
STEPS=()
CTR="" SERVER_PID=""

step() {  # step NAME COMMAND...: run it, record its time
  local name=$1 start=$SECONDS
  shift
  echo "== $name" >&2
  "$@"
  STEPS+=("$(printf '%-28s %5ds' "$name" $((SECONDS - start)))")
}

fail() { echo "docker-check: FAIL: $*" >&2; exit 1; }

cleanup() {  # on a failure: stop the server this run started (the process on its port), then buildah run
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    local pid
    pid=$(server_pid)
    if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
    timeout 60 tail --pid="$SERVER_PID" -f /dev/null || kill "$SERVER_PID" 2>/dev/null || true
  fi
  if [ -n "$CTR" ]; then "${BUILDAH[@]}" rm "$CTR" >/dev/null 2>&1 || true; fi
}
trap cleanup EXIT

tools() {
  [ "$(id -u)" = 0 ] || fail "run as root (buildah's chroot isolation, mmdebstrap)"
  command -v buildah >/dev/null && command -v mmdebstrap >/dev/null && return
  apt-get update -qq && apt-get install -y -qq buildah mmdebstrap >/dev/null
}

clean() {
  if [ -d "$WORK/storage" ]; then
    "${BUILDAH[@]}" rm --all >/dev/null  # the containers of this storage only
    "${BUILDAH[@]}" rmi --all --force >/dev/null
  fi
  rm -rf "$WORK"
}

base_image() {  # a Debian 12 root filesystem from Debian's packages, imported as an image
  if "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/base.tar"
  local ctr
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$ctr" "$WORK/base.tar" / >/dev/null
  "${BUILDAH[@]}" config --cmd /bin/bash "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE_IMAGE" >/dev/null
  rm -f "$WORK/base.tar"
}

build() {  # build TAG [BUILD-ARG...]
  local tag=$1
  shift
  local args=()
  for a in "$@"; do args+=(--build-arg "$a"); done
  "${BUILDAH[@]}" bud --isolation chroot --format docker --layers --quiet -v "$CA:$CA:ro" \
    --build-arg "BASE=$BASE_IMAGE" "${args[@]}" -t "$tag" . >"$WORK/build-${tag##*:}.log" 2>&1 ||
    { tail -40 "$WORK/build-${tag##*:}.log" >&2; fail "build of $tag failed (log: $WORK/build-${tag##*:}.log)"; }
}

config() {  # config FIELD: one field of the image's Docker config (Entrypoint, Cmd, Healthcheck), as JSON
  "${BUILDAH[@]}" inspect --type image "$IMAGE" | "$PY" -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["Docker"]["config"].get(sys.argv[1])))' "$1"
}

serve() {  # start the image's ENTRYPOINT + CMD in a container, the store mounted, flags set by env
  CTR=$("${BUILDAH[@]}" from --quiet "$IMAGE")
  PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local entrypoint cmd
  entrypoint=$(config Entrypoint) cmd=$(config Cmd)
  mapfile -t COMMAND < <("$PY" -c 'import json, sys; [print(a) for a in (json.loads(sys.argv[1]) or []) + (json.loads(sys.argv[2]) or [])]' "$entrypoint" "$cmd")
  [ "${#COMMAND[@]}" -gt 0 ] || fail "the image has no ENTRYPOINT or CMD"
  echo "   entrypoint: ${COMMAND[*]}; port $PORT" >&2
  "${RUN[@]}" -v "$WORK/models:/models" -v "$CA:$CA:ro" \
    --env HKSERVE_HOST=127.0.0.1 --env HKSERVE_PORT="$PORT" --env HKSERVE_SLOTS=2 --env HKSERVE_MAX_LEN=512 \
    "$CTR" -- "${COMMAND[@]}" >"$WORK/serve.log" 2>&1 &
  SERVER_PID=$!
}

wait_ready() {  # /health 200 (the first start pulls SmolLM2 into the store and compiles)
  "$PY" - "$PORT" "$SERVER_PID" <<'EOF' || { tail -30 "$WORK/serve.log" >&2; fail "/health never answered 200"; }
import os, sys, time, urllib.request
port, pid = int(sys.argv[1]), int(sys.argv[2])
deadline = time.monotonic() + 900
while time.monotonic() < deadline:
    if not os.path.exists(f"/proc/{pid}"):
        sys.exit("the server exited")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            if r.status == 200:
                sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit("timed out")
EOF
}

healthcheck() {  # the image's own HEALTHCHECK command, run inside the container
  local test
  test=$(config Healthcheck)
  echo "   HEALTHCHECK $test" >&2
  mapfile -t HC < <("$PY" -c 'import json, sys; t = json.loads(sys.argv[1])["Test"]; assert t[0] == "CMD", t; [print(a) for a in t[1:]]' "$test")
  [ "${#HC[@]}" -gt 0 ] || fail "the image has no HEALTHCHECK"
  "${RUN[@]}" --env HKSERVE_PORT="$PORT" "$CTR" -- "${HC[@]}" || fail "the HEALTHCHECK command failed"
}

server_pid() {  # the process listening on the port
  [ -n "${PORT:-}" ] || return 0
  ss -Htlnp "sport = :$PORT" | grep -o 'pid=[0-9]*' | head -1 | cut -d= -f2
}

check_user() {  # the server runs as the image's user, not root
  local pid uid want
  pid=$(server_pid)
  [ -n "$pid" ] || fail "no process listens on port $PORT"
  uid=$(awk '/^Uid:/ {print $2}' "/proc/$pid/status")
  want=$("${RUN[@]}" "$CTR" -- id -u hkserve)
  echo "   pid $pid ($(tr '\0' ' ' <"/proc/$pid/cmdline" | cut -c1-60)...) runs as uid $uid; image user hkserve = $want" >&2
  [ "$uid" = "$want" ] && [ "$uid" != 0 ] || fail "the server runs as uid $uid, not the image's user ($want)"
}

stop() {  # SIGTERM to the container's init (tini), as `docker stop` sends it: a drained exit 0
  local pid init rc=0
  pid=$(server_pid)
  init=$(awk '{print $4}' "/proc/$pid/stat")
  grep -q tini "/proc/$init/cmdline" || fail "the server's parent ($init) is not tini"
  kill -TERM "$init"
  timeout 120 tail --pid="$SERVER_PID" -f /dev/null || fail "no exit within 120 s of SIGTERM"
  wait "$SERVER_PID" || rc=$?
  SERVER_PID=""
  grep -q "draining" "$WORK/serve.log" || fail "the server did not drain"
  [ "$rc" = 0 ] || { tail -20 "$WORK/serve.log" >&2; fail "exit status $rc after SIGTERM"; }
  echo "   exit 0 after SIGTERM" >&2
}

tools
[ "${DOCKER_CHECK_CLEAN:-0}" = 1 ] && step "remove images and store" clean
mkdir -p "$WORK/models"
chown -R 1000:1000 "$WORK/models"  # the image's user owns the store (also what an earlier run left)
step "debian base (mmdebstrap)" base_image
step "build $IMAGE" build "$IMAGE"
step "serve: start" serve
step "serve: /health 200" wait_ready
step "HEALTHCHECK command" healthcheck
step "chat vs golden (openai)" "$PY" scripts/docker_check_chat.py "http://127.0.0.1:$PORT/v1"
step "non-root user" check_user
step "SIGTERM: drained exit" stop
[ "${DOCKER_CHECK_CUDA:-0}" = 1 ] && step "build $CUDA_IMAGE" build "$CUDA_IMAGE" ACCEL=cuda12

echo "== image sizes" >&2
"${BUILDAH[@]}" images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep -E 'hkserve' >&2
echo "== step times" >&2
printf '%s\n' "${STEPS[@]}" >&2
echo "docker-check: OK" >&2
