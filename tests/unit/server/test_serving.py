"""The request path's caches (llmgw.server.gateway.serving): active key hashes, deployed model names,
and the body limits deployed profiles raise above server.yaml's."""

from __future__ import annotations

from pathlib import Path

from llmgw.server.gateway.serving import ServingCache
from llmgw.server.store import Store, hash_api_key


def test_refresh_reads_keys_models_and_body_limits(tmp_path: Path) -> None:
    with Store.open(tmp_path / "llmgw.db") as store:
        cache = ServingCache(store, max_request_body=1000)
        cache.refresh_keys()
        cache.refresh_models()
        assert set(cache.keys) == set() and set(cache.models) == set()
        assert cache.body_limits == {} and cache.largest_body_limit == 1000
        _key, secret = store.create_api_key("k")
        store.put_catalog_model("big", {"p": {"engine": "sim", "max_request_body": 5000}})
        store.deploy_model("big", profile="p", replicas=1)
        store.put_model("small", engine="sim", params={}, replicas=1)
        # Nothing changes until the admin API refreshes.
        assert set(cache.keys) == set() and set(cache.models) == set()
        cache.refresh_keys()
        cache.refresh_models()
        assert set(cache.keys) == {hash_api_key(secret)}
        assert set(cache.models) == {"big", "small"}
        assert cache.body_limits == {"big": 5000}
        assert cache.largest_body_limit == 5000
