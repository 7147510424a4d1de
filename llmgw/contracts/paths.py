"""Where llmgw's files live by default on a host (DESIGN §7), one definition for every side.

Each of these is read by more than one party that may not import the others: the agent and
``llmgw agent``'s root commands (which must not load the agent), ``llmgw ctl engine check``
(a client, which looks for the node's agent.yaml), the control plane and ``llmgw ctl`` (which
reads the ctl.yaml and admin token a local control plane writes), the agent's spooler and the
root update helper. The packages' units and the installer hold the same paths; the packaging
tests check them against these.
"""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "DEFAULT_AGENT_CONFIG",
    "DEFAULT_AGENT_STATE_DIR",
    "DEFAULT_SERVER_CONFIG",
    "DEFAULT_SERVER_STATE_DIR",
    "PACKAGED_BUNDLE_DIR",
]

DEFAULT_AGENT_CONFIG = Path("/etc/llmgw/agent.yaml")
"""The node agent's configuration (``llmgw agent --config``)."""

DEFAULT_AGENT_STATE_DIR = Path("/var/lib/llmgw-agent")
"""The node agent's state: its key and certificate, shard records, the update spool."""

DEFAULT_SERVER_CONFIG = Path("/etc/llmgw/server.yaml")
"""The control plane's configuration (``llmgw server --config``), used when it exists."""

DEFAULT_SERVER_STATE_DIR = Path("/var/lib/llmgw")
"""The control plane's state: its database, CA, admin token and the ctl.yaml it writes."""

PACKAGED_BUNDLE_DIR = Path("/usr/share/llmgw/agent-bundles")
"""The agent bundles the llmgw-agent-bundles package installs (read-only, the package
manager's): the control plane serves them beside those of its ``bundle_dir``."""
