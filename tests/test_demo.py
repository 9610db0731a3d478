"""The reference scenario end to end: the demo under torchrun, its dumps, and both analyzers.

The demo is the session's one run (conftest's ``demo_done``: ``(dump_dir, output)``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mpjob import DEMO, REPO, demo_hang_line

pytestmark = [pytest.mark.job, pytest.mark.timeout(240)]

Demo = tuple[Path, str]


def _during_hang(dump_dir: Path, pattern: str) -> list[Path]:
    return sorted(dump_dir.glob(pattern))


def test_demo_prints_caught_timeout_and_verdict(demo_done: Demo) -> None:
    _, out = demo_done
    assert "[rank 0] Caught timeout: RuntimeError: all_reduce #4 on communicator 'main_comm'" in out
    assert "Verdict:" in out and "rank 1" in out.split("Verdict:")[1].splitlines()[0].lower()
    assert "python -m torch.distributed.flight_recorder.fr_trace" in out


def test_fr_trace_dump_shows_seq_4_all_reduce_missing_rank_1(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    rows = []
    for f in _during_hang(dump_dir, "torchcomms_fr_trace_*.txt"):
        rows += [ln for ln in f.read_text().splitlines() if re.search(r"\b4\b.*nccl:all_reduce.*\{1\}", ln)]
    assert rows, "no FR trace dump showed seq 4 nccl:all_reduce with missing ranks {1}"


def test_stacks_dump_shows_rank_1_sleeping_and_rank_0_in_all_reduce(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    line = demo_hang_line()
    sleeping, both = 0, 0
    for f in _during_hang(dump_dir, "stacks_*.txt"):
        text = f.read_text()
        sections = re.split(r"^=== Rank (\d+)[^\n]*===$", text, flags=re.M)
        by_rank = {int(sections[i]): sections[i + 1] for i in range(1, len(sections) - 1, 2)}
        if f'{DEMO.name}", line {line} in hang_phase' in by_rank.get(1, ""):
            sleeping += 1
            # Before rank 0's timeout fires it is inside all_reduce; after, in the final wait.
            if re.search(r'recording/(ops|comms)\.py", line \d+ in all_reduce', by_rank.get(0, "")):
                both += 1
    assert sleeping, f"no stacks dump showed rank 1 at {DEMO.name}:{line}"
    assert both, "no stacks dump showed rank 0 inside all_reduce while rank 1 slept"


def test_per_rank_pickles_exist(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    assert (dump_dir / "per_rank" / "rank_0").is_file()
    assert (dump_dir / "per_rank" / "rank_1").is_file()


def test_pytorch_fr_trace_agrees_on_the_pickles(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    per_rank = str(dump_dir / "per_rank")
    base = [sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", per_rank, "-p", "rank_"]
    proc = subprocess.run(base, capture_output=True, text=True, timeout=120)
    text = proc.stdout + proc.stderr
    assert "Not all ranks joining collective, sequence number: 4" in text
    assert "missing ranks: {1}" in text
    proc = subprocess.run(base + ["-j"], capture_output=True, text=True, timeout=120)
    rows = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "all_reduce(" in ln or "broadcast(" in ln]
    assert [ln.count("(") for ln in rows] == [2, 2, 2, 2, 1]  # 5 entries for rank 0, 4 for rank 1


def test_our_cli_exits_2_with_missing_rank_1(demo_done: Demo) -> None:
    dump_dir, _ = demo_done
    proc = subprocess.run(
        [sys.executable, "-m", "debug_server.tools.fr_trace", str(dump_dir / "per_rank"), "-p", "rank_", "--json"],
        capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO)),
    )
    assert proc.returncode == 2, proc.stderr
    result = json.loads(proc.stdout)
    missing = [f for f in result["findings"] if f["kind"] == "missing_ranks"]
    assert [(f["group"], f["seq"], f["op"], f["ranks"]) for f in missing] == [("main_comm", 4, "all_reduce", [1])]
