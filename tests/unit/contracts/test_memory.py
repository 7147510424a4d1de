"""A profile's ``host_memory`` (llmgw.contracts.memory, parsed by the catalog) and the size
of a source's weights as a node lists them (NodeSources.size_bytes)."""

from __future__ import annotations

import pytest

from llmgw.contracts.catalog import parse_profile
from llmgw.contracts.memory import mib_text
from llmgw.contracts.model_sources import NodeSources, SourceSpec
from llmgw.errors import ConfigError


def _parse(**raw: object) -> object:
    return parse_profile(
        {"engine": "sim", **raw}, model="m", profile="default", source="catalog.yaml"
    )


def test_host_memory_is_parsed_kept_and_given_back_in_the_catalogs_form() -> None:
    profile = _parse(host_memory="16GiB")
    assert profile.host_memory_mib == 16 * 1024  # type: ignore[attr-defined]
    stored = profile.to_dict()  # type: ignore[attr-defined]
    assert stored["host_memory"] == 16 * 1024
    assert _parse(**{k: v for k, v in stored.items() if k != "engine"}) == profile
    plain = _parse()
    assert plain.host_memory_mib is None  # type: ignore[attr-defined]
    assert "host_memory" not in plain.to_dict()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("16GB", "GB is ambiguous; use binary units, e.g. 16GiB"),
        (0, "must be at least 1 MiB"),
        ("lots", "memory like 40GiB or 40960MiB"),
    ],
)
def test_a_bad_host_memory_is_refused_naming_the_key_and_the_fix(value: object, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        _parse(host_memory=value)
    assert "models.m.profiles.default.host_memory" in str(caught.value)
    assert words in str(caught.value)


def test_mib_text() -> None:
    assert (mib_text(16 * 1024), mib_text(1500)) == ("16 GiB", "1500 MiB")


def test_the_size_of_a_source_as_listed() -> None:
    listed = NodeSources(
        {
            "models_root": "/srv/models",
            "listed_depth": 2,
            "entries": [
                {"name": "a.gguf", "size_bytes": 5, "dir": False},
                {"name": "llama", "size_bytes": 30, "dir": True},
                {"name": "llama/x", "size_bytes": 10, "dir": False},
                {"name": "bare", "size_bytes": 0, "dir": True},
                {"name": "bare/x", "size_bytes": 7, "dir": False},
                {"name": "bare/y", "size_bytes": 8, "dir": False},
                {"name": "bare/sub", "size_bytes": 0, "dir": True},
            ],
        }
    )
    assert listed.size_bytes(SourceSpec("a.gguf")) == 5
    assert listed.size_bytes(SourceSpec("llama")) == 30  # the folder's own size, as reported
    assert listed.size_bytes(SourceSpec("/srv/models/llama")) == 30
    assert listed.size_bytes(SourceSpec("bare")) == 15  # the files listed under it
    assert listed.size_bytes(SourceSpec("missing")) == 0
    assert listed.size_bytes(SourceSpec("/elsewhere/llama")) == 0
    assert listed.size_bytes(SourceSpec("https://h/f.gguf", "ab" * 32)) == 0
