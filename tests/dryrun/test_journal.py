"""The frozen agent logs to the journal with its fields (Debian 12): python-systemd is built into
the binary (scripts/dist.sh), so under systemd log.py's journal handler sends each record with
its LLMGW_* fields, its logger and a syslog priority. `journalctl -o json -u llmgw-agent`
shows them; without python-systemd the agent would say so and write plain text."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.harness import wait_for
from tests.packaging.pkgcheck import systemd_image_of

from .lab import Lab

NODE = "dry-journal"


def entries(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_the_agent_journal_carries_llmgw_fields(lab: Lab) -> None:
    node = lab.boot(systemd_image_of("bookworm"), NODE)
    join = lab.join_command(NODE)
    node.sh(join["command"])
    assert node.unit("ActiveState") == "active"

    def started() -> list[dict[str, Any]]:
        out = node.out("journalctl -o json --no-pager -u llmgw-agent.service")
        return [e for e in entries(out) if e.get("LLMGW_NODE") == NODE]

    found = wait_for(started, what="an agent journal entry with LLMGW_NODE", timeout=60, interval=1)
    everything = entries(node.out("journalctl -o json --no-pager -u llmgw-agent.service"))
    messages = [str(e.get("MESSAGE", "")) for e in everything]
    assert not any("python-systemd is missing" in m for m in messages), messages
    entry = next(e for e in found if str(e["MESSAGE"]).startswith("agent started"))
    assert entry["SYSLOG_IDENTIFIER"] == "llmgw"
    assert entry["PRIORITY"] == "6"
    assert entry["LOGGER"] == "llmgw.agent"
    assert entry["LLMGW_DATAPLANE"].endswith(":9443")
    assert entry["LLMGW_SERVERS"]
    assert entry["_SYSTEMD_UNIT"] == "llmgw-agent.service"
    # Sent through the journal's native protocol by the agent itself, not its stderr.
    assert entry["_TRANSPORT"] == "journal"
