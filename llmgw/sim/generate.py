"""The words the ``sim`` engine answers with, deterministically for a (seed, prompt).

Determinism: the seed is the request's ``seed`` or else :attr:`SimConfig.seed`;
the generator is ``random.Random`` seeded with a BLAKE2b digest of the seed and
the prompt text (chat: the message contents joined by newlines). It draws a
length in [8, 64], where the answer ends by itself (its end-of-sequence token),
at least ``min_tokens`` (vLLM's: no end before that many), never with ``ignore_eos``
(vLLM's: the answer runs to its limit). When that exceeds ``max_tokens`` (the
request's limit, else the rest of the model's context) exactly ``max_tokens``
tokens are emitted with finish reason ``length``, otherwise all of them with
``stop``. The tokens are drawn one after the other from the one generator, so a
longer answer to the same prompt and seed starts with the shorter one.
The first token is a capitalised word and every later one a space followed by a
word, so the streamed deltas concatenate to the non-streamed text exactly.
With ``n`` > 1, choice ``i`` > 0 uses a generator keyed on ``i`` as well;
choice 0 is always what :func:`generate` returns.

The tokenizer (:func:`tokenize`, :func:`detokenize`) has those words as its tokens: each word
bare, capitalised, and after a space, one id each; any other piece of text (a word with its
leading white space) is its UTF-8 bytes, one id each after the words. So every text round-trips
and the engine's own output is one token per word.

Continuation (:func:`resume`, :func:`split_own`): an answer's first ``k`` tokens given back
(chat's ``continue_final_message``; a completions prompt that ends in them) continue exactly:
the generator is keyed on the prompt without them, the whole answer drawn with ``k`` more
tokens of limit and ``k`` more of ``min_tokens``, and the tokens after the ``k`` emitted. So a
stream resumed after ``k`` tokens on another replica, with ``max_tokens`` reduced by ``k``,
carries the text the uninterrupted stream would have. A given text that is not how the sim's
answer to the rest begins is no continuation (:func:`resume` says None).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence

from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig, is_int

__all__ = [
    "MAX_LENGTH",
    "MIN_LENGTH",
    "TOKEN_JSON",
    "VOCAB_SIZE",
    "detokenize",
    "draw",
    "generate",
    "own_tokens",
    "resume",
    "split_own",
    "tokenize",
]

MIN_LENGTH = 8
"""Fewest tokens a completion has when ``max_tokens`` does not cut it short."""
MAX_LENGTH = 64
"""Most tokens a completion has."""

_WORDS: tuple[str, ...] = tuple(
    dict.fromkeys(
        """
    the of and to in is was for that on with as by at from it be this are or
    an have not which one all were they but had there when more time some can
    about out many then them these so would other into has her two like him see
    could no make than first been its who now people my made over did down only
    way find use may water long little very after words called just where most
    know get through back much before go good new write our used me man too any
    day same right look think also around another came come work three word must
    because does part even place well such here take why things help put years
    different away again off went old number great tell men say small every found
    still between name should home big give air line set own under read last
    never us left end along while might next sound below saw something thought
    both few those always looked show large often together asked house world
    going want school important until form food keep children feet land side
    without boy once animals life enough took sometimes four head above kind began
    almost live page got earth need far hand high year mother light parts country
    father let night following picture being study second eyes soon times story
    boys since white days ever paper hard near sentence better best across during
    today others however sure means knew try told young miles sun ways thing whole
    hear example heard several change answer room sea against top turned learn
    point city play toward five using himself usually river clear early ground
    garden morning window quiet bright simple warm green stone bridge road valley
    forest mountain signal engine model token stream server request answer cloud
    river market letter music winter summer spring autumn circle square system
    """.split()
    )
)
_FIRST: tuple[str, ...] = tuple(w.capitalize() for w in _WORDS)
_LATER: tuple[str, ...] = tuple(" " + w for w in _WORDS)
_FIRST_SET = frozenset(_FIRST)
_LATER_SET = frozenset(_LATER)
# The letters that end a text (searched from a bounded start: the vocabulary's words are short).
_LETTERS_AT_END = re.compile(r"[A-Za-z]+$")
_LONGEST_WORD = max(len(w) for w in _WORDS)
TOKEN_JSON: dict[str, str] = {t: json.dumps(t) for t in _FIRST + _LATER}
"""Each token as a JSON string, for the server's pre-serialised stream chunks."""

_PIECES: tuple[str, ...] = _WORDS + _FIRST + _LATER
_PIECE_ID: dict[str, int] = {piece: i for i, piece in enumerate(_PIECES)}
_BYTE_BASE = len(_PIECES)
VOCAB_SIZE = _BYTE_BASE + 256
"""Token ids are 0..VOCAB_SIZE-1: the words' pieces, then the 256 bytes."""
# A word with the white space before it; white space at the very end on its own.
_SPLIT = re.compile(r"\s*\S+|\s+")


def _rng(seed: int, prompt: str, choice: int) -> random.Random:
    material = f"{seed}\x00{choice}\x00{prompt}".encode("utf-8", "surrogatepass")
    digest = hashlib.blake2b(material, digest_size=16).digest()
    return random.Random(int.from_bytes(digest, "big"))


def draw(
    prompt: str,
    max_tokens: int,
    seed: int,
    choice: int = 0,
    *,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[str], str]:
    """:func:`generate` for choice ``choice``, without checking its arguments (the server's
    request path has checked them)."""
    rng = _rng(seed, prompt, choice)
    length = rng.randint(MIN_LENGTH, MAX_LENGTH)  # drawn always: the words do not depend on it
    ends = None if ignore_eos else max(length, min_tokens)
    count = max_tokens if ends is None else min(ends, max_tokens)
    tokens = [_FIRST[rng.randrange(len(_FIRST))]]
    tokens += rng.choices(_LATER, k=count - 1)
    return tokens, ("length" if ends is None or ends > max_tokens else "stop")


def own_tokens(text: str) -> list[str] | None:
    """``text`` as the engine's own tokens (a capitalised word, then words each after a
    space), None when it is not such a text."""
    pieces = _SPLIT.findall(text)
    if not pieces or pieces[0] not in _FIRST_SET:
        return None
    for piece in pieces[1:]:
        if piece not in _LATER_SET:
            return None
    return pieces


def resume(
    prompt: str,
    done: Sequence[str],
    max_tokens: int,
    seed: int,
    choice: int = 0,
    *,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[str], str] | None:
    """The rest of the answer to ``prompt`` whose first tokens ``done`` were emitted already:
    at most ``max_tokens`` more, none to end before ``min_tokens`` more. None when ``done`` is
    not how that answer begins, or is all of it."""
    k = len(done)
    if k == 0:
        return None
    tokens, finish = draw(
        prompt, k + max_tokens, seed, choice, min_tokens=min_tokens + k, ignore_eos=ignore_eos
    )
    if len(tokens) <= k or tokens[:k] != list(done):
        return None
    return tokens[k:], finish


def split_own(prompt: str, seed: int, choice: int = 0) -> tuple[str, list[str]] | None:
    """Where a completions ``prompt`` ends in the first tokens of the engine's own answer (for
    ``seed``) to what comes before them: (that beginning, those tokens), else None. Each
    capitalised vocabulary word in the run of the engine's words that ends the prompt is a
    candidate start, checked by drawing the answer to what precedes it."""
    later: list[str] = []
    pos = len(prompt)
    while pos > 0:
        run = _LETTERS_AT_END.search(prompt, max(0, pos - 4 * _LONGEST_WORD), pos)
        if run is None:
            return None
        word = run.group()
        for i, letter in enumerate(word):
            if letter.isupper() and word[i:] in _FIRST_SET:
                head = prompt[: pos - len(word) + i]
                done = [word[i:], *reversed(later)]
                # Its tokens whatever the answer's length (the words do not depend on it).
                if draw(head, len(done), seed, choice, ignore_eos=True)[0] == done:
                    return head, done
        start = pos - len(word)
        if start < 1 or prompt[start - 1] != " " or " " + word not in _LATER_SET:
            return None
        later.append(" " + word)
        pos = start - 1
    return None


def tokenize(text: str) -> list[int]:
    """The token ids of ``text``: one per known piece, one per UTF-8 byte of the others."""
    ids: list[int] = []
    for piece in _SPLIT.findall(text):
        known = _PIECE_ID.get(piece)
        if known is not None:
            ids.append(known)
        else:
            ids.extend(_BYTE_BASE + b for b in piece.encode("utf-8", "surrogatepass"))
    return ids


def detokenize(ids: Sequence[int]) -> str:
    """The text of token ids (:func:`tokenize`'s inverse); ValueError names an id out of
    0..VOCAB_SIZE-1. Bytes that are not UTF-8 come back as U+FFFD."""
    out: list[str] = []
    pending = bytearray()
    for token in ids:
        if not 0 <= token < VOCAB_SIZE:
            raise ValueError(f"token id {token} is not in 0..{VOCAB_SIZE - 1}")
        if token >= _BYTE_BASE:
            pending.append(token - _BYTE_BASE)
            continue
        if pending:
            out.append(pending.decode("utf-8", "replace"))
            pending.clear()
        out.append(_PIECES[token])
    if pending:
        out.append(pending.decode("utf-8", "replace"))
    return "".join(out)


def generate(
    cfg: SimConfig,
    prompt: str,
    *,
    max_tokens: int,
    seed: int | None,
    min_tokens: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[str], str]:
    """The tokens the engine emits for ``prompt`` and the finish reason.

    ``seed`` None means ``cfg.seed``. ``"".join(tokens)`` is the completion text.
    """
    if not is_int(max_tokens) or max_tokens < 1:
        raise EngineError(f"sim: max_tokens must be a positive integer, got {max_tokens!r}")
    if seed is not None and not is_int(seed):
        raise EngineError(f"sim: seed must be an integer or None, got {seed!r}")
    if not is_int(min_tokens) or min_tokens < 0:
        raise EngineError(f"sim: min_tokens must be an integer >= 0, got {min_tokens!r}")
    return draw(
        prompt,
        max_tokens,
        cfg.seed if seed is None else seed,
        min_tokens=min_tokens,
        ignore_eos=ignore_eos,
    )
