"""llmgw.contracts.paths: DESIGN's default paths, and the sides that read them use them."""

from __future__ import annotations

from pathlib import Path

from llmgw.agent.config import parse_agent_config
from llmgw.contracts.paths import (
    DEFAULT_AGENT_CONFIG,
    DEFAULT_AGENT_STATE_DIR,
    DEFAULT_SERVER_CONFIG,
    DEFAULT_SERVER_STATE_DIR,
)
from llmgw.contracts.update_order import DEFAULT_SPOOL
from llmgw.server.common.config import parse_server_config


def test_the_paths_are_designs() -> None:
    # The packages' units and the installer hold the same paths: changing one is a migration.
    assert DEFAULT_AGENT_CONFIG == Path("/etc/llmgw/agent.yaml")
    assert DEFAULT_AGENT_STATE_DIR == Path("/var/lib/llmgw-agent")
    assert DEFAULT_SERVER_CONFIG == Path("/etc/llmgw/server.yaml")
    assert DEFAULT_SERVER_STATE_DIR == Path("/var/lib/llmgw")


def test_each_side_defaults_to_them() -> None:
    assert parse_server_config({}).state_dir == DEFAULT_SERVER_STATE_DIR
    assert parse_agent_config({"server": "cp1"}).state_dir == DEFAULT_AGENT_STATE_DIR
    # The agent spools update requests in its state directory, where the root helper looks.
    assert DEFAULT_SPOOL.parent == DEFAULT_AGENT_STATE_DIR
