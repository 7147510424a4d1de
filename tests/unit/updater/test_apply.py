"""The root helper (``llmgw agent update-apply``) against real files: a good order is applied
and its counter kept; every refusal, of a bad order, a hostile bundle or a hostile agent,
leaves the counter, the installed agent and everything outside the helper's work directory
as they were."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from llmgw import pki
from llmgw.agent.update_spool import read_status
from llmgw.contracts.update_order import REQUEST, STATUS
from llmgw.errors import UpdateError
from llmgw.pki import Authority
from llmgw.pki.certs import load_key
from llmgw.server.fleet.updates import sign_order
from llmgw.updater import bundle as helper_bundle
from llmgw.updater.apply import ApplyResult, apply_request, read_counter
from tests.unit.orders import NODE, order_for


def tar_gz(entries: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]]) -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.GNU_FORMAT) as tar:
        for entry in entries:
            if isinstance(entry, tuple):
                info, data = entry
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(entry)
    return raw.getvalue()


def file_entry(name: str, data: bytes, mode: int = 0o644) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.mode = mode
    return info, data


def dir_entry(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.DIRTYPE
    info.mode = 0o755
    return info


def bundle_bytes(
    version: str,
    *,
    marker: Path,
    exit_code: int = 0,
    arch: str = "x64",
    info_version: str | None = None,
    extra: list[tarfile.TarInfo | tuple[tarfile.TarInfo, bytes]] | None = None,
) -> bytes:
    """A bundle laid out like packaging/bundle.py's, whose install-agent.sh records its
    arguments, the health timeout it was given and its working directory in ``marker``."""
    top = f"llmgw-agent-{version}-linux-{arch}"
    script = (
        "#!/bin/sh\nset -eu\n"
        f'echo "$* timeout=${{LLMGW_AGENT_HEALTH_TIMEOUT:-unset}} '
        f'settle=${{LLMGW_AGENT_SETTLE_SECONDS:-unset}} cwd=$(pwd)" > {marker}\n'
        'echo "installing" \n'
        + (
            f'echo "new agent did not listen; rolled back" >&2\nexit {exit_code}\n'
            if exit_code
            else ""
        )
    )
    info = f"name: llmgw-agent\nversion: {info_version or version}\narchitecture: linux-{arch}\n"
    return tar_gz(
        [
            dir_entry(top),
            file_entry(f"{top}/BUILD-INFO", info.encode()),
            file_entry(f"{top}/install-agent.sh", script.encode(), 0o755),
            file_entry(f"{top}/llmgw", b"#!/bin/sh\necho llmgw " + version.encode() + b"\n", 0o755),
            *(extra or []),
        ]
    )


@dataclass
class Node:
    """One node's update directories: the agent's spool, the installer's trust directory,
    the helper's state, and the installed agent."""

    root: Path
    ca: Authority

    @property
    def spool(self) -> Path:
        return self.root / "agent-state" / "update"

    @property
    def trust(self) -> Path:
        return self.root / "etc-update"

    @property
    def state(self) -> Path:
        return self.root / "helper-state"

    @property
    def installed(self) -> Path:
        return self.root / "installed" / "llmgw"

    @property
    def marker(self) -> Path:
        return self.root / "installer-ran"

    def spool_request(
        self,
        bundle: bytes,
        order: dict[str, Any] | None = None,
        *,
        key: Authority | None = None,
        tamper: Callable[[bytes], bytes] | None = None,
    ) -> dict[str, Any]:
        order = order or order_for(sha256=hashlib.sha256(bundle).hexdigest())
        data, signature = sign_order((key or self.ca).key, order)
        if tamper is not None:
            data = tamper(data)
        incoming = self.spool / "incoming.test"
        incoming.mkdir(parents=True)
        (incoming / "bundle.tar.gz").write_bytes(bundle)
        (incoming / "order.json").write_bytes(data)
        (incoming / "order.sig").write_bytes(signature)
        incoming.rename(self.spool / REQUEST)
        return order

    def apply(self) -> ApplyResult:
        return apply_request(
            spool=self.spool,
            trust=self.trust,
            state=self.state,
            installed_binary=self.installed,
            machine="x86_64",
        )

    def assert_refused(self, result: ApplyResult, words: str, *, counter_before: int = 0) -> None:
        assert result.state == "refused", result
        assert words in result.message
        assert result.exit_code == 1
        status = read_status(self.spool)
        assert status is not None and status["state"] == "refused"
        assert words in status["message"]
        assert read_counter(self.state) == counter_before
        assert not self.marker.exists(), "the installer ran for a refused order"
        assert not os.path.lexists(self.spool / REQUEST)
        assert os.listdir(self.state / "work") == []


@pytest.fixture
def node(tmp_path: Path, authority: Authority) -> Node:
    n = Node(tmp_path, authority)
    n.spool.mkdir(parents=True)
    n.trust.mkdir()
    (n.trust / "ca.pem").write_bytes((authority.directory / "ca.crt").read_bytes())
    (n.trust / "node-id").write_text(NODE + "\n")
    n.installed.parent.mkdir()
    n.installed.write_text("#!/bin/sh\necho 'llmgw 0.1.0'\n")
    n.installed.chmod(0o755)
    return n


# -- the helper: accepted ------------------------------------------------------------------------


def test_a_good_order_is_applied_and_its_counter_kept(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_AGENT_HEALTH_TIMEOUT", "7")
    monkeypatch.setenv("LLMGW_AGENT_SETTLE_SECONDS", "11")
    bundle = bundle_bytes("0.2.0", marker=node.marker)
    node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest(), counter=5))
    result = node.apply()
    assert (result.state, result.counter, result.version) == ("done", 5, "0.2.0"), result
    assert result.exit_code == 0
    ran = node.marker.read_text()
    assert ran.startswith("upgrade timeout=7 settle=11 cwd=")
    assert ran.rstrip().endswith("/unpacked/llmgw-agent-0.2.0-linux-x64")
    status = read_status(node.spool)
    assert status is not None
    assert (status["state"], status["counter"], status["version"]) == ("done", 5, "0.2.0")
    assert read_counter(node.state) == 5
    assert oct((node.state).stat().st_mode & 0o777) == "0o700"
    assert os.listdir(node.state / "work") == []
    assert not os.path.lexists(node.spool / REQUEST)


def test_the_same_version_again_is_no_downgrade(node: Node) -> None:
    bundle = bundle_bytes("0.1.0", marker=node.marker)
    node.spool_request(
        bundle, order_for(version="0.1.0", sha256=hashlib.sha256(bundle).hexdigest())
    )
    assert node.apply().state == "done"


def test_a_failed_upgrade_is_rolled_back_and_its_counter_spent(node: Node) -> None:
    bundle = bundle_bytes("0.2.0", marker=node.marker, exit_code=3)
    order = node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest()))
    result = node.apply()
    assert result.state == "rolled-back"
    assert "exited with 3" in result.message
    assert "new agent did not listen; rolled back" in result.message
    assert result.exit_code == 1
    assert read_counter(node.state) == 1
    # The same order again is a replay now, even though it did not succeed.
    node.marker.unlink()
    node.spool_request(bundle, order)
    node.assert_refused(node.apply(), "not above the last accepted one (1)", counter_before=1)


def test_nothing_to_do_without_a_request(node: Node) -> None:
    result = node.apply()
    assert (result.state, result.exit_code) == ("idle", 0)
    assert read_status(node.spool) is None


# -- the helper: refused ---------------------------------------------------------------------------


def good_bundle(node: Node, version: str = "0.2.0") -> tuple[bytes, str]:
    bundle = bundle_bytes(version, marker=node.marker)
    return bundle, hashlib.sha256(bundle).hexdigest()


def test_a_tampered_order_is_refused(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(
        bundle,
        order_for(sha256=sha),
        tamper=lambda data: data.replace(b'"counter":1', b'"counter":9'),
    )
    node.assert_refused(node.apply(), "does not verify against the cluster CA")


def test_an_order_signed_by_another_ca_is_refused(node: Node, other_authority: Authority) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha), key=other_authority)
    node.assert_refused(node.apply(), "does not verify against the cluster CA")


def test_an_expired_order_is_refused(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, expires=int(time.time()) - 1))
    node.assert_refused(node.apply(), "expired")


def test_a_replayed_counter_is_refused(node: Node) -> None:
    (node.state).mkdir(mode=0o700)
    (node.state / "counter").write_text("4\n")
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, counter=4))
    node.assert_refused(node.apply(), "not above the last accepted one (4)", counter_before=4)


def test_a_downgrade_is_refused(node: Node) -> None:
    node.installed.write_text("#!/bin/sh\necho 'llmgw 0.10.0'\n")
    bundle, sha = good_bundle(node, "0.9.9")
    node.spool_request(bundle, order_for(sha256=sha, version="0.9.9"))
    node.assert_refused(node.apply(), "older than the installed 0.10.0")


def test_an_unknown_installed_version_is_refused(node: Node) -> None:
    node.installed.unlink()
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    node.assert_refused(node.apply(), "downgrade cannot be ruled out")


def test_a_package_installed_agent_is_refused_with_its_package_manager_named(
    node: Node, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    packaged = tmp_path / "usr-lib-llmgw" / "llmgw"
    packaged.parent.mkdir()
    packaged.write_text("#!/bin/sh\necho 'llmgw 0.1.0'\n")
    monkeypatch.setattr(helper_bundle, "PACKAGE_BINARY", packaged)
    node.installed.unlink()
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    node.assert_refused(node.apply(), "apt-get install llmgw-agent")


def test_another_nodes_order_is_refused(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, node_id="gpu-2"))
    node.assert_refused(node.apply(), "for node gpu-2, and this is node gpu-1")


def test_another_architecture_is_refused(node: Node) -> None:
    bundle = bundle_bytes("0.2.0", marker=node.marker, arch="arm64")
    sha = hashlib.sha256(bundle).hexdigest()
    node.spool_request(bundle, order_for(sha256=sha, arch="arm64"))
    node.assert_refused(node.apply(), "this machine is linux-x64")


def test_a_bundle_that_does_not_match_the_sha256_is_refused(node: Node) -> None:
    bundle, _ = good_bundle(node)
    node.spool_request(bundle, order_for(sha256="ab" * 32))
    node.assert_refused(node.apply(), "not the abab")


def test_a_bundle_of_another_version_is_refused(node: Node) -> None:
    bundle = bundle_bytes("0.2.0", marker=node.marker, info_version="0.3.0")
    node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest()))
    node.assert_refused(node.apply(), "the bundle is version 0.3.0, the order says 0.2.0")


def _symlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.SYMTYPE
    info.linkname = target
    return info


def _hardlink(name: str, target: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE
    info.linkname = target
    return info


def _device(name: str) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.CHRTYPE
    info.devmajor, info.devminor = 1, 3
    return info


TOP = "llmgw-agent-0.2.0-linux-x64"


@pytest.mark.parametrize(
    ("member", "words"),
    [
        (file_entry("/etc/cron.d/evil", b"x"), "an absolute path"),
        (file_entry(f"{TOP}/../../etc/evil", b"x"), "'..'"),
        (file_entry(f"{TOP}/a/../../evil", b"x"), "'..'"),
        (_symlink(f"{TOP}/escape", "/etc"), "a link"),
        (_symlink(f"{TOP}/rel", "../../etc/passwd"), "a link"),
        (_hardlink(f"{TOP}/shadow", "/etc/shadow"), "a link"),
        (_device(f"{TOP}/null"), "not a file or directory"),
        (file_entry("llmgw-agent-0.3.0-linux-x64/other", b"x"), "outside the top folder"),
        # A second installer, the one the unpack would keep: refused before the counter.
        (file_entry(f"{TOP}/install-agent.sh", b"#!/bin/sh\nexit 0\n"), "in the archive twice"),
    ],
)
def test_hostile_bundle_members_are_refused(
    node: Node, member: tarfile.TarInfo | tuple[tarfile.TarInfo, bytes], words: str
) -> None:
    bundle = bundle_bytes("0.2.0", marker=node.marker, extra=[member])
    node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest()))
    node.assert_refused(node.apply(), words)
    assert not (node.root / "etc").exists()


def test_a_bundle_without_an_installer_is_refused(node: Node) -> None:
    bundle = tar_gz(
        [
            dir_entry(TOP),
            file_entry(f"{TOP}/BUILD-INFO", b"version: 0.2.0\narchitecture: linux-x64\n"),
            file_entry(f"{TOP}/llmgw", b"x", 0o755),
        ]
    )
    node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest()))
    node.assert_refused(node.apply(), f"no {TOP}/install-agent.sh")


def test_garbage_instead_of_a_bundle_is_refused(node: Node) -> None:
    bundle = b"not a tarball at all"
    node.spool_request(bundle, order_for(sha256=hashlib.sha256(bundle).hexdigest()))
    node.assert_refused(node.apply(), "not a readable .tar.gz")


# -- the helper against a hostile agent --------------------------------------------------------------


def test_a_symlinked_request_is_refused_and_its_target_untouched(node: Node) -> None:
    elsewhere = node.root / "precious"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("mine")
    os.symlink(elsewhere, node.spool / REQUEST)
    node.assert_refused(node.apply(), "not a directory (a symlink or a file)")
    assert (elsewhere / "keep").read_text() == "mine"
    assert elsewhere.stat().st_mode & 0o777 == 0o755  # not chmodded through the link


@pytest.mark.parametrize("name", ["order.json", "order.sig", "bundle.tar.gz"])
def test_a_symlink_inside_the_request_is_refused(node: Node, name: str) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    victim = node.root / "victim"
    victim.write_bytes((node.spool / REQUEST / name).read_bytes())
    (node.spool / REQUEST / name).unlink()
    os.symlink(victim, node.spool / REQUEST / name)
    node.assert_refused(node.apply(), f"{name} in the request is a symlink")
    assert victim.exists()


def test_a_fifo_in_the_request_is_refused_without_hanging(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    (node.spool / REQUEST / "order.sig").unlink()
    os.mkfifo(node.spool / REQUEST / "order.sig")
    node.assert_refused(node.apply(), "order.sig in the request is not a regular file")


def test_an_extra_file_in_the_request_is_refused(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    (node.spool / REQUEST / "unpacked").mkdir()
    node.assert_refused(node.apply(), "not exactly")


def test_a_status_symlink_is_replaced_not_followed(node: Node) -> None:
    victim = node.root / "victim"
    victim.write_text("do not overwrite")
    os.symlink(victim, node.spool / STATUS)
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, node_id="gpu-2"))
    result = node.apply()
    assert result.state == "refused"
    assert victim.read_text() == "do not overwrite"
    assert not (node.spool / STATUS).is_symlink()
    assert (node.spool / STATUS).stat().st_mode & 0o777 == 0o644
    assert json.loads((node.spool / STATUS).read_text())["state"] == "refused"


def test_a_symlinked_spool_is_not_used(node: Node) -> None:
    real = node.root / "somewhere"
    real.mkdir()
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha))
    (node.spool).rename(real / "update")
    os.symlink(real / "update", node.spool)
    with pytest.raises(UpdateError, match="not a directory"):
        node.apply()
    assert (real / "update" / REQUEST).is_dir()  # left alone
    assert not node.marker.exists()


def test_the_command_line_exits_non_zero_on_a_refusal(node: Node) -> None:
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, node_id="gpu-2"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmgw",
            "agent",
            "update-apply",
            "--spool",
            str(node.spool),
            "--trust",
            str(node.trust),
            "--state",
            str(node.state),
            "--installed-binary",
            str(node.installed),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result
    assert "error: update refused: the order is for node gpu-2" in result.stderr
    assert "llmgw-agent-update: took" in result.stdout
    assert read_status(node.spool)["state"] == "refused"  # type: ignore[index]


# -- across a CA rotation ----------------------------------------------------------------------------


@dataclass
class Rotated:
    """A node whose helper trusts the old CA, and the control plane's PKI just rotated."""

    node: Node
    old: Authority
    new: Authority

    def rotation_fields(self, pin: str | None = None) -> dict[str, Any]:
        d = self.new.directory
        return {
            "ca_pin": pin or self.new.ca_hash(),
            "ca_certs": [(d / pki.CA_CERT).read_text(), (d / pki.CROSS_CERT).read_text()],
        }


@pytest.fixture
def rotated(tmp_path: Path) -> Rotated:
    d = tmp_path / "cp-pki"
    old = pki.init_ca(d)
    n = Node(tmp_path / "node", old)
    n.spool.mkdir(parents=True)
    n.trust.mkdir()
    (n.trust / "ca.pem").write_bytes(pki.cert_pem(old.cert))
    (n.trust / "ca-hash").write_text(old.ca_hash() + "\n")
    (n.trust / "node-id").write_text(NODE + "\n")
    n.installed.parent.mkdir()
    n.installed.write_text("#!/bin/sh\necho 'llmgw 0.1.0'\n")
    n.installed.chmod(0o755)
    pki.rotate_ca(d, overlap=3600)
    return Rotated(n, old, pki.load_ca(d))


def trusted_pin(node: Node) -> str:
    return pki.fingerprint(pki.load_cert(node.trust / "ca.pem").public_key())


def test_an_order_of_the_new_ca_moves_the_trust_through_the_cross_certificate(
    rotated: Rotated,
) -> None:
    node, new = rotated.node, rotated.new
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, **rotated.rotation_fields()), key=new)
    result = node.apply()
    assert result.state == "done", result
    assert trusted_pin(node) == new.ca_hash()
    assert (node.trust / "ca-hash").read_text().strip() == new.ca_hash()
    # The new CA's own certificate is trusted, not the cross-certificate.
    assert pki.load_cert(node.trust / "ca.pem") == new.cert
    # From now on plain orders of the new CA verify directly.
    node.marker.unlink()
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, counter=2), key=new)
    assert node.apply().state == "done"


def test_an_order_of_the_old_ca_naming_the_new_pin_moves_the_trust(rotated: Rotated) -> None:
    node = rotated.node
    bundle, sha = good_bundle(node)
    node.spool_request(bundle, order_for(sha256=sha, **rotated.rotation_fields()), key=rotated.old)
    assert node.apply().state == "done"
    assert trusted_pin(node) == rotated.new.ca_hash()


def test_a_refused_rotation_order_leaves_the_trust(rotated: Rotated) -> None:
    node = rotated.node
    bundle, sha = good_bundle(node, "0.0.9")  # a downgrade: refused after verification
    node.spool_request(
        bundle, order_for(sha256=sha, version="0.0.9", **rotated.rotation_fields()), key=rotated.new
    )
    node.assert_refused(node.apply(), "downgrade")
    assert trusted_pin(node) == rotated.old.ca_hash()


def test_the_agent_cannot_sign_orders_with_its_node_key(rotated: Rotated, tmp_path: Path) -> None:
    """The node's certificate is signed by the trusted CA too, but it is no CA certificate:
    an order the agent signs with its own key and vouches for with it is refused."""
    node = rotated.node
    ident = pki.issue_node_cert(rotated.old, NODE, tmp_path / "agent")
    agent_key = load_key(ident.key)
    as_ca = Authority(cert=pki.load_cert(ident.cert), key=agent_key, directory=ident.cert.parent)
    bundle, sha = good_bundle(node)
    fields = {
        "ca_pin": pki.fingerprint(agent_key.public_key()),
        "ca_certs": [ident.cert.read_text()],
    }
    node.spool_request(bundle, order_for(sha256=sha, **fields), key=as_ca)
    node.assert_refused(node.apply(), "does not verify against the cluster CA")
    assert trusted_pin(node) == rotated.old.ca_hash()


def test_a_ca_of_the_agents_choosing_is_refused(rotated: Rotated, tmp_path: Path) -> None:
    """A self-made CA with the cluster CA's very name, not signed by the trusted CA."""
    node = rotated.node
    rogue = pki.init_ca(tmp_path / "rogue")  # same default subject as the cluster CA
    assert rogue.cert.subject == rotated.old.cert.subject
    bundle, sha = good_bundle(node)
    fields = {"ca_pin": rogue.ca_hash(), "ca_certs": [pki.cert_pem(rogue.cert).decode()]}
    node.spool_request(bundle, order_for(sha256=sha, **fields), key=rogue)
    node.assert_refused(node.apply(), "does not verify against the cluster CA")
    # Signed by the rotated (endorsed) CA but naming the rogue one as the new trust.
    fields = rotated.rotation_fields(pin=rogue.ca_hash())
    fields["ca_certs"].append(pki.cert_pem(rogue.cert).decode())
    node.spool_request(bundle, order_for(sha256=sha, **fields), key=rotated.new)
    node.assert_refused(node.apply(), "names the pin")
    assert trusted_pin(node) == rotated.old.ca_hash()


def test_after_the_overlap_the_cross_certificate_no_longer_vouches(
    rotated: Rotated, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = rotated.node
    bundle, sha = good_bundle(node)
    order = order_for(
        sha256=sha, expires=int(time.time()) + 30 * 86400, **rotated.rotation_fields()
    )
    node.spool_request(bundle, order, key=rotated.new)
    result = apply_request(
        spool=node.spool,
        trust=node.trust,
        state=node.state,
        installed_binary=node.installed,
        machine="x86_64",
        now=lambda: time.time() + 2 * 3600,
    )
    node.assert_refused(result, "its overlap has ended")
    assert trusted_pin(node) == rotated.old.ca_hash()


def test_a_pin_without_its_certificate_is_refused(rotated: Rotated) -> None:
    node = rotated.node
    bundle, sha = good_bundle(node)
    fields = rotated.rotation_fields()
    fields["ca_certs"] = fields["ca_certs"][1:]  # the cross-certificate alone
    node.spool_request(bundle, order_for(sha256=sha, **fields), key=rotated.new)
    node.assert_refused(node.apply(), "carries no self-signed certificate")


def test_odd_certificates_in_an_unverified_order_are_refused_not_a_crash(
    rotated: Rotated, other_authority: Authority
) -> None:
    """Until an order verifies, its ca_certs are anyone's: keys of other kinds, a CA of
    another name, are passed over and the order is refused."""
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "llmgw cluster CA")])
    now = dt.datetime.now(dt.UTC)
    odd = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, None)
    )
    node = rotated.node
    bundle, sha = good_bundle(node)
    fields = {
        "ca_pin": other_authority.ca_hash(),
        "ca_certs": [pki.cert_pem(odd).decode(), pki.cert_pem(other_authority.cert).decode()],
    }
    node.spool_request(bundle, order_for(sha256=sha, **fields), key=other_authority)
    node.assert_refused(node.apply(), "does not verify against the cluster CA")
