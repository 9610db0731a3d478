"""The fast tier's rule (``tests/tiers.py``): a test that starts a process is marked ``job``.

The guard that fails an unmarked test starting a process is run on a one-file suite in a temp dir
(as ``test_skip_policy`` does); the static check reads every test module of this suite.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

STARTERS = {
    "subprocess": None, "multiprocessing": None, "torch.multiprocessing": None, "rankprocs": None,
    "mpjob": {"run_job", "start_ranks", "start_demo", "run_demo", "ReferenceDemo"},
    "fakefleet": {"start_frontend", "frontend_over", "start_fleet", "start_helpers"},
}
"""Modules whose import (any name, or the names listed) means the module starts processes."""


def _starts_processes(tree: ast.Module) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name in STARTERS]
        elif isinstance(node, ast.ImportFrom) and node.module in STARTERS:
            names = STARTERS[node.module]
            found += [f"{node.module}.{a.name}" for a in node.names
                      if names is None or a.name in names]
    return found


def test_every_module_that_can_start_a_process_marks_its_jobs() -> None:
    unmarked = []
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        starters = _starts_processes(ast.parse(text))
        if starters and "pytest.mark.job" not in text:
            unmarked.append(f"{path.name} ({', '.join(starters)})")
    assert not unmarked, f"modules that import what starts processes, with no job mark: {unmarked}"


CONFTEST = """
from tiers import ProcessGuard, mark_jobs

def pytest_configure(config):
    config.addinivalue_line("markers", "job: starts processes")
    config.pluginmanager.register(ProcessGuard(), "process_guard")

def pytest_collection_modifyitems(items):
    mark_jobs(items)
"""

SUITE = """
import subprocess, sys
import pytest

def test_unmarked_starts_one():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

@pytest.mark.job
def test_marked_starts_one():
    subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_in_process():
    assert sum([1, 2]) == 3
"""


def _pytest(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_one.py").write_text(SUITE)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_one.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin",
             "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


@pytest.mark.job
def test_an_unmarked_test_that_starts_a_process_fails_naming_it(tmp_path: Path) -> None:
    proc = _pytest(tmp_path)
    assert proc.returncode == 1, proc.stdout
    assert "1 failed, 2 passed" in proc.stdout, proc.stdout
    assert "FAILED test_one.py::test_unmarked_starts_one" in proc.stdout
    assert "not in the job tier" in proc.stdout and " -c pass" in proc.stdout


@pytest.mark.job
def test_the_fast_tier_leaves_out_only_the_marked_tests(tmp_path: Path) -> None:
    proc = _pytest(tmp_path, "-m", "not job", "--collect-only")
    assert "2/3 tests collected (1 deselected)" in proc.stdout, proc.stdout
    assert "test_marked_starts_one" not in proc.stdout


@pytest.mark.job
def test_the_fast_tier_of_this_suite_holds_over_300_tests() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", "not job", str(TESTS)],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=120)
    last = proc.stdout.strip().splitlines()[-1]
    selected = int(last.split("/", 1)[0])
    assert selected >= 300, last
