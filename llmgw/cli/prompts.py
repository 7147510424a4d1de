"""Secrets a command needs (a join token, the admin password): from an environment variable,
else a no-echo prompt when standing in a terminal; never from the command line, where every
user of the machine could read them in /proc."""

from __future__ import annotations

import getpass
import os
import sys

from llmgw.errors import ConfigError

__all__ = ["read_secret", "stdin_is_tty"]


def stdin_is_tty() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def read_secret(
    env: str, prompt: str, *, what: str, strip: bool = False, again: str | None = None
) -> str:
    """The ``what`` from ``env``, else asked with ``prompt`` (not echoed) in a terminal;
    ``strip`` drops the whitespace around it (a token pasted with its newline). A new
    secret that is typed is asked for a second time with ``again``; the two must agree.
    Raises ConfigError when there is none."""
    value = os.environ.get(env, "")
    if strip:
        value = value.strip()
    if value:
        return value
    if stdin_is_tty():
        value = getpass.getpass(prompt)
        if strip:
            value = value.strip()
        if value:
            if again is not None and getpass.getpass(again) != value:
                raise ConfigError(
                    f"the two {what}s differ; nothing was done. Run it again and type the "
                    f"same {what} twice"
                )
            return value
    raise ConfigError(
        f"no {what}: set {env} or run in a terminal to be prompted; never pass it as an argument"
    )
