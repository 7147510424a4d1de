#!/bin/sh
# Install, upgrade, roll back and remove the llmgw node agent (DESIGN §5, §7), from the
# bundle this script sits in (llmgw, systemd/, agent.example.yaml) or, with 'package', from
# the signed apt/yum repository.
#
# Usage: install-agent.sh VERB [OPTIONS]           (as root)
#   install [--node-id ID --enroll-url URL --ca-hash HASH [--node-uid UID]]
#           [--node-address IP | --mgmt-interface NAME]
#           [--firewall-from IP|CIDR]... [--fabric-peers CIDR]...
#           [--models-root DIR] [--cache-root DIR] [NODE FACTS] [--docker | --docker-group]
#       The service user, lingering, the binary (under /usr/local/lib/llmgw-agent, the
#       previous one kept; /usr/local/bin/llmgw links to it), the unit and its drop-in, the
#       update helper, the configuration; with the join options: 'llmgw agent join' (the
#       token from LLMGW_JOIN_TOKEN, else a prompt), start, wait until the agent listens.
#       Re-running it with the same options changes nothing and restarts nothing. A run that
#       fails (the join refused, the agent not up in time, ^C) removes what it created, and
#       only that: a failed fresh install leaves nothing installed.
#       --node-uid UID: re-pair a node whose state directory is gone, keeping its record
#       (the uid and re-pair token 'llmgw ctl join-command --rekey NODE --re-pair'
#       prints); it is approved by fingerprint again.
#       --node-address IP: this node's own address, where the control plane reaches its
#       data plane (agent.yaml mgmt_addr); --mgmt-interface NAME: the interface to take it
#       from (mgmt_interface; the agent refuses to start when it has no address). Neither:
#       the agent's route towards the control plane decides. Kept in agent.yaml; 'none'
#       clears. (--address is the old name of --node-address.)
#       NODE FACTS, written to agent.yaml and remembered (a re-run without them keeps them;
#       one with other values changes them and says so): --fabric NAME[:HCA,...]
#       (repeatable; a bare NAME takes this node's active InfiniBand adapters, found now and
#       listed; 'none' clears), --nvidia-smi PATH, --ib-root DIR ('none' clears either),
#       --engine NAME=PATH (repeatable; 'none' clears). --models-root and --cache-root are
#       kept the same way; agent.yaml is the truth: a root edited there by hand is kept.
#       --firewall-from: :9443 (the gateway) and the multi-node port range (agent.yaml's
#       multinode_ports, default 29500-29999) from these sources only; --fabric-peers: the
#       multi-node range only, from the fabric's own network. Both are remembered like the
#       facts ('none' removes their rules).
#       --docker: engines may run as Docker containers (runtime: docker), through
#       llmgw-docker-proxy, a socket that allows only the docker runtime's calls (llmgw's
#       labelled containers, unprivileged, ports on 127.0.0.1). --docker-group instead puts
#       the agent in the docker group, which is root on this host. Neither: the agent has no
#       Docker access (and leaves the docker group if an earlier install put it there).
#   upgrade [--ca-hash HASH] [NODE FACTS]
#                Install this bundle's binary and units, keep the configuration and the
#                identity, restart; roll back by itself when the new agent does not listen
#                within LLMGW_AGENT_HEALTH_TIMEOUT seconds (default 180), or stops within
#                LLMGW_AGENT_SETTLE_SECONDS (default 30) after it came up. --ca-hash (after
#                a CA rotation, the new pin 'llmgw ctl cert' shows): the update helper trusts
#                the CA of that pin from the agent's CA file from then on. NODE FACTS (as
#                for install) are written to agent.yaml once the new version runs.
#   rollback     Swap back to the previous binary and units, restart.
#   uninstall [--purge]
#                Stop and remove the binary, the units and the firewall rules; keep the
#                configuration, the identity and the models. --purge also removes the
#                configuration, the identity, the drop-ins, the update helper's trust and
#                state, and the user; never the model and cache folders.
#   rekey --enroll-url URL --ca-hash HASH [--node-id ID]        (also: --rekey)
#                Stop, 'llmgw agent join --rekey' (a rekey token in LLMGW_JOIN_TOKEN), start;
#                on failure the agent starts again on its old identity. The one-liner
#                'llmgw ctl join-command --rekey NODE' prints ends with this verb.
#   package --repo-url URL --repo-key FILE|URL [the options of install]
#                Install llmgw-agent with apt-get or dnf from the signed repository served
#                at URL (scripts/repo.sh's --url: URL/apt, URL/yum), then configure, join and
#                start as install does. A failed run rolls back as install's does, and
#                purges the package when that run installed it.
#   status       Versions, the unit, the port, the identity, the node facts, the firewall
#                rules (:9443 and the multi-node range).
#
# Before it changes anything, install checks systemd >= 247 (the unit's hardening needs it)
# and bubblewrap (bwrap: the engines' sandbox; not for a node with runtime: docker), warns
# with the fix when the host turns off the unprivileged user namespaces bwrap needs, and
# warns, naming the package, when what the node is set to run lacks nvidia-smi (NVIDIA
# GPUs on its PCI bus, or --nvidia-smi), Docker (--docker, --docker-group, runtime: docker)
# or the NVIDIA Container Toolkit (Docker and NVIDIA GPUs); the agent then reports the node
# degraded, with the same reasons, until it is fixed.
#
# Environment: LLMGW_JOIN_TOKEN (the join or rekey token; never pass it as an argument),
# LLMGW_AGENT_HEALTH_TIMEOUT (seconds to wait for the agent to listen; default 180),
# LLMGW_AGENT_SETTLE_SECONDS (an upgraded agent that stops within this many seconds after it
# came up is rolled back too; default 30, 0 turns the watch off).
set -eu

# Where things go; tests/packaging reads these assignments (keep them plain).
AGENT_PORT=9443
SERVICE_USER=llmgw-agent
CONFIG=/etc/llmgw/agent.yaml
STATE_DIR=/var/lib/llmgw-agent
# The agent's TMPDIR (its unit's second StateDirectory=): a sibling of STATE_DIR, never inside
# it, so that root never manages a path inside a tree the agent owns.
TMP_DIR=/var/lib/llmgw-agent-tmp
LIB_DIR=/usr/local/lib/llmgw-agent
UNIT_DIR=/etc/systemd/system
UPDATE_TRUST_DIR=/etc/llmgw/update
MODELS_ROOT=/srv/llmgw/models
CACHE_ROOT=/srv/llmgw/cache
# /usr/local/bin/llmgw: the installed binary on root's PATH (a bundle install only; a
# package puts /usr/bin/llmgw there itself).
COMMAND_LINK=/usr/local/bin/llmgw
# Where NVIDIA GPUs are looked for before the driver is there (vendor 0x10de, class 0x03...).
PCI_DEVICES=/sys/bus/pci/devices
# The kernel settings that may turn off the user namespaces the engines' sandbox needs.
PROC_SYS=/proc/sys
# The oldest systemd the agent's unit runs under as written (its sandboxing directives).
MIN_SYSTEMD=247
# agent.yaml's multinode_ports when there is no agent.yaml yet to ask (the agent's default).
DEFAULT_MULTINODE_PORTS=29500-29999
# A path given as a node fact: it goes into agent.yaml, a unit file, sed and awk (the same
# characters llmgw.contracts.nodefacts accepts).
FACT_PATH_RE='^/[A-Za-z0-9_./+-]*$'

UNIT=llmgw-agent.service
UPDATE_UNITS="llmgw-agent-update.path llmgw-agent-update.service"
DROPIN_DIR=$UNIT_DIR/$UNIT.d
DROPIN=$DROPIN_DIR/10-install.conf
PREVIOUS_DIR=$LIB_DIR/previous
# What the installer itself did (firewall rules, install mode); only install, package and
# uninstall write here (upgrades run from the sandboxed update helper, which cannot).
INSTALL_STATE=/var/lib/llmgw-agent-install
# The node facts (and model and cache roots) the last install was given, one 'KEY VALUE' a
# line, so that a re-run without them keeps them.
FACTS_RECORD=$INSTALL_STATE/facts
UPDATE_STATE=/var/lib/llmgw-update
LINGER_DIR=/var/lib/systemd/linger
PACKAGE_BIN=/usr/bin/llmgw
NFT_TABLE=llmgw
# Docker access (--docker): the proxy's unit and socket, and the agent's drop-in naming it.
PROXY_UNIT=llmgw-docker-proxy.service
PROXY_SOCKET=/run/llmgw-docker-proxy/docker.sock
DOCKER_DROPIN=$DROPIN_DIR/20-docker.conf
# Its unit's StateDirectory= under DynamicUser= (a link to private/): where it unpacks itself.
PROXY_STATE="/var/lib/llmgw-docker-proxy /var/lib/private/llmgw-docker-proxy"
# The lines of agent.yaml that 'install' owns (its options), rewritten by every install.
MANAGED_MARK="# install-agent.sh: set from its options at each install (edit by re-running it)"
DEFAULT_HEALTH_TIMEOUT=180
DEFAULT_SETTLE=30
# The only PATH programs run as the agent user get (their environment is reset).
AGENT_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

info() { printf '==> %s\n' "$*" >&2; }
warn() { printf 'warning: %s\n' "$*" >&2; }
fatal() {
    printf 'error: %s\n' "$*" >&2
    exit 1
}
usage() {
    sed -n 's/^# \{0,1\}//; /^Usage:/,/^$/p' "$0" >&2
    exit 2
}

# ------------------------------------------------------------------------------ arguments

parse_args() {
    VERB=${1:-}
    [ -n "$VERB" ] || usage
    shift
    case $VERB in
        -h | --help | help)
            sed -n 's/^# \{0,1\}//; /^Usage:/,/^$/p' "$0"
            exit 0
            ;;
    esac
    [ "$VERB" != --rekey ] || VERB=rekey # the guides' spelling of the verb
    NODE_ID="" ENROLL_URL="" CA_HASH="" NODE_ADDRESS="" MGMT_IFACE="" MGMT_GIVEN=""
    FIREWALL_FROM="" PURGE=""
    REPO_URL="" REPO_KEY="" DOCKER="" NODE_UID="" FABRIC_PEERS=""
    MODELS="" CACHE="" MODELS_GIVEN="" CACHE_GIVEN="" FIREWALL_GIVEN="" PEERS_GIVEN=""
    # Node facts: each list (space-separated checked values) with a flag saying it was given.
    FABRICS="" FABRICS_GIVEN="" ENGINES="" ENGINES_GIVEN="" NVIDIA_SMI="" IB_ROOT=""
    while [ $# -gt 0 ]; do
        case $1 in
            --purge)
                PURGE=1
                shift
                continue
                ;;
            --docker | --docker-group)
                mode=proxy
                [ "$1" = --docker ] || mode=group
                [ -z "$DOCKER" ] || [ "$DOCKER" = "$mode" ] \
                    || fatal "--docker and --docker-group exclude each other: give one"
                DOCKER=$mode
                shift
                continue
                ;;
            -h | --help) usage ;;
            --node-id | --enroll-url | --ca-hash | --node-address | --address | --mgmt-interface | \
                --firewall-from | --models-root | --cache-root | --repo-url | --repo-key | \
                --node-uid | --fabric-peers | --fabric | --nvidia-smi | --ib-root | --engine)
                if [ $# -lt 2 ] || [ -z "$2" ]; then fatal "$1 needs a value (see: $0 --help)"; fi
                ;;
            *) fatal "unknown option '$1' for '$VERB' (see: $0 --help)" ;;
        esac
        case $1 in
            --node-id) NODE_ID=$2 ;;
            --enroll-url) ENROLL_URL=$2 ;;
            --ca-hash) CA_HASH=$2 ;;
            --node-address | --address)
                [ "$1" = --node-address ] \
                    || warn "--address is now --node-address (this node's own address; 'llmgw ctl join-command --address' is the control plane's); --address still works, for now"
                [ -z "$NODE_ADDRESS" ] || fatal "--node-address is given twice; give it once"
                NODE_ADDRESS=$2
                ;;
            --mgmt-interface)
                [ -z "$MGMT_IFACE" ] || fatal "--mgmt-interface is given twice; give it once"
                MGMT_IFACE=$2
                ;;
            --firewall-from) FIREWALL_FROM="$FIREWALL_FROM $(check_source "$1" "$2")" FIREWALL_GIVEN=1 ;;
            --fabric-peers) FABRIC_PEERS="$FABRIC_PEERS $(check_source "$1" "$2")" PEERS_GIVEN=1 ;;
            --models-root) MODELS=$(check_dir_option "$1" "$2") MODELS_GIVEN=1 ;;
            --cache-root) CACHE=$(check_dir_option "$1" "$2") CACHE_GIVEN=1 ;;
            --node-uid) NODE_UID=$(check_node_uid "$2") ;;
            --fabric) FABRICS="$FABRICS $(check_fact "$1" "$2")" FABRICS_GIVEN=1 ;;
            --engine) ENGINES="$ENGINES $(check_fact "$1" "$2")" ENGINES_GIVEN=1 ;;
            --nvidia-smi)
                [ -z "$NVIDIA_SMI" ] || fatal "--nvidia-smi is given twice; give it once"
                NVIDIA_SMI=$(check_fact_path "$1" "$2")
                ;;
            --ib-root)
                [ -z "$IB_ROOT" ] || fatal "--ib-root is given twice; give it once"
                IB_ROOT=$(check_fact_path "$1" "$2")
                ;;
            --repo-url) REPO_URL=${2%/} ;;
            --repo-key) REPO_KEY=$2 ;;
        esac
        shift 2
    done
    case $VERB in
        install | package | upgrade | rollback | uninstall | rekey | status) ;;
        *) fatal "unknown verb '$VERB'; one of install, upgrade, rollback, uninstall, rekey, package, status" ;;
    esac
    if [ -n "$PURGE" ] && [ "$VERB" != uninstall ]; then
        fatal "--purge goes with 'uninstall' only"
    fi
    FACTS_GIVEN=$FABRICS_GIVEN$ENGINES_GIVEN$NVIDIA_SMI$IB_ROOT
    case $VERB in
        install | package)
            if [ -n "$NODE_ID$ENROLL_URL$CA_HASH" ] && { [ -z "$NODE_ID" ] || [ -z "$ENROLL_URL" ] || [ -z "$CA_HASH" ]; }; then
                fatal "joining needs --node-id, --enroll-url and --ca-hash together (the command 'llmgw ctl join-command' prints has all three)"
            fi
            if [ -n "$NODE_UID" ] && [ -z "$NODE_ID" ]; then
                fatal "--node-uid re-pairs a node: it goes with --node-id, --enroll-url and --ca-hash and a re-pair token (all in the command 'llmgw ctl join-command --rekey NODE --re-pair' prints)"
            fi
            ;;
        rekey)
            [ -n "$ENROLL_URL" ] || fatal "rekey needs --enroll-url and --ca-hash (from 'llmgw ctl join-command --rekey NODE')"
            [ -n "$CA_HASH" ] \
                || fatal "rekey needs --enroll-url and --ca-hash (from 'llmgw ctl join-command --rekey NODE')"
            ;;
        upgrade)
            [ -z "$NODE_ID$ENROLL_URL$NODE_ADDRESS$MGMT_IFACE$FIREWALL_FROM$REPO_URL$REPO_KEY$DOCKER$NODE_UID$FABRIC_PEERS$MODELS_GIVEN$CACHE_GIVEN" ] \
                || fatal "'upgrade' takes no options but --ca-hash (the cluster CA's pin after a CA rotation, from 'llmgw ctl cert') and the node facts (--fabric, --nvidia-smi, --ib-root, --engine); the others are install's: run install again with them"
            ;;
        *)
            [ -z "$NODE_ID$ENROLL_URL$CA_HASH$NODE_ADDRESS$MGMT_IFACE$FIREWALL_FROM$REPO_URL$REPO_KEY$DOCKER$NODE_UID$FABRIC_PEERS$MODELS_GIVEN$CACHE_GIVEN$FACTS_GIVEN" ] \
                || fatal "'$VERB' takes no options but --purge (uninstall)"
            ;;
    esac
    if [ "$VERB" = rekey ] && [ -n "$NODE_UID$FABRIC_PEERS$MODELS_GIVEN$CACHE_GIVEN$FACTS_GIVEN$FIREWALL_FROM$NODE_ADDRESS$MGMT_IFACE" ]; then
        [ -z "$NODE_UID" ] \
            || fatal "rekey replaces the key of a node that has its state directory; a node whose state directory is gone re-pairs with 'install --node-uid UID' (the command 'llmgw ctl join-command --rekey NODE --re-pair' prints)"
        fatal "rekey keeps agent.yaml, the drop-in and the firewall as they are; change them with install (the same options) before or after the rekey"
    fi
    check_fact_lists
    if [ -n "$DOCKER" ] && [ "$VERB" = rekey ]; then
        fatal "--docker and --docker-group go with 'install' and 'package' only"
    fi
    if [ "$VERB" = package ]; then
        [ -n "$REPO_URL" ] || fatal "package needs --repo-url URL (where the repository is served) and --repo-key FILE|URL (its public key)"
        [ -n "$REPO_KEY" ] \
            || fatal "package needs --repo-url URL (where the repository is served) and --repo-key FILE|URL (its public key)"
    elif [ -n "$REPO_URL$REPO_KEY" ]; then
        fatal "--repo-url and --repo-key go with 'package' only"
    fi
    check_node_address
    HEALTH_TIMEOUT=${LLMGW_AGENT_HEALTH_TIMEOUT:-$DEFAULT_HEALTH_TIMEOUT}
    case $HEALTH_TIMEOUT in
        '' | *[!0-9]*) fatal "LLMGW_AGENT_HEALTH_TIMEOUT='$HEALTH_TIMEOUT' is not a number of seconds" ;;
    esac
    SETTLE=${LLMGW_AGENT_SETTLE_SECONDS:-$DEFAULT_SETTLE}
    case $SETTLE in
        '' | *[!0-9]*) fatal "LLMGW_AGENT_SETTLE_SECONDS='$SETTLE' is not a number of seconds" ;;
    esac
}

# --node-address and --mgmt-interface: one or the other ('none' clears what agent.yaml has).
check_node_address() {
    if [ -n "$NODE_ADDRESS" ] && [ -n "$MGMT_IFACE" ]; then
        fatal "--node-address and --mgmt-interface both say where this node is reached; give one: the address itself, or the interface to take it from"
    fi
    if [ -n "$NODE_ADDRESS" ] && [ "$NODE_ADDRESS" != none ]; then
        check_address "$NODE_ADDRESS" || fatal "--node-address $NODE_ADDRESS is not an IP address (e.g. 10.0.0.5 or fd00::5)"
    fi
    if [ -n "$MGMT_IFACE" ] && [ "$MGMT_IFACE" != none ]; then
        check_iface "$MGMT_IFACE" || fatal "--mgmt-interface '$MGMT_IFACE' is not a network interface name: at most 15 letters, digits and _ . - (as 'ip -brief link' lists them)"
    fi
    return 0
}

# A network interface name, of the characters that can go into agent.yaml unquoted-safe
# and into sed and awk (llmgw.contracts.nodefacts takes the same).
check_iface() {
    printf '%s\n' "$1" | grep -Eq '^[A-Za-z0-9_.-]{1,15}$'
}

check_address() {
    case $1 in
        *:*) printf '%s\n' "$1" | grep -Eq '^[0-9A-Fa-f:.]+$' ;;
        *) printf '%s\n' "$1" | grep -Eq '^([0-9]{1,3}\.){3}[0-9]{1,3}$' ;;
    esac
}

check_source() { # OPTION VALUE ('none' clears what an earlier install opened)
    if [ "$2" = none ]; then
        printf 'none\n'
        return 0
    fi
    address=${2%/*}
    prefix=""
    [ "$address" = "$2" ] || prefix=${2##*/}
    check_address "$address" || fatal "$1 $2 is not an IP address or CIDR (e.g. 10.0.0.0/24)"
    case $prefix in
        '') ;;
        *[!0-9]*) fatal "$1 $2: the prefix length must be a number" ;;
        *)
            limit=32
            case $address in *:*) limit=128 ;; esac
            [ "$prefix" -le "$limit" ] || fatal "$1 $2: the prefix length is above $limit"
            ;;
    esac
    printf '%s\n' "$2"
}

check_dir_option() {
    case $2 in
        /*) ;;
        *) fatal "$1 $2 is not an absolute path" ;;
    esac
    case $2 in
        *[[:space:]]* | *[\"\'\\]*) fatal "$1 '$2': a path with spaces or quotes cannot go into a unit's ReadWritePaths=" ;;
    esac
    check_fact_path "$1" "$2" >/dev/null
    printf '%s\n' "${2%/}"
}

# A path fact (or 'none' where the option allows it): absolute, of the characters that can
# go into agent.yaml, a unit file and this script's sed and awk.
check_fact_path() {
    if [ "$2" = none ] && { [ "$1" = --nvidia-smi ] || [ "$1" = --ib-root ]; }; then
        printf 'none\n'
        return 0
    fi
    case $2 in
        /*) ;;
        *) fatal "$1 '$2' is not an absolute path; give one starting with '/'" ;;
    esac
    printf '%s\n' "$2" | grep -Eq "$FACT_PATH_RE" \
        || fatal "$1 '$2' holds a character other than letters, digits and _ . / + - (white space, a quote, ':', '#', '\$'...), which cannot go into agent.yaml and the unit; use a path without them (a symlink to it)"
    case "$2/" in
        */../* | */./*) fatal "$1 '$2' holds '.' or '..' components; give the path itself" ;;
    esac
    printf '%s\n' "${2%/}"
}

# --fabric and --engine values: one word of the characters their syntax uses (NAME:HCA,HCA
# and NAME=PATH); what they mean is checked by 'llmgw agent render-facts' (check_facts).
check_fact() {
    printf '%s\n' "$2" | grep -Eq '^[A-Za-z0-9_.:,=/+-]+$' \
        || fatal "$1 '$2' is not $([ "$1" = --fabric ] && echo "NAME:HCA[,HCA...] (e.g. ib-b:mlx5_2,mlx5_3)" || echo "NAME=PATH (e.g. vllm=/opt/vllm/bin/vllm)"), or 'none'"
    printf '%s\n' "$2"
}

check_node_uid() {
    printf '%s\n' "$1" | grep -Eq '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$' \
        || fatal "--node-uid '$1' is not a node uid; give the one 'llmgw ctl join-command --rekey NODE --re-pair' prints (also in 'llmgw ctl nodes --json')"
    printf '%s\n' "$1"
}

# 'none' clears a list, and goes alone.
check_fact_lists() {
    for pair in "--fabric:$FABRICS" "--engine:$ENGINES" "--firewall-from:$FIREWALL_FROM" \
        "--fabric-peers:$FABRIC_PEERS"; do
        option=${pair%%:*}
        # shellcheck disable=SC2086 # a list of checked words
        set -- ${pair#*:}
        if [ $# -gt 1 ]; then
            for value in "$@"; do
                [ "$value" != none ] || fatal "$option none clears what an earlier install set: give it alone, not with other $option options"
            done
        fi
    done
}

# ------------------------------------------------------------------------------ helpers

check_root() {
    [ "$(id -u)" -eq 0 ] || fatal "'$VERB' needs root; run it with sudo (sudo --preserve-env=LLMGW_JOIN_TOKEN to pass a token)"
}

check_systemd() {
    [ -d /run/systemd/system ] \
        || fatal "systemd is not running (no /run/systemd/system); the agent is a systemd service: install on a machine booted with systemd"
    for tool in systemctl ss sha256sum setpriv; do
        command -v "$tool" >/dev/null 2>&1 || fatal "no $tool; install it (apt-get install -y iproute2 util-linux systemd coreutils)"
    done
    check_systemd_version
}

# The unit's sandboxing (ProtectProc=, the credentials and directories it names) needs
# systemd 247 or later: older ones would start the agent less confined than it says, or not.
check_systemd_version() {
    said=$(systemctl --version 2>/dev/null | head -n 1)
    version=$(printf '%s\n' "$said" | sed -n 's/^systemd \([0-9][0-9]*\).*/\1/p')
    [ -n "$version" ] || fatal "could not read systemd's version ('systemctl --version' said '$said'); the agent needs systemd $MIN_SYSTEMD or later"
    [ "$version" -ge "$MIN_SYSTEMD" ] \
        || fatal "systemd $version is older than $MIN_SYSTEMD, which the agent's hardened unit needs; upgrade the OS (Debian 11, Ubuntu 22.04, RHEL 9 or later ship a newer one). Nothing was changed"
}

# Staging area for everything written atomically, removed at exit; a failed install first
# undoes what it created (undo_created).
make_stage() {
    STAGE=$(mktemp -d)
    trap 'on_exit' EXIT
    trap 'exit 130' INT TERM
}

on_exit() {
    exit_status=$?
    set +e
    if [ "$exit_status" -ne 0 ] && [ -n "${UNDO:-}" ]; then
        undo_created
    fi
    rm -rf "$STAGE"
    exit "$exit_status"
}

sum_of() { sha256sum "$1" 2>/dev/null | cut -c1-64; }

# "640 root:llmgw-agent": the mode as install/chmod take it (leading zeros dropped).
mode_of() { stat -c '%a %U:%G' "$1" 2>/dev/null || true; }
same_mode() { [ "$(mode_of "$1")" = "${2#0} $3" ]; }

# Put SRC at DEST with MODE and OWNER (user:group) unless it is there already; CHANGED says
# which: yes when DEST changed, no when it was already so. Atomic: a copy beside DEST, then mv.
put_file() {
    src=$1 dest=$2 mode=$3 owner=$4
    CHANGED=no
    if [ -f "$dest" ] && cmp -s "$src" "$dest" && same_mode "$dest" "$mode" "$owner"; then
        return 0
    fi
    note_created "$dest"
    mkdir -p "$(dirname "$dest")"
    tmp=$(dirname "$dest")/.$(basename "$dest").new.$$
    cp "$src" "$tmp"
    chmod "$mode" "$tmp"
    chown "$owner" "$tmp"
    mv -f "$tmp" "$dest"
    CHANGED=yes
}

# A directory with MODE and OWNER, made when missing; an existing one is set to them only
# when FORCE is given (our own directories), never an operator's model folder; CHANGED says
# whether it did anything (yes/no), as for put_file. Root never
# follows a link here: DIR must not be a symlink, and every directory above it must be root's
# and writable by no one else (unless sticky), so that no other user can swap DIR for a link
# between this check and chmod/chown (a planted 'ln -s /etc DIR' would otherwise hand /etc to
# the agent).
put_dir() {
    dir=$1 mode=$2 owner=$3 force=${4:-}
    CHANGED=no
    if [ -d "$dir" ] && ! [ -L "$dir" ] && { [ -z "$force" ] || same_mode "$dir" "$mode" "$owner"; }; then
        return 0
    fi
    root_owned_path "$(dirname "$dir")" \
        || fatal "$(dirname "$dir") (above $dir) $WHY; root does not manage paths there. Make $dir by hand (install -d -m $mode -o ${owner%%:*} -g ${owner#*:} $dir) in a directory only root can write, and run this again"
    if [ -L "$dir" ]; then
        fatal "$dir is a symlink (to $(readlink "$dir")); root does not follow it. Remove the link (rm $dir) and run this again"
    fi
    if [ ! -e "$dir" ]; then
        note_created "$dir"
        mkdir -p "$dir"
    elif [ ! -d "$dir" ]; then
        fatal "$dir is not a directory; move it away and run this again"
    fi
    chmod "$mode" "$dir"
    chown -h "$owner" "$dir"
    CHANGED=yes
}

# 0 when DIR (absolute) and every directory above it, as far as they exist, are real
# directories (no symlink) owned by root and writable by no one else unless sticky (/tmp);
# else 1, the reason in WHY.
root_owned_path() {
    path=$1
    WHY=""
    # Only an absolute path ends at /: dirname of a relative one ends at '.' for ever.
    case $path in
        /*) ;;
        *)
            WHY="is not an absolute path ('$path')"
            return 1
            ;;
    esac
    while :; do
        if [ -L "$path" ]; then
            WHY="leads through the symlink $path"
            return 1
        fi
        if [ -e "$path" ]; then
            path_uid=$(stat -c %u "$path")
            path_mode=0$(stat -c %a "$path")
            if [ "$path_uid" != 0 ]; then
                WHY="is not root's: $path belongs to uid $path_uid"
                return 1
            fi
            # Writable by group or others and not sticky: another user could swap an entry.
            if [ $((path_mode & 022)) -ne 0 ] && [ $((path_mode & 01000)) -eq 0 ]; then
                WHY="is writable by others: $path has mode ${path_mode#0}"
                return 1
            fi
        fi
        [ "$path" = / ] && return 0
        path=$(dirname "$path")
    done
}

# Run a program of the agent's as the service user, detached from root's terminal and
# environment: a new session (setsid: no controlling terminal to inject into), stdin from
# /dev/null, the environment reset to PATH, HOME, LANG, its TMPDIR and LLMGW_BY_INSTALLER=1
# ('llmgw agent join' then leaves agent.yaml and the start to this script, which says them
# with the real paths), plus the token, for as_agent_with_token only. Its output reaches root's terminal only after the fact, with
# control characters removed, so nothing the agent's code prints can drive that terminal.
as_agent() {
    agent_run "" "$@"
}

as_agent_with_token() {
    agent_run "$JOIN_TOKEN" "$@"
}

agent_run() {
    token=$1
    shift
    out=$STAGE/as-agent.out
    rc=0
    # The token goes through a pipe (printf is a builtin) to the inner sh, which reads it into
    # the agent's environment (read and export are builtins too): on env's argv it would be
    # in /proc/PID/cmdline, readable by every user of the machine, for as long as env ran.
    # Once the token is read, the agent's program gets /dev/null as its standard input, as
    # before: nothing of the installer's (nor an operator's terminal) reaches it.
    # shellcheck disable=SC2016 # $t and $@ are the inner sh's
    printf '%s\n' "$token" | (cd / && exec setsid -w env -i PATH="$AGENT_PATH" \
        HOME=/nonexistent LANG=C.UTF-8 TMPDIR="$TMP_DIR" LLMGW_BY_INSTALLER=1 sh -c 'IFS= read -r t || true
if [ -n "$t" ]; then LLMGW_JOIN_TOKEN=$t; export LLMGW_JOIN_TOKEN; fi
unset t
exec </dev/null
exec setpriv --reuid="$0" --regid="$0" --init-groups -- "$@"' "$SERVICE_USER" "$@") \
        >"$out" 2>&1 || rc=$?
    tr -d '\000-\010\013-\037\177' <"$out" >&2
    rm -f "$out"
    return $rc
}

# A file of the agent's (FILE, in a directory it can write) copied into DEST (root's) by the
# agent user: a symlink it planted leads only where the agent itself may read, and a FIFO or
# a huge file cannot hold up or fill the installer. DEST is empty when it could not be read.
agent_read() {
    : >"$2"
    (cd / && exec setsid -w env -i PATH="$AGENT_PATH" LANG=C.UTF-8 setpriv --reuid="$SERVICE_USER" \
        --regid="$SERVICE_USER" --init-groups -- timeout 30 head -c 1048576 -- "$1") </dev/null >"$2" 2>/dev/null \
        || : >"$2"
}

# "X.Y.Z" from a binary's --version, run as root with TMPDIR in the stage; empty when it does
# not answer.
version_of() {
    [ -x "$1" ] || return 0
    said=$(TMPDIR=$STAGE "$1" --version 2>/dev/null) || return 0
    case $said in
        "llmgw "*) printf '%s\n' "${said#llmgw }" ;;
    esac
}

journal_tail() {
    journalctl -u "$UNIT" -n 25 --no-pager 2>/dev/null | sed 's/^/    /' >&2 || true
}

is_listening() {
    [ -n "$(ss -ltnH "( sport = :$AGENT_PORT )" 2>/dev/null)" ]
}

invocation_of() { systemctl show -p InvocationID --value "$UNIT" 2>/dev/null || true; }

# Restart the agent without waiting on systemd (our own timeout decides), then wait.
restart_agent() {
    RESTARTED_FROM=$(invocation_of)
    systemctl restart --no-block "$UNIT"
}

# Until the unit is active (READY=1: stream up, data plane bound) and the port listens; after
# restart_agent, as a new invocation: with --no-block the old one can still be active and
# listening for a moment, and that is not the restarted agent.
wait_listening() {
    timeout=$1
    waited=0
    while :; do
        if [ "$(systemctl is-active "$UNIT" 2>/dev/null)" = active ] && is_listening \
            && { [ -z "${RESTARTED_FROM:-}" ] || [ "$(invocation_of)" != "$RESTARTED_FROM" ]; }; then
            return 0
        fi
        [ "$waited" -ge "$timeout" ] && return 1
        sleep 1
        waited=$((waited + 1))
    done
}

has_identity() { [ -f "$STATE_DIR/node.crt" ]; }

mode_recorded() { cat "$INSTALL_STATE/mode" 2>/dev/null || true; }

# The binary the units run: the package's, or the tarball install's.
agent_bin() {
    if [ "$(mode_recorded)" = package ]; then
        printf '%s\n' "$PACKAGE_BIN"
    else
        printf '%s\n' "$LIB_DIR/llmgw"
    fi
}

bundle_dir() {
    BUNDLE=$(cd "$(dirname "$0")" && pwd)
    [ -f "$BUNDLE/llmgw" ] \
        || fatal "no llmgw next to this script ($BUNDLE); run the install-agent.sh of an unpacked llmgw-agent-*.tar.gz bundle"
    [ -f "$BUNDLE/systemd/$UNIT" ] \
        || fatal "no systemd/$UNIT in $BUNDLE; the bundle is incomplete: download it again"
    chmod 0755 "$BUNDLE/llmgw" 2>/dev/null || true
    NEW_VERSION=$(version_of "$BUNDLE/llmgw")
    [ -n "$NEW_VERSION" ] \
        || fatal "$BUNDLE/llmgw does not run here ('llmgw --version' failed): is the bundle for this architecture ($(uname -m))? Nothing was changed"
}

# A unit from systemd/ as installed here: ExecStart pointed at BIN (the unit ships with the
# package's /usr/bin/llmgw); the file is otherwise the bundle's.
render_unit() {
    src=$1 bin=$2 out=$3
    {
        printf '# Installed by install-agent.sh from the bundle'"'"'s systemd/%s (ExecStart: %s).\n' \
            "$(basename "$src")" "$bin"
        sed "s#^ExecStart=\([-+!@:]*\)[^ ]*/llmgw\( \|\$\)#ExecStart=\1$bin\2#" "$src"
    } >"$out"
    grep -q '^ExecStart=' "$src" || return 0
    grep -q "^ExecStart=[-+!@:]*$bin\( \|\$\)" "$out" \
        || fatal "$src has no 'ExecStart=.../llmgw' line to point at $bin; the bundle is broken"
}

# ------------------------------------------------------------------------------ a failed install's undo
# install writes down what it creates as it goes, one 'KIND WHAT' a line in STAGE/created: a
# path that was not there (the topmost of it and the directories mkdir -p makes above it),
# the user, the group, lingering, firewall rules. A failure anywhere after that (the EXIT
# trap: a fatal, a failed command, ^C) takes back exactly those, newest first: a fresh install
# that fails leaves the host as it found it, and a failed re-run over an earlier install
# removes nothing that install had (it created nothing of it). 'package' records the same
# way, and the package itself (note_package) when this run is the one that installs it.
arm_undo() {
    FRESH=yes
    if [ -e "$LIB_DIR/llmgw" ] || has_identity || [ -n "$(mode_recorded)" ] || package_installed; then
        FRESH=""
    fi
    UNDO=$STAGE/created
    : >"$UNDO"
    # Made by systemd (the proxy's StateDirectory=) or the update helper, not by this script,
    # but only because of this run when they are not there before it.
    for path in $UPDATE_STATE $PROXY_STATE; do
        [ -e "$path" ] || [ -L "$path" ] || note_undo path "$path"
    done
}

note_undo() { [ -z "${UNDO:-}" ] || printf '%s %s\n' "$1" "$2" >>"$UNDO"; }

# PATH is about to be made (its own variable names: sh has no local ones, and the callers
# use path, dir, dest).
note_created() {
    [ -n "${UNDO:-}" ] || return 0
    nc_path=$1 nc_top=""
    while [ "$nc_path" != / ] && [ ! -e "$nc_path" ] && [ ! -L "$nc_path" ]; do
        nc_top=$nc_path
        nc_path=$(dirname "$nc_path")
    done
    [ -z "$nc_top" ] || note_undo path "$nc_top"
}

# llmgw-agent in the package manager install_package uses (dpkg where apt-get is, else rpm):
# installed, config-files (removed, its configuration left), partly (half-installed or
# half-configured), or nothing when it has none.
package_state() {
    if command -v apt-get >/dev/null 2>&1; then
        case $(dpkg-query -W -f '${db:Status-Status}' llmgw-agent 2>/dev/null) in
            installed) echo installed ;;
            config-files) echo config-files ;;
            "" | not-installed) ;;
            *) echo partly ;;
        esac
    elif command -v rpm >/dev/null 2>&1 && rpm -q llmgw-agent >/dev/null 2>&1; then
        echo installed
    fi
}

package_installed() { [ "$(package_state)" = installed ]; }

# Before 'package' installs llmgw-agent, when it is not installed yet: what the package's own
# scripts make besides its files (preinst: the group and user; postinst: lingering, the
# default data folders; the state and /etc/llmgw the agent and this script fill), as
# note_created would have, then the package, so that the undo (newest first) purges the
# package before it removes those. A package that is installed already is left out: a failed
# re-run keeps it. Removed with its configuration left (dpkg's config-files), it goes back
# to that state.
note_package() {
    package_installed && return 0
    getent group "$SERVICE_USER" >/dev/null 2>&1 || note_undo group "$SERVICE_USER"
    getent passwd "$SERVICE_USER" >/dev/null 2>&1 || note_undo user "$SERVICE_USER"
    [ -e "$LINGER_DIR/$SERVICE_USER" ] || note_undo linger "$SERVICE_USER"
    for path in /etc/llmgw "$STATE_DIR" "$TMP_DIR" "$MODELS_ROOT" "$CACHE_ROOT"; do
        note_created "$path"
    done
    action=purge
    [ "$(package_state)" != config-files ] || action=remove
    note_undo package "$action"
}

# 0 when there is a package to take out as ACTION: this run got it (partly) in.
package_to_undo() {
    case $(package_state) in
        "") return 1 ;;
        config-files) [ "$1" = purge ] ;;
    esac
}

# 0 when the undo list has the package: this run installed it.
package_undone() { grep -q '^package ' "${UNDO_LIST:-$UNDO}"; }

# The package this run installed, taken out again as note_package recorded (ACTION: purge or
# remove) after its units were stopped; 1 when the package manager fails. Its maintainer
# scripts get no standard input (the undo loop reads its list there).
undo_package() {
    if command -v apt-get >/dev/null 2>&1; then
        # dpkg, not apt-get: offline, and it takes a half-installed package too.
        DEBIAN_FRONTEND=noninteractive dpkg --"$1" llmgw-agent >"$STAGE/undo-package.log" 2>&1 </dev/null \
            || { cat "$STAGE/undo-package.log" >&2; return 1; }
    else
        rpm -e llmgw-agent >&2 </dev/null
    fi
}

# 0 when this run made PATH (it, or a directory above it, is in the list).
was_created() {
    while read -r wc_kind wc_what; do
        [ "$wc_kind" = path ] || continue
        case $1 in
            "$wc_what" | "$wc_what"/*) return 0 ;;
        esac
    done <"${UNDO_LIST:-$UNDO}"
    return 1
}

make_dir() {
    note_created "$1"
    mkdir -p "$1"
}

# The service user and what runs as it: its manager, its processes. 1 when userdel fails.
remove_user() {
    loginctl disable-linger "$SERVICE_USER" >/dev/null 2>&1 || true
    rm -f "$LINGER_DIR/$SERVICE_USER"
    getent passwd "$SERVICE_USER" >/dev/null 2>&1 || return 0
    uid=$(id -u "$SERVICE_USER")
    systemctl stop "user@$uid.service" >/dev/null 2>&1 || true
    # Whatever still runs as the user (engines started outside the unit) ends with it.
    pkill -TERM -u "$uid" >/dev/null 2>&1 || true
    waited=0
    while pgrep -u "$uid" >/dev/null 2>&1 && [ "$waited" -lt 10 ]; do
        sleep 1
        waited=$((waited + 1))
    done
    pkill -KILL -u "$uid" >/dev/null 2>&1 || true
    userdel "$SERVICE_USER" >/dev/null 2>&1 || userdel -f "$SERVICE_USER"
}

# Run by the EXIT trap after a failed install (set -e is off there): the reason is said
# already, above; this says what was taken back.
undo_created() {
    UNDO_LIST=$UNDO
    UNDO=""
    if [ ! -s "$UNDO_LIST" ]; then
        [ -z "${FRESH:-}" ] || printf 'error: install failed before it changed anything: nothing was left installed\n' >&2
        return 0
    fi
    info "rollback: the install failed; removing what it created"
    # The units it put in place stop first: the agent (and engines in its cgroup), the proxy;
    # all of them when the package came with this run (its units, enabled by this run).
    for name in llmgw-agent-update.path llmgw-agent-update.service $UNIT $PROXY_UNIT; do
        was_created "$UNIT_DIR/$name" || package_undone || continue
        systemctl disable --now "$name" >/dev/null 2>&1
        systemctl kill --signal=SIGKILL "$name" >/dev/null 2>&1
    done
    if grep -qx 'firewall rules' "$UNDO_LIST"; then
        # Rules added before a failed one are only in the new record yet.
        [ ! -f "$INSTALL_STATE/firewall.new" ] || mv -f "$INSTALL_STATE/firewall.new" "$INSTALL_STATE/firewall"
        firewall_clear
    fi
    joined=""
    was_created "$STATE_DIR" && [ -f "$STATE_DIR/node.crt" ] && joined=yes
    removed="" left=""
    tac "$UNDO_LIST" >"$STAGE/undo"
    while read -r kind what; do
        case $kind in
            path)
                # (One systemd was to make may never have come.)
                if [ -e "$what" ] || [ -L "$what" ]; then
                    case $what in
                        /?*) rm -rf "$what" && removed="$removed, $what" || left="$left $what" ;;
                    esac
                fi
                ;;
            user)
                # ('package' notes it before the package's preinst makes it, which may not come.)
                getent passwd "$what" >/dev/null 2>&1 || continue
                remove_user </dev/null && removed="$removed, user $what" || left="$left user:$what"
                ;;
            group)
                if getent group "$what" >/dev/null 2>&1; then
                    groupdel "$what" >/dev/null 2>&1 || left="$left group:$what"
                fi
                ;;
            linger) loginctl disable-linger "$what" >/dev/null 2>&1 ;;
            package)
                package_to_undo "$what" || continue
                undo_package "$what" && removed="$removed, package llmgw-agent" || left="$left package:llmgw-agent"
                ;;
            firewall) removed="$removed, its firewall rules" ;;
        esac
    done <"$STAGE/undo"
    systemctl daemon-reload >/dev/null 2>&1
    systemctl reset-failed "$UNIT" >/dev/null 2>&1
    [ -z "$joined" ] || warn "this node had joined as $NODE_ID before the failure: its enrolment stays on the control plane; reject it there (llmgw ctl reject $NODE_ID) or join again with a new token from 'llmgw ctl join-command --node $NODE_ID'"
    if [ -n "$left" ]; then
        printf 'error: rolled back, but could not remove:%s (above); remove them by hand\n' "$left" >&2
    elif [ -n "${FRESH:-}" ]; then
        printf 'error: rolled back (removed %s): nothing was left installed\n' "${removed#, }" >&2
    else
        printf 'error: rolled back what this run added (removed %s); the install that was here before is kept\n' "${removed#, }" >&2
    fi
}

# ------------------------------------------------------------------------------ install steps
# Numbered in the order install runs them (the run order is at the end of this file). A step
# that changes what the agent runs with sets RESTART=yes: the units are reloaded and the agent
# (re)started; one that changes its Docker access sets DOCKER_CHANGED=yes too.

# 1. the service user: a system user, no login, no home; in the docker group only with
# --docker-group (configure_docker).
ensure_user() {
    if ! getent passwd "$SERVICE_USER" >/dev/null 2>&1; then
        info "user: creating system user $SERVICE_USER"
        if ! getent group "$SERVICE_USER" >/dev/null 2>&1; then
            note_undo group "$SERVICE_USER"
            groupadd --system "$SERVICE_USER"
        fi
        note_undo user "$SERVICE_USER"
        useradd --system --gid "$SERVICE_USER" --no-create-home --home-dir /nonexistent \
            --shell /usr/sbin/nologin --comment "llmgw node agent" "$SERVICE_USER"
    fi
}

# 2. lingering: the user's manager runs without a login session (engines in its scope).
ensure_linger() {
    [ -e "$LINGER_DIR/$SERVICE_USER" ] && return 0
    info "user: lingering on for $SERVICE_USER"
    note_undo linger "$SERVICE_USER"
    if ! loginctl enable-linger "$SERVICE_USER" >/dev/null 2>&1; then
        # No logind: the flag file is what it reads when it starts.
        make_dir "$LINGER_DIR"
        note_created "$LINGER_DIR/$SERVICE_USER"
        : >"$LINGER_DIR/$SERVICE_USER"
    fi
}

# 3. folders: state (0700, the agent's), models and caches (made when missing), /etc/llmgw.
ensure_dirs() {
    put_dir "$STATE_DIR" 0700 "$SERVICE_USER:$SERVICE_USER" force
    put_dir "$TMP_DIR" 0700 "$SERVICE_USER:$SERVICE_USER" force
    for dir in "$MODELS" "$CACHE"; do
        put_dir "$dir" 0755 "$SERVICE_USER:$SERVICE_USER"
        if [ "$CHANGED" = yes ]; then
            info "folders: made $dir"
        fi
    done
    put_dir /etc/llmgw 0755 root:root
}

# 4. the binary, the previous one kept for rollback (with the units it ran under); 'package'
# installs the package instead (install_package), before steps 1 to 3.
install_binary() {
    if [ -f "$LIB_DIR/llmgw" ] && cmp -s "$BUNDLE/llmgw" "$LIB_DIR/llmgw"; then
        return 0
    fi
    put_dir "$LIB_DIR" 0755 root:root force
    if [ -f "$LIB_DIR/llmgw" ]; then
        keep_previous
        rm -rf "$PREVIOUS_DIR.old"
    fi
    info "binary: llmgw $NEW_VERSION into $LIB_DIR"
    put_file "$BUNDLE/llmgw" "$LIB_DIR/llmgw" 0755 root:root
    RESTART=yes
}

keep_previous() {
    rm -rf "$PREVIOUS_DIR.new"
    mkdir -p "$PREVIOUS_DIR.new"
    cp -p "$LIB_DIR/llmgw" "$PREVIOUS_DIR.new/llmgw"
    for name in $UNIT $UPDATE_UNITS; do
        [ -f "$UNIT_DIR/$name" ] && cp -p "$UNIT_DIR/$name" "$PREVIOUS_DIR.new/$name"
    done
    # The slot's former content stays as previous.old until the caller knows the new binary
    # is good: an upgrade that rolls back puts it back.
    rm -rf "$PREVIOUS_DIR.old"
    if [ -d "$PREVIOUS_DIR" ]; then mv "$PREVIOUS_DIR" "$PREVIOUS_DIR.old"; fi
    mv "$PREVIOUS_DIR.new" "$PREVIOUS_DIR"
    info "binary: kept llmgw $(version_of "$PREVIOUS_DIR/llmgw") in $PREVIOUS_DIR for rollback"
}

# 5. the units: the agent's (unless a package owns it) and the update helper's.
install_units() {
    bin=$(agent_bin)
    names=$UPDATE_UNITS
    [ "$(mode_recorded)" = package ] || names="$UNIT $names"
    # The proxy's unit, where --docker installed it (the package ships its own).
    if [ "$(mode_recorded)" != package ] && [ "$(docker_recorded)" = proxy ]; then
        names="$names $PROXY_UNIT"
    fi
    for name in $names; do
        [ -f "$BUNDLE/systemd/$name" ] || fatal "no systemd/$name in $BUNDLE; the bundle is incomplete"
        render_unit "$BUNDLE/systemd/$name" "$bin" "$STAGE/$name"
        put_file "$STAGE/$name" "$UNIT_DIR/$name" 0644 root:root
        if [ "$CHANGED" = yes ]; then
            info "units: $UNIT_DIR/$name"
            RESTART=yes
        fi
    done
}

# 6. the drop-in: the model and cache roots the agent may write.
install_dropin() {
    {
        echo "# Written by install-agent.sh (install --models-root/--cache-root); rewritten at"
        echo "# each install. Your own settings: systemctl edit $UNIT (override.conf)."
        echo "[Service]"
        echo "ReadWritePaths=-$MODELS -$CACHE"
    } >"$STAGE/10-install.conf"
    put_file "$STAGE/10-install.conf" "$DROPIN" 0644 root:root
    if [ "$CHANGED" = yes ]; then
        info "units: $DROPIN (ReadWritePaths=$MODELS $CACHE)"
        RESTART=yes
    fi
}

# 7. Docker access, as --docker/--docker-group say (recorded; re-runs say it again):
# proxy: llmgw-docker-proxy's socket and a drop-in that points the agent at it (DOCKER_HOST);
# group: the docker group, root on this host; neither: none. DOCKER_CHANGED=yes (and
# RESTART=yes) when something changed.
docker_recorded() { cat "$INSTALL_STATE/docker" 2>/dev/null || true; }

in_docker_group() {
    case " $(id -nG "$SERVICE_USER" 2>/dev/null) " in
        *" docker "*) return 0 ;;
    esac
    return 1
}

# What Docker access the agent has, in words (status). The group is looked at, not only the
# record: an installer older than --docker put the agent in the docker group and recorded
# nothing, and 'upgrade' (signed updates, packages) keeps that membership.
docker_access() {
    if in_docker_group; then
        if [ "$(docker_recorded)" = group ]; then
            echo "$SERVICE_USER is in the docker group (root on this host)"
        else
            echo "$SERVICE_USER is in the docker group (root on this host), put there by an older install; run install --docker (with this node's options) to move it to $PROXY_UNIT"
        fi
        return 0
    fi
    case $(docker_recorded) in
        proxy) echo "through $PROXY_UNIT ($PROXY_SOCKET): $(systemctl is-active "$PROXY_UNIT" 2>/dev/null || true)" ;;
        *) echo "no access (install --docker gives it through $PROXY_UNIT)" ;;
    esac
}

# An upgrade changes no access, but says so when the agent is root on this host by a group
# membership no --docker-group asked for.
warn_docker_group() {
    if in_docker_group && [ "$(docker_recorded)" != group ]; then
        warn "$SERVICE_USER is in the docker group, which is root on this host (an install older than --docker put it there; upgrades keep it): run install-agent.sh install --docker with this node's options to move it to $PROXY_UNIT"
    fi
}

configure_docker() {
    if [ -n "$DOCKER" ] && ! getent group docker >/dev/null 2>&1; then
        fatal "--$([ "$DOCKER" = group ] && echo docker-group || echo docker) needs Docker, and this host has no docker group; install Docker (apt-get install -y docker.io), then run this again"
    fi
    if [ "$DOCKER" = group ]; then
        warn "--docker-group: $SERVICE_USER joins the docker group, which is root on this host (whoever runs code as $SERVICE_USER can run 'docker run --privileged -v /:/h'); --docker gives it llmgw-docker-proxy's socket instead, which allows only what llmgw's engines need"
        if ! in_docker_group; then
            info "user: adding $SERVICE_USER to the docker group"
            usermod -aG docker "$SERVICE_USER"
            DOCKER_CHANGED=yes
        fi
    elif in_docker_group; then
        info "user: removing $SERVICE_USER from the docker group (root on this host)$([ "$DOCKER" = proxy ] || echo "; give --docker for Docker engines through llmgw-docker-proxy")"
        gpasswd -d "$SERVICE_USER" docker >/dev/null
        DOCKER_CHANGED=yes
    fi
    if [ "$DOCKER" = proxy ]; then
        if [ "$(mode_recorded)" != package ]; then
            render_unit "$BUNDLE/systemd/$PROXY_UNIT" "$(agent_bin)" "$STAGE/$PROXY_UNIT"
            put_file "$STAGE/$PROXY_UNIT" "$UNIT_DIR/$PROXY_UNIT" 0644 root:root
            if [ "$CHANGED" = yes ]; then
                info "units: $UNIT_DIR/$PROXY_UNIT"
                DOCKER_CHANGED=yes
            fi
        fi
        {
            echo "# Written by install-agent.sh --docker: the docker runtime goes through"
            echo "# $PROXY_UNIT, never to docker.sock itself; rewritten at each install."
            echo "[Unit]"
            echo "Wants=$PROXY_UNIT"
            echo "After=$PROXY_UNIT"
            echo "[Service]"
            echo "Environment=DOCKER_HOST=unix://$PROXY_SOCKET"
        } >"$STAGE/20-docker.conf"
        put_file "$STAGE/20-docker.conf" "$DOCKER_DROPIN" 0644 root:root
        if [ "$CHANGED" = yes ]; then
            info "units: $DOCKER_DROPIN (DOCKER_HOST=unix://$PROXY_SOCKET)"
            DOCKER_CHANGED=yes
        fi
    else
        if [ -f "$DOCKER_DROPIN" ] || [ -f "$UNIT_DIR/$PROXY_UNIT" ] \
            || [ "$(systemctl is-enabled "$PROXY_UNIT" 2>/dev/null)" = enabled ]; then
            info "docker: $PROXY_UNIT off"
            systemctl disable --now "$PROXY_UNIT" >/dev/null 2>&1 || true
            rm -f "$DOCKER_DROPIN" "$UNIT_DIR/$PROXY_UNIT"
            # shellcheck disable=SC2086 # a list of absolute paths without spaces
            rm -rf $PROXY_STATE
            DOCKER_CHANGED=yes
        fi
    fi
    make_dir "$INSTALL_STATE"
    printf '%s\n' "${DOCKER:-none}" >"$STAGE/docker"
    put_file "$STAGE/docker" "$INSTALL_STATE/docker" 0644 root:root
    if [ "$DOCKER_CHANGED" = yes ]; then
        RESTART=yes
    fi
}

# After the daemon-reload: the proxy enabled, and (re)started when --docker asked for it and
# its unit changed or it does not run.
start_docker_proxy() {
    [ "$DOCKER" = proxy ] || return 0
    systemctl enable "$PROXY_UNIT" >/dev/null 2>&1 || fatal "systemctl enable $PROXY_UNIT failed"
    if [ "$DOCKER_CHANGED" = no ] && [ "$(systemctl is-active "$PROXY_UNIT" 2>/dev/null)" = active ]; then
        return 0
    fi
    systemctl restart "$PROXY_UNIT" \
        || fatal "$PROXY_UNIT did not start; see: journalctl -u $PROXY_UNIT (is docker running? systemctl start docker)"
    info "docker: $PROXY_UNIT serves $PROXY_SOCKET to $SERVICE_USER"
}

# 8. the join, as the service user, when asked (--node-id) and this node has no identity yet;
# a node joined already must be the one asked for.
ensure_joined() {
    if ! has_identity && [ -n "$NODE_ID" ]; then
        join_node
        RESTART=yes
    elif has_identity && [ -n "$NODE_ID" ]; then
        said=$(config_node_id)
        [ -z "$said" ] || [ "$said" = "$NODE_ID" ] \
            || fatal "this node is already joined as '$said', not '$NODE_ID'; uninstall --purge first to join it as another node"
        [ -z "$NODE_UID" ] \
            || fatal "this node still has its identity ($STATE_DIR/node.crt): --node-uid re-pairs a node whose state directory is gone. Rekey it instead with the command 'llmgw ctl join-command --rekey $NODE_ID' prints (the re-pair token is left unspent)"
    fi
}

# The token only in the join's environment. Writes the identity into the state directory
# and, when there is no valid agent.yaml yet, a fresh one in the stage (the service user
# cannot write /etc/llmgw).
join_node() {
    read_join_token "no join token: export LLMGW_JOIN_TOKEN=<token from 'llmgw ctl join-command'> and run again with 'sudo --preserve-env=LLMGW_JOIN_TOKEN' (or run in a terminal to be asked)"
    info "join: node $NODE_ID at $ENROLL_URL"
    if config_is_valid "$CONFIG"; then
        join_config=$CONFIG
    else
        joindir=$STAGE/join
        mkdir -p "$joindir"
        chown "$SERVICE_USER:$SERVICE_USER" "$joindir"
        chmod 0700 "$joindir"
        # The stage is root's 0700; the service user needs to pass through it.
        chmod 0711 "$STAGE"
        join_config=$joindir/agent.yaml
    fi
    if [ -n "$NODE_UID" ]; then
        info "join: re-pairing as uid $NODE_UID (it needs approval by fingerprint again)"
    fi
    as_agent_with_token "$(agent_bin)" agent join --node-id "$NODE_ID" --enroll-url "$ENROLL_URL" \
        --ca-hash "$CA_HASH" --config "$join_config" --state-dir "$STATE_DIR" \
        ${NODE_UID:+--node-uid "$NODE_UID"} \
        || fatal "'llmgw agent join' failed (its message above); nothing of the identity was written. Fix what it says and run this command again"
    if [ "$join_config" != "$CONFIG" ]; then
        # Read by the agent user: the join folder is the agent's, and a symlink planted there
        # must not make root copy a file of its own.
        agent_read "$join_config" "$STAGE/joined.yaml"
        [ -s "$STAGE/joined.yaml" ] || fatal "'llmgw agent join' wrote no $join_config"
    fi
}

# The join or rekey token into JOIN_TOKEN: LLMGW_JOIN_TOKEN, else asked for (not echoed) on a
# terminal; $1 is the error when there is neither. The agent user's program gets it in its
# environment only (never as an argument, never by a prompt of its own on root's terminal).
read_join_token() {
    JOIN_TOKEN=${LLMGW_JOIN_TOKEN:-}
    if [ -z "$JOIN_TOKEN" ] && [ -t 0 ]; then
        printf 'join token (from llmgw ctl join-command; not shown): ' >&2
        stty -echo 2>/dev/null || true
        IFS= read -r JOIN_TOKEN || true
        stty echo 2>/dev/null || true
        printf '\n' >&2
    fi
    [ -n "$JOIN_TOKEN" ] || fatal "$1"
}

# The node id agent.yaml names.
config_node_id() {
    [ -f "$CONFIG" ] || return 0
    sed -n "s/^node_id:[[:space:]]*['\"]\{0,1\}\([^'\"[:space:]]*\).*/\1/p" "$CONFIG" | head -n 1
}

# The node id: the option, else what agent.yaml says.
node_id_now() {
    if [ -n "$NODE_ID" ]; then
        printf '%s\n' "$NODE_ID"
    else
        config_node_id
    fi
}

# 9. agent.yaml: what the join wrote (server(s), node_id, state_dir) or the operator's file,
# with the installer's own lines (the model and cache roots, the node's address or interface,
# the node facts) at the end.
ensure_config() {
    if [ -f "$STAGE/joined.yaml" ]; then
        write_config "$STAGE/joined.yaml"
    elif [ -f "$CONFIG" ] && config_is_valid "$CONFIG"; then
        write_config "$CONFIG"
    elif has_identity; then
        fatal "$CONFIG is missing or not valid but this node has an identity in $STATE_DIR; restore $CONFIG (llmgw agent --check --config $CONFIG says what is wrong), or uninstall --purge and join afresh"
    fi
}

config_is_valid() {
    [ -f "$1" ] && TMPDIR=$STAGE "$(agent_bin)" agent --check --config "$1" >/dev/null 2>&1
}

write_config() {
    base=$1
    # The node facts' keys are the installer's only in its block: the same key set by hand
    # elsewhere in the file would be there twice (the agent refuses that), and is not ours
    # to drop.
    # shellcheck disable=SC2013 # top-level keys: one word each
    for key in $(sed -n 's/^\([a-z_]*\):.*/\1/p' "$STAGE/facts.yaml"); do
        line=$(awk -v mark="$MANAGED_MARK" -v key="$key" '
            $0 == mark { exit }
            index($0, key ":") == 1 { print NR; exit }
        ' "$base")
        [ -z "$line" ] || fatal "$base sets '$key:' itself (line $line), and the node facts given to this installer set it too; put them into that section by hand and leave their options out, or remove the section from $base and run this again. Nothing was changed"
    done
    {
        # Drop the lines a previous install wrote, and the keys the options set: after the
        # mark, the fact keys with their indented lines too; the node's address or interface
        # wherever it is when one of them is given (they exclude each other).
        awk -v mark="$MANAGED_MARK" -v address="$MGMT_GIVEN" '
            $0 == mark { managed = 1; next }
            /^(models_root|cache_root):/ { next }
            (address != "" || managed) && /^(mgmt_addr|mgmt_interface):/ { next }
            managed && /^(fabrics|discovery|engines):/ { skipping = 1; next }
            skipping && /^([ \t]|- |-$)/ { next }
            { skipping = 0; print }
        ' "$base"
        echo "$MANAGED_MARK"
        echo "models_root: $MODELS"
        echo "cache_root: $CACHE"
        # Quoted: YAML would read 1:2:3:4:5:6:7:8 as a number, and 'on' as a boolean.
        [ -z "$NODE_ADDRESS" ] || echo "mgmt_addr: \"$NODE_ADDRESS\""
        [ -z "$MGMT_IFACE" ] || echo "mgmt_interface: \"$MGMT_IFACE\""
        cat "$STAGE/facts.yaml"
    } >"$STAGE/agent.yaml"
    # The managed lines come as one block at the end: re-runs find them in place.
    awk -v mark="$MANAGED_MARK" '
        $0 == mark { seen = 1; next }
        seen && /^(models_root|cache_root|mgmt_addr|mgmt_interface|fabrics|discovery|engines):/ { next }
        seen && /^([ \t]|- |-$)/ { next }
        seen { exit 1 }
    ' "$STAGE/agent.yaml" || fatal "could not compose $CONFIG"
    config_is_valid "$STAGE/agent.yaml" || {
        TMPDIR=$STAGE "$(agent_bin)" agent --check --config "$STAGE/agent.yaml" >&2 || true
        fatal "the configuration composed from $base is not valid (above); fix $base and run again"
    }
    written=written
    [ ! -f "$CONFIG" ] || written=updated
    put_file "$STAGE/agent.yaml" "$CONFIG" 0640 "root:$SERVICE_USER"
    if [ "$CHANGED" = yes ]; then
        info "config: $CONFIG ($written)"
        RESTART=yes
    fi
}

# The node facts and the model and cache roots: given, else remembered from the last install
# (its record), else (an install older than the record) the roots in agent.yaml's managed
# block, else the defaults. A given value that differs from the remembered one is said.
recorded() { # KEY: its values in the record, space-separated
    [ -f "$FACTS_RECORD" ] || return 0
    awk -v key="$1" '$1 == key { printf "%s%s", sep, $2; sep = " " } END { if (sep != "") print "" }' "$FACTS_RECORD"
}

managed_value() { # KEY: its value in agent.yaml's managed block
    [ -f "$CONFIG" ] || return 0
    awk -v mark="$MANAGED_MARK" -v key="$1" '
        $0 == mark { managed = 1; next }
        managed && index($0, key ": ") == 1 { print substr($0, length(key) + 3); exit }
    ' "$CONFIG" | unquote
}

# KEY: its value in agent.yaml, wherever the key is set at the top level (the agent refuses
# a key set twice), as the operator may have edited it: a comment and quotes removed. Only
# read, never run; each caller checks the value as it checks the option it stands for.
config_value() {
    [ -f "$CONFIG" ] && [ -r "$CONFIG" ] || return 0
    awk -v key="$1" 'index($0, key ":") == 1 { print substr($0, length(key) + 2) }' "$CONFIG" \
        | tail -n 1 | sed 's/[[:space:]]#.*$//' | unquote
}

# A YAML scalar as written: surrounding blanks and one pair of quotes removed.
unquote() {
    sed "s/^[[:space:]]*//; s/[[:space:]]*\$//; s/^\"\(.*\)\"\$/\1/; s/^'\(.*\)'\$/\1/"
}

# OPTION GIVEN NOW BEFORE: say what happens to one fact. NOW is the value it will have.
say_fact() {
    # Names of its own: sh has no local variables, and the callers use option, now, before.
    sf_option=$1 sf_given=$2 sf_now=$3 sf_before=$4
    if [ -n "$sf_given" ]; then
        if { [ -f "$FACTS_RECORD" ] || [ -n "$sf_before" ]; } && [ "$sf_now" != "$sf_before" ]; then
            info "facts: $sf_option ${sf_now:-none} (was ${sf_before:-none})"
        fi
    elif [ -n "$sf_now" ]; then
        info "facts: keeping $sf_option $sf_now from the last install"
    fi
}

resolve_facts() { # [BIN: finds a bare fabric name's adapters now, to say what changes]
    MODELS=$(resolve_root models_root --models-root "$MODELS_GIVEN" "$MODELS" "$MODELS_ROOT")
    CACHE=$(resolve_root cache_root --cache-root "$CACHE_GIVEN" "$CACHE" "$CACHE_ROOT")
    resolve_mgmt
    resolve_list FIREWALL_FROM "$FIREWALL_GIVEN" firewall_from --firewall-from
    resolve_list FABRIC_PEERS "$PEERS_GIVEN" fabric_peers --fabric-peers
    resolve_one NVIDIA_SMI nvidia_smi --nvidia-smi
    resolve_one IB_ROOT ib_root --ib-root
    [ -z "${1:-}" ] || resolve_fabrics "$1"
    resolve_list FABRICS "$FABRICS_GIVEN" fabric --fabric
    resolve_list ENGINES "$ENGINES_GIVEN" engine --engine
}

# The node's own address or interface (agent.yaml's mgmt_addr or mgmt_interface): given
# ('none' clears), else what the managed block holds. One set by hand above the block stays
# as it is, unless an option replaces it.
resolve_mgmt() {
    MGMT_GIVEN=$NODE_ADDRESS$MGMT_IFACE
    rm_addr=$(config_value mgmt_addr) rm_iface=$(config_value mgmt_interface)
    rm_was=none
    [ -z "$rm_addr" ] || rm_was="--node-address $rm_addr"
    [ -z "$rm_iface" ] || rm_was="--mgmt-interface $rm_iface"
    if [ -n "$MGMT_GIVEN" ]; then
        [ "$NODE_ADDRESS" != none ] || NODE_ADDRESS=""
        [ "$MGMT_IFACE" != none ] || MGMT_IFACE=""
        rm_now=none
        [ -z "$NODE_ADDRESS" ] || rm_now="--node-address $NODE_ADDRESS"
        [ -z "$MGMT_IFACE" ] || rm_now="--mgmt-interface $MGMT_IFACE"
        if [ "$rm_now" != "$rm_was" ]; then
            info "address: $rm_now (was $rm_was in $CONFIG)"
        fi
        return 0
    fi
    NODE_ADDRESS=$(managed_value mgmt_addr)
    MGMT_IFACE=$(managed_value mgmt_interface)
    if [ -n "$NODE_ADDRESS" ] && ! check_address "$NODE_ADDRESS"; then
        fatal "mgmt_addr '$NODE_ADDRESS' in $CONFIG is not an IP address; give --node-address again (or --node-address none); nothing was changed"
    fi
    if [ -n "$MGMT_IFACE" ] && ! check_iface "$MGMT_IFACE"; then
        fatal "mgmt_interface '$MGMT_IFACE' in $CONFIG is not a network interface name; give --mgmt-interface again (or --mgmt-interface none); nothing was changed"
    fi
    if [ "$rm_was" != none ]; then
        info "address: keeping $rm_was from $CONFIG"
    fi
}

# A bare fabric name (--fabric ib-b): this node's active InfiniBand adapters, found in sysfs
# now by BIN's 'llmgw agent render-facts' (the one parser of node facts) and listed; what
# was found is what agent.yaml and the record keep, never looked for again.
resolve_fabrics() { # BIN
    rf_bin=$1 rf_bare=""
    for value in $FABRICS; do
        case $value in *:* | none) ;; *) rf_bare="$rf_bare $value" ;; esac
    done
    [ -n "$rf_bare" ] || return 0
    set --
    for value in $FABRICS; do set -- "$@" --fabric "$value"; done
    [ -z "$IB_ROOT" ] || set -- "$@" --ib-root "$IB_ROOT"
    # Bounded: it reads the --ib-root tree as root (sysfs, unless an operator named another).
    if ! TMPDIR=$STAGE timeout 60 "$rf_bin" agent render-facts --resolved-fabrics "$@" >"$STAGE/fabrics" 2>"$STAGE/fabrics.err"; then
        why=$(sed -n 's/^Error: //p' "$STAGE/fabrics.err" | tr -d '\000-\010\013-\037\177')
        [ -n "$why" ] || why=$(tr -d '\000-\010\013-\037\177' <"$STAGE/fabrics.err")
        [ -n "$why" ] || why="the adapters in ${IB_ROOT:-/sys/class/infiniband} could not be read within 60 s"
        fatal "node facts: $why. Nothing was changed"
    fi
    rf_found=""
    while IFS= read -r value; do
        rf_found="$rf_found $(check_fact --fabric "$value")"
    done <"$STAGE/fabrics"
    FABRICS=${rf_found# }
    for value in $FABRICS; do
        case " $rf_bare " in
            *" ${value%%:*} "*)
                info "facts: --fabric ${value%%:*} takes the active InfiniBand adapters in ${IB_ROOT:-/sys/class/infiniband}: $(printf '%s\n' "${value#*:}" | sed 's/,/, /g') (kept as --fabric $value)"
                ;;
        esac
    done
}

# What a re-run keeps is checked again as if given (the record or agent.yaml may have been
# edited by hand): KEY VALUES, each through its option's check; a bad one stops the run
# before anything changes, saying where it came from. A given option replaces it unchecked.
check_remembered() {
    cr_option=--$(printf '%s' "$1" | tr _ -)
    case $1 in
        models_root | cache_root) cr_check=check_dir_option ;;
        nvidia_smi | ib_root) cr_check=check_fact_path ;;
        fabric | engine) cr_check=check_fact ;;
        firewall_from | fabric_peers) cr_check=check_source ;;
    esac
    cr_from="remembered from the last install ($FACTS_RECORD)"
    [ -f "$FACTS_RECORD" ] || cr_from="remembered from the last install ($CONFIG and $INSTALL_STATE/firewall, an older install)"
    [ -z "${CR_FILE:-}" ] || cr_from="set as $1 in $CR_FILE"
    for cr_value in $2; do
        ("$cr_check" "$cr_option" "$cr_value") >/dev/null 2>"$STAGE/remembered.err" \
            || fatal "$cr_option $cr_value, $cr_from, is not valid: $(sed 's/^error: //' "$STAGE/remembered.err"). Give $cr_option again (or $cr_option none, where it clears); nothing was changed"
    done
}

# A root (run in a subshell: its variables stay there): given, else agent.yaml's (the file
# is the truth: a root edited there by hand is kept, and said), else the last install's.
resolve_root() { # KEY OPTION GIVEN VALUE DEFAULT: the root to use (said on stderr)
    before=$(recorded "$1")
    [ -f "$FACTS_RECORD" ] || before=$(managed_value "$1")
    in_file=$(config_value "$1")
    in_file=${in_file%/}
    now=$4
    if [ -z "$3" ] && [ -n "$in_file" ]; then
        CR_FILE=$CONFIG
        check_remembered "$1" "$in_file"
        if [ -n "$before" ] && [ "$in_file" != "$before" ]; then
            info "facts: keeping $2 $in_file from $CONFIG (edited there; the last install had $before)"
            printf '%s\n' "$in_file"
            return 0
        fi
        before=$in_file
    fi
    [ -n "$3" ] || check_remembered "$1" "$before"
    [ -n "$3" ] || now=${before:-$5}
    [ -z "$3" ] || [ -z "$in_file" ] || before=$in_file
    shown=$now
    # The default, not given, is nothing to keep.
    [ -n "$3" ] || [ "$now" != "$5" ] || shown=""
    say_fact "$2" "$3" "$shown" "$before"
    printf '%s\n' "$now"
}

resolve_list() { # VARIABLE GIVEN KEY OPTION
    before=$(recorded "$3")
    # An install older than the record: the sources its firewall record opened :9443 from.
    if [ ! -f "$FACTS_RECORD" ] && [ "$3" = firewall_from ]; then
        before=$(firewall_records | awk -v port="$AGENT_PORT" '$3 == port { printf "%s%s", sep, $2; sep = " " }')
    fi
    eval "now=\$$1"
    # shellcheck disable=SC2154 # now is set by the eval
    now=$(printf '%s\n' "$now" | sed 's/^ *//; s/ *$//')
    [ "$now" != none ] || now=""
    [ -n "$2" ] || check_remembered "$3" "$before"
    [ -n "$2" ] || now=$before
    eval "$1=\$now"
    say_fact "$4" "$2" "$now" "$before"
}

resolve_one() { # VARIABLE KEY OPTION
    before=$(recorded "$2")
    eval "now=\$$1"
    given=$now
    [ -n "$given" ] || check_remembered "$2" "$before"
    [ -n "$given" ] || now=$before
    [ "$now" != none ] || now=""
    eval "$1=\$now"
    say_fact "$3" "$given" "$now" "$before"
}

# The agent.yaml keys of the facts (into STAGE/facts.yaml), by BIN's 'llmgw agent
# render-facts', the one parser of node facts: a fact it refuses stops the run here, before
# anything is changed.
check_facts() { # BIN [WHAT_CHANGED: said after the reason; default: nothing]
    bin=$1
    changed=${2:-Nothing was changed}
    resolve_fabrics "$bin"
    set --
    for value in $FABRICS; do set -- "$@" --fabric "$value"; done
    for value in $ENGINES; do set -- "$@" --engine "$value"; done
    [ -z "$NVIDIA_SMI" ] || set -- "$@" --nvidia-smi "$NVIDIA_SMI"
    [ -z "$IB_ROOT" ] || set -- "$@" --ib-root "$IB_ROOT"
    if ! TMPDIR=$STAGE "$bin" agent render-facts "$@" >"$STAGE/facts.yaml" 2>"$STAGE/facts.err"; then
        why=$(sed -n 's/^Error: //p' "$STAGE/facts.err" | tr -d '\000-\010\013-\037\177')
        fatal "node facts: ${why:-$(tr -d '\000-\010\013-\037\177' <"$STAGE/facts.err")}. $changed"
    fi
}

# What install was given (or kept), for the next run.
record_facts() {
    {
        echo "models_root $MODELS"
        echo "cache_root $CACHE"
        for value in $FIREWALL_FROM; do echo "firewall_from $value"; done
        for value in $FABRIC_PEERS; do echo "fabric_peers $value"; done
        for value in $FABRICS; do echo "fabric $value"; done
        for value in $ENGINES; do echo "engine $value"; done
        [ -z "$NVIDIA_SMI" ] || echo "nvidia_smi $NVIDIA_SMI"
        [ -z "$IB_ROOT" ] || echo "ib_root $IB_ROOT"
    } >"$STAGE/facts.record"
    make_dir "$INSTALL_STATE"
    put_file "$STAGE/facts.record" "$FACTS_RECORD" 0644 root:root
}

# Pre-flight, before anything changes: warnings (naming the package) for what the node is
# set to run and lacks; the agent reports it degraded with the same reasons once it runs.
# The agent runs process engines in a bubblewrap sandbox (README "Engine sandbox"): bwrap
# must be installed, and the host must allow unprivileged user namespaces. A node set to run
# only Docker engines needs neither. Each setting that turns them off is named with its fix,
# in the agent's words (llmgw/agent/bwrap.py, userns_problem), then a trial run says whether
# bwrap works for an unprivileged user at all (a seccomp profile, a container).
check_sandbox() {
    if [ -f "$CONFIG" ] && grep -Eq '^runtime:[[:space:]]*["'"'"']?docker' "$CONFIG"; then
        return 0
    fi
    bwrap=$(command -v bwrap 2>/dev/null || true)
    [ -n "$bwrap" ] \
        || fatal "bubblewrap (bwrap) is not installed, and the agent runs process engines in its sandbox: apt-get install -y bubblewrap (or dnf install -y bubblewrap), then run this again. Nothing was changed"
    off=""
    setting=$(cat "$PROC_SYS/kernel/unprivileged_userns_clone" 2>/dev/null || true)
    [ "$setting" != 0 ] \
        || off="$off; kernel.unprivileged_userns_clone=0: sysctl -w kernel.unprivileged_userns_clone=1 and keep it in /etc/sysctl.d/90-llmgw-userns.conf"
    setting=$(cat "$PROC_SYS/kernel/apparmor_restrict_unprivileged_userns" 2>/dev/null || true)
    [ "$setting" != 1 ] \
        || off="$off; kernel.apparmor_restrict_unprivileged_userns=1: allow bwrap alone an unprivileged user namespace with an AppArmor profile: printf 'abi <abi/4.0>,\ninclude <tunables/global>\nprofile bwrap /usr/bin/bwrap flags=(unconfined) {\n  userns,\n}\n' >/etc/apparmor.d/bwrap && apparmor_parser -r /etc/apparmor.d/bwrap"
    setting=$(cat "$PROC_SYS/user/max_user_namespaces" 2>/dev/null || true)
    [ "$setting" != 0 ] \
        || off="$off; user.max_user_namespaces=0: sysctl -w user.max_user_namespaces=15000 and keep it in /etc/sysctl.d/90-llmgw-userns.conf"
    if [ -n "$off" ]; then
        warn "engines run in a bubblewrap sandbox, which needs unprivileged user namespaces, and this host turns them off: ${off#; }; or set sandbox: false in the profile to run its engine unconfined. Until then the agent refuses to start process engines here"
        return 0
    fi
    # As nobody, as the agent will be (not root: root needs no user namespace).
    if ! setpriv --reuid=65534 --regid=65534 --clear-groups -- "$bwrap" --unshare-user --unshare-pid \
        --ro-bind / / --dev /dev --ro-bind /proc /proc --chdir / /bin/true >"$STAGE/bwrap.log" 2>&1; then
        warn "engines run in a bubblewrap sandbox, which needs unprivileged user namespaces, and bwrap could not make one (bwrap: $(tail -n 1 "$STAGE/bwrap.log")); a seccomp or AppArmor policy of this host (or of the container it runs in) must allow them. Until then the agent refuses to start process engines here"
    fi
}

preflight() {
    check_sandbox
    gpus=0
    for device in "$PCI_DEVICES"/*; do
        [ -f "$device/vendor" ] || continue
        [ "$(cat "$device/vendor" 2>/dev/null)" = 0x10de ] || continue
        case $(cat "$device/class" 2>/dev/null) in
            0x03*) gpus=$((gpus + 1)) ;;
        esac
    done
    smi=$NVIDIA_SMI
    [ -n "$smi" ] || smi=$(command -v nvidia-smi 2>/dev/null || true)
    if [ "$gpus" -gt 0 ] || [ -n "$NVIDIA_SMI" ]; then
        if [ -z "$smi" ] || [ ! -x "$smi" ]; then
            what="this node has $gpus NVIDIA GPU(s) on its PCI bus"
            [ -z "$NVIDIA_SMI" ] || what="--nvidia-smi is $NVIDIA_SMI"
            warn "$what but $([ -n "$NVIDIA_SMI" ] && echo "it is not an executable" || echo "no nvidia-smi on PATH"): install NVIDIA's driver (Debian: apt-get install nvidia-driver; Ubuntu: ubuntu-drivers install; or your vendor's), or give --nvidia-smi PATH. Until then the agent reports this node degraded (no GPU driver) and it takes no GPU replicas"
        fi
    fi
    wants_docker=$DOCKER
    if [ -z "$wants_docker" ] && [ -f "$CONFIG" ] && grep -Eq '^runtime:[[:space:]]*["'"'"']?docker' "$CONFIG"; then
        wants_docker="runtime: docker"
    fi
    [ -n "$wants_docker" ] || return 0
    case $wants_docker in
        proxy) why=--docker ;;
        group) why=--docker-group ;;
        *) why="runtime: docker in $CONFIG" ;;
    esac
    if ! command -v dockerd >/dev/null 2>&1 && ! command -v docker >/dev/null 2>&1; then
        warn "engines are to run in Docker ($why) but Docker is not installed: apt-get install docker.io (or dnf install moby-engine, or Docker CE). Until then the agent reports this node degraded and no Docker engine is placed here"
    fi
    if [ "$gpus" -gt 0 ] && ! command -v nvidia-ctk >/dev/null 2>&1 \
        && ! command -v nvidia-container-cli >/dev/null 2>&1 \
        && ! command -v nvidia-container-runtime >/dev/null 2>&1; then
        warn "engines are to run in Docker on this node's $gpus NVIDIA GPU(s), but the NVIDIA Container Toolkit is not installed: install nvidia-container-toolkit (from NVIDIA's repository) and run 'nvidia-ctk runtime configure --runtime=docker', or containers will not see the GPUs"
    fi
}

# /usr/local/bin/llmgw: the installed binary on root's PATH (llmgw agent join, llmgw ctl, the
# rekey one-liner's commands). Only our own link is made or replaced: a file an operator put
# there is left as it is, and said.
link_command() {
    target=$LIB_DIR/llmgw
    if [ -L "$COMMAND_LINK" ] && [ "$(readlink "$COMMAND_LINK")" = "$target" ]; then
        return 0
    fi
    if [ -e "$COMMAND_LINK" ] || [ -L "$COMMAND_LINK" ]; then
        warn "$COMMAND_LINK exists and is not this installer's link to $target; it is left as it is (run $target directly, or remove $COMMAND_LINK and install again)"
        return 0
    fi
    make_dir "$(dirname "$COMMAND_LINK")"
    note_created "$COMMAND_LINK"
    ln -s "$target" "$COMMAND_LINK"
    info "binary: $COMMAND_LINK -> $target"
}

unlink_command() {
    if [ -L "$COMMAND_LINK" ] && [ "$(readlink "$COMMAND_LINK")" = "$LIB_DIR/llmgw" ]; then
        rm -f "$COMMAND_LINK"
    fi
}

# 10. what the root update helper trusts: the cluster CA this node pinned at its join, and
# the node id an order must name. Root's, readable by all; the agent cannot change them. The
# agent's ca.crt is read by the agent user into the stage (a symlink it planted reaches only
# what it may read itself), then 'llmgw agent update-trust' writes ca.pem only when that CA
# hashes to the pin: --ca-hash when given, else the pin recorded at the first install. No
# pin, or no match: the trust stays as it was. (A new CA, when the cluster's rotates, comes
# the same way: a root-run install or rekey with the new --ca-hash.)
install_update_trust() {
    put_dir "$UPDATE_TRUST_DIR" 0755 root:root force
    agent_read "$STATE_DIR/ca.crt" "$STAGE/agent-ca.crt"
    if [ -s "$STAGE/agent-ca.crt" ]; then
        if "$(agent_bin)" agent update-trust --ca "$STAGE/agent-ca.crt" --trust "$UPDATE_TRUST_DIR" \
            ${CA_HASH:+--ca-hash "$CA_HASH"} >"$STAGE/trust.out" 2>&1; then
            if grep -q '^trust: written' "$STAGE/trust.out"; then
                info "update helper: trusts the cluster CA in $UPDATE_TRUST_DIR/ca.pem"
            fi
        else
            warn "update helper: trust not changed: $(sed 's/^error: //' "$STAGE/trust.out" | tr -d '\000-\010\013-\037\177')"
        fi
    elif has_identity; then
        warn "update helper: trust not changed: $SERVICE_USER cannot read $STATE_DIR/ca.crt (missing, or a link to what it may not read); run the install again with --ca-hash from 'llmgw ctl join-command' once it is back"
    fi
    id=$(node_id_now)
    if [ -n "$id" ]; then
        printf '%s\n' "$id" >"$STAGE/node-id"
        put_file "$STAGE/node-id" "$UPDATE_TRUST_DIR/node-id" 0644 root:root
    fi
}

# 11. the firewall: port AGENT_PORT (the gateway's way in) and the multi-node range
# (agent.yaml's multinode_ports: rank 0's rendezvous port of a multi-node replica and its
# workers' endpoints, which the replica's other nodes dial) from the given sources only:
# --firewall-from gets both, --fabric-peers the range. What was added is recorded, one
# 'BACKEND SOURCE PORTS' a line (PORTS 9443 or A-B; a record of an older install has no
# PORTS, meaning AGENT_PORT), and removed exactly on uninstall (or when install is run with
# other sources).
firewall_backend() {
    if command -v ufw >/dev/null 2>&1 && ufw status 2>/dev/null | grep -q '^Status: active'; then
        echo ufw
    elif command -v firewall-cmd >/dev/null 2>&1 && [ "$(firewall-cmd --state 2>/dev/null)" = running ]; then
        echo firewalld
    elif command -v nft >/dev/null 2>&1; then
        echo nft
    fi
}

family_of() {
    case $1 in
        *:*) echo ipv6 ;;
        *) echo ipv4 ;;
    esac
}

# The multi-node range the agent uses: its configuration's, asked of the agent itself.
multinode_ports() {
    if [ -f "$CONFIG" ] && ports=$(TMPDIR=$STAGE "$(agent_bin)" agent --check --config "$CONFIG" --print multinode_ports 2>/dev/null) \
        && printf '%s\n' "$ports" | grep -Eq '^[0-9]+-[0-9]+$'; then
        printf '%s\n' "$ports"
    else
        printf '%s\n' "$DEFAULT_MULTINODE_PORTS"
    fi
}

# PORTS (9443 or A-B) as ufw spells it, and in words.
ufw_ports() { printf '%s\n' "$1" | tr - :; }
ports_said() {
    case $1 in
        *-*) echo "$1/tcp (multi-node replicas)" ;;
        *) echo ":$1/tcp" ;;
    esac
}

firewall_add() { # BACKEND SOURCE PORTS
    case $1 in
        ufw) ufw allow proto tcp from "$2" to any port "$(ufw_ports "$3")" comment "llmgw-agent" >/dev/null ;;
        firewalld)
            rule="rule family=$(family_of "$2") source address=$2 port port=$3 protocol=tcp accept"
            firewall-cmd --quiet --permanent --add-rich-rule="$rule"
            firewall-cmd --quiet --add-rich-rule="$rule"
            ;;
        nft)
            nft add table inet "$NFT_TABLE"
            nft add chain inet "$NFT_TABLE" input '{ type filter hook input priority 0; policy accept; }'
            nft insert rule inet "$NFT_TABLE" input "$(nft_family "$2")" saddr "$2" tcp dport "$3" accept
            if ! nft list chain inet "$NFT_TABLE" input | grep -q "tcp dport $3 drop"; then
                nft add rule inet "$NFT_TABLE" input tcp dport "$3" drop
            fi
            ;;
    esac
}

nft_family() {
    case $1 in
        *:*) echo ip6 ;;
        *) echo ip ;;
    esac
}

firewall_remove() { # BACKEND SOURCE PORTS
    case $1 in
        ufw) ufw delete allow proto tcp from "$2" to any port "$(ufw_ports "$3")" >/dev/null 2>&1 || true ;;
        firewalld)
            rule="rule family=$(family_of "$2") source address=$2 port port=$3 protocol=tcp accept"
            firewall-cmd --quiet --permanent --remove-rich-rule="$rule" 2>/dev/null || true
            firewall-cmd --quiet --remove-rich-rule="$rule" 2>/dev/null || true
            ;;
        nft)
            # The table is ours alone: it goes with its last source.
            nft delete table inet "$NFT_TABLE" 2>/dev/null || true
            ;;
    esac
}

firewall_present() { # BACKEND SOURCE PORTS
    case $1 in
        ufw) ufw status 2>/dev/null | grep -q "^$(ufw_ports "$3")/tcp .* ALLOW .* $2\( \|\$\)" ;;
        firewalld) firewall-cmd --list-rich-rules 2>/dev/null | grep -q "source address=\"$2\" port port=\"$3\"" ;;
        nft) nft list table inet "$NFT_TABLE" 2>/dev/null | grep -q "saddr $2 tcp dport $3 accept" ;;
        *) return 1 ;;
    esac
}

# The record's lines as 'BACKEND SOURCE PORTS' (an older record's two fields: AGENT_PORT).
firewall_records() {
    [ -f "$INSTALL_STATE/firewall" ] || return 0
    awk -v port="$AGENT_PORT" 'NF >= 2 { print $1, $2, (NF >= 3 ? $3 : port) }' "$INSTALL_STATE/firewall"
}

firewall_clear() {
    [ -f "$INSTALL_STATE/firewall" ] || return 0
    firewall_records >"$STAGE/firewall.old"
    while read -r rec_backend rec_source rec_ports; do
        info "firewall: removing $rec_backend rule for $(ports_said "$rec_ports") from $rec_source"
        firewall_remove "$rec_backend" "$rec_source" "$rec_ports"
    done <"$STAGE/firewall.old"
    rm -f "$INSTALL_STATE/firewall"
}

configure_firewall() {
    range=$(multinode_ports)
    # shellcheck disable=SC2086 # lists of checked addresses, split on purpose
    {
        for source in $FIREWALL_FROM; do
            echo "$source $AGENT_PORT"
            echo "$source $range"
        done
        for source in $FABRIC_PEERS; do echo "$source $range"; done
    } | sort -u >"$STAGE/firewall.wanted"
    wanted=$(cat "$STAGE/firewall.wanted")
    recorded=$(firewall_records | cut -d' ' -f2,3 | sort -u)
    if [ -z "$wanted" ]; then
        firewall_clear
        case $(firewall_backend) in
            ufw | firewalld)
                # Not an error: the host's rules may already let the gateway in. But an agent
                # that looks healthy here and is unreachable from the gateway is the worst case.
                warn "$(firewall_backend) is active and no --firewall-from was given: unless its rules already allow :$AGENT_PORT/tcp from the gateway (and $range/tcp between the nodes of a fabric, for multi-node replicas), the control plane cannot reach this agent; run again with --firewall-from GATEWAY_IP (and --fabric-peers CIDR)"
                ;;
        esac
        return 0
    fi
    backend=$(firewall_backend)
    [ -n "$backend" ] || fatal "--firewall-from and --fabric-peers need ufw (active), firewalld (running) or nft; install nftables, or leave them out"
    if [ "$wanted" = "$recorded" ] && [ "$(firewall_records | cut -d' ' -f1 | sort -u)" = "$backend" ]; then
        missing=""
        while read -r source ports; do
            firewall_present "$backend" "$source" "$ports" || missing=1
        done <"$STAGE/firewall.wanted"
        [ -n "$missing" ] || return 0
    fi
    firewall_clear
    make_dir "$INSTALL_STATE"
    # Rules of this run's own; a re-run's replace rules an earlier install made, kept.
    [ -n "$recorded" ] || note_undo firewall rules
    : >"$INSTALL_STATE/firewall.new"
    while read -r source ports; do
        info "firewall ($backend): $(ports_said "$ports") from $source"
        firewall_add "$backend" "$source" "$ports" || fatal "adding the $backend rule for $source ($ports) failed"
        printf '%s %s %s\n' "$backend" "$source" "$ports" >>"$INSTALL_STATE/firewall.new"
    done <"$STAGE/firewall.wanted"
    mv "$INSTALL_STATE/firewall.new" "$INSTALL_STATE/firewall"
    [ "$backend" != nft ] \
        || warn "nft rules (table inet $NFT_TABLE) do not survive a reboot; run this install again after one, or add them to /etc/nftables.conf"
}

# 12. enable the units; (re)start only when something changed (RESTART) or the agent is not
# running.
start_agent() {
    enabled=""
    if [ "$(systemctl is-enabled "$UNIT" 2>/dev/null)" != enabled ]; then
        systemctl enable "$UNIT" >/dev/null 2>&1 || fatal "systemctl enable $UNIT failed"
        enabled=" (enabled: it starts at boot)"
    fi
    if [ "$(mode_recorded)" != package ] || [ -f "$UNIT_DIR/llmgw-agent-update.path" ]; then
        if [ "$(systemctl is-enabled llmgw-agent-update.path 2>/dev/null)" != enabled ] \
            || [ "$(systemctl is-active llmgw-agent-update.path 2>/dev/null)" != active ]; then
            systemctl enable --now llmgw-agent-update.path >/dev/null 2>&1 \
                || fatal "systemctl enable --now llmgw-agent-update.path failed; see: journalctl -u llmgw-agent-update.path"
        fi
    fi
    if ! has_identity; then
        info "not started: this node has no identity yet. Run this again with --node-id, --enroll-url and --ca-hash (the token in LLMGW_JOIN_TOKEN)"
        return 0
    fi
    if [ "$(systemctl is-active "$UNIT" 2>/dev/null)" = active ]; then
        if [ "$RESTART" = no ]; then
            info "service: $UNIT runs and nothing changed; not restarted"
            return 0
        fi
        info "service: restarting $UNIT (what it runs with changed, above)"
    else
        info "service: starting $UNIT$enabled"
    fi
    systemctl reset-failed "$UNIT" >/dev/null 2>&1 || true
    restart_agent
    if ! wait_listening "$HEALTH_TIMEOUT"; then
        journal_tail
        fatal "$UNIT did not come up listening on :$AGENT_PORT within $HEALTH_TIMEOUT s (its journal above); fix what it says, then: systemctl restart $UNIT"
    fi
    info "service: $UNIT is active and listens on :$AGENT_PORT"
}

# How llmgw came here (tarball or package), for the verbs that come after.
record_mode() {
    make_dir "$INSTALL_STATE"
    chmod 0755 "$INSTALL_STATE"
    printf '%s\n' "$1" >"$STAGE/mode"
    put_file "$STAGE/mode" "$INSTALL_STATE/mode" 0644 root:root
}

# ------------------------------------------------------------------------------ package

# 4 for 'package': llmgw-agent from the signed repository, with apt-get or dnf/yum (RESTART=yes
# when that changed its version).
install_package() {
    fetch_repo_key
    if command -v apt-get >/dev/null 2>&1; then
        add_apt_repo
    elif command -v dnf >/dev/null 2>&1 || command -v yum >/dev/null 2>&1; then
        add_yum_repo
    else
        fatal "neither apt-get nor dnf/yum here; install from the bundle instead: install-agent.sh install"
    fi
    [ -x "$PACKAGE_BIN" ] || fatal "the package did not install $PACKAGE_BIN"
}

fetch_repo_key() {
    case $REPO_KEY in
        http://* | https://*)
            command -v curl >/dev/null 2>&1 || fatal "no curl to fetch $REPO_KEY; apt-get install -y curl, or pass --repo-key FILE"
            curl -fsSL -o "$STAGE/repo.key" "$REPO_KEY" || fatal "could not download the repository key from $REPO_KEY"
            ;;
        *)
            [ -f "$REPO_KEY" ] || fatal "--repo-key $REPO_KEY: no such file"
            cp "$REPO_KEY" "$STAGE/repo.key"
            ;;
    esac
    if grep -q -- '-----BEGIN PGP PUBLIC KEY BLOCK-----' "$STAGE/repo.key"; then
        KEY_EXT=asc
    else
        KEY_EXT=gpg
    fi
}

add_apt_repo() {
    keyring=/usr/share/keyrings/llmgw.$KEY_EXT
    put_file "$STAGE/repo.key" "$keyring" 0644 root:root
    if [ "$CHANGED" = yes ]; then
        info "package: repository key $keyring"
    fi
    printf 'deb [signed-by=%s] %s/apt stable main\n' "$keyring" "$REPO_URL" >"$STAGE/llmgw.list"
    put_file "$STAGE/llmgw.list" /etc/apt/sources.list.d/llmgw.list 0644 root:root
    if [ "$CHANGED" = yes ]; then
        info "package: /etc/apt/sources.list.d/llmgw.list ($REPO_URL/apt)"
    fi
    before=$(dpkg-query -W -f '${Version}' llmgw-agent 2>/dev/null || true)
    info "package: apt-get update && apt-get install llmgw-agent"
    apt-get update -q -o Dir::Etc::sourcelist=/etc/apt/sources.list.d/llmgw.list \
        -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 >"$STAGE/apt.log" 2>&1 \
        || { cat "$STAGE/apt.log" >&2; fatal "apt-get update of $REPO_URL/apt failed (above): check the URL and the key"; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o Dpkg::Options::=--force-confold \
        llmgw-agent >"$STAGE/apt.log" 2>&1 \
        || { cat "$STAGE/apt.log" >&2; fatal "apt-get install llmgw-agent failed (above)"; }
    after=$(dpkg-query -W -f '${Version}' llmgw-agent 2>/dev/null || true)
    [ "$before" = "$after" ] || RESTART=yes
}

add_yum_repo() {
    key=/etc/pki/rpm-gpg/RPM-GPG-KEY-llmgw
    put_file "$STAGE/repo.key" "$key" 0644 root:root
    {
        echo "[llmgw]"
        echo "name=llmgw"
        echo "baseurl=$REPO_URL/yum"
        echo "enabled=1"
        echo "gpgcheck=1"
        echo "repo_gpgcheck=1"
        echo "gpgkey=file://$key"
    } >"$STAGE/llmgw.repo"
    put_file "$STAGE/llmgw.repo" /etc/yum.repos.d/llmgw.repo 0644 root:root
    pm=dnf
    command -v dnf >/dev/null 2>&1 || pm=yum
    before=$(rpm -q --qf '%{VERSION}' llmgw-agent 2>/dev/null || true)
    info "package: $pm install llmgw-agent"
    "$pm" install -y -q llmgw-agent >&2 || fatal "$pm install llmgw-agent failed (above)"
    after=$(rpm -q --qf '%{VERSION}' llmgw-agent 2>/dev/null || true)
    [ "$before" = "$after" ] || RESTART=yes
}

# ------------------------------------------------------------------------------ upgrade, rollback

check_installed() {
    [ "$(mode_recorded)" != package ] \
        || fatal "llmgw-agent came from a package here: upgrade it with apt-get install --only-upgrade llmgw-agent (or dnf upgrade llmgw-agent)"
    [ -f "$LIB_DIR/llmgw" ] || fatal "llmgw-agent is not installed here ($LIB_DIR/llmgw is missing); run: install-agent.sh install"
}

# After restart_and_wait: 0 when the agent stays up for SETTLE seconds, the same invocation
# (an agent that crashes and is brought back by Restart= gets a new InvocationID), active
# and listening at the end; 1 as soon as it is not.
settled() {
    has_identity || return 0
    [ "$SETTLE" -gt 0 ] || return 0
    invocation=$(systemctl show -p InvocationID --value "$UNIT" 2>/dev/null || true)
    info "upgrade: watching llmgw $NEW_VERSION for $SETTLE s"
    watched=0
    while [ "$watched" -lt "$SETTLE" ]; do
        sleep 1
        watched=$((watched + 1))
        if [ "$(systemctl is-active "$UNIT" 2>/dev/null)" != active ] \
            || [ "$(systemctl show -p InvocationID --value "$UNIT" 2>/dev/null || true)" != "$invocation" ]; then
            warn "llmgw $NEW_VERSION stopped $watched s after it came up"
            return 1
        fi
    done
    is_listening
}

# Restart and wait; 0 when the agent listens (or has no identity to start with).
restart_and_wait() {
    # The proxy runs the same binary: it restarts too, when it runs.
    systemctl try-restart "$PROXY_UNIT" >/dev/null 2>&1 || true
    has_identity || return 0
    systemctl reset-failed "$UNIT" >/dev/null 2>&1 || true
    restart_agent
    wait_listening "$1"
}

restore_previous() {
    for name in $UNIT $UPDATE_UNITS; do
        if [ -f "$PREVIOUS_DIR/$name" ]; then
            cp -p "$PREVIOUS_DIR/$name" "$UNIT_DIR/.$name.new.$$"
            mv -f "$UNIT_DIR/.$name.new.$$" "$UNIT_DIR/$name"
        fi
    done
    cp -p "$PREVIOUS_DIR/llmgw" "$LIB_DIR/.llmgw.new.$$"
    mv -f "$LIB_DIR/.llmgw.new.$$" "$LIB_DIR/llmgw"
    systemctl daemon-reload
}

# ------------------------------------------------------------------------------ uninstall

stop_everything() {
    for name in llmgw-agent-update.path llmgw-agent-update.service $UNIT $PROXY_UNIT; do
        systemctl disable --now "$name" >/dev/null 2>&1 || true
    done
    # Engines outlive the agent (KillMode=process) and stay in its cgroup: with the agent
    # gone they serve nobody.
    systemctl kill --signal=SIGTERM "$UNIT" >/dev/null 2>&1 || true
    systemctl kill --signal=SIGKILL "$UNIT" >/dev/null 2>&1 || true
}

# Docker engines (runtime: docker) are dockerd's containers, not processes of the agent's unit:
# uninstall leaves them running, as it leaves the models, and names them. An agent on the kept
# identity adopts them again (engines outlive the agent); after --purge none will.
report_docker_engines() {
    command -v docker >/dev/null 2>&1 || return 0
    engines=$(docker ps --filter label=llmgw.shard --format '{{.Names}}' 2>/dev/null | tr '\n' ' ')
    engines=${engines% }
    [ -n "$engines" ] || return 0
    # shellcheck disable=SC2016 # a command for the operator to run, printed as it is
    remove='docker rm -f $(docker ps -aq --filter label=llmgw.shard)'
    if [ -n "$PURGE" ]; then
        warn "uninstall: these Docker engine containers keep running, and without this node's identity no agent adopts them: $engines; remove them: $remove"
    else
        info "uninstall: these Docker engine containers keep running (they are dockerd's, not the agent's): $engines; an install on this node's identity adopts them, or remove them: $remove"
    fi
}

# llmgw-agent removed (purged with --purge) by the package manager it came with.
remove_package() {
    if command -v apt-get >/dev/null 2>&1; then
        action=remove
        [ -z "$PURGE" ] || action=purge
        info "uninstall: apt-get $action llmgw-agent"
        DEBIAN_FRONTEND=noninteractive apt-get "$action" -y -q llmgw-agent >&2 \
            || fatal "apt-get could not remove llmgw-agent (above)"
        if [ -n "$PURGE" ]; then
            rm -f /etc/apt/sources.list.d/llmgw.list /usr/share/keyrings/llmgw.asc /usr/share/keyrings/llmgw.gpg
        fi
    else
        pm=dnf
        command -v dnf >/dev/null 2>&1 || pm=yum
        "$pm" remove -y -q llmgw-agent >&2 || fatal "$pm could not remove llmgw-agent (above)"
        if [ -n "$PURGE" ]; then
            rm -f /etc/yum.repos.d/llmgw.repo /etc/pki/rpm-gpg/RPM-GPG-KEY-llmgw
        fi
    fi
}

purge_everything() {
    info "purge: configuration, identity, drop-ins, update trust and state, user"
    rm -rf "$DROPIN_DIR" "$STATE_DIR" "$TMP_DIR" "$UPDATE_TRUST_DIR" "$UPDATE_STATE" "$CONFIG"
    rmdir /etc/llmgw 2>/dev/null || true
    remove_user || fatal "could not delete the user $SERVICE_USER (userdel above)"
    rm -f "$LINGER_DIR/$SERVICE_USER"
    if getent group "$SERVICE_USER" >/dev/null 2>&1; then
        groupdel "$SERVICE_USER" >/dev/null 2>&1 || true
    fi
}

# ------------------------------------------------------------------------------ status

# What is installed and running here, one line a thing.
print_status() {
    mode=$(mode_recorded)
    bin=$(agent_bin)
    if [ "$mode" = package ]; then
        echo "installed:  llmgw $(version_of "$PACKAGE_BIN" || true) (package, $PACKAGE_BIN)"
    elif [ -f "$LIB_DIR/llmgw" ]; then
        echo "installed:  llmgw $(version_of "$bin") ($bin)"
    else
        echo "installed:  no"
    fi
    if [ -L "$COMMAND_LINK" ] && [ "$(readlink "$COMMAND_LINK")" = "$LIB_DIR/llmgw" ]; then
        echo "command:    $COMMAND_LINK -> $LIB_DIR/llmgw"
    fi
    if [ -f "$PREVIOUS_DIR/llmgw" ]; then
        echo "previous:   llmgw $(version_of "$PREVIOUS_DIR/llmgw") ($PREVIOUS_DIR, for rollback)"
    else
        echo "previous:   none"
    fi
    if command -v systemctl >/dev/null 2>&1 && [ -d /run/systemd/system ]; then
        enabled=$(systemctl is-enabled "$UNIT" 2>/dev/null || true)
        active=$(systemctl is-active "$UNIT" 2>/dev/null || true)
        since=$(systemctl show -p ActiveEnterTimestamp --value "$UNIT" 2>/dev/null || true)
        echo "unit:       $UNIT ${enabled:-not-found}, ${active:-unknown}${since:+ since $since}"
        echo "updates:    llmgw-agent-update.path $(systemctl is-active llmgw-agent-update.path 2>/dev/null || true)"
    fi
    if is_listening; then
        echo "listening:  yes, :$AGENT_PORT"
    else
        echo "listening:  no (:$AGENT_PORT)"
    fi
    if has_identity; then
        echo "identity:   node $(node_id_now) ($STATE_DIR/node.crt)"
    else
        echo "identity:   none (not joined)"
    fi
    if [ -r "$CONFIG" ]; then
        if [ -n "$(config_value mgmt_addr)" ]; then
            echo "address:    $(config_value mgmt_addr) (mgmt_addr in $CONFIG)"
        elif [ -n "$(config_value mgmt_interface)" ]; then
            echo "address:    that of $(config_value mgmt_interface) (mgmt_interface in $CONFIG)"
        else
            echo "address:    the route's towards the control plane (no mgmt_addr or mgmt_interface in $CONFIG)"
        fi
    fi
    echo "docker:     $(docker_access)"
    if [ -f "$FACTS_RECORD" ]; then
        while read -r key value; do
            printf '%-11s %s\n' "$(echo "$key" | tr _ -):" "$value"
        done <"$FACTS_RECORD"
    fi
    if [ -s "$INSTALL_STATE/firewall" ]; then
        firewall_records >"$STAGE/firewall.status"
        while read -r backend source ports; do
            echo "firewall:   $backend allows $(ports_said "$ports") from $source"
        done <"$STAGE/firewall.status"
    else
        echo "firewall:   no rules added"
    fi
}

# ============================================================================== run order
# Each verb's steps in the order they run; the functions above do the work. install: steps 1
# to 12; package: its own step 4 first, then 1 to 3 and 5 to 12. RESTART and DOCKER_CHANGED
# (yes/no) carry what the steps changed to the ones that reload and (re)start.

verb_install() {
    check_root
    check_systemd
    make_stage
    bundle_dir
    [ "$(mode_recorded)" != package ] \
        || fatal "llmgw-agent was installed from a package here; use 'package' (or uninstall first)"
    info "install: llmgw $NEW_VERSION from $BUNDLE"
    resolve_facts "$BUNDLE/llmgw"
    check_facts "$BUNDLE/llmgw"
    preflight
    arm_undo
    ensure_user    # 1
    ensure_linger  # 2
    ensure_dirs    # 3
    install_binary # 4
    link_command
    record_mode tarball
    configure_and_start
    UNDO=""
    info "done: llmgw $NEW_VERSION installed ($LIB_DIR/llmgw)"
}

# Steps 5 to 12, shared by install and package once the binary is in place.
configure_and_start() {
    install_units    # 5
    install_dropin   # 6
    configure_docker # 7
    if [ "$RESTART" = yes ]; then
        systemctl daemon-reload
    fi
    start_docker_proxy
    ensure_joined        # 8
    ensure_config        # 9
    record_facts
    install_update_trust # 10
    configure_firewall   # 11
    start_agent          # 12
}

verb_package() {
    check_root
    check_systemd
    make_stage
    # The units of the update helper and the example come from the bundle when this script is
    # in one; the agent's own unit comes with the package.
    BUNDLE=$(cd "$(dirname "$0")" && pwd)
    [ -f "$LIB_DIR/llmgw" ] && [ "$(mode_recorded)" != package ] \
        && fatal "llmgw-agent is installed from a bundle here ($LIB_DIR); uninstall it first, then run package"
    # Checked before the package goes in when this script sits in a bundle, and always with
    # the package's own binary once it is in (a bare fabric name is found by the first).
    if [ -x "$BUNDLE/llmgw" ] && [ -n "$(version_of "$BUNDLE/llmgw")" ]; then
        resolve_facts "$BUNDLE/llmgw"
        check_facts "$BUNDLE/llmgw"
    else
        resolve_facts ""
    fi
    preflight
    arm_undo
    note_package
    install_package # 4
    record_mode package
    NEW_VERSION=$(version_of "$PACKAGE_BIN")
    check_facts "$PACKAGE_BIN" "Run package again with the facts fixed"
    ensure_user   # 1
    ensure_linger # 2
    ensure_dirs   # 3
    # No update helper with packages: the package manager updates them.
    UPDATE_UNITS=""
    configure_and_start
    UNDO=""
    info "done: llmgw $NEW_VERSION installed from the package ($PACKAGE_BIN)"
}

verb_upgrade() {
    check_root
    check_systemd
    make_stage
    check_installed
    bundle_dir
    if [ -n "$FACTS_GIVEN" ]; then
        resolve_facts "$BUNDLE/llmgw"
        check_facts "$BUNDLE/llmgw"
        config_is_valid "$CONFIG" \
            || fatal "node facts go into $CONFIG, which is missing or not valid ('$LIB_DIR/llmgw agent --check' says why); fix it, or run install with them. Nothing was changed"
    fi
    old=$(version_of "$LIB_DIR/llmgw")
    if cmp -s "$BUNDLE/llmgw" "$LIB_DIR/llmgw"; then
        install_units
        if [ "$RESTART" = yes ]; then
            systemctl daemon-reload
            restart_and_wait "$HEALTH_TIMEOUT" || true
        fi
        upgrade_trust
        upgrade_facts
        warn_roots_apart
        info "llmgw $NEW_VERSION is installed already; nothing to upgrade"
        return 0
    fi
    info "upgrade: llmgw ${old:-?} -> $NEW_VERSION"
    warn_docker_group
    keep_previous
    # From here on a failure rolls back: the copies run in a subshell of their own, where
    # set -e stops at the first one that fails (set -e is ignored in a tested command, so
    # 'if ( ... )' would carry on past it); the script then restores the previous version
    # rather than stop with the new binary in place and the old units.
    set +e
    (
        set -e
        put_file "$BUNDLE/llmgw" "$LIB_DIR/llmgw" 0755 root:root
        install_units
    )
    copied=$?
    set -e
    why="the new agent did not come up listening on :$AGENT_PORT within $HEALTH_TIMEOUT s, or stopped within $SETTLE s after"
    if [ "$copied" -ne 0 ]; then
        warn "llmgw $NEW_VERSION could not be put in place (above)"
        why="it could not be put in place (above)"
    else
        systemctl daemon-reload
        if restart_and_wait "$HEALTH_TIMEOUT"; then
            if settled; then
                rm -rf "$PREVIOUS_DIR.old"
                upgrade_trust
                upgrade_facts
                # An install older than the link gets it from an upgrade run as root (the
                # signed-update helper may not write /usr/local/bin, and does without).
                if [ -w "$(dirname "$COMMAND_LINK")" ]; then link_command; fi
                warn_roots_apart
                info "done: llmgw $NEW_VERSION runs and listens on :$AGENT_PORT (llmgw ${old:-?} kept for rollback)"
                return 0
            fi
            warn "llmgw $NEW_VERSION came up but did not stay up for $SETTLE s (LLMGW_AGENT_SETTLE_SECONDS); its journal:"
        else
            warn "llmgw $NEW_VERSION did not come up listening on :$AGENT_PORT within $HEALTH_TIMEOUT s; its journal:"
        fi
        journal_tail
    fi
    info "rollback: restoring llmgw ${old:-?}"
    restore_previous
    # The version before the rolled-back one is the previous one again.
    if [ -d "$PREVIOUS_DIR.old" ]; then
        rm -rf "$PREVIOUS_DIR"
        mv "$PREVIOUS_DIR.old" "$PREVIOUS_DIR"
    fi
    if restart_and_wait "$HEALTH_TIMEOUT"; then
        fatal "upgrade to llmgw $NEW_VERSION failed: $why; rolled back to llmgw ${old:-?}, which runs again"
    fi
    journal_tail
    fatal "upgrade to llmgw $NEW_VERSION failed and the rolled-back llmgw ${old:-?} does not come up either (journal above); see: journalctl -u $UNIT"
}

# The model and cache roots are agent.yaml's (the file is the truth, and an upgrade keeps
# them), but the agent's unit may write only where install's drop-in says: say when the two
# part (a root edited by hand since the last install), and how to apply it.
warn_roots_apart() {
    [ -f "$DROPIN" ] || return 0
    wr_models=$(config_value models_root) wr_cache=$(config_value cache_root)
    wr_models=${wr_models%/} wr_cache=${wr_cache%/}
    wr_models=${wr_models:-$MODELS_ROOT} wr_cache=${wr_cache:-$CACHE_ROOT}
    wr_unit=$(sed -n 's/^ReadWritePaths=//p' "$DROPIN" | tail -n 1)
    [ "$wr_unit" != "-$wr_models -$wr_cache" ] || return 0
    warn "$CONFIG names models_root $wr_models and cache_root $wr_cache, and the agent's unit may write $wr_unit ($DROPIN); run 'install-agent.sh install' (no options needed: it keeps agent.yaml's roots) to make their folders and let the agent write there"
}

# After a CA rotation: 'upgrade --ca-hash NEW' moves the update helper's trust to the CA of
# that pin (checked by 'llmgw agent update-trust', never the agent's word alone).
upgrade_trust() {
    [ -n "$CA_HASH" ] || return 0
    install_update_trust \
        || warn "update helper: its trust may not be updated (above); run 'install-agent.sh upgrade --ca-hash $CA_HASH' again"
}

# upgrade with node facts: agent.yaml with them, once the new version runs; a restart that
# fails with them puts the file back as it was.
upgrade_facts() {
    [ -n "$FACTS_GIVEN" ] || return 0
    cp -p "$CONFIG" "$STAGE/agent.yaml.before"
    RESTART=no
    write_config "$CONFIG"
    [ "$RESTART" = yes ] || {
        record_facts
        info "facts: $CONFIG has them already"
        return 0
    }
    if restart_and_wait "$HEALTH_TIMEOUT"; then
        record_facts
        info "facts: the agent runs with them"
        return 0
    fi
    journal_tail
    # Taken back whole: agent.yaml as it was, and the record never names them.
    put_file "$STAGE/agent.yaml.before" "$CONFIG" 0640 "root:$SERVICE_USER"
    restart_and_wait "$HEALTH_TIMEOUT" || true
    fatal "the agent did not come up with the new node facts (journal above); $CONFIG is back as it was"
}

verb_rollback() {
    check_root
    check_systemd
    make_stage
    check_installed
    [ -f "$PREVIOUS_DIR/llmgw" ] || fatal "no previous version in $PREVIOUS_DIR to roll back to"
    current=$(version_of "$LIB_DIR/llmgw")
    previous=$(version_of "$PREVIOUS_DIR/llmgw")
    info "rollback: llmgw ${current:-?} -> ${previous:-?}"
    # A swap: rolling back again returns to the version rolled back from.
    mkdir -p "$STAGE/current"
    cp -p "$LIB_DIR/llmgw" "$STAGE/current/llmgw"
    for name in $UNIT $UPDATE_UNITS; do
        [ -f "$UNIT_DIR/$name" ] && cp -p "$UNIT_DIR/$name" "$STAGE/current/$name"
    done
    restore_previous
    rm -rf "$PREVIOUS_DIR.new"
    cp -a "$STAGE/current" "$PREVIOUS_DIR.new"
    rm -rf "$PREVIOUS_DIR"
    mv "$PREVIOUS_DIR.new" "$PREVIOUS_DIR"
    if restart_and_wait "$HEALTH_TIMEOUT"; then
        info "done: llmgw ${previous:-?} runs and listens on :$AGENT_PORT (llmgw ${current:-?} kept in $PREVIOUS_DIR)"
        return 0
    fi
    journal_tail
    fatal "llmgw ${previous:-?} did not come up listening on :$AGENT_PORT within $HEALTH_TIMEOUT s (journal above); 'rollback' again returns to llmgw ${current:-?}"
}

verb_rekey() {
    check_root
    check_systemd
    make_stage
    has_identity || fatal "this node has no identity to rekey ($STATE_DIR/node.crt); join it with: install-agent.sh install --node-id ..."
    [ -n "$NODE_ID" ] || NODE_ID=$(node_id_now)
    [ -n "$NODE_ID" ] || fatal "no node_id in $CONFIG; pass --node-id"
    read_join_token "no rekey token: export LLMGW_JOIN_TOKEN=<token from 'llmgw ctl join-command --rekey $NODE_ID'> and run again with 'sudo --preserve-env=LLMGW_JOIN_TOKEN'"
    bin=$(agent_bin)
    info "rekey: stopping $UNIT; it starts again when the rekey is done, or fails"
    systemctl stop "$UNIT"
    status=0
    as_agent_with_token "$bin" agent join --rekey --node-id "$NODE_ID" --enroll-url "$ENROLL_URL" \
        --ca-hash "$CA_HASH" --config "$CONFIG" || status=$?
    if [ "$status" -eq 0 ]; then
        # The agent is stopped: a failure here must not end the script before it starts again.
        install_update_trust \
            || warn "update helper: its trust may not be updated (above); run 'install-agent.sh install' again to update it"
        info "service: starting $UNIT on its new identity ($STATE_DIR/node.crt)"
    else
        warn "'llmgw agent join --rekey' failed (above); starting the agent again on its old identity"
    fi
    restart_and_wait "$HEALTH_TIMEOUT" || {
        journal_tail
        fatal "$UNIT did not come up listening on :$AGENT_PORT within $HEALTH_TIMEOUT s after the rekey (journal above)"
    }
    [ "$status" -eq 0 ] || fatal "rekey failed; the agent runs on its old identity"
    info "done: node $NODE_ID rekeyed; the agent runs on its new identity"
}

verb_uninstall() {
    check_root
    check_systemd
    make_stage
    mode=$(mode_recorded)
    info "uninstall: stopping and disabling $UNIT and the update helper"
    stop_everything
    report_docker_engines
    firewall_clear
    if [ "$mode" = package ]; then
        remove_package
    fi
    rm -f "$UNIT_DIR/$UNIT" "$UNIT_DIR/$PROXY_UNIT" "$DOCKER_DROPIN"
    # shellcheck disable=SC2086 # a list of absolute paths without spaces
    rm -rf $PROXY_STATE
    for name in $UPDATE_UNITS; do rm -f "$UNIT_DIR/$name"; done
    unlink_command
    rm -rf "$LIB_DIR" "$INSTALL_STATE"
    if [ -n "$PURGE" ]; then
        purge_everything
    fi
    systemctl daemon-reload
    systemctl reset-failed "$UNIT" >/dev/null 2>&1 || true
    if [ -n "$PURGE" ]; then
        info "done: llmgw-agent purged; the model and cache folders are kept ($MODELS_ROOT, $CACHE_ROOT and any others you chose)"
    else
        info "done: llmgw-agent removed; kept $CONFIG, the identity in $STATE_DIR and the models ('uninstall --purge' removes all but the models)"
    fi
}

verb_status() {
    make_stage
    print_status
}

main() {
    parse_args "$@"
    RESTART=no DOCKER_CHANGED=no
    case $VERB in
        install) verb_install ;;
        package) verb_package ;;
        upgrade) verb_upgrade ;;
        rollback) verb_rollback ;;
        uninstall) verb_uninstall ;;
        rekey) verb_rekey ;;
        status) verb_status ;;
    esac
}

main "$@"
