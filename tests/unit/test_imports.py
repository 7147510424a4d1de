"""The import graph of ``llmgw/``: which package may import which, and no cycles.

Every ``import`` and ``from … import`` in every module counts, wherever it stands: at the top,
inside a function, under ``if TYPE_CHECKING:`` (a type-only import still ties the two modules
together for a reader and for mypy). The graph is read with :mod:`ast`, nothing is imported.

The rules, one a row: a module under IMPORTER may not import one under IMPORTED ("x" is the
package ``llmgw.x`` and everything below it); a package under ONLY loads nothing else.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

#   IMPORTER          IMPORTED        WHY
FORBIDDEN: tuple[tuple[str, str, str], ...] = (
    ("server", "agent", "the control plane and the node agent share only contracts/"),
    ("agent", "server", "the node agent and the control plane share only contracts/"),
    ("engines", "agent", "engines run under the agent; what both need lives in contracts/"),
    ("engines", "sim", "the sim is an engine: it imports engines/ (KV events), not the reverse"),
    ("cli.ctl", "server", "ctl is a client of the server's API, not of its code (nor sqlite3)"),
    ("contracts", "agent", "contracts belong to neither side"),
    ("contracts", "server", "contracts belong to neither side"),
    ("contracts", "cli", "contracts belong to neither side"),
    ("server.store", "server.ha", "HA stands on the store; what both need lives in the store"),
    ("server.ha", "server.app", "HA runs the roles' parts it is given, never the wiring"),
)

# The control plane's wings, lowest first: a module of one may import its own wing and those
# below, never one above. What is in none (app, leader, process, admin/, console/: the wiring
# and the operators' surfaces) stands on them all.
#   WING              WHAT IT HOLDS
WINGS: tuple[tuple[str, str], ...] = (
    ("server.store", "the state store, the states its rows take, join tokens"),
    ("server.accounts", "operators' accounts, passwords, logins and their lockout"),
    ("server.common", "server.yaml, TLS, the HTTP API's errors, /metrics"),
    ("server.gateway", "the request path: routing, queues, limits, usage, tokenizers"),
    ("server.joining", "enrolment, the agent bundles, cloud-init"),
    ("server.fleet", "nodes' streams and reports, the scheduler, installs, updates, the CA"),
    ("server.ha", "who leads, the standby's forwarding, the kept socket, the instances"),
)

# A package that loads nothing but itself and these, through its own imports and those of
# every module they reach: the root update helper, which runs as root and is audited alone
# (nothing of the agent, the control plane or the CLI). "stdlib" is Python's standard
# library. pki: the trust check (a CA's fingerprint, is it a CA); netaddr: the node id an
# order names (through contracts); cryptography: signatures and certificates.
#   PACKAGE      OF LLMGW                                                    OUTSIDE LLMGW
ONLY: Mapping[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "updater": (
        ("errors", "contracts", "fsutil", "versions", "pki", "netaddr"),
        ("stdlib", "cryptography"),
    ),
}

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "llmgw"


@dataclass(frozen=True)
class Edge:
    """``importer`` imports ``imported`` (a module of the tree, or an outside top-level name)
    at ``line`` of ``path``."""

    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.importer} -> {self.imported} ({self.path}:{self.line})"


def modules_of(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file for every module of ``package`` under ``root`` (a package is its
    ``__init__.py``)."""
    found: dict[str, Path] = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _targets(node: ast.Import | ast.ImportFrom, name: str, is_package: bool) -> Iterator[str]:
    """The dotted names ``node`` (in module ``name``) imports, relative ones made absolute; for
    ``from X import Y`` both ``X.Y`` and ``X`` (the caller keeps the one that is a module)."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:
        here = name.split(".") if is_package else name.split(".")[:-1]
        up = here[: len(here) - (node.level - 1)] if node.level > 1 else here
        base = ".".join([*up, base] if base else up)
    for alias in node.names:
        yield f"{base}.{alias.name}" if alias.name != "*" else base
    yield base


def _resolve(target: str, modules: Mapping[str, Path]) -> str:
    """The module of the tree ``target`` names: itself, else its nearest enclosing module (``from
    pkg.mod import func`` imports ``pkg.mod``); for an outside name, its top-level package."""
    parts = target.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return target.split(".")[0]


def import_edges(root: Path, package: str) -> list[Edge]:
    """Every import of every module of ``package``, one :class:`Edge` per imported module."""
    modules = modules_of(root, package)
    edges: list[Edge] = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            seen: set[str] = set()
            targets = list(_targets(node, name, is_package))
            if isinstance(node, ast.ImportFrom):
                # `from X import Y`: Y when it is a module, else X (once, whatever Y names).
                base = targets.pop()
                targets = [t for t in targets if t in modules] or [base]
            for target in targets:
                imported = _resolve(target, modules)
                if imported != name and imported not in seen:
                    seen.add(imported)
                    edges.append(Edge(name, imported, path.relative_to(root), node.lineno))
    return edges


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def rule_violations(edges: list[Edge], package: str) -> list[str]:
    """The edges FORBIDDEN refuses, each with why."""
    found: list[str] = []
    for edge in edges:
        for importer, imported, why in FORBIDDEN:
            if _under(edge.importer, f"{package}.{importer}") and _under(
                edge.imported, f"{package}.{imported}"
            ):
                found.append(f"{edge}: {importer} may not import {imported}: {why}")
    return found


def wing_of(module: str, package: str) -> int | None:
    """The index in WINGS of ``module``'s wing; None for a module in no wing."""
    for index, (wing, _what) in enumerate(WINGS):
        if _under(module, f"{package}.{wing}"):
            return index
    return None


def wing_violations(edges: list[Edge], package: str) -> list[str]:
    """The edges that run up between the server's wings (a module in no wing of the server
    counts as above them all)."""
    found: list[str] = []
    for edge in edges:
        if not _under(edge.importer, f"{package}.server"):
            continue
        low, high = wing_of(edge.importer, package), wing_of(edge.imported, package)
        if high is None or (low is not None and high <= low):
            continue
        if low is None:
            continue  # the wiring and the surfaces stand on every wing
        found.append(
            f"{edge}: the wing {WINGS[low][0]} may not import {WINGS[high][0]}, a wing above it "
            "(move what both need down, or pass it in)"
        )
    return found


def loads(edges: list[Edge], start: str) -> dict[str, str]:
    """Every module of the tree that loading the package ``start`` loads (itself included),
    each with the module that imports it first."""
    by_importer: dict[str, list[Edge]] = {}
    for edge in edges:
        by_importer.setdefault(edge.importer, []).append(edge)
    seen = {m: "(itself)" for m in by_importer if _under(m, start)}
    todo = sorted(seen)
    while todo:
        for edge in by_importer.get(todo.pop(), []):
            if edge.imported.count(".") and edge.imported not in seen:
                seen[edge.imported] = edge.importer
                todo.append(edge.imported)
    return seen


def only_violations(edges: list[Edge], package: str) -> list[str]:
    """The imports, by the ONLY packages or by any module they load, of what ONLY does not
    allow them; each with how the importing module came to be loaded."""
    found: list[str] = []
    for only, (inside, outside) in ONLY.items():
        start = f"{package}.{only}"
        loaded = loads(edges, start)
        allowed = "only " + ", ".join((*inside, *outside))
        for edge in edges:
            if edge.importer not in loaded:
                continue
            if _under(edge.imported, package):
                ok = edge.imported == package or any(
                    _under(edge.imported, f"{package}.{name}") for name in (only, *inside)
                )
            else:
                ok = edge.imported in outside or (
                    "stdlib" in outside and edge.imported in sys.stdlib_module_names
                )
            if not ok:
                via = "" if _under(edge.importer, start) else f", loaded by {loaded[edge.importer]}"
                found.append(f"{edge}{via}: {only} may load {allowed}")
    return found


def cycles(edges: list[Edge]) -> list[tuple[list[str], list[str]]]:
    """For each strongly connected part of the graph of the tree's modules (Tarjan's algorithm)
    that has a cycle: one cycle (a path ``a -> … -> a``) and all the part's modules."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set())
        if edge.imported.count("."):  # a module of the tree (outside names are top-level)
            graph[edge.importer].add(edge.imported)
            graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[set[str]] = []

    def connect(node: str) -> None:
        # Recursive Tarjan; llmgw's graph is a few hundred modules deep at most.
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            part: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.add(member)
                if member == node:
                    break
            parts.append(part)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    found: list[tuple[list[str], list[str]]] = []
    for part in parts:
        start = min(part)
        if len(part) == 1 and start not in graph[start]:
            continue
        found.append((_path_back(graph, part, start), sorted(part)))
    return sorted(found)


def _path_back(graph: Mapping[str, set[str]], part: set[str], start: str) -> list[str]:
    """The shortest path from ``start`` back to itself within ``part`` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following: list[str] = []
        for node in frontier:
            for succ in sorted(graph[node] & part):
                if succ == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if succ not in came_from:
                    came_from[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected part but has no way back")


def problems(root: Path, package: str) -> list[str]:
    """What is wrong with ``package``'s import graph, one line each (none: all is well)."""
    edges = import_edges(root, package)
    found = (
        rule_violations(edges, package)
        + wing_violations(edges, package)
        + only_violations(edges, package)
    )
    for cycle, part in cycles(edges):
        line = "import cycle: " + " -> ".join(cycle)
        if len(part) > len(cycle) - 1:
            line += f" (one of the cycles among these {len(part)}: {', '.join(part)})"
        found.append(line)
    return found


# ------------------------------------------------------------------------------ the tree


def test_llmgw_import_graph_keeps_the_rules_and_has_no_cycle() -> None:
    found = problems(ROOT, PACKAGE)
    assert not found, "import graph of llmgw/:\n" + "\n".join(found)


def test_the_root_helper_loads_nothing_of_the_agent_server_or_cli() -> None:
    found = only_violations(import_edges(ROOT, PACKAGE), PACKAGE)
    assert not found, "what the root helper loads:\n" + "\n".join(found)


def test_the_tree_is_read() -> None:
    # Against a checker that reads nothing and so finds nothing wrong.
    edges = import_edges(ROOT, PACKAGE)
    assert any(edge.importer == "llmgw.cli" and edge.imported == "llmgw" for edge in edges), (
        "llmgw/cli/__init__.py's `from llmgw import __version__` was not seen"
    )
    assert len({edge.importer for edge in edges}) > 50


# ------------------------------------------------------------------------ the checker


def write_tree(root: Path, files: Mapping[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


PACKAGES = {
    "pkg/__init__.py": "",
    "pkg/errors.py": "import os\n",
    "pkg/agent/__init__.py": "",
    "pkg/server/__init__.py": "",
    "pkg/contracts/__init__.py": "",
    "pkg/contracts/order.py": "import json\nfrom pkg.errors import Error\n",
    "pkg/cli/__init__.py": "",
    "pkg/updater/__init__.py": "",
}


def test_a_clean_tree_has_no_problem(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/agent/a.py": "from pkg.contracts import order\nfrom . import b\n",
            "pkg/agent/b.py": "from ..contracts.order import dump\n",
            "pkg/server/s.py": "import pkg.contracts.order\n",
            "pkg/updater/apply.py": (
                "import hashlib\nfrom pkg.errors import Error\nfrom pkg.contracts import order\n"
                "from . import helper\n"
            ),
            "pkg/updater/helper.py": "import os.path\n",
        },
    )
    assert problems(tmp_path, "pkg") == []


def test_a_forbidden_edge_is_caught_wherever_the_import_stands(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/agent/a.py": "",
            "pkg/server/s.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.agent.a import Agent\n"
            ),
            "pkg/server/t.py": "def f():\n    from ..agent import a\n",
            "pkg/agent/b.py": "import pkg.server.s as s\n",
            "pkg/contracts/c.py": "from pkg.cli import main\n",
        },
    )
    why = {edge[:2]: edge[2] for edge in FORBIDDEN}
    assert sorted(problems(tmp_path, "pkg")) == [
        "pkg.agent.b -> pkg.server.s (pkg/agent/b.py:1): agent may not import server: "
        + why["agent", "server"],
        "pkg.contracts.c -> pkg.cli (pkg/contracts/c.py:1): contracts may not import cli: "
        + why["contracts", "cli"],
        "pkg.server.s -> pkg.agent.a (pkg/server/s.py:3): server may not import agent: "
        + why["server", "agent"],
        "pkg.server.t -> pkg.agent.a (pkg/server/t.py:2): server may not import agent: "
        + why["server", "agent"],
    ]


def test_the_updater_loads_only_what_it_may_through_any_module(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/agent/spool.py": "import yaml\n",
            "pkg/fsutil.py": "import os\nfrom pkg.agent import spool\n",
            "pkg/updater/apply.py": (
                "import json\nimport yaml\nimport cryptography.x509\nfrom pkg import fsutil\n"
                "from pkg.errors import E\nfrom . import trust\n"
            ),
            "pkg/updater/trust.py": "def f():\n    from pkg.server import app\n",
        },
    )
    inside, outside = ONLY["updater"]
    allowed = "updater may load only " + ", ".join((*inside, *outside))
    assert sorted(problems(tmp_path, "pkg")) == [
        # Loaded through fsutil, which the helper may import: the agent's module, and what
        # that imports in turn.
        f"pkg.agent.spool -> yaml (pkg/agent/spool.py:1), loaded by pkg.fsutil: {allowed}",
        f"pkg.fsutil -> pkg.agent.spool (pkg/fsutil.py:2), loaded by pkg.updater.apply: {allowed}",
        f"pkg.updater.apply -> yaml (pkg/updater/apply.py:2): {allowed}",
        f"pkg.updater.trust -> pkg.server (pkg/updater/trust.py:2): {allowed}",
    ]


def test_a_cycle_is_caught_with_its_path(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/server/app.py": "from pkg.server.gateway import Gateway\nfrom . import admin\n",
            "pkg/server/gateway.py": "from . import nodes\n",
            "pkg/server/nodes.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from pkg.server.app import ControlPlane\n"
            ),
            "pkg/server/admin.py": "from pkg.server import app\n",
            # A second, separate one: a package and the module it re-exports from.
            "pkg/agent/__init__.py": "from pkg.agent.x import X\n",
            "pkg/agent/x.py": "def f():\n    from pkg.agent import X\n",
            # A third: three modules in a ring, relative imports.
            "pkg/cli/a.py": "from .b import B\n",
            "pkg/cli/b.py": "from . import c\n",
            "pkg/cli/c.py": "from .a import A\n",
        },
    )
    assert problems(tmp_path, "pkg") == [
        "import cycle: pkg.agent -> pkg.agent.x -> pkg.agent",
        "import cycle: pkg.cli.a -> pkg.cli.b -> pkg.cli.c -> pkg.cli.a",
        "import cycle: pkg.server.admin -> pkg.server.app -> pkg.server.admin (one of the cycles "
        "among these 4: pkg.server.admin, pkg.server.app, pkg.server.gateway, pkg.server.nodes)",
    ]


def test_an_import_up_between_the_servers_wings_is_caught(tmp_path: Path) -> None:
    # The store reading the fleet's states (as the first sketch of the wings had it): refused.
    # Down (the fleet reading the store) and from the wiring (app) into any wing: allowed.
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/server/app.py": "from pkg.server.fleet.nodes import N\n",
            "pkg/server/store/__init__.py": "",
            "pkg/server/store/rows.py": "from pkg.server.fleet.states import S\n",
            "pkg/server/fleet/__init__.py": "",
            "pkg/server/fleet/states.py": "S = 1\n",
            "pkg/server/fleet/nodes.py": "N = 1\n",
            "pkg/server/ha/__init__.py": "",
            "pkg/server/ha/roles.py": "from pkg.server.store import rows\n",
        },
    )
    assert problems(tmp_path, "pkg") == [
        "pkg.server.store.rows -> pkg.server.fleet.states (pkg/server/store/rows.py:1): the wing "
        "server.store may not import server.fleet, a wing above it (move what both need down, "
        "or pass it in)"
    ]


def test_the_engines_never_import_the_sim(tmp_path: Path) -> None:
    # The sim imports engines/ (the KV events format, its own parameters); engines/sim.py
    # describes the sim without loading it. Planted the other way, the rule fires.
    write_tree(
        tmp_path,
        {
            **PACKAGES,
            "pkg/engines/__init__.py": "",
            "pkg/engines/sim.py": "from pkg.sim.config import LIMIT\n",
            "pkg/sim/__init__.py": "",
            "pkg/sim/config.py": "LIMIT = 1\n",
        },
    )
    why = {edge[:2]: edge[2] for edge in FORBIDDEN}
    assert problems(tmp_path, "pkg") == [
        "pkg.engines.sim -> pkg.sim.config (pkg/engines/sim.py:1): engines may not import sim: "
        + why["engines", "sim"]
    ]


# --- the tests' own imports: no test module imports from another test module. What several
# test modules share lives in a helper module (``*_rig.py``, ``fakes.py``, ``clock.py``, …) or,
# for a fixture, in a ``conftest.py``: a test module is read alone, and moving or deleting one
# breaks nothing else.


def _test_module(name: str) -> bool:
    return name.rsplit(".", 1)[-1].startswith("test_")


def cross_imports(root: Path) -> list[Edge]:
    """Imports of a test module by another module of ``tests/`` (conftest.py included)."""
    return [e for e in import_edges(root, "tests") if _test_module(e.imported)]


def test_no_test_module_imports_another() -> None:
    found = cross_imports(ROOT)
    assert found == [], "move what is shared into a helper module:\n" + "\n".join(map(str, found))


def test_a_planted_import_of_a_test_module_is_caught(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "tests/__init__.py": "",
            "tests/unit/__init__.py": "",
            "tests/unit/rig.py": "def helper() -> None: ...\n",
            "tests/unit/test_a.py": "from tests.unit.rig import helper\nTABLE = 1\n",
            "tests/unit/test_b.py": "def f() -> None:\n    from .test_a import TABLE\n",
        },
    )
    assert [(e.importer, e.imported, e.line) for e in cross_imports(tmp_path)] == [
        ("tests.unit.test_b", "tests.unit.test_a", 2)
    ]
