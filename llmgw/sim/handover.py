"""The ``sim`` engine's side of disaggregated prefill/decode: a request's ``kv_transfer_params``
checked and carried out as vLLM's NixlConnector does (:class:`Handover`), over the TCP
transfer of :mod:`llmgw.sim.transfer`.

The flow is the one vLLM's disaggregation proxy drives
(tests/v1/kv_connector/nixl_integration/toy_proxy_server.py):

- Prefill: the client's body with ``kv_transfer_params: {"do_remote_decode": true,
  "do_remote_prefill": false, ...}``, ``stream: false``, ``max_tokens: 1``. The engine pays the
  prompt's prefill, keeps its blocks and answers a normal response with a top-level
  ``kv_transfer_params`` naming itself, as ``NixlConnectorScheduler.request_finished`` makes
  it: ``do_remote_prefill`` true, ``do_remote_decode`` false, ``remote_block_ids``,
  ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``, ``tp_size``
  (1). As in vLLM, only an answer cut by its length keeps blocks (one that ended by itself
  gives ``kv_transfer_params: null``, its blocks freed).
- Decode: the client's body with those params. The engine pulls the blocks its own prefix
  cache lacks (vLLM's ``get_num_new_matched_tokens``: the prompt less the locally computed
  tokens) and answers without paying the prefill; its response carries
  ``kv_transfer_params: null``, as vLLM's. Usage as vLLM reports a remotely prefilled
  request: ``prompt_tokens`` the whole prompt, ``cached_tokens`` the prompt less one (vLLM's
  scheduler counts the loaded tokens as computed, less the last one, which it recomputes for
  the first token's logits; ``_update_waiting_for_remote_kv``).
- A pull that fails (refused, cut, over ``--kv-transfer-timeout``) is handled as vLLM's
  ``kv_load_failure_policy: "recompute"``: the decode prefills the prompt itself and answers
  normally; each is counted (``llmgw_sim_kv_load_failures_total`` on ``/metrics``).

Refusals (400, OpenAI's error shape, ``param`` naming the member): params that are not an
object, flags that are not booleans, both flags true, a decode without its engine id, block
ids, host or port, block ids another prompt's length, a prefill that streams, and more than
one prompt or choice (one request is one transfer). An engine started without
``--kv-transfer-addr`` refuses any ``kv_transfer_params`` asking for a transfer (vLLM without
a connector would ignore them and serve the request whole, which hides a deployment's
mistake). Params with neither flag set ask for nothing and the request is served whole.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from llmgw.sim.config import SimConfig, is_int
from llmgw.sim.protocol import BadRequest
from llmgw.sim.transfer import BlockServer, PullFailed, TransferStats, pull

__all__ = ["PARAM", "Handover", "Remote", "Role"]

log = logging.getLogger("llmgw.engine.sim")

PARAM = "kv_transfer_params"


@dataclass(frozen=True, slots=True)
class Remote:
    """A decode's order: pull ``block_ids`` of ``engine_id`` from ``host:port``."""

    engine_id: str
    block_ids: list[int]
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Role:
    """What a request's ``kv_transfer_params`` ask of this engine: a prefill whose blocks
    are kept for a decode (``remote`` None), or a decode of a remote prefill."""

    remote: Remote | None = None


class Handover:
    """The transfers of one engine: its block server on ``--kv-transfer-addr`` (None
    without one) and its counters."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.stats = TransferStats()
        self.engine_id = str(uuid.uuid4())  # as vLLM's: a fresh id per engine start
        self.server: BlockServer | None = None
        self.host = ""
        self.port = 0

    async def open(self) -> None:
        """Listen on ``--kv-transfer-addr`` when it is given; EngineError when it cannot."""
        addr = self.cfg.kv_transfer_hostport
        if addr is None:
            return
        server = BlockServer(
            self.engine_id,
            self.cfg.block_size,
            self.cfg.kv_bytes_per_token,
            self.cfg.kv_transfer_timeout_s,
            self.stats,
        )
        self.host, self.port = await server.open(*addr)
        self.server = server
        log.info(
            "sim: serving kept KV blocks on %s:%d engine_id=%s",
            self.host,
            self.port,
            self.engine_id,
            extra={"engine": "sim", "kv_transfer_port": self.port},
        )

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()
            self.server = None

    # ----------------------------------------------------------------- the request's params

    def role(
        self, params: object, *, prompts: int, n: int, stream: bool, prompt_tokens: int
    ) -> Role | None:
        """What ``params`` ask of this engine (None: nothing, serve the request whole);
        BadRequest says what is wrong with them."""
        if not isinstance(params, dict):
            raise BadRequest(f"'{PARAM}' must be an object, got {_kind(params)}", PARAM)
        decode = _flag(params, "do_remote_decode")
        prefill = _flag(params, "do_remote_prefill")
        if decode and prefill:
            raise BadRequest(
                f"'{PARAM}' sets both do_remote_decode (this engine prefills for a remote "
                "decode) and do_remote_prefill (this engine decodes a remote prefill); set "
                "one of them",
                PARAM,
            )
        if not decode and not prefill:
            return None
        if self.server is None:
            raise BadRequest(
                f"this engine was not started with a KV transfer address (--kv-transfer-addr), "
                f"so it cannot {'keep blocks for' if decode else 'pull blocks from'} another "
                f"engine; drop '{PARAM}' or deploy the model disaggregated",
                PARAM,
            )
        if prompts != 1 or n != 1:
            raise BadRequest(
                f"'{PARAM}' take one prompt and n=1 (one request, one KV transfer); this "
                f"request has {prompts} prompt(s) and n={n}",
                PARAM,
            )
        if decode:
            if stream:
                raise BadRequest(
                    f"a prefill for a remote decode ('{PARAM}.do_remote_decode') must not "
                    "stream: the kept blocks are named in the response body; set stream false",
                    "stream",
                )
            return Role()
        return Role(_remote(params, self.cfg.block_size, prompt_tokens))

    # ----------------------------------------------------------------- the two sides

    def keep(self, prompt_tokens: int, finish: str) -> dict[str, Any] | None:
        """The prefill's answer ``kv_transfer_params``: its blocks kept for the decode (none,
        and None, when the answer ended by itself, as vLLM keeps only a length-capped one)."""
        server = self.server
        assert server is not None  # role() refused a transfer without it
        if finish != "length" or prompt_tokens == 0:
            return None
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": server.keep(prompt_tokens),
            "remote_engine_id": self.engine_id,
            "remote_request_id": f"sim-{uuid.uuid4().hex}",
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    async def pull(self, remote: Remote, prompt_tokens: int, cached: int) -> bool:
        """Pull the blocks of the prompt this engine's cache lacks (from ``cached`` tokens
        on); False when the pull failed and the prompt must be recomputed (counted)."""
        first = cached // self.cfg.block_size
        blocks = remote.block_ids[first:]
        if not blocks:  # all cached here: nothing to move (vLLM only notifies the prefill)
            return True
        expect = (prompt_tokens - cached) * self.cfg.kv_bytes_per_token
        try:
            got = await pull(
                remote.host,
                remote.port,
                remote.engine_id,
                blocks,
                expect,
                self.cfg.kv_transfer_timeout_s,
            )
        except PullFailed as e:
            self.stats.load_failures += 1
            log.warning(
                "sim: %s; recomputing the prompt (kv_load_failure_policy recompute)",
                e.message,
                extra={"engine": "sim"},
            )
            return False
        self.stats.pulls_done += 1
        self.stats.bytes_received += got
        return True

    # ----------------------------------------------------------------- /metrics

    async def metrics(self, request: web.Request) -> web.StreamResponse:
        """``GET /metrics``: the transfer counters in Prometheus' text format."""
        s = self.stats
        held = self.server.held_blocks if self.server is not None else 0
        rows = [
            ("kv_blocks_held", "gauge", "KV blocks kept for a remote decode's pull", held),
            (
                "kv_kept_requests_total",
                "counter",
                "prompts whose blocks were kept",
                s.kept_requests,
            ),
            ("kv_pulls_served_total", "counter", "pulls answered with blocks", s.pulls_served),
            ("kv_pulls_refused_total", "counter", "pulls refused", s.pulls_refused),
            ("kv_bytes_sent_total", "counter", "KV bytes sent to decodes", s.bytes_sent),
            (
                "kv_expired_requests_total",
                "counter",
                "kept prompts freed unpulled",
                s.expired_requests,
            ),
            ("kv_pulls_total", "counter", "pulls this engine completed", s.pulls_done),
            ("kv_bytes_received_total", "counter", "KV bytes pulled", s.bytes_received),
            ("kv_load_failures_total", "counter", "failed pulls recomputed", s.load_failures),
        ]
        lines: list[str] = []
        for name, kind, text, value in rows:
            full = f"llmgw_sim_{name}"
            lines += [f"# HELP {full} {text}", f"# TYPE {full} {kind}", f"{full} {value}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _flag(params: dict[str, Any], name: str) -> bool:
    value = params.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"'{PARAM}.{name}' must be a boolean, got {value!r}", f"{PARAM}.{name}")
    return value


def _remote(params: dict[str, Any], block_size: int, prompt_tokens: int) -> Remote:
    """A decode's order from ``params``; BadRequest names what is missing or wrong."""
    fix = "pass the kv_transfer_params the prefill's response carried, unchanged"
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise _bad("remote_engine_id", f"must be the prefill's engine id, got {engine_id!r}", fix)
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise _bad("remote_host", f"must be the prefill's host, got {host!r}", fix)
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise _bad("remote_port", f"must be a port in 1..65535, got {port!r}", fix)
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list) or not blocks or not all(is_int(b) and b >= 0 for b in blocks):
        raise _bad(
            "remote_block_ids", f"must be a non-empty list of block ids, got {blocks!r}", fix
        )
    if len(set(blocks)) != len(blocks):
        raise _bad("remote_block_ids", "names a block twice", fix)
    needed = -(-prompt_tokens // block_size)
    if len(blocks) != needed:
        raise _bad(
            "remote_block_ids",
            f"has {len(blocks)} block(s) but this prompt of {prompt_tokens} tokens fills "
            f"{needed} of {block_size}: they are another prompt's (or another block size's)",
            "send the decode the same prompt as the prefill, to engines of one block_size",
        )
    tp_size = params.get("tp_size", 1)
    if tp_size is not None and (not is_int(tp_size) or tp_size < 1):
        raise _bad("tp_size", f"must be a positive integer, got {tp_size!r}", fix)
    return Remote(engine_id, list(blocks), host, port)


def _bad(member: str, problem: str, fix: str) -> BadRequest:
    return BadRequest(f"'{PARAM}.{member}' {problem}; {fix}", f"{PARAM}.{member}")


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
