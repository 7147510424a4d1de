"""The model-source contract: what a source may be, where a fetched one lies, which nodes
have or may fetch it, and the one fetch rule both sides read."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw.contracts.model_sources import NodeSources, SourceSpec, parse_source
from llmgw.contracts.sources import fetchable, parse_prefix
from llmgw.errors import ConfigError

SHA = "0f" * 32


def test_names_paths_and_urls() -> None:
    assert parse_source("llama") == SourceSpec("llama")
    assert parse_source("/srv/llmgw/models/org/m") == SourceSpec("/srv/llmgw/models/org/m")
    url = parse_source({"url": " https://h/m/w.gguf ", "sha256": SHA.upper()})
    assert url == SourceSpec("https://h/m/w.gguf", SHA)
    assert url.cache_path(Path("/srv/llmgw/cache")) == Path(
        f"/srv/llmgw/cache/sources/{SHA}/w.gguf"
    )
    assert url.to_value() == {"url": "https://h/m/w.gguf", "sha256": SHA}
    with pytest.raises(ConfigError, match="must be a name under the node's models_root"):
        parse_source(["llama"])


@pytest.mark.parametrize(
    ("source", "root", "name"),
    [
        ("llama", "/srv/llmgw/models", "llama"),
        ("/srv/llmgw/models/org/m", "/srv/llmgw/models", "org/m"),
        ("/srv/llmgw/models/org/m", "/srv/llmgw/models/", "org/m"),
        ("/srv/llmgw/models-old/m", "/srv/llmgw/models", None),  # a prefix, not a parent
        ("/srv/llmgw/models", "/srv/llmgw/models", None),  # the root itself is no source
    ],
)
def test_the_name_a_source_has_under_a_models_root(
    source: str, root: str, name: str | None
) -> None:
    assert SourceSpec(source).name_under(root) == name


def test_the_fetch_rule() -> None:
    listed = (parse_prefix("http://10.0.0.2:8000/models/"), parse_prefix("file:///srv/share/"))
    assert fetchable("https://anywhere.example/m.gguf", ())
    assert fetchable("http://10.0.0.2:8000/models/m.gguf", listed)
    assert not fetchable("http://10.0.0.2:8000/models/m.gguf", ())
    assert not fetchable("http://10.0.0.2:8000/models-x/m.gguf", listed)
    assert fetchable("file:///srv/share/m.gguf", listed)
    assert not fetchable("file:///srv/share/../etc/shadow", listed)
    assert not fetchable("ftp://h/m.gguf", listed)


def test_a_node_without_a_report_is_none_and_a_bad_prefix_is_no_prefix() -> None:
    assert NodeSources.from_inventory({"gpus": []}) is None
    assert NodeSources.from_inventory({"sources": None}) is None
    node = NodeSources.from_inventory(
        {"sources": {"models_root": "/m", "fetch_prefixes": ["not a url", "file:///s/"]}}
    )
    assert node is not None
    assert [p.text for p in node.prefixes] == ["file:///s/"]
    assert node.problem(SourceSpec("file:///s/w.gguf", SHA)) == ""
