"""The agent's fencing state: the highest epoch it has accepted and the op ids it has applied.

Both live in one small JSON file in the state directory, replaced atomically, so that a
deposed leader (a lower epoch) cannot act and a resent order is not applied twice, across
reconnects and agent restarts alike.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from llmgw.errors import ConfigError, StaleEpoch
from llmgw.fsutil import atomic_write

__all__ = ["Decision", "OperationLog"]

# Op ids are uuids; remembering the last 10,000 covers any realistic resend window.
MAX_APPLIED = 10_000


@dataclass(frozen=True)
class Decision:
    """What to do with an incoming order."""

    apply: bool
    duplicate: bool


class OperationLog:
    """Persistent epoch fence and applied-op record."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.max_epoch = 0
        self._applied: OrderedDict[str, None] = OrderedDict()
        self._load()

    def _load(self) -> None:
        try:
            raw = self.path.read_text()
        except FileNotFoundError:
            return
        except OSError as exc:
            raise ConfigError(
                f"cannot read the operation log: {exc.strerror}; check the state directory's "
                "owner and mode (it belongs to the agent's user, mode 0700)",
                file=str(self.path),
            ) from exc
        try:
            data = json.loads(raw)
            self.max_epoch = int(data["max_epoch"])
            self._applied = OrderedDict((str(op), None) for op in data["applied"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(
                "the operation log is corrupt; move it aside and restart the agent "
                "(the control plane resends what is still wanted)",
                file=str(self.path),
            ) from exc

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = json.dumps({"max_epoch": self.max_epoch, "applied": list(self._applied)})
        atomic_write(self.path, data.encode(), mode=0o600)

    def observe_epoch(self, epoch: int) -> None:
        """Raise the fence to a leader's epoch announced in Welcome; refuse a lower one."""
        if epoch < self.max_epoch:
            raise StaleEpoch(
                f"control plane epoch {epoch} is lower than {self.max_epoch} already accepted; "
                "it is a deposed leader, try the next server"
            )
        if epoch > self.max_epoch:
            self.max_epoch = epoch
            self._save()

    def check(self, epoch: int, op_id: str) -> Decision:
        """Decide on an order; raise StaleEpoch for one from a lower epoch."""
        if epoch < self.max_epoch:
            raise StaleEpoch(
                f"order {op_id} carries epoch {epoch}, lower than {self.max_epoch} already "
                "accepted; it was not applied"
            )
        if op_id in self._applied:
            return Decision(apply=False, duplicate=True)
        return Decision(apply=True, duplicate=False)

    def record(self, epoch: int, op_id: str) -> None:
        """Remember that an order was applied (called before acknowledging it)."""
        self.max_epoch = max(self.max_epoch, epoch)
        self._applied[op_id] = None
        while len(self._applied) > MAX_APPLIED:
            self._applied.popitem(last=False)
        self._save()

    def applied(self, op_id: str) -> bool:
        return op_id in self._applied
