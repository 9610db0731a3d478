"""Skips are for what is outside the project: an import of our own code that fails is a failure.

Each test runs pytest on a one-file suite in a temp dir with ``tests/skip_policy.py`` loaded,
as conftest loads it for this suite.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.job

TESTS = Path(__file__).resolve().parent


def _pytest(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_one.py").write_text(body)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider", "-p", "skip_policy",
         "test_one.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        # Only the policy: the suite's other plugins (aiohttp, hypothesis...) would just add
        # seconds of imports to every run.
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin",
             "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


def test_importorskip_of_our_own_module_in_a_test_fails_naming_the_module(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "import pytest\n\ndef test_x():\n"
                             "    pytest.importorskip('debug_server.no_such_part')\n")
    assert proc.returncode == 1, proc.stdout
    assert "1 failed" in proc.stdout and "skipped" not in proc.stdout
    assert "our own code failed to import" in proc.stdout
    assert "debug_server.no_such_part" in proc.stdout


def test_module_level_importorskip_of_our_own_module_fails(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "import pytest\nmod = pytest.importorskip('debug_server.no_such_part')\n\n"
                             "def test_x():\n    pass\n")
    assert proc.returncode != 0, proc.stdout
    assert "our own code failed to import" in proc.stdout and "skipped" not in proc.stdout


def test_importorskip_of_a_module_outside_the_project_still_skips_with_its_reason(
        tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "import pytest\n\ndef test_x():\n"
                             "    pytest.importorskip('torch._no_such_private_module')\n")
    assert proc.returncode == 0, proc.stdout
    assert "1 skipped" in proc.stdout
    assert "could not import 'torch._no_such_private_module'" in proc.stdout
