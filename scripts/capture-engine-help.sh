#!/bin/sh
# Capture vLLM's and SGLang's own words for the tests, from real installs, and check every
# command llmgw builds for them against their own parsers. No test runs this (tests never
# download); what it writes are the fixtures they read.
#
# Usage: scripts/capture-engine-help.sh [--venvs DIR] [--python PYTHON] [--vllm VERSION]
#            [--vllm-deps-of VERSION] [--sglang VERSION] [--check-only]
#   --venvs DIR        where the engines' virtual environments go, DIR/vllm and DIR/sglang,
#                      outside the repository (default ~/.cache/llmgw-engine-venvs; about
#                      10 GB each with torch). One that has the asked version is reused.
#   --python PYTHON    the Python the environments are made with (default python3)
#   --vllm VERSION     the vLLM release (default 0.34.0)
#   --vllm-deps-of V   install vLLM V with its dependencies first, then VERSION over it
#                      without them (default 0.33.0: 0.34.0 pins flashinfer-python==0.7.3,
#                      which is not on PyPI; its help and parser do not import it). Give
#                      the same version as --vllm when it installs as it is.
#   --sglang VERSION   the SGLang release (default 0.5.23)
#   --check-only       write nothing into the repository (every step but the last runs)
#
# What it does, for each engine (run from anywhere; needs the repository's .venv, make venv):
#   1. its environment: pip install ENGINE==VERSION into DIR/ENGINE unless it is there
#   2. its help, as engine-check runs it (C locale, no COLUMNS, the engine's CHECK_ENV):
#      `vllm serve --help=all` with VLLM_TARGET_DEVICE=cpu (vLLM prints nothing without a
#      GPU otherwise), `python -m sglang.launch_server --help`
#      -> tests/fixtures/engines/help/ENGINE.txt
#   3. the versions (engine, Python, torch) -> tests/fixtures/engines/help/VERSIONS
#   4. its KV cache events: the engine's own publisher, given the --kv-events-config llmgw
#      builds for a shard (an ipc:// socket in a directory the agent's code made), must
#      bind it; a SUB socket dials it as the agent does and keeps what arrives
#      -> tests/fixtures/engines/kvevents/ENGINE.json (scripts/lib/engine_kvframes.py)
#   5. llmgw ctl engine-check ENGINE --help-output ENGINE.txt
#   6. every command llmgw builds for the engine (scripts/lib/engine_argv.py: single node,
#      each parameter, KV events, each task, multi-node rank 0 and workers, each pool of a
#      disaggregated model) through the
#      engine's own parser and configuration checks (scripts/lib/engine_parse.py)
#   7. when all passed, the fixtures into place (each file whole)
# It stops at the first failure, saying which step; the engines' own output of steps 4 and
# 6 is kept in DIR/ENGINE.log.
#
# Environment: PIP_* as pip reads it (an index, a proxy, a constraint file).
set -eu

SELF=$0
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(dirname "$HERE")
HELP_DIR=$ROOT/tests/fixtures/engines/help
KV_DIR=$ROOT/tests/fixtures/engines/kvevents
LLMGW_PY=$ROOT/.venv/bin/python

# shellcheck source=lib/common.sh
. "$HERE/lib/common.sh"

VENVS=${HOME:-/root}/.cache/llmgw-engine-venvs
PYTHON=python3
VLLM_VERSION=0.34.0
VLLM_DEPS_OF=0.33.0
SGLANG_VERSION=0.5.23
CHECK_ONLY=""

parse_args() {
    while [ $# -gt 0 ]; do
        case $1 in
            --venvs) VENVS=$(absolute "${2:?--venvs needs a directory}"); shift 2 ;;
            --python) PYTHON=${2:?--python needs a program}; shift 2 ;;
            --vllm) VLLM_VERSION=${2:?--vllm needs a version}; shift 2 ;;
            --vllm-deps-of) VLLM_DEPS_OF=${2:?--vllm-deps-of needs a version}; shift 2 ;;
            --sglang) SGLANG_VERSION=${2:?--sglang needs a version}; shift 2 ;;
            --check-only) CHECK_ONLY=1; shift ;;
            -h | --help) usage ;;
            *) warn "unknown argument: $1"; usage ;;
        esac
    done
    [ -x "$LLMGW_PY" ] || fatal "no $LLMGW_PY; run 'make venv' in $ROOT first"
    case $VENVS in
        "$ROOT" | "$ROOT"/*) fatal "--venvs $VENVS is inside the repository; give a folder outside it" ;;
    esac
}

# The version of Python package $2 in environment $1, or nothing.
installed_version() {
    "$1/bin/python" -c "import importlib.metadata as m; print(m.version('$2'))" 2>/dev/null || true
}

# 1. DIR/ENGINE with ENGINE==VERSION ($3: the release whose dependencies it stands on)
install_engine() {
    engine=$1 version=$2 deps_of=${3:-$2}
    venv=$VENVS/$engine
    if [ "$(installed_version "$venv" "$engine")" = "$version" ]; then
        info "$engine $version: $venv (reused)"
        return 0
    fi
    info "$engine $version: installing into $venv (several GB, minutes)"
    mkdir -p "$VENVS"
    [ -x "$venv/bin/python" ] || "$PYTHON" -m venv "$venv" || fatal "$PYTHON -m venv $venv failed"
    "$venv/bin/pip" install -q -U pip || fatal "pip could not upgrade itself in $venv"
    "$venv/bin/pip" install -q "$engine==$deps_of" \
        || fatal "pip install $engine==$deps_of failed (output above); pick another release (--vllm, --vllm-deps-of, --sglang)"
    if [ "$deps_of" != "$version" ]; then
        "$venv/bin/pip" install -q --no-deps "$engine==$version" \
            || fatal "pip install --no-deps $engine==$version failed (output above)"
    fi
}

# The engine's help as engine-check runs it: stdout alone, stderr to the log.
engine_help() {
    case $1 in
        vllm) env -u COLUMNS LC_ALL=C VLLM_TARGET_DEVICE=cpu "$VENVS/vllm/bin/vllm" serve --help=all ;;
        sglang) env -u COLUMNS LC_ALL=C "$VENVS/sglang/bin/python" -m sglang.launch_server --help ;;
    esac
}

# 2. the help text, into $work/ENGINE.txt
capture_help() {
    info "$1: its help"
    engine_help "$1" >"$work/$1.txt" 2>>"$VENVS/$1.log" \
        || fatal "$1's help failed; see $VENVS/$1.log"
    grep -q -- "--help" "$work/$1.txt" || fatal "$1's help does not document --help: cut short? ($work/$1.txt)"
}

# 3. VERSIONS: what made the fixtures
write_versions() {
    {
        printf '# What made the help texts and KV event frames here (scripts/capture-engine-help.sh).\n'
        for engine in vllm sglang; do
            venv=$VENVS/$engine
            note=""
            [ "$engine" != vllm ] || [ "$VLLM_DEPS_OF" = "$VLLM_VERSION" ] \
                || note=" (installed without its dependencies over vllm $VLLM_DEPS_OF's)"
            printf '%s %s%s: %s, torch %s\n' "$engine" "$(installed_version "$venv" "$engine")" "$note" \
                "$("$venv/bin/python" -c 'import platform; print("Python", platform.python_version())')" \
                "$(installed_version "$venv" torch)"
        done
        printf 'captured %s\n' "$(date -u +%Y-%m-%d)"
    } >"$work/VERSIONS"
}

# 4. the engine's own publisher on llmgw's ipc:// endpoint, into $work/ENGINE.json
capture_kv_frames() {
    info "$1: its KV event publisher on llmgw's endpoint"
    config=$("$LLMGW_PY" -c "
import sys
from pathlib import Path
from llmgw.agent.kvevents import engine_config
from llmgw.agent.kvsockets import prepare_socket_dir
shard = 'llama-8b-r0-s0'
print(engine_config(shard, prepare_socket_dir(Path(sys.argv[1]), shard)))
" "$work/state-$1") || fatal "llmgw could not make a KV event socket directory under $work"
    "$VENVS/$1/bin/python" "$HERE/lib/engine_kvframes.py" "$1" "$config" \
        >"$work/$1.json" 2>>"$VENVS/$1.log" \
        || fatal "$1's publisher failed (last lines of $VENVS/$1.log: $(tail -n 3 "$VENVS/$1.log"))"
}

# 5. engine-check on the new help text
engine_check() {
    info "$1: llmgw ctl engine-check"
    "$ROOT/.venv/bin/llmgw" ctl engine-check "$1" --help-output "$work/$1.txt" \
        || fatal "$1's help lacks a flag llmgw passes (above)"
}

# 6. llmgw's commands through the engine's own parser
parse_forms() {
    info "$1: every command llmgw builds, through $1's own parser"
    "$LLMGW_PY" "$HERE/lib/engine_argv.py" "$1" >"$work/$1-forms.json" \
        || fatal "llmgw could not build $1's commands"
    status=0
    "$VENVS/$1/bin/python" "$HERE/lib/engine_parse.py" "$1" "$work/$1-forms.json" \
        >"$work/$1-parse.out" 2>>"$VENVS/$1.log" || status=$?
    cat "$work/$1-parse.out" >>"$VENVS/$1.log"
    grep -E '^(ok |REFUSED |[0-9]+ of )' "$work/$1-parse.out" >&2 || true
    [ "$status" -eq 0 ] || fatal "$1 refuses a command llmgw builds (above; its output in $VENVS/$1.log)"
}

# 7. the fixtures, each moved into place whole
install_fixtures() {
    mkdir -p "$KV_DIR"
    for engine in vllm sglang; do
        mv "$work/$engine.txt" "$HELP_DIR/$engine.txt"
        mv "$work/$engine.json" "$KV_DIR/$engine.json"
    done
    mv "$work/VERSIONS" "$HELP_DIR/VERSIONS"
    info "wrote $HELP_DIR/{vllm,sglang}.txt, VERSIONS and $KV_DIR/{vllm,sglang}.json"
}

main() {
    parse_args "$@"
    remove_on_exit
    work=$(mktemp -d)
    TO_CLEAN="$work"
    install_engine vllm "$VLLM_VERSION" "$VLLM_DEPS_OF"
    install_engine sglang "$SGLANG_VERSION"
    for engine in vllm sglang; do
        : >"$VENVS/$engine.log"
        capture_help "$engine"
        capture_kv_frames "$engine"
        engine_check "$engine"
        parse_forms "$engine"
    done
    write_versions
    if [ -n "$CHECK_ONLY" ]; then
        info "checks passed; --check-only: the fixtures are unchanged"
    else
        install_fixtures
    fi
}

main "$@"
