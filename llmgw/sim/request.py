"""A ``sim`` chat or completions request read: its prompts, each with the beginning of its
answer given back to be continued (:class:`Prompt`), and its sampling and streaming options
(:class:`Options`), refused with :class:`~llmgw.sim.protocol.BadRequest` as vLLM refuses
them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llmgw.sim.config import SimConfig, is_int
from llmgw.sim.generate import draw, own_tokens, resume, split_own
from llmgw.sim.protocol import BadRequest, chat_prompt, continued_message, missing, positive_int

__all__ = ["MAX_N", "Options", "Prompt", "parse_options", "parse_prompts"]

MAX_N = 16
"""The most choices (``n``) a request may ask for."""


def _completion_prompts(prompt: object) -> list[str]:
    if prompt is None:
        raise missing("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return prompt
    raise BadRequest(
        "'prompt' must be a string or a non-empty array of strings "
        "(token-id prompts are not supported by the sim engine)",
        "prompt",
    )


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt: its text before the answer (``head``) and the answer's beginning given
    back to be continued (``done``: chat's continue_final_message, or the tail of a
    completions prompt that is the engine's own answer so far; "" when none)."""

    head: str
    done: str = ""
    # ``done`` as the engine's own tokens; None when it is not (or there is none).
    own: list[str] | None = None
    # What the answer is keyed on when ``done`` is not the beginning of the head's answer.
    whole: str = ""

    def answer(self, limit: int, opts: Options, choice: int) -> tuple[list[str], str]:
        """The tokens emitted for choice ``choice`` and its finish reason."""
        min_tokens = min(opts.min_tokens, limit)
        if self.own is not None:
            rest = resume(
                self.head,
                self.own,
                limit,
                opts.seed,
                choice,
                min_tokens=min_tokens,
                ignore_eos=opts.ignore_eos,
            )
            if rest is not None:
                return rest
        key = self.whole if self.done else self.head
        return draw(
            key, limit, opts.seed, choice, min_tokens=min_tokens, ignore_eos=opts.ignore_eos
        )


def parse_prompts(body: dict[str, Any], chat: bool, seed: int) -> list[Prompt]:
    """The request's prompts, each with the beginning of its answer it gives back."""
    if chat:
        messages = body.get("messages")
        done = continued_message(body)
        whole = chat_prompt(messages)
        if done is None:
            return [Prompt(whole)]
        assert isinstance(messages, list)  # chat_prompt checked it
        head = chat_prompt(messages[:-1]) if len(messages) > 1 else ""
        return [Prompt(head, done, own_tokens(done), whole)]
    prompts: list[Prompt] = []
    for text in _completion_prompts(body.get("prompt")):
        found = split_own(text, seed)
        if found is None:
            prompts.append(Prompt(text))
        else:
            head, own = found
            prompts.append(Prompt(head, text[len(head) :], own, text))
    return prompts


@dataclass(frozen=True, slots=True)
class Options:
    max_tokens: int | None  # as asked; None: the engine's default, else the context's rest
    limit_name: str  # the member that asked it, named in a refusal
    min_tokens: int
    ignore_eos: bool
    seed: int
    n: int
    stream: bool
    include_usage: bool


def parse_options(body: dict[str, Any], cfg: SimConfig, *, chat: bool) -> Options:
    limit_name = "max_completion_tokens"
    max_tokens = positive_int(body, limit_name) if chat else None
    if max_tokens is None:
        limit_name = "max_tokens"
        max_tokens = positive_int(body, limit_name)
    # vLLM's sampling parameters for long answers: no end before min_tokens, none at all
    # with ignore_eos (the answer runs to its limit).
    min_tokens = body.get("min_tokens")
    if min_tokens is None:
        min_tokens = 0
    elif not is_int(min_tokens) or min_tokens < 0:
        raise BadRequest(f"'min_tokens' must be an integer >= 0, got {min_tokens!r}", "min_tokens")
    if max_tokens is not None and min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens must be less than or equal to {limit_name}={max_tokens}, got {min_tokens}",
            "min_tokens",
        )
    ignore_eos = body.get("ignore_eos")
    if ignore_eos is None:
        ignore_eos = False
    elif not isinstance(ignore_eos, bool):
        raise BadRequest(f"'ignore_eos' must be a boolean, got {ignore_eos!r}", "ignore_eos")

    seed = body.get("seed")
    if seed is None:
        seed = cfg.seed
    elif not is_int(seed):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}", "seed")

    n = positive_int(body, "n") or 1
    if n > MAX_N:
        raise BadRequest(f"'n' must be at most {MAX_N}, got {n}", "n")

    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise BadRequest(f"'stream' must be a boolean, got {stream!r}", "stream")

    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise BadRequest("'stream_options' must be an object", "stream_options")
        value = stream_options.get("include_usage")
        if value is not None and not isinstance(value, bool):
            raise BadRequest(
                f"'stream_options.include_usage' must be a boolean, got {value!r}",
                "stream_options.include_usage",
            )
        include_usage = bool(value)

    return Options(max_tokens, limit_name, min_tokens, ignore_eos, seed, n, stream, include_usage)
