"""The root helper can be audited alone: everything of llmgw that ``llmgw.updater`` loads,
directly or through what it imports (inside functions too), is the helper itself, the
contracts it checks orders against, llmgw.errors and the foundation modules; nothing of the
agent, the control plane or the CLI runs as root."""

from __future__ import annotations

import ast
from pathlib import Path

import llmgw

PACKAGE = Path(llmgw.__file__).parent
ALLOWED_OUTSIDE = {
    "llmgw",
    "llmgw.errors",
    "llmgw.contracts",
    "llmgw.contracts.update_order",
    "llmgw.pki",
    "llmgw.fsutil",
    "llmgw.netaddr",
    "llmgw.versions",
}


def _source(module: str) -> Path:
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _imports(module: str) -> set[str]:
    """The llmgw modules ``module`` imports anywhere in its source, with their packages."""
    return _imports_in(_source(module).read_text())


def _imports_in(text: str) -> set[str]:
    tree = ast.parse(text)
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        for name in names:
            parts = name.split(".")
            for end in range(1, len(parts) + 1):
                candidate = ".".join(parts[:end])
                if candidate.startswith("llmgw") and _source(candidate).is_file():
                    found.add(candidate)
    return found


def _closure(start: set[str]) -> dict[str, str]:
    """Every llmgw module reachable from ``start``, with one module that imports it."""
    seen = {name: "(start)" for name in start}
    todo = sorted(start)
    while todo:
        module = todo.pop()
        for imported in _imports(module):
            if imported not in seen:
                seen[imported] = module
                todo.append(imported)
    return seen


def test_the_updater_loads_nothing_of_the_agent_server_or_cli() -> None:
    helper = {
        f"llmgw.updater.{path.stem}" if path.stem != "__init__" else "llmgw.updater"
        for path in (PACKAGE / "updater").glob("*.py")
    }
    assert {"llmgw.updater.apply", "llmgw.updater.trust"} <= helper
    reached = _closure(helper)
    outside = {
        name: by
        for name, by in reached.items()
        if not name.startswith("llmgw.updater") and name not in ALLOWED_OUTSIDE
    }
    assert outside == {}, f"the root helper loads {outside} (module: imported by)"


def test_the_walk_sees_every_kind_of_import() -> None:
    # The rule above is only as good as the walk: imports inside functions, of a module
    # from its package, and under TYPE_CHECKING all count.
    text = (
        "from typing import TYPE_CHECKING\n"
        "import llmgw.errors\n"
        "from llmgw.agent import config\n"
        "if TYPE_CHECKING:\n"
        "    from llmgw.server.app import ControlPlane\n"
        "def f():\n"
        "    from llmgw.cli.common import table\n"
    )
    assert _imports_in(text) == {
        "llmgw",
        "llmgw.errors",
        "llmgw.agent",
        "llmgw.agent.config",
        "llmgw.server",
        "llmgw.server.app",
        "llmgw.cli",
        "llmgw.cli.common",
    }
