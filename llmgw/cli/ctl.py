"""``llmgw ctl``: operator commands against a control plane's admin API."""

from __future__ import annotations

import getpass
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from llmgw.cli.cert import cert
from llmgw.cli.common import echo_json, reports_errors, table
from llmgw.cli.engine_check import engine_check
from llmgw.client import ADMIN_PASSWORD_ENV, NEW_ADMIN_PASSWORD_ENV, AdminClient, find_target
from llmgw.contracts.catalog import load_catalog
from llmgw.engines.registry import engine_names, installable_engines
from llmgw.errors import ConfigError

__all__ = ["ctl"]


@dataclass
class Ctl:
    server: str | None
    token: str | None
    config: Path | None
    as_json: bool
    state_dir: Path | None = None
    ca: Path | None = None
    insecure_http: bool = False
    _client: AdminClient | None = None

    @property
    def client(self) -> AdminClient:
        if self._client is None:
            self._client = AdminClient(
                find_target(self.server, self.token, self.config, self.state_dir),
                ca=self.ca,
                insecure_http=self.insecure_http,
            )
        return self._client

    def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        password: bool = False,
    ) -> Any:
        """``password``: the body carries the admin password."""
        return self.client.request(method, path, body, password=password)


pass_ctl = click.make_pass_decorator(Ctl)


@click.group()
@click.option(
    "--server",
    envvar="LLMGW_SERVER",
    help="Control plane URL, e.g. https://cp:8080 (env: LLMGW_SERVER).",
)
@click.option("--token", envvar="LLMGW_TOKEN", help="Admin token (env: LLMGW_TOKEN).")
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_CTL_CONFIG",
    help="ctl.yaml with server, token/token_file and ca (env: LLMGW_CTL_CONFIG; default ~/.config/llmgw/ctl.yaml, then the one 'llmgw up' writes).",
)
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    envvar="LLMGW_STATE_DIR",
    help="Use the ctl.yaml that 'llmgw up --state-dir DIR' (or 'llmgw server') wrote into DIR (env: LLMGW_STATE_DIR, as for 'llmgw up').",
)
@click.option(
    "--ca",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="LLMGW_CA",
    help="CA certificate (PEM) that verifies an https control plane, e.g. its STATE/pki/ca.crt with tls: cluster (env: LLMGW_CA; default: the ctl.yaml's ca, else the system trust store).",
)
@click.option(
    "--insecure-http",
    is_flag=True,
    envvar="LLMGW_INSECURE_HTTP",
    help="Send the admin token and password over plain http:// to a host that is not loopback (env: LLMGW_INSECURE_HTTP=1). Anyone on the path can read them.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts instead of tables.")
@click.pass_context
def ctl(
    ctx: click.Context,
    server: str | None,
    token: str | None,
    config: Path | None,
    state_dir: Path | None,
    ca: Path | None,
    insecure_http: bool,
    as_json: bool,
) -> None:
    """Operate a cluster: nodes, models, replicas, API keys, certificates."""
    ctx.obj = Ctl(
        server=server,
        token=token,
        config=config,
        as_json=as_json,
        state_dir=state_dir.expanduser().absolute() if state_dir else None,
        ca=ca,
        insecure_http=insecure_http,
    )


ctl.add_command(cert)
ctl.add_command(engine_check)


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    secs = max(0, time.time() - ts)
    if secs < 120:
        return f"{secs:.0f}s ago"
    if secs < 7200:
        return f"{secs / 60:.0f}m ago"
    return f"{secs / 3600:.0f}h ago"


@ctl.command()
@pass_ctl
@reports_errors
def nodes(c: Ctl) -> None:
    """List nodes: state, connection, shards, GPUs (or why there are none)."""
    data = c.call("GET", "/api/nodes")
    if c.as_json:
        echo_json(data)
        return
    rows = []
    for n in data:
        gpus = (
            str(len(n["gpus"]))
            if n["gpus"]
            else f"0 ({n['gpu_status']})"
            if n["gpu_status"]
            else "0"
        )
        rows.append(
            [
                n["id"],
                n["state"] + (",draining" if n["draining"] else ""),
                "yes" if n["connected"] else "no",
                n["dataplane_addr"],
                n["shards"],
                ",".join(n["engines"]),
                n["agent_version"],
                _ago(n["last_seen"]),
                _until(n["cert_expires_at"]),
                (n["fingerprint"] or "")[:23] + "…"
                if n["state"] != "pending"
                else n["fingerprint"],
                gpus,
                _update_cell(n.get("update")),
            ]
        )
    click.echo(
        table(
            [
                "NODE",
                "STATE",
                "CONNECTED",
                "DATA PLANE",
                "SHARDS",
                "ENGINES",
                "VERSION",
                "SEEN",
                "CERT EXPIRES",
                "FINGERPRINT",
                "GPUS",
                "UPDATE",
            ],
            rows,
        )
    )


def _update_cell(update: dict[str, Any] | None) -> str:
    if not update:
        return "-"
    return f"{update['version']} {update['state']}"


@ctl.group(invoke_without_command=True)
@click.pass_context
@reports_errors
def models(ctx: click.Context) -> None:
    """List models with their deployed profile, desired and ready replicas (and change the
    catalog with 'models apply -f catalog.yaml')."""
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
            m["gpus"],
            m["nodes"],
            m["replicas"],
            m["ready"],
            m["unplaceable"]
            or (
                f"{m['older_profile_replicas']} replica(s) of an older profile being replaced"
                if m.get("older_profile_replicas")
                else ""
            ),
        ]
        for m in data
    ]
    click.echo(
        table(["MODEL", "PROFILE", "ENGINE", "GPUS", "NODES", "DESIRED", "READY", "PROBLEM"], rows)
    )


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
@reports_errors
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


@ctl.command()
@click.argument("model")
@click.option(
    "--profile",
    help="Profile of the catalog model to deploy (default: the one deployed now; a model "
    "new from the catalog deploys 'default').",
)
@click.option(
    "--replicas",
    type=click.IntRange(0, 1000),
    default=None,
    help="Replica count (default: 1 for a new model; a deployed model keeps its count).",
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
@reports_errors
def deploy(
    c: Ctl,
    model: str,
    profile: str | None,
    replicas: int | None,
    engine: str | None,
    params: tuple[str, ...],
) -> None:
    """Deploy MODEL: a profile of a catalog model, or an ad-hoc one with --engine/--param;
    or change its replica count."""
    adhoc = engine is not None or bool(params)
    if profile is not None and adhoc:
        raise click.UsageError(
            "--profile deploys a profile of the catalog; --engine/--param describe a model "
            "outside it; give one or the other (change a profile in the catalog and run "
            "'llmgw ctl models apply -f catalog.yaml')"
        )
    body: dict[str, Any] = {"name": model}
    if replicas is not None:
        body["replicas"] = replicas
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
    click.echo(
        f"deployed {data['name']}: {data['replicas']} replicas of {shape} ({data['ready']} "
        "ready now)"
    )
    older = data.get("older_profile_replicas") or 0
    if older:
        click.echo(
            f"{older} replica(s) of another profile keep serving until each has a ready "
            "replacement (one at a time)"
        )
    click.echo(f"watch them come up with 'llmgw ctl replicas {shlex.quote(data['name'])}'")


@ctl.command()
@click.argument("model")
@pass_ctl
@reports_errors
def undeploy(c: Ctl, model: str) -> None:
    """Stop every replica of MODEL and remove it."""
    data = c.call("DELETE", f"/api/models/{model}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"undeployed {model}")


@ctl.command()
@click.argument("model", required=False)
@pass_ctl
@reports_errors
def replicas(c: Ctl, model: str | None) -> None:
    """List replicas (of MODEL) with their node, state and last failure."""
    path = "/api/replicas" + (f"?model={model}" if model else "")
    data = c.call("GET", path)
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            r["replica"],
            r["model"],
            r["state"],
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
        table(["REPLICA", "MODEL", "STATE", "NODE", "PORT", "RESTARTS", "INFLIGHT", "REASON"], rows)
    )


@ctl.group()
def keys() -> None:
    """API keys for the gateway (/v1)."""


@keys.command("create")
@click.argument("name")
@pass_ctl
@reports_errors
def keys_create(c: Ctl, name: str) -> None:
    """Create a key for NAME; the key is shown once."""
    data = c.call("POST", "/api/keys", {"name": name})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"created key {data['id']} for {data['name']}:")
    click.echo(data["key"])
    click.echo("store it now: it is not shown again (only its hash is kept)")


@keys.command("list")
@click.option("--all", "include_all", is_flag=True, help="Include revoked keys.")
@pass_ctl
@reports_errors
def keys_list(c: Ctl, include_all: bool) -> None:
    """List API keys (prefixes only)."""
    data = c.call("GET", "/api/keys" + ("?all=1" if include_all else ""))
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [
            k["id"],
            k["name"],
            k["prefix"] + "…",
            _ago(k["created_at"]),
            "revoked" if k["revoked_at"] else "active",
        ]
        for k in data
    ]
    click.echo(table(["ID", "NAME", "PREFIX", "CREATED", "STATE"], rows))


@keys.command("revoke")
@click.argument("key")
@pass_ctl
@reports_errors
def keys_revoke(c: Ctl, key: str) -> None:
    """Revoke KEY (its id or prefix); requests with it get 401 at once."""
    data = c.call("DELETE", f"/api/keys/{key}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"revoked key {data['id']} ({data['name']})")


@ctl.command()
@click.option("--limit", default=30, show_default=True, type=click.IntRange(1, 1000))
@click.option(
    "--subject", default=None, help="Only events about this node, model, replica or shard."
)
@pass_ctl
@reports_errors
def events(c: Ctl, limit: int, subject: str | None) -> None:
    """Recent cluster events, newest first."""
    path = f"/api/events?limit={limit}" + (f"&subject={subject}" if subject else "")
    data = c.call("GET", path)
    if c.as_json:
        echo_json(data)
        return
    rows = [
        [time.strftime("%H:%M:%S", time.localtime(e["ts"])), e["kind"], e["subject"], e["message"]]
        for e in data
    ]
    click.echo(table(["TIME", "KIND", "SUBJECT", "MESSAGE"], rows))


def _duration(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        if text[-1:] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not a duration like 30m, 1h or 2d", param_hint="--ttl"
        ) from None


@ctl.command("join-command")
@click.option("--node", "node", help="Id of the node to join (DNS name, e.g. gpu-01).")
@click.option(
    "--rekey",
    "rekey_node",
    metavar="NODE",
    help="Mint a rekey token for NODE instead: it keeps its uid.",
)
@click.option(
    "--ttl", default="1h", show_default=True, help="How long the token is valid (30m, 1h, 2d)."
)
@click.option(
    "--address",
    help="HOST or HOST:PORT (IPv6 in brackets) the node reaches the control plane at; a PORT is the gateway's, for the bundle download (default: the server's first advertise, else the host ctl used).",
)
@click.option(
    "--require-approval",
    is_flag=True,
    help="With --rekey: the node needs approval again after rekeying.",
)
@pass_ctl
@reports_errors
def join_command(
    c: Ctl,
    node: str | None,
    rekey_node: str | None,
    ttl: str,
    address: str | None,
    require_approval: bool,
) -> None:
    """Mint a one-time token and print the command to paste on the node."""
    if bool(node) == bool(rekey_node):
        raise click.UsageError("give exactly one of --node NODE (a new node) or --rekey NODE")
    if require_approval and not rekey_node:
        raise click.UsageError(
            "--require-approval goes with --rekey (a fresh join always needs approval)"
        )
    body: dict[str, Any] = {
        "node": node or rekey_node,
        "ttl": _duration(ttl),
        "rekey": bool(rekey_node),
        "require_approval": require_approval,
    }
    if address:
        body["address"] = address
    data = c.call("POST", "/api/join-tokens", body)
    if c.as_json:
        echo_json(data)
        return
    if data.get("warning"):
        click.echo(f"warning: {data['warning']}", err=True)
    expires = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(data["expires_at"]))
    what = "rekey" if data["kind"] == "rekey" else "join"
    click.echo(
        f"{what} token {data['id']} for node {data['node']}, valid until {expires} (one use)"
    )
    click.echo(f"enrol URL: {data['enroll_url']}")
    click.echo(f"CA hash:   {data['ca_hash']}")
    click.echo("")
    click.echo("run on the node:")
    click.echo("")
    click.echo(f"  {data['command']}")
    click.echo("")
    click.echo(
        "then compare the fingerprint it prints and approve: llmgw ctl approve "
        f"{shlex.quote(data['node'])} --fingerprint sha256:…"
    )


@ctl.group(invoke_without_command=True)
@click.option(
    "--all", "include_all", is_flag=True, help="Include used, expired and revoked tokens."
)
@click.pass_context
@reports_errors
def tokens(ctx: click.Context, include_all: bool) -> None:
    """List outstanding join tokens (and revoke them with 'tokens revoke ID')."""
    if ctx.invoked_subcommand is not None:
        return
    c = ctx.find_object(Ctl)
    assert c is not None
    data = c.call("GET", "/api/join-tokens" + ("?all=1" if include_all else ""))
    if c.as_json:
        echo_json(data)
        return

    def state(t: dict[str, Any]) -> str:
        if t["used_at"]:
            return "used"
        if t["revoked_at"]:
            return "revoked"
        return "active" if t["active"] else "expired"

    rows = [
        [t["id"], t["node"], t["kind"], t["prefix"] + "…", _until(t["expires_at"]), state(t)]
        for t in data
    ]
    click.echo(table(["ID", "NODE", "KIND", "PREFIX", "EXPIRES", "STATE"], rows))


@tokens.command("revoke")
@click.argument("token_id")
@pass_ctl
@reports_errors
def tokens_revoke(c: Ctl, token_id: str) -> None:
    """Revoke an unused join token (its id or prefix)."""
    data = c.call("DELETE", f"/api/join-tokens/{token_id}")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"revoked join token {data['id']} for node {data['node']}")


def _until(ts: float | None) -> str:
    if not ts:
        return "-"
    secs = ts - time.time()
    if secs <= 0:
        return "expired"
    if secs < 7200:
        return f"in {secs / 60:.0f}m"
    if secs < 3 * 86400:
        return f"in {secs / 3600:.0f}h"
    return f"in {secs / 86400:.0f}d"


@ctl.command()
@click.argument("node")
@click.option(
    "--fingerprint",
    "fp",
    required=True,
    help="The sha256:… key fingerprint 'llmgw agent join' printed on the node.",
)
@pass_ctl
@reports_errors
def approve(c: Ctl, node: str, fp: str) -> None:
    """Approve a pending NODE after comparing its key fingerprint."""
    data = c.call("POST", f"/api/nodes/{node}/approve", {"fingerprint": fp})
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"approved {node}; it takes work from now on")


@ctl.command()
@click.argument("node")
@pass_ctl
@reports_errors
def reject(c: Ctl, node: str) -> None:
    """Remove a pending NODE and deny its certificate."""
    data = c.call("POST", f"/api/nodes/{node}/reject")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"rejected {node}; its certificate is denied")


@ctl.command()
@click.argument("node")
@pass_ctl
@reports_errors
def revoke(c: Ctl, node: str) -> None:
    """Revoke NODE: deny its certificates, cut its stream, rebuild its replicas elsewhere."""
    data = c.call("POST", f"/api/nodes/{node}/revoke")
    if c.as_json:
        echo_json(data)
        return
    serials = ", ".join(data["serials"]) or "none outstanding"
    click.echo(
        f"revoked {node} (certificates denied: {serials}); it can come back only through a fresh join"
    )


@ctl.group()
def engines() -> None:
    """Engines on the nodes: install a build on one node or all of them."""


@engines.command("install")
@click.argument("target", metavar="NODE|--all", required=False)
@click.argument("engine", type=click.Choice(installable_engines()))
@click.argument("version")
@click.option("--all", "all_nodes", is_flag=True, help="Every approved node.")
@click.option(
    "--url",
    required=True,
    help="Where the nodes download the build (a .tar.gz/.tar.xz/.zip): https://, or http:// "
    "and file:// from places the nodes list in install_sources in agent.yaml.",
)
@click.option("--sha256", "sha", required=True, help="The publisher's SHA-256 of that file.")
@click.option("--arch", default="", help="Only for this architecture (x86_64, aarch64).")
@click.option(
    "--wait/--no-wait", default=True, show_default=True, help="Wait for every node's result."
)
@click.option("--timeout", default=3600.0, show_default=True, help="Seconds to wait with --wait.")
@pass_ctl
@reports_errors
def engines_install(
    c: Ctl,
    target: str | None,
    engine: str,
    version: str,
    all_nodes: bool,
    url: str,
    sha: str,
    arch: str,
    wait: bool,
    timeout: float,
) -> None:
    """Install ENGINE VERSION on NODE (or --all): download, check the SHA-256, unpack, run it."""
    if bool(target) == all_nodes:
        raise click.UsageError("name one NODE or pass --all")
    body: dict[str, Any] = {
        "engine": engine,
        "version": version,
        "url": url,
        "sha256": sha,
        "arch": arch,
    }
    if all_nodes:
        body["all"] = True
    else:
        body["nodes"] = [target]
    sent = c.call("POST", "/api/engines/install", body)
    ops = [r["op_id"] for r in sent if r["op_id"]]
    deadline = time.monotonic() + timeout
    rows = sent
    while wait and ops and time.monotonic() < deadline:
        rows = c.call("GET", "/api/engines/installs?" + "&".join(f"op={op}" for op in ops))
        if all(r["state"] != "installing" for r in rows):
            break
        time.sleep(1.0)
    rows = rows + [r for r in sent if not r["op_id"]]
    if c.as_json:
        echo_json(rows)
    else:
        click.echo(
            table(
                ["NODE", "ENGINE", "VERSION", "STATE", "ERROR"],
                [[r["node"], engine, version, r["state"], r.get("error") or ""] for r in rows],
            )
        )
    if any(r["state"] in ("failed", "skipped") for r in rows):
        raise click.exceptions.Exit(1)


@ctl.command()
@click.argument("node")
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until no replica is left on NODE.",
)
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait.")
@pass_ctl
@reports_errors
def drain(c: Ctl, node: str, wait: bool, timeout: float) -> None:
    """Move every replica off NODE, one at a time, each replacement ready before the original stops."""
    data = c.call("POST", f"/api/nodes/{node}/drain")
    if not wait:
        if c.as_json:
            echo_json(data)
        else:
            click.echo(
                f"draining {node}: {len(data['replicas_left'])} replicas to move "
                f"(llmgw ctl drain {shlex.quote(node)} to watch)"
            )
        return
    deadline = time.monotonic() + timeout
    last = ""
    while True:
        left = data["replicas_left"]
        moving = ", ".join(f"{m['replica']} -> {m['replacement']}" for m in data["moving"]) or "-"
        line = f"{node}: {len(left)} replicas left; moving {moving}"
        if data.get("blocked"):
            line += f"; blocked: {data['blocked']}"
        if line != last and not c.as_json:
            click.echo(line)
            last = line
        if not left:
            break
        if time.monotonic() > deadline:
            raise click.ClickException(f"drain of {node} not done after {timeout:.0f}s: {line}")
        time.sleep(1.0)
        data = c.call("GET", f"/api/nodes/{node}/drain")
    if c.as_json:
        echo_json(data)
    else:
        click.echo(
            f"{node} is drained; 'llmgw ctl uncordon {shlex.quote(node)}' lets it take "
            "replicas again"
        )


@ctl.command()
@click.argument("node")
@pass_ctl
@reports_errors
def uncordon(c: Ctl, node: str) -> None:
    """Let a drained NODE take replicas again."""
    data = c.call("POST", f"/api/nodes/{node}/uncordon")
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"{node} takes new replicas again")


# -- signed self-updates ----------------------------------------------------------------------


def _stdin_is_tty() -> bool:
    return sys.stdin is not None and sys.stdin.isatty()


def _secret(env: str, prompt: str) -> str:
    """A password from ``env``, else a no-echo prompt; never from the command line, where
    every user of the machine could read it in /proc."""
    value = os.environ.get(env, "")
    if value:
        return value
    if _stdin_is_tty():
        value = getpass.getpass(prompt)
        if value:
            return value
    raise ConfigError(
        f"no admin password: set {env} or run in a terminal to be prompted; never pass it "
        "as an argument"
    )


@ctl.command()
@click.argument("target", metavar="NODE|--all", required=False)
@click.option("--all", "all_nodes", is_flag=True, help="Every approved node.")
@click.option(
    "--version",
    "version",
    required=True,
    help="The agent version to install; the control plane must serve its bundle.",
)
@click.option(
    "--wait/--no-wait",
    default=True,
    show_default=True,
    help="Wait until every node has applied (or refused) the update.",
)
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds to wait with --wait.")
@click.option(
    "--ttl", default=3600, show_default=True, help="Seconds the signed order stays valid."
)
@pass_ctl
@reports_errors
def update(
    c: Ctl,
    target: str | None,
    all_nodes: bool,
    version: str,
    wait: bool,
    timeout: float,
    ttl: int,
) -> None:
    """Update the agent on NODE (or --all) to VERSION with an order signed by the cluster
    CA. Asks for the admin password again (env: LLMGW_ADMIN_PASSWORD for scripts)."""
    if bool(target) == all_nodes:
        raise click.UsageError("name one NODE or pass --all")
    password = _secret(ADMIN_PASSWORD_ENV, "admin password (not echoed): ")
    body: dict[str, Any] = {"version": version, "password": password, "ttl": ttl}
    if all_nodes:
        body["all"] = True
    else:
        body["nodes"] = [target]
    rows = c.call("POST", "/api/updates", body, password=True)
    nodes = [r["node"] for r in rows]
    deadline = time.monotonic() + timeout
    shown: dict[str, tuple[str, str]] = {}

    def progress(current: list[dict[str, Any]]) -> None:
        for r in current:
            seen = (r["state"], r["message"])
            if shown.get(r["node"]) != seen and not c.as_json:
                click.echo(f"{r['node']}: {r['version']} {r['state']}: {r['message']}", err=True)
            shown[r["node"]] = seen

    progress(rows)
    while wait and not all(r["final"] for r in rows):
        if time.monotonic() > deadline:
            pending = ", ".join(f"{r['node']} ({r['state']})" for r in rows if not r["final"])
            raise click.ClickException(
                f"the update is not finished after {timeout:.0f}s: {pending}; "
                "'llmgw ctl nodes' shows where each node is"
            )
        time.sleep(1.0)
        rows = c.call("GET", "/api/updates?" + "&".join(f"node={n}" for n in nodes))
        progress(rows)
    if c.as_json:
        echo_json(rows)
    else:
        click.echo(
            table(
                ["NODE", "VERSION", "COUNTER", "STATE", "MESSAGE"],
                [[r["node"], r["version"], r["counter"], r["state"], r["message"]] for r in rows],
            )
        )
    if wait and any(r["state"] != "done" for r in rows):
        raise click.exceptions.Exit(1)


@ctl.group()
def admin() -> None:
    """The control plane's own credentials."""


@admin.command("password")
@pass_ctl
@reports_errors
def admin_password(c: Ctl) -> None:
    """Change the admin password that signed updates ask for (old, then new twice; env:
    LLMGW_ADMIN_PASSWORD and LLMGW_NEW_ADMIN_PASSWORD for scripts)."""
    old = _secret(ADMIN_PASSWORD_ENV, "current admin password (not echoed): ")
    new = os.environ.get(NEW_ADMIN_PASSWORD_ENV, "")
    if not new:
        new = _secret(NEW_ADMIN_PASSWORD_ENV, "new admin password (not echoed): ")
        if _stdin_is_tty() and getpass.getpass("new admin password again: ") != new:
            raise ConfigError("the two new passwords differ; nothing was changed")
    data = c.call("PUT", "/api/admin/password", {"old": old, "new": new}, password=True)
    if c.as_json:
        echo_json(data)
        return
    click.echo(f"admin password changed; {data['removed']} (the first one) was removed")
