"""Where engine installs may download from (issue 11, point 10): https:// verified against
the system store or the cluster CA, plain http:// and file:// only from agent.yaml's
install_sources, redirects only to listed https:// places, and nothing of what a probe
reached in what the control plane hears. Real HTTP(S) servers on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import logging
import ssl
import tarfile
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llmgw import pki
from llmgw.agent.config import parse_agent_config
from llmgw.agent.installs import download_ssl_context, install_engine
from llmgw.contracts.sources import SourcePrefix, parse_prefix
from llmgw.errors import ConfigError, EngineError
from llmgw.proto import control_pb2 as pb

pytestmark = pytest.mark.timeout(60)

SERVER_SCRIPT = b'#!/bin/sh\necho "version: 4242 (deadbeef)"\nexit 0\n'


def build() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        info = tarfile.TarInfo("llama/bin/llama-server")
        info.mode, info.size = 0o755, len(SERVER_SCRIPT)
        tf.addfile(info, io.BytesIO(SERVER_SCRIPT))
    return buf.getvalue()


BUILD = build()
SHA = hashlib.sha256(BUILD).hexdigest()
SECRET = b"internal service: admin password hunter2\n"


def order(url: str, sha256: str = SHA) -> pb.InstallEngine:
    return pb.InstallEngine(engine="llamacpp", version="b4242", url=url, sha256=sha256)


class Site:
    """One HTTP(S) server: /build.tar.gz, /secret, /to?url=… (a 302), counting requests."""

    def __init__(self) -> None:
        self.requests: Counter[str] = Counter()
        self.base = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        self.requests[name] += 1
        if name == "build.tar.gz":
            return web.Response(body=BUILD)
        if name == "secret":
            return web.Response(body=SECRET)
        if name == "to":
            raise web.HTTPFound(request.query["url"])
        raise web.HTTPNotFound()

    @contextlib.asynccontextmanager
    async def running(
        self, ssl_context: ssl.SSLContext | None = None, host: str = "127.0.0.1"
    ) -> AsyncIterator[Site]:
        app = web.Application()
        app.router.add_get("/{name}", self.handle)
        runner = web.AppRunner(app, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=ssl_context)
        await site.start()
        port = runner.addresses[0][1]
        self.base = f"{'https' if ssl_context else 'http'}://{host}:{port}"
        try:
            yield self
        finally:
            await runner.cleanup()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cluster CA, a server certificate from it for 127.0.0.1 and localhost, and one from
    a CA nobody trusts."""
    tmp = tmp_path_factory.mktemp("tls")
    ca = pki.init_ca(tmp / "ca")
    good = pki.issue_server_cert(ca, tmp / "good", hosts=["127.0.0.1", "localhost"])
    rogue_ca = pki.init_ca(tmp / "rogue-ca")
    rogue = pki.issue_server_cert(rogue_ca, tmp / "rogue", hosts=["127.0.0.1", "localhost"])

    def server_ctx(identity: pki.Identity) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(identity.cert, identity.key)
        return ctx

    client = download_ssl_context(good.ca)  # the system store and the cluster CA
    assert client.cert_store_stats()["x509_ca"] >= 1
    return {"good": server_ctx(good), "rogue": server_ctx(rogue), "client": client}


def run(scenario: Any) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def refused(state: Path, want: pb.InstallEngine, **kwargs: Any) -> str:
    with pytest.raises(EngineError) as caught:
        await install_engine(want, state_dir=state, **kwargs)
    return str(caught.value)


def listed(*prefixes: str) -> tuple[SourcePrefix, ...]:
    return tuple(parse_prefix(p) for p in prefixes)


# -- plain http ----------------------------------------------------------------------------


def test_a_plain_http_url_not_listed_is_refused_before_any_request(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Site().running() as site:
            message = await refused(tmp_path, order(f"{site.base}/build.tar.gz"))
            assert "http:// URLs are fetched only from places listed in install_sources" in message
            assert f"'install_sources: [{site.base}/]'" in message
            # Listed for another port or another folder: still refused.
            other = listed(f"{site.base}/engines/", "http://127.0.0.1:1/")
            message = await refused(tmp_path, order(f"{site.base}/build.tar.gz"), sources=other)
            assert "install_sources" in message
            # A dot segment never matches a listed folder.
            sneaky = order(f"{site.base}/engines/../secret")
            message = await refused(tmp_path, sneaky, sources=other)
            assert "'.' or '..' segments" in message
            assert sum(site.requests.values()) == 0

    run(scenario)


def test_a_listed_plain_http_source_installs(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with Site().running() as site:
            info = await install_engine(
                order(f"{site.base}/build.tar.gz"),
                state_dir=tmp_path,
                sources=listed(f"{site.base}/build.tar.gz"),
            )
            assert info.ok and "4242" in info.version
            assert site.requests["build.tar.gz"] == 1

    run(scenario)


def test_a_redirect_to_another_host_or_port_is_refused_and_not_followed(
    tmp_path: Path, tls: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with (
            Site().running() as site,
            Site().running() as inner,
            Site().running(tls["good"], host="localhost") as secure,
        ):
            sources = listed(f"{site.base}/")
            for target in (f"{inner.base}/secret", f"{secure.base}/secret"):
                with caplog.at_level(logging.WARNING, logger="llmgw.agent.installs"):
                    message = await refused(
                        tmp_path,
                        order(f"{site.base}/to?url={target}"),
                        sources=sources,
                        ssl_context=tls["client"],
                    )
                assert message.startswith(f"download of {site.base}/to?… refused: it redirects")
                assert "install_sources in agent.yaml" in message
                assert target.split("/")[2] not in message  # not even where it pointed
                assert any(target in str(r.__dict__.get("fields")) for r in caplog.records)
            assert inner.requests["secret"] == 0 and secure.requests["secret"] == 0
            assert site.requests["to"] == 2

    run(scenario)


# -- https ---------------------------------------------------------------------------------


def test_https_is_verified_against_the_cluster_ca_and_needs_no_listing(
    tmp_path: Path, tls: dict[str, Any]
) -> None:
    async def scenario() -> None:
        async with Site().running(tls["good"]) as site:
            info = await install_engine(
                order(f"{site.base}/build.tar.gz"), state_dir=tmp_path, ssl_context=tls["client"]
            )
            assert info.ok

    run(scenario)


def test_https_with_an_untrusted_certificate_fails_without_details(
    tmp_path: Path, tls: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        async with Site().running(tls["rogue"]) as site:
            with caplog.at_level(logging.WARNING, logger="llmgw.agent.installs"):
                message = await refused(
                    tmp_path, order(f"{site.base}/build.tar.gz"), ssl_context=tls["client"]
                )
            assert message.startswith(f"download of {site.base}/build.tar.gz failed; the agent's")
            assert "certificate" not in message.lower() and "ssl" not in message.lower()
            assert any("certificate" in str(r.__dict__.get("fields")) for r in caplog.records)
            assert site.requests["build.tar.gz"] == 0

    run(scenario)


def test_https_redirects_are_followed_only_to_listed_https_places(
    tmp_path: Path, tls: dict[str, Any]
) -> None:
    async def scenario() -> None:
        async with (
            Site().running(tls["good"]) as front,
            Site().running(tls["good"], host="localhost") as cdn,
            Site().running() as plain,
        ):
            via = f"{front.base}/to?url={cdn.base}/build.tar.gz"
            # Not listed: refused.
            message = await refused(tmp_path, order(via), ssl_context=tls["client"])
            assert "refused: it redirects" in message
            assert cdn.requests["build.tar.gz"] == 0
            # Listed: followed (an https:// front needs no listing itself).
            info = await install_engine(
                order(via),
                state_dir=tmp_path,
                sources=listed(f"{cdn.base}/"),
                ssl_context=tls["client"],
            )
            assert info.ok and cdn.requests["build.tar.gz"] == 1
            # Down to plain http, even a listed place: refused.
            down = f"{front.base}/to?url={plain.base}/build.tar.gz"
            message = await refused(
                tmp_path / "b",
                order(down),
                sources=listed(f"{plain.base}/"),
                ssl_context=tls["client"],
            )
            assert "refused: it redirects" in message
            assert plain.requests["build.tar.gz"] == 0

    run(scenario)


# -- what the control plane hears ------------------------------------------------------------


def test_a_probe_learns_nothing_of_what_answered(tmp_path: Path) -> None:
    secret_sha = hashlib.sha256(SECRET).hexdigest()

    async def scenario() -> None:
        async with Site().running() as site:
            sources = listed(f"{site.base}/")
            answers = [
                await refused(tmp_path, order(f"{site.base}/secret"), sources=sources),
                await refused(tmp_path, order(f"{site.base}/nothing"), sources=sources),
                await refused(
                    tmp_path, order("http://127.0.0.1:1/x"), sources=listed("http://127.0.0.1:1/")
                ),
            ]
            assert answers[0].startswith(f"checksum mismatch for {site.base}/secret:")
            assert answers[1].startswith(f"download of {site.base}/nothing failed;")
            assert answers[2].startswith("download of http://127.0.0.1:1/x failed;")
            for answer in answers:
                # The URLs themselves are said; their random ports must not count as a leak.
                said = answer.replace(site.base, "BASE").replace("127.0.0.1:1", "HOST")
                assert secret_sha not in said
                assert str(len(SECRET)) not in said
                assert "404" not in said and "refused" not in said.lower()
                assert "hunter2" not in said

    run(scenario)


# -- file:// --------------------------------------------------------------------------------


def test_file_sources_must_be_listed_and_stay_inside_it(tmp_path: Path) -> None:
    engines = tmp_path / "engines"
    engines.mkdir()
    (engines / "build.tar.gz").write_bytes(BUILD)
    outside = tmp_path / "private"
    outside.mkdir()
    (outside / "node.key").write_bytes(BUILD)
    (engines / "link.tar.gz").symlink_to(outside / "node.key")
    url = (engines / "build.tar.gz").as_uri()

    async def scenario() -> None:
        message = await refused(tmp_path / "s1", order(url))
        assert "file:// URLs are fetched only from places listed in install_sources" in message
        sources = listed(engines.as_uri() + "/")
        info = await install_engine(order(url), state_dir=tmp_path / "s2", sources=sources)
        assert info.ok
        message = await refused(
            tmp_path / "s3", order((engines / "link.tar.gz").as_uri()), sources=sources
        )
        assert "resolves (through a symlink) to a file outside" in message
        assert "node.key" not in message

    run(scenario)


# -- agent.yaml ------------------------------------------------------------------------------


def test_install_sources_in_agent_yaml() -> None:
    cfg = parse_agent_config(
        {
            "server": "cp:7443",
            "node_id": "gpu-1",
            "install_sources": [
                "https://releases.example.net/llama.cpp/",
                "http://10.0.0.2:8000/engines",
                "file:///srv/engines/",
            ],
        }
    )
    https, http, file = cfg.install_sources
    assert (https.scheme, https.host, https.port) == ("https", "releases.example.net", 443)
    assert (http.port, http.path) == (8000, "/engines")
    assert http.covers("http://10.0.0.2:8000/engines/llama.tar.gz")
    assert not http.covers("http://10.0.0.2:8000/engines-old/llama.tar.gz")
    assert not http.covers("http://10.0.0.2:8001/engines/llama.tar.gz")
    assert not https.covers("https://releases.example.net.evil.io/llama.cpp/x")
    assert file.covers("file:///srv/engines/x.tar.gz") and not file.covers("file:///srv/x")
    assert parse_agent_config({"server": "cp:7443", "node_id": "n"}).install_sources == ()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("ftp://example.net/", "only https://, http:// and file:// URLs"),
        ("https:///x", "needs a host"),
        ("https://user:pw@example.net/", "must not carry a user name or password"),
        ("https://example.net/x?sig=1", "no '?query'"),
        ("file://host/srv/", "a file:// URL names a path on this node"),
        ("https://example.net/a/../b", "'.' or '..' segments"),
    ],
)
def test_bad_install_sources_name_the_key(entry: str, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_agent_config({"server": "cp:7443", "node_id": "n", "install_sources": [entry]})
    message = str(caught.value)
    assert "install_sources[0]" in message and expected in message
