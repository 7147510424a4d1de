"""A stream that survives its replica: when a streamed chat or completion breaks after its
first token (the engine killed, the agent gone, the data-plane connection reset), the gateway
continues it on another ready replica of the model, and the client's stream goes on as one.

Three pieces, each testable alone:

- :func:`plan` decides, when the request arrives, whether its stream could be resumed at all
  (one choice, no logprobs, an engine that continues a message, the model's profile not
  ``resume: false``), from the body the gateway parsed anyway;
- :class:`StreamSplice` follows the events relayed to the client (the text so far, the stream's
  ``id`` and ``created``, tool calls begun, the end) and, in a resumed part, rewrites the new
  replica's events into the first part's stream: the same ``id``, ``created`` and choice
  index, its role chunk left out, its usage summed with the parts before (see
  :meth:`StreamSplice.summed`);
- :func:`resumed_body` is the request the next replica gets: for chat, the same messages and
  the partial answer as a final assistant message with ``continue_final_message: true`` and
  ``add_generation_prompt: false`` (vLLM's and SGLang's way; the sim's too); for completions,
  the prompt and the text so far. ``max_tokens`` (and ``max_completion_tokens``,
  ``min_tokens``) reduced by the tokens already sent; the sampling parameters and the seed as
  they were.

Engines without ``continue_final_message`` (llama.cpp and the others) resume a chat when the
gateway holds the model's chat template (its profile's ``tokenizer`` and ``chat_template``,
:class:`~llmgw.server.gateway.tokenizing.HfTokenizer`): the next replica gets a *completions*
request (:func:`completion_body`) whose prompt is the chat rendered as for routing and the text
so far, and its completion chunks reach the client as the chat's chunks. Without the template,
or with tools or parts other than text, their chat streams are not resumed (reason
``engine``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw.contracts.resuming import DEFAULT_MAX_RESUMES
from llmgw.http.errors import UpstreamError, UpstreamTimeout
from llmgw.http.relay import LineEnds, error_event

__all__ = [
    "CHAT_RESUMING_ENGINES",
    "DEFAULT_MAX_RESUMES",
    "RESUMABLE_PATHS",
    "ChatPrompt",
    "ResumePlan",
    "StreamBroken",
    "StreamSplice",
    "cause_of",
    "completion_body",
    "ended_early",
    "not_resumed",
    "plan",
    "resumed_body",
    "splice_for",
]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESUMABLE_PATHS = frozenset({CHAT, COMPLETIONS})

CHAT_RESUMING_ENGINES = frozenset({"vllm", "sglang", "sim"})
"""The engines whose chat endpoint takes ``continue_final_message``: the answer goes on from
the assistant's partial message. The sim's is the uninterrupted text for a seed; vLLM's and
SGLang's only with greedy sampling (and up to their own nondeterminism and the partial text
tokenized again): a seed starts a new draw at the resume point."""

ChatPrompt = Callable[[Mapping[str, Any]], str | None]
"""A chat request's prompt text as its model's template renders it (None: it cannot)."""

# A chat's fields that a completions request has no use for (or that an engine would refuse
# there); ``max_completion_tokens`` becomes ``max_tokens``.
_CHAT_ONLY = (
    "messages",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "reasoning_effort",
    "modalities",
    "audio",
    "prediction",
    "store",
    "metadata",
    "web_search_options",
    "max_completion_tokens",
)

_MAX_EVENT = 1024 * 1024
_DUMPS = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


class StreamBroken(UpstreamError):
    """The replica's stream ended early without the connection breaking: it sent an error
    event (its agent's, when the engine died under it) or ended without ``[DONE]``."""

    def __init__(self, message: str, cause: str) -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """What a stream's resumption needs to know from its request: the endpoint's kind, and
    the most resumes; ``blocker``: why it cannot be resumed (None: it can); ``render``: a
    chat's prompt renderer when its engine does not continue a message (its resumed parts
    are then completions)."""

    chat: bool
    max_resumes: int
    blocker: str | None = None
    render: ChatPrompt | None = None


def plan(
    path: str,
    payload: Mapping[str, Any],
    engine: str,
    max_resumes: int | None,
    render: ChatPrompt | None = None,
) -> ResumePlan | None:
    """Whether a stream of ``payload`` to ``path`` on a model of ``engine`` may be resumed;
    ``max_resumes`` is the profile's (0: resume off; None: the default); ``render``: the
    model's chat template, when the gateway holds it (used only for an engine that does not
    continue a message). None for a request that is not a streamed chat or completion."""
    if payload.get("stream") is not True or path not in (CHAT, COMPLETIONS):
        return None
    chat = path == CHAT
    most = DEFAULT_MAX_RESUMES if max_resumes is None else max_resumes
    if not chat or engine in CHAT_RESUMING_ENGINES:
        render = None
    blocker = _blocker(chat, payload, engine, most, render is not None)
    return ResumePlan(chat, most, blocker, render)


def _blocker(
    chat: bool, payload: Mapping[str, Any], engine: str, most: int, renders: bool
) -> str | None:
    if most < 1:
        return "off"
    n = payload.get("n")
    if n not in (None, 1) or payload.get("best_of") not in (None, 1):
        return "n"  # several choices interleave: one replica's draw cannot continue them all
    if payload.get("logprobs") not in (None, False, 0) or payload.get("top_logprobs"):
        return "logprobs"  # the resumed part's would be of another prompt
    if chat:
        if engine not in CHAT_RESUMING_ENGINES and (not renders or payload.get("tools")):
            return "engine"  # no template to render its prompt with, or tools it cannot
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages or payload.get("continue_final_message"):
            return "prompt"
        return None
    prompt = payload.get("prompt")
    if not isinstance(prompt, str) or payload.get("echo") or payload.get("suffix"):
        return "prompt"  # a list of prompts, token ids, the prompt echoed, an insertion
    return None


def splice_for(
    path: str,
    payload: Mapping[str, Any],
    engine: str,
    max_resumes: int | None,
    render: ChatPrompt | None = None,
) -> StreamSplice | None:
    """What follows a stream that may be resumed on another replica; None when it is not a
    streamed chat or completion, or its model's profile turns resuming off (the gateway then
    reads nothing of the stream)."""
    resume = plan(path, payload, engine, max_resumes, render)
    if resume is None or resume.blocker == "off":
        return None
    return StreamSplice(resume)


def cause_of(exc: Exception) -> str:
    """What broke a stream, as ``llmgw_stream_resumes_total`` says it."""
    if isinstance(exc, StreamBroken):
        return exc.cause
    return "timeout" if isinstance(exc, UpstreamTimeout) else "reset"


async def ended_early(
    started: web.StreamResponse, model: str, failure: Exception
) -> web.StreamResponse:
    """A stream that found no replica to go on with ends with the error event of its
    ``failure``, as a stream that is not resumed ends."""
    message = f"the stream ended early: {failure}; no other replica of {model} is ready"
    with contextlib.suppress(ConnectionError):  # the client may be gone
        await started.write(error_event(message))
    return started


async def not_resumed(started: web.StreamResponse, failure: Exception) -> web.StreamResponse:
    """A stream found not to go on only once its next request was made (its limit spent,
    its chat not rendered) ends with the error event it would have had unresumed (the relay
    left it out, the stream then meant to go on)."""
    with contextlib.suppress(ConnectionError):  # the client may be gone
        await started.write(error_event(f"the stream ended early: {failure}"))
    return started


def resumed_body(body: bytes, chat: bool, text: str, sent: int) -> bytes | None:
    """The request that continues ``body`` (as forwarded) after ``sent`` tokens whose text is
    ``text``; None when its limit is spent (the answer ended with it). Nothing sent yet (the
    stream broke before its first token): ``body`` itself, asked again."""
    if sent == 0:
        return body
    payload = json.loads(body)
    for name in ("max_tokens", "max_completion_tokens"):
        limit = payload.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if limit - sent < 1:
                return None
            payload[name] = limit - sent
    least = payload.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least:
        payload["min_tokens"] = max(0, least - sent)
    if chat:
        payload["messages"] = [*payload["messages"], {"role": "assistant", "content": text}]
        payload["continue_final_message"] = True
        payload["add_generation_prompt"] = False
    else:
        payload["prompt"] = payload["prompt"] + text
    return _DUMPS(payload).encode()


def completion_body(body: bytes, text: str, sent: int, render: ChatPrompt) -> bytes | str:
    """The completions request that continues the chat ``body`` (as forwarded) after ``sent``
    tokens whose text is ``text``, on an engine without ``continue_final_message``: its
    prompt the chat rendered by ``render`` and ``text``, its sampling parameters and seed
    the chat's, ``max_tokens`` less ``sent``. Or why there is none: ``"limit"`` (the limit
    was spent), ``"engine"`` (the template does not render this chat)."""
    payload = json.loads(body)
    prompt = render(payload)
    if prompt is None:
        return "engine"
    limit = payload.get("max_completion_tokens", payload.get("max_tokens"))
    for name in _CHAT_ONLY:
        payload.pop(name, None)
    if isinstance(limit, int) and not isinstance(limit, bool):
        if limit - sent < 1:
            return "limit"
        payload["max_tokens"] = limit - sent
    least = payload.get("min_tokens")
    if isinstance(least, int) and not isinstance(least, bool) and least:
        payload["min_tokens"] = max(0, least - sent)
    payload["prompt"] = prompt + text
    return _DUMPS(payload).encode()


class StreamSplice:
    """Follows an event stream relayed to its client, and joins the parts of a resumed one.

    :meth:`feed` passes whole events only (the part of one a chunk ends inside is held until
    it ends, so that a stream cut mid-event sends none of that event and its text is neither
    lost nor doubled). The first part's events pass as they came; a later part's are
    rewritten (:meth:`_rewrite`). An error event from the replica, or its end without
    ``[DONE]``, raises :class:`StreamBroken` instead of reaching the client (at the end of
    the body, :meth:`end`: the events before it in the same chunk are sent first, and what
    follows it is not)."""

    def __init__(self, resume: ResumePlan) -> None:
        self.plan = resume
        self.part = 0  # how many times the stream was resumed
        self.id: Any = None
        self.created: Any = None
        self.model: Any = None
        self.completions = False  # the current part is a completion continuing a chat
        self.pieces: list[str] = []  # the text sent, in pieces
        self.sent = 0  # content events sent (a token each), all parts
        self.before = 0  # of those, sent before the current part
        self.finished = False  # a finish_reason was sent
        self.done = False  # [DONE] was sent
        self.blocker = resume.blocker  # why it cannot be resumed (tool calls begun...)
        self._held = b""
        self._ends = LineEnds()
        self._role_seen = False  # the current part's role chunk (a later part's is dropped)
        self._error: StreamBroken | None = None  # the replica's error event, raised at the end

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def why_not(self) -> str | None:
        """Why the stream, broken now, cannot be resumed; None when it can."""
        if self.blocker is not None:
            return self.blocker
        if self.finished:
            return "finished"
        if self.part >= self.plan.max_resumes:
            return "max_resumes"
        return None

    def goes_on(self, exc: UpstreamError) -> bool:
        """The stream broke with ``exc``: whether it will be resumed (then the client gets no
        error event now)."""
        return self.why_not() is None

    def next_body(self, body: bytes) -> tuple[str, bytes] | str:
        """The path and body that continue the stream whose first request was ``body``; or
        why there are none (``limit``, ``engine``). Call :meth:`next_part` before the next
        part's events."""
        render = self.plan.render
        if render is None or self.sent == 0:
            path = CHAT if self.plan.chat else COMPLETIONS
            again = resumed_body(body, self.plan.chat, self.text, self.sent)
            return "limit" if again is None else (path, again)
        made = completion_body(body, self.text, self.sent, render)
        return made if isinstance(made, str) else (COMPLETIONS, made)

    def next_part(self, path: str = "") -> None:
        """The stream goes on with another replica's answer (to ``path``: a completion
        continuing a chat is translated into the chat's chunks)."""
        self.completions = self.plan.chat and path == COMPLETIONS
        self.part += 1
        self.before = self.sent
        self._held = b""
        self._ends = LineEnds()
        self._role_seen = False
        self._error = None

    # -- the events --------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> bytes:
        """What of ``chunk`` to send now."""
        if self._error is not None:
            return b""  # after the replica's error event: nothing more of this part
        data = self._held + self._ends.lf(chunk)
        cut = data.rfind(b"\n\n")
        if cut < 0:
            if len(data) > _MAX_EVENT:
                raise StreamBroken("an event of the stream is over 1 MiB", "error")
            self._held = data
            return b""
        self._held = data[cut + 2 :]
        out: list[bytes] = []
        for event in data[: cut + 2].split(b"\n\n"):
            if event:
                kept = self._event(event)
                if self._error is not None:
                    break
                if kept is not None:
                    out.append(kept + b"\n\n")
        return b"".join(out)

    def end(self) -> None:
        """The replica's stream ended: :class:`StreamBroken` unless it was whole."""
        if self._error is not None:
            raise self._error
        if not self.done:
            raise StreamBroken("the replica's stream ended without [DONE]", "eof")

    def _event(self, event: bytes) -> bytes | None:
        at = event.find(b"data:")
        if at < 0 or (at > 0 and event[at - 1 : at] != b"\n"):
            return event  # a comment or another field: as it came
        data = event[at + 5 :].strip()
        if data == b"[DONE]":
            self.done = True
            return event
        try:
            obj = json.loads(data)
        except ValueError:
            return event
        if not isinstance(obj, dict):
            return event
        error = obj.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            self._error = StreamBroken(f"the replica sent an error: {message}", "error")
            return None
        choices = obj.get("choices")
        if isinstance(choices, list):
            self._follow(choices)
        if self.id is None:
            self.id, self.created = obj.get("id"), obj.get("created")
            self.model = obj.get("model")
        if self.part == 0:
            return event
        return self._rewrite(obj)

    def _follow(self, choices: list[Any]) -> None:
        """The text, tool calls and end the choices carry."""
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            if self.plan.chat and not self.completions:
                delta = choice.get("delta")
                delta = delta if isinstance(delta, dict) else {}
                content = delta.get("content")
                if delta.get("tool_calls") or delta.get("function_call"):
                    self.blocker = "tool_calls"
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.blocker = "reasoning"  # continuing it would need the reasoning back
            else:
                content = choice.get("text")
            if isinstance(content, str) and content:
                self.pieces.append(content)
                self.sent += 1
            if choice.get("finish_reason") is not None:
                self.finished = True

    def _rewrite(self, obj: dict[str, Any]) -> bytes | None:
        """A later part's event as the first part's stream carries it; None: dropped (its
        role chunk: the client had the first part's)."""
        obj["id"], obj["created"] = self.id, self.created
        choices = obj.get("choices")
        if self.completions:
            _as_chat(obj, self.model)
        elif self.plan.chat and not self._role_seen and isinstance(choices, list) and choices:
            self._role_seen = True
            delta = choices[0].get("delta") if isinstance(choices[0], dict) else None
            if (
                isinstance(delta, dict)
                and delta.get("role") is not None
                and not delta.get("content")
                and choices[0].get("finish_reason") is None
            ):
                return None
            if isinstance(delta, dict):
                delta.pop("role", None)
        usage = obj.get("usage")
        if isinstance(usage, dict):
            obj["usage"] = self.summed(usage)
        return b"data: " + _DUMPS(obj).encode()

    def summed(self, usage: Mapping[str, Any]) -> dict[str, Any]:
        """A later part's ``usage`` as the whole stream's. That part's prompt was the original
        prompt and the text already sent (``before`` tokens), which the engine counts as
        prompt and the client got as completion: those tokens move from prompt to completion,
        so the original prompt is counted once and the total is what the engines did.
        ``before`` counts the content events relayed, one a token with vLLM, SGLang and the
        sim (an engine that sends several tokens in one event shifts the split between prompt
        and completion a little, never the total). ``cached_tokens`` is the last part's, as
        its engine reports it (its prefix cache most likely held the original prompt)."""
        out = dict(usage)
        prompt = _count(usage.get("prompt_tokens"))
        completion = _count(usage.get("completion_tokens"))
        moved = min(self.before, prompt)
        out["prompt_tokens"] = prompt - moved
        out["completion_tokens"] = completion + moved
        out["total_tokens"] = prompt + completion
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and "cached_tokens" in details:
            out["prompt_tokens_details"] = {
                **details,
                "cached_tokens": min(_count(details.get("cached_tokens")), prompt - moved),
            }
        return out


def _as_chat(obj: dict[str, Any], model: Any) -> None:
    """A completion chunk made the chat chunk it continues: each choice's ``text`` its
    ``delta.content``, the chat stream's object and model."""
    obj["object"] = "chat.completion.chunk"
    if model is not None:
        obj["model"] = model
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    obj["choices"] = [
        {
            "index": c.get("index", 0),
            "delta": {"content": c["text"]} if isinstance(c.get("text"), str) else {},
            "logprobs": None,
            "finish_reason": c.get("finish_reason"),
        }
        for c in choices
        if isinstance(c, dict)
    ]


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
