"""The sim's text: deterministic for a (seed, prompt), lengths in range, cut at max_tokens;
its tokenizer round-trips any text."""

from __future__ import annotations

import pytest

from llmgw.errors import EngineError
from llmgw.sim.config import SimConfig
from llmgw.sim.generate import (
    MAX_LENGTH,
    MIN_LENGTH,
    VOCAB_SIZE,
    detokenize,
    generate,
    tokenize,
)


def test_generate_is_deterministic() -> None:
    cfg = SimConfig(seed=3)
    a = generate(cfg, "hello there", max_tokens=1000, seed=None)
    b = generate(cfg, "hello there", max_tokens=1000, seed=None)
    assert a == b
    assert a == generate(SimConfig(seed=99), "hello there", max_tokens=1000, seed=3)
    tokens, finish = a
    assert finish == "stop"
    assert MIN_LENGTH <= len(tokens) <= MAX_LENGTH
    assert tokens[0][0].isupper() and not tokens[0].startswith(" ")
    assert all(t.startswith(" ") and t[1:].isalpha() for t in tokens[1:])


def test_generate_depends_on_seed_and_prompt() -> None:
    cfg = SimConfig()
    base = generate(cfg, "p", max_tokens=100, seed=1)
    assert generate(cfg, "p", max_tokens=100, seed=2) != base
    assert generate(cfg, "q", max_tokens=100, seed=1) != base


def test_generate_lengths_cover_the_range() -> None:
    cfg = SimConfig()
    lengths = {len(generate(cfg, f"prompt {i}", max_tokens=1000, seed=0)[0]) for i in range(500)}
    assert min(lengths) == MIN_LENGTH and max(lengths) == MAX_LENGTH


def test_generate_truncates_to_max_tokens() -> None:
    cfg = SimConfig()
    full, finish = generate(cfg, "x y z", max_tokens=1000, seed=5)
    assert finish == "stop"
    cut, finish = generate(cfg, "x y z", max_tokens=3, seed=5)
    assert finish == "length" and cut == full[:3]
    exact, finish = generate(cfg, "x y z", max_tokens=len(full), seed=5)
    assert finish == "stop" and exact == full


def test_generate_rejects_bad_max_tokens() -> None:
    with pytest.raises(EngineError, match="max_tokens"):
        generate(SimConfig(), "x", max_tokens=0, seed=None)


# --------------------------------------------------------------------------- the tokenizer


@pytest.mark.parametrize(
    "text",
    ["", "the river", "Quiet river the", "  leading\n\ntwo lines ", "émigré naïve 🙂", "x"],
)
def test_tokenize_and_detokenize_round_trip(text: str) -> None:
    ids = tokenize(text)
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert detokenize(ids) == text


def test_the_engines_own_output_is_one_token_per_word() -> None:
    tokens, _ = generate(SimConfig(), "a prompt", max_tokens=64, seed=3)
    text = "".join(tokens)
    ids = tokenize(text)
    assert len(ids) == len(tokens) == len(text.split())
    assert [detokenize([i]) for i in ids] == tokens


def test_detokenize_refuses_an_id_out_of_the_vocabulary() -> None:
    with pytest.raises(ValueError, match=rf"token id {VOCAB_SIZE} is not in 0\.\.{VOCAB_SIZE - 1}"):
        detokenize([VOCAB_SIZE])
    with pytest.raises(ValueError, match="token id -1"):
        detokenize([-1])
