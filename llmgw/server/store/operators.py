"""The operators table: the people who run the cluster (the console's and ctl's accounts),
each an ``admin`` or a ``viewer``, their passwords kept as scrypt hashes.

A removed account keeps its row (the audit trail names it) with ``removed_at`` set; its
name can be taken again. The last active admin can be neither removed nor demoted.
"""

from __future__ import annotations

from llmgw.errors import Conflict, NotFound
from llmgw.server.store.database import Database
from llmgw.server.store.rows import OPERATOR_ROLES, Operator, check_operator_name

__all__ = ["Operators"]


class Operators:
    """Operator accounts, by name among the active ones."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_operator(self, name: str, role: str, password_hash: str, created_by: str) -> Operator:
        """A new account; :class:`Conflict` when an active one has the name."""
        check_operator_name(name)
        _check_role(role)
        with self._db.write():
            if self._active(name) is not None:
                raise Conflict(
                    f"operator {name!r} exists already; change it with 'llmgw ctl users "
                    f"password {name}' or 'llmgw ctl users role {name} ROLE'"
                )
            now = self._db.clock()
            self._db.execute(
                "INSERT INTO operators(name, role, password_hash, created_at, created_by, "
                "password_changed_at) VALUES (?, ?, ?, ?, ?, ?)",
                (name, role, password_hash, now, created_by, now),
            )
            return self.get_operator(name)

    def get_operator(self, name: str) -> Operator:
        """The active account *name*; :class:`NotFound` when there is none."""
        row = self._active(name)
        if row is None:
            raise NotFound(f"no operator {name!r}; 'llmgw ctl users list' shows them")
        return row

    def find_operator(self, name: str) -> Operator | None:
        """The active account *name*, or None."""
        return self._active(name)

    def list_operators(self) -> list[Operator]:
        """The active accounts, by name."""
        rows = self._db.all("SELECT * FROM operators WHERE removed_at IS NULL ORDER BY name")
        return [Operator.from_row(r) for r in rows]

    def count_operators(self) -> int:
        """Accounts ever made, removed ones included (0: a store before its first admin)."""
        row = self._db.one("SELECT COUNT(*) AS n FROM operators")
        return 0 if row is None else int(row["n"])

    def set_operator_password(self, name: str, password_hash: str) -> Operator:
        with self._db.write():
            self.get_operator(name)
            self._db.execute(
                "UPDATE operators SET password_hash = ?, password_changed_at = ? "
                "WHERE name = ? AND removed_at IS NULL",
                (password_hash, self._db.clock(), name),
            )
            return self.get_operator(name)

    def set_operator_role(self, name: str, role: str) -> Operator:
        """Change *name*'s role; :class:`Conflict` when it would leave no admin."""
        _check_role(role)
        with self._db.write():
            current = self.get_operator(name)
            if current.role == "admin" and role != "admin":
                self._keep_an_admin(name, "demoted")
            self._db.execute(
                "UPDATE operators SET role = ? WHERE name = ? AND removed_at IS NULL",
                (role, name),
            )
            return self.get_operator(name)

    def remove_operator(self, name: str) -> Operator:
        """Remove *name* (its row stays, marked); :class:`Conflict` when it is the last
        admin."""
        with self._db.write():
            current = self.get_operator(name)
            if current.role == "admin":
                self._keep_an_admin(name, "removed")
            self._db.execute(
                "UPDATE operators SET removed_at = ? WHERE id = ?", (self._db.clock(), current.id)
            )
            row = self._db.one("SELECT * FROM operators WHERE id = ?", (current.id,))
        assert row is not None
        return Operator.from_row(row)

    def _keep_an_admin(self, name: str, what: str) -> None:
        row = self._db.one(
            "SELECT COUNT(*) AS n FROM operators WHERE role = 'admin' AND removed_at IS NULL"
        )
        if row is None or int(row["n"]) <= 1:
            raise Conflict(
                f"{name!r} is the last admin and cannot be {what}: nobody could manage the "
                f"operators after it; add another admin first ('llmgw ctl users add NAME "
                "--role admin')"
            )

    def _active(self, name: str) -> Operator | None:
        row = self._db.one("SELECT * FROM operators WHERE name = ? AND removed_at IS NULL", (name,))
        return None if row is None else Operator.from_row(row)


def _check_role(role: str) -> None:
    if role not in OPERATOR_ROLES:
        raise ValueError(f"unknown role {role!r}; use one of {', '.join(OPERATOR_ROLES)}")
