"""catalog.yaml -> Catalog: profiles, sidecars, units, and refusals naming model, profile, key."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

from llmgw.contracts.catalog import (
    Catalog,
    ModelSpec,
    Profile,
    Sidecar,
    adhoc_profile,
    load_catalog,
    parse_catalog,
    parse_memory_mib,
    parse_profile,
    profile_body_limit,
)
from llmgw.contracts.model_sources import SourceSpec
from llmgw.engines import registry
from llmgw.errors import ConfigError

FULL = """\
models:
  llama-3-8b:
    profiles:
      default: {engine: vllm, source: /srv/llmgw/models/llama-3-8b, gpus: 1, gpu_memory: 40GiB, args: [--max-model-len, "8192"]}
      tp2: {engine: vllm, source: /srv/llmgw/models/llama-3-8b, gpus: 2}
      big: {engine: sglang, source: /srv/llmgw/models/llama-3-70b, gpus: 8, nodes: 2, placement: spread}
      cpu: {engine: llamacpp, source: /srv/llmgw/models/llama-3-8b.Q4.gguf, gpus: 0, params: {ctx_size: "4096"}}
    sidecars:            # optional, per model or per profile
      - {name: tokenizer, command: [/usr/local/bin/tok-server, --port, "9100"], health: "http://127.0.0.1:9100/health", timeout: 60s}
  llmgw-sim:
    profiles:
      default: {engine: sim, gpus: 0, params: {ttft_ms: "20"}}
"""

TOKENIZER = Sidecar(
    name="tokenizer",
    command=("/usr/local/bin/tok-server", "--port", "9100"),
    health="http://127.0.0.1:9100/health",
    timeout_s=60.0,
    ready_after_s=2.0,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def test_full_catalog(tmp_path: Path) -> None:
    catalog = load_catalog(write(tmp_path, FULL))
    llama = catalog.models["llama-3-8b"]
    assert list(llama.profiles) == ["default", "tp2", "big", "cpu"]
    assert llama.profiles["default"] == Profile(
        engine="vllm",
        source="/srv/llmgw/models/llama-3-8b",
        gpus=1,
        nodes=1,
        gpu_memory_mib=40960,
        args=("--max-model-len", "8192"),
        params={},
        placement="binpack",
        sidecars=(TOKENIZER,),
    )
    big = llama.profiles["big"]
    assert (big.engine, big.gpus, big.nodes, big.placement) == ("sglang", 8, 2, "spread")
    assert big.gpu_memory_mib is None
    cpu = llama.profiles["cpu"]
    assert (cpu.gpus, cpu.params) == (0, {"ctx_size": "4096"})
    # Model-level sidecars go to every profile.
    assert all(p.sidecars == (TOKENIZER,) for p in llama.profiles.values())
    assert catalog.models["llmgw-sim"] == ModelSpec(
        "llmgw-sim", {"default": Profile(engine="sim", params={"ttft_ms": "20"})}
    )


def test_full_catalog_round_trips_through_json(tmp_path: Path) -> None:
    catalog = load_catalog(write(tmp_path, FULL))
    data = json.loads(json.dumps(catalog.to_dict()))
    assert parse_catalog(data, source="again") == catalog
    assert data["models"]["llama-3-8b"]["profiles"]["default"] == {
        "engine": "vllm",
        "source": "/srv/llmgw/models/llama-3-8b",
        "gpus": 1,
        "nodes": 1,
        "gpu_memory": 40960,
        "args": ["--max-model-len", "8192"],
        "params": {},
        "placement": "binpack",
        "sidecars": [
            {
                "name": "tokenizer",
                "command": ["/usr/local/bin/tok-server", "--port", "9100"],
                "health": "http://127.0.0.1:9100/health",
                "timeout": 60.0,
                "ready_after": 2.0,
            }
        ],
    }
    assert data["models"]["llmgw-sim"]["profiles"]["default"] == {
        "engine": "sim",
        "gpus": 0,
        "nodes": 1,
        "args": [],
        "params": {"ttft_ms": "20"},
        "placement": "binpack",
        "sidecars": [],
    }


def test_the_three_source_forms_parse_and_round_trip() -> None:
    sha = "AB" * 32
    data = {
        "models": {
            "m": {
                "profiles": {
                    "named": {"engine": "vllm", "source": "meta/Llama-3-8B", "gpus": 1},
                    "path": {"engine": "vllm", "source": "/srv/llmgw/models/llama", "gpus": 1},
                    "fetched": {
                        "engine": "llamacpp",
                        "source": {"url": "https://h.example/m/tiny.Q4.gguf", "sha256": sha},
                        "gpus": 0,
                    },
                    "sim": {"engine": "sim", "source": "tiny"},
                }
            }
        }
    }
    catalog = parse_catalog(data, source="c.yaml")
    profiles = catalog.models["m"].profiles
    assert (profiles["named"].source, profiles["named"].source_sha256) == ("meta/Llama-3-8B", "")
    assert profiles["path"].source_spec == SourceSpec("/srv/llmgw/models/llama")
    fetched = profiles["fetched"].source_spec
    # The SHA-256 is kept lowercase: the cache folder's name on the node.
    assert fetched == SourceSpec("https://h.example/m/tiny.Q4.gguf", sha.lower())
    assert fetched.file_name == "tiny.Q4.gguf"
    assert profiles["sim"].source == "tiny"
    stored = json.loads(json.dumps(catalog.to_dict()))
    assert stored["models"]["m"]["profiles"]["fetched"]["source"] == {
        "url": "https://h.example/m/tiny.Q4.gguf",
        "sha256": sha.lower(),
    }
    assert stored["models"]["m"]["profiles"]["named"]["source"] == "meta/Llama-3-8B"
    assert parse_catalog(stored, source="again") == catalog


def test_a_profile_may_raise_the_request_body_limit_and_it_round_trips() -> None:
    data = {
        "models": {
            "long": {
                "profiles": {
                    "128k": {"engine": "sim", "max_request_body": "64MiB"},
                    "default": {"engine": "sim"},
                }
            }
        }
    }
    catalog = parse_catalog(data, source="c.yaml")
    profiles = catalog.models["long"].profiles
    assert profiles["128k"].max_request_body == 64 * 1024 * 1024
    assert profiles["default"].max_request_body is None
    stored = json.loads(json.dumps(catalog.to_dict()))
    assert stored["models"]["long"]["profiles"]["128k"]["max_request_body"] == 64 * 1024**2
    assert "max_request_body" not in stored["models"]["long"]["profiles"]["default"]
    assert parse_catalog(stored, source="again") == catalog
    assert profile_body_limit(stored["models"]["long"]["profiles"]["128k"]) == 64 * 1024**2
    assert profile_body_limit(stored["models"]["long"]["profiles"]["default"]) is None
    assert profile_body_limit(None) is None


def test_profile_sidecars_replace_the_models_by_name_and_add_to_them() -> None:
    data = {
        "models": {
            "m": {
                "sidecars": [
                    {"name": "tok", "command": ["tok"]},
                    {"name": "cache", "command": ["/bin/cache"], "ready_after": 0},
                ],
                "profiles": {
                    "a": {"engine": "sim"},
                    "b": {
                        "engine": "sim",
                        "sidecars": [
                            {"name": "extra", "command": ["extra"]},
                            {"name": "tok", "command": ["tok", "--fast"], "timeout": "2m"},
                        ],
                    },
                },
            }
        }
    }
    profiles = parse_catalog(data, source="c").models["m"].profiles
    assert [s.name for s in profiles["a"].sidecars] == ["tok", "cache"]
    assert profiles["b"].sidecars == (
        Sidecar("tok", ("tok", "--fast"), timeout_s=120.0),
        Sidecar("cache", ("/bin/cache",), ready_after_s=0.0),
        Sidecar("extra", ("extra",)),
    )


def test_empty_models_is_an_empty_catalog() -> None:
    assert parse_catalog({"models": {}}, source="c") == Catalog({})


def test_adhoc_profile_is_a_valid_default_profile() -> None:
    stored = adhoc_profile("sim", {"ttft_ms": 5, "extra_args": ["--x"]})
    assert stored["params"] == {"ttft_ms": "5"} and stored["args"] == ["--x"]
    parsed = parse_catalog({"models": {"m": {"profiles": {"default": stored}}}}, source="c")
    assert parsed.models["m"].profiles["default"].to_dict() == stored


def _sidecar_timeout(value: object) -> float:
    """A sidecar's ``timeout`` as the catalog reads it (llmgw.durations' one syntax)."""
    sidecar = {"name": "tok", "command": ["tok"], "timeout": value}
    data = {"models": {"m": {"profiles": {"p": {"engine": "sim", "sidecars": [sidecar]}}}}}
    return parse_catalog(data, source="c").models["m"].profiles["p"].sidecars[0].timeout_s


@pytest.mark.parametrize(
    ("text", "seconds"),
    [(60, 60.0), (1.5, 1.5), ("60s", 60.0), ("500ms", 0.5), ("5m", 300.0), ("1h", 3600.0)],
)
def test_durations(text: object, seconds: float) -> None:
    assert _sidecar_timeout(text) == seconds


@pytest.mark.parametrize(("text", "seconds"), [("30d", 30 * 86400.0), ("90", 90.0)])
def test_durations_have_the_one_syntax_of_every_setting(text: str, seconds: float) -> None:
    """Until the durations were unified, catalog.yaml refused "30d" (valid in server.yaml)
    and a unit-less string; both are read as everywhere else now."""
    assert _sidecar_timeout(text) == seconds


@pytest.mark.parametrize("text", ["-1s", "s", "1 h", "1w", True, [1]])
def test_bad_durations(text: object) -> None:
    with pytest.raises(
        ConfigError, match=r"^c: models\.m\.profiles\.p\.sidecars\[0\]\.timeout: .*duration"
    ):
        _sidecar_timeout(text)


@pytest.mark.parametrize(
    ("text", "mib"),
    [
        (40960, 40960),
        ("40GiB", 40960),
        ("40960MiB", 40960),
        ("1.5GiB", 1536),
        ("1TiB", 1048576),
        ("80 gib", 81920),
    ],
)
def test_memory_units(text: object, mib: int) -> None:
    assert parse_memory_mib(text) == mib


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("40GB", "GB is ambiguous; use binary units, e.g. 40GiB"),
        ("40G", "use binary units, e.g. 40GiB"),
        ("40KiB", "unknown unit 'KiB'; use MiB, GiB or TiB"),
        ("0.5MiB", "not a whole number of MiB"),
        (0, "at least 1 MiB"),
        ("40960", "must be memory like 40GiB"),
        (1.5, "must be memory like 40GiB"),
        (True, "must be memory like 40GiB"),
    ],
)
def test_bad_memory(text: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_memory_mib(text)


# Each case: a change to one valid profile of model "llama" (profile "p"), the key the
# error must name, and a part of the message.
BASE: dict[str, Any] = {
    "engine": "vllm",
    "source": "/srv/llmgw/models/llama",
    "gpus": 1,
}
P = "models.llama.profiles.p"

INVALID_PROFILES: list[tuple[dict[str, Any], str, str]] = [
    ({"engin": "vllm"}, f"{P}.engin", "unknown key 'engin'; did you mean 'engine'?"),
    ({"engine": None}, f"{P}.engine", "is missing: choose one of sim, vllm, sglang, llamacpp"),
    ({"engine": "vlm"}, f"{P}.engine", "unknown engine 'vlm'; did you mean 'vllm'?"),
    ({"engine": 3}, f"{P}.engine", "must be a string, got int"),
    ({"source": None}, f"{P}.source", "is missing: engine vllm needs its weights"),
    ({"source": ""}, f"{P}.source", "must be a name under the node's models_root"),
    ({"source": 7}, f"{P}.source", "must be a name under the node's models_root"),
    ({"source": "../etc/shadow"}, f"{P}.source", "has an empty, '.' or '..' segment"),
    ({"source": "/srv/llmgw/models/../x"}, f"{P}.source", "a source stays under the node's"),
    ({"source": "a//b"}, f"{P}.source", "has an empty, '.' or '..' segment"),
    ({"source": "a/b/c/d"}, f"{P}.source", "is 4 levels deep; the agent lists models_root 3"),
    ({"source": "a\\b"}, f"{P}.source", "must not contain a NUL character or a backslash"),
    ({"source": "https://h/m.gguf"}, f"{P}.source", "is a URL without its SHA-256"),
    ({"source": {"url": "https://h/m.gguf"}}, f"{P}.source", "needs sha256: the 64 hex"),
    (
        {"source": {"url": "https://h/m.gguf", "sha256": "ab" * 31}},
        f"{P}.source",
        "needs sha256: the 64 hex",
    ),
    ({"source": {"sha256": "ab" * 32}}, f"{P}.source", "needs url: the https://"),
    (
        {"source": {"url": "ftp://h/m.gguf", "sha256": "ab" * 32}},
        f"{P}.source",
        "cannot be fetched: only https://, http:// and file:// URLs",
    ),
    (
        {"source": {"url": "https://h/models/", "sha256": "ab" * 32}},
        f"{P}.source",
        "must end in the file's name",
    ),
    (
        {"source": {"url": "https://h/m.gguf?sig=1", "sha256": "ab" * 32}},
        f"{P}.source",
        "must not have a query or fragment",
    ),
    (
        {"source": {"url": "https://h/m.gguf", "sha256": "ab" * 32, "size": 1}},
        f"{P}.source",
        "has unknown key(s) size",
    ),
    ({"gpus": None}, f"{P}.gpus", "is missing: engine vllm needs the number of GPUs"),
    ({"gpus": -1}, f"{P}.gpus", "must be at least 0, got -1"),
    ({"gpus": 1.5}, f"{P}.gpus", "must be a whole number, got float 1.5"),
    ({"gpus": True}, f"{P}.gpus", "must be a whole number, got bool"),
    ({"gpus": "2"}, f"{P}.gpus", "must be a whole number, got string '2'"),
    ({"nodes": 0}, f"{P}.nodes", "must be at least 1, got 0"),
    (
        {"gpus": 0, "nodes": 2},
        f"{P}.nodes",
        "2 nodes need gpus >= 1 (multi-node replicas shard GPUs across nodes)",
    ),
    ({"gpu_memory": "40GB"}, f"{P}.gpu_memory", "GB is ambiguous"),
    ({"gpu_memory": "lots"}, f"{P}.gpu_memory", "must be memory like 40GiB"),
    ({"gpus": 0, "gpu_memory": "40GiB"}, f"{P}.gpu_memory", "memory per GPU but gpus is 0"),
    ({"args": "--max-model-len 8192"}, f"{P}.args", "must be a list, got string"),
    ({"args": ["--max-model-len", 8192]}, f"{P}.args[1]", 'quote the number: "8192"'),
    ({"args": [""]}, f"{P}.args[0]", "must not be empty"),
    ({"params": ["ctx_size=4096"]}, f"{P}.params", "must be a mapping of name to settings"),
    ({"params": {"ctx_size": 4096}}, f"{P}.params.ctx_size", 'quote the number: "4096"'),
    ({"params": {"extra_args": "x"}}, f"{P}.params.extra_args", "give extra engine arguments"),
    ({"params": {"a b": "x"}}, f"{P}.params.a b", "not a valid parameter name"),
    ({"params": {"max_len": "8"}}, f"{P}.params", "vllm engine has no parameter 'max_len'"),
    ({"params": {"max_model_len": "0"}}, f"{P}.params", "max_model_len='0' must be at least 1"),
    ({"params": {"model_path": "/m"}}, f"{P}.params.model_path", "is the profile's source"),
    ({"placement": "pack"}, f"{P}.placement", "unknown placement 'pack'; did you mean"),
    ({"placement": 1}, f"{P}.placement", "must be a string, got int"),
    ({"max_request_body": "64MB"}, f"{P}.max_request_body", "ambiguous; use binary units"),
    ({"max_request_body": 10}, f"{P}.max_request_body", "must be at least 1 KiB"),
    ({"max_request_body": "2GiB"}, f"{P}.max_request_body", "must be at most 1 GiB"),
    ({"sidecars": {"name": "tok"}}, f"{P}.sidecars", "must be a list, got mapping"),
    ({"sidecars": [{"command": ["tok"]}]}, f"{P}.sidecars[0].name", "each sidecar needs a name"),
    ({"sidecars": [{"name": "tok"}]}, f"{P}.sidecars[0].command", "the program and its"),
    ({"sidecars": [{"name": "tok", "command": []}]}, f"{P}.sidecars[0].command", "empty list"),
    (
        {"sidecars": [{"name": "tok", "command": ["bin/tok"]}]},
        f"{P}.sidecars[0].command[0]",
        "'bin/tok' is a relative path",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["tok"], "health": "127.0.0.1:9100"}]},
        f"{P}.sidecars[0].health",
        "is not an http:// or https:// URL with a host",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["tok"], "health": "http://h:99999/"}]},
        f"{P}.sidecars[0].health",
        "invalid port",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["tok"], "timeout": "forever"}]},
        f"{P}.sidecars[0].timeout",
        "a duration like 500ms, 30s, 5m, 2h or 30d",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["tok"], "timeout": 0}]},
        f"{P}.sidecars[0].timeout",
        "must be more than 0 s",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["tok"], "readyafter": "1s"}]},
        f"{P}.sidecars[0].readyafter",
        "did you mean 'ready_after'?",
    ),
    (
        {"sidecars": [{"name": "tok", "command": ["a"]}, {"name": "tok", "command": ["b"]}]},
        f"{P}.sidecars[1].name",
        "sidecar 'tok' is listed twice (also models.llama.profiles.p.sidecars[0])",
    ),
    (
        {"sidecars": [{"name": "-tok", "command": ["a"]}]},
        f"{P}.sidecars[0].name",
        "is not a valid sidecar name",
    ),
]


@pytest.mark.parametrize(("change", "key", "message"), INVALID_PROFILES)
def test_invalid_profiles_name_model_profile_and_key(
    change: dict[str, Any], key: str, message: str
) -> None:
    profile = {**BASE, **change}
    for name, value in change.items():
        if value is None:
            del profile[name]
    with pytest.raises(ConfigError) as info:
        parse_catalog({"models": {"llama": {"profiles": {"p": profile}}}}, source="catalog.yaml")
    text = str(info.value)
    assert text.startswith(f"catalog.yaml: {key}: "), text
    assert message in text, text
    assert info.value.key == key and info.value.file == "catalog.yaml"


def test_params_are_checked_against_the_engine() -> None:
    bad = {"models": {"s": {"profiles": {"fast": {"engine": "sim", "params": {"speed": "9"}}}}}}
    with pytest.raises(ConfigError, match=r"^c: models\.s\.profiles\.fast\.params: sim engine"):
        parse_catalog(bad, source="c")
    worse = copy.deepcopy(bad)
    worse["models"]["s"]["profiles"]["fast"]["params"] = {"ttft_ms": "soon"}
    with pytest.raises(ConfigError, match="ttft_ms='soon' is not a valid float"):
        parse_catalog(worse, source="c")


def test_an_engine_without_a_multi_node_form_is_refused_several_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check reads the registry's capability, so it fails for an engine whose builder
    has no multi-node form (today every engine has one: one is made single-node here)."""
    single = {n: replace(e, multi_node=n != "vllm") for n, e in registry.ENGINES.items()}
    monkeypatch.setattr(registry, "ENGINES", MappingProxyType(single))
    data = {"models": {"m": {"profiles": {"big": {**BASE, "engine": "vllm", "nodes": 2}}}}}
    with pytest.raises(ConfigError) as info:
        parse_catalog(data, source="c")
    assert str(info.value) == (
        "c: models.m.profiles.big.nodes: engine vllm has no multi-node form; use nodes: 1 or "
        "one of llamacpp, sglang, sim"
    )
    data["models"]["m"]["profiles"]["big"]["nodes"] = 1
    assert parse_catalog(data, source="c").models["m"].profiles["big"].nodes == 1


def test_the_example_error_message() -> None:
    data = {
        "models": {
            "llama-3-8b": {
                "profiles": {"big": {"engine": "sglang", "source": "/srv/m", "gpus": 0, "nodes": 2}}
            }
        }
    }
    with pytest.raises(ConfigError) as info:
        parse_catalog(data, source="catalog.yaml")
    assert str(info.value) == (
        "catalog.yaml: models.llama-3-8b.profiles.big.nodes: 2 nodes need gpus >= 1 "
        "(multi-node replicas shard GPUs across nodes)"
    )


INVALID_CATALOGS: list[tuple[object, str, str]] = [
    (None, "", "catalog.yaml: is empty; a catalog is 'models:'"),
    ([], "", "must be a mapping, got list"),
    ({}, "models", "is missing: give 'models:'"),
    ({"model": {}}, "model", "unknown key 'model'; did you mean 'models'?"),
    ({"models": ["llama"]}, "models", "must be a mapping of name to settings, got list"),
    ({"models": {"-llama": {}}}, "models.-llama", "is not a valid model name"),
    ({"models": {"llama": None}}, "models.llama", "must be a mapping, got null"),
    ({"models": {"llama": {}}}, "models.llama.profiles", "model llama needs at least one"),
    ({"models": {"llama": {"profiles": {}}}}, "models.llama.profiles", "is empty: model llama"),
    (
        {"models": {"llama": {"profile": {"default": BASE}}}},
        "models.llama.profile",
        "did you mean 'profiles'?",
    ),
    (
        {"models": {"llama": {"profiles": {"de fault": BASE}}}},
        "models.llama.profiles.de fault",
        "is not a valid profile name",
    ),
    (
        {"models": {"llama": {"profiles": {"p": "vllm"}}}},
        "models.llama.profiles.p",
        "must be a mapping, got string",
    ),
    (
        {"models": {"llama": {"profiles": {"p": BASE}, "sidecars": [{"name": "t"}]}}},
        "models.llama.sidecars[0].command",
        "is missing",
    ),
    (
        {"models": {"llama": {"profiles": {1: BASE}}}},
        "models.llama.profiles",
        "names must be strings, got int 1",
    ),
]


@pytest.mark.parametrize(("data", "key", "message"), INVALID_CATALOGS)
def test_invalid_catalogs(data: object, key: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_catalog(data, source="catalog.yaml")
    text = str(info.value)
    assert text.startswith(f"catalog.yaml: {key}: " if key else "catalog.yaml: "), text
    assert message in text, text


def test_load_catalog_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file; give the path of the catalog file"):
        load_catalog(tmp_path / "nope.yaml")
    path = write(tmp_path, "models:\n  a: {profiles: {p: {engine: sim}}}\n  a: {}\n")
    with pytest.raises(ConfigError, match=r"line 3, column 3: invalid YAML.*found key 'a' twice"):
        load_catalog(path)
    path = write(tmp_path, "models:\n  a:\n    profiles:\n      p: {engine: sim, gpus: x}\n")
    with pytest.raises(ConfigError) as info:
        load_catalog(path)
    assert str(info.value).startswith(f"{path}: models.a.profiles.p.gpus: must be a whole")


def test_parse_profile_reads_a_stored_profile_back() -> None:
    catalog = parse_catalog(
        {"models": {"m": {"profiles": {"big": {**BASE, "nodes": 2, "gpu_memory": "80GiB"}}}}},
        source="c",
    )
    stored = json.loads(json.dumps(catalog.to_dict()["models"]["m"]["profiles"]["big"]))
    profile = parse_profile(stored, model="m", profile="big", source="state database")
    assert profile == catalog.models["m"].profiles["big"]
    assert (profile.nodes, profile.gpu_memory_mib) == (2, 81920)
    with pytest.raises(ConfigError) as info:
        parse_profile({"engine": "vllm"}, model="m", profile="big", source="state database")
    assert str(info.value).startswith("state database: models.m.profiles.big.source: is missing")


def test_the_catalog_imports_neither_the_server_nor_sqlite3() -> None:
    """``llmgw ctl`` checks catalog.yaml with this module: it is a contract, not the server's."""
    probe = (
        "import sys, llmgw.contracts.catalog\n"
        "print(sorted(m for m in sys.modules if m == 'sqlite3' or m.startswith('llmgw.server')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
