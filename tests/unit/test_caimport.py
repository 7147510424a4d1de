"""Unit tests of llmgw.caimport: a CA export installed into a state directory (the CA files
and the admin token, with their modes and owner), nothing written when another CA or admin
token is in the way, and nothing followed through a symlink below the state directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmgw import caimport, pki
from llmgw.caexport import CAExport
from llmgw.caimport import Installed
from llmgw.errors import CAExportError
from tests.unit.caexport_rig import TOKEN, exported, mode, snapshot

pytestmark = pytest.mark.usefixtures("open_umask")


def installed(tmp: Path, export: CAExport) -> tuple[Path, Path, Installed]:
    state = tmp / "new" / "state"
    done = caimport.install(export, pki_dir=state / "pki", token_file=state / "admin.token")
    return state / "pki", state / "admin.token", done


def test_install_writes_the_ca_and_token_and_the_instance_makes_its_own_certificates(
    tmp_path: Path,
) -> None:
    src, export = exported(tmp_path)
    pki_dir, token, done = installed(tmp_path, export)
    assert done == Installed(ca=True, token=True)
    assert sorted(p.name for p in pki_dir.iterdir()) == ["ca.crt", "ca.key", "trust.crt"]
    assert (mode(pki_dir), mode(pki_dir / "ca.crt"), mode(pki_dir / "ca.key")) == (
        0o700,
        0o644,
        0o600,
    )
    assert (mode(pki_dir.parent), mode(token)) == (0o700, 0o600)
    assert token.read_text() == TOKEN + "\n"
    assert (pki_dir / "ca.crt").read_bytes() == (src / "ca.crt").read_bytes()
    # Only ca.crt and ca.key: the first start issues this instance's own certificates.
    ca, server, client = pki.ensure_server_identity(pki_dir, hosts=["cp-2.example"])
    assert ca.ca_hash() == export.ca_hash
    mine, theirs = pki.load_cert(server.cert), pki.load_cert(src / "server.crt")
    assert pki.issued_by(mine, export.ca_cert) and pki.issued_by(
        pki.load_cert(client.cert), ca.cert
    )
    assert mine.public_key() != theirs.public_key()
    assert "cp-2.example" in pki.control_plane_names(mine)
    assert "cp-1.example" not in pki.control_plane_names(mine)


def test_importing_the_same_export_again_changes_nothing(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    pki_dir, _, _ = installed(tmp_path, export)
    pki.ensure_server_identity(pki_dir, hosts=[])
    before = snapshot(pki_dir.parent)
    assert installed(tmp_path, export)[2] == Installed(ca=False, token=False)
    assert snapshot(pki_dir.parent) == before


def test_install_refuses_another_ca_and_writes_nothing(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    state = tmp_path / "new" / "state"
    other = pki.init_ca(state / "pki")
    before = snapshot(state)
    with pytest.raises(CAExportError) as info:
        installed(tmp_path, export)
    assert str(info.value) == (
        f"this instance already has CA {other.ca_hash()} (in {state / 'pki'}); the export is "
        f"{export.ca_hash}, of another cluster or of a CA rotated since. Nothing was "
        f"imported; move {state / 'pki'} aside if this instance should join that cluster (it "
        "makes its own certificates at start), then import again"
    )
    assert snapshot(state) == before
    assert not (state / "admin.token").exists()


def test_install_refuses_another_admin_token_and_writes_nothing(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    state = tmp_path / "new" / "state"
    state.mkdir(parents=True)
    (state / "admin.token").write_text("llmgw-admin-other\n")
    with pytest.raises(CAExportError) as info:
        installed(tmp_path, export)
    assert str(info.value) == (
        f"{state / 'admin.token'} holds another admin token than the export's; nothing was "
        f"imported. Move {state / 'admin.token'} aside if this instance should join the "
        "export's cluster (llmgw ctl then needs that cluster's token here too), then import "
        "again"
    )
    assert sorted(p.name for p in state.iterdir()) == ["admin.token"]
    # The same token, or an empty file, is no obstacle.
    (state / "admin.token").write_text(TOKEN + "\n")
    assert installed(tmp_path, export)[2] == Installed(ca=True, token=False)


def test_install_refuses_a_broken_ca_there(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    pki_dir = tmp_path / "new" / "state" / "pki"
    pki_dir.mkdir(parents=True)
    (pki_dir / "ca.key").write_text("half a CA")
    with pytest.raises(CAExportError) as info:
        installed(tmp_path, export)
    message = str(info.value)
    assert message.startswith(f"{pki_dir} holds a CA that cannot be used (")
    assert message.endswith(f"nothing was imported. Move {pki_dir} aside, then import again")
    assert sorted(p.name for p in pki_dir.iterdir()) == ["ca.key"]


def test_install_into_a_directory_without_a_ca_clears_what_is_not_its_own(tmp_path: Path) -> None:
    """A directory without a CA may hold a stranger's rotation files or certificates: the
    old CA they name would be trusted, the certificates are not this instance's."""
    _, export = exported(tmp_path)
    pki_dir = tmp_path / "new" / "state" / "pki"
    stranger = tmp_path / "stranger"
    pki.ensure_server_identity(stranger, hosts=[])
    pki.rotate_ca(stranger, overlap=3600)
    pki_dir.mkdir(parents=True)
    for name in ("server.crt", "server.key", "previous-ca.crt", "ca-cross.crt", "rotation.json"):
        (pki_dir / name).write_bytes((stranger / name).read_bytes())
    installed(tmp_path, export)
    assert sorted(p.name for p in pki_dir.iterdir()) == ["ca.crt", "ca.key", "trust.crt"]
    assert pki.read_rotation(pki_dir) is None


def test_install_of_a_rotation_makes_an_equal_verifier(tmp_path: Path) -> None:
    src, export = exported(tmp_path, rotate=True)
    pki_dir, _, _ = installed(tmp_path, export)
    names = sorted(p.name for p in pki_dir.iterdir())
    assert names == [
        "ca-cross.crt",
        "ca.crt",
        "ca.key",
        "previous-ca.crt",
        "rotation.json",
        "trust.crt",
    ]
    assert mode(pki_dir / "rotation.json") == 0o600
    for name in ("ca-cross.crt", "ca.crt", "previous-ca.crt", "trust.crt"):
        assert mode(pki_dir / name) == 0o644
        assert (pki_dir / name).read_bytes() == (src / name).read_bytes(), name
    assert pki.read_rotation(pki_dir) == pki.read_rotation(src)
    _, server, _ = pki.ensure_server_identity(pki_dir, hosts=[])
    # Its certificate carries the cross-certificate after the leaf, as the source's does.
    chain = pki.load_bundle(server.cert)
    assert [pki.fingerprint(c.public_key()) for c in chain[1:]] == [export.ca_hash]
    assert pki.issued_by(chain[1], pki.load_cert(src / "previous-ca.crt"))


def test_run_as_root_the_files_go_to_the_state_directory_owner(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    state = tmp_path / "new" / "state"
    state.mkdir(parents=True)
    if os.geteuid() == 0:
        os.chown(state, 4242, 4343)
        expected = (4242, 4343)
    else:  # nobody else's: a user's files stay the user's
        expected = (os.getuid(), os.getgid())
    installed(tmp_path, export)
    for path in (state / "pki", *(state / "pki").iterdir(), state / "admin.token"):
        assert (path.stat().st_uid, path.stat().st_gid) == expected, path


def _tree(directory: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry under ``directory`` (itself included): its mode and a file's bytes."""
    found: dict[str, tuple[int, bytes | None]] = {".": (mode(directory), None)}
    for p in sorted(directory.rglob("*")):
        found[str(p.relative_to(directory))] = (
            mode(p),
            p.read_bytes() if p.is_file() else None,
        )
    return found


def test_a_symlinked_pki_directory_is_not_followed(tmp_path: Path) -> None:
    """The control plane's user may have replaced STATE/pki with a link (to /etc, say): run as
    root, the import chmodded the target 0700 and wrote the CA key into it."""
    _, export = exported(tmp_path)
    state = tmp_path / "new" / "state"
    state.mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    (target / "passwd").write_text("root:x:0:0\n")
    before = _tree(target)
    (state / "pki").symlink_to(target)
    with pytest.raises(CAExportError) as info:
        installed(tmp_path, export)
    assert str(info.value) == (
        f"{state / 'pki'} is a symlink or not what it should be (a directory for the PKI, a "
        "file for the rest); the import does not follow links there. Nothing was imported; "
        f"move {state / 'pki'} aside, then import again"
    )
    assert _tree(target) == before
    assert sorted(p.name for p in state.iterdir()) == ["pki"]  # no token written either


def test_symlinks_inside_the_state_directory_are_not_followed(tmp_path: Path) -> None:
    """A linked ca.key (read, or written through) and a linked admin token are refused;
    the files they point at are untouched."""
    _, export = exported(tmp_path)
    state = tmp_path / "new" / "state"
    (state / "pki").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.write_text("not a key\n")
    (state / "pki" / "ca.key").symlink_to(outside)
    with pytest.raises(CAExportError, match=r"pki/ca\.key is a symlink"):
        installed(tmp_path, export)
    (state / "pki" / "ca.key").unlink()
    (state / "admin.token").symlink_to(outside)
    with pytest.raises(CAExportError, match=r"admin\.token is a symlink"):
        installed(tmp_path, export)
    assert outside.read_text() == "not a key\n"
    assert list((state / "pki").iterdir()) == []
