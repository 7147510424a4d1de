"""The ``sim`` engine's KV event publisher: a ZeroMQ PUB socket framed exactly as vLLM's
``ZmqEventPublisher`` (vllm/distributed/kv_events.py).

Each batch is one multipart message ``(topic, seq, payload)``: the configured topic, ``seq``
8 bytes big-endian counting from 0, the payload :func:`llmgw.engines.kvevents.encode_batch`.
The socket binds or connects by vLLM's rule (:func:`~llmgw.engines.kvevents.publisher_binds`:
binds ``*``, ``::``, ``ipc://`` and ``inproc://`` endpoints, connects to the others), has a
high-water mark and linger 0. Sends are non-blocking from the event loop: a batch that would
block is dropped and counted (its ``seq`` is spent all the same, so a subscriber sees the
gap), with a log line at most once a minute; publishing never holds the engine up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import zmq

from llmgw.engines.kvevents import Event, EventBatch, encode_batch, publisher_binds
from llmgw.errors import EngineError
from llmgw.sim.config import KvEventsSettings

__all__ = ["DROP_LOG_INTERVAL_S", "EventPublisher"]

log = logging.getLogger("llmgw.engine.sim")

DROP_LOG_INTERVAL_S = 60.0
"""The least time between two log lines about dropped batches."""


class EventPublisher:
    """One engine's PUB socket; :meth:`publish` sends a batch, :meth:`close` ends it."""

    def __init__(self, settings: KvEventsSettings) -> None:
        self.endpoint = settings.endpoint
        self.topic = settings.topic
        self._topic = settings.topic.encode("utf-8")
        self._seq = 0
        self.dropped = 0
        self._logged_drops = 0
        self._last_drop_log = float("-inf")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.SNDHWM, settings.hwm)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            if publisher_binds(self.endpoint):
                self._socket.bind(self.endpoint)
            else:
                self._socket.connect(self.endpoint)
        except zmq.ZMQError as exc:
            self._socket.close(0)
            self._context.term()
            verb = "bind" if publisher_binds(self.endpoint) else "connect to"
            raise EngineError(
                f"sim: cannot {verb} the KV events endpoint {self.endpoint}: {exc}; fix "
                "--kv-events-config's endpoint or free the address"
            ) from exc

    @property
    def sequence(self) -> int:
        """The ``seq`` the next batch gets."""
        return self._seq

    def publish(self, events: Sequence[Event]) -> bool:
        """Send one batch of ``events`` (now's ``ts``); False when it was dropped."""
        seq = self._seq
        self._seq += 1
        payload = encode_batch(EventBatch(time.time(), tuple(events)))
        try:
            self._socket.send_multipart(
                [self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self._dropped()
            return False
        return True

    def _dropped(self) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._last_drop_log >= DROP_LOG_INTERVAL_S:
            log.warning(
                "sim: dropped %d KV event batch(es) to %s: the subscriber is not keeping up",
                self.dropped - self._logged_drops,
                self.endpoint,
                extra={"engine": "sim", "endpoint": self.endpoint, "dropped": self.dropped},
            )
            self._last_drop_log = now
            self._logged_drops = self.dropped

    def close(self) -> None:
        """Close the socket (linger 0: what is unsent is dropped) and its context."""
        if self._socket.closed:
            return
        self._socket.close(0)
        self._context.term()
