"""The agent bundles the control plane serves, and the join one-liner run for real by sh."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from llmgw.errors import NotFound
from llmgw.server.joining.bundles import Bundle, BundleStore, add_bundle_routes, one_liner
from tests.ci import require_tools
from tests.oneliner import INSTALLER, make_bundle, run_one_liner

TOKEN = "llmgwjt_s3cret-Token"
CA_HASH = "sha256:" + "ab" * 32


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def serve(
    directory: Path, body: Callable[[TestClient[Any, Any], BundleStore], Awaitable[None]]
) -> None:
    async def main() -> None:
        app = web.Application()
        store = add_bundle_routes(app, directory)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await body(client, store)

    asyncio.run(main())


def test_listing_is_empty_without_a_directory_or_bundles(tmp_path: Path) -> None:
    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        response = await client.get("/agent/bundles")
        assert response.status == 200
        assert await response.json() == []
        (tmp_path / "missing").mkdir()
        (tmp_path / "missing" / "notes.txt").write_text("not a bundle")
        (tmp_path / "missing" / "llmgw-agent-0.1.0-linux-riscv64.tar.gz").write_text("no")
        assert await (await client.get("/agent/bundles")).json() == []

    serve(tmp_path / "missing", body)


def test_listing_names_the_newest_bundle_of_each_architecture(tmp_path: Path) -> None:
    make_bundle(tmp_path, "0.1.9", "linux-x64")
    newest_x64 = make_bundle(tmp_path, "0.1.10", "linux-x64")
    make_bundle(tmp_path, "0.1.10rc1", "linux-x64")
    arm64 = make_bundle(tmp_path, "0.1.0", "linux-arm64")

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        response = await client.get("/agent/bundles")
        listing = await response.json()
        base = f"http://127.0.0.1:{client.port}"
        assert listing == [
            {
                "rid": "linux-arm64",
                "url": f"{base}/agent/bundles/linux-arm64.tar.gz",
                "sha256": sha(arm64),
                "size": arm64.stat().st_size,
                "version": "0.1.0",
            },
            {
                "rid": "linux-x64",
                "url": f"{base}/agent/bundles/linux-x64.tar.gz",
                "sha256": sha(newest_x64),
                "size": newest_x64.stat().st_size,
                "version": "0.1.10",
            },
        ]

    serve(tmp_path, body)


def test_download_streams_the_newest_file_with_its_hash(tmp_path: Path) -> None:
    make_bundle(tmp_path, "0.1.0", "linux-x64")
    newest = make_bundle(tmp_path, "0.2.0", "linux-x64")

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        response = await client.get("/agent/bundles/linux-x64.tar.gz")
        assert response.status == 200
        assert await response.read() == newest.read_bytes()
        assert response.headers["Content-Type"] == "application/gzip"
        assert response.headers["X-Llmgw-Bundle-Sha256"] == sha(newest)
        assert response.headers["X-Llmgw-Bundle-Version"] == "0.2.0"
        assert newest.name in response.headers["Content-Disposition"]
        head = await client.head("/agent/bundles/linux-x64.tar.gz")
        assert head.status == 200
        assert int(head.headers["Content-Length"]) == newest.stat().st_size

    serve(tmp_path, body)


def test_missing_bundles_are_404_saying_what_to_copy_where(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    make_bundle(tmp_path, "0.1.0", "linux-x64")

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        response = await client.get("/agent/bundles/linux-arm64.tar.gz")
        assert response.status == 404
        text = await response.text()
        # Anonymous: the answer does not say where this host keeps its bundles ...
        assert str(tmp_path) not in text
        assert await response.json() == {
            "error": {
                "message": "no linux-arm64 bundle on this control plane; its operator "
                "installs the llmgw-agent-bundles package, or copies "
                "llmgw-agent-*-linux-arm64.tar.gz (make dist ARCH=arm64) into the bundle_dir "
                "of server.yaml",
                "code": "not_found",
            }
        }
        # ... the log does, once, for the operator.
        lines = [r for r in caplog.records if r.name == "llmgw.server.bundles"]
        assert len(lines) == 1
        assert lines[0].fields["bundle_dir"] == str(tmp_path)  # type: ignore[attr-defined]
        response = await client.get("/agent/bundles/linux-riscv64.tar.gz")
        assert response.status == 404
        message = (await response.json())["error"]["message"]
        assert message.startswith("no such bundle linux-riscv64.tar.gz")
        assert "linux-x64.tar.gz, linux-arm64.tar.gz" in message

    serve(tmp_path, body)
    assert BundleStore(tmp_path / "empty").missing_message("linux-x64") == (
        "no linux-x64 bundle on this control plane; its operator installs the "
        "llmgw-agent-bundles package, or copies llmgw-agent-*-linux-x64.tar.gz (make dist) "
        "into the bundle_dir of server.yaml"
    )


def test_the_packages_bundles_are_served_beside_the_operators(tmp_path: Path) -> None:
    """The llmgw-agent-bundles package's directory (read-only, the package manager's) is
    served after bundle_dir: the newest version of each architecture wins wherever it is,
    and of one version in both, the operator's copy."""
    operator, packaged = tmp_path / "bundle_dir", tmp_path / "packaged"
    operator.mkdir()
    packaged.mkdir()
    arm64 = make_bundle(packaged, "0.2.0", "linux-arm64")
    x64_packaged = make_bundle(packaged, "0.2.0", "linux-x64")
    make_bundle(operator, "0.1.0", "linux-x64")  # older than the package's: not served
    store = BundleStore(operator, packaged)
    assert [(b.rid, b.version, b.path) for b in store.scan()] == [
        ("linux-arm64", "0.2.0", arm64),
        ("linux-x64", "0.2.0", x64_packaged),
    ]
    # The operator's copy of the same version wins; a newer one of theirs, too.
    same = make_bundle(operator, "0.2.0", "linux-x64", installer=INSTALLER + "# theirs\n")
    assert store.scan()[1].path == same and store.scan()[1].sha256 == sha(same)
    newer = make_bundle(operator, "0.3.0", "linux-x64")
    assert store.scan()[1].path == newer
    # Without the package's directory (none given, or not there): only the operator's.
    assert [b.rid for b in BundleStore(operator).scan()] == ["linux-x64"]
    assert [b.rid for b in BundleStore(operator, tmp_path / "none").scan()] == ["linux-x64"]

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        listing = await (await client.get("/agent/bundles")).json()
        assert [(b["rid"], b["sha256"]) for b in listing] == [("linux-arm64", sha(arm64))]
        download = await client.get("/agent/bundles/linux-arm64.tar.gz")
        assert download.status == 200 and await download.read() == arm64.read_bytes()
        assert download.headers["X-Llmgw-Bundle-Sha256"] == sha(arm64)

    async def main() -> None:
        app = web.Application()
        store = add_bundle_routes(app, tmp_path / "no-bundle-dir", packaged)
        (packaged / x64_packaged.name).unlink()
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            await body(client, store)

    asyncio.run(main())


def test_hashes_are_cached_until_the_file_changes(tmp_path: Path) -> None:
    path = make_bundle(tmp_path, "0.1.0", "linux-x64")
    store = BundleStore(tmp_path)
    first = store.scan()[0].sha256
    assert first == sha(path)
    # Same size, mtime and inode: the cached hash stands (the file is not read again).
    stat = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    with open(path, "r+b") as handle:
        handle.write(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert store.scan()[0].sha256 == first
    # A new mtime (a copy over it): hashed again.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert store.scan()[0].sha256 == sha(path) != first
    path.unlink()
    assert store.scan() == []
    assert store._hashes == {}


# -- the one-liner ------------------------------------------------------------------------------


def bundle_of(path: Path, rid: str, version: str = "0.1.0") -> Bundle:
    return Bundle(rid=rid, version=version, path=path, sha256=sha(path), size=path.stat().st_size)


@pytest.fixture
def one_liner_tools() -> None:
    """What the one-liner runs: curl (or wget) and sha256sum."""
    if not shutil.which("wget"):
        require_tools("curl")
    require_tools("sha256sum")


@pytest.mark.usefixtures("one_liner_tools")
@pytest.mark.parametrize(
    ("machine", "rid", "uid"),
    [("x86_64", "linux-x64", 0), ("aarch64", "linux-arm64", 1000)],
)
def test_one_liner_installs_the_bundle_for_this_machine(
    tmp_path: Path, machine: str, rid: str, uid: int
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    bundles = [
        bundle_of(make_bundle(served, "0.1.0", "linux-x64"), "linux-x64"),
        bundle_of(make_bundle(served, "0.1.0", "linux-arm64"), "linux-arm64"),
    ]

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        command = one_liner(
            f"http://127.0.0.1:{client.port}",
            await store.bundles(),
            node_id="gpu-01",
            enroll_url="https://cp.example.net:8443",
            ca_hash=CA_HASH,
            token=TOKEN,
        )
        assert command == one_liner(
            f"http://127.0.0.1:{client.port}/",
            bundles,
            node_id="gpu-01",
            enroll_url="https://cp.example.net:8443",
            ca_hash=CA_HASH,
            token=TOKEN,
        )
        assert "\n" not in command
        for bundle in bundles:
            assert bundle.sha256 in command
        result = await asyncio.to_thread(run_one_liner, tmp_path, command, machine=machine, uid=uid)
        assert result.returncode == 0, result.stderr
        assert "agent.tar.gz: OK" in result.stdout

    serve(served, body)
    record = tmp_path / "record"
    argv = Path(f"{record}.argv").read_text().splitlines()
    assert argv == [
        "install",
        "--node-id",
        "gpu-01",
        "--enroll-url",
        "https://cp.example.net:8443",
        "--ca-hash",
        CA_HASH,
    ]
    assert Path(f"{record}.token").read_text() == TOKEN
    assert Path(f"{record}.path").read_text().endswith(f"/llmgw-agent-0.1.0-{rid}/install-agent.sh")
    # Not root: through sudo, which got no token on its command line either.
    sudo_argv = Path(f"{record}.sudo")
    if uid == 0:
        assert not sudo_argv.exists()
    else:
        assert TOKEN not in sudo_argv.read_text()
        assert sudo_argv.read_text().splitlines()[0] == "sh"


@pytest.mark.usefixtures("one_liner_tools")
def test_one_liner_refuses_a_bundle_whose_hash_differs_and_unknown_machines(
    tmp_path: Path,
) -> None:
    served = tmp_path / "served"
    served.mkdir()
    genuine = bundle_of(make_bundle(served, "0.1.0", "linux-x64"), "linux-x64")
    # The control plane now serves something else than the command was made for.
    make_bundle(served, "0.1.0", "linux-x64", installer=INSTALLER + "echo tampered\n")

    async def body(client: TestClient[Any, Any], store: BundleStore) -> None:
        command = one_liner(
            f"http://127.0.0.1:{client.port}",
            [genuine],
            node_id="gpu-01",
            enroll_url="https://cp:8443",
            ca_hash=CA_HASH,
        )
        result = await asyncio.to_thread(run_one_liner, tmp_path, command)
        assert result.returncode != 0
        assert "FAILED" in result.stdout + result.stderr
        assert not await asyncio.to_thread(os.path.exists, f"{tmp_path / 'record'}.argv")
        (tmp_path / "bin").rename(tmp_path / "bin-1")
        (tmp_path / "tmp").rmdir()
        result = await asyncio.to_thread(run_one_liner, tmp_path, command, machine="riscv64")
        assert result.returncode == 1
        assert "llmgw: no agent bundle for riscv64 (this control plane has linux-x64)" in (
            result.stderr
        )

    serve(served, body)


def test_one_liner_without_a_token_leaves_it_to_the_installer_prompt(tmp_path: Path) -> None:
    path = make_bundle(tmp_path, "0.1.0", "linux-x64")
    command = one_liner(
        "http://cp:8080",
        [bundle_of(path, "linux-x64")],
        node_id="gpu-01",
        enroll_url="https://cp:8443",
        ca_hash=CA_HASH,
    )
    assert "LLMGW_JOIN_TOKEN=" not in command
    assert "sudo --preserve-env=LLMGW_JOIN_TOKEN" in command
    assert "http://cp:8080/agent/bundles/" in command
    with_token = one_liner(
        "http://cp:8080",
        [bundle_of(path, "linux-x64")],
        node_id="gpu-01",
        enroll_url="https://cp:8443",
        ca_hash=CA_HASH,
        token="it's",
    )
    assert "export LLMGW_JOIN_TOKEN='it'\"'\"'s'" in with_token


def test_one_liner_needs_a_bundle() -> None:
    with pytest.raises(NotFound, match="no agent bundle to join nodes with"):
        one_liner("http://cp:8080", [], node_id="n", enroll_url="https://cp:8443", ca_hash="x")


def test_listing_is_json_serialisable(tmp_path: Path) -> None:
    path = make_bundle(tmp_path, "0.1.0", "linux-x64")
    entry = bundle_of(path, "linux-x64").as_json("http://cp:8080/")
    assert json.loads(json.dumps(entry))["url"] == "http://cp:8080/agent/bundles/linux-x64.tar.gz"


def test_one_liner_checks_the_certificate_unless_told_the_node_cannot_yet(tmp_path: Path) -> None:
    bundle = bundle_of(make_bundle(tmp_path, "0.1.0", "linux-x64"), "linux-x64")
    args: dict[str, Any] = {
        "node_id": "gpu-01",
        "enroll_url": "https://cp:8443",
        "ca_hash": CA_HASH,
    }
    checked = one_liner("https://cp.example.net:8080", [bundle], **args)
    assert "curl -fsSL -o agent.tar.gz https://cp.example.net:8080/agent/bundles/" in checked
    assert "wget -q -O agent.tar.gz https://cp.example.net:8080/agent/bundles/" in checked
    assert "--insecure" not in checked and "--no-check-certificate" not in checked
    # tls: cluster: the node does not trust the cluster CA yet; the SHA-256 is the check.
    unchecked = one_liner("https://cp.example.net:8080", [bundle], verify_tls=False, **args)
    assert "curl -fsSL --insecure -o agent.tar.gz" in unchecked
    assert "wget -q --no-check-certificate -O agent.tar.gz" in unchecked
    assert f"h={bundle.sha256}" in unchecked and "sha256sum -c -" in unchecked


def test_one_liner_quotes_every_value_for_the_shell(tmp_path: Path) -> None:
    bundle = bundle_of(make_bundle(tmp_path, "0.1.0", "linux-x64"), "linux-x64")
    odd = 'it\'s a "node"; $(id) `id` x;id;#'
    command = one_liner(
        "https://cp:8080", [bundle], node_id=odd, enroll_url=odd, ca_hash=odd, token=odd
    )
    check = subprocess.run(["sh", "-n", "-c", command], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for part in (f"export LLMGW_JOIN_TOKEN={shlex.quote(odd)}", f"--node-id {shlex.quote(odd)}"):
        assert part in command
