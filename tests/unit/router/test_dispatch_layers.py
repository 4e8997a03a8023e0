"""The router's request path points one way (decision 132): only the app imports the dispatcher, and
the dispatcher's helpers import nothing above them (no way back into the loop)."""

from __future__ import annotations

import ast
from pathlib import Path

ROUTER = Path(__file__).resolve().parents[3] / "src" / "kvwire" / "router"

# module -> the request-path modules it must not import (those that call it, directly or not). The
# request names the relay's ClientStream as a type only (``ClientRequest.resume_stream``).
_ABOVE = {
    "relay": {"dispatcher", "app"},
    "selection": {"dispatcher", "relay", "app"},
    "request": {"dispatcher", "selection", "app"},
    "registry": {"dispatcher", "relay", "selection", "request", "app"},
}


def _router_imports(path: Path) -> set[str]:
    """Router modules ``path`` imports anywhere (module level, functions, TYPE_CHECKING)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvwire.router."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("kvwire.router.")}
    return found


def test_only_the_app_imports_the_dispatcher() -> None:
    importers = {p.stem for p in ROUTER.glob("*.py") if "dispatcher" in _router_imports(p)}
    assert importers == {"app"}


def test_the_dispatchers_helpers_import_nothing_above_them() -> None:
    wrong = {name: _router_imports(ROUTER / f"{name}.py") & above for name, above in _ABOVE.items()}
    assert {name: found for name, found in wrong.items() if found} == {}


def test_the_check_sees_imports() -> None:
    assert {"relay", "request", "selection"} <= _router_imports(ROUTER / "dispatcher.py")
