"""The package's layout follows docs/architecture.md: which part may import which, and no cycles.

The parts, lowest first: the common modules at the package top (config, auth, listen, dumpio, errors, stacks),
then ``recording`` and ``analysis`` (neither knows the other), then ``rank``, then ``frontend``,
then ``tools``. A module may import its own part and any part below it, never one above, and
the recording side (the training hot path) is imported by ``rank`` only.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "debug_server"
PARTS = ("protocol", "readers", "recording", "rank", "fanout", "frontend", "agent", "analysis", "tools")
COMMON = {"config", "auth", "listen", "dumpio", "errors", "stacks"}
# The two-line modules that keep documented imports and commands at their old names.
SHIMS = {"comms", "hooks", "fr_trace", "nccl_log", "preflight", "view"}
# What each part may import (besides itself and the common modules).
ALLOWED = {
    "common": set(),
    "protocol": set(),
    "readers": {"protocol"},
    "recording": set(),
    "analysis": {"protocol"},
    "rank": {"recording", "readers", "analysis", "protocol"},
    "fanout": {"readers", "analysis", "protocol"},
    "frontend": {"fanout", "readers", "rank", "analysis", "protocol"},
    "agent": {"fanout", "readers", "rank", "analysis", "protocol"},
    "tools": {"frontend", "fanout", "readers", "analysis", "protocol"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _part(module: str) -> str | None:
    bits = module.split(".")
    if len(bits) < 2:
        return "package"
    if bits[1] in PARTS:
        return bits[1]
    if bits[1] in COMMON:
        return "common"
    if bits[1] in SHIMS:
        return "shim"
    return None


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node that can run: module level and every function body (lazy imports inside a
    function are imports too), but not ``if TYPE_CHECKING:`` blocks, which never run."""
    out: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        out.append(node)
        todo.extend(child for child in ast.iter_child_nodes(node) if not _is_type_checking(child))
    return out


def _imports(path: Path, *, runtime_only: bool) -> set[str]:
    """Modules of ours that ``path`` imports anywhere, functions included (``from pkg import
    mod`` resolves to the module); ``runtime_only`` leaves out ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    nodes = _runtime_nodes(tree) if runtime_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("debug_server"):
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.add(sub if _file_of(sub) is not None else node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("debug_server"))
    return out


def _file_of(module: str) -> Path | None:
    rel = Path(*module.split(".")[1:]) if "." in module else Path()
    for cand in (PKG / rel.with_suffix(".py"), PKG / rel / "__init__.py"):
        if cand.is_file():
            return cand
    return None


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def test_every_module_sits_in_a_known_part() -> None:
    unknown = sorted(m for m in _modules() if _part(m) is None)
    assert unknown == [], f"modules outside the parts of docs/architecture.md: {unknown}"


def test_no_part_imports_a_part_above_it() -> None:
    bad = []
    for mod, path in _modules().items():
        src = _part(mod)
        if src not in ALLOWED:
            continue
        for dep in _imports(path, runtime_only=False):
            dst = _part(dep)
            if dst in (src, "common") or dst in ALLOWED[src]:
                continue
            bad.append(f"{mod} -> {dep}")
    assert bad == [], "imports against docs/architecture.md's arrows:\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """Every back edge of a depth-first walk of ``graph``, as the cycle it closes."""
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_imports_form_no_cycle_function_level_imports_included() -> None:
    # A function-level import is still an edge: it only moves the cycle from import time to
    # call time. Only ``if TYPE_CHECKING:`` imports (annotations, never run) are left out.
    mods = _modules()
    graph = {m: {d for d in _imports(p, runtime_only=True) if d in mods and d != m}
             for m, p in mods.items()}
    cycles = _cycles(graph)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def _room_graph(room: str) -> dict[str, set[str]]:
    mods = {m: p for m, p in _modules().items() if m.startswith(f"debug_server.{room}.")}
    return {m: {d for d in _imports(p, runtime_only=False) if d in mods and d != m}
            for m, p in mods.items()}


@pytest.mark.parametrize("room", ["fanout", "recording"])
def test_no_cycle_inside_a_room_annotations_included(room: str) -> None:
    # Issue 40: inside ``fanout/`` the asker knows no caller, the rounds and the route know the
    # asker, the collector owns them all; inside ``recording/`` the helpers name what they need
    # of a communicator (``commstate.CommState``), never ``comms.Comm`` above them.
    cycles = _cycles(_room_graph(room))
    assert cycles == [], f"import cycles in {room}/, annotations included:\n" + "\n".join(cycles)


def test_the_collector_protocols_know_no_implementation() -> None:
    graph = _room_graph("fanout")
    assert graph["debug_server.fanout.collector"] <= {
        "debug_server.fanout.reply", "debug_server.fanout.transport"}, \
        graph["debug_server.fanout.collector"]


RENDERERS = ("debug_server.frontend.render", "debug_server.frontend.lanes",
             "debug_server.analysis.report", "debug_server.analysis.tables")


def test_renderers_read_the_analysis_result_never_the_fetch_or_the_text_report() -> None:
    # One reply's trip (docs/architecture.md): renderers get the result, its table models
    # (analysis.tables) and FetchFacts, never FrData (the stacks pages' records, RankResult,
    # are what those pages show); the HTML never asks report.py for tables.
    mods = _modules()
    bad = [f"{m} -> {d}" for m in RENDERERS for d in sorted(_imports(mods[m], runtime_only=False))
           if d == "debug_server.fanout.reply"
           or (m != "debug_server.analysis.report" and d == "debug_server.analysis.report")]
    assert bad == [], "renderers reading the fetch or the text report:\n" + "\n".join(bad)


@pytest.mark.job
def test_the_frontend_process_never_loads_the_recording_side() -> None:
    code = ("import sys\nimport debug_server.frontend.app\n"
            "print(sorted(m for m in sys.modules if m.startswith('debug_server.recording')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", f"the frontend imported the recording side: {out}"


def test_every_package_ships_in_the_wheel() -> None:
    # pyproject.toml names its packages one by one: a new room left out of it imports from a
    # source tree (and in the editable install the tests use) but is missing from the wheel.
    import tomllib

    listed = set(tomllib.loads((PKG.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {_module_name(p.parent / "__init__.py") for p in PKG.rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml: {sorted(found - listed)}"


def test_no_module_over_600_lines_no_function_over_100() -> None:
    big, long_fns = [], []
    for mod, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > 600:
            big.append(f"{mod}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > 100:
                    long_fns.append(f"{mod}.{node.name}: {n} lines")
    assert big == [] and long_fns == [], "\n".join(big + long_fns)
