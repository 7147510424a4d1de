"""``llmgw agent inventory``: what this node's agent would report to the control plane, looked
up now, without joining or connecting: its GPUs, driver, engines, InfiniBand adapters and
fabrics, and (``--sources``) what NVML and ``nvidia-smi`` each see, side by side, with a
second sample of every GPU's utilisation. For a GPU machine's first check
(scripts/gpu-check.sh) and for an operator asking why a node reports what it does.

With the agent's configuration (``llmgw agent --config``, when the file exists) discovery
runs as the agent runs it (its ``discovery.nvidia_smi``, ``ib_root``, fabrics and engine
programs); without it, with the defaults, and nothing is called degraded.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import click

from llmgw.contracts.inventory import inventory_dict

__all__ = ["inventory"]

_SAMPLE_GAP_S = 1.0


def _facts_json(facts: Any) -> dict[str, Any]:
    return {
        "source": facts.source,
        "status": facts.status,
        "driver_version": facts.driver_version,
        "warnings": list(facts.warnings),
        "gpus": [
            {
                "index": g.index,
                "uuid": g.uuid,
                "name": g.name,
                "memory_total_mib": g.memory_total_mib,
                "memory_used_mib": g.memory_used_mib,
                "utilization_percent": (
                    g.utilization_percent if g.HasField("utilization_percent") else None
                ),
            }
            for g in facts.gpus
        ],
    }


def _gpu_line(gpu: dict[str, Any]) -> str:
    used = gpu["utilization_percent"]
    busy = "unknown" if used is None else f"{used}%"
    return (
        f"    {gpu['index']} {gpu['name']}  {gpu['uuid']}  memory "
        f"{gpu['memory_used_mib']}/{gpu['memory_total_mib']} MiB  utilisation {busy}"
    )


def _say_source(name: str, seen: dict[str, Any]) -> None:
    click.echo(f"  {name}: {len(seen['gpus'])} GPUs, driver {seen['driver_version'] or '-'}")
    if seen["status"]:
        click.echo(f"    status: {seen['status']}")
    for gpu in seen["gpus"]:
        click.echo(_gpu_line(gpu))
    for warning in seen["warnings"]:
        click.echo(f"    warning: {warning}")


def _say(report: dict[str, Any]) -> None:
    inv = report["inventory"]
    click.echo(
        f"node {inv['hostname']} ({inv['arch']}, {inv['cpus']} CPUs, "
        f"{inv['memory_total_bytes'] / 2**30:.1f} GiB)"
    )
    click.echo(
        f"GPUs ({inv['gpu_source'] or 'none found'}): {len(inv['gpus'])}, driver "
        f"{inv['driver_version'] or '-'}" + (f"; {inv['gpu_status']}" if inv["gpu_status"] else "")
    )
    for gpu in inv["gpus"]:
        click.echo(
            f"  {gpu['index']} {gpu['name']}  {gpu['uuid']}  memory "
            f"{gpu['memory_used_mib']}/{gpu['memory_total_mib']} MiB"
        )
    click.echo(f"engines: {', '.join(inv['engines']) or 'none'}")
    for detail in inv["engine_details"]:
        state = "ok" if detail["ok"] else f"will not run: {detail['problem']}"
        click.echo(f"  {detail['name']} {detail['version'] or ''} {detail['path']}: {state}")
    for adapter in inv["ib_adapters"]:
        ports = ", ".join(f"port {p['port']} {p['state']} {p['rate']}" for p in adapter["ports"])
        click.echo(f"InfiniBand {adapter['name']}: {ports or 'no ports'}")
    for fabric in inv["fabrics"]:
        health = "healthy" if fabric["healthy"] else "unhealthy"
        click.echo(f"fabric {fabric['name']} ({', '.join(fabric['hcas'])}): {health}")
    for reason in inv["degraded"]:
        click.echo(f"degraded: {reason['message']}")
    for warning in inv["warnings"]:
        click.echo(f"warning: {warning}")
    sources = report.get("sources")
    if sources:
        click.echo("each source, side by side:")
        for name, seen in sources.items():
            _say_source(name, seen)
        click.echo(f"a second sample, {_SAMPLE_GAP_S:g} s later:")
        for name, seen in report["second_sample"].items():
            _say_source(name, seen)


@click.command("inventory")
@click.option(
    "--sources",
    is_flag=True,
    help="Also show what NVML and nvidia-smi each see, and a second sample of every GPU's "
    "utilisation a second later.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")
@click.pass_context
def inventory(ctx: click.Context, sources: bool, as_json: bool) -> None:
    """Print what this node's agent would report (GPUs, driver, engines, fabrics), looked
    up now; with --sources, NVML's and nvidia-smi's views side by side."""
    # Imported when run: discovery loads NVML and runs the engines' checks.
    from llmgw.agent.config import load_agent_config
    from llmgw.agent.discovery import each_source
    from llmgw.agent.inventory import collect_inventory

    parent = ctx.parent.params if ctx.parent is not None else {}
    path = parent.get("config_path")
    cfg = load_agent_config(path) if isinstance(path, Path) and path.is_file() else None
    nvidia_smi = cfg.discovery.nvidia_smi if cfg is not None else None
    report: dict[str, Any] = {
        "config": str(path) if cfg is not None else None,
        "inventory": inventory_dict(collect_inventory(cfg)),
    }
    if sources:
        first = each_source(nvidia_smi)
        time.sleep(_SAMPLE_GAP_S)
        again = each_source(nvidia_smi)
        report["sources"] = {name: _facts_json(facts) for name, facts in first.items()}
        report["second_sample"] = {name: _facts_json(facts) for name, facts in again.items()}
    if as_json:
        click.echo(json.dumps(report, indent=2, sort_keys=True))
    else:
        _say(report)
