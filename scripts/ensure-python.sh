#!/bin/sh
# Create the project's virtual environment, installing what a fresh Debian 12 lacks for it.
set -eu

info() { printf '%s\n' "$*" >&2; }
fatal() { printf 'error: %s\n' "$*" >&2; exit 1; }

main() {
    if [ "${1:-}" = --optional ]; then
        shift
        install_optional "$@"
        return 0
    fi
    python=$1
    venv=$2
    command -v "$python" >/dev/null 2>&1 || install_debian_packages python3 python3-venv python3-pip
    command -v "$python" >/dev/null 2>&1 || fatal "no $python found; install Python 3.11 or newer"
    "$python" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
        || fatal "$python is $("$python" -V 2>&1); llmgw needs Python 3.11 or newer (PYTHON=python3.11 make ...)"
    if ! "$python" -m venv --help >/dev/null 2>&1 || ! "$python" -c 'import ensurepip' >/dev/null 2>&1; then
        install_debian_packages python3-venv
    fi
    info "creating $venv with $("$python" -V 2>&1)"
    "$python" -m venv "$venv" || {
        rm -rf "$venv"
        fatal "could not create $venv; on Debian/Ubuntu run: sudo apt-get install python3-venv"
    }
}

# --optional PROGRAM PACKAGE: what 'make run' is better with (bubblewrap, the engines'
# sandbox) but runs without: installed where that needs no password (root, or sudo -n), else
# left to the warning llmgw prints with the fix.
install_optional() {
    command -v "$1" >/dev/null 2>&1 && return 0
    command -v apt-get >/dev/null 2>&1 || return 0
    if [ "$(id -u)" -eq 0 ]; then
        info "installing $2 with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null 2>&1; } \
            || info "could not install $2; llmgw runs without it and says what it misses"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true >/dev/null 2>&1; then
        info "installing $2 with sudo apt-get"
        sudo -n DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$2" >/dev/null 2>&1 \
            || info "could not install $2; llmgw runs without it and says what it misses"
    fi
}

install_debian_packages() {
    command -v apt-get >/dev/null 2>&1 || return 0
    if [ "$(id -u)" -eq 0 ]; then
        info "installing $* with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null \
            || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
    elif command -v sudo >/dev/null 2>&1; then
        info "installing $* with sudo apt-get"
        sudo DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null
    else
        fatal "missing $*; run as root: apt-get install $*"
    fi
}

main "$@"
