"""Where the control plane fetches a model's tokenizer files from, and what a failure says
(llmgw.server.gateway.tokenizer_files, through llmgw.server.gateway.tokenizing.Tokenizers): no loopback or
private target unless server.yaml's tokenizer_sources lists it (checked on the name and on
the connected socket), no redirect to another host, no path inside the state directory or
naming a secret, and a problem that says "download failed", "read failed" or "checksum
mismatch": never a status, a connection error or a digest (viewers read it too)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from llmgw.contracts.catalog import FileRef
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.sources import parse_prefix
from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.tokenizing import HfTokenizer, Tokenizers

SECRET = b"llmgw-admin-the-secret\n"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _served(tokenizer: FileRef) -> ServedModel:
    tasks = ("generate",)
    return ServedModel(
        "m", "vllm", tasks, served_paths("vllm", tasks), 64, None, tokenizer=tokenizer,
        routing="kv-events",
    )  # fmt: skip


class _Files(ThreadingHTTPServer):
    """Fixed files and redirects on ``host``, counting the requests it answers."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.files: dict[str, bytes] = {}
        self.redirects: dict[str, str] = {}
        self.requests: list[str] = []
        super().__init__((host, 0), _Handler)

    @property
    def base(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class _Handler(BaseHTTPRequestHandler):
    server: _Files

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
        if self.path in self.server.redirects:
            self.send_response(302)
            self.send_header("Location", self.server.redirects[self.path])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        data = self.server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(host: str) -> Iterator[_Files]:
    server = _Files(host)
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture
def files() -> Iterator[_Files]:
    yield from _serve("127.0.0.1")


@pytest.fixture
def other_host() -> Iterator[_Files]:
    """Another host: 127.0.0.2 (the whole of 127/8 is loopback on Linux)."""
    yield from _serve("127.0.0.2")


def _problem(tokenizers: Tokenizers, ref: FileRef) -> str:
    tokenizers.set_models([_served(ref)])
    asyncio.run(tokenizers.load_due())
    assert tokenizers.for_model("m") is None
    problem = tokenizers.problem("m")
    assert problem is not None
    return problem


def _logged(caplog: pytest.LogCaptureFixture) -> str:
    """The fields of the lines logged (what the operator reads)."""
    return " ".join(str(getattr(r, "fields", "")) for r in caplog.records)


def _download_failed(url: str) -> str:
    return (
        f"model m: tokenizer {url}: download failed (the control plane's log says why); check "
        "that the URL serves the file to this control plane, that an http:// URL or one on a "
        "private network is under a prefix of tokenizer_sources in server.yaml, or copy the "
        "file here and give tokenizer.path"
    )


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/secret",
        "https://127.0.0.1:{port}/secret",
        "https://localhost:{port}/secret",
        "https://[::ffff:127.0.0.1]:{port}/secret",
    ],
)
def test_a_loopback_url_is_refused_without_a_digest_or_status(
    tmp_path: Path, files: _Files, url: str
) -> None:
    files.files["/secret"] = SECRET
    url = url.format(port=files.server_address[1])
    problem = _problem(Tokenizers(tmp_path / "tokenizers"), FileRef(url, "0" * 64))
    assert problem == _download_failed(url)
    assert files.requests == []  # refused before a byte was sent
    assert _sha(SECRET) not in problem


def test_a_name_resolving_elsewhere_on_connect_is_refused_on_the_socket(
    tmp_path: Path, files: _Files, caplog: pytest.LogCaptureFixture
) -> None:
    """A host name that resolves to a public address when checked and to loopback when
    connected (DNS rebinding) reaches nothing: the connected address is checked too."""
    url = f"https://127.0.0.1:{files.server_address[1]}/secret"
    tokenizers = Tokenizers(tmp_path / "tokenizers")
    tokenizers.files.resolve = lambda _host: ["93.184.216.34"]
    with caplog.at_level(logging.WARNING, logger="llmgw.server.tokenizer_files"):
        problem = _problem(tokenizers, FileRef(url, "0" * 64))
    assert problem == _download_failed(url)
    assert files.requests == []
    assert "connected to 127.0.0.1, not a public address" in _logged(caplog)  # the log says why


def test_a_listed_prefix_is_fetched_and_a_redirect_to_another_host_is_refused(
    tmp_path: Path, tokenizer_json: bytes, files: _Files, other_host: _Files
) -> None:
    files.files["/tok/tokenizer.json"] = tokenizer_json
    files.redirects["/tok/moved.json"] = "/tok/tokenizer.json"  # the same host: followed
    files.redirects["/tok/away.json"] = f"{other_host.base}/tokenizer.json"
    other_host.files["/tokenizer.json"] = tokenizer_json
    listed = (parse_prefix(files.base + "/tok/"),)
    digest = _sha(tokenizer_json)

    moved = Tokenizers(tmp_path / "a", sources=listed)
    moved.set_models([_served(FileRef(f"{files.base}/tok/moved.json", digest))])
    asyncio.run(moved.load_due())
    assert isinstance(moved.for_model("m"), HfTokenizer)
    assert files.requests == ["/tok/moved.json", "/tok/tokenizer.json"]

    away = f"{files.base}/tok/away.json"
    problem = _problem(Tokenizers(tmp_path / "b", sources=listed), FileRef(away, digest))
    assert problem == _download_failed(away)
    assert other_host.requests == []
    # Listed too, the other host is followed to.
    both = (*listed, parse_prefix(other_host.base + "/"))
    followed = Tokenizers(tmp_path / "c", sources=both)
    followed.set_models([_served(FileRef(away, digest))])
    asyncio.run(followed.load_due())
    assert isinstance(followed.for_model("m"), HfTokenizer)
    assert other_host.requests == ["/tokenizer.json"]


def test_failures_say_download_failed_or_checksum_mismatch_and_the_log_says_why(
    tmp_path: Path, files: _Files, caplog: pytest.LogCaptureFixture
) -> None:
    files.files["/t.json"] = SECRET
    listed = (parse_prefix(files.base + "/"),)
    missing, wrong = f"{files.base}/missing.json", f"{files.base}/t.json"
    with caplog.at_level(logging.WARNING, logger="llmgw.server.tokenizer_files"):
        gone = _problem(Tokenizers(tmp_path / "a", sources=listed), FileRef(missing, "0" * 64))
        mismatch = _problem(Tokenizers(tmp_path / "b", sources=listed), FileRef(wrong, "0" * 64))
    assert gone == _download_failed(missing)
    # The URL is said; its random port (40459 once) must not count as a leak.
    said = gone.replace(files.base, "BASE")
    assert "404" not in said and "Not Found" not in said
    assert mismatch.startswith(f"model m: tokenizer {wrong}: checksum mismatch; nothing was kept")
    assert _sha(SECRET) not in mismatch
    assert "HTTP 404" in _logged(caplog) and _sha(SECRET) in _logged(caplog)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    (state / "admin.token").write_bytes(SECRET)
    return state


def _refused(path: Path) -> str:
    return (
        f"model m: tokenizer {path}: refused: the control plane reads no tokenizer file inside "
        "its state directory or among its secrets; put the file in a directory of its own and "
        "set tokenizer.path to it"
    )


def test_a_path_in_the_state_directory_is_refused_without_a_digest(
    tmp_path: Path, state: Path
) -> None:
    token = state / "admin.token"
    private = (state, token)
    for ref in (FileRef(str(token), "0" * 64), FileRef(str(token))):
        problem = _problem(Tokenizers(state / "tokenizers", private=private), ref)
        assert problem == _refused(token)
        assert _sha(SECRET) not in problem
    # Nor through a symbolic link outside it.
    link = tmp_path / "innocent.json"
    link.symlink_to(token)
    problem = _problem(Tokenizers(state / "tokenizers", private=private), FileRef(str(link)))
    assert problem == _refused(link)


def test_a_hard_link_to_a_secret_file_is_refused_when_read(tmp_path: Path) -> None:
    secret = tmp_path / "etc" / "db-password"
    secret.parent.mkdir()
    secret.write_bytes(SECRET)
    link = tmp_path / "models" / "tokenizer.json"
    link.parent.mkdir()
    os.link(secret, link)
    tokenizers = Tokenizers(None, private=(tmp_path / "state", secret))
    problem = _problem(tokenizers, FileRef(str(link), "0" * 64))
    assert problem.startswith(f"model m: tokenizer {link}: read failed")
    assert _sha(SECRET) not in problem


def test_the_control_planes_tokenizers_refuse_its_admin_token_and_loopback(
    tmp_path: Path, state: Path, files: _Files
) -> None:
    """As server.yaml wires them: STATE/admin.token is never read, a loopback URL never
    fetched, and neither problem carries a digest or a status."""
    cfg = load_server_config(None, overrides={"state_dir": str(state)})
    token = state / "admin.token"
    problem = _problem(ControlPlane(cfg).tokenizers, FileRef(str(token), "0" * 64))
    assert problem == _refused(token)
    files.files["/secret"] = SECRET
    url = f"{files.base}/secret"
    problem = _problem(ControlPlane(cfg).tokenizers, FileRef(url, "0" * 64))
    assert problem == _download_failed(url)
    assert files.requests == []
