"""Where the state database is: server.yaml's ``database`` (a ``sqlite:///PATH`` URL, a libpq
``postgresql://`` URL, or a plain path: a SQLite file) and the file holding the PostgreSQL
password, parsed and checked, and said back without any secret.

A password is never part of the URL (it would be in the configuration's readers' view, in
``ps`` when given to a command, and in logs): it comes from ``password_file`` or libpq's own
``PGPASSFILE`` (``~/.pgpass``).

Whoever can write the database owns the cluster (an operator's row, the leader's address the
standbys forward passwords to), so a database reached over the network must be the one meant:
libpq's default ``sslmode=prefer`` takes any certificate, or none. A URL naming a host that is
not loopback or a Unix socket needs ``sslmode=verify-full`` (with ``sslrootcert``, the CA that
signed the server's certificate), or an ``sslmode=`` stated explicitly, which is the
operator's choice of less.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from llmgw.errors import ConfigError

__all__ = ["Location", "parse_location"]

_SQLITE = "sqlite://"
_POSTGRES = ("postgresql://", "postgres://")


@dataclass(frozen=True)
class Location:
    """One database: ``engine`` is ``sqlite`` (``path``) or ``postgresql`` (``conninfo``)."""

    engine: str
    display: str
    """What messages and logs say: the path, or the URL without any secret."""
    path: str = ""
    conninfo: dict[str, str] = field(default_factory=dict)
    """libpq's keywords (host, port, dbname, user, target_session_attrs...), no password."""
    password_file: Path | None = None

    @property
    def is_postgresql(self) -> bool:
        return self.engine == "postgresql"

    @property
    def unverified_network_hosts(self) -> list[str]:
        """The hosts reached over the network without libpq checking the server's
        certificate and name (an explicit ``sslmode`` below ``verify-full``): what the start
        warns of. Empty for SQLite, verify-full, and loopback or socket hosts alone."""
        if not self.is_postgresql or self.conninfo.get("sslmode") == "verify-full":
            return []
        return _network_hosts(self.conninfo)

    def hosts(self) -> list[str]:
        """host:port of each server the URL names (for messages)."""
        hosts = self.conninfo.get("host", "localhost").split(",")
        ports = self.conninfo.get("port", "5432").split(",")
        if len(ports) == 1:
            ports = ports * len(hosts)
        return [f"{h or 'localhost'}:{p or '5432'}" for h, p in zip(hosts, ports, strict=False)]

    def read_password(self) -> str | None:
        """The password from :attr:`password_file` (None: libpq finds one, or none is needed)."""
        if self.password_file is None:
            return None
        try:
            text = self.password_file.read_text()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the database password file {self.password_file}: "
                f"{exc.strerror}; it must be readable by the control plane's user (mode 0600)",
                key="database.password_file",
            ) from exc
        password = text.strip("\r\n")
        if not password or "\n" in password:
            raise ConfigError(
                f"{self.password_file} must hold the database password alone, on one line",
                key="database.password_file",
            )
        return password


def parse_location(
    value: str, *, password_file: Path | None = None, key: str = "database"
) -> Location:
    """The database *value* names; a :class:`ConfigError` naming *key* when it is wrong."""
    text = value.strip()
    if not text:
        raise ConfigError("is empty; give sqlite:///PATH or a postgresql:// URL", key=key)
    if text.startswith(_POSTGRES):
        return _postgres(text, password_file, key)
    if password_file is not None:
        raise ConfigError(
            "password_file is for a postgresql:// database; a SQLite file needs none",
            key=f"{key}.password_file",
        )
    if text.startswith(_SQLITE):
        rest = text[len(_SQLITE) :]
        if rest == ":memory:" or rest == "/:memory:":
            return Location("sqlite", ":memory:", path=":memory:")
        if not rest.startswith("/"):
            raise ConfigError(
                f"{text!r} names no absolute path; write sqlite:///ABSOLUTE/PATH (three slashes)",
                key=key,
            )
        path = rest
    elif "://" in text:
        scheme = text.split("://", 1)[0]
        raise ConfigError(
            f"unknown database scheme {scheme!r}; give sqlite:///PATH or a postgresql:// URL",
            key=key,
        )
    else:
        path = text
    return Location("sqlite", path, path=path)


def _postgres(url: str, password_file: Path | None, key: str) -> Location:
    try:
        from psycopg import conninfo as pgconninfo
    except ImportError as exc:
        raise ConfigError(
            f"names a PostgreSQL database, but this llmgw has no PostgreSQL driver ({exc}); "
            "install it (pip install 'psycopg[binary,pool]'; the llmgw packages and "
            "binaries carry it) or use sqlite:///PATH",
            key=key,
        ) from exc

    try:
        params: dict[str, Any] = pgconninfo.conninfo_to_dict(url)
    except Exception as exc:  # psycopg.ProgrammingError: libpq's parser refused it
        raise ConfigError(
            f"is not a valid PostgreSQL URL ({_first_line(exc)}); write it as "
            "postgresql://USER@HOST[:PORT][,HOST2...]/DBNAME[?target_session_attrs=read-write]",
            key=key,
        ) from exc
    if "password" in params:
        raise ConfigError(
            "holds a password; take it out of the URL and put it in a file named by "
            "password_file (mode 0600), or in the control plane user's ~/.pgpass",
            key=key,
        )
    if not params.get("dbname"):
        raise ConfigError(
            "names no database; add it after the host: postgresql://USER@HOST/DBNAME", key=key
        )
    if "passfile" in params and password_file is not None:
        raise ConfigError(
            "gives both passfile (in the URL) and password_file; keep one",
            key=key,
        )
    conninfo = {str(k): str(v) for k, v in params.items()}
    remote = _network_hosts(conninfo)
    if remote and "sslmode" not in conninfo:
        raise ConfigError(
            f"reaches {', '.join(remote)} over the network without checking that the server "
            "is the one meant (libpq's default sslmode=prefer takes any certificate, or "
            "none), and whoever answers there owns the cluster; add "
            "sslmode=verify-full&sslrootcert=/etc/llmgw/db-ca.crt to the URL (the CA that "
            "signed the database server's certificate, readable by the control plane's "
            "user; sslrootcert=system: the system's trust store), or state another sslmode= "
            "to accept less (the README's 'The database connection' says what each means)",
            key=key,
        )
    return Location(
        "postgresql",
        _display(conninfo),
        conninfo=conninfo,
        password_file=password_file,
    )


def _network_hosts(conninfo: dict[str, str]) -> list[str]:
    """The hosts (and hostaddrs) of a libpq conninfo that are reached over the network: not a
    Unix socket directory, not ``localhost``, not a loopback address. Without ``host`` libpq
    reads PGHOST, else it uses the Unix socket."""
    entries = conninfo.get("host", os.environ.get("PGHOST", "")).split(",")
    entries += conninfo.get("hostaddr", os.environ.get("PGHOSTADDR", "")).split(",")
    return [h.strip() for h in entries if not _is_local(h.strip())]


def _is_local(host: str) -> bool:
    if not host or host.startswith(("/", "@")):  # the default socket, a socket directory
        return True
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _display(conninfo: dict[str, str]) -> str:
    user = conninfo.get("user")
    host = conninfo.get("host", "")
    port = conninfo.get("port")
    hosts = host.split(",") if host else [""]
    if port and "," not in port:
        netloc = ",".join(f"{h}:{port}" for h in hosts)
    elif port:
        pairs = zip(hosts, port.split(","), strict=False)
        netloc = ",".join(f"{h}:{p}" if p else h for h, p in pairs)
    else:
        netloc = host
    auth = f"{quote(user, safe='')}@" if user else ""
    return f"postgresql://{auth}{netloc}/{conninfo.get('dbname', '')}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
