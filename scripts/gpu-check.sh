#!/bin/sh
# The GPU check: on a machine with NVIDIA GPUs, what the built llmgw's discovery reports
# (NVML and nvidia-smi side by side, MIG, a utilisation sample a second apart, the driver)
# next to nvidia-smi's own view (nvidia-smi -q, the CUDA version, the MIG instances), so that
# the two can be compared line by line. Read-only: it changes nothing on the machine.
#
# Usage: scripts/gpu-check.sh [LLMGW]   (default dist/llmgw-linux-ARCH from 'make dist', else
#        the llmgw on PATH); LLMGW_AGENT_CONFIG=FILE runs discovery as that agent.yaml says.
# Exit 0 when llmgw's discovery agrees with nvidia-smi on the GPUs' count, uuids and driver;
# 1 when it does not (the difference is printed); 2 when it cannot run at all.
set -eu

info() { printf '%s\n' "$*" >&2; }
fatal() { printf 'error: %s\n' "$*" >&2; exit 2; }
step() { printf '\n===== %s\n' "$*"; }

find_llmgw() {
    if [ -n "${1:-}" ]; then
        LLMGW=$1
    else
        case $(uname -m) in
            x86_64) arch=x64 ;;
            aarch64) arch=arm64 ;;
            *) arch=$(uname -m) ;;
        esac
        LLMGW=dist/llmgw-linux-$arch
        [ -x "$LLMGW" ] || LLMGW=$(command -v llmgw || true)
    fi
    if [ -z "$LLMGW" ] || [ ! -x "$LLMGW" ]; then
        fatal "no llmgw to check; build it with 'make dist' (dist/llmgw-linux-ARCH) or pass its path"
    fi
    command -v nvidia-smi >/dev/null 2>&1 \
        || fatal "no nvidia-smi on PATH: this check is for a machine with NVIDIA GPUs and their driver"
}

llmgw_view() {
    step "llmgw: $LLMGW"
    "$LLMGW" --version
    step "llmgw agent inventory --sources (what the agent would report; NVML and nvidia-smi side by side)"
    "$LLMGW" agent --config "${LLMGW_AGENT_CONFIG:-/etc/llmgw/agent.yaml}" inventory --sources || true
    REPORT=$(mktemp)
    trap 'rm -f "$REPORT"' EXIT
    "$LLMGW" agent --config "${LLMGW_AGENT_CONFIG:-/etc/llmgw/agent.yaml}" inventory --json >"$REPORT" \
        || fatal "llmgw agent inventory --json failed (above)"
}

nvidia_view() {
    step "nvidia-smi (its header: driver and CUDA version)"
    nvidia-smi || true
    step "nvidia-smi -L (GPUs and MIG devices)"
    nvidia-smi -L || true
    step "nvidia-smi --query-gpu (the fields llmgw reads)"
    nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.used,driver_version,utilization.gpu,mig.mode.current \
        --format=csv || true
    step "MIG GPU instances"
    nvidia-smi mig -lgi 2>&1 || true
    step "/proc/driver/nvidia/version"
    cat /proc/driver/nvidia/version 2>&1 || true
    step "nvidia-smi -q"
    nvidia-smi -q || true
}

# The GPUs' count and uuids and the driver, as llmgw and as nvidia-smi see them.
compare() {
    step "comparison"
    # The JSON is llmgw's (indent 2, one key a line): its driver, then each GPU's uuid.
    ours=$({
        sed -n 's/^ *"driver_version": "\(.*\)",\{0,1\}$/\1/p' "$REPORT" | head -n 1
        sed -n 's/^ *"uuid": "\(.*\)",\{0,1\}$/\1/p' "$REPORT"
    })
    theirs=$({
        nvidia-smi --query-gpu=driver_version --format=csv,noheader | head -n 1
        # MIG-mode GPUs are left out by llmgw (it places engines on whole GPUs): so here too.
        nvidia-smi --query-gpu=uuid,mig.mode.current --format=csv,noheader \
            | awk -F', ' '$2 != "Enabled" { print $1 }'
    })
    if [ "$ours" = "$theirs" ]; then
        printf 'llmgw and nvidia-smi agree: driver and %s GPU(s)\n' "$(printf '%s\n' "$theirs" | sed 1d | grep -c . || true)"
        return 0
    fi
    printf 'llmgw and nvidia-smi differ (first line: the driver, then the uuids of whole GPUs):\n'
    printf -- '--- llmgw\n%s\n--- nvidia-smi\n%s\n' "$ours" "$theirs"
    return 1
}

main() {
    find_llmgw "${1:-}"
    llmgw_view
    nvidia_view
    compare
}

main "$@"
