"""The gateway's prompt tokenizers (llmgw.server.gateway.tokenizing): the sim engine's own text and
tokenizer, a Hugging Face tokenizer.json with its chat template applied as vLLM applies it,
and the control plane's cache of them per model (paths, URLs fetched once into the state
directory, each checked by its SHA-256; failures recorded and retried)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from llmgw.contracts.catalog import FileRef
from llmgw.contracts.endpoints import served_paths
from llmgw.contracts.sources import parse_prefix
from llmgw.errors import TokenizerError
from llmgw.server.gateway.serving import ServedModel, ServingCache
from llmgw.server.gateway.tokenizing import (
    MAX_PROMPT_CHARS,
    HfTokenizer,
    SimTokenizer,
    Tokenizers,
)
from llmgw.server.store import Store
from llmgw.sim.generate import tokenize
from llmgw.sim.protocol import chat_prompt
from tests.unit.clock import Clock
from tests.unit.server.tokenizer_rig import CHATML

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"


def _chatml_by_hand(messages: list[dict[str, str]], bos: str = "<s>") -> str:
    """What CHATML renders ``messages`` to, built without Jinja."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return f"{bos}{turns}<|im_start|>assistant\n"


def _id(tok: Tokenizer, token: str) -> int:
    found = tok.token_to_id(token)
    assert found is not None, token
    return found


# --- SimTokenizer ----------------------------------------------------------------------------


def test_sim_keys_the_very_text_the_sim_engine_prompts_with() -> None:
    sim = SimTokenizer()
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
        },
        {"role": "assistant", "content": None},
    ]
    assert sim.token_ids(CHAT, {"messages": messages}) == tokenize(chat_prompt(messages))
    assert sim.token_ids(CHAT, {"messages": messages}) == tokenize("be brief\nhello\nworld")
    assert sim.token_ids(COMPLETIONS, {"prompt": "once upon"}) == tokenize("once upon")
    assert sim.token_ids(COMPLETIONS, {"prompt": ["first", "second"]}) == tokenize("first")
    assert sim.token_ids(RESPONSES, {"input": "hi"}) == tokenize("hi")
    # llmgw.sim.responses puts the instructions first, one a line.
    assert sim.token_ids(RESPONSES, {"input": "hi", "instructions": "be kind"}) == tokenize(
        "be kind\nhi"
    )
    assert sim.token_ids(RESPONSES, {"input": "hi", "instructions": ""}) == tokenize("hi")


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (CHAT, {}),
        (CHAT, {"messages": "hello"}),
        (CHAT, {"messages": []}),
        (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}),
        (CHAT, {"messages": [{"role": "user", "content": 7}]}),
        (CHAT, {"messages": [{"role": "user", "content": [{"text": "no type"}]}]}),
        (CHAT, {"messages": ["not an object"]}),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"prompt": 42}),
        (COMPLETIONS, {"prompt": [1, 2, 3]}),
        (COMPLETIONS, {"prompt": []}),
        (RESPONSES, {"input": [{"role": "user", "content": "items"}]}),
        (RESPONSES, {"input": "hi", "instructions": 3}),
        (RESPONSES, {}),
        ("/v1/embeddings", {"input": "hi"}),
        (CHAT, ["not", "a", "dict"]),
        (COMPLETIONS, {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}),
    ],
)
def test_sim_gives_none_for_what_it_does_not_key(path: str, payload: Any) -> None:
    assert SimTokenizer().token_ids(path, payload) is None


# --- HfTokenizer -----------------------------------------------------------------------------


def test_a_chat_is_rendered_as_transformers_does_and_encoded_without_special_tokens(
    tokenizer_json: bytes,
) -> None:
    tok = Tokenizer.from_str(tokenizer_json.decode())
    hf = HfTokenizer.from_files(tokenizer_json, CHATML.encode())
    messages = [
        {"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "hello world"},
    ]
    text = hf.render(messages)
    assert text == _chatml_by_hand(messages)
    ids = hf.token_ids(CHAT, {"model": "m", "messages": messages})
    assert ids == tok.encode(_chatml_by_hand(messages), add_special_tokens=False).ids
    # By hand: the template's own bos, no second one, and no eos from the post-processor.
    s, ims, ime = _id(tok, "<s>"), _id(tok, "<|im_start|>"), _id(tok, "<|im_end|>")
    w = {
        word: _id(tok, word)
        for word in "you are a helpful assistant system user hello world".split()
    }
    assert ids == [
        s,
        ims, w["system"], w["you"], w["are"], w["a"], w["helpful"], w["assistant"], ime,
        ims, w["user"], w["hello"], w["world"], ime,
        ims, w["assistant"],
    ]  # fmt: skip
    # The request's own add_special_tokens and add_generation_prompt are followed (vLLM's).
    with_specials = hf.token_ids(CHAT, {"messages": messages, "add_special_tokens": True})
    assert with_specials == [s, *ids, _id(tok, "</s>")]
    without_prompt = hf.token_ids(CHAT, {"messages": messages, "add_generation_prompt": False})
    assert without_prompt == ids[:-2]


def test_text_parts_are_joined_by_newlines_and_bos_comes_from_the_post_processor(
    tokenizer_json: bytes,
) -> None:
    hf = HfTokenizer.from_files(tokenizer_json, b"{{ bos_token }}{{ messages[0]['content'] }}")
    assert hf.specials == {"bos_token": "<s>", "eos_token": "</s>"}
    parts = [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}]
    assert hf.render([{"role": "user", "content": parts}]) == "<s>hello\nworld"


def test_a_tokenizer_config_json_gives_the_template_and_its_special_tokens(
    tokenizer_json: bytes,
) -> None:
    config = {
        "chat_template": "{{ bos_token }}|{{ eos_token }}|{{ messages[0]['content'] }}",
        "bos_token": {"content": "<|im_start|>", "lstrip": False},
        "eos_token": "<|im_end|>",
    }
    hf = HfTokenizer.from_files(tokenizer_json, json.dumps(config).encode())
    assert hf.render([{"role": "user", "content": "hi"}]) == "<|im_start|>|<|im_end|>|hi"
    named = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    assert HfTokenizer.from_files(tokenizer_json, json.dumps(named).encode()).template_text == "D"
    with pytest.raises(TokenizerError, match="without a chat_template string"):
        HfTokenizer.from_files(tokenizer_json, b'{"bos_token": "<s>"}')


def test_completions_add_special_tokens_and_token_id_prompts_are_their_ids(
    tokenizer_json: bytes,
) -> None:
    tok = Tokenizer.from_str(tokenizer_json.decode())
    hf = HfTokenizer.from_files(tokenizer_json)
    expected = tok.encode("hello world", add_special_tokens=True).ids
    assert expected[0] == _id(tok, "<s>") and expected[-1] == _id(tok, "</s>")
    assert hf.token_ids(COMPLETIONS, {"prompt": "hello world"}) == expected
    assert hf.token_ids(COMPLETIONS, {"prompt": ["hello world", "the fox"]}) == expected
    plain = hf.token_ids(COMPLETIONS, {"prompt": "hello world", "add_special_tokens": False})
    assert plain == expected[1:-1]
    assert hf.token_ids(COMPLETIONS, {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert hf.token_ids(COMPLETIONS, {"prompt": [[5, 6], [7]]}) == [5, 6]


def test_a_response_is_the_chat_vllm_builds_of_its_instructions_and_input(
    tokenizer_json: bytes,
) -> None:
    hf = HfTokenizer.from_files(tokenizer_json, CHATML.encode())
    messages = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "hello world"},
    ]
    expected = hf.token_ids(CHAT, {"messages": messages})
    assert expected is not None
    assert hf.token_ids(RESPONSES, {"input": "hello world", "instructions": "be kind"}) == expected
    assert hf.token_ids(RESPONSES, {"input": "hello world"}) == hf.token_ids(
        CHAT, {"messages": messages[1:]}
    )


@pytest.mark.parametrize(
    ("path", "payload"),
    [
        (CHAT, {"messages": [{"role": "tool", "content": "42"}]}),  # the template refuses
        (CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        ),
        (CHAT, {"messages": [{"role": "assistant", "content": "", "tool_calls": [{}]}]}),
        (CHAT, {"messages": [{"role": 1, "content": "hi"}]}),
        (CHAT, {"messages": [{"role": "user", "content": {"text": "hi"}}]}),
        (CHAT, {"messages": [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]}),
        (CHAT, {"messages": None}),
        (COMPLETIONS, {"prompt": [True, 1]}),
        (COMPLETIONS, {"prompt": [-1]}),
        (COMPLETIONS, {"prompt": {"text": "hi"}}),
        (COMPLETIONS, {"prompt": "x" * (MAX_PROMPT_CHARS + 1)}),
        (RESPONSES, {"input": [{"type": "message"}]}),
        ("/tokenize", {"prompt": "hi"}),
        (CHAT, "not a dict"),
    ],
)
def test_hf_gives_none_for_what_it_does_not_key(
    tokenizer_json: bytes, path: str, payload: Any
) -> None:
    hf = HfTokenizer.from_files(tokenizer_json, CHATML.encode())
    assert hf.token_ids(path, payload) is None


def test_without_a_chat_template_a_chat_gives_none(tokenizer_json: bytes) -> None:
    hf = HfTokenizer.from_files(tokenizer_json)
    assert hf.token_ids(CHAT, {"messages": [{"role": "user", "content": "hi"}]}) is None
    assert hf.token_ids(RESPONSES, {"input": "hi"}) is None
    assert hf.token_ids(COMPLETIONS, {"prompt": "hi"}) is not None


def test_files_that_are_not_a_tokenizer_or_a_template_are_refused(tokenizer_json: bytes) -> None:
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        HfTokenizer.from_files(b'{"model": "nothing"}')
    with pytest.raises(TokenizerError, match=r"not a tokenizer\.json"):
        HfTokenizer.from_files(b"\xff\xfe")
    with pytest.raises(TokenizerError, match=r"does not compile \(line 1"):
        HfTokenizer.from_files(tokenizer_json, b"{% for m in messages %}")


# --- Tokenizers ------------------------------------------------------------------------------


def _served(
    name: str,
    tokenizer: FileRef | None,
    chat_template: FileRef | None = None,
    *,
    engine: str = "vllm",
    routing: str = "kv-events",
) -> ServedModel:
    tasks = ("generate",)
    return ServedModel(
        name,
        engine,
        tasks,
        served_paths(engine, tasks),
        64,
        None,
        routing=routing,
        tokenizer=tokenizer,
        chat_template=chat_template,
    )


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_failed(url: str, model: str = "m", key: str = "tokenizer") -> str:
    return (
        f"model {model}: {key} {url}: download failed (the control plane's log says why); "
        "check that the URL serves the file to this control plane, that an http:// URL or "
        "one on a private network is under a prefix of tokenizer_sources in server.yaml, or "
        f"copy the file here and give {key}.path"
    )


class _Files(ThreadingHTTPServer):
    """A local HTTP server of fixed files, counting the requests it answers."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files
        self.requests: list[str] = []
        super().__init__(("127.0.0.1", 0), _FileHandler)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _FileHandler(BaseHTTPRequestHandler):
    server: _Files

    def do_GET(self) -> None:
        self.server.requests.append(self.path)
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


@pytest.fixture
def files_server() -> Iterator[_Files]:
    server = _Files({})
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def test_a_path_with_its_sha256_loads_and_a_wrong_one_is_refused(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_json)
    template = tmp_path / "chat_template.jinja"
    template.write_bytes(CHATML.encode())
    wrong = "0" * 64
    tokenizers = Tokenizers(tmp_path / "state" / "tokenizers", clock=Clock())
    tokenizers.set_models(
        [
            _served("good", FileRef(str(path), _sha(tokenizer_json)), FileRef(str(template))),
            _served("bad", FileRef(str(path), wrong)),
        ]
    )
    assert tokenizers.for_model("good") is None  # nothing on the request's path
    assert tokenizers.problem("good") == "its tokenizer is loading"
    asyncio.run(tokenizers.load_due())
    good = tokenizers.for_model("good")
    assert isinstance(good, HfTokenizer) and good.template_text == CHATML
    assert tokenizers.problem("good") is None
    assert good.token_ids(CHAT, {"messages": [{"role": "user", "content": "hi"}]})
    assert tokenizers.for_model("bad") is None
    # Not the file's digest: a path's problem is no oracle of what the file holds.
    assert tokenizers.problem("bad") == (
        f"model bad: tokenizer {path}: checksum mismatch; nothing was kept: put the right "
        f"file at {path}, or set tokenizer.sha256 to its digest"
    )
    assert tokenizers.loads == 1 and tokenizers.fetches == 0


def test_a_missing_path_is_reported_and_retried_with_backoff(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    clock = Clock()
    tokenizers = Tokenizers(None, clock=clock, retry_initial=5.0, retry_max=8.0)
    tokenizers.set_models([_served("m", FileRef(str(path)))])
    asyncio.run(tokenizers.load_due())
    assert tokenizers.problem("m") == (
        f"model m: tokenizer {path}: read failed (the control plane's log says why); put the "
        "file there, readable by the control plane's user, or fix the profile's tokenizer.path"
    )
    path.write_bytes(tokenizer_json)
    clock.t += 4.9  # not due yet
    asyncio.run(tokenizers.load_due())
    assert tokenizers.for_model("m") is None
    clock.t += 0.2
    asyncio.run(tokenizers.load_due())
    assert isinstance(tokenizers.for_model("m"), HfTokenizer)
    assert tokenizers.problem("m") is None


def test_a_url_is_fetched_once_into_the_state_dir_and_reused(
    tmp_path: Path, tokenizer_json: bytes, files_server: _Files
) -> None:
    files_server.files["/tok/tokenizer.json"] = tokenizer_json
    files_server.files["/tok/chat.jinja"] = CHATML.encode()
    digest, template_digest = _sha(tokenizer_json), _sha(CHATML.encode())
    served = _served(
        "m",
        FileRef(f"{files_server.base}/tok/tokenizer.json", digest),
        FileRef(f"{files_server.base}/tok/chat.jinja", template_digest),
    )
    cache = tmp_path / "state" / "tokenizers"
    listed = (parse_prefix(files_server.base + "/tok/"),)
    first = Tokenizers(cache, sources=listed)
    first.set_models([served])
    asyncio.run(first.load_due())
    assert isinstance(first.for_model("m"), HfTokenizer)
    assert files_server.requests == ["/tok/tokenizer.json", "/tok/chat.jinja"]
    assert (cache / digest).read_bytes() == tokenizer_json
    assert (cache / template_digest).read_bytes() == CHATML.encode()
    assert (cache / digest).stat().st_mode & 0o777 == 0o600
    # The same files again (another model, the next start): read from the cache.
    second = Tokenizers(cache, sources=listed)
    second.set_models([served])
    asyncio.run(second.load_due())
    assert isinstance(second.for_model("m"), HfTokenizer)
    assert len(files_server.requests) == 2 and second.fetches == 0
    # A cached file that no longer matches its digest is fetched again, and replaced.
    (cache / digest).write_bytes(b"damaged")
    third = Tokenizers(cache, sources=listed)
    third.set_models([served])
    asyncio.run(third.load_due())
    assert isinstance(third.for_model("m"), HfTokenizer)
    assert files_server.requests[2:] == ["/tok/tokenizer.json"]
    assert (cache / digest).read_bytes() == tokenizer_json


def test_a_url_whose_bytes_do_not_match_is_refused_and_nothing_kept(
    tmp_path: Path, tokenizer_json: bytes, files_server: _Files
) -> None:
    files_server.files["/tokenizer.json"] = tokenizer_json
    expected = _sha(b"another release")
    url = f"{files_server.base}/tokenizer.json"
    cache = tmp_path / "tokenizers"
    tokenizers = Tokenizers(cache, sources=(parse_prefix(files_server.base),))
    tokenizers.set_models([_served("m", FileRef(url, expected))])
    asyncio.run(tokenizers.load_due())
    assert tokenizers.for_model("m") is None
    problem = tokenizers.problem("m")
    assert problem is not None
    assert problem.startswith(f"model m: tokenizer {url}: checksum mismatch; nothing was kept: ")
    assert "set tokenizer.sha256 in the catalog" in problem
    assert _sha(tokenizer_json) not in problem
    assert not cache.exists() or list(cache.iterdir()) == []


def test_an_unreachable_url_is_reported_and_retried(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/tokenizer.json"
    clock = Clock()
    tokenizers = Tokenizers(
        tmp_path / "tokenizers",
        clock=clock,
        fetch_timeout=5.0,
        sources=(parse_prefix(f"http://127.0.0.1:{port}/"),),
    )
    tokenizers.set_models([_served("m", FileRef(url, "a" * 64))])
    asyncio.run(tokenizers.load_due())
    assert tokenizers.problem("m") == _download_failed(url)
    assert tokenizers.fetches == 1
    asyncio.run(tokenizers.load_due())  # not due: no new attempt
    assert tokenizers.fetches == 1
    clock.t += 5.0
    asyncio.run(tokenizers.load_due())
    assert tokenizers.fetches == 2
    clock.t += 5.0  # the backoff doubled: 10 s now
    asyncio.run(tokenizers.load_due())
    assert tokenizers.fetches == 2


def test_an_http_error_and_a_url_without_a_cache_are_reported(
    tmp_path: Path, files_server: _Files
) -> None:
    url = f"{files_server.base}/missing.json"
    listed = (parse_prefix(files_server.base),)
    tokenizers = Tokenizers(tmp_path / "tokenizers", sources=listed)
    no_cache = Tokenizers(None, sources=listed)
    for t in (tokenizers, no_cache):
        t.set_models([_served("m", FileRef(url, "b" * 64))])
        asyncio.run(t.load_due())
    assert tokenizers.problem("m") == _download_failed(url)  # not the status: the log's
    assert no_cache.problem("m") == (
        f"model m: tokenizer {url} is a URL and this control plane keeps no cache of fetched "
        "files; give tokenizer.path (an absolute path here) instead"
    )


def test_a_sim_model_needs_none_and_other_routings_load_nothing(tmp_path: Path) -> None:
    missing = FileRef(str(tmp_path / "never-read.json"))
    tokenizers = Tokenizers(tmp_path / "tokenizers")
    tokenizers.set_models(
        [
            _served("sim", None, engine="sim", routing="least-outstanding"),
            _served("plain", missing, routing="least-outstanding"),
            _served("approx", missing, routing="prefix-approx"),
            _served("no-file", None),
        ]
    )
    assert isinstance(tokenizers.for_model("sim"), SimTokenizer)  # at once
    asyncio.run(tokenizers.load_due())
    for name in ("plain", "approx", "no-file", "unknown"):
        assert tokenizers.for_model(name) is None
        assert tokenizers.problem(name) is None
    assert tokenizers.loads == 0


def test_a_model_keeps_its_tokenizer_until_its_files_change_or_it_goes(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_json)
    tokenizers = Tokenizers(None)
    tokenizers.set_models([_served("m", FileRef(str(path)))])
    asyncio.run(tokenizers.load_due())
    loaded = tokenizers.for_model("m")
    assert loaded is not None
    tokenizers.set_models([_served("m", FileRef(str(path)))])
    assert tokenizers.for_model("m") is loaded
    template = tmp_path / "chat.jinja"
    template.write_bytes(CHATML.encode())
    tokenizers.set_models([_served("m", FileRef(str(path)), FileRef(str(template)))])
    assert tokenizers.for_model("m") is None  # until the new one loads
    asyncio.run(tokenizers.load_due())
    reloaded = tokenizers.for_model("m")
    assert isinstance(reloaded, HfTokenizer) and reloaded.template_text == CHATML
    tokenizers.set_models([])
    assert tokenizers.for_model("m") is None and tokenizers.problem("m") is None


def test_run_loads_in_the_background_when_told_the_models(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_json)

    async def main() -> None:
        tokenizers = Tokenizers(None)
        task = asyncio.create_task(tokenizers.run())
        try:
            await asyncio.sleep(0)
            tokenizers.set_models([_served("m", FileRef(str(path)))])
            for _ in range(500):
                if tokenizers.for_model("m") is not None:
                    break
                await asyncio.sleep(0.01)
            assert isinstance(tokenizers.for_model("m"), HfTokenizer)
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())


def test_the_serving_cache_tells_the_models_with_their_profiles_files(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_json)
    digest = _sha(tokenizer_json)
    with Store.open(tmp_path / "llmgw.db") as store:
        store.put_catalog_model(
            "routed",
            {
                "default": {
                    "engine": "vllm",
                    "gpus": 1,
                    "routing": "kv-events",
                    "tokenizer": {"path": str(path), "sha256": digest},
                    "chat_template": {"url": "https://example.com/t.jinja", "sha256": "c" * 64},
                }
            },
        )
        store.put_model("plain", engine="sim", params={}, replicas=1)
        cache = ServingCache(store, max_request_body=1000)
        told: list[list[ServedModel]] = []
        cache.on_models = told.append
        cache.refresh_models()
    assert len(told) == 1
    served = {m.name: m for m in told[0]}
    assert served["routed"].routing == "kv-events"
    assert served["routed"].tokenizer == FileRef(str(path), digest)
    assert served["routed"].chat_template == FileRef("https://example.com/t.jinja", "c" * 64)
    assert served["plain"].routing == "least-outstanding"
    assert served["plain"].tokenizer is None and served["plain"].chat_template is None


# --- the prompt of a chat resumed as a completion (llmgw.server.gateway.resume) -------------


def test_chat_prompt_is_the_routing_render_without_its_bos_text(tokenizer_json: bytes) -> None:
    tok = HfTokenizer.from_files(tokenizer_json, CHATML.encode())
    assert tok.specials["bos_token"] == "<s>"
    payload: dict[str, Any] = {"messages": [{"role": "user", "content": "hello world"}]}
    whole = tok.render(payload["messages"])
    assert whole == "<s><|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert tok.chat_prompt(payload) == whole.removeprefix("<s>")
    # The request's own add_generation_prompt is followed, as for routing.
    assert tok.chat_prompt({**payload, "add_generation_prompt": False}) == (
        "<|im_start|>user\nhello world<|im_end|>\n"
    )
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.chat_prompt({**payload, "tools": tools}) is None
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]
    assert tok.chat_prompt({"messages": image}) is None
    assert tok.chat_prompt({"messages": [{"role": "tool", "content": "x"}]}) is None  # refused
    assert HfTokenizer.from_files(tokenizer_json).chat_prompt(payload) is None  # no template


def test_a_template_loads_for_resuming_on_an_engine_without_continue_final_message(
    tmp_path: Path, tokenizer_json: bytes
) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(tokenizer_json)
    template = tmp_path / "chat_template.jinja"
    template.write_bytes(CHATML.encode())
    tok, chatml = FileRef(str(path)), FileRef(str(template))
    tokenizers = Tokenizers(None, clock=Clock())
    tokenizers.set_models(
        [
            _served("llama", tok, chatml, engine="llamacpp", routing="least-outstanding"),
            _served("llama-bare", tok, engine="llamacpp", routing="least-outstanding"),
            _served("vllm", tok, chatml, routing="least-outstanding"),  # continues a message
        ]
    )
    asyncio.run(tokenizers.load_due())
    assert tokenizers.loads == 1
    assert tokenizers.chat_prompt("llama") is not None
    assert tokenizers.chat_prompt("llama-bare") is None
    assert tokenizers.chat_prompt("vllm") is None
    assert tokenizers.chat_prompt("absent") is None
