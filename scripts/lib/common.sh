#!/bin/sh
# What the scripts in scripts/ share, sourced (never run) relative to the script itself:
#     # shellcheck source=lib/common.sh
#     . "$(dirname "$0")/lib/common.sh"
# messages, arguments, clean-up on exit, the Debian mirror, apt installs and debootstrap into
# the test cache. POSIX sh; it sets DEFAULT_MIRROR and TEST_CACHE, defines functions, and runs
# nothing else.
#
# Only what runs on this host may use it: what a script runs inside a chroot or writes out for
# later (dist.sh's in_rootfs steps, llamacpp-rootfs.sh's wrapper) must stay self-contained, as
# must installer/install-agent.sh (the agent bundle carries it alone).
# The cache keys are the scripts' own (their recipes, or their text): a change here to what a
# rootfs holds must change those keys too.
#
# Environment: LLMGW_DEBIAN_MIRROR (debian_mirror), LLMGW_TEST_CACHE (TEST_CACHE).

DEFAULT_MIRROR=http://deb.debian.org/debian
# What the test and build scripts cache (rootfs, tarballs) goes below this.
# shellcheck disable=SC2034 # for the scripts
TEST_CACHE=${LLMGW_TEST_CACHE:-/var/cache/llmgw-test}

info() { printf '==> %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
fatal() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}

sha() { sha256sum | cut -c1-64; }

# The "Usage:" paragraph of the header comment of the script $SELF, then exit 2.
usage() {
    sed -n 's/^# \{0,1\}//; /^Usage:/,/^$/p' "$SELF" >&2
    exit 2
}

# $1 as an absolute path, relative to the current directory.
absolute() {
    case $1 in
        /*) printf '%s\n' "$1" ;;
        *) printf '%s/%s\n' "$(pwd)" "$1" ;;
    esac
}

# The paths in TO_CLEAN (made by mktemp: no white space) go when the script exits, however it
# exits; an interrupt exits 130. Scripts add to TO_CLEAN after calling this.
remove_on_exit() {
    TO_CLEAN=""
    trap remove_to_clean EXIT
    trap 'exit 130' INT TERM
}

remove_to_clean() {
    # shellcheck disable=SC2086 # a list of paths made by mktemp, without spaces
    rm -rf $TO_CLEAN
}

# A docker command and a dockerd it reaches.
require_dockerd() {
    command -v docker >/dev/null 2>&1 || fatal "no docker command; apt-get install -y docker.io"
    docker info >/dev/null 2>&1 \
        || fatal "cannot reach dockerd; start it (dockerd >/var/log/dockerd.log 2>&1 &) or join the 'docker' group"
}

# The Debian mirror: LLMGW_DEBIAN_MIRROR as given, else the main archive in apt's sources (its
# deb822 "URIs:" lines and one-line "deb [options] URI suite ..." entries; the first URI whose
# path ends in /debian, not -security, not third parties), else deb.debian.org; no slash at
# the end.
debian_mirror() {
    if [ -n "${LLMGW_DEBIAN_MIRROR:-}" ]; then
        printf '%s\n' "$LLMGW_DEBIAN_MIRROR"
        return 0
    fi
    uri=$(
        {
            cat /etc/apt/sources.list.d/*.sources 2>/dev/null | sed -n 's/^URIs:[[:space:]]*//p' | tr ' ' '\n'
            cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
                | sed -n 's/^deb[[:space:]]\{1,\}\(\[[^]]*\][[:space:]]\{1,\}\)\{0,1\}\([^[:space:]]*\).*/\2/p'
        } | grep -E '^https?://.*/debian/?$' | head -n 1
    ) || true
    printf '%s\n' "${uri:-$DEFAULT_MIRROR}" | sed 's:/*$::'
}

# apt-get install PACKAGE..., quietly; when that fails, once more after apt-get update.
apt_install() {
    info "installing $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}

# A fresh work directory $work under the folder $1 (made if missing), named .${2:-rootfs}.*,
# removed on exit (see remove_on_exit).
cache_workdir() {
    mkdir -p "$1"
    work=$(mktemp -d "$1/.${2:-rootfs}.XXXXXX")
    TO_CLEAN="$TO_CLEAN $work"
}

# debootstrap ARGUMENT... with its output in $work/debootstrap.log; when it fails, the log's
# last lines and a stop that names the mirror ($mirror, which the arguments should name too).
run_debootstrap() {
    debootstrap "$@" >>"$work/debootstrap.log" 2>&1 \
        || {
            tail -n 20 "$work/debootstrap.log" >&2
            fatal "debootstrap failed (log above); is $mirror reachable? (set LLMGW_DEBIAN_MIRROR)"
        }
}

# The second stage of a --foreign debootstrap into $1, in a chroot (an emulated one needs its
# qemu in there first), logged like run_debootstrap.
debootstrap_second_stage() {
    chroot "$1" /debootstrap/debootstrap --second-stage >>"$work/debootstrap.log" 2>&1 \
        || { tail -n 20 "$work/debootstrap.log" >&2; fatal "debootstrap's second stage failed (log above)"; }
}

# apt's downloaded packages and lists in rootfs $1: not wanted in a cached rootfs.
drop_apt_caches() {
    rm -rf "$1/var/cache/apt/archives/"*.deb "$1/var/lib/apt/lists/"*
}

# The rootfs tarball $1, from the cache or made now (needs root, about a minute): debootstrap
# --variant=minbase --include=$3 $2 from the Debian mirror (with debootstrap's suite script $4
# when given), apt's caches dropped, then the caller's function $5 (if given) run on the
# rootfs directory before it is packed. The tarball's folder holds the work directory.
rootfs_tarball() {
    if [ -f "$1" ]; then
        info "rootfs: cached $1"
        return 0
    fi
    cache=$(dirname "$1")
    [ "$(id -u)" -eq 0 ] || fatal "debootstrap needs root; run as root or fill $cache first"
    command -v debootstrap >/dev/null 2>&1 || fatal "no debootstrap; apt-get install -y debootstrap"
    [ -z "${4:-}" ] || [ -f "$4" ] || fatal "debootstrap has no $4; apt-get install -y debootstrap"
    mirror=$(debian_mirror)
    info "rootfs: debootstrap --variant=minbase --include=$3 $2 from $mirror"
    cache_workdir "$cache"
    run_debootstrap --variant=minbase --include="$3" "$2" "$work/rootfs" "$mirror" ${4:+"$4"}
    drop_apt_caches "$work/rootfs"
    [ -z "${5:-}" ] || "$5" "$work/rootfs"
    tar --numeric-owner -C "$work/rootfs" -cf "$work/rootfs.tar" .
    mv "$work/rootfs.tar" "$1"
}

# The base image $1:<the first 12 characters of $ROOTFS_KEY>, docker-imported once from the
# tarball the caller's ensure_rootfs makes as $ROOTFS_TAR; sets BASE.
import_base_image() {
    BASE=$1:$(printf '%s' "$ROOTFS_KEY" | cut -c1-12)
    if docker image inspect "$BASE" >/dev/null 2>&1; then
        info "base image: $BASE exists"
        return 0
    fi
    ensure_rootfs
    info "base image: docker import $ROOTFS_TAR $BASE"
    docker import "$ROOTFS_TAR" "$BASE" >/dev/null
}
