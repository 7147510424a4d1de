"""Disaggregated serving on the engine side: what a shard's role (``prefill`` or ``decode``)
and its KV transfer address add to its engine's command, per engine, and the checks a role
passes (:func:`check_role`).

A disaggregated model has two pools of single-node replicas on one fabric; the gateway sends
a request to a prefill replica, then to a decode replica that pulls the KV cache from it.
Each engine speaks its own hand-over (:class:`Handover`, the registry's ``disagg_handover``);
the shard's ``transfer_addr`` (``host:port``, the port inside the node's ``multinode_ports``)
is where its engine binds the side channel that peers dial. What each engine does, from its
own code and documentation:

- vLLM (docs/features/nixl_connector_usage.md; vllm/distributed/kv_transfer/kv_connector/v1/
  nixl): ``--kv-transfer-config {"kv_connector":"NixlConnector","kv_role":"kv_both"}`` on
  both pools: NixlConnector "does not distinguish kv_role", the proxy (here the gateway) makes
  a replica a prefiller or a decoder by the ``kv_transfer_params`` it sends, so the role
  changes nothing on vLLM's command line. The NIXL handshake listener is a ZeroMQ socket bound
  at ``VLLM_NIXL_SIDE_CHANNEL_HOST:VLLM_NIXL_SIDE_CHANNEL_PORT`` (the transfer address: it
  binds that address alone, not every interface). Its port is ``base + data_parallel_index``
  (one listener in the scheduler, which answers for every tensor-parallel rank), so a
  TP > 1 shard without data parallelism takes the one port; a profile that adds
  ``--data-parallel-size N`` takes ``N`` ports from the base, which the control plane does
  not reserve. The KV cache itself moves over UCX (NIXL's default backend):
  ``UCX_NET_DEVICES`` names the fabric's adapters as UCX spells an InfiniBand port,
  ``mlx5_0:1``; UCX_TLS is left to UCX (its default, every transport it finds).
- SGLang (python/sglang/srt/disaggregation/): ``--disaggregation-mode prefill|decode``,
  ``--disaggregation-transfer-backend`` (its default, ``mooncake``, named so that the command
  says it; a profile's args may name ``nixl``, they come later and win),
  ``--disaggregation-ib-device`` the fabric's adapters (HCA names without port suffixes, as
  its help asks for NIXL UCX). Only the prefill runs a bootstrap server (decode dials the
  one each request names), on ``--disaggregation-bootstrap-port``; decode gets no port.
  Found in its code: the bootstrap server binds the HTTP ``--host``
  (``CommonKVBootstrapServer(host=server_args.host, ...)``; 0.5.23 has no flag of its own for
  it), so its HTTP API stays on 127.0.0.1 like every engine's and the bootstrap server binds
  ``bootstrap_port``, a second loopback port the agent picks; the agent relays the transfer
  address to it (:mod:`llmgw.agent.bootstrap`), which is where the decode pool (and the
  gateway's ``bootstrap_host``/``bootstrap_port``) dials it. A plain TCP relay suffices: the
  bootstrap server is aiohttp (HTTP/1.1 over TCP: ``PUT /route``, where the prefill's own
  ranks register over loopback, ``GET /route`` and ``POST /query_dp_ranks`` from the
  decode's ranks) and reads no address from its connection. Each rank registers
  ``rank_ip``, its KV sender's ZeroMQ socket, on the address ``SGLANG_HOST_IP`` names (else
  the first route's source address), set to the transfer host so that the transfers stay on
  the fabric (the decode's ranks dial it directly, not through the relay); it binds a free port it picks itself: SGLang has no setting to keep it inside
  ``multinode_ports``, so a node whose firewall drops the fabric's peers elsewhere blocks it.
  The prefill registers its HTTP port too (``prefill_http_port``), which a newer decode
  dials on the bootstrap host to recompute a retracted request: on loopback it is not
  reachable, so such a retraction fails there as it would on any firewalled node.
- sim (``llmgw engine sim``): ``--kv-transfer-addr HOST:PORT``, where its TCP pull binds.

llama.cpp cannot disaggregate: a role on it is refused. Disaggregated pools are single-node
replicas in this release: a multi-node shard with a role is refused too.
"""

from __future__ import annotations

import json
from enum import StrEnum

from llmgw.engines.spec import EngineSpec, rendezvous_addr
from llmgw.errors import EngineError

__all__ = [
    "DECODE",
    "PREFILL",
    "ROLES",
    "SGLANG_BACKEND",
    "Handover",
    "check_role",
    "runs_bootstrap_server",
    "sglang_flags",
    "sim_flags",
    "transfer_host_port",
    "ucx_devices",
    "vllm_flags",
]

PREFILL = "prefill"
DECODE = "decode"
ROLES: tuple[str, ...] = (PREFILL, DECODE)
"""A shard's ``disagg_role`` besides "" (aggregated: the whole request on one replica)."""


class Handover(StrEnum):
    """How the gateway hands a request from a prefill replica to a decode replica."""

    VLLM = "vllm"
    """``kv_transfer_params``: a ``max_tokens: 1`` prefill returns them, the decode request
    carries them (NixlConnector; the sim speaks it too)."""
    SGLANG = "sglang"
    """Bootstrap host, port and room, sent to both replicas at once."""


# vLLM's KVTransferConfig: the connector and its role (vLLM requires kv_role once a connector
# is named; NixlConnector reads neither kv_ip nor kv_port, it takes the env below).
VLLM_KV_TRANSFER = json.dumps(
    {"kv_connector": "NixlConnector", "kv_role": "kv_both"}, separators=(",", ":")
)
SGLANG_BACKEND = "mooncake"
"""SGLang's transfer backend unless a profile's args name another (its own default)."""
UCX_PORT = "1"
"""The adapter port UCX_NET_DEVICES names when agent.yaml gives an HCA without one (the
port of a single-port adapter, and the first of a dual-port one)."""


def check_role(engine: str, handover: Handover | None, spec: EngineSpec) -> None:
    """The role of ``spec`` makes sense for ``engine`` (whose registry row speaks
    ``handover``); EngineError saying what is wrong and what to do when not."""
    role = spec.disagg_role
    if not role:
        if spec.transfer_addr:
            raise EngineError(
                f"transfer_addr {spec.transfer_addr} is given without a disaggregation role; "
                f"an aggregated shard transfers no KV cache: give a role ({' or '.join(ROLES)}) "
                "or no transfer_addr"
            )
        return
    if role not in ROLES:
        raise EngineError(
            f"disaggregation role {role!r} is not one llmgw knows; use {' or '.join(ROLES)} "
            "(or none for an aggregated replica)"
        )
    if handover is None:
        raise EngineError(
            f"{_label(engine)} cannot disaggregate prefill and decode; use vllm, sglang or sim "
            "(or deploy the model without prefill and decode pools)"
        )
    if spec.multi_node:
        raise EngineError(
            f"a {role} shard of a {spec.nodes}-node replica: disaggregated pools are "
            "single-node replicas in this release; deploy the pools with nodes 1"
        )
    if not spec.transfer_addr:
        raise EngineError(
            f"a {role} shard needs transfer_addr (host:port where its engine binds its KV "
            "transfer side channel); the control plane sends one with every role, so upgrade "
            "a control plane that does not"
        )
    transfer_host_port(spec)


def transfer_host_port(spec: EngineSpec) -> tuple[str, int]:
    """``(host, port)`` of the shard's ``transfer_addr``; EngineError when it is not
    ``host:port``."""
    return rendezvous_addr(spec.transfer_addr, "transfer_addr")


def ucx_devices(devices: tuple[str, ...]) -> str:
    """``UCX_NET_DEVICES`` of the node's fabric adapters: UCX names an InfiniBand device by
    adapter and port (``mlx5_0:1``); one given with its port is kept as it is."""
    return ",".join(d if ":" in d else f"{d}:{UCX_PORT}" for d in devices)


def vllm_flags(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """The flags and environment a role adds to ``vllm serve`` (the same for both roles)."""
    if not spec.disagg_role:
        return [], {}
    host, port = transfer_host_port(spec)
    env = {"VLLM_NIXL_SIDE_CHANNEL_HOST": host, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}
    if spec.fabric_devices:
        env["UCX_NET_DEVICES"] = ucx_devices(spec.fabric_devices)
    return ["--kv-transfer-config", VLLM_KV_TRANSFER], env


def runs_bootstrap_server(handover: Handover | None, role: str) -> bool:
    """Whether a ``role`` shard of an engine speaking ``handover`` runs a bootstrap server on
    loopback (an SGLang prefill), which the agent relays its ``transfer_addr`` to."""
    return handover is Handover.SGLANG and role == PREFILL


def sglang_flags(spec: EngineSpec) -> tuple[list[str], dict[str, str]]:
    """The flags and environment a role adds to SGLang's launch_server; EngineError for a
    prefill without its ``bootstrap_port``."""
    if not spec.disagg_role:
        return [], {}
    host = transfer_host_port(spec)[0]
    argv = ["--disaggregation-mode", spec.disagg_role]
    argv += ["--disaggregation-transfer-backend", SGLANG_BACKEND]
    if spec.disagg_role == PREFILL:
        if spec.bootstrap_port <= 0:
            raise EngineError(
                "an SGLang prefill shard needs bootstrap_port, the free loopback port its "
                "bootstrap server binds (it binds the HTTP --host, 127.0.0.1): the agent picks "
                f"one and relays transfer_addr {spec.transfer_addr} to it; a caller that builds "
                "the command itself must pick one too"
            )
        argv += ["--disaggregation-bootstrap-port", str(spec.bootstrap_port)]
    if spec.fabric_devices:
        # HCA names without port suffixes (its help: "use HCA names without port suffixes
        # for NIXL UCX"; mooncake takes the same names).
        argv += [
            "--disaggregation-ib-device",
            ",".join(d.split(":")[0] for d in spec.fabric_devices),
        ]
    return argv, {"SGLANG_HOST_IP": host}


def sim_flags(spec: EngineSpec) -> list[str]:
    """The flags a role adds to ``llmgw engine sim``."""
    if not spec.disagg_role:
        return []
    return ["--kv-transfer-addr", spec.transfer_addr]


def _label(engine: str) -> str:
    return "llama.cpp" if engine == "llamacpp" else f"engine {engine}"
