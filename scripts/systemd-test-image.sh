#!/bin/sh
# Build a local Docker image of Debian that boots systemd (/sbin/init), for the package tests
# (tests/packaging/: the .deb packages are installed, upgraded and purged in a container of
# it, and apt installs them from a signed repository served on its loopback) and the
# installer's dry run (tests/dryrun/: install-agent.sh's whole life cycle, with ufw, nft,
# lingering and sudo). No registry is used: the image is a debootstrap rootfs, `docker
# import`ed. bookworm by default; bullseye (systemd 247, the oldest llmgw supports) too.
#
# --docker: the node also runs a Docker engine of its own (docker.io; nested in the test
# container), for the dry run of `runtime: docker` (tests/dryrun/test_docker_engine.py). Two
# TEST-IMAGE-ONLY arrangements make dockerd work in a container that is not --privileged:
# /var/lib/docker is a tmpfs (overlay2 cannot stack on the container's own overlay root; a
# tmpfs, unlike a volume, leaves nothing behind when a killed run's container is removed), and
# before containerd and dockerd start, the cgroup v1 hierarchies Docker mounted read-only are
# remounted read-write in the container's own mount namespace (its cgroup namespace is
# private, so runc creates the engines' cgroups under the container's own; the host's mounts
# are untouched; root in the container could mount them itself anyway). A real node needs
# neither. Made for the cgroup v1 hosts MACHINES.md describes: on a cgroup v2 host the nested
# dockerd would also need its processes moved out of the container's root cgroup.
#
# --ssh: the node also runs sshd (openssh-server), for `llmgw ctl onboard` over ssh
# (tests/dryrun/test_onboard.py). The rootfs keeps no host key: each container makes its own at
# its first boot (a test-only unit before ssh.service), so that no two share one and a test can
# pin each container's key in its own known_hosts.
#
# --cloud-init: the node also has Debian's cloud-init, for the dry run of the user-data
# 'llmgw ctl join-command --cloud-init' prints (tests/dryrun/test_cloud_init.py): the NoCloud
# datasource only (a test puts its seed in /var/lib/cloud/seed/nocloud), enabled in a
# container (/etc/cloud/cloud-init.enabled; else its generator turns it off there), and
# the locale module off (the minimal rootfs has no locales, and it would fail). A test runs
# 'cloud-init clean' and restarts the container: that is the machine's first boot.
#
# Usage: scripts/systemd-test-image.sh [--suite bookworm|bullseye] [--docker | --ssh | --cloud-init]
#        [IMAGE] (default IMAGE llmgw-test-systemd:local, llmgw-test-systemd-bullseye:local,
#        with --docker llmgw-test-systemd-docker:local, llmgw-test-systemd-bullseye-docker:local,
#        with --ssh llmgw-test-systemd-ssh:local, llmgw-test-systemd-bullseye-ssh:local,
#        with --cloud-init llmgw-test-systemd-cloudinit:local, ...-bullseye-cloudinit:local)
#
# Environment: LLMGW_TEST_SUITE (the suite when --suite is not given), LLMGW_TEST_CACHE
# (default /var/cache/llmgw-test), LLMGW_DEBIAN_MIRROR (default: the first Debian mirror in
# /etc/apt/sources.list*).
#
# Re-runs are cheap: the rootfs tarball is cached, keyed by the recipe that made it, and the
# image is imported again only when its label differs from that key. Prints IMAGE.
#
# Run a container of it the way MACHINES.md found to work where --privileged does not:
#   docker run -d --cap-add=ALL --cap-drop=SYS_RESOURCE --security-opt seccomp=unconfined \
#     --security-opt apparmor=unconfined --cgroupns=private --tmpfs /run --tmpfs /run/lock \
#     --stop-signal=SIGRTMIN+3 --network none IMAGE /sbin/init
set -eu

SUITES="bookworm bullseye"
# python3: the stand-in program and the repository's HTTP server; rpm: the .rpm scriptlets.
# What install-agent.sh uses on a node: curl, ca-certificates, sudo, iproute2 (ss),
# dbus-user-session and libpam-systemd (lingering), ufw, nftables and firewalld (--firewall-from;
# firewalld is masked: a test that wants it unmasks and starts it, the others see plain nft),
# bubblewrap (the agent runs process engines in its sandbox; the packages depend on it).
INCLUDE=systemd,systemd-sysv,dbus,dbus-user-session,libpam-systemd,procps,python3,rpm,curl,ca-certificates,sudo,iproute2,ufw,nftables,firewalld,bash-completion,man-db,bubblewrap
KEY_LABEL=llmgw.test-systemd.key

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. what is needed, whatever the caches hold
check_tools() {
    require_dockerd
}

image_is_current() {
    label=$(docker image inspect --format "{{ index .Config.Labels \"$KEY_LABEL\" }}" "$IMAGE" 2>/dev/null) \
        || return 1
    [ "$label" = "$KEY" ]
}

# 2. the rootfs tarball, from the cache or debootstrap (about 50 s)
ensure_rootfs() {
    flavour=systemd
    [ "$DOCKER" = 0 ] || flavour=systemd-docker
    [ "$SSH" = 0 ] || flavour=systemd-ssh
    [ "$CLOUD_INIT" = 0 ] || flavour=systemd-cloudinit
    ROOTFS_TAR=$CACHE/rootfs-$SUITE-$flavour-$KEY.tar
    rootfs_tarball "$ROOTFS_TAR" "$SUITE" "$INCLUDE" "" fit_for_containers
}

fit_for_containers() {
    # With the sources debootstrap wrote, still.
    [ "$CLOUD_INIT" = 0 ] || fit_for_cloud_init "$1"
    # No network in the tests' containers: apt knows only the sources a test adds.
    rm -f "$1/etc/apt/sources.list"
    # A container has no console to log in on, and its machine id is made at boot.
    rm -f "$1/etc/systemd/system/getty.target.wants/"*
    : >"$1/etc/machine-id"
    # Installed, not running: ufw or plain nft are the other tests' firewalls.
    ln -sf /dev/null "$1/etc/systemd/system/firewalld.service"
    [ "$DOCKER" = 0 ] || fit_for_nested_docker "$1"
    [ "$SSH" = 0 ] || fit_for_sshd "$1"
}

# --ssh: no host key in the image; each container makes its own before sshd starts.
fit_for_sshd() {
    rm -f "$1"/etc/ssh/ssh_host_*
    units=$1/etc/systemd/system
    cat >"$units/llmgw-test-ssh-hostkeys.service" <<'EOF'
[Unit]
Description=Test image only: this container's own ssh host keys
DefaultDependencies=no
Before=ssh.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/usr/bin/ssh-keygen -A
EOF
    mkdir -p "$units/ssh.service.d"
    cat >"$units/ssh.service.d/llmgw-test.conf" <<'EOF'
[Unit]
Requires=llmgw-test-ssh-hostkeys.service
After=llmgw-test-ssh-hostkeys.service
EOF
}

# --cloud-init's arrangements (see the head of this file). cloud-init is installed by apt in
# the rootfs, not by debootstrap's --include, whose resolver fails to configure its Python
# dependencies (python3-cryptography) in bookworm.
fit_for_cloud_init() {
    cp /etc/resolv.conf "$1/etc/resolv.conf"
    mount -t proc proc "$1/proc"
    rc=0
    chroot "$1" sh -c 'export DEBIAN_FRONTEND=noninteractive; apt-get update -q >/dev/null &&
        apt-get install -y -q --no-install-recommends cloud-init >/dev/null' || rc=$?
    umount "$1/proc"
    [ "$rc" -eq 0 ] || fatal "apt-get install cloud-init failed in the rootfs (exit $rc); is the mirror reachable?"
    drop_apt_caches "$1"
    : >"$1/etc/resolv.conf"
    mkdir -p "$1/etc/cloud/cloud.cfg.d"
    cat >"$1/etc/cloud/cloud.cfg.d/90-llmgw-test.cfg" <<'EOF'
# Test image only: the seed a test writes, and no locale (the rootfs has none).
datasource_list: [ NoCloud, None ]
locale: false
EOF
    : >"$1/etc/cloud/cloud-init.enabled"
}

# The two test-only arrangements of --docker (see the head of this file).
fit_for_nested_docker() {
    units=$1/etc/systemd/system
    cat >"$units/var-lib-docker.mount" <<'EOF'
[Unit]
Description=Test image only: dockerd's storage on a tmpfs (overlay2 cannot stack on overlay)

[Mount]
What=tmpfs
Where=/var/lib/docker
Type=tmpfs
Options=mode=0711
EOF
    cat >"$units/llmgw-test-cgroups-rw.service" <<'EOF'
[Unit]
Description=Test image only: the cgroup v1 hierarchies writable for the nested dockerd
DefaultDependencies=no
ConditionVirtualization=container

[Service]
Type=oneshot
RemainAfterExit=yes
# $$: a literal $ for the shell (systemd expands $NAME itself).
ExecStart=/bin/sh -c 'for d in /sys/fs/cgroup/*/; do if mountpoint -q "$$d"; then mount -o remount,rw,bind "$$d"; fi; done'
EOF
    for unit in containerd docker; do
        mkdir -p "$units/$unit.service.d"
        cat >"$units/$unit.service.d/llmgw-test.conf" <<'EOF'
[Unit]
Requires=llmgw-test-cgroups-rw.service var-lib-docker.mount
After=llmgw-test-cgroups-rw.service var-lib-docker.mount
EOF
    done
}

# 3. the image, imported from the rootfs and labelled with its key
import_image() {
    info "image: docker import $ROOTFS_TAR $IMAGE"
    docker import --change "LABEL $KEY_LABEL=$KEY" --change 'CMD ["/sbin/init"]' \
        "$ROOTFS_TAR" "$IMAGE" >/dev/null
}

default_image() {
    suffix=""
    [ "$DOCKER" = 0 ] || suffix=-docker
    [ "$SSH" = 0 ] || suffix=-ssh
    [ "$CLOUD_INIT" = 0 ] || suffix=-cloudinit
    case $1 in
        bookworm) echo "llmgw-test-systemd$suffix:local" ;;
        *) echo "llmgw-test-systemd-$1$suffix:local" ;;
    esac
}

parse_args() {
    SUITE=${LLMGW_TEST_SUITE:-bookworm}
    IMAGE=""
    DOCKER=0
    SSH=0
    CLOUD_INIT=0
    while [ $# -gt 0 ]; do
        case $1 in
            --docker)
                DOCKER=1
                shift
                ;;
            --ssh)
                SSH=1
                shift
                ;;
            --cloud-init)
                CLOUD_INIT=1
                shift
                ;;
            --suite)
                [ $# -ge 2 ] || fatal "--suite needs one of: $SUITES"
                SUITE=$2
                shift 2
                ;;
            -*) fatal "usage: $0 [--suite bookworm|bullseye] [--docker | --ssh | --cloud-init] [IMAGE] (unknown option '$1')" ;;
            *)
                [ -z "$IMAGE" ] || fatal "usage: $0 [--suite bookworm|bullseye] [--docker | --ssh | --cloud-init] [IMAGE] (one IMAGE)"
                IMAGE=$1
                shift
                ;;
        esac
    done
    case " $SUITES " in
        *" $SUITE "*) ;;
        *) fatal "suite '$SUITE' is not one of: $SUITES" ;;
    esac
    [ "$((DOCKER + SSH + CLOUD_INIT))" -le 1 ] || fatal "--docker, --ssh and --cloud-init make different images: give one"
    [ -n "$IMAGE" ] || IMAGE=$(default_image "$SUITE")
}

main() {
    parse_args "$@"
    CACHE=$TEST_CACHE
    variant=""
    if [ "$DOCKER" = 1 ]; then
        INCLUDE=$INCLUDE,docker.io
        variant="; nested docker: /var/lib/docker tmpfs, cgroups remounted rw"
    fi
    if [ "$SSH" = 1 ]; then
        INCLUDE=$INCLUDE,openssh-server
        variant="; sshd: host keys made at first boot"
    fi
    if [ "$CLOUD_INIT" = 1 ]; then
        variant="; cloud-init by apt: NoCloud only, enabled, no locale"
    fi
    KEY=$(printf 'debootstrap --variant=minbase --include=%s %s %s; getty off; no sources; firewalld masked%s\n' \
        "$INCLUDE" "$SUITE" "$(uname -m)" "$variant" | sha)
    remove_on_exit

    check_tools
    if ! image_is_current; then
        # One build of an image at a time (test runs, or .ci/run's side-by-side builds, may
        # start together): a lock per recipe in the cache, so that other images build beside
        # it. Where the cache is not writable (root filled it; this run only imports a cached
        # rootfs), a read-only lock on this very script, which needs no writable place.
        if mkdir -p "$CACHE" 2>/dev/null && [ -w "$CACHE" ]; then
            exec 9>"$CACHE/.systemd-image-$KEY.lock"
        else
            exec 9<"$0"
        fi
        flock 9
        if ! image_is_current; then
            ensure_rootfs
            import_image
        fi
    fi
    info "image: $IMAGE is up to date ($KEY_LABEL=$(printf '%s' "$KEY" | cut -c1-12)...)"
    printf '%s\n' "$IMAGE"
}

main "$@"
