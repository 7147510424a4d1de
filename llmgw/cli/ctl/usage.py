"""``llmgw ctl usage``: what the API keys used, per key and model, over a window of UTC days
(the requests, the prompt, completion and cached tokens, the errors)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import click

from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.keys import USAGE_HEADERS
from llmgw.cli.ctl.output import count, echo_json, table
from llmgw.contracts.keypolicy import USAGE_COUNTS

__all__ = ["usage"]


@click.command()
@click.option("--key", help="Only this key (its id, prefix or name).")
@click.option("--model", help="Only this model.")
@click.option(
    "--since",
    default="7d",
    show_default=True,
    metavar="DURATION|DAY",
    help="From the UTC day this long ago (7d: a week ago; 0d: today), or a day YYYY-MM-DD.",
)
@click.option(
    "--until",
    metavar="DURATION|DAY",
    help="Through this UTC day (default: today), as --since.",
)
@click.option("--by-day", is_flag=True, help="A line per day, instead of sums over the window.")
@click.option(
    "--json", "as_json", is_flag=True, help="Print the rows (one per day, key and model) as JSON."
)
@pass_ctl
def usage(
    c: Ctl,
    key: str | None,
    model: str | None,
    since: str,
    until: str | None,
    by_day: bool,
    as_json: bool,
) -> None:
    """API keys' usage per key and model: requests, tokens and errors, with a total.

    Days are UTC days, as budgets count them; the last second's requests may not be
    counted yet.
    """
    query = {"key": key, "model": model, "since": since, "until": until}
    rows = c.call("GET", "/api/usage?" + urlencode({k: v for k, v in query.items() if v}))
    if as_json or c.as_json:
        echo_json(rows)
        return
    if not rows:
        click.echo(f"no usage since {since}" + (f" until {until}" if until else ""))
        return
    headers = [*(["DAY"] if by_day else []), "KEY", "MODEL", *USAGE_HEADERS]
    blank = [""] * (len(headers) - len(USAGE_COUNTS) - 1)
    total = ["TOTAL", *blank, *(count(sum(r[c] for r in rows)) for c in USAGE_COUNTS)]
    click.echo(table(headers, [*_lines(rows, by_day), total]))


def _lines(rows: list[dict[str, Any]], by_day: bool) -> list[list[str]]:
    """One line per key and model (per day too, with *by_day*), a key by its name (and its
    id where two keys of the window share that name)."""
    names: dict[str, set[str]] = {}
    for r in rows:
        names.setdefault(r["key"] or r["key_id"], set()).add(r["key_id"])
    sums: dict[tuple[str, ...], dict[str, int]] = {}
    for r in rows:
        name = r["key"] or r["key_id"]
        label = f"{name} ({r['key_id']})" if len(names[name]) > 1 else name
        at = (r["day"], label, r["model"]) if by_day else (label, r["model"])
        into = sums.setdefault(at, dict.fromkeys(USAGE_COUNTS, 0))
        for c in USAGE_COUNTS:
            into[c] += r[c]
    return [[*at, *(count(v[c]) for c in USAGE_COUNTS)] for at, v in sorted(sums.items())]
