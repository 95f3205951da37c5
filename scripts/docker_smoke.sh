#!/usr/bin/env bash
# Container smoke test: build the Dockerfile on a local Debian bookworm base with the CPU
# torch wheel, start the server, wait for /health, and generate one image.
#
# Not part of CI (minutes: debootstrap, then an image build). Needs root and Debian's apt;
# installs podman, runc and debootstrap when missing. Re-runnable: the base image and the
# build's layer cache are kept, the container and the temporary build context are not.
#
# Environment:
#   TORCH_WHEEL   CPU torch 2.13.0 cp311 wheel (default: searched in $PIP_FIND_LINKS,
#                 /opt/wheels, then the whole disk)
#   IMAGE         tag to build (default: localhost/diffbatch:smoke)
#   HEALTH_TIMEOUT_S  seconds to wait for /health 200 (default: 180)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BASE_IMAGE=localhost/debian-bookworm:base
IMAGE=${IMAGE:-localhost/diffbatch:smoke}
HEALTH_TIMEOUT_S=${HEALTH_TIMEOUT_S:-180}
RUNC=/usr/sbin/runc
HOST_CA=/etc/ssl/certs/ca-certificates.crt

log() { printf 'docker smoke: %s\n' "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }

if [[ $(id -u) -ne 0 ]]; then
    exec sudo --preserve-env=TORCH_WHEEL,IMAGE,HEALTH_TIMEOUT_S,PIP_FIND_LINKS "$0" "$@"
fi

work=$(mktemp -d /var/tmp/diffbatch-smoke.XXXXXX)
container=""
cleanup() {
    if [[ -n $container ]]; then
        podman --runtime "$RUNC" rm -f "$container" >/dev/null 2>&1 || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# --- tools ------------------------------------------------------------------------------
missing=()
command -v podman >/dev/null || missing+=(podman)
[[ -x $RUNC ]] || missing+=(runc)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# crun (podman's default runtime) fails on this kind of host's cgroups and rlimits.
if [[ ! -e /etc/containers/containers.conf ]]; then
    log "writing /etc/containers/containers.conf"
    mkdir -p /etc/containers
    cat >/etc/containers/containers.conf <<'EOF'
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
EOF
fi

# --- base image -------------------------------------------------------------------------
if ! podman image exists "$BASE_IMAGE"; then
    log "building $BASE_IMAGE with debootstrap (a few minutes)"
    rootfs="$work/rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian
    tar -C "$rootfs" -c . | podman import - "$BASE_IMAGE" >/dev/null
    rm -rf "$rootfs"
fi

# --- build context: the repo without .venv/.git, plus the CPU torch wheel ----------------
find_wheel() {
    local dir
    for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
        dir=${dir#file://}
        compgen -G "$dir/torch-2.13.0+cpu-cp311-*.whl" | head -n1 && return 0
    done
    find / -xdev -name 'torch-2.13.0+cpu-cp311-*.whl' -print -quit 2>/dev/null
}
wheel=${TORCH_WHEEL:-$(find_wheel || true)}
[[ -n $wheel && -f $wheel ]] || die "no CPU torch 2.13.0 cp311 wheel found; set TORCH_WHEEL"

context="$work/context"
mkdir -p "$context/wheels"
tar -C "$REPO" -c \
    --exclude=./.venv --exclude=./.git --exclude=./outputs \
    --exclude=__pycache__ --exclude=.mypy_cache --exclude=.ruff_cache --exclude=.pytest_cache \
    . | tar -C "$context" -x
cp "$wheel" "$context/wheels/"

# pip inside the build trusts the host's CA bundle, mounted at a neutral path (mounting it
# over the image's /etc/ssl/certs would break the ca-certificates package).
cat >"$work/pip.conf" <<'EOF'
[global]
cert = /run/host-ca.crt
timeout = 180
EOF

log "building $IMAGE from $context"
build_start=$SECONDS
nice -n 10 podman build \
    --runtime "$RUNC" --isolation chroot --network host --format docker \
    -v "$HOST_CA:/run/host-ca.crt:ro" \
    -v "$work/pip.conf:/etc/pip.conf:ro" \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    --build-arg TORCH_SPEC="./wheels/$(basename "$wheel")" \
    -t "$IMAGE" "$context"
log "build took $((SECONDS - build_start)) s"
rm -rf "$context"

# --- run --------------------------------------------------------------------------------
# Port 8000 (the image's HEALTHCHECK port) when it is free, else any free port.
port=$(python3 - <<'EOF'
import socket
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: TIME_WAIT is free
try:
    s.bind(("127.0.0.1", 8000))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])
s.close()
EOF
)
container="diffbatch-smoke-$$"
log "starting $container on port $port"
# --health-interval disable: no healthcheck timer (it needs systemd; podman 4.3 still tries and
# logs harmless 'unable to get systemd connection' errors). `healthcheck run` works regardless.
podman --runtime "$RUNC" run -d --name "$container" --network host --health-interval disable \
    "$IMAGE" --config /opt/diffbatch/configs/tiny-sd.yaml --port "$port" >/dev/null

url="http://127.0.0.1:$port"
deadline=$((SECONDS + HEALTH_TIMEOUT_S))
until [[ $(curl -s -o /dev/null -w '%{http_code}' "$url/health" || true) == 200 ]]; do
    if [[ $(podman inspect -f '{{.State.Running}}' "$container") != true ]]; then
        podman logs "$container" >&2 || true
        die "container exited before /health was ready"
    fi
    if ((SECONDS >= deadline)); then
        podman logs "$container" >&2 || true
        die "/health not 200 within ${HEALTH_TIMEOUT_S} s"
    fi
    sleep 2
done
log "/health 200 after $((HEALTH_TIMEOUT_S - (deadline - SECONDS))) s"

if [[ $port == 8000 ]]; then
    podman --runtime "$RUNC" healthcheck run "$container" >/dev/null \
        || die "the image's HEALTHCHECK failed"
    log "HEALTHCHECK healthy"
fi

response=$(curl -sS --fail-with-body -X POST "$url/v1/images/generations" \
    -H 'Content-Type: application/json' \
    -d '{"prompt":"a cat","size":"64x64","num_inference_steps":2}') \
    || { podman logs "$container" >&2 || true; die "generation request failed: $response"; }
RESPONSE=$response python3 - <<'EOF' || die "bad generation response"
import base64, json, os
body = json.loads(os.environ["RESPONSE"])
png = base64.b64decode(body["data"][0]["b64_json"])
assert png.startswith(b"\x89PNG"), png[:8]
print(f"docker smoke: generated a {len(png)}-byte PNG")
EOF

echo "docker smoke: OK"
echo "image: $IMAGE $(podman image inspect --format '{{.Id}}' "$IMAGE")"
