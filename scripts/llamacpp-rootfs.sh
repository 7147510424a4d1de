#!/bin/sh
# Make a real llama.cpp engine for the tests without building it: a Debian forky (testing)
# minbase rootfs with Debian's llama.cpp-tools (not in bookworm or trixie; it needs a newer
# glibc than this host has), and a `llama-server` wrapper that runs the rootfs's llama-server
# through the rootfs's own dynamic loader and libraries.
#
# Usage: scripts/llamacpp-rootfs.sh DIR
#   DIR            the rootfs (made if missing, refreshed if an older recipe made it)
#   DIR/../bin/llama-server   the wrapper; its path is printed on stdout
#   DIR/../lib     a link to the rootfs's /usr/lib: DIR/.. is then an install prefix
#
# The wrapper takes llama-server's own arguments; paths (the model) are the host's. It runs
# as any user, with no chroot or mount, so llmgw's unprivileged engine sandbox can run it (a
# chroot cannot run there). The first build needs root (debootstrap).
#
# Environment: LLMGW_TEST_CACHE (default /var/cache/llmgw-test), LLMGW_DEBIAN_MIRROR (default:
# the first Debian mirror in /etc/apt/sources.list*).
#
# Re-runs are cheap: the rootfs tarball is cached, keyed by the recipe that made it, and DIR
# is unpacked again only when its marker names another recipe.
set -eu

SUITE=forky
# bookworm's debootstrap has no script for forky; sid's is the same recipe.
SUITE_SCRIPT=/usr/share/debootstrap/scripts/sid
INCLUDE=llama.cpp-tools,ca-certificates
MARKER=.llmgw-llamacpp-rootfs

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. what is needed, whatever the caches hold
check_tools() {
    [ "$(id -u)" -eq 0 ] || fatal "the llama.cpp rootfs needs root (debootstrap, its files' owners); run as root"
    for tool in tar flock find; do
        command -v "$tool" >/dev/null 2>&1 || fatal "no $tool command; apt-get install -y util-linux findutils tar"
    done
}

rootfs_is_current() {
    [ -f "$ROOTFS/$MARKER" ] && [ "$(cat "$ROOTFS/$MARKER")" = "$ROOTFS_KEY" ] \
        && [ -x "$ROOTFS/usr/bin/llama-server" ]
}

# 2. the rootfs tarball, from the cache or debootstrap (about 45 s, 280 MB)
ensure_tarball() {
    ROOTFS_TAR=$CACHE/rootfs-$SUITE-llamacpp-$ROOTFS_KEY.tar
    rootfs_tarball "$ROOTFS_TAR" "$SUITE" "$INCLUDE" "$SUITE_SCRIPT" has_llama_server
}

has_llama_server() {
    [ -x "$1/usr/bin/llama-server" ] \
        || fatal "debootstrap ran but the rootfs has no /usr/bin/llama-server (did llama.cpp-tools move?)"
}

# 3. DIR, unpacked from the tarball next to where it goes, then moved into place
unpack_rootfs() {
    if [ -e "$ROOTFS" ]; then
        [ -f "$ROOTFS/$MARKER" ] \
            || fatal "$ROOTFS exists and was not made by this script; give another DIR or remove it"
    fi
    parent=$(dirname "$ROOTFS")
    mkdir -p "$parent"
    stage=$(mktemp -d "$parent/.rootfs.XXXXXX")
    TO_CLEAN="$TO_CLEAN $stage"
    info "rootfs: unpacking into $ROOTFS"
    tar --numeric-owner -C "$stage" -xf "$ROOTFS_TAR"
    printf '%s\n' "$ROOTFS_KEY" >"$stage/$MARKER"
    if [ -e "$ROOTFS" ]; then
        mv "$ROOTFS" "$stage.old"
        TO_CLEAN="$TO_CLEAN $stage.old"
    fi
    mv "$stage" "$ROOTFS"
}

# 4. the wrapper, replaced atomically when its text changes
install_wrapper() {
    bindir=$(dirname "$ROOTFS")/bin
    mkdir -p "$bindir"
    # bin/ beside lib/: an install prefix, which llmgw's engine sandbox binds whole.
    ln -sfn "$(basename "$ROOTFS")/usr/lib" "$(dirname "$ROOTFS")/lib"
    WRAPPER=$bindir/llama-server
    staged=$(mktemp "$bindir/.llama-server.XXXXXX")
    TO_CLEAN="$TO_CLEAN $staged"
    write_wrapper >"$staged"
    chmod 0755 "$staged"
    if [ -f "$WRAPPER" ] && cmp -s "$staged" "$WRAPPER"; then
        info "wrapper: $WRAPPER is up to date"
        return 0
    fi
    mv "$staged" "$WRAPPER"
    info "wrapper: $WRAPPER installed"
}

write_wrapper() {
    quoted=$(printf '%s' "$ROOTFS" | sed "s/'/'\\\\''/g")
    loader=$(find_loader)
    triplet=$(basename "$(find "$ROOTFS/usr/lib" -maxdepth 1 -name '*-linux-gnu' | head -n 1)")
    cat <<EOF
#!/bin/sh
# llama-server of the $SUITE rootfs below, run by that rootfs's own dynamic loader with its
# libraries; made by scripts/llamacpp-rootfs.sh. No chroot and no mounts: it runs as any user,
# inside llmgw's unprivileged engine sandbox too (which binds this folder's parent, the
# engine's install prefix: bin/, lib/ and the rootfs).
set -eu
ROOTFS='$quoted'
LIB="\$ROOTFS/usr/lib/$triplet"
LOADER="\$ROOTFS$loader"
EOF
    cat <<'EOF'
# ggml looks for its CPU back-ends in the folder it was built for, which is the rootfs's, not
# this host's: name the baseline one (every x86-64 runs it).
GGML_BACKEND_PATH="$LIB/ggml/backends0/libggml-cpu-x64.so"
export GGML_BACKEND_PATH
# exec all the way: the server keeps this process's pid, so the agent's signals reach it.
exec "$LOADER" --library-path "$LIB/llama:$LIB" "$ROOTFS/usr/bin/llama-server" "$@"
EOF
}

# The rootfs's dynamic loader, as a path inside it (/usr/lib64/ld-linux-x86-64.so.2).
find_loader() {
    for candidate in "$ROOTFS"/usr/lib64/ld-linux*.so.* "$ROOTFS"/usr/lib/ld-linux*.so.*; do
        if [ -f "$candidate" ]; then
            printf '%s\n' "${candidate#"$ROOTFS"}"
            return 0
        fi
    done
    fatal "no dynamic loader (ld-linux*.so.*) in $ROOTFS/usr/lib64 or $ROOTFS/usr/lib"
}

main() {
    [ $# -eq 1 ] || fatal "usage: $0 DIR (the rootfs; the wrapper goes in DIR/../bin)"
    case $1 in
        /*) ROOTFS=$1 ;;
        *) ROOTFS=$(pwd)/$1 ;;
    esac
    ROOTFS=${ROOTFS%/}
    case $ROOTFS in *[[:space:]]*) fatal "DIR must not contain white space: $ROOTFS" ;; esac
    SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    CACHE=$TEST_CACHE
    ROOTFS_KEY=$(printf 'debootstrap --variant=minbase --include=%s %s %s %s\n' \
        "$INCLUDE" "$SUITE" "$SUITE_SCRIPT" "$(uname -m)" | sha)
    remove_on_exit

    check_tools
    if ! rootfs_is_current; then
        # One build at a time (test runs may start together), locked on this very script
        # (a read-only lock needs no writable place); the first build may serve the others.
        exec 9<"$SELF"
        flock 9
        if ! rootfs_is_current; then
            ensure_tarball
            unpack_rootfs
        fi
    fi
    info "rootfs: $ROOTFS is current (recipe $(printf '%s' "$ROOTFS_KEY" | cut -c1-12)...)"
    install_wrapper
    printf '%s\n' "$WRAPPER"
}

main "$@"
