"""``llmgw server --import-ca``: the CA of another instance installed into this one's state
directory, through click's test runner (exact user-visible text and exit codes); every
refusal writes nothing."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import click
import pytest
import yaml
from click.testing import CliRunner, Result

from llmgw import caexport, pki
from llmgw.cli import main, prompts
from llmgw.cli.server import server

PASSPHRASE = "a long passphrase"
TOKEN = "llmgw-admin-shared"


def snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    if not directory.exists():
        return {}
    return {
        str(p.relative_to(directory)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def export_file(tmp_path: Path) -> Path:
    src = tmp_path / "first" / "pki"
    pki.ensure_server_identity(src, hosts=[])
    export = caexport.collect(src, pki.load_ca(src), cluster_id="c-7", admin_token=TOKEN)
    path = tmp_path / "ca.llmgw"
    path.write_bytes(caexport.seal(export, PASSPHRASE, kdf=caexport.KDF(n=2**14)))
    return path


@pytest.fixture
def config(tmp_path: Path) -> Path:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))
    return cfg


def ca_hash(export_file: Path) -> str:
    return str(json.loads(export_file.read_bytes())["ca_hash"])


def import_ca(
    config: Path, export_file: Path, passphrase: str | None = PASSPHRASE, *more: str
) -> Result:
    env = {"LLMGW_CA_PASSPHRASE": passphrase}
    args = ["server", "--config", str(config), "--import-ca", str(export_file), *more]
    return CliRunner().invoke(main, args, env=env)


def test_import_writes_the_ca_and_token_and_says_what_next(
    tmp_path: Path, config: Path, export_file: Path
) -> None:
    result = import_ca(config, export_file)
    state = tmp_path / "state"
    assert (result.exit_code, result.stderr) == (0, ""), result.output
    assert result.stdout == (
        f"imported CA {ca_hash(export_file)} of cluster c-7 into {state / 'pki'}\n"
        f"admin token: written to {state / 'admin.token'}\n"
        f"delete {export_file} now (and the copy on the instance it came from): its passphrase "
        "alone protects the CA key\n"
        "this instance makes its own server and client certificates at its first start; start "
        "the control plane: systemctl start llmgw-server\n"
    )
    assert pki.load_ca(state / "pki").ca_hash() == ca_hash(export_file)
    assert stat.S_IMODE(os.stat(state / "pki" / "ca.key").st_mode) == 0o600
    assert stat.S_IMODE(os.stat(state / "pki" / "ca.crt").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(state / "admin.token").st_mode) == 0o600
    assert (state / "admin.token").read_text() == TOKEN + "\n"
    # Again: nothing to do, and it says so.
    before = snapshot(state)
    result = import_ca(config, export_file)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == [
        f"this instance already has CA {ca_hash(export_file)} (in {state / 'pki'}); unchanged",
        f"admin token: {state / 'admin.token'} holds it already; unchanged",
    ]
    assert snapshot(state) == before


def test_state_dir_and_admin_token_file_are_the_running_servers(
    tmp_path: Path, export_file: Path
) -> None:
    cfg = tmp_path / "other.yaml"
    cfg.write_text(yaml.safe_dump({"admin_token_file": str(tmp_path / "etc" / "token")}))
    result = import_ca(cfg, export_file, PASSPHRASE, "--state-dir", str(tmp_path / "s2"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s2" / "pki" / "ca.key").exists()
    assert (tmp_path / "etc" / "token").read_text() == TOKEN + "\n"
    assert not (tmp_path / "s2" / "admin.token").exists()


def test_a_wrong_passphrase_writes_nothing(tmp_path: Path, config: Path, export_file: Path) -> None:
    result = import_ca(config, export_file, "not the passphrase")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: wrong passphrase for {export_file} (or its header was altered); nothing was "
        "imported. Give the passphrase it was exported with (LLMGW_CA_PASSPHRASE or the "
        "prompt), or export the CA again\n"
    )
    assert not (tmp_path / "state").exists()


def test_a_tampered_file_writes_nothing(tmp_path: Path, config: Path, export_file: Path) -> None:
    obj = json.loads(export_file.read_bytes())
    obj["cluster_id"] = "c-8"
    export_file.write_text(json.dumps(obj))
    result = import_ca(config, export_file)
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: {export_file} was altered or damaged after its export (the passphrase is "
        "right, but its contents fail their check); nothing was imported. Export the CA again\n"
    )
    assert not (tmp_path / "state").exists()


def test_an_unknown_format_is_refused_before_the_passphrase_is_asked(
    tmp_path: Path, config: Path, export_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    obj = json.loads(export_file.read_bytes())
    export_file.write_text(json.dumps({**obj, "format": "llmgw-ca-export/9"}))
    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(prompts.getpass, "getpass", lambda prompt: pytest.fail("asked"))
    result = import_ca(config, export_file, None)
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: {export_file} is a CA export of format llmgw-ca-export/9, which this llmgw "
        "cannot read"
    )
    assert not (tmp_path / "state").exists()


def test_the_passphrase_is_asked_once_in_a_terminal(
    tmp_path: Path, config: Path, export_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(prompts.getpass, "getpass", lambda p: asked.append(p) or PASSPHRASE)
    result = import_ca(config, export_file, None)
    assert result.exit_code == 0, result.output
    assert asked == [f"passphrase of {export_file} (not echoed): "]


def test_without_a_terminal_or_variable_it_says_how(
    tmp_path: Path, config: Path, export_file: Path
) -> None:
    result = import_ca(config, export_file, None)
    assert result.exit_code == 2
    assert result.stderr == (
        "error: no passphrase of the CA export: set LLMGW_CA_PASSPHRASE or run in a terminal "
        "to be prompted; never pass it as an argument\n"
    )
    assert not (tmp_path / "state").exists()


def test_another_ca_or_token_here_is_refused_and_nothing_written(
    tmp_path: Path, config: Path, export_file: Path
) -> None:
    state = tmp_path / "state"
    mine = pki.init_ca(state / "pki")
    before = snapshot(state)
    result = import_ca(config, export_file)
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == (
        f"error: this instance already has CA {mine.ca_hash()} (in {state / 'pki'}); the "
        f"export is {ca_hash(export_file)}, of another cluster or of a CA rotated since. "
        f"Nothing was imported; move {state / 'pki'} aside if this instance should join that "
        "cluster (it makes its own certificates at start), then import again\n"
    )
    assert snapshot(state) == before
    (state / "pki").rename(tmp_path / "pki.aside")
    (state / "admin.token").write_text("llmgw-admin-mine\n")
    before = snapshot(state)
    result = import_ca(config, export_file)
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"error: {state / 'admin.token'} holds another admin token than the export's; nothing "
        "was imported."
    )
    assert snapshot(state) == before and not (state / "pki").exists()


def test_a_missing_file_and_a_subcommand_beside_it(
    tmp_path: Path, config: Path, export_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result = import_ca(config, tmp_path / "nope.llmgw")
    assert result.exit_code == 1
    assert result.stderr == (
        f"error: cannot read {tmp_path / 'nope.llmgw'}: No such file or directory; give the "
        "file 'llmgw ctl cert export-ca' wrote, readable by this user\n"
    )

    ran: list[str] = []

    @click.command("verb")
    def verb() -> None:
        ran.append("verb")

    monkeypatch.setitem(server.commands, "verb", verb)
    result = CliRunner().invoke(
        main, ["server", "--config", str(config), "--import-ca", str(export_file), "verb"]
    )
    assert result.exit_code == 2
    assert "Error: --import-ca runs alone, not with 'verb'" in result.stderr
    assert ran == [] and not (tmp_path / "state").exists()
