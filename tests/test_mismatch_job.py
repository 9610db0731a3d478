"""A real 2-rank gloo job with a misconfigured collective, named live and post-mortem alike.

Runs ``scripts/gpu/check_mismatch.py`` (the GPU check's own driver) on gloo: rank 0 all_reduces
where rank 1 broadcasts at #3, both hang; the live ``/fr_trace``, the hang report and the CLI on
the pickles must all say ``type_mismatch`` at #3, ``misconfigured_collective``, no GPU advice.
The size case (rank 0 completes, rank 1 hangs) cannot run on gloo: gloo aborts rank 0 ("Received
data size doesn't match expected size"); its regression tests serve synthetic rings instead
(``test_live_equals_postmortem.py``, ``test_verdict_category.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpjob import REPO, free_port

pytestmark = pytest.mark.job


@pytest.mark.timeout(150)
def test_type_mismatch_on_gloo_is_named_live_in_the_hang_report_and_post_mortem(
        tmp_path: Path) -> None:
    env = dict(os.environ, TEST_BACKEND="gloo", READ_AT="4", COMM_TIMEOUT="10",
               DEBUG_SERVER_PORT=str(free_port()), MASTER_PORT=str(free_port()),
               OUT=str(tmp_path), PYTHONPATH=str(REPO))
    env.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "gpu" / "check_mismatch.py"),
                             "--cases", "type"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=130)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(10)
    assert proc.returncode == 0, out[-4000:]
    assert "OK: type named at #3 live and post-mortem" in out
    for where in ("live /fr_trace", "hang report", "post-mortem CLI"):
        section = out.split(f"--- {where}")[1].split("\n--- ")[0]
        assert "[type_mismatch] main_comm #3 all_reduce ranks [0, 1]" in section, where
        assert "category: misconfigured_collective" in section, where
        assert "suspect the GPU" not in section, where
