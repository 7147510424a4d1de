#!/bin/sh
# Build the frozen llmgw for one architecture into dist/ (DESIGN §7): a PyInstaller one-file
# binary (the agent bundles' binary), a one-folder build (for the packages), the bundle
# llmgw-agent-<version>-linux-<arch>.tar.gz, the wheel llmgw-<version>-py3-none-any.whl (the
# operator CLI where there is no binary: pipx install), SHA256SUMS over dist/, and the figures:
# each artifact's size (and what stripping the one-folder build's shared objects saved) and
# the median start-up time of `llmgw --version`.
# The bundle carries LICENSES (the DEP-5 copyright file of everything the binary bundles), the
# manual pages and the shell completions; beside it goes its CycloneDX SBOM
# (<bundle>.cdx.json). Both come from the build's inventory, dist/.contents-<arch>.json, which
# packaging/inventory.py writes in the rootfs (every bundled file traced to its owner), and
# which scripts/packages.sh reads for the packages' copyright files and SBOMs.
#
# Usage: scripts/dist.sh [--allow-missing-installer] [--version V] [x64|arm64]
#                                              (make dist [ARCH=arm64] [VERSION=V])
#        scripts/dist.sh --check [--version V] [x64|arm64]   exit 0 when dist/ holds binaries
#                                              built from these very sources, 1 when it does not
#
# --version V builds the same sources with __version__ stamped V (in the build's copy of the
# tree; the checkout is not touched) into dist/vV/: llmgw-linux-<arch> (its --version says
# 'llmgw V'), llmgw-onedir-<arch>/, llmgw-agent-V-linux-<arch>.tar.gz and their SHA256SUMS,
# cached by the hash of the inputs like the plain build. Upgrade tests use it for "N+1".
# dist/SHA256SUMS does not cover these dist/v*/ folders.
#
# The binaries must run on Debian 11 (glibc 2.31) and later, so they are built inside a
# Debian bullseye rootfs against its glibc, with a CPython 3.11 compiled there from Debian's
# source (bullseye's own python3 is 3.9). arm64 is built the same way in an arm64 bullseye
# rootfs, emulated by qemu-user, its CPython cross-compiled (the first arm64 build takes
# about half an hour; the rootfs is cached after that).
# PyInstaller's bootloader is compiled there too, with packaging/pyinstaller-runtime-dir.patch,
# so that a one-file binary unpacks itself into a directory it owns, never a noexec /tmp.
#
# Environment: LLMGW_TEST_CACHE (default /var/cache/llmgw-test; the rootfs go to its dist/),
# LLMGW_DEBIAN_MIRROR (default: the first Debian mirror in /etc/apt/sources.list*), PYTHON
# (runs the bundle builder; default .venv/bin/python, else python3), SOURCE_DATE_EPOCH
# (default: the time of the last commit).
#
# Re-runs are cheap: the rootfs with its CPython is cached, keyed by its recipe; the build
# tools in it are reinstalled only when pyproject.toml or the PyInstaller pin change; the
# binaries are rebuilt only when the hash of their inputs differs from dist/.inputs-<arch>.
# Needs root (debootstrap, chroot, mounts) unless the binaries are already current.
set -eu

SUITE=bullseye # glibc 2.31: the oldest target
# CPython from Debian's source archive (bookworm's python3.11), pinned by its hash.
PYTHON_VERSION=3.11.2
PYTHON_SOURCE=pool/main/p/python3.11/python3.11_$PYTHON_VERSION.orig.tar.gz
PYTHON_SHA256=2411c74bda5bbcfcddaf4531f66d1adc73f247f529aee981b029513aefdbf849
PYTHON_CONFIGURE="--prefix=/opt/python --enable-shared --with-ensurepip=install"
PYINSTALLER_VERSION=6.22.3
PYINSTALLER_SHA256=05eb2f5615503e72939a7224d68b4aff572c6b0438ee4a17d0a4b481f399362d
# python-systemd (the journal handler of llmgw/log.py: LLMGW_* fields, priorities), compiled
# in the rootfs against its libsystemd (bullseye: systemd 247), which the binaries then carry.
SYSTEMD_PYTHON_VERSION=235
SYSTEMD_PYTHON_SHA256=4e57f39797fd5d9e2d22b8806a252d7c0106c936039d1e71c8c6b8008e695c0a
# Debian packages the build tools need beyond the rootfs recipe (installed with the tools).
# chrpath: CPython's extension modules and python-systemd's are linked with the rootfs's
# RUNPATH /opt/python/lib (the build's LDFLAGS), which the frozen program must not carry.
TOOLS_PACKAGES="libsystemd-dev pkg-config chrpath"
INCLUDE=build-essential,ca-certificates,patch,libssl-dev,zlib1g-dev,libffi-dev,libbz2-dev,liblzma-dev,libsqlite3-dev,uuid-dev
# arm64's CPython is cross-compiled in a copy of the x64 rootfs, with these.
CROSS_TRIPLET=aarch64-linux-gnu
CROSS_PACKAGES="crossbuild-essential-arm64 libssl-dev:arm64 zlib1g-dev:arm64 libffi-dev:arm64 libbz2-dev:arm64 liblzma-dev:arm64 libsqlite3-dev:arm64 uuid-dev:arm64"
GLIBC_FLOOR=2.31
# Bump when the rootfs recipe below changes in a way the variables above do not show.
ROOTFS_RECIPE=1
# Likewise for the build tools installed in it (ensure_tools). 2: PyInstaller's source
# fetched outside the rootfs, nothing byte-compiled at install.
TOOLS_RECIPE=2

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

# 1. arguments, paths and the keys of what is cached
parse_args() {
    ALLOW_MISSING_INSTALLER=""
    CHECK=""
    WHEEL_ONLY=""
    ARCH=x64
    STAMP=""
    while [ $# -gt 0 ]; do
        case $1 in
            --allow-missing-installer) ALLOW_MISSING_INSTALLER=--allow-missing-installer ;;
            --check) CHECK=1 ;;
            --wheel)
                [ $# -ge 2 ] || fatal "--wheel needs a directory, e.g. --wheel dist"
                WHEEL_ONLY=$2
                shift
                ;;
            --version)
                [ $# -ge 2 ] || fatal "--version needs a value, e.g. --version 0.1.1"
                STAMP=$2
                shift
                ;;
            x64 | arm64) ARCH=$1 ;;
            *) fatal "usage: $0 [--allow-missing-installer | --check | --wheel DIR] [--version V] [x64|arm64] (got '$1')" ;;
        esac
        shift
    done
    if [ -n "$STAMP" ]; then
        # A version is a file name and a sed replacement here: digits, letters, '.', '+', '-',
        # '~' only, starting with a digit.
        case $STAMP in
            [0-9]*) ;;
            *) fatal "--version '$STAMP' must start with a digit (e.g. 0.1.1)" ;;
        esac
        case $STAMP in
            *[!0-9A-Za-z.+~-]*) fatal "--version '$STAMP' may hold only digits, letters and . + ~ -" ;;
        esac
    fi
    case $ARCH in
        x64) DEB_ARCH=amd64 QEMU="" ;;
        arm64) DEB_ARCH=arm64 QEMU=qemu-aarch64 ;;
    esac
    if [ "$ARCH" = x64 ] && [ "$(uname -m)" != x86_64 ]; then
        fatal "x64 builds run on an x86-64 machine (this one is $(uname -m))"
    fi
}

setup() {
    ROOT=$(cd "$(dirname "$0")/.." && pwd)
    cd "$ROOT"
    if [ -z "${PYTHON:-}" ]; then
        if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
    fi
    VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' llmgw/__init__.py)
    [ -n "$VERSION" ] || fatal "no __version__ = \"X.Y.Z\" line in llmgw/__init__.py"
    OUT=dist
    if [ -n "$STAMP" ]; then
        VERSION=$STAMP
        OUT=dist/v$STAMP
    fi
    CACHE=$TEST_CACHE/dist
    ROOTFS=$(rootfs_path "$DEB_ARCH")
    TOOLS_KEY=$({
        printf '%s\n' "$ROOTFS" "$TOOLS_RECIPE" "$PYINSTALLER_VERSION" "$PYINSTALLER_SHA256" \
            "$SYSTEMD_PYTHON_VERSION" "$SYSTEMD_PYTHON_SHA256" "$TOOLS_PACKAGES"
        cat packaging/pyinstaller-runtime-dir.patch pyproject.toml
    } | sha)
    INPUTS=$({
        printf '%s\n' "$TOOLS_KEY" "$VERSION" "stamped:$STAMP"
        sha256sum scripts/dist.sh packaging/llmgw.spec packaging/inventory.py README.md
        find llmgw -type f -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    } | sha)
    ONEFILE=$OUT/llmgw-linux-$ARCH
    ONEDIR=$OUT/llmgw-onedir-$ARCH
    REVISION=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
    if [ "$REVISION" != unknown ] && [ -n "$(git status --porcelain 2>/dev/null | head -n 1)" ]; then
        REVISION=$REVISION-dirty
    fi
    if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
        SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
    fi
    export SOURCE_DATE_EPOCH
}

# The cached build rootfs of Debian architecture $1, named after the recipe that makes it.
rootfs_path() {
    key=$({
        printf '%s\n' "$ROOTFS_RECIPE" "$SUITE" "$1" "$INCLUDE" "$PYTHON_SOURCE" "$PYTHON_SHA256" \
            "$PYTHON_CONFIGURE"
        [ "$1" = amd64 ] || printf '%s\n' "$CROSS_PACKAGES"
    } | sha | cut -c1-16)
    printf '%s/%s-%s-%s\n' "$CACHE" "$SUITE" "$1" "$key"
}

# 2. what the build needs on this machine
check_tools() {
    [ "$(id -u)" -eq 0 ] || fatal "building $ONEFILE needs root (debootstrap, chroot); run as root, or 'sudo make dist'"
    missing=""
    command -v debootstrap >/dev/null 2>&1 || missing="$missing debootstrap"
    command -v unshare >/dev/null 2>&1 || missing="$missing util-linux"
    if [ -n "$QEMU" ]; then
        command -v "$QEMU-static" >/dev/null 2>&1 || missing="$missing qemu-user-static"
        command -v update-binfmts >/dev/null 2>&1 || missing="$missing binfmt-support"
    fi
    if [ -n "$missing" ]; then
        command -v apt-get >/dev/null 2>&1 || fatal "missing:$missing; install them"
        # shellcheck disable=SC2086 # a list of package names
        apt_install $missing
    fi
    [ -n "$QEMU" ] && enable_binfmt
    return 0
}

enable_binfmt() {
    if [ ! -e /proc/sys/fs/binfmt_misc/status ]; then
        mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc \
            || fatal "cannot mount binfmt_misc; arm64 programs cannot run here"
    fi
    if [ ! -e "/proc/sys/fs/binfmt_misc/$QEMU" ]; then
        update-binfmts --enable "$QEMU" >/dev/null 2>&1 \
            || fatal "cannot register $QEMU with binfmt_misc (update-binfmts --enable $QEMU)"
    fi
}

# Run a shell script (read from stdin) as root inside rootfs $1, with `sh -eu`, in a mount
# namespace of its own: /proc and /dev are mounted there and vanish with it, whatever happens
# to this script. Further arguments are environment assignments for the script.
in_rootfs() {
    rootfs=$1
    shift
    cat >"$rootfs/.llmgw-step.sh"
    # shellcheck disable=SC2016 # expanded by the inner shell
    unshare --mount --propagation private sh -c '
        set -e
        mount -t proc proc "$1/proc"
        mount --rbind /dev "$1/dev"
        root=$1
        shift
        exec chroot "$root" /usr/bin/env -i PATH=/opt/python/bin:/usr/sbin:/usr/bin:/sbin:/bin \
            HOME=/root LANG=C.UTF-8 PIP_CERT=/etc/ssl/llmgw-build-ca.crt \
            PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 "$@" /bin/sh -eu /.llmgw-step.sh
    ' sh "$rootfs" "$@" </dev/null
}

# What pip needs inside a rootfs: DNS, and this machine's CA bundle (which may hold a proxy's).
refresh_network_files() {
    cp /etc/resolv.conf "$1/etc/resolv.conf" 2>/dev/null || true
    for bundle in /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt; do
        if [ -f "$bundle" ]; then
            cp "$bundle" "$1/etc/ssl/llmgw-build-ca.crt"
            return 0
        fi
    done
    cp "$1/etc/ssl/certs/ca-certificates.crt" "$1/etc/ssl/llmgw-build-ca.crt"
}

# 3. the build rootfs: bullseye, its compilers and headers, and CPython (cached). x64 compiles
# CPython natively; arm64 cross-compiles it in a copy of the x64 rootfs (whose CPython is the
# build Python a cross build needs), since compiling it under emulation would take hours.
ensure_rootfs() {
    if [ -f "$ROOTFS/.llmgw-ready" ]; then
        info "rootfs: cached $ROOTFS"
        return 0
    fi
    mirror=$(debian_mirror)
    fetch_python_source
    if [ -z "$QEMU" ]; then
        make_native_rootfs "$ROOTFS" "$ARCH"
        return 0
    fi
    X64_ROOTFS=$(rootfs_path amd64)
    if [ ! -f "$X64_ROOTFS/.llmgw-ready" ]; then
        exec 8>"$CACHE/.lock-x64"
        flock 8
        [ -f "$X64_ROOTFS/.llmgw-ready" ] || make_native_rootfs "$X64_ROOTFS" x64
        exec 8>&-
    fi
    make_foreign_rootfs
}

# The CPython source, once per run, checked against its pinned hash.
fetch_python_source() {
    source_dir=$(mktemp -d)
    TO_CLEAN="$TO_CLEAN $source_dir"
    PYTHON_TARBALL=$source_dir/python.tar.gz
    info "rootfs: CPython $PYTHON_VERSION from $mirror/$PYTHON_SOURCE"
    "$PYTHON" -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1], sys.argv[2])' \
        "$mirror/$PYTHON_SOURCE" "$PYTHON_TARBALL" \
        || fatal "could not download $mirror/$PYTHON_SOURCE"
    got=$(sha <"$PYTHON_TARBALL")
    [ "$got" = "$PYTHON_SHA256" ] || fatal "$PYTHON_SOURCE has SHA-256 $got, expected $PYTHON_SHA256"
}

# A fresh work directory for rootfs $1 (x64|arm64), after removing what an interrupted run
# left (that architecture's lock is held: no other build uses them).
rootfs_workdir() {
    rm -rf "$CACHE/.rootfs-$1."*
    cache_workdir "$CACHE" "rootfs-$1"
}

debootstrap_into() { # DIR DEB_ARCH [--foreign]
    info "rootfs: debootstrap --arch=$2 --variant=minbase $SUITE from $mirror"
    step_started=$(date +%s)
    run_debootstrap ${3:+"$3"} --arch="$2" --variant=minbase --include="$INCLUDE" "$SUITE" "$1" "$mirror"
    info "rootfs: debootstrap --arch=$2${3:+ $3} ready in $(($(date +%s) - step_started)) s"
}

# No -g (the default OPT has it): the frozen binaries carry libpython.
configure_python() { # extra configure arguments...
    printf '%s\n' "cd /build && tar -xzf python.tar.gz && cd Python-$PYTHON_VERSION"
    printf '%s\n' "./configure $PYTHON_CONFIGURE $* OPT='-DNDEBUG -fwrapv -O3 -Wall' LDFLAGS='-Wl,-rpath,/opt/python/lib'"
    printf '%s\n' "make -j$(nproc)"
}

make_native_rootfs() { # DEST ARCH
    rootfs_workdir "$2"
    new=$work/rootfs
    debootstrap_into "$new" amd64
    drop_apt_caches "$new"
    mkdir -p "$new/build"
    cp "$PYTHON_TARBALL" "$new/build/python.tar.gz"
    started=$(date +%s)
    info "rootfs: compiling CPython (a few minutes)"
    {
        configure_python
        echo "make install"
        echo "cd / && rm -rf /build /opt/python/lib/python3.11/test"
        echo "/opt/python/bin/python3.11 -c 'import ssl, sqlite3, zlib, lzma, bz2, ctypes, uuid'"
    } | in_rootfs "$new" >"$work/python.log" 2>&1 \
        || { tail -n 30 "$work/python.log" >&2; fatal "compiling CPython failed (log above)"; }
    info "rootfs: CPython built in $(($(date +%s) - started)) s"
    touch "$new/.llmgw-ready"
    rm -rf "$1"
    mv "$new" "$1"
}

make_foreign_rootfs() {
    rootfs_workdir "$ARCH"
    new=$work/rootfs
    # Foreign: unpack, then run the second stage under emulation through binfmt_misc, whose
    # interpreter path must exist inside the chroot.
    debootstrap_into "$new" "$DEB_ARCH" --foreign
    install_qemu "$new"
    info "rootfs: debootstrap's second stage, emulated (several minutes)"
    step_started=$(date +%s)
    debootstrap_second_stage "$new"
    info "rootfs: debootstrap's second stage (emulated) ready in $(($(date +%s) - step_started)) s"
    drop_apt_caches "$new"

    started=$(date +%s)
    info "rootfs: cross-compiling CPython for $DEB_ARCH in a copy of $X64_ROOTFS"
    cross=$work/cross
    # Under the x64 lock: an x64 build running meanwhile (CI starts both) rewrites the x64
    # rootfs's /build and /opt/llmgw-build, which a copy must not catch half-way.
    exec 8>"$CACHE/.lock-x64"
    flock 8
    cp -a "$X64_ROOTFS" "$cross"
    exec 8>&-
    refresh_network_files "$cross"
    mkdir -p "$cross/build"
    cp "$PYTHON_TARBALL" "$cross/build/python.tar.gz"
    {
        echo "dpkg --add-architecture $DEB_ARCH"
        echo "apt-get update -q"
        echo "DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $CROSS_PACKAGES"
        # The ac_cv_ answers are what configure cannot find out without running arm64 code.
        configure_python --build=x86_64-linux-gnu --host="$CROSS_TRIPLET" \
            --with-build-python=/opt/python/bin/python3.11 --with-ensurepip=no \
            ac_cv_file__dev_ptmx=yes ac_cv_file__dev_ptc=no ac_cv_buggy_getaddrinfo=no
        echo "make install DESTDIR=/build/stage"
    } | in_rootfs "$cross" >"$work/python.log" 2>&1 \
        || { tail -n 30 "$work/python.log" >&2; fatal "cross-compiling CPython failed (log above)"; }
    mkdir -p "$new/opt"
    cp -a "$cross/build/stage/opt/python" "$new/opt/python"
    rm -rf "$cross" "$new/opt/python/lib/python3.11/test"
    echo "/opt/python/bin/python3.11 -c 'import ssl, sqlite3, zlib, lzma, bz2, ctypes, uuid'" \
        | in_rootfs "$new" >>"$work/python.log" 2>&1 \
        || { tail -n 30 "$work/python.log" >&2; fatal "the cross-compiled CPython does not run (log above)"; }
    info "rootfs: CPython cross-compiled in $(($(date +%s) - started)) s"
    touch "$new/.llmgw-ready"
    rm -rf "$ROOTFS"
    mv "$new" "$ROOTFS"
}

install_qemu() {
    mkdir -p "$1/usr/bin" "$1/usr/libexec/qemu-binfmt"
    cp "$(command -v "$QEMU-static")" "$1/usr/bin/"
    interpreter=$(sed -n 's/^interpreter //p' "/proc/sys/fs/binfmt_misc/$QEMU")
    case $interpreter in
        "/usr/bin/$QEMU-static" | "") ;;
        *) mkdir -p "$1$(dirname "$interpreter")" && ln -sf "/usr/bin/$QEMU-static" "$1$interpreter" ;;
    esac
}

# 4. the build tools in the rootfs: a venv with llmgw's dependencies, python-systemd compiled
# against the rootfs's libsystemd, and a PyInstaller whose bootloader is compiled there,
# patched (reinstalled when TOOLS_KEY changes)
ensure_tools() {
    refresh_network_files "$ROOTFS"
    [ -n "$QEMU" ] && install_qemu "$ROOTFS"
    if [ "$(cat "$ROOTFS/opt/llmgw-build/.key" 2>/dev/null)" = "$TOOLS_KEY" ]; then
        info "tools: current in $ROOTFS/opt/llmgw-build"
        return 0
    fi
    info "tools: PyInstaller $PYINSTALLER_VERSION (patched bootloader) and llmgw's dependencies"
    rm -rf "$ROOTFS/opt/llmgw-build" "$ROOTFS/build"
    mkdir -p "$ROOTFS/build"
    cp packaging/pyinstaller-runtime-dir.patch "$ROOTFS/build/"
    "$PYTHON" -c '
import sys, tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["dependencies"]))
' >"$ROOTFS/build/requirements.txt"
    printf 'pyinstaller==%s --hash=sha256:%s\n' "$PYINSTALLER_VERSION" "$PYINSTALLER_SHA256" \
        >"$ROOTFS/build/pyinstaller.txt"
    printf 'systemd-python==%s --hash=sha256:%s\n' "$SYSTEMD_PYTHON_VERSION" "$SYSTEMD_PYTHON_SHA256" \
        >"$ROOTFS/build/systemd-python.txt"
    log=$(mktemp)
    TO_CLEAN="$TO_CLEAN $log"
    step_started=$(date +%s)
    # PyInstaller's sdist is fetched here, not in the rootfs: pip prepares an sdist's
    # metadata in a build environment of its own, which under qemu took 92 s of an arm64
    # build's 330 s of tools (issue 37 point 22); natively, a few seconds.
    "$PYTHON" -m pip download --quiet --no-deps --no-binary :all: --require-hashes \
        -r "$ROOTFS/build/pyinstaller.txt" -d "$ROOTFS/build" >"$log" 2>&1 \
        || { tail -n 30 "$log" >&2; fatal "downloading PyInstaller's source failed (log above)"; }
    in_rootfs "$ROOTFS" >"$log" 2>&1 <<EOF || { tail -n 30 "$log" >&2; fatal "installing the build tools failed (log above)"; }
cd /build
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $TOOLS_PACKAGES
rm -rf /var/cache/apt/archives/*.deb /var/lib/apt/lists/*
python3.11 -m venv /opt/llmgw-build
/opt/llmgw-build/bin/pip install --quiet --upgrade pip
# --no-compile: PyInstaller compiles what it bundles itself; byte-compiling every installed
# package under qemu is a third of this step's time there.
/opt/llmgw-build/bin/pip install --quiet --no-compile -r requirements.txt
# From its source (there is no wheel), against this rootfs's libsystemd.
/opt/llmgw-build/bin/pip install --quiet --no-binary systemd-python --require-hashes \
    -r systemd-python.txt
/opt/llmgw-build/bin/python -c 'from systemd import journal; journal.send'
# The libraries a build freezes keep no RUNPATH into this rootfs (/opt/python/lib does not
# exist on a target; the bootloader loads libpython itself). The interpreter keeps its own.
for library in /opt/python/lib/libpython3.11.so.1.0 /opt/python/lib/python3.11/lib-dynload/*.so \
    /opt/llmgw-build/lib/python3.11/site-packages/systemd/*.so; do
    if chrpath -l "\$library" >/dev/null 2>&1; then chrpath -d "\$library"; fi
done
/opt/llmgw-build/bin/python -c 'import ssl, sqlite3, lzma, bz2, ctypes, uuid, json; from systemd import journal'
tar -xzf pyinstaller-$PYINSTALLER_VERSION.tar.gz
cd pyinstaller-$PYINSTALLER_VERSION
patch -p1 <../pyinstaller-runtime-dir.patch
# The sdist has no Linux bootloader: installing it compiles one, from the patched source.
/opt/llmgw-build/bin/pip install --quiet --no-compile .
cd /
rm -rf /build
EOF
    printf '%s\n' "$TOOLS_KEY" >"$ROOTFS/opt/llmgw-build/.key"
    info "tools: built in $(($(date +%s) - step_started)) s"
}

# 5. the binaries: PyInstaller in the rootfs, on a clean copy of the sources
build_binaries() {
    info "binaries: PyInstaller one-file and one-folder of llmgw $VERSION for linux-$ARCH"
    rm -rf "$ROOTFS/build"
    mkdir -p "$ROOTFS/build/src/packaging"
    tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md llmgw \
        | tar -C "$ROOTFS/build/src" -xf -
    cp packaging/llmgw.spec packaging/inventory.py packaging/pyinstaller-runtime-dir.patch \
        "$ROOTFS/build/src/packaging/"
    [ -z "$STAMP" ] || stamp_version "$ROOTFS/build/src/llmgw/__init__.py"
    log=$(mktemp)
    TO_CLEAN="$TO_CLEAN $log"
    started=$(date +%s)
    # Each binary must say its version where it was built (for arm64: the only place here
    # with an arm64 userland).
    in_rootfs "$ROOTFS" SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" PYTHONHASHSEED=0 >"$log" 2>&1 <<EOF || { tail -n 40 "$log" >&2; fatal "PyInstaller failed (log above)"; }
cd /build/src
# Both variants from one analysis (packaging/llmgw.spec --mode both): the same files in each.
LLMGW_TOC_OUT=/build/out/toc.json /opt/llmgw-build/bin/pyinstaller --noconfirm \\
    --log-level WARN --distpath /build/out/bin --workpath /build/work \\
    packaging/llmgw.spec -- --mode both
mkdir -p /build/out/onefile /build/out/onedir
mv /build/out/bin/llmgw-onefile /build/out/onefile/llmgw
mv /build/out/bin/llmgw /build/out/onedir/llmgw
# Where every bundled file comes from (the copyright file, LICENSES and the SBOMs say it).
/opt/llmgw-build/bin/python packaging/inventory.py --toc /build/out/toc.json \\
    --python-prefix /opt/python --source /build/src --work /build/work \\
    --patch packaging/pyinstaller-runtime-dir.patch --out /build/out/contents.json
# The one-folder build's shared objects lose their symbol tables (Debian policy; what dh_strip
# does). Never the executables: a PyInstaller executable carries its archive appended, which
# strip would cut off (the one-file binary is all archive).
find /build/out/onedir/llmgw/_internal -type f \\( -name '*.so' -o -name '*.so.*' \\) \\
    | LC_ALL=C sort >/build/out/shared-objects
before=\$(xargs -d '\\n' cat </build/out/shared-objects | wc -c)
xargs -d '\\n' strip --remove-section=.comment --remove-section=.note --strip-unneeded \\
    </build/out/shared-objects
# ... and are not executable (Debian policy: 0644; the loader maps them without it).
xargs -d '\\n' chmod 0644 </build/out/shared-objects
after=\$(xargs -d '\\n' cat </build/out/shared-objects | wc -c)
printf 'files %s\\nbefore %s\\nafter %s\\n' "\$(wc -l </build/out/shared-objects)" "\$before" "\$after" \\
    >/build/out/strip
for binary in /build/out/onefile/llmgw /build/out/onedir/llmgw/llmgw; do
    said=\$(\$binary --version)
    [ "\$said" = "llmgw $VERSION" ] || { echo "\$binary --version says '\$said', expected 'llmgw $VERSION'" >&2; exit 1; }
done
# Both carry python-systemd's journal module and the libsystemd it was compiled against
# (without them, log.py falls back to plain text under systemd), psycopg's C
# implementation with the libpq of its wheel (without them, a control plane on PostgreSQL
# needs a libpq on the machine: packaging/llmgw.spec), and uvloop's compiled loop (without
# it, every daemon runs on asyncio's slower loop: llmgw/loop.py), and the console's
# templates and static files (without them, the control plane refuses to start).
ls /build/out/onedir/llmgw/_internal/systemd/_journal.*.so /build/out/onedir/llmgw/_internal/libsystemd.so.0 \
    /build/out/onedir/llmgw/_internal/psycopg_binary/_psycopg.*.so \
    /build/out/onedir/llmgw/_internal/psycopg_binary.libs/libpq-*.so.* \
    /build/out/onedir/llmgw/_internal/uvloop/loop.*.so \
    /build/out/onedir/llmgw/_internal/llmgw/server/console/templates/base.html \
    /build/out/onedir/llmgw/_internal/llmgw/server/console/static/console.js >/dev/null
/opt/llmgw-build/bin/python -c '
import sys
from PyInstaller.archive.readers import CArchiveReader
names = list(CArchiveReader(sys.argv[1]).toc)
wanted = {
    "systemd/_journal.": "python-systemd",
    "libsystemd.so.0": "python-systemd",
    "psycopg_binary/_psycopg.": "psycopg-binary",
    "psycopg_binary.libs/libpq-": "psycopg-binary",
    "uvloop/loop.": "uvloop",
    "llmgw/server/console/templates/base.html": "the console templates (datas in llmgw.spec)",
    "llmgw/server/console/static/console.js": "the console static files (datas in llmgw.spec)",
}
for prefix, package in wanted.items():
    if not any(name.startswith(prefix) for name in names):
        sys.exit(sys.argv[1] + " lacks " + prefix + "*: " + package + " did not make it into the build")
' /build/out/onefile/llmgw
EOF
    info "binaries: built in $(($(date +%s) - started)) s"
    lock_out
    rm -rf "$ONEFILE" "$ONEDIR" "$OUT/.inputs-$ARCH" "$OUT/.contents-$ARCH.json" "$OUT/.strip-$ARCH"
    cp "$ROOTFS/build/out/onefile/llmgw" "$ONEFILE"
    cp -a "$ROOTFS/build/out/onedir/llmgw" "$ONEDIR"
    cp "$ROOTFS/build/out/contents.json" "$OUT/.contents-$ARCH.json"
    cp "$ROOTFS/build/out/strip" "$OUT/.strip-$ARCH"
    rm -rf "$ROOTFS/build"
    printf '%s\n' "$INPUTS" >"$OUT/.inputs-$ARCH"
}

# Builds of both architectures may run at once (CI does): what each writes into $OUT (its
# binaries, its bundle, and SHA256SUMS over all of them) is written under $OUT/.lock, held
# until the script ends, so that no SHA256SUMS is computed over half-copied files.
lock_out() {
    [ -z "${OUT_LOCKED:-}" ] || return 0
    mkdir -p "$OUT"
    exec 7>"$OUT/.lock"
    flock 7
    OUT_LOCKED=1
}

# --version V: the build's copy of llmgw/__init__.py says V (the checkout is not touched).
stamp_version() {
    sed -i "s/^__version__ = \".*\"\$/__version__ = \"$STAMP\"/" "$1"
    grep -qx "__version__ = \"$STAMP\"" "$1" || fatal "could not stamp version $STAMP into $1"
}

binaries_are_current() {
    [ -x "$ONEFILE" ] && [ -x "$ONEDIR/llmgw" ] && [ -f "$OUT/.contents-$ARCH.json" ] \
        && [ -f "$OUT/.strip-$ARCH" ] && [ "$(cat "$OUT/.inputs-$ARCH" 2>/dev/null)" = "$INPUTS" ]
}

# 6. each binary says its version, run here when it is of this machine's architecture (the
# build checked that too, in its rootfs)
check_version() {
    [ -z "$QEMU" ] || return 0
    for binary in "$ONEFILE" "$ONEDIR/llmgw"; do
        said=$("$binary" --version) || fatal "$binary --version failed"
        [ "$said" = "llmgw $VERSION" ] || fatal "$binary --version says '$said', expected 'llmgw $VERSION'"
    done
}

# 7. the wheel, for the operator CLI where no binary is built (macOS, other platforms:
# 'pipx install llmgw-V-py3-none-any.whl'); pure Python, the same for every architecture,
# built from a clean copy of the sources (stamped like the binaries with --version).
make_wheel() {
    work=$(mktemp -d)
    TO_CLEAN="$TO_CLEAN $work"
    # LICENSE too: pyproject's license-files names it, and the wheel carries it.
    tar -cf - --exclude=__pycache__ --exclude='*.pyc' pyproject.toml README.md LICENSE llmgw \
        | tar -C "$work" -xf -
    [ -z "$STAMP" ] || stamp_version "$work/llmgw/__init__.py"
    python=$PYTHON
    case $python in /*) ;; */*) python=$PWD/$python ;; esac
    (cd "$work" && SOURCE_DATE_EPOCH="$SOURCE_DATE_EPOCH" "$python" -m pip wheel --quiet --no-deps \
        --no-build-isolation --no-index -w "$work/wheel" .) >"$work/log" 2>&1 \
        || { tail -n 30 "$work/log" >&2; fatal "the wheel did not build (log above; needs setuptools>=77 in $PYTHON)"; }
    wheel="llmgw-$VERSION-py3-none-any.whl"
    [ -f "$work/wheel/$wheel" ] || fatal "pip wheel made no $wheel (made: $(ls "$work/wheel"))"
    rm -f "$OUT"/llmgw-*-py3-none-any.whl
    cp "$work/wheel/$wheel" "$OUT/$wheel"
    info "wheel: $OUT/$wheel"
}

# 8. the bundle, SHA256SUMS, and the figures
# The bundle carries LICENSES (everything the binary bundles, from the build's inventory),
# the manual pages and the shell completions (from the click definitions); its CycloneDX SBOM
# goes beside it, into SHA256SUMS.
make_bundle() {
    docs=$(mktemp -d)
    TO_CLEAN="$TO_CLEAN $docs"
    contents=$OUT/.contents-$ARCH.json
    "$PYTHON" packaging/licenses.py copyright --contents "$contents" --out "$docs/LICENSES" \
        || fatal "no LICENSES for the bundle (above)"
    "$PYTHON" packaging/manpages.py --version "$VERSION" \
        --date "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d)" --out "$docs/man/man1" \
        || fatal "the manual pages did not generate (above)"
    "$PYTHON" packaging/completions.py --out "$docs/completions" \
        || fatal "the shell completions did not generate (above)"
    "$PYTHON" packaging/bundle.py build --binary "$ONEFILE" --arch "$ARCH" --version "$VERSION" \
        --revision "$REVISION" --glibc-floor "$GLIBC_FLOOR" --out "$OUT" $ALLOW_MISSING_INSTALLER \
        --docs "$docs"
    bundle=$OUT/llmgw-agent-$VERSION-linux-$ARCH.tar.gz
    "$PYTHON" packaging/licenses.py sbom --contents "$contents" --artifact "$bundle" \
        --name llmgw-agent --version "$VERSION" \
        --purl "pkg:generic/llmgw-agent@$VERSION?arch=linux-$ARCH" --arch "$DEB_ARCH" \
        --out "$bundle.cdx.json" || fatal "no SBOM for $bundle (above)"
    if [ -n "$STAMP" ]; then
        "$PYTHON" packaging/bundle.py sums "$OUT"
    else
        "$PYTHON" packaging/bundle.py sums dist --exclude 'v[0-9]*'
    fi
}

report() {
    info "figures for linux-$ARCH:"
    # Start-up times under emulation say nothing about an arm64 machine: not measured.
    "$PYTHON" packaging/report.py --onefile "$ONEFILE" --onedir "$ONEDIR" \
        --bundle "$OUT/llmgw-agent-$VERSION-linux-$ARCH.tar.gz" --strip "$OUT/.strip-$ARCH" \
        ${QEMU:+--no-timing} >&2
}

main() {
    parse_args "$@"
    setup
    if [ -n "$WHEEL_ONLY" ]; then
        # 'make wheel': the wheel alone, into the directory given (no root, no build rootfs).
        OUT=$WHEEL_ONLY
        mkdir -p "$OUT"
        remove_on_exit
        make_wheel
        exit 0
    fi
    if [ -n "$CHECK" ]; then
        if binaries_are_current; then
            info "$ONEFILE and $ONEDIR are current"
            exit 0
        fi
        hint="make dist"
        [ "$ARCH" = x64 ] || hint="$hint ARCH=$ARCH"
        [ -z "$STAMP" ] || hint="$hint VERSION=$STAMP"
        info "$ONEFILE is missing or was built from other sources; run $hint"
        exit 1
    fi
    remove_on_exit
    if binaries_are_current; then
        [ -n "$QEMU" ] && [ "$(id -u)" -eq 0 ] && enable_binfmt
        info "binaries: $ONEFILE and $ONEDIR are current"
    else
        check_tools
        mkdir -p "$CACHE"
        # One build per architecture at a time: the rootfs and its /build are shared.
        exec 9>"$CACHE/.lock-$ARCH"
        flock 9
        ensure_rootfs
        ensure_tools
        build_binaries
        exec 9>&-
    fi
    lock_out
    check_version
    make_wheel
    make_bundle
    report
}

main "$@"
