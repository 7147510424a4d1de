"""``llmgw ctl models show MODEL``: one model in detail; a disaggregated one with its pools'
replicas and load and its hand-over as the answering instance's gateway counted it
(requests handed over, fallbacks by reason, prefill retries, hand-over time, tokens and
bytes moved: the admin API's ``handover``, :mod:`llmgw.server.admin.handover`)."""

from __future__ import annotations

from typing import Any

import click

from llmgw.cli.ctl.complete import MODELS
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.output import count, echo_json, table
from llmgw.contracts.disagg import ROLES, split_pool

__all__ = ["bytes_text", "model_text", "show"]


@click.command("show")
@click.argument("model", shell_complete=MODELS)
@pass_ctl
def show(c: Ctl, model: str) -> None:
    """One model in detail: its profile and replicas; a disaggregated one's pools with their
    load, and its hand-over (requests, fallbacks by reason, transfer time, tokens and bytes
    moved) as the answering instance's gateway saw it."""
    pair = split_pool(model)
    if pair is not None:
        raise click.UsageError(
            f"{model} is the {pair[1]} pool of {pair[0]}: 'llmgw ctl models show {pair[0]}' "
            "shows the model with both pools"
        )
    data = c.call("GET", "/api/models")
    found = [m for m in data if m.get("name") == model]
    if not found:
        names = ", ".join(sorted(str(m.get("name")) for m in data)) or "none"
        raise click.UsageError(
            f"no model {model} is deployed (deployed: {names}); 'llmgw ctl models' lists them"
        )
    if c.as_json:
        echo_json(found[0])
        return
    click.echo(model_text(found[0]))


def model_text(m: dict[str, Any]) -> str:
    """The detail view's text of one model as the admin API lists it."""
    lines = [
        f"Model:    {m['name']}",
        f"Profile:  {m['profile']} ({m['engine']})",
    ]
    pools = m.get("pools") or {}
    if not pools:
        lines.append(f"Replicas: {m['ready']} ready of {m['replicas']}")
        if m.get("unplaceable"):
            lines.append(f"Problem:  {m['unplaceable']}")
        return "\n".join(lines)
    rows = []
    for role in ROLES:
        pool = pools.get(role)
        if pool is None:
            continue
        load = pool.get("load") or {}
        rows.append(
            [
                role,
                pool["gpus"],
                f"{pool['ready']}/{pool['replicas']}",
                load.get("inflight", 0),
                count(int(load.get("tokens", 0))),
                count(int(load.get("decoding", 0))) if role == "decode" else "-",
                pool.get("unplaceable") or "",
            ]
        )
    lines += [
        "",
        table(["POOL", "GPUS", "READY", "IN FLIGHT", "TOKENS", "TO GENERATE", "PROBLEM"], rows),
    ]
    handover = m.get("handover")
    if handover:
        lines += ["", *_handover_lines(handover)]
    return "\n".join(lines)


def _handover_lines(h: dict[str, Any]) -> list[str]:
    requests = h.get("requests") or {}
    seconds = h.get("handover_seconds") or {}
    fallbacks = h.get("fallbacks") or {}
    moved = h.get("transfer_bytes")
    p50, p99 = seconds.get("p50"), seconds.get("p99")
    rows = [
        ["handed over", count(int(requests.get("handed_over", 0)))],
        ["failed (decode)", count(int(requests.get("failed", 0)))],
        ["fallbacks (run whole)", count(int(requests.get("fallback", 0)))],
        *[[f"  {reason}", count(int(n))] for reason, n in sorted(fallbacks.items())],
        ["retried prefills", count(int(h.get("prefill_retries", 0)))],
        [
            "hand-over p50 / p99",
            "-" if p50 is None or p99 is None else f"{_secs(p50)} / {_secs(p99)}",
        ],
        ["tokens moved", count(int(h.get("transfer_tokens", 0)))],
        [
            "bytes moved",
            "- (kv_bytes_per_token not set in the profile)" if moved is None else bytes_text(moved),
        ],
    ]
    seen = h.get("seen_by") or "this instance's gateway"
    # A table without its (empty) header line: the labels are the first column.
    return [f"Hand-over, as {seen} saw it:", table(["", ""], rows).split("\n", 1)[1]]


def _secs(value: float) -> str:
    return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"


def bytes_text(n: int) -> str:
    """Bytes as an operator reads them: ``512 B``, ``1.5 MiB``, ``3.2 GiB``."""
    if n < 1024:
        return f"{n} B"
    value, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{value:.1f} {unit}"
