"""The models table and what runs of them: a model's catalog profiles and the one
deployed, its replicas, and each replica's shards (one process on one node each).

Three tables, one concept: what is wanted and what is placed, changed together
(a model's deletion cascades to its replicas and their shards; a catalog change is
refused while its replicas run the profile it would change).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Collection
from typing import Any

from llmgw.errors import Conflict, NotFound
from llmgw.server.store.database import Database
from llmgw.server.store.nodes import Nodes
from llmgw.server.store.rows import DEFAULT_PROFILE, Model, Replica, Shard, check_state, dump_json
from llmgw.server.store.states import ReplicaState, ShardState

__all__ = ["SHARD_FIELDS", "Models"]

SHARD_FIELDS: frozenset[str] = frozenset(
    {
        *("state", "port", "pid", "exit_code", "reason", "restarts", "op_id", "gpus"),
        *("dist_init_addr", "sleep_level", "host_memory_mib"),
    }
)
"""The columns of a shard :meth:`Models.update_shard` may set."""


class Models:
    """Models, their replicas and the replicas' shards, by name and id."""

    def __init__(self, db: Database, nodes: Nodes) -> None:
        self._db = db
        self._nodes = nodes

    # ------------------------------------------------------------------- models

    def put_model(
        self,
        name: str,
        *,
        engine: str,
        params: dict[str, Any],
        replicas: int,
        profiles: dict[str, Any] | None = None,
    ) -> Model:
        """Create a model or replace its engine, params and replica count, deploying profile
        ``default``; its profiles become *profiles* (which must have ``default``), or none:
        then its engine and params are its only profile."""
        _check_replicas(name, replicas)
        blob = dump_json(params, f"model {name} params")
        if profiles is not None:
            _check_profiles(name, profiles)
            if DEFAULT_PROFILE not in profiles:
                raise ValueError(f"model {name}: profiles must include {DEFAULT_PROFILE!r}")
        kept = dump_json(profiles or {}, f"model {name} profiles")
        now = self._db.clock()
        with self._db.write():
            self._db.execute(
                "INSERT INTO models(name, engine, params, replicas, created_at, updated_at, "
                "profiles, profile) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT(name) DO UPDATE "
                "SET engine = excluded.engine, params = excluded.params, "
                "replicas = excluded.replicas, updated_at = excluded.updated_at, "
                "profiles = excluded.profiles, profile = excluded.profile",
                (name, engine, blob, replicas, now, now, kept, DEFAULT_PROFILE),
            )
            return self.get_model(name)

    def put_catalog_model(self, name: str, profiles: dict[str, Any]) -> Model:
        """Create a model from the catalog with 0 replicas, or replace its profiles keeping
        its replica count and deployed profile (whose engine and params are refreshed).

        A new model deploys ``default``, else its first profile. Refused with
        :class:`Conflict` when the change would pull the ground from under running
        replicas: their profile's engine changes, or their profile is dropped.
        """
        _check_profiles(name, profiles)
        blob = dump_json(profiles, f"model {name} profiles")
        now = self._db.clock()
        with self._db.write():
            row = self._db.one("SELECT * FROM models WHERE name = ?", (name,))
            if row is None:
                deployed = _first_profile(profiles)
                engine, params = _profile_columns(profiles[deployed])
                self._db.execute(
                    "INSERT INTO models(name, engine, params, replicas, created_at, updated_at, "
                    "profiles, profile) VALUES (?, ?, ?, 0, ?, ?, ?, ?)",
                    (name, engine, dump_json(params, "params"), now, now, blob, deployed),
                )
                return self.get_model(name)
            model = Model.from_row(row)
            running = self._replica_count(name)
            deployed = model.profile
            if deployed not in profiles:
                if running or model.replicas:
                    raise Conflict(
                        f"model {name} has profile {deployed} deployed ({model.replicas} "
                        f"replicas wanted, {running} placed) and the new profiles "
                        f"({', '.join(sorted(profiles))}) drop it; keep profile {deployed}, "
                        f"or scale {name} to 0 first ('llmgw ctl deploy {name} --replicas 0')"
                    )
                deployed = _first_profile(profiles)
            engine, params = _profile_columns(profiles[deployed])
            if running and engine != model.engine:
                raise Conflict(
                    f"model {name} runs {running} replica(s) of profile {deployed} with engine "
                    f"{model.engine}, and the new profile {deployed} has engine {engine}; "
                    f"'llmgw ctl undeploy {name}' (or scale it to 0) first, or give engine "
                    f"{engine} another profile"
                )
            self._db.execute(
                "UPDATE models SET profiles = ?, profile = ?, engine = ?, params = ?, "
                "updated_at = ? WHERE name = ?",
                (blob, deployed, engine, dump_json(params, "params"), now, name),
            )
            return self.get_model(name)

    def deploy_model(self, name: str, *, profile: str, replicas: int) -> Model:
        """Deploy *profile* of a model with *replicas* replicas: its engine and params become
        the profile's. :class:`NotFound` names the profiles there are. Replicas of another
        profile keep running; the scheduler replaces them one at a time."""
        _check_replicas(name, replicas)
        with self._db.write():
            model = self.get_model(name)
            if not model.profiles:
                if profile != DEFAULT_PROFILE:
                    raise NotFound(
                        f"model {name} has no profile {profile}: it was deployed without the "
                        f"catalog, with engine {model.engine} as its only profile "
                        f"({DEFAULT_PROFILE}); add it to the catalog with "
                        "'llmgw ctl models apply -f catalog.yaml'"
                    )
                engine, params = model.engine, model.params
            elif profile not in model.profiles:
                raise NotFound(
                    f"model {name} has no profile {profile}; its profiles: "
                    f"{', '.join(sorted(model.profiles))}"
                )
            else:
                engine, params = _profile_columns(model.profiles[profile])
            self._db.execute(
                "UPDATE models SET profile = ?, engine = ?, params = ?, replicas = ?, "
                "updated_at = ? WHERE name = ?",
                (
                    profile,
                    engine,
                    dump_json(params, "params"),
                    replicas,
                    self._db.clock(),
                    name,
                ),
            )
            return self.get_model(name)

    def set_scaling(self, name: str, scaling: dict[str, Any], *, replicas: int) -> Model:
        """Store a model's scaling policy (its JSON; ``{}``: a fixed count) with the replica
        count it starts from."""
        _check_replicas(name, replicas)
        blob = dump_json(scaling, f"model {name} scaling")
        with self._db.write():
            cur = self._db.execute(
                "UPDATE models SET scaling = ?, replicas = ?, updated_at = ? WHERE name = ?",
                (blob, replicas, self._db.clock(), name),
            )
            if cur.rowcount == 0:
                raise _no_model(name)
            return self.get_model(name)

    def set_replicas(self, name: str, replicas: int) -> Model:
        """The replica count the planner wants for a model that scales by demand."""
        _check_replicas(name, replicas)
        with self._db.write():
            cur = self._db.execute(
                "UPDATE models SET replicas = ?, updated_at = ? WHERE name = ?",
                (replicas, self._db.clock(), name),
            )
            if cur.rowcount == 0:
                raise _no_model(name)
            return self.get_model(name)

    def _replica_count(self, model: str) -> int:
        row = self._db.one("SELECT count(*) FROM replicas WHERE model = ?", (model,))
        assert row is not None
        return int(row[0])

    def get_model(self, name: str) -> Model:
        row = self._db.one("SELECT * FROM models WHERE name = ?", (name,))
        if row is None:
            raise _no_model(name)
        return Model.from_row(row)

    def list_models(self) -> list[Model]:
        return [Model.from_row(r) for r in self._db.all("SELECT * FROM models ORDER BY name")]

    def delete_model(self, name: str) -> None:
        """Delete a model and, by cascade, its replicas and their shards."""
        with self._db.write():
            cur = self._db.execute("DELETE FROM models WHERE name = ?", (name,))
            if cur.rowcount == 0:
                raise _no_model(name)

    # ----------------------------------------------------------------- replicas

    def add_replica(self, model: str) -> Replica:
        """A new replica of *model*, state ``pending``, of the model's current profile."""
        now = self._db.clock()
        with self._db.write():
            profile = self.get_model(model).profile
            # Replica and shard ids go into URL paths (the gateway's /s/SHARD, the admin
            # API's): a disaggregated pool's '#' (MODEL#prefill) would end the path there.
            stem = model.replace("#", "-")
            replica_id = self._db.unused_id("replicas", lambda: f"{stem}-{secrets.token_hex(3)}")
            self._db.execute(
                "INSERT INTO replicas(id, model, state, created_at, updated_at, profile) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (replica_id, model, ReplicaState.PENDING, now, now, profile),
            )
            return self.get_replica(replica_id)

    def get_replica(self, replica_id: str) -> Replica:
        row = self._db.one("SELECT * FROM replicas WHERE id = ?", (replica_id,))
        if row is None:
            raise _no_replica(replica_id)
        return Replica.from_row(row)

    def list_replicas(self, model: str | None = None) -> list[Replica]:
        if model is None:
            rows = self._db.all("SELECT * FROM replicas ORDER BY model, created_at, id")
        else:
            rows = self._db.all(
                "SELECT * FROM replicas WHERE model = ? ORDER BY created_at, id", (model,)
            )
        return [Replica.from_row(r) for r in rows]

    def models_with_stale_replicas(self) -> set[str]:
        """The models that have replicas of a profile other than the one deployed now."""
        rows = self._db.all(
            "SELECT DISTINCT r.model FROM replicas r JOIN models m ON m.name = r.model "
            "WHERE r.profile IS NOT NULL AND r.profile != m.profile"
        )
        return {row[0] for row in rows}

    def count_replicas(self) -> dict[str, int]:
        """How many replicas each model has, less those stopping (a scale-down's, still
        finishing their requests); models without any are absent."""
        rows = self._db.all(
            "SELECT model, count(*) FROM replicas WHERE state != ? GROUP BY model",
            (ReplicaState.STOPPING,),
        )
        return {row[0]: int(row[1]) for row in rows}

    def count_replicas_by_state(self) -> dict[tuple[str, str], int]:
        """(model, state) -> how many replicas of the model are in that state."""
        rows = self._db.all("SELECT model, state, count(*) FROM replicas GROUP BY model, state")
        return {(row[0], row[1]): int(row[2]) for row in rows}

    def set_replica_state(self, replica_id: str, state: str) -> None:
        """Set a :class:`ReplicaState` (pending, starting, ready, failed, stopping, and the
        sleep states); other values are a ValueError."""
        value = check_state(state, ReplicaState, "replica")
        with self._db.write():
            cur = self._db.execute(
                "UPDATE replicas SET state = ?, updated_at = ? WHERE id = ?",
                (value, self._db.clock(), replica_id),
            )
            if cur.rowcount == 0:
                raise _no_replica(replica_id)

    def delete_replica(self, replica_id: str) -> None:
        """Delete a replica and, by cascade, its shards."""
        with self._db.write():
            cur = self._db.execute("DELETE FROM replicas WHERE id = ?", (replica_id,))
            if cur.rowcount == 0:
                raise _no_replica(replica_id)

    # ------------------------------------------------------------------- shards

    def add_shard(self, replica_id: str, node_id: str, *, rank: int = 0) -> Shard:
        """Place rank *rank* of a replica on a node; id ``<replica>-s<rank>``, state pending."""
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"shard rank must be a whole number of 0 or more, not {rank!r}")
        shard_id = f"{replica_id}-s{rank}"
        with self._db.write():
            self.get_replica(replica_id)
            self._nodes.get_node(node_id)
            if self._db.one("SELECT 1 FROM shards WHERE id = ?", (shard_id,)) is not None:
                raise Conflict(
                    f"replica {replica_id} already has a shard of rank {rank}; "
                    f"delete shard {shard_id} first"
                )
            self._db.execute(
                "INSERT INTO shards(id, replica_id, node_id, rank, state, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (shard_id, replica_id, node_id, rank, ShardState.PENDING, self._db.clock()),
            )
            return self.get_shard(shard_id)

    def get_shard(self, shard_id: str) -> Shard:
        row = self._db.one("SELECT * FROM shards WHERE id = ?", (shard_id,))
        if row is None:
            raise _no_shard(shard_id)
        return Shard.from_row(row)

    def list_shards(
        self,
        *,
        node_id: str | None = None,
        replica_id: str | None = None,
        states: Collection[str] | None = None,
    ) -> list[Shard]:
        """The shards (on ``node_id``, of ``replica_id``, in one of ``states``), by replica
        and rank."""
        where: list[str] = []
        params: list[Any] = []
        if states is not None:
            if not states:
                return []
            for state in states:
                check_state(state, ShardState, "shard")
            where.append(f"state IN ({', '.join('?' for _ in states)})")
            params.extend(states)
        if node_id is not None:
            where.append("node_id = ?")
            params.append(node_id)
        if replica_id is not None:
            where.append("replica_id = ?")
            params.append(replica_id)
        sql = "SELECT * FROM shards"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY replica_id, rank"
        return [Shard.from_row(r) for r in self._db.all(sql, tuple(params))]

    def update_shard(self, shard_id: str, **fields: Any) -> Shard:
        """Set any of state, port, pid, exit_code, reason, restarts, op_id, gpus (a list of
        GPU uuids), dist_init_addr; return the row."""
        unknown = set(fields) - SHARD_FIELDS
        if unknown:
            raise ValueError(
                f"cannot update shard field(s) {', '.join(sorted(unknown))}; "
                f"allowed: {', '.join(sorted(SHARD_FIELDS))}"
            )
        if "state" in fields:
            fields["state"] = check_state(fields["state"], ShardState, "shard")
        if "gpus" in fields:
            gpus = fields["gpus"]
            if not isinstance(gpus, list | tuple) or not all(isinstance(g, str) for g in gpus):
                raise ValueError(f"shard gpus must be a list of GPU uuids, not {gpus!r}")
            fields["gpus"] = json.dumps(list(gpus))
        if "dist_init_addr" in fields and not isinstance(fields["dist_init_addr"], str):
            raise ValueError(
                f"shard dist_init_addr must be a host:port string, not {fields['dist_init_addr']!r}"
            )
        names = sorted(fields)
        assignments = "".join(f"{name} = ?, " for name in names)
        with self._db.write():
            cur = self._db.execute(
                f"UPDATE shards SET {assignments}updated_at = ? WHERE id = ?",
                (*(fields[name] for name in names), self._db.clock(), shard_id),
            )
            if cur.rowcount == 0:
                raise _no_shard(shard_id)
            return self.get_shard(shard_id)

    def delete_shard(self, shard_id: str) -> None:
        with self._db.write():
            cur = self._db.execute("DELETE FROM shards WHERE id = ?", (shard_id,))
            if cur.rowcount == 0:
                raise _no_shard(shard_id)


# ------------------------------------------------------------- row validation


def _check_replicas(name: str, replicas: object) -> None:
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise Conflict(
            f"model {name}: replicas must be a whole number of 0 or more, not {replicas!r}"
        )


def _check_profiles(name: str, profiles: object) -> None:
    # The shape a profiles column needs; the catalog's schema checks the rest first.
    if not isinstance(profiles, dict) or not profiles:
        raise ValueError(f"model {name}: profiles must be a non-empty mapping, not {profiles!r}")
    for profile, spec in profiles.items():
        if (
            not isinstance(profile, str)
            or not isinstance(spec, dict)
            or not isinstance(spec.get("engine"), str)
        ):
            raise ValueError(
                f"model {name}: profile {profile!r} must be a mapping with an engine, not {spec!r}"
            )


def _first_profile(profiles: dict[str, Any]) -> str:
    return DEFAULT_PROFILE if DEFAULT_PROFILE in profiles else next(iter(profiles))


def _profile_columns(profile: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The engine and params columns for a deployed profile: its params, and its args as
    ``extra_args`` (what starting a shard reads)."""
    params: dict[str, Any] = dict(profile.get("params") or {})
    args = list(profile.get("args") or [])
    if args:
        params["extra_args"] = args
    return str(profile["engine"]), params


def _no_model(name: str) -> NotFound:
    return NotFound(f"no model named {name}; 'llmgw ctl models' lists them")


def _no_replica(replica_id: str) -> NotFound:
    return NotFound(f"no replica named {replica_id}; 'llmgw ctl models' lists them")


def _no_shard(shard_id: str) -> NotFound:
    return NotFound(f"no shard named {shard_id}; 'llmgw ctl models' lists them")
