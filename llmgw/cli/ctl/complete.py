"""Shell completion of the values ``llmgw ctl`` commands take, from the control plane itself:
``llmgw ctl approve <TAB>`` offers the pending nodes, ``drain``/``revoke``/``nodes`` every
node, ``undeploy``/``replicas`` the deployed models.

A TAB must never print or hang: each callback asks the control plane once, with a short
timeout, through the same client and credentials the command would use (the ctl group's
options as given on the line being completed, their environment variables, the saved
login, the ctl.yaml of 'llmgw up'), and offers nothing on any error at all.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from click.shell_completion import CompletionItem

__all__ = ["ALL_NODES", "MODELS", "PENDING_NODES", "TIMEOUT"]

TIMEOUT = 1.0  # seconds: a completion that takes longer is worse than none


def _ctl_params(ctx: click.Context) -> dict[str, Any]:
    """The ctl group's options as parsed so far (group callbacks do not run during
    completion, so the Ctl object does not exist: read the contexts' params)."""
    current: click.Context | None = ctx
    while current is not None:
        if current.command.name == "ctl":
            return dict(current.params)
        current = current.parent
    return {}


def _fetch(ctx: click.Context, path: str) -> Any:
    from llmgw.client import AdminClient, find_target

    params = _ctl_params(ctx)
    state_dir = params.get("state_dir")
    client = AdminClient(
        find_target(
            params.get("server"),
            params.get("token"),
            params.get("config"),
            Path(state_dir).expanduser().absolute() if state_dir else None,
        ),
        timeout=TIMEOUT,
        ca=params.get("ca"),
        insecure_http=bool(params.get("insecure_http")),
    )
    return client.request("GET", path)


def _completer(
    path: str, pick: Callable[[Any], list[tuple[str, str]]]
) -> Callable[[click.Context, click.Parameter, str], list[CompletionItem]]:
    def complete(
        ctx: click.Context, param: click.Parameter, incomplete: str
    ) -> list[CompletionItem]:
        try:
            # Nothing the client might print (a warning) may reach the shell's line.
            with (
                contextlib.redirect_stderr(io.StringIO()),
                contextlib.redirect_stdout(io.StringIO()),
            ):
                values = pick(_fetch(ctx, path))
        except Exception:  # a TAB offers nothing rather than a traceback
            return []
        return [
            CompletionItem(value, help=help_text or None)
            for value, help_text in values
            if value.startswith(incomplete)
        ]

    return complete


def _nodes(pending_only: bool) -> Callable[[Any], list[tuple[str, str]]]:
    def pick(data: Any) -> list[tuple[str, str]]:
        out = []
        for node in data:
            if pending_only and node.get("state") != "pending":
                continue
            out.append((str(node["id"]), str(node.get("state") or "")))
        return out

    return pick


def _models(data: Any) -> list[tuple[str, str]]:
    return [(str(m["name"]), f"{m.get('ready', 0)}/{m.get('replicas', 0)} ready") for m in data]


PENDING_NODES = _completer("/api/nodes", _nodes(pending_only=True))
ALL_NODES = _completer("/api/nodes", _nodes(pending_only=False))
MODELS = _completer("/api/models", _models)
