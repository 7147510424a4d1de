"""A throwaway PostgreSQL cluster for the tests: ``initdb`` + ``pg_ctl`` in a temporary
directory, as an unprivileged user (``postgres`` when the tests run as root: PostgreSQL
refuses to run as root), on a free port of 127.0.0.1, with password authentication for the
role the control plane uses, and TLS on (a certificate for 127.0.0.1 and localhost from a CA
of its own, :attr:`Cluster.tls_ca`, so that a test can connect with sslmode=verify-full).

One cluster per test session (:func:`cluster`); each test that wants a clean database asks for
a fresh one (:meth:`Cluster.fresh_database`), which is much cheaper than a cluster. Debian's
``postgresql`` package provides the programs (under ``/usr/lib/postgresql/VERSION/bin``, not on
PATH); without them the tests say how to install them through :func:`tests.ci.unavailable`.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

from tests.ci import unavailable

__all__ = ["Cluster", "find_bindir"]

ROLE = "llmgw"
PASSWORD = "test-password-0123"
SUPERUSER = "postgres"


def find_bindir() -> Path | None:
    """The newest installed PostgreSQL's bin directory (Debian's layout), else PATH's."""
    found = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name)
    )
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Cluster:
    """One running PostgreSQL cluster; :meth:`stop` and :meth:`start` it to test an outage."""

    def __init__(self, root: Path, bindir: Path, user: str | None) -> None:
        self.root = root
        self.data = root / "data"
        self.sockets = root / "sock"
        self.tls_ca = root / "tls" / "ca.crt"
        self.bindir = bindir
        self.user = user  # run the programs as this user (None: as ourselves)
        self.port = _free_port()
        self._names = itertools.count(1)

    # -------------------------------------------------------------------- running

    def _run(self, *argv: str, check: bool = True, timeout: float = 60) -> str:
        cmd = [str(self.bindir / argv[0]), *argv[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, cwd=self.root, check=False
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr}")
        return proc.stdout

    def init(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets.mkdir(exist_ok=True)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (self.root, self.sockets):
                os.chown(path, entry.pw_uid, entry.pw_gid)
            self.root.chmod(0o755)
        self._run(
            "initdb",
            "-D",
            str(self.data),
            "-U",
            SUPERUSER,
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
            "--locale=C.UTF-8",
            "--encoding=UTF8",
            "--no-sync",
        )
        cert, key = self._make_tls()
        conf = self.data / "postgresql.conf"
        with conf.open("a") as f:
            f.write(
                f"ssl = on\nssl_cert_file = '{cert}'\nssl_key_file = '{key}'\n"
                f"listen_addresses = '127.0.0.1'\nport = {self.port}\n"
                f"unix_socket_directories = '{self.sockets}'\n"
                "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n"
                "max_connections = 200\nshared_buffers = 32MB\n"
            )
        self.start()
        self.psql(
            f"CREATE ROLE {ROLE} LOGIN PASSWORD '{PASSWORD}' CREATEDB",
        )

    def _make_tls(self) -> tuple[Path, Path]:
        """The server's certificate and key (the key the server's user's own, 0600, as
        PostgreSQL insists), issued by a CA made for this cluster."""
        from llmgw import pki

        directory = self.tls_ca.parent
        ca = pki.init_ca(directory)
        ident = pki.issue_server_cert(ca, directory, hosts=["127.0.0.1", "localhost"])
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            for path in (directory, ident.cert, ident.key):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        return ident.cert, ident.key

    def start(self) -> None:
        self._run(
            "pg_ctl", "-D", str(self.data), "-l", str(self.root / "log"), "-w", "-t", "60", "start"
        )

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop", check=False)

    def psql(self, sql: str, database: str = "postgres") -> str:
        return self._run(
            "psql",
            "-X",
            "-q",
            "-A",
            "-t",
            "-v",
            "ON_ERROR_STOP=1",
            "-h",
            str(self.sockets),
            "-p",
            str(self.port),
            "-U",
            SUPERUSER,
            "-d",
            database,
            "-c",
            sql,
        )

    # ---------------------------------------------------------------- databases

    def fresh_database(self) -> str:
        """A new empty database owned by the control plane's role; its name."""
        name = f"llmgw_t{os.getpid()}_{next(self._names)}"
        self.psql(f"CREATE DATABASE {name} OWNER {ROLE} TEMPLATE template0")
        return name

    def url(self, database: str, *, password: bool = True, **params: str) -> str:
        """A libpq URL of *database* as the control plane's role (the password in the URL
        only for tests that hand the URL to psycopg directly)."""
        auth = f"{ROLE}:{PASSWORD}" if password else ROLE
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{database}" + (
            f"?{query}" if query else ""
        )

    def password_file(self, directory: Path) -> Path:
        """A file holding the role's password (what server.yaml's password_file names)."""
        path = directory / "db-password"
        path.write_text(PASSWORD + "\n")
        path.chmod(0o600)
        return path

    def destroy(self) -> None:
        self.stop("immediate")
        with contextlib.suppress(OSError):
            shutil.rmtree(self.root)


def start_cluster() -> Cluster:
    """A running cluster in a new temporary directory (unavailable() without PostgreSQL)."""
    bindir = find_bindir()
    if bindir is None:
        unavailable(
            "PostgreSQL is not installed; apt-get install -y postgresql (the tests start a "
            "throwaway cluster of their own; the system's is not used)"
        )
    user: str | None = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SUPERUSER)
        except KeyError:
            unavailable("running as root needs the 'postgres' user; apt-get install -y postgresql")
        user = SUPERUSER
    root = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
    cluster = Cluster(root, bindir, user)
    try:
        cluster.init()
    except BaseException:
        cluster.destroy()
        raise
    return cluster
