"""The two sides of kv-events agree: a vLLM engine's recorded event batch (msgpack bytes built
from vLLM's schema, its own SHA-256 hashes), re-keyed by the agent's BlockMap, fills the
gateway's index with exactly the keys the gateway computes for the same chat request from the
model's tokenizer.json and chat template, so the request is routed to that replica."""

from __future__ import annotations

import hashlib
import os

import msgpack
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from tokenizers.trainers import WordLevelTrainer

from llmgw.agent.kvevents import BlockMap, Pending
from llmgw.contracts.kvblocks import block_keys
from llmgw.engines.kvevents import decode_batch
from llmgw.proto import control_pb2 as pb
from llmgw.server.gateway.policies import RouteHint
from llmgw.server.gateway.routing import Endpoint, Router
from llmgw.server.gateway.tokenizing import HfTokenizer

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WORDS = "the quick brown fox jumps over a lazy dog you are helpful assistant system user".split()


def tokenizer() -> Tokenizer:
    tok = Tokenizer(WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        [" ".join(WORDS)], WordLevelTrainer(special_tokens=["[UNK]", "<|im_start|>", "<|im_end|>"])
    )
    return tok


def vllm_batch(token_ids: list[int], block_size: int) -> bytes:
    """What vLLM publishes when it caches these tokens' full blocks: one BlockStored in the
    array form, block hashes SHA-256 chained from a random seed (its NONE_HASH)."""
    parent = os.urandom(32)
    hashes = []
    full = len(token_ids) - len(token_ids) % block_size
    for at in range(0, full, block_size):
        parent = hashlib.sha256(parent + repr(token_ids[at : at + block_size]).encode()).digest()
        hashes.append(parent)
    event = ["BlockStored", hashes, None, token_ids[:full], block_size, None, "GPU"]
    return msgpack.packb([1733140000.5, [event], 0], use_bin_type=True)


def test_the_gateway_keys_a_prompt_as_the_agent_keys_the_engines_events() -> None:
    tok = tokenizer()
    gateway_side = HfTokenizer(tok, TEMPLATE)
    messages = [
        {"role": "system", "content": " ".join(WORDS * 12)},
        {"role": "user", "content": "the lazy dog"},
    ]
    ids = gateway_side.token_ids("/v1/chat/completions", {"messages": messages})
    assert ids is not None and len(ids) > 64

    # On the node: the engine computed the same ids (it applied the same template) and
    # published its blocks; the agent re-keys them.
    blocks, pending = BlockMap(), Pending()
    for event in decode_batch(vllm_batch(ids, 16)).events:
        blocks.apply(event, pending)
    (message,) = pending.take("s1", 16)

    router = Router()
    eps = [Endpoint("m", f"r{i}", f"s{i}", f"n{i}", "h:1") for i in range(3)]
    for ep in eps:
        router.set_ready(ep)
    router.kv_events("n1", message)
    router.kv_events("n0", pb.KvEvents(shard_id="s0", block_size=16))
    keys = block_keys(ids, 16)
    assert sorted(message.stored) == sorted(keys)

    # A later turn of the same conversation shares the prefix: it goes to s1.
    later = [
        *messages,
        {"role": "assistant", "content": "you are"},
        {"role": "user", "content": "fox"},
    ]
    later_ids = gateway_side.token_ids("/v1/chat/completions", {"messages": later})
    assert later_ids is not None
    hint = RouteHint("kv-events", block_keys(later_ids, 16), unit=16, tokens=len(later_ids))
    assert router.pick_free("m", 8, hint=hint) is eps[1]
    assert hint.matched >= len(ids) // 16 - 1
