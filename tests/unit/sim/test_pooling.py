"""The sim engine's embeddings, rerank, score and tokenizer endpoints, over a real socket:
the official OpenAI client's embeddings (base64, its default, and float), vLLM's shapes for
the others, and OpenAI-shaped refusals."""

from __future__ import annotations

import base64
import json
import math
import struct
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from llmgw.sim.config import SimConfig
from llmgw.sim.generate import VOCAB_SIZE, tokenize
from llmgw.sim.pooling import MAX_INPUTS, MAX_MODEL_LEN, embed, relevance
from tests.unit.sim.running import running

MODEL = "llmgw-sim"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with running(SimConfig(port=0, embedding_dim=64)) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


def post(base_url: str, path: str, body: Any) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        base_url + path, data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


# --------------------------------------------------------------------------- embeddings


def test_the_openai_client_decodes_its_default_base64_embeddings(client: openai.OpenAI) -> None:
    result = client.embeddings.create(model=MODEL, input=["the river", "a stone bridge"])
    assert [e.index for e in result.data] == [0, 1]
    first, second = (e.embedding for e in result.data)
    assert len(first) == len(second) == 64
    assert math.isclose(norm(first), 1.0, rel_tol=1e-6)
    assert first != second
    assert result.model == MODEL
    assert (result.usage.prompt_tokens, result.usage.total_tokens) == (5, 5)
    # float32 on the wire: the same vector as the float form, to float32 precision.
    floats = client.embeddings.create(model=MODEL, input="the river", encoding_format="float")
    assert all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
        for a, b in zip(first, floats.data[0].embedding, strict=True)
    )


def test_base64_is_little_endian_float32(base_url: str) -> None:
    status, body = post(
        base_url,
        "/v1/embeddings",
        {"model": MODEL, "input": "the river", "encoding_format": "base64"},
    )
    assert status == 200
    raw = base64.b64decode(body["data"][0]["embedding"])
    assert len(raw) == 4 * 64
    vector = struct.unpack("<64f", raw)
    expected = embed(MODEL, "the river", 64, 64)
    assert all(
        math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-7)
        for a, b in zip(vector, expected, strict=True)
    )


def test_embeddings_are_deterministic_and_token_ids_embed_as_their_text(
    client: openai.OpenAI,
) -> None:
    def one(value: Any) -> list[float]:
        result = client.embeddings.create(model=MODEL, input=value, encoding_format="float")
        return result.data[0].embedding

    assert one("the river") == one("the river")
    assert one(tokenize("the river")) == one("the river")
    many = client.embeddings.create(
        model=MODEL, input=[tokenize("the river"), tokenize("x")], encoding_format="float"
    )
    assert [e.embedding for e in many.data] == [one("the river"), one("x")]
    # Another model, another vector.
    assert embed("other", "the river", 64, 64) != embed(MODEL, "the river", 64, 64)


def test_dimensions_take_the_first_ones_scaled_to_norm_1(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model=MODEL, input="the river", encoding_format="float")
    short = client.embeddings.create(
        model=MODEL, input="the river", dimensions=8, encoding_format="float"
    )
    vector = short.data[0].embedding
    assert len(vector) == 8 and math.isclose(norm(vector), 1.0, rel_tol=1e-9)
    head = full.data[0].embedding[:8]
    assert all(math.isclose(a, b / norm(head)) for a, b in zip(vector, head, strict=True))


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({}, "input", "'input' is required"),
        ({"input": ""}, "input", "'input' must not be an empty string"),
        ({"input": []}, "input", "'input' must not be empty"),
        ({"input": ["a", ""]}, "input[1]", "'input[1]' must not be an empty string"),
        ({"input": [[]]}, "input[0]", "must not be an empty list of token ids"),
        ({"input": [1, "a"]}, "input[0]", "'input' must be a string, an array of strings"),
        ({"input": 7}, "input", "'input' must be a string, an array of strings"),
        ({"input": [VOCAB_SIZE]}, "input", f"token id {VOCAB_SIZE} is not in"),
        ({"input": ["a"] * (MAX_INPUTS + 1)}, "input", f"at most {MAX_INPUTS} per request"),
        ({"input": "a", "dimensions": 65}, "dimensions", "must be at most 64 for this model"),
        ({"input": "a", "dimensions": 0}, "dimensions", "must be a positive integer"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", "'float' or 'base64'"),
    ],
)
def test_bad_embedding_requests_are_refused_openai_style(
    base_url: str, body: dict[str, Any], param: str, message: str
) -> None:
    status, answer = post(base_url, "/v1/embeddings", {"model": MODEL, **body})
    assert status == 400
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"], error["message"]


def test_the_openai_client_raises_on_a_refusal(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="must be at most 64"):
        client.embeddings.create(model=MODEL, input="a", dimensions=1000)
    with pytest.raises(openai.NotFoundError, match="this engine serves 'llmgw-sim'"):
        client.embeddings.create(model="other", input="a")


# --------------------------------------------------------------------------- rerank, score


def test_rerank_puts_the_obviously_relevant_document_first(base_url: str) -> None:
    documents = [
        "a recipe for bread",
        "the green river runs through the valley",
        "river",
        "nothing in common",
    ]
    status, body = post(
        base_url,
        "/v1/rerank",
        {"model": MODEL, "query": "green river valley", "documents": documents},
    )
    assert status == 200
    assert body["model"] == MODEL and body["id"].startswith("rerank-")
    assert [r["index"] for r in body["results"]] == [1, 2, 0, 3]
    scores = [r["relevance_score"] for r in body["results"]]
    assert scores == sorted(scores, reverse=True) and scores[-1] == 0.0
    assert body["results"][0]["document"] == {"text": documents[1]}
    assert body["usage"]["total_tokens"] == 3 * 4 + sum(len(d.split()) for d in documents)


def test_rerank_top_n_return_documents_and_cohere_documents(base_url: str) -> None:
    status, body = post(
        base_url,
        "/v1/rerank",
        {
            "model": MODEL,
            "query": "stone bridge",
            "documents": [{"text": "a river"}, {"text": "the stone bridge"}, "bridge"],
            "top_n": 2,
            "return_documents": False,
        },
    )
    assert status == 200
    assert [r["index"] for r in body["results"]] == [1, 2]
    assert all("document" not in r for r in body["results"])


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q"}, "documents"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", 3]}, "documents[1]"),
        ({"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents"),
    ],
)
def test_bad_rerank_requests_are_refused(base_url: str, body: dict[str, Any], param: str) -> None:
    status, answer = post(base_url, "/v1/rerank", {"model": MODEL, **body})
    assert (status, answer["error"]["param"]) == (400, param)


def test_score_one_against_many_and_pairwise(base_url: str) -> None:
    status, body = post(
        base_url,
        "/v1/score",
        {"model": MODEL, "text_1": "green river", "text_2": ["the green river", "stone"]},
    )
    assert status == 200
    assert (body["object"], body["model"]) == ("list", MODEL)
    assert body["id"].startswith("score-") and isinstance(body["created"], int)
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "score"), (1, "score")]
    assert body["data"][0]["score"] == relevance("green river", "the green river") > 0
    assert body["data"][1]["score"] == 0.0
    assert body["usage"] == {"prompt_tokens": 8, "total_tokens": 8, "completion_tokens": 0}
    status, body = post(
        base_url, "/v1/score", {"model": MODEL, "text_1": ["a b", "c"], "text_2": ["a b", "d"]}
    )
    assert [d["score"] for d in body["data"]] == [1.0, 0.0]


def test_score_refuses_lists_of_different_lengths(base_url: str) -> None:
    status, answer = post(
        base_url, "/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]}
    )
    assert status == 400
    assert answer["error"]["message"] == (
        "'text_1' has 2 texts and 'text_2' 3: give one text_1 to score against every text_2, "
        "or as many of each (scored in pairs)"
    )
    status, answer = post(base_url, "/v1/score", {"model": MODEL, "text_1": "a"})
    assert (status, answer["error"]["param"]) == (400, "text_2")


def test_relevance_is_the_cosine_of_word_sets() -> None:
    assert relevance("The River", "river the") == 1.0
    assert relevance("a b", "a c") == 0.5
    assert relevance("", "a") == relevance("a", "!!") == 0.0


# --------------------------------------------------------------------------- tokenizer


def test_tokenize_and_detokenize_round_trip_like_vllm(base_url: str) -> None:
    text = "Quiet river, the émigré"
    status, body = post(base_url, "/tokenize", {"model": MODEL, "prompt": text})
    assert status == 200
    assert body == {
        "count": len(tokenize(text)),
        "max_model_len": MAX_MODEL_LEN,
        "tokens": tokenize(text),
        "token_strs": None,
    }
    status, back = post(base_url, "/detokenize", {"model": MODEL, "tokens": body["tokens"]})
    assert (status, back) == (200, {"prompt": text})


def test_tokenize_messages_is_their_contents_a_line_each(base_url: str) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "the river"}]},
    ]
    status, body = post(base_url, "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200
    assert body["tokens"] == tokenize("be brief\nthe river")


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("/tokenize", {}, "prompt", "give 'prompt' (a string) or 'messages'"),
        ("/tokenize", {"prompt": ["a"]}, "prompt", "'prompt' must be a string"),
        ("/tokenize", {"messages": []}, "messages", "non-empty array"),
        ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content", "a string"),
        ("/detokenize", {}, "tokens", "'tokens' is required"),
        ("/detokenize", {"tokens": ["a"]}, "tokens", "must be an array of token ids"),
        ("/detokenize", {"tokens": [-1]}, "tokens", f"{VOCAB_SIZE} tokens"),
    ],
)
def test_bad_tokenizer_requests_are_refused(
    base_url: str, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    status, answer = post(base_url, path, {"model": MODEL, **body})
    assert (status, answer["error"]["param"]) == (400, param)
    assert message in answer["error"]["message"]


@pytest.mark.parametrize(
    "path", ["/v1/embeddings", "/v1/rerank", "/v1/score", "/tokenize", "/detokenize"]
)
def test_every_endpoint_checks_the_body_and_the_model(base_url: str, path: str) -> None:
    status, answer = post(base_url, path, b"{not json")
    assert status == 400 and "not valid JSON" in answer["error"]["message"]
    status, answer = post(base_url, path, {"input": "a"})
    assert (status, answer["error"]["code"]) == (400, "missing_required_parameter")
    status, answer = post(base_url, path, {"model": "other"})
    assert (status, answer["error"]["code"]) == (404, "model_not_found")
