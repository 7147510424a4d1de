"""The gateway refuses an agent data plane whose certificate the control plane revoked: the
CA still vouches for it (an old identity after a rekey, a revoked node's key), the deny list
does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from cryptography.hazmat.primitives import serialization

from llmgw import pki
from llmgw.bodies import BodyBudget
from llmgw.server.common.config import load_server_config
from llmgw.server.common.metrics import Metrics
from llmgw.server.gateway.gateway import Gateway, GatewaySettings
from llmgw.server.gateway.routing import Router


def der_of(tmp_path: Path, node_id: str) -> tuple[bytes, str]:
    ca = pki.init_ca(tmp_path / "ca")
    identity = pki.issue_node_cert(ca, node_id, tmp_path / node_id)
    cert = pki.load_cert(identity.cert)
    return cert.public_bytes(serialization.Encoding.DER), pki.serial_hex(cert)


def gateway(revoked: set[str]) -> Gateway:
    return Gateway(
        Router(),
        Metrics(),
        cast(Any, None),  # no request is served
        BodyBudget(1024),
        GatewaySettings.of(load_server_config(None)),
        revoked=lambda: revoked,
        client_ssl=lambda: None,
        nodes_connected=lambda: 0,
        epoch=1,
        started_at=0.0,
    )


def test_a_current_certificate_passes(tmp_path: Path) -> None:
    der, _ = der_of(tmp_path, "gpu-1")
    assert gateway(set()).forwarder.agent_certificate_problem(der, "gpu-1") is None


def test_a_revoked_certificate_is_refused_with_the_way_back(tmp_path: Path) -> None:
    der, serial = der_of(tmp_path, "gpu-1")
    problem = gateway({serial}).forwarder.agent_certificate_problem(der, "gpu-1")
    assert problem is not None
    assert f"certificate {serial}" in problem and "revoked" in problem
    assert "llmgw ctl join-command --node gpu-1" in problem
