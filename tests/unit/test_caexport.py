"""Unit tests of llmgw.caexport: the sealed export of the cluster CA, opened with the right
passphrase only, refused when altered or of an unknown format, and installed into a PKI
directory (and refused there when another CA or admin token is in the way)."""

from __future__ import annotations

import base64
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from llmgw import caexport, pki
from llmgw.caexport import KDF, CAExport, Installed
from llmgw.errors import CAExportError, ConfigError

pytestmark = pytest.mark.usefixtures("open_umask")

# The cheapest cost a file may ask for: these tests seal many times.
FAST = KDF(n=2**14, r=8, p=1)
PASS = "correct horse battery"
TOKEN = "llmgw-admin-t0ken"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def snapshot(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns, mode(p))
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def exported(tmp: Path, *, rotate: bool = False, cluster: str = "c-1") -> tuple[Path, CAExport]:
    d = tmp / "source" / "pki"
    pki.ensure_server_identity(d, hosts=["cp-1.example"])
    if rotate:
        pki.rotate_ca(d, overlap=3600)
    ca = pki.load_ca(d)
    return d, caexport.collect(d, ca, cluster_id=cluster, admin_token=TOKEN)


def sealed(tmp: Path, **kw: Any) -> tuple[CAExport, bytes]:
    _, export = exported(tmp, **kw)
    return export, caexport.seal(export, PASS, kdf=FAST)


def edit(data: bytes, **changes: Any) -> bytes:
    obj = json.loads(data)
    obj.update(changes)
    return json.dumps(obj).encode()


def flip(b64: str) -> str:
    raw = bytearray(base64.b64decode(b64))
    raw[len(raw) // 2] ^= 0x01
    return base64.b64encode(bytes(raw)).decode()


# --------------------------------------------------------------------------- sealing


def test_round_trip_keeps_everything_and_shows_the_ca_in_clear(tmp_path: Path) -> None:
    export, data = sealed(tmp_path)
    header = json.loads(data)
    assert header["format"] == "llmgw-ca-export/1"
    assert header["ca_hash"] == export.ca_hash
    assert header["cluster_id"] == "c-1"
    assert header["kdf"]["name"] == "scrypt" and header["kdf"]["n"] == FAST.n
    # Neither the key nor the token is readable in the file.
    assert b"PRIVATE KEY" not in data and TOKEN.encode() not in data
    back = caexport.unseal(data, PASS, source="f.llmgw")
    assert back.to_json() == export.to_json()
    assert (back.cluster_id, back.admin_token, back.rotation) == ("c-1", TOKEN, None)
    assert pki.key_pem(back.ca_key) == pki.key_pem(export.ca_key)
    # A fresh salt and nonce every time.
    again = json.loads(caexport.seal(export, PASS, kdf=FAST))
    assert again["kdf"]["salt"] != header["kdf"]["salt"]
    assert again["nonce"] != header["nonce"]
    assert again["ciphertext"] != header["ciphertext"]


def test_the_default_cost_is_scrypt_2_17(tmp_path: Path) -> None:
    _, export = exported(tmp_path)
    data = caexport.seal(export, PASS)
    assert json.loads(data)["kdf"] | {"salt": "-"} == {
        "name": "scrypt",
        "n": 2**17,
        "r": 8,
        "p": 1,
        "salt": "-",
    }
    assert caexport.unseal(data, PASS, source="f").ca_hash == export.ca_hash


def test_a_wrong_passphrase_is_told_apart(tmp_path: Path) -> None:
    _, data = sealed(tmp_path)
    with pytest.raises(CAExportError) as info:
        caexport.unseal(data, PASS + "!", source="ca.llmgw")
    assert str(info.value) == (
        "wrong passphrase for ca.llmgw (or its header was altered); nothing was imported. Give "
        "the passphrase it was exported with (LLMGW_CA_PASSPHRASE or the prompt), or export "
        "the CA again"
    )


ALTERED = (
    "ca.llmgw was altered or damaged after its export (the passphrase is right, but its "
    "contents fail their check); nothing was imported. Export the CA again"
)


@pytest.mark.parametrize(
    "field",
    ["ca_hash", "cluster_id", "exported_at", "nonce", "ciphertext"],
)
def test_an_altered_header_or_ciphertext_fails_the_check(tmp_path: Path, field: str) -> None:
    _, data = sealed(tmp_path)
    obj = json.loads(data)
    value = obj[field]
    changed = {
        "ca_hash": "sha256:" + "0" * 64,
        "cluster_id": "another",
        "exported_at": value + 1 if isinstance(value, int) else value,
        "nonce": flip(obj["nonce"]),
        "ciphertext": flip(obj["ciphertext"]),
    }[field]
    with pytest.raises(CAExportError) as info:
        caexport.unseal(edit(data, **{field: changed}), PASS, source="ca.llmgw")
    assert str(info.value) == ALTERED


def test_an_altered_salt_or_cost_reads_as_a_wrong_passphrase(tmp_path: Path) -> None:
    _, data = sealed(tmp_path)
    kdf = json.loads(data)["kdf"]
    for changed in ({**kdf, "salt": flip(kdf["salt"])}, {**kdf, "n": 2**15}):
        with pytest.raises(CAExportError, match=r"^wrong passphrase for f \(or its header"):
            caexport.unseal(edit(data, kdf=changed), PASS, source="f")


def test_a_cut_or_reformatted_file(tmp_path: Path) -> None:
    _, data = sealed(tmp_path)
    # Whitespace is not part of what is checked: the header's canonical JSON is.
    compact = json.dumps(json.loads(data), separators=(",", ":")).encode()
    assert caexport.unseal(compact, PASS, source="f").ca_hash
    with pytest.raises(CAExportError) as info:
        caexport.unseal(data[: len(data) // 2], PASS, source="f")
    assert str(info.value) == (
        "f is not a readable CA export (it is not JSON); nothing was imported. Use the file "
        "'llmgw ctl cert export-ca' wrote, unchanged, or export the CA again"
    )


def test_an_unknown_format_version_says_which_release_reads_it(tmp_path: Path) -> None:
    _, data = sealed(tmp_path)
    with pytest.raises(CAExportError) as info:
        caexport.read_header(edit(data, format="llmgw-ca-export/2"), source="f")
    assert str(info.value) == (
        "f is a CA export of format llmgw-ca-export/2, which this llmgw cannot read (it reads "
        "llmgw-ca-export/1); nothing was imported. Import it with the llmgw release that "
        "exported it, or a newer one"
    )
    with pytest.raises(CAExportError, match=r"its format is 'pem', not llmgw-ca-export/1"):
        caexport.unseal(edit(data, format="pem"), PASS, source="f")
    with pytest.raises(CAExportError, match=r"\(it names no format\)"):
        caexport.unseal(b"[1, 2]", PASS, source="f")


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"extra": 1}, "unexpected or missing field(s): extra"),
        ({"check": None}, "its header is malformed"),
        ({"nonce": "not base64!"}, "its header is malformed"),
        ({"exported_at": True}, "its header is malformed"),
        ({"cipher": "aes-128-cbc"}, "its cipher, nonce or salt is not one llmgw makes"),
        ({"kdf": {"name": "scrypt", "n": 2**30, "r": 8, "p": 1, "salt": "AAAAAAAAAAAAAAAAAAAAAA=="}},
         "its scrypt cost n=1073741824 r=8 p=1 is outside what llmgw makes"),
        ({"kdf": {"name": "scrypt", "n": 3 * 2**14, "r": 8, "p": 1, "salt": "AAAAAAAAAAAAAAAAAAAAAA=="}},
         "its scrypt cost n=49152 r=8 p=1 is outside what llmgw makes"),
        ({"kdf": {"name": "pbkdf2", "n": 2**14, "r": 8, "p": 1, "salt": "AAAAAAAAAAAAAAAAAAAAAA=="}},
         "its header is malformed"),
    ],
)  # fmt: skip
def test_a_header_llmgw_does_not_make_is_refused_before_any_work(
    tmp_path: Path, changes: dict[str, Any], words: str
) -> None:
    _, data = sealed(tmp_path)
    with pytest.raises(CAExportError) as info:
        caexport.read_header(edit(data, **changes), source="f")
    assert f"f is not a readable CA export ({words}); nothing was imported" in str(info.value)


def test_missing_ciphertext_is_named(tmp_path: Path) -> None:
    _, data = sealed(tmp_path)
    obj = json.loads(data)
    del obj["ciphertext"]
    with pytest.raises(CAExportError, match=r"unexpected or missing field\(s\): ciphertext"):
        caexport.read_header(json.dumps(obj).encode(), source="f")


@pytest.mark.parametrize("passphrase", ["", "short", "x" * 11, None, 123456789012])
def test_a_short_passphrase_seals_nothing(tmp_path: Path, passphrase: Any) -> None:
    _, export = exported(tmp_path)
    with pytest.raises(ConfigError) as info:
        caexport.seal(export, passphrase, kdf=FAST)
    assert str(info.value) == (
        "the passphrase of a CA export must have at least 12 characters (it alone protects "
        "the CA key in the file); nothing was exported. Choose a longer one"
    )
    assert caexport.check_passphrase("x" * 12) == "x" * 12


def test_a_file_far_larger_than_an_export_is_not_read(tmp_path: Path) -> None:
    big = tmp_path / "big"
    big.write_bytes(b" " * (caexport.MAX_EXPORT + 1))
    with pytest.raises(CAExportError, match="it is larger than 1048576 bytes"):
        caexport.read_export(big)
    with pytest.raises(Exception, match=r"cannot read .*nope: No such file or directory"):
        caexport.read_export(tmp_path / "nope")


# --------------------------------------------------------------------------- what it holds


def test_during_a_rotation_the_old_ca_and_cross_certificate_go_along_but_not_its_key(
    tmp_path: Path,
) -> None:
    src, export = exported(tmp_path, rotate=True)
    rotation = pki.read_rotation(src)
    assert rotation is not None
    assert export.rotation == rotation
    assert export.previous_ca_cert is not None and export.cross_cert is not None
    assert pki.fingerprint(export.previous_ca_cert.public_key()) == rotation.previous
    payload = json.dumps(export.to_json())
    old_key = pki.key_pem(pki._load_key(src / pki.PREVIOUS_CA_KEY)).decode()
    assert old_key not in payload
    back = caexport.unseal(caexport.seal(export, PASS, kdf=FAST), PASS, source="f")
    assert back.to_json() == export.to_json()


def test_a_finished_rotation_goes_along_as_a_record_only(tmp_path: Path) -> None:
    src, _ = exported(tmp_path, rotate=True)
    pki.finish_rotation(src)
    export = caexport.collect(src, pki.load_ca(src), cluster_id="c", admin_token=TOKEN)
    assert export.rotation is not None and not export.rotation.active
    assert export.previous_ca_cert is None and export.cross_cert is None


def test_collect_refuses_a_rotation_whose_files_do_not_fit(tmp_path: Path) -> None:
    src, _ = exported(tmp_path, rotate=True)
    stranger = pki.init_ca(tmp_path / "stranger")
    (src / pki.PREVIOUS_CA_CERT).write_bytes(pki.cert_pem(stranger.cert))
    with pytest.raises(CAExportError) as info:
        caexport.collect(src, pki.load_ca(src), cluster_id="c", admin_token=TOKEN)
    rotation = pki.read_rotation(src)
    assert rotation is not None
    assert str(info.value) == (
        f"the CA in {src} cannot be exported: the old CA is not {rotation.previous}, the one "
        "the rotation replaced; nothing was exported. If a CA rotation just ran, export "
        "again; else restore the directory from a backup"
    )


# --------------------------------------------------------------------------- installing


def installed(tmp: Path, export: CAExport) -> tuple[Path, Path, Installed]:
    state = tmp / "new" / "state"
    done = caexport.install(export, pki_dir=state / "pki", token_file=state / "admin.token")
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
