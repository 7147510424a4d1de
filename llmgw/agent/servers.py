"""The control planes this agent knows: agent.yaml's ``servers`` (the seeds) and those the
leader named, persisted in ``STATE/servers.json`` with the certificate serials of the
retired instances, which the data plane refuses.

agent.yaml is root's and read-only to the agent, so what the leader says of the instances
added or retired since (``pb.ControlPlanes``) is kept in the agent's own state directory,
where a restarted agent finds it even when every instance agent.yaml names is gone. The
agent dials the seeds first, in their order, then the learnt instances that are not seeds.
Each list the leader sends replaces the learnt one whole (an instance retired disappears),
its retired serials too; the seeds are never dropped. A list or a file that fails the
contract's checks (:func:`llmgw.contracts.control_planes.check_control_planes`,
:func:`~llmgw.contracts.control_planes.check_retired_serials`) changes nothing: it is
logged, never fatal, and the agent keeps dialling (and refusing) what it knew. A file
written before retired serials existed has none: none are refused until the leader says.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from llmgw.contracts.control_planes import (
    MAX_CONTROL_PLANES,
    MAX_ENTRY_CHARS,
    MAX_RETIRED_SERIALS,
    MAX_SERIAL_CHARS,
    check_control_planes,
    check_retired_serials,
)
from llmgw.errors import ConfigError, FileError
from llmgw.fsutil import atomic_write, make_dir
from llmgw.log import kv

__all__ = ["SERVERS_FILE", "KnownServers", "servers_json"]

log = logging.getLogger("llmgw.agent.servers")

SERVERS_FILE = "servers.json"


def servers_json(servers: Sequence[str], retired_serials: Sequence[str] = ()) -> bytes:
    """What ``servers.json`` holds for the learnt ``servers`` and the retired instances'
    serials, the key left out when there are none (also written by a join that keeps the
    operator's agent.yaml: the enrolment's list has nowhere else to go)."""
    data: dict[str, list[str]] = {"servers": list(servers)}
    if retired_serials:
        data["retired_serials"] = list(retired_serials)
    return (json.dumps(data, indent=1) + "\n").encode()


# More than full lists of the longest entries can take: a larger file is not ours.
_MAX_FILE_BYTES = (
    2 * MAX_CONTROL_PLANES * (MAX_ENTRY_CHARS + 8)
    + 2 * MAX_RETIRED_SERIALS * (MAX_SERIAL_CHARS + 8)
    + 64
)


class KnownServers:
    """agent.yaml's seeds, the learnt instances and the retired ones' certificate serials
    of one state directory."""

    def __init__(self, seeds: Sequence[str], state_dir: Path) -> None:
        if not seeds:
            raise ConfigError("no control plane to dial; list them in 'servers'", key="servers")
        self.seeds: tuple[str, ...] = tuple(seeds)
        self.path = state_dir / SERVERS_FILE
        self.learnt: tuple[str, ...]
        self.retired_serials: tuple[str, ...]  # as the leader sent them, newest first
        self.learnt, self.retired_serials = self._load()
        self._retired = frozenset(self.retired_serials)

    def rotation(self) -> tuple[str, ...]:
        """What the reconnect loop dials, in order: the seeds, then the learnt instances
        that are not among them."""
        return self.seeds + tuple(s for s in self.learnt if s not in self.seeds)

    def is_retired(self, serial: str) -> bool:
        """Whether ``serial`` (lowercase hex) is a certificate of a retired instance."""
        return serial in self._retired

    def learn(
        self, servers: Sequence[str], *, source: str, retired_serials: Sequence[str] = ()
    ) -> bool:
        """Replace the learnt instances with the list ``source`` (the control plane that
        sent it) named, and the retired serials with those it sent, and persist them; True
        when either changed. Never raises: a list that fails the checks is logged and
        changes nothing; one that cannot be persisted is logged and used until the agent
        stops."""
        try:
            checked = check_control_planes(servers)
            retired = check_retired_serials(retired_serials)
        except ConfigError as exc:
            log.warning(
                "ignoring the control plane's list of control planes; still dialling the "
                "ones known before",
                extra=kv(
                    server=source,
                    error=str(exc),
                    entries=len(servers),
                    retired_serials=len(retired_serials),
                ),
            )
            return False
        if checked == self.learnt and retired == self.retired_serials:
            return False
        before = set(self.rotation())
        newly_retired = [s for s in retired if s not in self._retired]
        self.learnt, self.retired_serials = checked, retired
        self._retired = frozenset(retired)
        after = self.rotation()
        log.info(
            "learnt the control planes from the leader",
            extra=kv(
                server=source,
                servers=",".join(checked),
                added=",".join(s for s in after if s not in before) or "-",
                retired=",".join(s for s in sorted(before) if s not in after) or "-",
                refused_serials=",".join(newly_retired) or "-",
            ),
        )
        self._save()
        return True

    # -- the file -----------------------------------------------------------------------

    def _load(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The learnt instances and retired serials the file holds (none, when it is
        missing or unreadable)."""
        path = self.path
        try:
            with path.open("rb") as handle:
                raw = handle.read(_MAX_FILE_BYTES + 1)
        except FileNotFoundError:
            return (), ()
        except OSError as exc:
            log.warning(
                "cannot read the control planes learnt before; dialling agent.yaml's servers",
                extra=kv(path=str(path), error=exc.strerror or str(exc)),
            )
            return (), ()
        try:
            if len(raw) > _MAX_FILE_BYTES:
                raise ValueError(f"it is larger than {_MAX_FILE_BYTES} bytes")
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("servers"), list):
                raise ValueError("it is not an object with a list 'servers'")
            retired = data.get("retired_serials", [])
            if not isinstance(retired, list):
                raise ValueError("its 'retired_serials' is not a list")
            return check_control_planes(data["servers"]), check_retired_serials(retired)
        except (ValueError, ConfigError) as exc:  # UnicodeDecodeError, JSONDecodeError too
            log.warning(
                "the control planes learnt before are unreadable; ignoring them and dialling "
                "agent.yaml's servers (the leader sends the list again on connection)",
                extra=kv(path=str(path), error=str(exc)),
            )
            return (), ()

    def _save(self) -> None:
        try:
            make_dir(self.path.parent)
            atomic_write(self.path, servers_json(self.learnt, self.retired_serials), mode=0o600)
        except FileError as exc:
            log.warning(
                "cannot keep the learnt control planes in the state directory; they are used "
                "until the agent stops",
                extra=kv(path=str(self.path), error=str(exc)),
            )
