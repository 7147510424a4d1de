"""Prompt tokenizers: a request body turned into the token ids its model's engine computes
for the prompt, so that the gateway can cut them into blocks
(:func:`llmgw.contracts.kvblocks.block_keys`) and route to the replica that holds them.

A sim model's tokenizer is llmgw's own (:class:`SimTokenizer`); a vLLM or SGLang model's is
the ``tokenizer.json`` its profile names, with its chat template (:class:`HfTokenizer`).
:class:`Tokenizers` keeps one per deployed model: it reads the profile's files from the
control plane's disk, or fetches them once into ``<state_dir>/tokenizers/<sha256>``
(:mod:`llmgw.server.gateway.tokenizer_files`: where from, and what a failure says), in the
background when the models change, never on a request's path; a failure is recorded
(:meth:`Tokenizers.problem`) and retried with backoff. The gateway also counts a prompt's
tokens with them for what it charges the key (:mod:`llmgw.server.gateway.metering`); a long prompt
is tokenized in :meth:`Tokenizers.off_loop`'s threads, so that the event loop stays free.

A tokenizer never raises on what a client sent and never logs it: a body it cannot key
gives None, and the router routes that request without its prefix. A chat template is
third-party code, rendered in Jinja's ImmutableSandboxedEnvironment as transformers renders
it: one that tries what the sandbox forbids raises :class:`~llmgw.errors.ChatTemplateRefused`
(the gateway answers 400), as the engine's own rendering would refuse the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmgw.contracts.catalog import FileRef
from llmgw.contracts.sources import SourcePrefix
from llmgw.engines.registry import get_engine
from llmgw.errors import ChatTemplateRefused, EngineError, TokenizerError
from llmgw.log import kv
from llmgw.server.gateway.policies import TOKEN_ROUTINGS
from llmgw.server.gateway.resume import CHAT_RESUMING_ENGINES, ChatPrompt
from llmgw.server.gateway.serving import ServedModel
from llmgw.server.gateway.tokenizer_files import MAX_FILE_BYTES, TokenizerFiles
from llmgw.sim.generate import tokenize
from llmgw.sim.protocol import BadRequest, chat_prompt

__all__ = [
    "LONG_PROMPT_BYTES",
    "MAX_FILE_BYTES",
    "MAX_PROMPT_CHARS",
    "HfTokenizer",
    "PromptTokenizer",
    "SimTokenizer",
    "Tokenizers",
]

log = logging.getLogger("llmgw.server.tokenizing")

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"

MAX_PROMPT_CHARS = 1 << 20
"""The longest prompt text keyed (about 1 MiB): a longer one gives None (routed without its
prefix) rather than hold the request path while it is tokenized."""
MAX_PROMPT_IDS = 1 << 20
"""The most token ids a token-id prompt (/v1/completions) may give to be keyed."""
LONG_PROMPT_BYTES = 16 << 10
"""A request body at least this long has its prompt tokenized off the event loop: the sim's
tokenizer takes about 2 ms for 16 KiB of text, a chat template of 2,048 messages longer."""
_SLICE_CHARS = 16 << 10
_MAX_TOKEN_ID = (1 << 32) - 1
_T = TypeVar("_T")


class PromptTokenizer(ABC):
    """What turns a request body into its prompt's token ids, as the model's engine does."""

    @abstractmethod
    def token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None:
        """The token ids of the prompt of ``payload`` sent to the gateway's ``path``
        (/v1/chat/completions, /v1/completions, /v1/responses); None when this tokenizer
        cannot say (a shape it does not key, a prompt over :data:`MAX_PROMPT_CHARS`).
        Never raises on what a client sent; :class:`~llmgw.errors.ChatTemplateRefused` when
        the model's chat template tries what its sandbox forbids."""


# --- sim -----------------------------------------------------------------------------------


class SimTokenizer(PromptTokenizer):
    """The sim engine's tokenizer (:func:`llmgw.sim.generate.tokenize`) of the very text it
    prompts with: a chat's :func:`llmgw.sim.protocol.chat_prompt`, a completion's prompt (of
    a list, its first: the sim engine caches each prompt of a list, and the first one is the
    one routed by), a response's instructions and string ``input``, one a line (as
    llmgw.sim.responses joins them). Input items and token-id prompts give None."""

    def token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None:
        text = _sim_text(path, payload)
        if text is None or len(text) > MAX_PROMPT_CHARS:
            return None
        return _tokenize_sliced(text)


_CUT = re.compile(r"\S\s")


def _tokenize_sliced(text: str) -> list[int]:
    """:func:`llmgw.sim.generate.tokenize` of ``text``, a slice of about
    :data:`_SLICE_CHARS` at a time, each cut where white space follows a word (no piece of
    the sim's tokenizer spans such a place): its regular expression holds the interpreter
    for the whole text it is given, so in a thread a long prompt would stall the event loop
    as much as on it."""
    if len(text) <= _SLICE_CHARS:
        return tokenize(text)
    ids: list[int] = []
    start = 0
    while start < len(text):
        found = _CUT.search(text, start + _SLICE_CHARS)
        end = found.start() + 1 if found is not None else len(text)
        ids += tokenize(text[start:end])
        start = end
    return ids


def _sim_text(path: str, payload: Mapping[str, Any]) -> str | None:
    if not isinstance(payload, Mapping):
        return None
    if path == CHAT:
        try:
            return chat_prompt(payload.get("messages"))
        except BadRequest:
            return None
    if path == COMPLETIONS:
        return _first_prompt_text(payload.get("prompt"))
    if path == RESPONSES:
        text = payload.get("input")
        instructions = payload.get("instructions")
        if not isinstance(text, str) or not isinstance(instructions, str | None):
            return None
        return f"{instructions}\n{text}" if instructions else text
    return None


def _first_prompt_text(prompt: object) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return None


# --- Hugging Face ----------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    # transformers' own tojson filter: not HTML-escaped, and not ASCII-only by default.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile(template: str) -> jinja2.Template:
    """``template`` compiled as transformers compiles a chat template
    (``_compile_jinja_template`` in transformers/utils/chat_template_utils.py): a sandbox
    that no template can mutate its inputs in, blocks trimmed, loop controls, its
    ``raise_exception``, ``tojson`` and ``strftime_now``."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


class HfTokenizer(PromptTokenizer):
    """A Hugging Face tokenizer (its ``tokenizer.json``) and chat template, applied as vLLM
    applies them.

    A chat is rendered with the template as transformers renders it (``messages``,
    ``add_generation_prompt`` true, ``bos_token`` and ``eos_token`` when known, ``tools``
    None) and encoded without special tokens: vLLM's ChatCompletionRequest has
    ``add_special_tokens`` false by default, "the chat template takes care of adding the
    special tokens" (vllm/entrypoints/openai/protocol.py). A completion's prompt is encoded
    with them (CompletionRequest's default is true); a token-id prompt is its ids. A
    response's string ``input`` is the chat [system: instructions, user: input], as vLLM's
    ``_construct_input_messages`` builds it (vllm/entrypoints/openai/serving_responses.py).
    A request's own bool ``add_special_tokens`` or ``add_generation_prompt`` (vLLM's extra
    parameters) is followed.

    Without a chat template, a chat (and a response) gives None: the gateway does not guess
    the engine's. So does a chat with ``tools``, tool calls, or content parts other than
    text (vLLM rewrites those before its template sees them), or whose template refuses it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None = None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.template_text = chat_template
        try:
            self._template = _compile(chat_template) if chat_template is not None else None
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(
                f"the chat template does not compile (line {exc.lineno}: {exc.message}); "
                "give the model's own chat_template (its tokenizer_config.json's)"
            ) from exc
        self.specials = {
            name: value
            for name, value in (("bos_token", bos_token), ("eos_token", eos_token))
            if value is not None
        }

    @classmethod
    def from_files(cls, tokenizer_json: bytes, chat_template: bytes | None = None) -> HfTokenizer:
        """From the bytes of a ``tokenizer.json`` and of a chat template: a Jinja file, or a
        ``tokenizer_config.json`` (its ``chat_template``, ``bos_token`` and ``eos_token``).
        The bos and eos tokens are otherwise the tokenizer's post-processor's, when it adds
        any. TokenizerError says what is wrong with a file."""
        try:
            text = tokenizer_json.decode("utf-8")
            tokenizer = Tokenizer.from_str(text)
            raw = json.loads(text)
        except Exception as exc:  # tokenizers raises a bare Exception
            raise TokenizerError(
                f"not a tokenizer.json the tokenizers library reads ({exc}); give the "
                "model's own tokenizer.json (Hugging Face fast tokenizer format)"
            ) from exc
        bos, eos = _post_processor_specials(raw.get("post_processor"))
        template: str | None = None
        if chat_template is not None:
            template, config_bos, config_eos = _template_of(chat_template)
            bos = config_bos if config_bos is not None else bos
            eos = config_eos if config_eos is not None else eos
        return cls(tokenizer, template, bos_token=bos, eos_token=eos)

    def render(self, messages: object, *, add_generation_prompt: bool = True) -> str | None:
        """The prompt text of a chat's ``messages`` (None: no template, or messages it does
        not key); ChatTemplateRefused when the template tries what the sandbox forbids."""
        if self._template is None:
            return None
        checked = _template_messages(messages)
        if checked is None:
            return None
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                **self.specials,
            )
        except SecurityError as exc:
            # Third-party code trying what the sandbox forbids: stopped, and the engine's
            # own rendering (the same sandbox, transformers') would refuse it as well.
            raise ChatTemplateRefused(
                f"the model's chat template tried what its sandbox forbids ({exc}); it was "
                "not run. The operator should replace the profile's chat_template with the "
                "model's own"
            ) from None
        except Exception:
            # A template refusing a request (raise_exception, a missing key) is the
            # request's shape, not an error: it is routed without its prefix.
            return None

    def chat_prompt(self, payload: Mapping[str, Any]) -> str | None:
        """A chat request's prompt as a completions request gives it to llama.cpp: rendered
        as for routing (as vLLM renders it), without the template's leading ``bos_token``
        text. llama.cpp tokenizes a completion's prompt string with its special tokens
        parsed and adds BOS itself when the model's GGUF says so (``add_bos``), without
        looking whether the text already starts with one: a rendered BOS kept would make two
        (llama.cpp only warns of it). Its own chat endpoint strips the template's leading
        BOS text before tokenizing for the same reason. None: no template, tools, parts
        other than text, or a template that refuses the chat."""
        if self._template is None or payload.get("tools"):
            return None
        try:
            text = self.render(
                payload.get("messages"),
                add_generation_prompt=_flag(payload, "add_generation_prompt", True),
            )
        except ChatTemplateRefused:
            return None
        bos = self.specials.get("bos_token")
        if text is not None and bos and text.startswith(bos):
            text = text[len(bos) :]
        return text

    def token_ids(self, path: str, payload: dict[str, Any]) -> list[int] | None:
        if not isinstance(payload, Mapping):
            return None
        if path == COMPLETIONS:
            return self._completion_ids(payload)
        if path == CHAT:
            if payload.get("tools"):
                return None
            messages = payload.get("messages")
        elif path == RESPONSES:
            if payload.get("tools"):
                return None
            messages = _response_messages(payload)
        else:
            return None
        text = self.render(
            messages, add_generation_prompt=_flag(payload, "add_generation_prompt", True)
        )
        if text is None:
            return None
        return self._encode(text, _flag(payload, "add_special_tokens", False))

    def _completion_ids(self, payload: Mapping[str, Any]) -> list[int] | None:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of token-id prompts: its first
        if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
            return list(prompt) if len(prompt) <= MAX_PROMPT_IDS else None
        text = _first_prompt_text(prompt)
        if text is None:
            return None
        return self._encode(text, _flag(payload, "add_special_tokens", True))

    def _encode(self, text: str, add_special_tokens: bool) -> list[int] | None:
        if len(text) > MAX_PROMPT_CHARS:
            return None
        # encode_batch lets go of the interpreter while it encodes (encode holds it): in a
        # thread, a long prompt costs the event loop nothing.
        [encoding] = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_TOKEN_ID


def _flag(payload: Mapping[str, Any], name: str, default: bool) -> bool:
    value = payload.get(name)
    return value if isinstance(value, bool) else default


def _template_messages(messages: object) -> list[dict[str, Any]] | None:
    """The messages as a template sees them, or None when they are not a list of {role,
    content} with string content (or text parts, joined by newlines as vLLM's "string"
    content format joins them), or when their text is over :data:`MAX_PROMPT_CHARS`."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, Any]] = []
    size = 0
    for message in messages:
        if not isinstance(message, Mapping) or message.get("tool_calls"):
            return None
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str):
            return None
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, Mapping)]
            if len(texts) != len(content) or any(
                p.get("type") != "text" or not isinstance(t, str)
                for p, t in zip(content, texts, strict=True)
            ):
                return None
            content = "\n".join(str(t) for t in texts)
        elif content is not None and not isinstance(content, str):
            return None
        size += len(content or "")
        if size > MAX_PROMPT_CHARS:
            return None
        item: dict[str, Any] = {"role": role, "content": content}
        name = message.get("name")
        if isinstance(name, str):
            item["name"] = name
        out.append(item)
    return out


def _response_messages(payload: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    text, instructions = payload.get("input"), payload.get("instructions")
    if not isinstance(text, str) or not isinstance(instructions, str | None):
        return None
    messages = [{"role": "system", "content": instructions}] if instructions else []
    return [*messages, {"role": "user", "content": text}]


def _post_processor_specials(processor: object) -> tuple[str | None, str | None]:
    """The special tokens a tokenizer.json's post-processor puts before and after a single
    sequence (bos, eos), when it adds any."""
    if not isinstance(processor, Mapping):
        return None, None
    kind = processor.get("type")
    if kind == "Sequence":
        for inner in processor.get("processors") or []:
            found = _post_processor_specials(inner)
            if found != (None, None):
                return found
        return None, None
    if kind in ("BertProcessing", "RobertaProcessing"):
        cls, sep = processor.get("cls"), processor.get("sep")
        return (
            cls[0] if isinstance(cls, list) and cls and isinstance(cls[0], str) else None,
            sep[0] if isinstance(sep, list) and sep and isinstance(sep[0], str) else None,
        )
    if kind != "TemplateProcessing" or not isinstance(processor.get("single"), list):
        return None, None
    before: list[str] = []
    after: list[str] = []
    seen_sequence = False
    for piece in processor["single"]:
        if not isinstance(piece, Mapping):
            continue
        if "Sequence" in piece:
            seen_sequence = True
        special = piece.get("SpecialToken")
        if isinstance(special, Mapping) and isinstance(special.get("id"), str):
            (after if seen_sequence else before).append(special["id"])
    return (before[0] if before else None), (after[-1] if after else None)


def _template_of(data: bytes) -> tuple[str, str | None, str | None]:
    """A chat template file's template and, from a tokenizer_config.json, its bos and eos."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TokenizerError(
            "the chat template is not UTF-8 text; give the model's Jinja chat template or "
            "its tokenizer_config.json"
        ) from exc
    try:
        config = json.loads(text)
    except ValueError:
        return text, None, None
    if not isinstance(config, Mapping):
        return text, None, None
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
    if not isinstance(template, str):
        raise TokenizerError(
            "the chat template file is a JSON object without a chat_template string; give "
            "the model's tokenizer_config.json, or its chat template as a Jinja file"
        )
    return template, _special(config.get("bos_token")), _special(config.get("eos_token"))


def _special(value: object) -> str | None:
    """A tokenizer_config.json's special token: a string or an AddedToken's {content}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


# --- the control plane's tokenizers ----------------------------------------------------------


@dataclass(frozen=True)
class _Want:
    """What a model's tokenizer is made of: its profile's files."""

    tokenizer: FileRef
    chat_template: FileRef | None


@dataclass
class _Entry:
    want: _Want
    tokenizer: PromptTokenizer | None = None
    problem: str | None = None
    failures: int = 0
    retry_at: float = 0.0


class Tokenizers:
    """The control plane's prompt tokenizer of each deployed model.

    :meth:`set_models` is told the deployed models at every refresh (ServingCache.on_models);
    :meth:`run` loads what they need in the background, a model at a time, each file read or
    fetched in a thread. ``cache_dir`` (``<state_dir>/tokenizers``) holds the files fetched
    from URLs by their SHA-256; None: a URL is refused (only paths are read). ``sources``
    (server.yaml's ``tokenizer_sources``) and ``private`` (the paths never read) are
    :class:`~llmgw.server.gateway.tokenizer_files.TokenizerFiles`'."""

    def __init__(
        self,
        cache_dir: Path | None,
        *,
        sources: Iterable[SourcePrefix] = (),
        private: Iterable[Path] = (),
        fetch_timeout: float = 30.0,
        max_bytes: int = MAX_FILE_BYTES,
        retry_initial: float = 5.0,
        retry_max: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.files = TokenizerFiles(
            cache_dir,
            sources=sources,
            private=private,
            fetch_timeout=fetch_timeout,
            max_bytes=max_bytes,
        )
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.clock = clock
        self._sim = SimTokenizer()
        # Models whose engine's tokenizer is llmgw's own (sim), and those that load one.
        self._own: set[str] = set()
        self._entries: dict[str, _Entry] = {}
        self._wake = asyncio.Event()
        # Loads done (what tests and the admin API count).
        self.loads = 0
        # Where long prompts are tokenized: a few threads of their own, so that tokenizing
        # never waits behind (or holds up) the other work the loop hands to threads.
        self._pool: ThreadPoolExecutor | None = None

    @property
    def fetches(self) -> int:
        """The URLs fetched (or tried)."""
        return self.files.fetches

    def off_loop(self, work: Callable[[], _T]) -> asyncio.Future[_T]:
        """``work`` (tokenizing a long prompt) run in one of the tokenizers' threads."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="llmgw-tokenize")
        return asyncio.get_running_loop().run_in_executor(self._pool, work)

    def set_models(self, served: Iterable[ServedModel]) -> None:
        """The deployed models are ``served``: a model's tokenizer is kept while its files
        stay the same, dropped with the model, and loaded by :meth:`run` when new."""
        own: set[str] = set()
        entries: dict[str, _Entry] = {}
        for model in served:
            if not _tokenizer_needed(model.engine):
                own.add(model.name)
                continue
            # A token routing needs it; so does resuming a chat stream on an engine that
            # does not continue a message (its prompt rendered with the chat template).
            resumes = model.engine not in CHAT_RESUMING_ENGINES and model.chat_template
            if model.tokenizer is None or (model.routing not in TOKEN_ROUTINGS and not resumes):
                continue
            want = _Want(model.tokenizer, model.chat_template)
            entry = self._entries.get(model.name)
            entries[model.name] = (
                entry if entry is not None and entry.want == want else _Entry(want)
            )
        self._own, self._entries = own, entries
        if any(e.tokenizer is None for e in entries.values()):
            self._wake.set()

    def for_model(self, name: str) -> PromptTokenizer | None:
        """The prompt tokenizer of model ``name``; None while it is not loaded (or cannot
        be: :meth:`problem`), and for a model that routes without one."""
        if name in self._own:
            return self._sim
        entry = self._entries.get(name)
        return entry.tokenizer if entry is not None else None

    def chat_prompt(self, name: str) -> ChatPrompt | None:
        """Model ``name``'s chat prompt renderer (:meth:`HfTokenizer.chat_prompt`); None
        while its tokenizer is not loaded, or it has no chat template."""
        entry = self._entries.get(name)
        tok = entry.tokenizer if entry is not None else None
        if isinstance(tok, HfTokenizer) and tok.template_text is not None:
            return tok.chat_prompt
        return None

    def problem(self, name: str) -> str | None:
        """Why model ``name`` has no tokenizer although its routing needs one (still
        loading, or the last failure, with its fix); None when it has one or needs none."""
        entry = self._entries.get(name)
        if entry is None or entry.tokenizer is not None:
            return None
        return entry.problem or "its tokenizer is loading"

    async def run(self) -> None:
        """Load the tokenizers the models need, as they change, until cancelled; a failure
        is retried after a backoff (``retry_initial``, doubling, at most ``retry_max``)."""
        while True:
            await self.load_due()
            waits = [e.retry_at for e in self._entries.values() if e.tokenizer is None]
            timeout = max(0.0, min(waits) - self.clock()) if waits else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    async def load_due(self) -> None:
        """Load each tokenizer not loaded whose retry is due (one pass)."""
        for name, entry in list(self._entries.items()):
            if entry.tokenizer is not None or entry.retry_at > self.clock():
                continue
            try:
                loaded = await asyncio.to_thread(self._load, name, entry.want)
            except TokenizerError as exc:
                entry.failures += 1
                delay = min(self.retry_max, self.retry_initial * 2 ** (entry.failures - 1))
                entry.problem, entry.retry_at = exc.message, self.clock() + delay
                log.warning(
                    "cannot load a model's tokenizer; its requests are routed without their "
                    "prefix until it loads",
                    extra=kv(model=name, error=exc.message, retry_in=round(delay, 1)),
                )
                continue
            if self._entries.get(name) is entry:  # not replaced while it loaded
                entry.tokenizer, entry.problem, entry.failures = loaded, None, 0
                self.loads += 1
                log.info("loaded a model's tokenizer", extra=kv(model=name))

    def _load(self, model: str, want: _Want) -> HfTokenizer:
        files = self.files
        data = files.read(want.tokenizer, model, "tokenizer")
        template = (
            files.read(want.chat_template, model, "chat_template")
            if want.chat_template is not None
            else None
        )
        try:
            return HfTokenizer.from_files(data, template)
        except TokenizerError as exc:
            raise TokenizerError(f"model {model}: {exc.message}") from exc


def _tokenizer_needed(engine: str) -> bool:
    try:
        return get_engine(engine).tokenizer_needed
    except EngineError:
        return True
