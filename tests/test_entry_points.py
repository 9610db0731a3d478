"""The user's imports and commands: the names at the top of the package, and every console
command of pyproject.toml."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# [project.scripts] read by hand: tomllib is not in Python 3.10's standard library.
_TABLE = (REPO / "pyproject.toml").read_text().split("[project.scripts]\n", 1)[1].split("\n[", 1)[0]
SCRIPTS = dict(re.findall(r'^([\w-]+) = "([\w.:]+)"$', _TABLE, re.M))


@pytest.mark.job
def test_the_documented_names_import_from_the_top_without_loading_torch_or_aiohttp() -> None:
    code = ("import sys, debug_server\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'aiohttp'))\n"
            "from debug_server import start_debug_server, new_comm, FlightRecorderHook\n"
            "from debug_server.recording.comms import new_comm as deep_comm\n"
            "from debug_server.recording.hooks import FlightRecorderHook as deep_hook\n"
            "from debug_server.rank.server import start_debug_server as deep_start\n"
            "assert (new_comm, FlightRecorderHook, start_debug_server) == "
            "(deep_comm, deep_hook, deep_start)\n"
            "print(heavy, sorted(debug_server.__all__))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out.startswith("[] "), out
    assert {"start_debug_server", "new_comm", "FlightRecorderHook"} <= set(eval(out[3:]))


def test_an_unknown_top_level_name_is_an_attribute_error() -> None:
    import debug_server

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        debug_server.nope  # noqa: B018


def test_the_documented_commands_are_declared() -> None:
    assert {"debug-server-view", "debug-server-fr-trace", "debug-server-nccl-log",
            "debug-server-preflight", "debug-server-frontend"} <= set(SCRIPTS)


@pytest.mark.job
@pytest.mark.parametrize("command", sorted(SCRIPTS))
def test_each_console_command_exists_and_prints_its_help(command: str) -> None:
    module, _, func = SCRIPTS[command].partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    # What the installed wrapper runs: sys.exit(<function>()) with argv[1:] = ["--help"].
    code = f"import sys; from {module} import {func}; sys.argv = [{command!r}, '--help']; sys.exit({func}())"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout and "--help" in res.stdout, res.stdout[:500]
