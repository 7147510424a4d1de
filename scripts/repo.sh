#!/bin/sh
# Make the signed package repositories from the .deb and .rpm files 'make packages' built:
#   OUT/apt  an apt repository (suite stable, component main): pool/main/*.deb, Packages,
#            Release, InRelease and Release.gpg signed with the release key, the public key
#            (llmgw.gpg for /usr/share/keyrings, llmgw.asc) and llmgw.list;
#   OUT/yum  a yum/dnf repository: the packages signed with the release key (rpmsign),
#            createrepo_c metadata with repodata/repomd.xml.asc, RPM-GPG-KEY-llmgw and
#            llmgw.repo.
#
# Usage: scripts/repo.sh [--packages DIR] [--out DIR] [--url URL]
#   --packages  where the .deb and .rpm files are (env: LLMGW_REPO_PACKAGES; default dist)
#   --out       the repository tree, replaced as a whole (env: LLMGW_REPO_OUT; default
#               dist/repo)
#   --url       where OUT is served (env: LLMGW_REPO_URL; default http://127.0.0.1:8000, as
#               'python3 -m http.server --bind 127.0.0.1 --directory OUT' serves it); the
#               lists point at URL/apt and URL/yum
#
# Environment: LLMGW_RELEASE_KEY, the release signing key (an OpenPGP secret key file,
# armored or not); LLMGW_RELEASE_KEY_PASSPHRASE_FILE, its passphrase when it has one.
# Without LLMGW_RELEASE_KEY a throwaway ed25519 key is made once and kept at
# LLMGW_THROWAWAY_KEY (default build/release-key/llmgw-release-throwaway.asc, in a 0700
# directory, never under dist/ where it could be published): good for tests and local use,
# never for a release.
set -eu

DEFAULT_URL=http://127.0.0.1:8000
SUITE=stable
COMPONENT=main

# shellcheck source=lib/common.sh
. "$(dirname "$0")/lib/common.sh"

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --packages | --out | --url)
                [ $# -ge 2 ] || fatal "$1 needs a value"
                case $1 in
                    --packages) PACKAGES=$2 ;;
                    --out) OUT=$2 ;;
                    --url) URL=$2 ;;
                esac
                shift 2
                ;;
            -h | --help) usage ;;
            *) fatal "unknown argument '$1'; see $0 --help" ;;
        esac
    done
}

# 1. the tools and the packages
check_tools() {
    missing=""
    command -v apt-ftparchive >/dev/null 2>&1 || missing="$missing apt-utils"
    command -v dpkg-deb >/dev/null 2>&1 || missing="$missing dpkg"
    command -v gpg >/dev/null 2>&1 || missing="$missing gnupg"
    command -v createrepo_c >/dev/null 2>&1 || missing="$missing createrepo-c"
    command -v rpmsign >/dev/null 2>&1 || missing="$missing rpm"
    [ -z "$missing" ] || fatal "missing tools; install them: apt-get install -y$missing"
    set -- "$PACKAGES"/*.deb
    [ -f "$1" ] || fatal "no .deb in $PACKAGES; run 'make packages' first"
    set -- "$PACKAGES"/*.rpm
    [ -f "$1" ] || fatal "no .rpm in $PACKAGES; run 'make packages' first"
}

gpg_batch() { gpg --homedir "$GNUPGHOME" --batch --quiet "$@"; }

# 2. the release key, in a keyring of this run only
load_key() {
    GNUPGHOME=$(mktemp -d)
    chmod 0700 "$GNUPGHOME"
    key=${LLMGW_RELEASE_KEY:-}
    if [ -z "$key" ]; then
        key=$THROWAWAY_KEY
        [ -f "$key" ] || make_throwaway_key "$key"
        warn "signing with the throwaway key $key; set LLMGW_RELEASE_KEY for a release"
    fi
    [ -f "$key" ] || fatal "LLMGW_RELEASE_KEY names $key, which does not exist"
    gpg_batch --import "$key" 2>"$WORK/gpg.log" \
        || { cat "$WORK/gpg.log" >&2; fatal "could not import the release key $key"; }
    # The first secret key that can sign (its fingerprint, on the 'fpr' line after 'sec').
    FPR=$(gpg_batch --with-colons --list-secret-keys | awk -F: '
        $1 == "sec" { want = ($12 ~ /[sS]/) }
        $1 == "fpr" && want { print $10; exit }')
    [ -n "$FPR" ] || fatal "$key holds no secret key that can sign"
    SIGN_OPTS=""
    if [ -n "${LLMGW_RELEASE_KEY_PASSPHRASE_FILE:-}" ]; then
        SIGN_OPTS="--pinentry-mode loopback --passphrase-file $LLMGW_RELEASE_KEY_PASSPHRASE_FILE"
    fi
    info "release key $FPR"
}

make_throwaway_key() {
    info "making a throwaway ed25519 release key: $1"
    mkdir -p "$(dirname "$1")"
    chmod 0700 "$(dirname "$1")"
    home=$(mktemp -d)
    gpg --homedir "$home" --batch --quiet --passphrase '' \
        --quick-generate-key "llmgw release (throwaway) <llmgw@localhost>" ed25519 sign never
    (umask 077 && gpg --homedir "$home" --batch --armor --export-secret-keys >"$1.tmp")
    gpgconf --homedir "$home" --kill all 2>/dev/null || true
    rm -rf "$home"
    mv "$1.tmp" "$1"
}

# shellcheck disable=SC2086 # SIGN_OPTS is empty or options without spaces in their values
sign() { gpg_batch --local-user "$FPR" $SIGN_OPTS "$@"; }

# 3. the apt repository
make_apt() {
    apt=$STAGE/apt
    mkdir -p "$apt/pool/$COMPONENT"
    cp "$PACKAGES"/*.deb "$apt/pool/$COMPONENT/"
    # Architecture: all packages (llmgw-agent-bundles) go into every architecture's index
    # (apt-ftparchive --arch takes *_all.deb too), as Debian's own archive lists them.
    arches=$(for deb in "$apt/pool/$COMPONENT"/*.deb; do dpkg-deb -f "$deb" Architecture; done \
        | sort -u | grep -vx all | tr '\n' ' ' | sed 's/ $//')
    [ -n "$arches" ] || fatal "$PACKAGES holds only Architecture: all packages; add llmgw-agent and llmgw-server (make packages)"
    for arch in $arches; do
        dir=$apt/dists/$SUITE/$COMPONENT/binary-$arch
        mkdir -p "$dir"
        (cd "$apt" && apt-ftparchive --arch "$arch" packages "pool/$COMPONENT") >"$dir/Packages"
        gzip -9nk "$dir/Packages"
    done
    # Written elsewhere first: apt-ftparchive would list a Release file it is writing.
    (cd "$apt/dists/$SUITE" && apt-ftparchive \
        -o APT::FTPArchive::Release::Origin=llmgw \
        -o APT::FTPArchive::Release::Label=llmgw \
        -o APT::FTPArchive::Release::Suite=$SUITE \
        -o APT::FTPArchive::Release::Codename=$SUITE \
        -o "APT::FTPArchive::Release::Architectures=$arches" \
        -o APT::FTPArchive::Release::Components=$COMPONENT \
        -o "APT::FTPArchive::Release::Description=llmgw packages" \
        release .) >"$WORK/Release"
    mv "$WORK/Release" "$apt/dists/$SUITE/Release"
    sign --clearsign -o "$apt/dists/$SUITE/InRelease" "$apt/dists/$SUITE/Release"
    sign --detach-sign --armor -o "$apt/dists/$SUITE/Release.gpg" "$apt/dists/$SUITE/Release"
    gpg_batch --export "$FPR" >"$apt/llmgw.gpg"
    gpg_batch --armor --export "$FPR" >"$apt/llmgw.asc"
    printf 'deb [signed-by=/usr/share/keyrings/llmgw.gpg] %s/apt %s %s\n' \
        "$URL" "$SUITE" "$COMPONENT" >"$apt/llmgw.list"
    info "apt: $(find "$apt/pool" -name '*.deb' | wc -l) packages for $arches"
}

# 4. the yum repository
make_yum() {
    yum=$STAGE/yum
    mkdir -p "$yum"
    gpg_batch --armor --export "$FPR" >"$yum/RPM-GPG-KEY-llmgw"
    for rpm in "$PACKAGES"/*.rpm; do
        arch=$(rpm -qp --queryformat '%{ARCH}' "$rpm" 2>/dev/null) \
            || fatal "$rpm is not an rpm package"
        mkdir -p "$yum/$arch"
        cp "$rpm" "$yum/$arch/"
    done
    # Debian's rpm looks for gpg2, which gnupg no longer ships.
    set -- --addsign --define "__gpg $(command -v gpg)" --define "_gpg_path $GNUPGHOME" \
        --define "_gpg_name $FPR"
    [ -z "$SIGN_OPTS" ] || set -- "$@" --define "_gpg_sign_cmd_extra_args $SIGN_OPTS"
    rpmsign "$@" "$yum"/*/*.rpm >"$WORK/rpmsign.log" 2>&1 \
        || { cat "$WORK/rpmsign.log" >&2; fatal "rpmsign could not sign the packages"; }
    createrepo_c --quiet "$yum" >"$WORK/createrepo.log" 2>&1 \
        || { cat "$WORK/createrepo.log" >&2; fatal "createrepo_c failed"; }
    sign --detach-sign --armor -o "$yum/repodata/repomd.xml.asc" "$yum/repodata/repomd.xml"
    cat >"$yum/llmgw.repo" <<EOF
[llmgw]
name=llmgw
baseurl=$URL/yum
enabled=1
gpgcheck=1
repo_gpgcheck=1
gpgkey=$URL/yum/RPM-GPG-KEY-llmgw
EOF
    info "yum: $(find "$yum" -name '*.rpm' | wc -l) signed packages"
}

# 5. the new tree replaces the old one
publish() {
    chmod 0755 "$STAGE"
    if [ -e "$OUT" ]; then
        mv "$OUT" "$STAGE.old"
    fi
    mv "$STAGE" "$OUT"
    rm -rf "$STAGE.old"
    info "repositories in $OUT: apt/llmgw.list and yum/llmgw.repo point at $URL"
}

cleanup() {
    if [ -n "${GNUPGHOME:-}" ]; then
        gpgconf --homedir "$GNUPGHOME" --kill all 2>/dev/null || true
        rm -rf "$GNUPGHOME"
    fi
    # shellcheck disable=SC2086 # paths made by mktemp, without spaces
    [ -z "$TO_CLEAN" ] || rm -rf $TO_CLEAN
}

main() {
    SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
    PACKAGES=${LLMGW_REPO_PACKAGES:-}
    OUT=${LLMGW_REPO_OUT:-}
    URL=${LLMGW_REPO_URL:-$DEFAULT_URL}
    parse_args "$@"
    [ -z "$PACKAGES" ] || PACKAGES=$(absolute "$PACKAGES")
    [ -z "$OUT" ] || OUT=$(absolute "$OUT")
    THROWAWAY_KEY=${LLMGW_THROWAWAY_KEY:-}
    [ -z "$THROWAWAY_KEY" ] || THROWAWAY_KEY=$(absolute "$THROWAWAY_KEY")
    cd "$(dirname "$0")/.."
    [ -n "$THROWAWAY_KEY" ] || THROWAWAY_KEY=$(pwd)/build/release-key/llmgw-release-throwaway.asc
    [ -n "$PACKAGES" ] || PACKAGES=$(pwd)/dist
    [ -n "$OUT" ] || OUT=$(pwd)/dist/repo
    URL=${URL%/}
    GNUPGHOME="" TO_CLEAN=""
    trap cleanup EXIT
    trap 'exit 130' INT TERM

    check_tools
    WORK=$(mktemp -d)
    TO_CLEAN=$WORK
    mkdir -p "$(dirname "$OUT")"
    STAGE=$(mktemp -d "$(dirname "$OUT")/.repo.XXXXXX")
    TO_CLEAN="$TO_CLEAN $STAGE $STAGE.old"
    load_key
    make_apt
    make_yum
    publish
}

main "$@"
