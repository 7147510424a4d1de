"""``shards.json``: what the agent keeps of its shards, so that the next agent adopts them.

The file maps each shard id to its :class:`~llmgw.agent.runtimes.base.ShardRecord` (the
order that started it, its process or container, its state and its sidecars). It is written
whole on every change (:func:`llmgw.fsutil.atomic_write`: a crash leaves the old file or
the new one) and read once, at start-up. A file that cannot be read
adopts nothing; one that does not parse as what :func:`record_json` writes is moved aside
(``shards.json.corrupt-<UTC time>``) and adopts nothing: the control plane starts again what
it still wants.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from llmgw.agent.runtimes.base import ShardRecord, SidecarRecord
from llmgw.agent.sidecars import SidecarSpec
from llmgw.contracts.sandbox import SandboxPolicy
from llmgw.errors import FileError, ShardError
from llmgw.fsutil import atomic_write, make_dir
from llmgw.log import kv

__all__ = ["RECORDS_FILE", "ShardRecords", "parse_record", "record_json"]

log = logging.getLogger("llmgw.agent.records")

RECORDS_FILE = "shards.json"


class ShardRecords:
    """The records file of one state directory."""

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / RECORDS_FILE

    def save(self, records: Iterable[ShardRecord]) -> None:
        """Replace the file with ``records``; a failure is logged, not raised (the shards
        run on; only a restarted agent would miss them)."""
        data = {r.shard_id: record_json(r) for r in records}
        try:
            make_dir(self.state_dir)
            atomic_write(self.path, json.dumps(data).encode(), mode=0o600)
        except FileError as exc:
            log.warning(
                "cannot record shards in the state directory",
                extra=kv(path=str(self.path), error=str(exc)),
            )

    def load(self) -> list[ShardRecord]:
        """The records a previous agent left; a file that cannot be parsed is moved aside."""
        path = self.path
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning(
                "cannot read the shard records; adopting nothing",
                extra=kv(path=str(path), error=exc.strerror),
            )
            return []
        try:
            data = json.loads(raw)
            if not isinstance(data, dict):
                raise ValueError(f"a {type(data).__name__}, not an object")
            return [parse_record(str(sid), obj) for sid, obj in data.items()]
        except ValueError as exc:
            self._move_aside(exc)
            return []

    def _move_aside(self, problem: ValueError) -> None:
        path = self.path
        aside = path.with_name(
            f"{path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        )
        try:
            os.replace(path, aside)
        except OSError as move_exc:
            log.warning(
                "shard records are corrupt and cannot be moved aside; adopting nothing",
                extra=kv(path=str(path), error=str(problem), move_error=move_exc.strerror),
            )
        else:
            log.warning(
                "shard records are corrupt; moved them aside and adopting nothing",
                extra=kv(path=str(path), moved_to=str(aside), error=str(problem)),
            )


def record_json(record: ShardRecord) -> dict[str, Any]:
    """One entry of the file (its key is the shard id)."""
    data = asdict(record)
    del data["shard_id"]
    data["extra_args"] = list(record.extra_args)
    data["gpus"] = list(record.gpus)
    data["worker_addrs"] = list(record.worker_addrs)
    data["sidecars"] = [{**asdict(s), "argv": list(s.argv)} for s in record.sidecars]
    data["sandbox"] = record.sandbox.to_json()
    if record.container_id is None:
        del data["container_id"]
    if not record.kv_events_port:
        del data["kv_events_port"]  # only an older agent's records hold one
    return data


_MISSING: Any = object()


def _get(obj: dict[str, Any], key: str, kinds: tuple[type, ...], default: Any = _MISSING) -> Any:
    if key not in obj:
        if default is _MISSING:
            raise ValueError(f"no {key!r}")
        return default
    value = obj[key]
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise ValueError(f"{key!r} is a {type(value).__name__}")
    return value


def parse_record(shard_id: str, obj: object) -> ShardRecord:
    """One entry of the file; ValueError when it is not what :func:`record_json` wrote."""
    try:
        if not isinstance(obj, dict):
            raise ValueError(f"a {type(obj).__name__}, not an object")
        params = _get(obj, "params", (dict,), {})
        extra_args = _get(obj, "extra_args", (list,), [])
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in params.items()):
            raise ValueError("'params' is not a map of strings")
        if not all(isinstance(a, str) for a in extra_args):
            raise ValueError("'extra_args' is not a list of strings")
        return ShardRecord(
            shard_id=shard_id,
            replica_id=_get(obj, "replica_id", (str,)),
            model=_get(obj, "model", (str,)),
            engine=_get(obj, "engine", (str,)),
            rank=_get(obj, "rank", (int,), 0),
            params=params,
            extra_args=tuple(extra_args),
            pid=_get(obj, "pid", (int,)),
            start_time=_get(obj, "start_time", (int, type(None)), None),
            port=_get(obj, "port", (int,)),
            container_id=_get(obj, "container_id", (str, type(None)), None),
            state=_get(obj, "state", (str,)),
            nodes=_get(obj, "nodes", (int,), 1),
            dist_init_addr=_get(obj, "dist_init_addr", (str,), ""),
            gpus=_strings(obj, "gpus"),
            source=_get(obj, "source", (str,), ""),
            gpu_memory_mib=_get(obj, "gpu_memory_mib", (int,), 0),
            profile=_get(obj, "profile", (str,), ""),
            sidecars=tuple(
                _parse_sidecar(i, item) for i, item in enumerate(_get(obj, "sidecars", (list,), []))
            ),
            worker_addrs=_strings(obj, "worker_addrs"),
            listen_addr=_get(obj, "listen_addr", (str,), ""),
            log_offset=_get(obj, "log_offset", (int,), 0),
            kv_events=_get(obj, "kv_events", (bool,), False),
            kv_events_endpoint=_get(obj, "kv_events_endpoint", (str,), ""),
            kv_events_port=_port(obj, "kv_events_port"),
            # A record of an agent before sandboxes: its engine ran unconfined.
            sandbox=SandboxPolicy.from_json(_get(obj, "sandbox", (dict,), {})),
            sandboxed=_get(obj, "sandboxed", (bool,), False),
            sleep_level=_get(obj, "sleep_level", (int,), 0),
            # A record of an agent before disaggregation: an aggregated shard.
            disagg_role=_get(obj, "disagg_role", (str,), ""),
            transfer_addr=_get(obj, "transfer_addr", (str,), ""),
            bootstrap_port=_port(obj, "bootstrap_port"),
        )
    except ValueError as exc:
        raise ValueError(f"shard {shard_id!r}: {exc}") from None


def _port(obj: dict[str, Any], key: str) -> int:
    port = _get(obj, key, (int,), 0)
    if not 0 <= port < 65536:
        raise ValueError(f"{key!r} {port} is not a port (0..65535)")
    return int(port)


def _strings(obj: dict[str, Any], key: str) -> tuple[str, ...]:
    items = _get(obj, key, (list,), [])
    if not all(isinstance(a, str) for a in items):
        raise ValueError(f"{key!r} is not a list of strings")
    return tuple(items)


def _parse_sidecar(index: int, obj: object) -> SidecarRecord:
    if not isinstance(obj, dict):
        raise ValueError(f"sidecar {index} is a {type(obj).__name__}, not an object")
    try:
        record = SidecarRecord(
            name=_get(obj, "name", (str,)),
            argv=_strings(obj, "argv"),
            health_url=_get(obj, "health_url", (str,), ""),
            timeout_s=float(_get(obj, "timeout_s", (int, float), 0.0)),
            ready_after_s=float(_get(obj, "ready_after_s", (int, float), 0.0)),
            pid=_get(obj, "pid", (int,), 0),
            start_time=_get(obj, "start_time", (int, type(None)), None),
            sandboxed=_get(obj, "sandboxed", (bool,), False),
        )
        SidecarSpec.from_record(record)  # what adoption will build from it
    except (ValueError, ShardError) as exc:
        raise ValueError(f"sidecar {index}: {exc}") from None
    return record
