"""The control plane's prompt tokenizers as it wires them: the gateway holds them, a refresh
of the models (what the admin API does after a deploy) tells them the models, and a kv-events
model's tokenizer.json loads in the background while the control plane runs.

A real control plane runs in the test's process on loopback ports picked free.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from tokenizers import Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel

from llmgw.server.app import ControlPlane
from llmgw.server.common.config import load_server_config
from llmgw.server.gateway.tokenizing import HfTokenizer, SimTokenizer


def test_a_refresh_of_the_models_loads_their_tokenizers(tmp_path: Path) -> None:
    tok = Tokenizer(WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    data = tok.to_str().encode()
    path = tmp_path / "tokenizer.json"
    path.write_bytes(data)
    cfg = load_server_config(
        None,
        overrides={
            "state_dir": str(tmp_path / "server"),
            "http_listen": "127.0.0.1:0",
            "grpc_listen": "127.0.0.1:0",
            "enroll_listen": "127.0.0.1:0",
            "bundle_dir": str(tmp_path / "bundles"),
        },
    )

    async def main() -> None:
        cp = ControlPlane(cfg)
        await cp.start()
        try:
            assert cp.gateway.tokenizers is cp.tokenizers
            assert cp.tokenizers.files.cache_dir == tmp_path / "server" / "tokenizers"
            profile = {
                "engine": "vllm",
                "gpus": 1,
                "routing": "kv-events",
                "tokenizer": {"path": str(path), "sha256": hashlib.sha256(data).hexdigest()},
            }
            cp.store.put_catalog_model("routed", {"default": profile})
            cp.store.put_model("sim-model", engine="sim", params={}, replicas=0)
            cp.serving.refresh_models()
            assert isinstance(cp.gateway.tokenizers.for_model("sim-model"), SimTokenizer)
            for _ in range(200):
                if cp.gateway.tokenizers.for_model("routed") is not None:
                    break
                await asyncio.sleep(0.02)
            loaded = cp.gateway.tokenizers.for_model("routed")
            assert isinstance(loaded, HfTokenizer)
            assert loaded.token_ids("/v1/completions", {"prompt": "hello world"}) == [1, 2]
        finally:
            await cp.stop()

    asyncio.run(main())
