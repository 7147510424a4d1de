"""The control plane's state store: nodes, models, replicas, shards, API keys and their
usage, events, join tokens, the certificates issued to nodes, each node's update order, the
desired engine builds with each node's install of them, the leader's lease and the
control-plane instances.

One SQLite file in WAL mode (the embedded default), or a PostgreSQL database that several
control-plane instances share; its schema upgraded by one set of versioned migrations on
open; every engine's error leaves the package as a :class:`~llmgw.errors.StoreError` that
says what to do. The package:

- ``location``  where the database is (server.yaml's ``database``), said without secrets;
- ``database``  what the tables see of either engine: statements, rows, transactions;
- ``sqlite``, ``postgres``: the two engines (connection, writers' lock, error translation);
- ``dialect``   the migrations' SQLite statements as PostgreSQL runs them, and ``?`` as ``%s``;
- ``schema``    the versioned migrations and how they are applied;
- ``rows``      the row types the store hands out;
- ``nodes``, ``models``, ``credentials``, ``usage``, ``updates``, ``engines``, ``events``,
  ``operators``, ``logins``, ``gpus``, ``scaling``: one class per group of tables, holding
  their SQL;
- ``store``     :class:`Store`, which composes them;
- ``transfer``  a whole database copied from one engine to another (``llmgw server migrate``).
- ``lock``      the state directory's lock (the SQLite leader's, and ``migrate``'s).

The tables' SQL is plain and runs on both engines unchanged but for its ``?`` parameter
markers.
"""

from llmgw.server.store.credentials import API_KEY_PREFIX, hash_api_key
from llmgw.server.store.engines import ALL_NODES
from llmgw.server.store.events import (
    MAX_EVENT_BYTES,
    MAX_EVENT_MESSAGE,
    MAX_EVENT_SUBJECT,
    MAX_EVENTS,
)
from llmgw.server.store.gpus import GpuCordon
from llmgw.server.store.logins import hash_session_token
from llmgw.server.store.models import SHARD_FIELDS
from llmgw.server.store.rows import (
    DEFAULT_PROFILE,
    LOGIN_KINDS,
    OPERATOR_ROLES,
    ApiKey,
    Certificate,
    DesiredBuild,
    Event,
    Model,
    Node,
    NodeEngine,
    NodeUpdate,
    Operator,
    Replica,
    Shard,
    StoredLogin,
)
from llmgw.server.store.schema import MIGRATIONS
from llmgw.server.store.store import Store
from llmgw.server.store.tokens import JoinToken

__all__ = [
    "ALL_NODES",
    "API_KEY_PREFIX",
    "DEFAULT_PROFILE",
    "LOGIN_KINDS",
    "MAX_EVENTS",
    "MAX_EVENT_BYTES",
    "MAX_EVENT_MESSAGE",
    "MAX_EVENT_SUBJECT",
    "MIGRATIONS",
    "OPERATOR_ROLES",
    "SHARD_FIELDS",
    "ApiKey",
    "Certificate",
    "DesiredBuild",
    "Event",
    "GpuCordon",
    "JoinToken",
    "Model",
    "Node",
    "NodeEngine",
    "NodeUpdate",
    "Operator",
    "Replica",
    "Shard",
    "Store",
    "StoredLogin",
    "hash_api_key",
    "hash_session_token",
]
