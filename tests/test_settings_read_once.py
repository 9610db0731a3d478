"""The settings are built once at each entry point and passed down (docs/architecture.md,
"Settings"): no module below the entry points calls ``Settings.from_env`` or ``take_secrets``."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "debug_server"

# Where the environment is read, and why there.
ENTRY_POINTS = {
    "config/settings.py": "the declarations; take_secrets is from_env plus removing the secrets",
    "rank/server.py": "start_debug_server",
    "recording/comms.py": "new_comm, the recording side's own entry point (works without a server)",
    "frontend/app.py": "the frontend process's main (its attach command included)",
    "agent/main.py": "the agent process's main",
    "tools/view.py": "the post-mortem viewer's main",
}


def _settings_reads(tree: ast.AST) -> list[int]:
    """Lines that call ``Settings.from_env(...)`` or ``take_secrets(...)`` (``JobEnv.from_env``,
    torchrun's variables, is not a settings read)."""
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Attribute) and fn.attr == "from_env":
            if isinstance(fn.value, ast.Name) and fn.value.id == "Settings":
                lines.append(node.lineno)
        elif isinstance(fn, ast.Name) and fn.id == "take_secrets":
            lines.append(node.lineno)
    return lines


def test_only_the_entry_points_read_the_settings() -> None:
    found = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = str(path.relative_to(PKG))
        lines = _settings_reads(ast.parse(path.read_text()))
        if lines and rel not in ENTRY_POINTS:
            found[rel] = lines
    assert found == {}, ("Settings read below the entry points (build them at the entry point "
                         f"and pass the values down): {found}")


def test_every_listed_entry_point_still_reads_them() -> None:
    # A stale list would let a module read the environment unnoticed once it takes a listed name.
    stale = [rel for rel in ENTRY_POINTS if not _settings_reads(ast.parse((PKG / rel).read_text()))]
    assert stale == [], f"listed as entry points but read no settings: {stale}"


def test_the_scan_finds_a_settings_read() -> None:
    src = "from debug_server.config import Settings\nx = Settings.from_env().host\n"
    assert _settings_reads(ast.parse(src)) == [2]
    assert _settings_reads(ast.parse("JobEnv.from_env()\n")) == []
