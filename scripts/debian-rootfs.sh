#!/bin/sh
# A plain Debian rootfs (debootstrap --variant=minbase, nothing added) to run a built llmgw in
# with chroot: the proof that it starts on that release's glibc with that release's libraries
# alone. tests/packaging/ run the frozen binaries in bullseye (glibc 2.31, the oldest target).
#
# Usage: scripts/debian-rootfs.sh SUITE [amd64|arm64]     prints the rootfs directory
#
# Environment: LLMGW_TEST_CACHE (default /var/cache/llmgw-test; rootfs go to its rootfs/),
# LLMGW_DEBIAN_MIRROR (default: the first Debian mirror in /etc/apt/sources.list*).
#
# The rootfs is cached, keyed by suite and architecture; only the first call debootstraps
# (about 50 s; an arm64 one, emulated by qemu-user, about 5 min). Needs root then.
set -eu

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. what an emulated (arm64) rootfs needs: qemu-user registered with binfmt_misc
enable_qemu() {
    if ! command -v qemu-aarch64-static >/dev/null 2>&1 || ! command -v update-binfmts >/dev/null 2>&1; then
        apt_install qemu-user-static binfmt-support
    fi
    [ -e /proc/sys/fs/binfmt_misc/status ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
        || fatal "cannot mount binfmt_misc; arm64 programs cannot run here"
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 \
        || fatal "cannot register qemu-aarch64 with binfmt_misc (update-binfmts --enable qemu-aarch64)"
}

# binfmt_misc runs arm64 programs through an interpreter path that must exist in the chroot.
install_qemu() {
    mkdir -p "$1/usr/bin"
    cp "$(command -v qemu-aarch64-static)" "$1/usr/bin/"
    interpreter=$(sed -n 's/^interpreter //p' /proc/sys/fs/binfmt_misc/qemu-aarch64)
    case $interpreter in
        /usr/bin/qemu-aarch64-static | "") ;;
        *) mkdir -p "$1$(dirname "$interpreter")" && ln -sf /usr/bin/qemu-aarch64-static "$1$interpreter" ;;
    esac
}

# 2. the rootfs, from the cache or debootstrap
make_rootfs() {
    [ "$(id -u)" -eq 0 ] || fatal "debootstrap needs root; run as root or fill $CACHE first"
    command -v debootstrap >/dev/null 2>&1 || apt_install debootstrap
    mirror=$(debian_mirror)
    cache_workdir "$CACHE"
    info "rootfs: debootstrap --arch=$ARCH --variant=minbase $SUITE from $mirror"
    if [ "$ARCH" = "$(dpkg --print-architecture 2>/dev/null || echo amd64)" ]; then
        run_debootstrap --arch="$ARCH" --variant=minbase "$SUITE" "$work/rootfs" "$mirror"
    else
        run_debootstrap --foreign --arch="$ARCH" --variant=minbase "$SUITE" "$work/rootfs" "$mirror"
        install_qemu "$work/rootfs"
        debootstrap_second_stage "$work/rootfs"
    fi
    drop_apt_caches "$work/rootfs"
    touch "$work/rootfs/.llmgw-ready"
    mv "$work/rootfs" "$ROOTFS"
}

main() {
    if [ $# -lt 1 ] || [ $# -gt 2 ]; then
        fatal "usage: $0 SUITE [amd64|arm64]"
    fi
    SUITE=$1
    ARCH=${2:-amd64}
    case $ARCH in amd64 | arm64) ;; *) fatal "architecture $ARCH: use amd64 or arm64" ;; esac
    CACHE=$TEST_CACHE/rootfs
    ROOTFS=$CACHE/$SUITE-$ARCH-minbase
    remove_on_exit
    if [ "$ARCH" = arm64 ] && [ "$(uname -m)" != aarch64 ]; then
        [ "$(id -u)" -eq 0 ] && enable_qemu
        [ -f "$ROOTFS/.llmgw-ready" ] && [ "$(id -u)" -eq 0 ] && install_qemu "$ROOTFS"
    fi
    if [ ! -f "$ROOTFS/.llmgw-ready" ]; then
        # One debootstrap at a time (test runs may start together), locked on this script.
        exec 9<"$0"
        flock 9
        [ -f "$ROOTFS/.llmgw-ready" ] || make_rootfs
    fi
    printf '%s\n' "$ROOTFS"
}

main "$@"
