#!/bin/sh
# Build the agent's OCI image (README "The agent as a container") from the one-file binary
# `make dist` leaves in dist/llmgw-linux-x64, without any registry: the base is a minimal
# Debian bookworm rootfs (debootstrap --variant=minbase with bubblewrap, for the engine
# sandbox, and ca-certificates) that is `docker import`ed, and `docker build --network none`
# adds the binary. The image runs `llmgw agent` as the user llmgw-agent (uid and gid
# AGENT_UID below, fixed: the state volume and the docker proxy's socket are owned by it);
# the docker proxy of packaging/compose/compose.yaml runs from the same image as
# llmgw-docker-proxy (PROXY_UID), and runtime: docker may run it as the sim engine's image.
#
# Usage: scripts/agent-image.sh [--tag IMAGE] [--binary FILE]     (make image [IMAGE=...])
#        prints IMAGE (default llmgw-agent:VERSION, also tagged llmgw-agent:latest)
#
# --binary: the one-file llmgw to put in the image (default dist/llmgw-linux-x64; x86-64 only,
# the rootfs is this machine's architecture).
#
# Environment: LLMGW_TEST_CACHE (default /var/cache/llmgw-test: the rootfs tarball),
# LLMGW_DEBIAN_MIRROR (default: the first Debian mirror in /etc/apt/sources.list*).
#
# Re-runs are cheap: the rootfs tarball is cached, keyed by its recipe; the base image is
# kept; IMAGE is rebuilt only when the hash of the binary, this script and the rootfs recipe
# differs from its label. No RUN step: everything the image needs beyond the binary is made
# in the rootfs, so the build runs no program in it.
set -eu

SUITE=bookworm
INCLUDE=bubblewrap,ca-certificates
# Fixed ids, not from a range a host's own users come from, and distinct, so that files in
# volumes and processes seen from the host are the agent's (or the proxy's) alone.
AGENT_UID=17443
PROXY_UID=17444
# Bump when fit_for_agent changes what the rootfs holds.
RECIPE=2
HASH_LABEL=llmgw.agent-image.hash

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. arguments and what is needed
parse_args() {
    IMAGE=""
    BINARY=dist/llmgw-linux-x64
    while [ $# -gt 0 ]; do
        case $1 in
            --tag)
                [ $# -ge 2 ] || fatal "--tag needs an image name, e.g. --tag llmgw-agent:0.1.0"
                IMAGE=$2
                shift
                ;;
            --binary)
                [ $# -ge 2 ] || fatal "--binary needs a file, e.g. --binary dist/llmgw-linux-x64"
                BINARY=$2
                shift
                ;;
            -h | --help) usage ;;
            *) fatal "unknown argument '$1'; usage: $0 [--tag IMAGE] [--binary FILE]" ;;
        esac
        shift
    done
}

check_inputs() {
    [ "$(uname -m)" = x86_64 ] \
        || fatal "the agent image is built for x86-64 on an x86-64 machine (this one is $(uname -m))"
    [ -f "$BINARY" ] || fatal "no $BINARY; build it first: make dist (as root)"
    [ -x "$BINARY" ] || fatal "$BINARY is not executable; rebuild it: make dist"
    require_dockerd
    VERSION=$(TMPDIR=${TMPDIR:-/tmp} "$BINARY" --version 2>/dev/null | awk '{ print $NF }') \
        || true
    [ -n "$VERSION" ] || fatal "$BINARY --version printed no version; rebuild it: make dist"
    [ -n "$IMAGE" ] || IMAGE=llmgw-agent:$VERSION
}

# 2. the keys of what is cached
compute_keys() {
    ROOTFS_KEY=$(printf '%s\n' "$RECIPE" "$SUITE" "$INCLUDE" "$AGENT_UID" "$PROXY_UID" "$(uname -m)" \
        | sha)
    HASH=$({
        printf '%s\n' "$ROOTFS_KEY"
        sha256sum "$SELF" "$BINARY" | cut -c1-64
    } | sha)
}

image_is_current() {
    label=$(docker image inspect --format "{{ index .Config.Labels \"$HASH_LABEL\" }}" "$IMAGE" 2>/dev/null) \
        || return 1
    [ "$label" = "$HASH" ]
}

# 3. the rootfs tarball, from the cache or debootstrap (about 40 s)
ensure_rootfs() {
    ROOTFS_TAR=$TEST_CACHE/rootfs-$SUITE-agentimage-$ROOTFS_KEY.tar
    rootfs_tarball "$ROOTFS_TAR" "$SUITE" "$INCLUDE" "" fit_for_agent
}

# What the image needs beyond the packages, made in the rootfs (no RUN step in the build).
fit_for_agent() {
    r=$1
    # The users, as the packages make llmgw-agent: no login, no home; each its own group of
    # the same id. Not --system: the ids are above the system range on purpose.
    groupadd --root "$r" --gid "$AGENT_UID" llmgw-agent
    groupadd --root "$r" --gid "$PROXY_UID" llmgw-docker-proxy
    useradd --root "$r" --uid "$AGENT_UID" --gid llmgw-agent --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin --comment "llmgw node agent" llmgw-agent
    # The proxy gives its socket to the agent's group: chown to a group needs membership.
    useradd --root "$r" --uid "$PROXY_UID" --gid llmgw-docker-proxy --groups llmgw-agent \
        --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
        --comment "llmgw docker proxy" llmgw-docker-proxy
    # The agent's state and TMPDIR (the one-file build unpacks itself there at every start),
    # 0700 as the unit's StateDirectory=; the compose file mounts volumes here, and a fresh
    # named volume takes the owner and mode of the folder it covers.
    install -d -m 0700 -o "$AGENT_UID" -g "$AGENT_UID" "$r/var/lib/llmgw-agent" \
        "$r/var/lib/llmgw-agent-tmp"
    install -d -m 0755 -o "$AGENT_UID" -g "$AGENT_UID" "$r/srv/llmgw" "$r/srv/llmgw/models" \
        "$r/srv/llmgw/cache"
    install -d -m 0755 -o "$PROXY_UID" -g "$PROXY_UID" "$r/run/llmgw-docker-proxy"
    install -d -m 0700 -o "$PROXY_UID" -g "$PROXY_UID" "$r/var/lib/llmgw-docker-proxy"
    install -d -m 0755 "$r/etc/llmgw"
    # Smaller, and nothing in it gains privilege: no documentation, manuals or translations
    # (dpkg is told to skip them should anyone install a package into a derived image), no
    # set-id programs (no-new-privileges ignores them anyway).
    rm -rf "$r"/usr/share/doc/* "$r"/usr/share/man/* "$r"/usr/share/info/* \
        "$r"/usr/share/locale/* "$r"/usr/share/lintian "$r"/var/cache/debconf/*-old \
        "$r"/var/lib/dpkg/*-old "$r"/var/log/*.log
    cat >"$r/etc/dpkg/dpkg.cfg.d/llmgw-nodoc" <<'EOF'
path-exclude=/usr/share/doc/*
path-exclude=/usr/share/man/*
path-exclude=/usr/share/info/*
path-exclude=/usr/share/locale/*
EOF
    find "$r" -xdev -type f -perm /6000 -exec chmod ug-s {} +
    # No network in the build, and none needed: apt knows no sources until one is added.
    rm -f "$r/etc/apt/sources.list"
    : >"$r/etc/machine-id"
}

# 4. the base image, imported from the rootfs
ensure_base_image() {
    import_base_image llmgw-agent-base
}

# 5. the image: the binary on the base
build_image() {
    STAGE=$(mktemp -d)
    TO_CLEAN="$TO_CLEAN $STAGE"
    cp "$BINARY" "$STAGE/llmgw"
    chmod 0755 "$STAGE/llmgw"
    revision=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    cat >"$STAGE/Dockerfile" <<EOF
FROM $BASE
LABEL $HASH_LABEL=$HASH \\
      org.opencontainers.image.title="llmgw agent" \\
      org.opencontainers.image.description="The llmgw node agent (README: The agent as a container)" \\
      org.opencontainers.image.version="$VERSION" \\
      org.opencontainers.image.revision="$revision" \\
      org.opencontainers.image.licenses="Apache-2.0"
COPY llmgw /usr/bin/llmgw
# LLMGW_AGENT_CONTAINER: 'llmgw agent join' then says to start the container, not a unit.
ENV PATH=/usr/bin:/bin:/usr/sbin:/sbin \\
    TMPDIR=/var/lib/llmgw-agent-tmp \\
    LLMGW_AGENT_CONFIG=/etc/llmgw/agent.yaml \\
    LLMGW_AGENT_CONTAINER=1
USER $AGENT_UID:$AGENT_UID
WORKDIR /var/lib/llmgw-agent
# No ENTRYPOINT: a command is a whole llmgw command line, as printed ('docker run IMAGE llmgw
# agent join ...'), and the docker runtime can run this image as the sim engine's (it gives
# 'llmgw engine sim ...').
CMD ["llmgw", "agent"]
EOF
    info "image: docker build -t $IMAGE (no network)"
    DOCKER_BUILDKIT=0 docker build --network none --force-rm --tag "$IMAGE" "$STAGE" \
        >"$STAGE/build.log" 2>&1 \
        || { tail -n 30 "$STAGE/build.log" >&2; fatal "docker build failed (log above)"; }
    docker image prune --force --filter "label=$HASH_LABEL" >/dev/null 2>&1 || true
}

main() {
    SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    parse_args "$@"
    cd "$(dirname "$0")/.."
    remove_on_exit
    check_inputs
    compute_keys
    if ! image_is_current; then
        # One build at a time (test runs may start together), locked on this very script.
        exec 9<"$SELF"
        flock 9
        if ! image_is_current; then
            ensure_base_image
            build_image
            info "image: $IMAGE built"
        fi
    fi
    case $IMAGE in
        llmgw-agent:"$VERSION") docker tag "$IMAGE" llmgw-agent:latest ;;
    esac
    size=$(docker image inspect --format '{{ .Size }}' "$IMAGE")
    info "image: $IMAGE is up to date ($((size / 1000000)) MB; label $HASH_LABEL=$(printf '%s' "$HASH" | cut -c1-12)...)"
    printf '%s\n' "$IMAGE"
}

main "$@"
