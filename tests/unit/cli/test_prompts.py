"""Secrets from the environment or a no-echo prompt (llmgw.cli.prompts), never an argument."""

from __future__ import annotations

import pytest

from llmgw.cli import prompts
from llmgw.cli.prompts import read_secret
from llmgw.errors import ConfigError

ENV = "LLMGW_TEST_SECRET"


@pytest.fixture
def typed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """A terminal that answers each prompt with the next string the test put in the list."""
    answers: list[str] = []
    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(prompts.getpass, "getpass", lambda prompt: answers.pop(0))
    monkeypatch.delenv(ENV, raising=False)
    return answers


def test_the_environment_comes_first(monkeypatch: pytest.MonkeyPatch, typed: list[str]) -> None:
    monkeypatch.setenv(ENV, " s3cret\n")
    assert read_secret(ENV, "secret: ", what="secret") == " s3cret\n"
    assert read_secret(ENV, "secret: ", what="secret", strip=True) == "s3cret"
    assert read_secret(ENV, "secret: ", what="secret", again="again: ") == " s3cret\n"


def test_a_terminal_is_asked(typed: list[str]) -> None:
    typed += ["typed \n"]
    assert read_secret(ENV, "secret: ", what="secret", strip=True) == "typed"


def test_a_new_secret_is_asked_twice_and_must_agree(typed: list[str]) -> None:
    typed += ["one", "one"]
    assert read_secret(ENV, "new: ", what="new secret", again="again: ") == "one"
    typed += ["one", "two"]
    with pytest.raises(ConfigError) as info:
        read_secret(ENV, "new: ", what="new secret", again="again: ")
    assert str(info.value) == (
        "the two new secrets differ; nothing was done. Run it again and type the same new "
        "secret twice"
    )


def test_without_environment_or_terminal_it_says_how_to_give_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.setattr(prompts, "stdin_is_tty", lambda: False)
    with pytest.raises(ConfigError) as info:
        read_secret(ENV, "secret: ", what="join token")
    assert str(info.value) == (
        f"no join token: set {ENV} or run in a terminal to be prompted; "
        "never pass it as an argument"
    )


def test_an_empty_answer_is_none(typed: list[str]) -> None:
    typed += ["  "]
    with pytest.raises(ConfigError, match=r"^no secret: "):
        read_secret(ENV, "secret: ", what="secret", strip=True)
