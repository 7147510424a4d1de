"""The ``sim`` engine's endpoints that generate nothing: ``/v1/embeddings`` (OpenAI's shape),
``/v1/rerank`` and ``/v1/score`` (vLLM's, which Jina's and Cohere's clients speak), and
``/tokenize`` and ``/detokenize`` (vLLM's), all deterministic.

An embedding is a unit vector (L2 norm 1) drawn from a generator seeded with the model and
the text, so the same text always embeds the same and any two texts differently; a request's
``dimensions`` takes the first ones of it, scaled back to norm 1 (as OpenAI's shortened
embeddings are). A relevance score is the overlap of the two texts' words (the cosine of their
sets of lower-cased words): a document sharing the query's words ranks first. Token counts
(``usage``) are words, as the chat endpoints count them; ``/tokenize`` is the vocabulary of
:mod:`llmgw.sim.generate`.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import re
import struct
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from llmgw.sim.config import SimConfig, is_int
from llmgw.sim.generate import VOCAB_SIZE, detokenize, tokenize
from llmgw.sim.protocol import BadRequest, dumps, missing, parse_body, positive_int

__all__ = ["MAX_INPUTS", "MAX_MODEL_LEN", "PoolingHandlers", "embed", "relevance"]

MAX_INPUTS = 2048
"""The most texts one embeddings, rerank or score request may carry (OpenAI's limit)."""

MAX_MODEL_LEN = 32768
"""The context length ``/tokenize`` reports: sim has none, this is what it says."""

_WORD = re.compile(r"\w+")


def embed(model: str, text: str, dimensions: int, length: int) -> list[float]:
    """The first ``dimensions`` of ``text``'s ``length``-long embedding for ``model``, with
    L2 norm 1."""
    # SHAKE-128 of the model and text, read as 32-bit numbers in [-1, 1): fast, and the
    # first components do not depend on the length asked for.
    stream = hashlib.shake_128(f"{model}\x00{text}".encode("utf-8", "surrogatepass"))
    count = min(dimensions, length)
    raw = struct.unpack(f"<{count}I", stream.digest(4 * count))
    vector = [x / 2147483648.0 - 1.0 for x in raw]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def relevance(query: str, document: str) -> float:
    """How much ``document`` is about ``query``, in [0, 1]: the cosine of their sets of
    lower-cased words (1: the same words, 0: none in common)."""
    q = set(_WORD.findall(query.lower()))
    d = set(_WORD.findall(document.lower()))
    if not q or not d:
        return 0.0
    return len(q & d) / math.sqrt(len(q) * len(d))


def _words(text: str) -> int:
    return len(text.split())


class PoolingHandlers:
    """The handlers of one engine's embeddings, rerank, score and tokenizer endpoints."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/embeddings", self.embeddings),
            web.post("/v1/rerank", self.rerank),
            web.post("/v1/score", self.score),
            web.post("/tokenize", self.tokenize),
            web.post("/detokenize", self.detokenize),
        ]

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), self.cfg.model)
            texts = _embedding_inputs(body.get("input"))
            dimensions = positive_int(body, "dimensions") or self.cfg.embedding_dim
            if dimensions > self.cfg.embedding_dim:
                raise BadRequest(
                    f"'dimensions' must be at most {self.cfg.embedding_dim} for this model "
                    f"(its embeddings' length), got {dimensions}",
                    "dimensions",
                )
            encoding = body.get("encoding_format") or "float"
            if encoding not in ("float", "base64"):
                raise BadRequest(
                    f"'encoding_format' must be 'float' or 'base64', got {encoding!r}",
                    "encoding_format",
                )
        except BadRequest as e:
            return e.response()
        data = []
        for index, text in enumerate(texts):
            vector = embed(self.cfg.model, text, dimensions, self.cfg.embedding_dim)
            value: list[float] | str = vector
            if encoding == "base64":
                # Little-endian float32, as OpenAI sends it (and its client decodes it).
                value = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(_words(text) for text in texts)
        return _json(
            {
                "object": "list",
                "data": data,
                "model": self.cfg.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def rerank(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), self.cfg.model)
            query = body.get("query")
            if query is None:
                raise missing("query")
            if not isinstance(query, str) or not query:
                raise BadRequest("'query' must be a non-empty string", "query")
            documents = _documents(body.get("documents"))
            top_n = positive_int(body, "top_n") or len(documents)
            return_documents = body.get("return_documents", True)
            if not isinstance(return_documents, bool):
                raise BadRequest(
                    f"'return_documents' must be a boolean, got {return_documents!r}",
                    "return_documents",
                )
        except BadRequest as e:
            return e.response()
        scored = sorted(
            ((relevance(query, doc), index) for index, doc in enumerate(documents)),
            key=lambda pair: (-pair[0], pair[1]),
        )
        results = []
        for score, index in scored[:top_n]:
            result: dict[str, Any] = {"index": index, "relevance_score": score}
            if return_documents:
                result["document"] = {"text": documents[index]}
            results.append(result)
        tokens = sum(_words(query) + _words(doc) for doc in documents)
        return _json(
            {
                "id": "rerank-" + os.urandom(12).hex(),
                "model": self.cfg.model,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )

    async def score(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), self.cfg.model)
            firsts = _texts(body.get("text_1"), "text_1")
            seconds = _texts(body.get("text_2"), "text_2")
            if len(firsts) == 1:
                firsts = firsts * len(seconds)
            elif len(firsts) != len(seconds):
                raise BadRequest(
                    f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one "
                    "text_1 to score against every text_2, or as many of each (scored in pairs)",
                    "text_2",
                )
        except BadRequest as e:
            return e.response()
        data = [
            {"index": i, "object": "score", "score": relevance(a, b)}
            for i, (a, b) in enumerate(zip(firsts, seconds, strict=True))
        ]
        tokens = sum(_words(a) + _words(b) for a, b in zip(firsts, seconds, strict=True))
        return _json(
            {
                "id": "score-" + os.urandom(12).hex(),
                "object": "list",
                "created": int(time.time()),
                "model": self.cfg.model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), self.cfg.model)
            if body.get("messages") is not None:
                text = _messages_text(body["messages"])
            else:
                prompt = body.get("prompt")
                if prompt is None:
                    raise BadRequest(
                        "give 'prompt' (a string) or 'messages' (chat messages) to tokenize",
                        "prompt",
                        code="missing_required_parameter",
                    )
                if not isinstance(prompt, str):
                    raise BadRequest(f"'prompt' must be a string, got {prompt!r}", "prompt")
                text = prompt
        except BadRequest as e:
            return e.response()
        tokens = tokenize(text)
        return _json(
            {
                "count": len(tokens),
                "max_model_len": MAX_MODEL_LEN,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read(), self.cfg.model)
            tokens = body.get("tokens")
            if tokens is None:
                raise missing("tokens")
            ids = _token_ids(tokens, "tokens")
            text = _detokenized(ids, "tokens")
        except BadRequest as e:
            return e.response()
        return _json({"prompt": text})


def _json(obj: dict[str, Any]) -> web.Response:
    return web.Response(body=dumps(obj).encode(), content_type="application/json")


def _embedding_inputs(value: object) -> list[str]:
    """OpenAI's ``input``: a string, strings, token ids or lists of token ids (the text of
    the ids is what is embedded, so ids embed as their text does)."""
    if value is None:
        raise missing("input")
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list) and value and all(is_int(v) for v in value):
        items = [value]
    elif isinstance(value, list):
        items = list(value)
    else:
        raise BadRequest(_INPUT_SHAPE, "input")
    if not items:
        raise BadRequest("'input' must not be empty; " + _INPUT_SHAPE, "input")
    if len(items) > MAX_INPUTS:
        raise BadRequest(
            f"'input' has {len(items)} items; at most {MAX_INPUTS} per request", "input"
        )
    single = isinstance(value, str) or (len(items) == 1 and items[0] is value)
    texts: list[str] = []
    for index, item in enumerate(items):
        where = "input" if single else f"input[{index}]"
        if isinstance(item, str):
            if not item:
                raise BadRequest(f"'{where}' must not be an empty string", where)
            texts.append(item)
        elif isinstance(item, list):
            if not item:
                raise BadRequest(f"'{where}' must not be an empty list of token ids", where)
            texts.append(_detokenized(_token_ids(item, where), where))
        else:
            raise BadRequest(_INPUT_SHAPE, where)
    return texts


_INPUT_SHAPE = (
    "'input' must be a string, an array of strings, an array of token ids, or an array of "
    "arrays of token ids"
)


def _token_ids(value: object, where: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise BadRequest(f"'{where}' must be an array of token ids (integers)", where)
    return [int(v) for v in value]


def _detokenized(ids: Sequence[int], where: str) -> str:
    try:
        return detokenize(ids)
    except ValueError as exc:
        raise BadRequest(
            f"'{where}': {exc} (this model's vocabulary has {VOCAB_SIZE} tokens)", where
        ) from None


def _documents(value: object) -> list[str]:
    """Rerank's ``documents``: strings, or objects with a ``text`` (Cohere's and Jina's)."""
    if value is None:
        raise missing("documents")
    if not isinstance(value, list) or not value:
        raise BadRequest("'documents' must be a non-empty array of strings", "documents")
    if len(value) > MAX_INPUTS:
        raise BadRequest(
            f"'documents' has {len(value)} items; at most {MAX_INPUTS} per request", "documents"
        )
    out: list[str] = []
    for index, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):
            item = item["text"]
        if not isinstance(item, str):
            raise BadRequest(
                f"'documents[{index}]' must be a string (or an object with a 'text')",
                f"documents[{index}]",
            )
        out.append(item)
    return out


def _texts(value: object, name: str) -> list[str]:
    """Score's ``text_1`` or ``text_2``: a string or a non-empty array of strings."""
    if value is None:
        raise missing(name)
    if isinstance(value, str):
        return [value]
    if (
        isinstance(value, list)
        and value
        and len(value) <= MAX_INPUTS
        and all(isinstance(v, str) for v in value)
    ):
        return list(value)
    raise BadRequest(f"'{name}' must be a string or an array of 1 to {MAX_INPUTS} strings", name)


def _messages_text(messages: object) -> str:
    """The text a chat's messages tokenize as: their contents, one a line (sim has no chat
    template)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array of {role, content}", "messages")
    parts: list[str] = []
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            content = "".join(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        if not isinstance(content, str):
            raise BadRequest(
                f"'messages[{index}].content' must be a string or an array of text parts",
                f"messages[{index}].content",
            )
        parts.append(content)
    return "\n".join(parts)
