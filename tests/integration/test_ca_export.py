"""The CA in HA, end to end: ``llmgw ctl cert export-ca`` against a running control plane,
``llmgw server --import-ca`` into a second state directory, and a second control plane
started on it. On SQLite the second is another cluster's store; what is checked is what the
export makes equal (the CA, during a rotation the old CA and the cross-certificate, the admin
token) and what it must not (each instance's own server certificate). Every refusal, on
either side, is checked to leave nothing behind."""

from __future__ import annotations

import json
import os
import socket
import ssl
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography.hazmat.primitives.serialization import Encoding

from llmgw import pki
from llmgw.netaddr import CONTROL_PLANE_NAME
from tests.integration.harness import LLMGW, Server, start_server, stop_process

pytestmark = pytest.mark.integration

PASSPHRASE = "integration passphrase"
WAIT = 60.0


def start_in(tmp: Path) -> Server:
    """A control plane with its server.yaml and state directory (``tmp/server``) in ``tmp``."""
    tmp.mkdir(parents=True, exist_ok=True)
    return start_server(tmp)


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LLMGW, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=WAIT,
        stdin=subprocess.DEVNULL,
    )


def base_env(tmp: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env["XDG_CONFIG_HOME"] = str(tmp / "xdg")
    return env | more


def export_ca(
    tmp: Path, server: Server, out: Path, *more: str, password: str, passphrase: str = PASSPHRASE
) -> subprocess.CompletedProcess[str]:
    env = base_env(
        tmp,
        LLMGW_SERVER=server.url,
        LLMGW_TOKEN=server.admin_token,
        LLMGW_ADMIN_PASSWORD=password,
        LLMGW_CA_PASSPHRASE=passphrase,
    )
    return run("ctl", "cert", "export-ca", "--out", str(out), *more, env=env)


def import_ca(
    tmp: Path, state: Path, export: Path, passphrase: str = PASSPHRASE
) -> subprocess.CompletedProcess[str]:
    cfg = state.parent / "import.yaml"
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump({"state_dir": str(state)}))
    env = base_env(tmp, LLMGW_CA_PASSPHRASE=passphrase)
    return run("server", "--config", str(cfg), "--import-ca", str(export), env=env)


def admin_password(server: Server) -> str:
    return (server.state_dir / "admin.password").read_text().strip()


def tree(directory: Path) -> dict[str, bytes]:
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def exports(server: Server) -> list[dict[str, Any]]:
    return [e for e in server.api("GET", "/api/events?limit=500") if e["kind"] == "ca_exported"]


def presented(server: Server, *, trusting: Path, client: pki.Identity) -> bytes:
    """The certificate ``server``'s agent stream presents to a node that trusts only the CA
    file ``trusting`` (the handshake verifies it, under the control plane's name)."""
    ctx = ssl.create_default_context(cafile=str(trusting))
    ctx.load_cert_chain(client.cert, client.key)
    with (
        socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10) as raw,
        ctx.wrap_socket(raw, server_hostname=CONTROL_PLANE_NAME) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_export_import_and_a_second_instance_on_the_same_ca(tmp_path: Path) -> None:
    first = start_in(tmp_path / "first")
    second: Server | None = None
    try:
        ca = pki.load_ca(first.pki_dir)
        out = tmp_path / "ca.llmgw"
        password = admin_password(first)

        # Refusals: nothing is exported, nothing written, no event.
        wrong = export_ca(tmp_path, first, out, password="not-the-admin-password")
        assert wrong.returncode == 1, wrong.stderr
        assert wrong.stderr.startswith("error: wrong admin password; nothing was exported. ")
        short = export_ca(tmp_path, first, out, password=password, passphrase="too short")
        assert short.returncode == 2
        assert short.stderr == (
            "error: the passphrase of a CA export must have at least 12 characters (it alone "
            "protects the CA key in the file); nothing was exported. Choose a longer one\n"
        )
        assert not out.exists() and exports(first) == []

        done = export_ca(tmp_path, first, out, password=password)
        assert done.returncode == 0, done.stderr
        cluster = first.api("GET", "/api/status")["cluster_id"]
        assert done.stdout.splitlines()[0] == (
            f"exported CA {ca.ca_hash()} of cluster {cluster} to {out}"
        )
        assert stat.S_IMODE(out.stat().st_mode) == 0o600
        header = json.loads(out.read_bytes())
        assert (header["format"], header["ca_hash"]) == ("llmgw-ca-export/1", ca.ca_hash())
        assert first.admin_token not in out.read_text()
        [event] = exports(first)
        assert event["message"].startswith(f"the CA {ca.ca_hash()} and the admin token were")

        sealed = out.read_bytes()
        again = export_ca(tmp_path, first, out, password=password)
        assert again.returncode == 1
        assert again.stderr == (
            f"error: {out} exists; nothing was exported. Choose another --out, or pass --force "
            "to replace it\n"
        )
        assert out.read_bytes() == sealed and len(exports(first)) == 1

        # The import: a wrong passphrase writes nothing; the right one writes the CA and
        # the token; again, nothing changes.
        state = tmp_path / "second" / "server"
        refused = import_ca(tmp_path, state, out, passphrase="not the passphrase")
        assert refused.returncode == 1
        assert refused.stderr.startswith(f"error: wrong passphrase for {out} ")
        assert not state.exists()
        imported = import_ca(tmp_path, state, out)
        assert imported.returncode == 0, imported.stderr
        assert imported.stdout.splitlines()[0] == (
            f"imported CA {ca.ca_hash()} of cluster {cluster} into {state / 'pki'}"
        )
        assert imported.stdout.splitlines()[-1].endswith(
            "start the control plane: systemctl start llmgw-server"
        )
        assert sorted(p.name for p in (state / "pki").iterdir()) == [
            "ca.crt",
            "ca.key",
            "trust.crt",
        ]
        before = tree(state)
        same = import_ca(tmp_path, state, out)
        assert same.returncode == 0, same.stderr
        assert "unchanged" in same.stdout.splitlines()[0]
        assert tree(state) == before

        # Into the running first instance (the same cluster): nothing to do.
        own = import_ca(tmp_path, first.state_dir, out)
        assert own.returncode == 0, own.stderr
        assert own.stdout.splitlines()[:2] == [
            f"this instance already has CA {ca.ca_hash()} (in {first.pki_dir}); unchanged",
            f"admin token: {first.state_dir / 'admin.token'} holds it already; unchanged",
        ]
        # Into another cluster's state directory: refused, nothing written.
        other = tmp_path / "other" / "server"
        theirs = pki.init_ca(other / "pki")
        before_other = tree(other)
        clash = import_ca(tmp_path, other, out)
        assert clash.returncode == 1
        assert clash.stderr.startswith(
            f"error: this instance already has CA {theirs.ca_hash()} (in {other / 'pki'}); "
            f"the export is {ca.ca_hash()}"
        )
        assert tree(other) == before_other

        # The second instance starts on the imported state: the same CA and admin token,
        # its own server certificate, which a node of the first instance verifies.
        second = start_in(tmp_path / "second")
        assert second.state_dir == state
        assert second.admin_token == first.admin_token
        assert pki.load_ca(second.pki_dir).ca_hash() == ca.ca_hash()
        mine = pki.load_cert(second.pki_dir / "server.crt")
        theirs_cert = pki.load_cert(first.pki_dir / "server.crt")
        assert pki.issued_by(mine, ca.cert)
        assert mine.serial_number != theirs_cert.serial_number
        assert pki.fingerprint(mine.public_key()) != pki.fingerprint(theirs_cert.public_key())
        assert (second.pki_dir / "server.key").read_bytes() != (
            first.pki_dir / "server.key"
        ).read_bytes()
        node = pki.issue_node_cert(ca, "gpu-of-first", tmp_path / "node")
        der = presented(second, trusting=first.pki_dir / "ca.crt", client=node)
        assert der == mine.public_bytes(Encoding.DER)
        # llmgw ctl with the first instance's token works against the second.
        status = run(
            "ctl",
            "cert",
            env=base_env(tmp_path, LLMGW_SERVER=second.url, LLMGW_TOKEN=first.admin_token),
        )
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith(f"CA:          {ca.ca_hash()}  (valid until ")
    finally:
        stop_process(first.proc)
        if second is not None:
            stop_process(second.proc)


def test_an_export_during_a_rotation_makes_an_equal_signer_and_verifier(tmp_path: Path) -> None:
    first = start_in(tmp_path / "first")
    second: Server | None = None
    try:
        old_ca = pki.load_ca(first.pki_dir)
        first.api("POST", "/api/ca/rotate", {"overlap": "1d"})
        out = tmp_path / "ca.llmgw"
        done = export_ca(tmp_path, first, out, password=admin_password(first))
        assert done.returncode == 0, done.stderr
        rotation = pki.read_rotation(first.pki_dir)
        assert rotation is not None and rotation.previous == old_ca.ca_hash()
        assert done.stdout.splitlines()[1].startswith(
            f"with the CA rotation under way: the old CA {old_ca.ca_hash()} is trusted until "
        )
        state = tmp_path / "second" / "server"
        imported = import_ca(tmp_path, state, out)
        assert imported.returncode == 0, imported.stderr
        assert imported.stdout.splitlines()[1].startswith(
            f"with the CA rotation under way: the old CA {old_ca.ca_hash()} is trusted until "
        )
        for name in ("ca.crt", "previous-ca.crt", "ca-cross.crt", "rotation.json", "trust.crt"):
            assert (state / "pki" / name).read_bytes() == (first.pki_dir / name).read_bytes()
        assert not (state / "pki" / "previous-ca.key").exists()

        second = start_in(tmp_path / "second")
        # What 'llmgw ctl cert' shows is the same on both: the CAs, the drop, the rotation.
        assert second.api("GET", "/api/ca") == first.api("GET", "/api/ca")
        # A node that trusts only the old CA verifies the second instance, through the
        # cross-certificate after its leaf, as it verifies the first.
        node = pki.issue_node_cert(old_ca, "gpu-old", tmp_path / "node")
        for server in (first, second):
            der = presented(server, trusting=tmp_path / "node" / "ca.crt", client=node)
            leaf = pki.load_cert(server.pki_dir / "server.crt")
            assert der == leaf.public_bytes(Encoding.DER)
        chain = pki.load_bundle(second.pki_dir / "server.crt")
        assert len(chain) == 2 and pki.issued_by(chain[1], old_ca.cert)
    finally:
        stop_process(first.proc)
        if second is not None:
            stop_process(second.proc)
