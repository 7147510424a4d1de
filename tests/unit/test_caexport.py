"""Unit tests of llmgw.caexport: the sealed export of the cluster CA, opened with the right
passphrase only, refused when altered or of an unknown format (its installing:
tests/unit/test_caimport.py)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from llmgw import caexport, pki
from llmgw.caexport import KDF, CAExport
from llmgw.errors import CAExportError, ConfigError
from llmgw.pki.certs import load_key
from tests.unit.caexport_rig import TOKEN, exported

pytestmark = pytest.mark.usefixtures("open_umask")

# The cheapest cost a file may ask for: these tests seal many times.
FAST = KDF(n=2**14, r=8, p=1)
PASS = "correct horse battery"


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
    old_key = pki.key_pem(load_key(src / pki.PREVIOUS_CA_KEY)).decode()
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
