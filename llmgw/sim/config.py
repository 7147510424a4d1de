"""The settings of one ``sim`` engine (:class:`SimConfig`), checked when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from llmgw.errors import ConfigError, EngineError
from llmgw.netaddr import parse_hostport

__all__ = ["MAX_EMBEDDING_DIM", "SimConfig", "is_int"]

MAX_EMBEDDING_DIM = 16384
"""The longest embedding a sim engine makes (the largest real models' are 4096-8192)."""


@dataclass(frozen=True)
class SimConfig:
    """Settings of one ``sim`` engine; invalid values raise :class:`EngineError`.

    ``nodes`` > 1 makes it one shard of a multi-node replica: ``rank`` 0 binds
    ``dist_init_addr`` (``HOST:PORT``) and workers (``rank`` > 0) dial it, for up to
    ``join_timeout_s``; heartbeats go both ways every ``heartbeat_s`` and a peer silent for
    ``peer_timeout_s`` is gone. ``dist_init_addr`` is ignored when ``nodes`` is 1.
    ``embedding_dim``: the length of the vectors ``/v1/embeddings`` answers (a request's
    ``dimensions`` may ask for fewer).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model: str = "llmgw-sim"
    seed: int = 0
    ttft_ms: float = 0.0
    tps: float = 0.0
    max_tokens: int = 32
    embedding_dim: int = 384
    nodes: int = 1
    rank: int = 0
    dist_init_addr: str = ""
    join_timeout_s: float = 300.0
    heartbeat_s: float = 1.0
    peer_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise EngineError(f"sim: host must be a non-empty string, got {self.host!r}")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise EngineError(
                f"sim: port must be an integer in 0..65535, got {self.port!r}; 0 picks a free port"
            )
        if not isinstance(self.model, str) or not self.model:
            raise EngineError(f"sim: model must be a non-empty string, got {self.model!r}")
        if not is_int(self.seed):
            raise EngineError(f"sim: seed must be an integer, got {self.seed!r}")
        for name in ("ttft_ms", "tps"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value < 0
            ):
                raise EngineError(
                    f"sim: {name} must be a finite number >= 0, got {value!r}; 0 means no delay"
                )
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise EngineError(
                f"sim: max_tokens must be a positive integer, got {self.max_tokens!r}"
            )
        if not is_int(self.embedding_dim) or not 1 <= self.embedding_dim <= MAX_EMBEDDING_DIM:
            raise EngineError(
                f"sim: embedding_dim must be an integer in 1..{MAX_EMBEDDING_DIM}, got "
                f"{self.embedding_dim!r}"
            )
        if not is_int(self.nodes) or self.nodes < 1:
            raise EngineError(f"sim: nodes must be a positive integer, got {self.nodes!r}")
        if not is_int(self.rank) or not 0 <= self.rank < self.nodes:
            raise EngineError(
                f"sim: rank must be an integer in 0..{self.nodes - 1} for {self.nodes} node(s), "
                f"got {self.rank!r}"
            )
        for name in ("join_timeout_s", "heartbeat_s", "peer_timeout_s"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise EngineError(f"sim: {name} must be a finite number > 0, got {value!r}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise EngineError(
                f"sim: peer_timeout_s ({self.peer_timeout_s:g}) must exceed heartbeat_s "
                f"({self.heartbeat_s:g}), or every peer would look silent"
            )
        if self.nodes > 1:
            try:
                parse_hostport(self.dist_init_addr)
            except ConfigError as exc:
                raise EngineError(
                    f"sim: a replica of {self.nodes} nodes needs dist_init_addr HOST:PORT "
                    f"(rank 0 binds it, workers dial it): {exc}"
                ) from None

    @property
    def worker(self) -> bool:
        """Whether this is a worker of a multi-node replica (it serves nothing)."""
        return self.nodes > 1 and self.rank > 0


def is_int(value: object) -> bool:
    """An int that is not a bool (JSON and YAML give both)."""
    return isinstance(value, int) and not isinstance(value, bool)
