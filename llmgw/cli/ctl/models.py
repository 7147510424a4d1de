"""``llmgw ctl models``, ``models apply``, ``deploy``, ``undeploy``, ``replicas``: the models the
cluster serves, from the catalog or ad hoc, and their replicas."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import click

from llmgw.cli.common import Duration, ReportingGroup
from llmgw.cli.ctl.complete import MODELS
from llmgw.cli.ctl.context import Ctl, pass_ctl
from llmgw.cli.ctl.handover import show
from llmgw.cli.ctl.output import echo_json, table
from llmgw.contracts.catalog import load_catalog
from llmgw.contracts.disagg import ROLES, split_pool
from llmgw.contracts.scaling import MAX_TARGET_TOKENS
from llmgw.engines.registry import engine_names

__all__ = ["deploy", "models", "replicas", "undeploy"]


@click.group(cls=ReportingGroup, invoke_without_command=True)
@click.pass_context
def models(ctx: click.Context) -> None:
    """List models with their deployed profile, desired and ready replicas ('models show
    MODEL': one in detail, a disaggregated one's hand-over; 'models apply -f catalog.yaml'
    changes the catalog)."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctl)
    assert c is not None
    data = c.call("GET", "/api/models")
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            m["name"],
            m["profile"],
            m["engine"],
            _gpus(m),
            m["nodes"],
            _desired(m),
            _ready(m),
            m.get("routing") or "least-outstanding",
            "-" if m.get("cache_hit_rate") is None else f"{100 * m['cache_hit_rate']:.0f}%",
            m["unplaceable"]
            or ((m.get("scaling") or {}).get("holding") or "")
            or (
                f"no tokenizer (routed by load and session): {m['tokenizer_problem']}"
                if m.get("tokenizer_problem")
                else ""
            )
            or (
                f"{m['older_profile_replicas']} replica(s) of an older profile being replaced"
                if m.get("older_profile_replicas")
                else ""
            ),
        ]
        for m in data
    ]
    click.echo(
        table(
            [
                "MODEL",
                "PROFILE",
                "ENGINE",
                "GPUS",
                "NODES",
                "DESIRED",
                "READY",
                "ROUTING",
                "CACHED",
                "PROBLEM",
            ],
            rows,
        )
    )


models.add_command(show)


@models.command("apply")
@click.option(
    "-f",
    "--file",
    "path",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="The catalog: models and their profiles (catalog.yaml).",
)
@pass_ctl
def models_apply(c: Ctl, path: Path) -> None:
    """Add or update the models of a catalog file, all or none; others are left alone."""
    catalog = load_catalog(path)  # refuse a bad file before talking to the server
    data = c.call("PUT", "/api/catalog", catalog.to_dict())
    if c.as_json:
        echo_json(data)
        return
    rows = data["models"]
    if rows:
        click.echo(
            table(
                ["CHANGE", "MODEL", "PROFILES"],
                [[r["change"], r["name"], ", ".join(r["profiles"])] for r in rows],
            )
        )
    for r in rows:
        if r["note"]:
            click.echo(f"note: {r['name']}: {r['note']}", err=True)
    counts = {change: sum(r["change"] == change for r in rows) for change in _CHANGES}
    click.echo(f"catalog {path}: " + ", ".join(f"{n} {change}" for change, n in counts.items()))


_CHANGES = ("added", "updated", "unchanged")


def _parse_params(values: tuple[str, ...]) -> dict[str, Any]:
    params: dict[str, Any] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--param")
        params[key] = value
    return params


def _replicas_option(
    value: str | None, scaling: dict[str, Any], prefetch: bool | None = None
) -> int | dict[str, Any] | None:
    """--replicas N, or MIN-MAX with the scaling options, as the API takes it. --prefetch
    goes with either: a fixed N with it is sent as the bounds N-N (a count that does not
    move, its weights kept warm)."""
    if value is None:
        if scaling or prefetch is not None:
            flag = next(iter(scaling)).replace("_", "-") if scaling else "prefetch"
            raise click.UsageError(
                f"--{flag} goes with --replicas MIN-MAX (e.g. --replicas 0-8)"
                + (" or N" if not scaling else "")
                + ": it is part of the model's replica policy, given whole each time"
            )
        return None
    low, dash, high = value.partition("-")
    if not dash:
        if not value.isdigit() or not 0 <= int(value) <= 1000:
            raise click.BadParameter(
                f"{value!r}: give a whole number from 0 to 1000, or MIN-MAX (e.g. 0-8) to "
                "scale by demand",
                param_hint="--replicas",
            )
        if scaling:
            raise click.UsageError(
                f"--{next(iter(scaling)).replace('_', '-')} tunes scaling by demand; give "
                f"--replicas as MIN-MAX (e.g. 0-{value}), not a fixed {value}"
            )
        if prefetch:
            return {"min": int(value), "max": int(value), "prefetch": True}
        return int(value)
    if not (low.isdigit() and high.isdigit()):
        raise click.BadParameter(
            f"{value!r}: give MIN-MAX as two whole numbers, e.g. 0-8", param_hint="--replicas"
        )
    extra = {} if prefetch is None else {"prefetch": prefetch}
    return {"min": int(low), "max": int(high), **scaling, **extra}


def _pools(m: dict[str, Any]) -> dict[str, Any]:
    """A disaggregated model's pools (role -> its own row), in role order; {} for others."""
    pools = m.get("pools") or {}
    return {role: pools[role] for role in ROLES if role in pools}


def _gpus(m: dict[str, Any]) -> str:
    """GPUs per replica; a disaggregated model's per pool: ``1+2`` (prefill+decode)."""
    pools = _pools(m)
    return "+".join(str(p["gpus"]) for p in pools.values()) if pools else str(m["gpus"])


def _ready(m: dict[str, Any]) -> str:
    """Ready replicas; a disaggregated model's, both pools'."""
    pools = _pools(m)
    return str(sum(p["ready"] for p in pools.values())) if pools else str(m["ready"])


def _desired(m: dict[str, Any]) -> str:
    """A model's desired count, with its range when it scales by demand: ``2 (0-8)``, and
    whether its weights are kept warm: ``2 (2-2, prefetch)``; a disaggregated model's
    pools, ready of desired each: ``prefill 1/1, decode 2/3 (2-4)``."""
    pools = _pools(m)
    if pools:
        return ", ".join(f"{role} {p['ready']}/{_desired(p)}" for role, p in pools.items())
    scaling = m.get("scaling")
    if scaling and "min" in scaling:
        warm = ", prefetch" if scaling.get("prefetch") else ""
        return f"{m['replicas']} ({scaling['min']}-{scaling['max']}{warm})"
    return str(m["replicas"])


@click.command()
@click.argument("model")
@click.option(
    "--profile",
    help="Profile of the catalog model to deploy (default: the one deployed now; a model "
    "new from the catalog deploys 'default').",
)
@click.option(
    "--replicas",
    metavar="N|MIN-MAX",
    default=None,
    help="Replica count, or MIN-MAX to scale by demand between them (0-8: to zero when "
    "idle). Default: 1 for a new model; a deployed model keeps its count or range.",
)
@click.option(
    "--prefill",
    metavar="N|MIN-MAX",
    default=None,
    help="A disaggregated profile's prefill pool: its replica count, or MIN-MAX by demand "
    "(default: the profile's).",
)
@click.option(
    "--decode",
    metavar="N|MIN-MAX",
    default=None,
    help="A disaggregated profile's decode pool: its replica count, or MIN-MAX by demand "
    "(default: the profile's).",
)
@click.option(
    "--target-inflight",
    type=click.IntRange(1, 1000),
    default=None,
    help="With MIN-MAX: requests in flight plus queued one replica is meant to carry (default 8).",
)
@click.option(
    "--target-tokens",
    type=click.IntRange(1, MAX_TARGET_TOKENS),
    default=None,
    help="With MIN-MAX: output tokens being generated one replica is meant to carry; it "
    "scales by whichever of requests and tokens asks more (default: requests alone).",
)
@click.option(
    "--prefill-target-tokens",
    type=click.IntRange(1, MAX_TARGET_TOKENS),
    default=None,
    help="With --prefill MIN-MAX: prompt tokens waiting for or under prefill one prefill "
    "replica is meant to carry.",
)
@click.option(
    "--decode-target-tokens",
    type=click.IntRange(1, MAX_TARGET_TOKENS),
    default=None,
    help="With --decode MIN-MAX: output tokens being generated one decode replica is meant "
    "to carry.",
)
@click.option(
    "--ttft-slo",
    type=Duration(minimum=0.001),
    default=None,
    help="With MIN-MAX: one replica more while the gateways' TTFT p90 is over it, e.g. 2s.",
)
@click.option(
    "--scale-down-after",
    type=Duration(),
    default=None,
    help="With MIN-MAX: how long demand stays low before one replica goes (default 5m).",
)
@click.option(
    "--cold-start-timeout",
    type=Duration(minimum=0.001),
    default=None,
    help="With MIN-MAX: how long a request waits for a replica to start (default 5m).",
)
@click.option(
    "--sleep-after",
    type=Duration(minimum=0.001),
    default=None,
    help="With MIN-MAX: put a replica idle this long to sleep (its profile says sleep: "
    "{level: N}); the next request wakes it.",
)
@click.option(
    "--priority",
    type=click.Choice(["high", "normal", "low"]),
    default=None,
    help="With MIN-MAX: when GPUs are short, a model's demand takes them from models of a "
    "lower priority (default normal).",
)
@click.option(
    "--prefetch/--no-prefetch",
    default=None,
    help="With --replicas: keep the profile's weights in the page cache of every node the "
    "model may be placed on, so that a replica starting there loads them from memory "
    "(default: off).",
)
@click.option(
    "--engine",
    type=click.Choice(list(engine_names())),
    help="Engine of a model deployed without the catalog (default: sim).",
)
@click.option(
    "--param",
    "params",
    multiple=True,
    metavar="KEY=VALUE",
    help="Engine parameter of a model deployed without the catalog (repeatable), e.g. ttft_ms=50.",
)
@pass_ctl
def deploy(
    c: Ctl,
    model: str,
    profile: str | None,
    replicas: str | None,
    prefill: str | None,
    decode: str | None,
    target_inflight: int | None,
    target_tokens: int | None,
    prefill_target_tokens: int | None,
    decode_target_tokens: int | None,
    ttft_slo: float | None,
    scale_down_after: float | None,
    cold_start_timeout: float | None,
    sleep_after: float | None,
    priority: str | None,
    prefetch: bool | None,
    engine: str | None,
    params: tuple[str, ...],
) -> None:
    """Deploy MODEL: a profile of a catalog model, or an ad-hoc one with --engine/--param;
    or change its replica count (a fixed N, or MIN-MAX by demand); a disaggregated
    profile's pools with --prefill and --decode."""
    _refuse_pool(model, "deploy")
    pool_tokens = {"prefill": prefill_target_tokens, "decode": decode_target_tokens}
    for role, value in (("prefill", prefill), ("decode", decode)):
        if value is None and pool_tokens[role] is not None:
            raise click.UsageError(
                f"--{role}-target-tokens goes with --{role} MIN-MAX (e.g. --{role} 1-4): it "
                "is part of the pool's replica policy, given whole each time"
            )
    pools = {
        role: _pool_option(role, value, pool_tokens[role])
        for role, value in (("prefill", prefill), ("decode", decode))
        if value is not None
    }
    if pools and replicas is not None:
        raise click.UsageError(
            "--replicas counts an aggregated model's replicas; a disaggregated one's are its "
            "pools': give --prefill/--decode, or --replicas, not both"
        )
    scaling = {
        "target_inflight": target_inflight,
        "target_tokens": target_tokens,
        "ttft_slo": ttft_slo,
        "scale_down_after": scale_down_after,
        "cold_start_timeout": cold_start_timeout,
        "sleep_after": sleep_after,
        "priority": priority,
    }
    count = _replicas_option(
        replicas, {k: v for k, v in scaling.items() if v is not None}, prefetch
    )
    adhoc = engine is not None or bool(params)
    if profile is not None and adhoc:
        raise click.UsageError(
            "--profile deploys a profile of the catalog; --engine/--param describe a model "
            "outside it; give one or the other (change a profile in the catalog and run "
            "'llmgw ctl models apply -f catalog.yaml')"
        )
    body: dict[str, Any] = {"name": model}
    if count is not None:
        body["replicas"] = count
    if pools:
        body["pools"] = pools
    if profile is not None:
        body["profile"] = profile
    if adhoc:
        body["engine"] = engine or "sim"
        body["params"] = _parse_params(params)
    data = c.call("POST", "/api/models", body)
    if c.as_json:
        echo_json(data)
        return
    if adhoc:
        shape = f"engine {data['engine']}"
    else:
        shape = (
            f"profile {data['profile']} (engine {data['engine']}, {data['gpus']} GPU(s) x "
            f"{data['nodes']} node(s))"
        )
    scaled = data.get("scaling")
    if _pools(data):
        count_text = ", ".join(f"{role} {_count_text(p)}" for role, p in _pools(data).items())
    elif scaled and "min" in scaled and scaled["min"] != scaled["max"]:
        count_text = f"{scaled['min']}-{scaled['max']} replicas by demand ({data['replicas']} now)"
    else:
        count_text = f"{data['replicas']} replicas"
    if scaled and scaled.get("prefetch"):
        count_text += " (weights kept warm where it may go)"
    click.echo(f"deployed {data['name']}: {count_text} of {shape} ({data['ready']} ready now)")
    older = data.get("older_profile_replicas") or 0
    if older:
        click.echo(
            f"{older} replica(s) of another profile keep serving until each has a ready "
            "replacement (one at a time)"
        )
    click.echo(f"watch them come up with 'llmgw ctl replicas {shlex.quote(data['name'])}'")


def _count_text(m: dict[str, Any]) -> str:
    scaled = m.get("scaling")
    if scaled and "min" in scaled and scaled["min"] != scaled["max"]:
        return f"{scaled['min']}-{scaled['max']} replicas by demand ({m['replicas']} now)"
    return f"{m['replicas']} replicas"


def _pool_option(role: str, value: str, target_tokens: int | None = None) -> int | dict[str, Any]:
    """--prefill/--decode N|MIN-MAX (with --ROLE-target-tokens) as the API's ``pools``
    takes each."""
    scaling = {} if target_tokens is None else {"target_tokens": target_tokens}
    try:
        count = _replicas_option(value, scaling)
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint=f"--{role}") from None
    except click.UsageError as exc:
        # Said in --replicas's words: the pool's own flags named instead.
        message = exc.message.replace("--target-tokens", f"--{role}-target-tokens")
        raise click.UsageError(message.replace("--replicas", f"--{role}")) from None
    assert count is not None
    return count


def _refuse_pool(name: str, action: str) -> None:
    """A pool's name (MODEL#prefill) is refused before anything is sent ('#' would end the
    request's path there), naming the model and the fix."""
    pair = split_pool(name)
    if pair is None:
        return
    model, role = pair
    fixes = {
        "deploy": f"scale it with 'llmgw ctl deploy {model} --{role} N|MIN-MAX'",
        "undeploy": f"'llmgw ctl undeploy {model}' removes the model with both pools",
        "list": f"'llmgw ctl replicas {model}' lists both pools' replicas (ROLE)",
    }
    raise click.UsageError(
        f"{name} is the {role} pool of the disaggregated model {model}, not a model of its "
        f"own: {fixes[action]}"
    )


@click.command()
@click.argument("model", shell_complete=MODELS)
@pass_ctl
def undeploy(c: Ctl, model: str) -> None:
    """Stop every replica of MODEL (a disaggregated one's: both pools') and remove it."""
    _refuse_pool(model, "undeploy")
    data = c.call("DELETE", f"/api/models/{model}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"undeployed {model}")


class _ReplicasGroup(ReportingGroup):
    """``replicas [MODEL]`` lists; ``replicas sleep|wake REPLICA`` orders. A first word that
    is not a subcommand is the model to list (so no model may be called sleep or wake here;
    name it with ``--model``)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-") and args[0] not in self.commands:
            ctx.meta["replicas.model"] = args[0]
            args = args[1:]
        return super().parse_args(ctx, args)


@click.group(cls=_ReplicasGroup, invoke_without_command=True)
@click.option("--model", "model_option", default=None, help="List the replicas of this model.")
@click.pass_context
def replicas(ctx: click.Context, model_option: str | None) -> None:
    """List replicas ([MODEL]'s) with their node, state (asleep, waking...) and last failure;
    'replicas sleep REPLICA' and 'replicas wake REPLICA' put one to sleep and wake it."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctl)
    assert c is not None
    model = model_option or ctx.meta.get("replicas.model")
    if model:
        _refuse_pool(model, "list")
    path = "/api/replicas" + (f"?model={model}" if model else "")
    data = c.call("GET", path)
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            r["replica"],
            r["model"],
            r.get("role") or "-",
            _state(r),
            r["node"],
            r["port"],
            r["restarts"],
            r["inflight"],
            (f"exit {r['exit_code']}: " if r["exit_code"] is not None else "")
            + (r["reason"] or ""),
        ]
        for r in data
    ]
    click.echo(
        table(
            ["REPLICA", "MODEL", "ROLE", "STATE", "NODE", "PORT", "RESTARTS", "INFLIGHT", "REASON"],
            rows,
        )
    )


def _state(row: dict[str, Any]) -> str:
    """The state, with the level and the host memory held of one that sleeps."""
    level = row.get("sleep_level") or 0
    if row["state"] != "asleep" or not level:
        return str(row["state"])
    held = row.get("host_memory_mib") or 0
    return f"asleep (level {level}" + (f", {held} MiB host)" if held else ")")


@replicas.command("sleep")
@click.argument("replica")
@click.option(
    "--level",
    type=click.IntRange(1, 2),
    default=None,
    help="1: the weights kept in host memory (a fast wake); 2: dropped (a wake reloads "
    "them). Default: the level the replica's profile sleeps at.",
)
@pass_ctl
def replicas_sleep(c: Ctl, replica: str, level: int | None) -> None:
    """Put a ready REPLICA to sleep: its engine keeps running without its GPU memory, and
    the gateway sends it nothing until it is woken."""
    body: dict[str, Any] = {} if level is None else {"level": level}
    data = c.call("POST", f"/api/replicas/{replica}/sleep", body)
    if c.as_json:
        echo_json(data)
        return
    click.echo(
        f"{replica} is falling asleep at level {data['level']}; "
        f"wake it with 'llmgw ctl replicas wake {replica}'"
    )


@replicas.command("wake")
@click.argument("replica")
@pass_ctl
def replicas_wake(c: Ctl, replica: str) -> None:
    """Wake an asleep REPLICA: it serves again once its engine has its GPU memory back."""
    data = c.call("POST", f"/api/replicas/{replica}/wake", {})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"{replica} is waking; it is routed again once ready ('llmgw ctl replicas')")
