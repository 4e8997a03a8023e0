"""The package's module-level import graph has no circle (lazy imports inside functions excluded).

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so each import also depends on
the packages above the imported module."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(tree: ast.Module) -> list[str]:
    """Names imported at module level (not inside functions or ``if TYPE_CHECKING:``)."""
    found: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for target in _top_level_imports(ast.parse(path.read_text())):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # the module and every package above it
                dep = ".".join(parts[:i])
                if dep in modules and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)) is not None:
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    assert "kvwire.transfer.planes.factory" in graph  # the walk sees the package
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_vllm_config_imports_without_torch_or_zmq() -> None:
    """The plugin's config mapping is pure: vLLM's scheduler process may import it before torch."""
    import subprocess
    import sys

    code = (
        "import sys, kvwire.integrations.vllm_config, kvwire.transfer.config\n"
        "heavy = [m for m in ('torch', 'zmq') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)



PLANES = SRC / "kvwire" / "transfer" / "planes"
PLANES_PKG = "kvwire.transfer.planes"
SHARED = frozenset({"common", "base"})  # what a plane may import of the planes package


def _every_import(tree: ast.Module) -> list[str]:
    """Every module named by an import anywhere in the file (lazy and TYPE_CHECKING ones too)."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [f"{node.module}.{alias.name}" for alias in node.names]
    return found


def _plane_imports(root: Path = PLANES) -> dict[str, set[str]]:
    """For each file inside a subpackage of the planes package ``root`` (a plane, or common/): the
    members of the planes package it imports other than its own subpackage, e.g.
    ``{"shm/send.py": {"common", "base"}}``."""
    out: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if len(parts) < 2:  # base.py, factory.py: the package level, not a plane
            continue
        named = {
            target[len(PLANES_PKG) + 1 :].split(".")[0]
            for target in _every_import(ast.parse(path.read_text()))
            if target.startswith(PLANES_PKG + ".")
        }
        out["/".join(parts)] = named - {parts[0]}
    return out


def _crossings(imports: dict[str, set[str]]) -> dict[str, list[str]]:
    """Files of a plane that import another plane, and files of common/ that import any plane."""
    return {
        path: sorted(named - (SHARED if not path.startswith("common/") else {"base"}))
        for path, named in imports.items()
        if named - (SHARED if not path.startswith("common/") else {"base"})
    }


def test_no_plane_imports_another_plane() -> None:
    """Each plane (tcp, shm, ipc, nccl) imports only ``planes/common`` and ``planes/base.py`` of the
    planes package, lazily or not; ``common`` imports no plane (decision 130)."""
    imports = _plane_imports()
    assert {"tcp", "shm", "ipc", "nccl", "common"} <= {path.split("/")[0] for path in imports}
    assert _crossings(imports) == {}


def test_the_plane_check_sees_a_crossing(tmp_path: Path) -> None:
    for path, text in {
        "base.py": "",
        "tcp/wire.py": "from kvwire.transfer.planes.common import wire\n",
        "shm/send.py": "def f():\n    from kvwire.transfer.planes.tcp.wire import FRAME\n",
        "shm/plane.py": "from kvwire.transfer.planes.shm import send\nimport kvwire.transfer.planes.base\n",
        "common/wire.py": "import kvwire.transfer.planes.ipc.runs\n",
    }.items():
        (tmp_path / path).parent.mkdir(exist_ok=True)
        (tmp_path / path).write_text(text)
    assert _crossings(_plane_imports(tmp_path)) == {"shm/send.py": ["tcp"], "common/wire.py": ["ipc"]}


def test_the_server_and_the_vllm_plugin_import_no_plane() -> None:
    """``kvwire serve`` and the vLLM plugin build a TransferConfig from what kvwire.transfer.config
    exposes and hand it to the agent; which plane runs is the agent's business (decision 134)."""
    offenders = []
    for package in ("server", "integrations"):
        for path in sorted((SRC / "kvwire" / package).rglob("*.py")):
            planes = [m for m in _every_import(ast.parse(path.read_text()))
                      if m.startswith("kvwire.transfer.planes")]
            offenders += [f"{_module_name(path)} imports {m}" for m in planes]
    assert offenders == []
