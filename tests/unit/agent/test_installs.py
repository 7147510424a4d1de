"""install_engine against a real HTTP publisher on 127.0.0.1, with archives built here."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import json
import os
import re
import stat
import tarfile
import zipfile
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp import web

from llmgw.agent.discovery import ENGINE_MANIFEST
from llmgw.agent.installs import install_engine, remove_leftovers
from llmgw.contracts.sources import parse_prefix
from llmgw.errors import EngineError
from llmgw.proto import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)

GOOD_SERVER = b"""#!/bin/sh
case "$1" in
  --version) echo "version: 4242 (deadbeef)"; echo "built with cc for x86_64-linux-gnu" ;;
  *) echo "usage: llama-server [options]" ;;
esac
exit 0
"""
BROKEN_SERVER = b"""#!/bin/sh
echo "llama-server: error while loading shared libraries: libcuda.so.1: cannot open shared \
object file: No such file or directory" >&2
exit 127
"""
FAKE_PYTHON = b"""#!/bin/sh
echo "0.4.1"
exit 0
"""

Member = tuple[tarfile.TarInfo, bytes | None]


# -- archives ----------------------------------------------------------------------------


def entry(
    name: str,
    data: bytes | None = None,
    *,
    mode: int = 0o644,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> Member:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.linkname = link
    info.mtime = 1_700_000_000
    if kind == tarfile.DIRTYPE:
        info.mode = 0o755
    if data is not None:
        info.size = len(data)
    return info, data


def tarball(members: list[Member], compression: str = "gz") -> bytes:
    buf = io.BytesIO()
    mode = f"w:{compression}" if compression else "w"
    with tarfile.open(fileobj=buf, mode=mode) as tf:
        for info, data in members:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def llamacpp_members(script: bytes = GOOD_SERVER) -> list[Member]:
    return [
        entry("llama-b4242", kind=tarfile.DIRTYPE),
        entry("llama-b4242/bin", kind=tarfile.DIRTYPE),
        entry("llama-b4242/bin/llama-server", script, mode=0o755),
        entry("llama-b4242/lib/libllama.so", b"\x7fELF not really", mode=0o777),
        entry("llama-b4242/lib/libllama.so.1", kind=tarfile.SYMTYPE, link="libllama.so"),
        entry(
            "llama-b4242/lib/libllama.so.1.0",
            kind=tarfile.LNKTYPE,
            link="llama-b4242/lib/libllama.so",
        ),
        entry("llama-b4242/share/doc/README", b"hello\n", mode=0o4666),
        # A deeper file of the same name: the shortest path wins.
        entry("llama-b4242/examples/server/llama-server", b"#!/bin/sh\nexit 1\n", mode=0o755),
    ]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def order(name: str, data: bytes, base: str, **fields: Any) -> pb.InstallEngine:
    values: dict[str, Any] = {
        "engine": "llamacpp",
        "version": "b4242",
        "url": f"{base}/files/{name}",
        "sha256": sha(data),
        "arch": "",
    }
    values.update(fields)
    return pb.InstallEngine(**values)


# -- the publisher -----------------------------------------------------------------------


class Publisher:
    """Serves ``files`` under /files/NAME and counts every request by name."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: Counter[str] = Counter()
        self.release = asyncio.Event()
        self.slow_started = asyncio.Event()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.requests[name] += 1
        if name == "slow.tar.gz":
            response = web.StreamResponse()
            await response.prepare(request)
            await response.write(b"\x1f\x8b")
            self.slow_started.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), 10)
            return response
        if name not in self.files:
            raise web.HTTPNotFound()
        if name.startswith("chunked-"):
            # No Content-Length: the size cap must hold while streaming.
            response = web.StreamResponse()
            response.enable_chunked_encoding()
            await response.prepare(request)
            data = self.files[name]
            for start in range(0, len(data), 512):
                await response.write(data[start : start + 512])
            await response.write_eof()
            return response
        return web.Response(body=self.files[name], content_type="application/octet-stream")

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        app = web.Application()
        app.router.add_get("/files/{name}", self.handle)
        runner = web.AppRunner(app, shutdown_timeout=2.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            self.release.set()
            await runner.cleanup()


Scenario = Callable[[Publisher, str, Path], Awaitable[None]]


def run(tmp_path: Path, scenario: Scenario) -> None:
    async def main() -> None:
        publisher = Publisher()
        async with publisher.running() as base:
            await asyncio.wait_for(scenario(publisher, base, tmp_path / "state"), 30)

    asyncio.run(main())


def assert_nothing_left(state: Path) -> None:
    root = state / "engines"
    assert sorted(p.name for p in root.iterdir()) == []
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def install(want: pb.InstallEngine, **kwargs: Any) -> Awaitable[pb.EngineInfo]:
    """install_engine with the order's own http://host:port/ listed in install_sources (as an
    operator serving builds on the local network would)."""
    parts = urlsplit(want.url)
    if parts.scheme == "http":
        kwargs.setdefault("sources", (parse_prefix(f"http://{parts.hostname}:{parts.port}/"),))
    return install_engine(want, **kwargs)


async def refused(coro: Awaitable[pb.EngineInfo]) -> str:
    with pytest.raises(EngineError) as caught:
        await coro
    return str(caught.value)


# -- installs that work ------------------------------------------------------------------


def test_tarball_installs_writes_manifest_and_is_idempotent(tmp_path: Path) -> None:
    data = tarball(llamacpp_members())

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama-b4242-bin-ubuntu-x64.tar.gz"] = data
        want = order("llama-b4242-bin-ubuntu-x64.tar.gz", data, base, arch="amd64")
        info = await install(want, state_dir=state, arch="x86_64")

        final = state / "engines" / "llamacpp" / "b4242"
        assert info.ok
        assert info.name == "llamacpp"
        assert info.path == str(final / "llama-b4242" / "bin" / "llama-server")
        assert info.version
        manifest = json.loads((final / ENGINE_MANIFEST).read_text())
        assert manifest["engine"] == "llamacpp"
        assert manifest["version"] == "b4242"
        assert manifest["binary"] == "llama-b4242/bin/llama-server"
        assert manifest["sha256"] == sha(data)
        assert manifest["url"] == want.url
        assert manifest["installed_at"]
        assert set(manifest) == {"engine", "version", "binary", "sha256", "installed_at", "url"}

        assert os.access(info.path, os.X_OK)
        lib = final / "llama-b4242" / "lib"
        assert os.readlink(lib / "libllama.so.1") == "libllama.so"
        assert (lib / "libllama.so.1.0").stat().st_ino == (lib / "libllama.so").stat().st_ino
        readme = stat.S_IMODE((final / "llama-b4242" / "share" / "doc" / "README").stat().st_mode)
        assert readme & (stat.S_ISUID | stat.S_IWGRP | stat.S_IWOTH) == 0
        for path in final.rglob("*"):
            if not path.is_symlink():
                assert path.stat().st_mode & stat.S_IWOTH == 0, path
        root = state / "engines"
        assert stat.S_IMODE(root.stat().st_mode) == 0o700
        assert sorted(p.name for p in root.iterdir()) == ["llamacpp"]
        assert pub.requests["llama-b4242-bin-ubuntu-x64.tar.gz"] == 1

        again = await install(want, state_dir=state, arch="x86_64")
        assert again == info
        assert pub.requests["llama-b4242-bin-ubuntu-x64.tar.gz"] == 1

    run(tmp_path, scenario)


def test_zip_installs_and_keeps_executable_bits(tmp_path: Path) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        server = zipfile.ZipInfo("build/bin/llama-server")
        server.external_attr = (stat.S_IFREG | 0o755) << 16
        zf.writestr(server, GOOD_SERVER)
        link = zipfile.ZipInfo("build/bin/server")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "llama-server")
        zf.writestr("build/README.md", "hi\n")
    data = buf.getvalue()

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.zip"] = data
        info = await install(order("llama.zip", data, base), state_dir=state)
        final = state / "engines" / "llamacpp" / "b4242"
        assert info.ok
        assert info.path == str(final / "build" / "bin" / "llama-server")
        assert stat.S_IMODE(os.stat(info.path).st_mode) == 0o755
        assert os.readlink(final / "build" / "bin" / "server") == "llama-server"
        assert stat.S_IMODE((final / "build" / "README.md").stat().st_mode) & 0o111 == 0

    run(tmp_path, scenario)


def test_sglang_environment_checks_its_python(tmp_path: Path) -> None:
    data = tarball(
        [
            entry(".", kind=tarfile.DIRTYPE),
            entry("./sglang-env/bin/python3.11", FAKE_PYTHON, mode=0o755),
            entry("./sglang-env/bin/python", kind=tarfile.SYMTYPE, link="python3.11"),
            entry("./sglang-env/lib/python3.11/site-packages/sglang/__init__.py", b""),
        ],
        compression="xz",
    )

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["sglang-0.4.1.tar.xz"] = data
        want = order("sglang-0.4.1.tar.xz", data, base, engine="sglang", version="0.4.1")
        info = await install(want, state_dir=state)
        assert info.ok
        assert info.path == str(state / "engines" / "sglang" / "0.4.1" / "sglang-env/bin/python")
        manifest = json.loads(Path(info.path).parents[2].joinpath(ENGINE_MANIFEST).read_text())
        assert manifest["binary"] == "sglang-env/bin/python"

    run(tmp_path, scenario)


def test_vllm_environment_uses_its_vllm_script(tmp_path: Path) -> None:
    data = tarball(
        [
            entry("vllm-env/lib/python3.11/site-packages/vllm/__init__.py", b""),
            entry("vllm-env/lib/python3.11/site-packages/vllm/entrypoints/vllm", b""),
            entry("vllm-env/bin/vllm", b"#!/bin/sh\necho 0.6.3\n", mode=0o755),
        ]
    )

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["vllm.tgz"] = data
        want = order("vllm.tgz", data, base, engine="vllm", version="0.6.3+cu124")
        info = await install(want, state_dir=state)
        assert info.ok
        assert info.version == "0.6.3"
        assert info.path == str(state / "engines/vllm/0.6.3+cu124/vllm-env/bin/vllm")

    run(tmp_path, scenario)


def test_chunked_download_without_suffix_is_sniffed(tmp_path: Path) -> None:
    data = tarball(llamacpp_members())

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["chunked-latest"] = data
        info = await install(order("chunked-latest", data, base), state_dir=state)
        assert info.ok

    run(tmp_path, scenario)


# -- refusals that leave nothing behind ---------------------------------------------------


def test_tampered_archive_is_refused_and_deleted(tmp_path: Path) -> None:
    data = tarball(llamacpp_members())
    tampered = data[:-10] + bytes(10)

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = tampered
        want = order("llama.tar.gz", data, base)
        message = await refused(install(want, state_dir=state))
        assert message.startswith(
            f"checksum mismatch for {want.url}: the download is not the build the order's "
            "SHA-256 names; it was deleted"
        )
        # The control plane hears nothing of what was fetched: not its digest, not its size.
        # The URL is said, and its random port may hold the size's digits: leave it out.
        said = message.replace(want.url, "URL")
        assert sha(tampered) not in said
        assert re.search(rf"(?<!\d){len(tampered)}(?!\d)", said) is None
        assert_nothing_left(state)

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("member", "expected"),
    [
        (entry("../evil", b"x"), "member '../evil' has a '..' component"),
        (entry("llama/../../evil", b"x"), "member 'llama/../../evil' has a '..' component"),
        (entry("/tmp/llmgw-abs-evil", b"x"), "member '/tmp/llmgw-abs-evil' has an absolute path"),
        (
            entry("llama/lib/escape", kind=tarfile.SYMTYPE, link="../../../outside"),
            "member 'llama/lib/escape' is a symlink to '../../../outside', outside the install",
        ),
        (
            entry("llama/lib/passwd", kind=tarfile.SYMTYPE, link="/etc/passwd"),
            "member 'llama/lib/passwd' is a symlink to '/etc/passwd', outside the install",
        ),
        (
            entry("llama/passwd", kind=tarfile.LNKTYPE, link="/etc/passwd"),
            "member 'llama/passwd' is a hard link to '/etc/passwd', outside the install",
        ),
        (
            entry("llama/up", kind=tarfile.LNKTYPE, link="../outside"),
            "member 'llama/up' is a hard link to '../outside', outside the install",
        ),
        (entry("llama/pipe", kind=tarfile.FIFOTYPE), "member 'llama/pipe' is a fifo"),
        (entry("llama/null", kind=tarfile.CHRTYPE), "member 'llama/null' is a device file"),
    ],
    ids=[
        "dotdot",
        "nested-dotdot",
        "absolute",
        "symlink-up",
        "symlink-abs",
        "hardlink-passwd",
        "hardlink-up",
        "fifo",
        "chardev",
    ],
)
def test_unsafe_tar_member_is_refused(tmp_path: Path, member: Member, expected: str) -> None:
    data = tarball([*llamacpp_members(), member])

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        message = await refused(install(order("llama.tar.gz", data, base), state_dir=state))
        assert expected in message
        assert "unsafe and was deleted" in message
        assert_nothing_left(state)

    run(tmp_path, scenario)
    assert not (tmp_path / "evil").exists()
    assert not (tmp_path / "state" / "evil").exists()
    assert not os.path.lexists("/tmp/llmgw-abs-evil")


def test_symlink_chain_escaping_through_an_earlier_link_is_refused(tmp_path: Path) -> None:
    # Each link looks inside on its own; followed on disk, "e" is the folder's parent.
    data = tarball(
        [
            *llamacpp_members(),
            entry("d", kind=tarfile.DIRTYPE),
            entry("d/l", kind=tarfile.SYMTYPE, link=".."),
            entry("e", kind=tarfile.SYMTYPE, link="d/l/.."),
            entry("e/evil", b"x"),
        ]
    )

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar"] = data
        message = await refused(install(order("llama.tar", data, base), state_dir=state))
        assert "member 'e' is a symlink to 'd/l/..', outside the install folder" in message
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_unsafe_zip_members_are_refused(tmp_path: Path) -> None:
    def zipped(name: str, attr: int = 0, data: bytes = b"x") -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w") as zf:
            zf.writestr("build/bin/llama-server", GOOD_SERVER)
            info = zipfile.ZipInfo(name)
            info.external_attr = attr << 16
            zf.writestr(info, data)
        return buf.getvalue()

    cases = [
        (zipped("../evil"), "member '../evil' has a '..' component"),
        (zipped("/abs-evil"), "member '/abs-evil' has an absolute path"),
        (
            zipped("build/up", stat.S_IFLNK | 0o777, b"../../x"),
            "member 'build/up' is a symlink to '../../x', outside the install folder",
        ),
    ]

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        for index, (data, expected) in enumerate(cases):
            name = f"bad{index}.zip"
            pub.files[name] = data
            message = await refused(install(order(name, data, base), state_dir=state))
            assert expected in message
            assert_nothing_left(state)

    run(tmp_path, scenario)


def test_engine_that_will_not_run_is_refused_with_its_error(tmp_path: Path) -> None:
    data = tarball(llamacpp_members(BROKEN_SERVER))

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        message = await refused(install(order("llama.tar.gz", data, base), state_dir=state))
        assert message.startswith("llamacpp b4242 from ")
        assert "does not run on this node" in message
        assert "libcuda.so.1: cannot open shared object file" in message
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_archive_without_the_binary_is_refused(tmp_path: Path) -> None:
    data = tarball([entry("llama/bin/llama-cli", GOOD_SERVER, mode=0o755)])

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        message = await refused(install(order("llama.tar.gz", data, base), state_dir=state))
        assert "holds no llamacpp engine: expected a file named 'llama-server'" in message
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_wrong_arch_is_refused_before_downloading(tmp_path: Path) -> None:
    data = tarball(llamacpp_members())

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        want = order("llama.tar.gz", data, base, arch="arm64")
        message = await refused(install(want, state_dir=state, arch="amd64"))
        assert "the order is for arm64 but this node is x86_64" in message
        assert "send the build for x86_64" in message
        assert pub.requests["llama.tar.gz"] == 0
        assert not (state / "engines").exists()

    run(tmp_path, scenario)


def test_http_404_is_refused(tmp_path: Path) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        want = order("missing.tar.gz", b"whatever", base)
        message = await refused(install(want, state_dir=state))
        assert message.startswith(f"download of {want.url} failed; the agent's log on the node")
        # The URL is said; its random port (40497 once) must not count as a leak.
        said = message.replace(want.url, "URL")
        assert "404" not in said and "Not Found" not in said
        assert pub.requests["missing.tar.gz"] == 1
        assert_nothing_left(state)

    run(tmp_path, scenario)


@pytest.mark.parametrize("name", ["big.tar.gz", "chunked-big.tar.gz"])
def test_download_over_the_cap_is_refused(tmp_path: Path, name: str) -> None:
    data = os.urandom(4096)

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files[name] = data
        want = order(name, data, base)
        message = await refused(install(want, state_dir=state, max_bytes=1000))
        assert message.startswith(f"download of {want.url} failed;")
        said = message.replace(want.url, "URL")  # its random port is no leak
        assert "1000" not in said and "4096" not in said
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_unpacked_size_over_the_cap_is_refused(tmp_path: Path) -> None:
    data = tarball([*llamacpp_members(), entry("llama/zeros", bytes(100_000))])

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        want = order("llama.tar.gz", data, base)
        message = await refused(install(want, state_dir=state, max_unpacked_bytes=50_000))
        assert "more than the limit of 50000" in message
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_download_timeout_is_refused(tmp_path: Path) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        want = order("slow.tar.gz", b"whatever", base)
        message = await refused(install(want, state_dir=state, timeout=0.5))
        assert message.startswith(f"download of {want.url} failed;")
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_other_build_of_an_installed_version_is_refused_without_downloading(
    tmp_path: Path,
) -> None:
    data = tarball(llamacpp_members())
    other = tarball([*llamacpp_members(), entry("llama-b4242/NEWS", b"changed\n")])

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["a.tar.gz"] = data
        pub.files["b.tar.gz"] = other
        await install(order("a.tar.gz", data, base), state_dir=state)
        message = await refused(install(order("b.tar.gz", other, base), state_dir=state))
        assert f"llamacpp b4242 is already installed in {state / 'engines/llamacpp/b4242'}" in (
            message
        )
        assert f"from a build with SHA-256 {sha(data)}, but the order says {sha(other)}" in message
        assert pub.requests["b.tar.gz"] == 0
        assert sorted(p.name for p in (state / "engines").iterdir()) == ["llamacpp"]

    run(tmp_path, scenario)


def test_version_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        stray = state / "engines" / "llamacpp" / "b4242"
        stray.mkdir(parents=True)
        message = await refused(install(order("x.tar.gz", b"x", base), state_dir=state))
        assert f"{stray} exists but its install manifest {ENGINE_MANIFEST} is missing" in message
        assert f"remove {stray} and send the order again" in message
        assert pub.requests["x.tar.gz"] == 0

    run(tmp_path, scenario)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"engine": "sim"}, "cannot install engine 'sim': installable engines are llamacpp"),
        ({"version": ".."}, "cannot install llamacpp version '..'"),
        ({"version": "a/b"}, "cannot install llamacpp version 'a/b'"),
        ({"version": "x" * 65}, "a version is 1-64 letters"),
        ({"url": "file:///etc/passwd"}, "file:// URLs are fetched only from places listed"),
        ({"url": "ftp://example.com/x.tar.gz"}, "only https://, http:// and file:// URLs"),
        ({"sha256": "abc"}, "sha256 'abc' is not 64 hex digits"),
        ({"sha256": "g" * 64}, "is not 64 hex digits"),
        # The install-order contract's rule, which the control plane kept alone before.
        ({"url": "https://pub.example/" + "x" * 4096}, "a URL is at most 4096 characters"),
    ],
    ids=[
        "engine",
        "dotdot",
        "slash",
        "long",
        "file-url",
        "ftp-url",
        "short-sha",
        "hex-sha",
        "long-url",
    ],
)
def test_invalid_order_is_refused(tmp_path: Path, fields: dict[str, str], expected: str) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        message = await refused(install(order("x.tar.gz", b"x", base, **fields), state_dir=state))
        assert expected in message
        assert not (state / "engines").exists()
        assert sum(pub.requests.values()) == 0

    run(tmp_path, scenario)


def test_display_url_hides_credentials(tmp_path: Path) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        url = base.replace("http://", "http://user:secret@") + "/files/gone.tar.gz?X-Sig=secret"
        want = pb.InstallEngine(engine="llamacpp", version="b1", url=url, sha256="a" * 64)
        message = await refused(install(want, state_dir=state))
        assert "secret" not in message
        assert f"{base}/files/gone.tar.gz?…" in message

    run(tmp_path, scenario)


def test_cancelled_install_leaves_nothing(tmp_path: Path) -> None:
    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        want = order("slow.tar.gz", b"whatever", base)
        task = asyncio.create_task(install(want, state_dir=state))
        await pub.slow_started.wait()
        await asyncio.sleep(0.1)
        assert [p.name[:5] for p in (state / "engines").iterdir()] == [".tmp-"]
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert_nothing_left(state)

    run(tmp_path, scenario)


def test_concurrent_orders_for_one_version_install_it_once(tmp_path: Path) -> None:
    data = tarball(llamacpp_members())

    async def scenario(pub: Publisher, base: str, state: Path) -> None:
        pub.files["llama.tar.gz"] = data
        want = order("llama.tar.gz", data, base)
        first, second = await asyncio.gather(
            install(want, state_dir=state), install(want, state_dir=state)
        )
        assert first == second
        assert first.ok
        assert pub.requests["llama.tar.gz"] == 2  # both downloaded; the second found it done
        assert sorted(p.name for p in (state / "engines").iterdir()) == ["llamacpp"]
        assert sorted(p.name for p in (state / "engines" / "llamacpp").iterdir()) == ["b4242"]

    run(tmp_path, scenario)


def test_remove_leftovers_deletes_interrupted_installs(tmp_path: Path) -> None:
    root = tmp_path / "engines"
    stuck = root / ".tmp-abc123" / "root" / "locked"
    stuck.mkdir(parents=True)
    (stuck / "file").write_bytes(b"x")
    stuck.chmod(0o500)
    (root / "llamacpp").mkdir()
    removed = remove_leftovers(tmp_path)
    assert removed == [root / ".tmp-abc123"]
    assert sorted(p.name for p in root.iterdir()) == ["llamacpp"]
    assert remove_leftovers(tmp_path / "nowhere") == []
