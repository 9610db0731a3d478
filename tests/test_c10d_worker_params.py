"""What torch's own C++ worker (``_WorkerServer``) answers to ``fr_trace_json``, on a real gloo
job: the facts the frontend's fan-out and the fake c10d workers (``fakefleet.c10d_dump``,
``make_c10d_worker_app``) rely on.

- ``fr_trace_json`` ignores every parameter: ``onlyactive=true``, our ``window=`` and anything
  else all get the whole ring with 200 (so the fan-out cuts it on arrival; asking
  ``onlyactive=true`` first would save nothing);
- on gloo no entry is ever marked completed (``state`` stays ``scheduled``, ``retired`` says
  done), which is what c10d's ``onlyactive`` filters on: even where honoured, it would keep every
  gloo entry;
- entries carry no ``frames`` (c10d's JSON dump writes no stacks);
- its text is compact with sorted keys, which ``analysis.frtext`` cuts without parsing it all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from fakefleet import c10d_dump
from mpjob import free_port
from torch._C import _distributed_c10d as c10d

from debug_server.protocol import frtext, frwindow
from debug_server.tools import synthetic

pytestmark = pytest.mark.job

REPO = Path(__file__).resolve().parent.parent

PROBE = """
import json, os, sys, time, urllib.error, urllib.request
import torch, torch.distributed as dist
from torch._C._distributed_c10d import _WorkerServer
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
for _ in range(5):
    dist.all_reduce(torch.ones(3))
w = _WorkerServer("127.0.0.1", 0)
# c10d's watchdog retires gloo work on its own thread: wait (30 s at most: the full suite on a
# loaded 2-core box once ran past 10 s) until it counted all five, so the answers below are of a
# settled ring; the fixture says so where it never settled.
deadline = time.monotonic() + 30
while True:
    req = urllib.request.Request(f"http://127.0.0.1:{w.port}/handler/fr_trace_json", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        status = json.loads(r.read().decode()).get("pg_status", {}).get("0", {})
    settled = status.get("last_completed_collective") == "5"
    if settled or time.monotonic() > deadline:
        break
    time.sleep(0.05)
out = {"settled": settled}
for name, query in [("fr_trace_json", ""), ("fr_trace_json", "onlyactive=true"),
                    ("fr_trace_json", "window=4"), ("fr_trace_json", "includecollectives=false"),
                    ("dump_nccl_trace_json", "onlyactive=true")]:
    url = f"http://127.0.0.1:{w.port}/handler/{name}?{query}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as r:
            raw = r.read().decode()
            out[f"{name}?{query}"] = [r.status, json.loads(raw)]
            out.setdefault("raw", raw)
    except urllib.error.HTTPError as e:
        out[f"{name}?{query}"] = [e.code, None]
out["nccl_available"] = dist.is_nccl_available()
w.shutdown()
dist.destroy_process_group()
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def answers() -> dict[str, Any]:
    if not hasattr(c10d, "_WorkerServer"):
        pytest.skip("this torch has no C++ WorkerServer")
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(PROBE), str(free_port())],
                         env=env, cwd=REPO, capture_output=True, text=True, timeout=90)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, out.stderr[-3000:]
    got = dict(json.loads(line[len("RESULT "):]))
    assert got.pop("settled"), "c10d's watchdog had not retired the 5th gloo op after 30 s"
    return got


def test_torchs_fr_trace_json_answers_the_whole_ring_whatever_the_parameters(
        answers: dict[str, Any]) -> None:
    status, plain = answers["fr_trace_json?"]
    assert status == 200 and [e["collective_seq_id"] for e in plain["entries"]] == [1, 2, 3, 4, 5]
    for query in ("onlyactive=true", "window=4", "includecollectives=false"):
        status, dump = answers[f"fr_trace_json?{query}"]
        assert status == 200, query
        assert [e["collective_seq_id"] for e in dump["entries"]] == [1, 2, 3, 4, 5], query


def test_torchs_gloo_entries_are_never_marked_completed_only_retired(
        answers: dict[str, Any]) -> None:
    _, dump = answers["fr_trace_json?"]
    assert {(e["state"], e["retired"], e["time_discovered_completed_ns"])
            for e in dump["entries"]} == {("scheduled", True, 0)}
    assert dump["pg_status"]["0"]["last_completed_collective"] == "5"


def test_torchs_nccl_handler_is_absent_where_torch_has_no_nccl(answers: dict[str, Any]) -> None:
    if answers["nccl_available"]:
        pytest.skip("this torch has NCCL: dump_nccl_trace_json exists here")
    assert answers["dump_nccl_trace_json?onlyactive=true"][0] == 404


def test_fake_c10d_dumps_have_exactly_the_keys_of_torchs(answers: dict[str, Any]) -> None:
    _, real = answers["fr_trace_json?"]
    fake = c10d_dump(synthetic.hang_job(2, n_entries=5, missing_rank=1)[0])
    assert "frames" not in real["entries"][0]
    assert set(fake) == set(real)
    assert set(fake["entries"][0]) == set(real["entries"][0])
    assert set(next(iter(fake["pg_status"].values()))) == set(real["pg_status"]["0"])
    assert set(fake["pg_config"][""]) == set(real["pg_config"][""])


def test_torchs_own_reply_text_is_cut_as_its_parsed_dump_is(answers: dict[str, Any]) -> None:
    raw = answers["raw"]
    for w in (frwindow.Window(slack=0), frwindow.Window(slack=4), frwindow.Window(since={"0": 4})):
        text = frtext.cut_text(raw, w)
        assert text is not None and json.loads(text) == w(json.loads(raw)), w
    cut = json.loads(frtext.cut_text(raw, frwindow.Window(slack=0)) or "{}")
    assert [e["collective_seq_id"] for e in cut["entries"]] == [5]
