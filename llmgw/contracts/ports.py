"""The ports llmgw listens on by default (DESIGN §2), one definition for both ends.

A node and its control plane must agree on these without configuration: ``llmgw agent join
https://cp`` dials the enrolment port, an agent's ``server: cp`` the gRPC stream port, and
the control plane's default ``enroll_listen``/``grpc_listen`` bind the same numbers. So they
are part of the wire contract, not of either side's configuration, and live here rather
than in :mod:`llmgw.netaddr` (which parses addresses and knows nothing of llmgw's services).
"""

from __future__ import annotations

__all__ = ["DEFAULT_DATA_PORT", "DEFAULT_ENROLL_PORT", "DEFAULT_GRPC_PORT", "DEFAULT_HTTP_PORT"]

DEFAULT_HTTP_PORT = 8080
"""Control plane: the gateway /v1, the admin API /api, bundles, /metrics, /healthz."""

DEFAULT_ENROLL_PORT = 8443
"""Control plane: enrolment, where a joining agent trades its one-time token for a cert."""

DEFAULT_GRPC_PORT = 7443
"""Control plane: the agents' Connect stream (gRPC over mTLS)."""

DEFAULT_DATA_PORT = 9443
"""Agent: its data plane, which only the control plane's gateway may call (mTLS)."""
