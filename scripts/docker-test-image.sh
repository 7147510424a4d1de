#!/bin/sh
# Build a local Docker image with llmgw installed, for the docker runtime's tests, without any
# registry: the base is a Debian bookworm rootfs made with debootstrap and `docker import`ed;
# llmgw and its dependencies are wheels made on this host and installed with --no-index.
#
# Usage: scripts/docker-test-image.sh IMAGE        (e.g. llmgw-test-engine:local)
#
# Environment: PYTHON (whose pip builds the wheels; default .venv/bin/python, else python3),
# LLMGW_TEST_CACHE (default /var/cache/llmgw-test), LLMGW_DEBIAN_MIRROR (default: the first
# Debian mirror in /etc/apt/sources.list*).
#
# Re-runs are cheap: the rootfs tarball is cached, keyed by the recipe that made it; the base
# image is kept; IMAGE is rebuilt only when the hash of this script and of llmgw's sources
# differs from its label. The image has no entrypoint: the runtime gives the command.
set -eu

SUITE=bookworm # its python3 is 3.11, the version the wheels are chosen for
INCLUDE=python3,python3-venv
HASH_LABEL=llmgw.test-image.hash

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. what is needed, whatever the caches hold
check_tools() {
    require_dockerd
    "$PYTHON" -m pip --version >/dev/null 2>&1 \
        || fatal "$PYTHON has no pip; set PYTHON to a Python with pip (e.g. .venv/bin/python after 'make venv')"
}

# 2. the content hash: this script and everything that goes into llmgw's wheel
content_hash() {
    {
        sha256sum "$SELF"
        sha256sum pyproject.toml README.md
        find llmgw -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha
}

image_is_current() {
    label=$(docker image inspect --format "{{ index .Config.Labels \"$HASH_LABEL\" }}" "$IMAGE" 2>/dev/null) \
        || return 1
    [ "$label" = "$HASH" ]
}

# 3. the rootfs tarball, from the cache or debootstrap (about 50 s)
ensure_rootfs() {
    ROOTFS_TAR=$CACHE/rootfs-$SUITE-$ROOTFS_KEY.tar
    rootfs_tarball "$ROOTFS_TAR" "$SUITE" "$INCLUDE"
}

# 4. the base image, imported from the rootfs
ensure_base_image() {
    import_base_image llmgw-test-base
}

# 5. wheels of llmgw and its dependencies for CPython 3.11 on x86-64 Linux
build_wheels() {
    wheels=$STAGE/context/wheels
    mkdir -p "$STAGE/src" "$STAGE/host" "$wheels"
    # From a clean copy: an in-tree build/ may hold modules that no longer exist.
    tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md llmgw \
        | tar -C "$STAGE/src" -xf -
    info "wheels: llmgw"
    "$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" "$STAGE/src" >"$STAGE/pip.log" 2>&1 \
        || { cat "$STAGE/pip.log" >&2; fatal "could not build llmgw's wheel"; }
    set -- "$wheels"/llmgw-*.whl
    llmgw_wheel=$1
    # Dependencies published only as source (sdnotify) become pure-Python wheels here; the
    # others are downloaded for the image's Python, whatever Python runs this.
    info "wheels: dependencies"
    "$PYTHON" -m pip wheel --quiet --wheel-dir "$STAGE/host" "$llmgw_wheel" >"$STAGE/pip.log" 2>&1 \
        || { cat "$STAGE/pip.log" >&2; fatal "could not resolve llmgw's dependencies"; }
    for wheel in "$STAGE/host"/*-none-any.whl; do
        case $(basename "$wheel") in llmgw-*) ;; *) cp "$wheel" "$wheels/" ;; esac
    done
    "$PYTHON" -m pip download --quiet --only-binary=:all: --python-version 3.11 \
        --implementation cp --abi cp311 --platform manylinux2014_x86_64 \
        --platform manylinux_2_28_x86_64 --find-links "$wheels" --dest "$wheels" "$llmgw_wheel" \
        >"$STAGE/pip.log" 2>&1 \
        || { cat "$STAGE/pip.log" >&2; fatal "could not download llmgw's dependencies for CPython 3.11"; }
}

# 6. the image: the wheels installed into /opt/llmgw, offline
build_image() {
    cat >"$STAGE/context/Dockerfile" <<EOF
FROM $BASE
LABEL $HASH_LABEL=$HASH
COPY wheels /tmp/llmgw-wheels
RUN python3 -m venv /opt/llmgw \\
 && PIP_DISABLE_PIP_VERSION_CHECK=1 /opt/llmgw/bin/pip install --quiet --no-index --no-cache-dir \\
    --find-links /tmp/llmgw-wheels llmgw \\
 && rm -rf /tmp/llmgw-wheels \\
 && /opt/llmgw/bin/llmgw --help >/dev/null
ENV PATH=/opt/llmgw/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
EOF
    info "image: docker build -t $IMAGE (no network)"
    DOCKER_BUILDKIT=0 docker build --network none --force-rm --tag "$IMAGE" "$STAGE/context" \
        >"$STAGE/build.log" 2>&1 \
        || { tail -n 30 "$STAGE/build.log" >&2; fatal "docker build failed (log above)"; }
    # The image this one replaces, now untagged, and the layers of failed builds (all of
    # them carry the label, which comes first).
    docker image prune --force --filter "label=$HASH_LABEL" >/dev/null 2>&1 || true
}

main() {
    [ $# -eq 1 ] || fatal "usage: $0 IMAGE (e.g. llmgw-test-engine:local)"
    IMAGE=$1
    SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    cd "$(dirname "$0")/.."
    if [ -z "${PYTHON:-}" ]; then
        if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
    fi
    CACHE=$TEST_CACHE
    ROOTFS_KEY=$(printf 'debootstrap --variant=minbase --include=%s %s %s\n' \
        "$INCLUDE" "$SUITE" "$(uname -m)" | sha)
    remove_on_exit

    check_tools
    HASH=$(content_hash)
    if ! image_is_current; then
        # One build at a time (test runs may start together), locked on this very script
        # (a read-only lock needs no writable place); the first build may serve the others.
        exec 9<"$SELF"
        flock 9
        image_is_current || build
    fi
    info "image: $IMAGE is up to date (label $HASH_LABEL=$(printf '%s' "$HASH" | cut -c1-12)...)"
    printf '%s\n' "$IMAGE"
}

build() {
    ensure_base_image
    STAGE=$(mktemp -d)
    TO_CLEAN="$TO_CLEAN $STAGE"
    build_wheels
    build_image
    info "image: $IMAGE built"
}

main "$@"
