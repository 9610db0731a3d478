"""Attaching a frontend to a running job through its TCPStore (``--store HOST:PORT``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from httpget import request
from mpjob import REPO, free_port, kill_all, reference_job

from debug_server.auth import TOKEN_ENV, TOKEN_HEADER, store_key
from debug_server.frontend import attach
from debug_server.protocol.addrs import meta_key, url_key
from debug_server.readers.storeview import store_client


def _start_attached(store_port: int, world_size: int, *extra: str,
                    env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m debug_server.frontend --store ...`` as its own process; (process, 'ready <port>'
    from the address it prints, or its 'error: ...' line)."""
    child_env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    child_env.update(PYTHONPATH=str(REPO), **(env or {}))
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "debug_server.frontend", "--store", f"127.0.0.1:{store_port}",
             "--world-size", str(world_size), "--port", "0", "--host", "127.0.0.1",
             "--fetch-timeout", "3", *extra],
            env=child_env, cwd=REPO, stdout=subprocess.PIPE, stderr=err, start_new_session=True)
        assert proc.stdout is not None
        with proc.stdout:  # the address is all it prints there
            first = proc.stdout.readline().decode()
        m = re.fullmatch(rf"debug_server frontend: http://127\.0\.0\.1:(\d+)/ for {world_size} "
                         r"ranks\n", first)
        if m:
            return proc, f"ready {m.group(1)}"
        proc.wait(60)  # no address: it exits, and says why on stderr
        err.seek(0)
        errors = [ln for ln in err.read().decode().splitlines() if ln.startswith("error: ")]
        return proc, errors[0] if errors else f"no address and no error line (stdout {first!r})"


def _end(proc: subprocess.Popen[Any]) -> None:
    kill_all([proc])


# ---------------------------------------------------------------------------------------------
# The address and the store's answers


def test_store_address_parses_host_port_and_bracketed_ipv6() -> None:
    assert attach.parse_store("node001:29500") == ("node001", 29500)
    assert attach.parse_store("[fd00::1]:29500") == ("fd00::1", 29500)


@pytest.mark.parametrize("bad", ["node001", "node001:", ":29500", "node001:http", "node001:70000"])
def test_store_address_without_a_port_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(attach.AttachError, match=r"expected HOST:PORT \(the job's MASTER_ADDR"):
        attach.parse_store(bad)


def test_restart_to_trust_is_the_newest_named_by_a_sidecar(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, 5)
    store.set(meta_key(0), json.dumps({"restart": 2, "pid": 1}))
    store.set(meta_key(1), json.dumps({"restart": 1, "pid": 2}))  # a rank not re-registered yet
    assert attach.current_restart(store, 3) == 2  # rank 2 has no sidecar at all


def test_token_comes_from_the_jobs_store_key_of_that_restart(tcp_store: Any) -> None:
    store = store_client("127.0.0.1", tcp_store.port, 5)
    store.set(store_key(1), "t" * 32)
    assert attach.job_token(store, 1, None) == "t" * 32
    assert attach.job_token(store, 0, None) is None  # restart 0 published none: no token
    assert attach.job_token(store, 1, "e" * 20) == "e" * 20  # an explicit one wins


@pytest.mark.job
def test_unreachable_store_is_one_line_error_and_exit_2(tmp_path: Path) -> None:
    proc, line = _start_attached(free_port(), 2)
    try:
        assert proc.wait(60) == 2
        assert re.fullmatch(r"error: cannot reach the job's TCPStore at 127\.0\.0\.1:\d+ within "
                            r"3 s \(.*\)", line), line
    finally:
        _end(proc)


@pytest.mark.job
def test_token_from_the_environment_guards_the_attached_pages(tcp_store: Any) -> None:
    token = "env-token-0123456789abcdef"
    proc, line = _start_attached(tcp_store.port, 1, env={TOKEN_ENV: token})
    try:
        assert line.startswith("ready "), line
        base = f"http://127.0.0.1:{line.split()[1]}"
        assert request(f"{base}/?format=json")[0] == 401
        status, body = request(f"{base}/?format=json", headers={TOKEN_HEADER: token})
        assert status == 200 and json.loads(body)["ranks"][0]["status"] == "not registered"
    finally:
        _end(proc)


@pytest.mark.job
def test_frontend_started_by_hand_without_store_is_a_usage_error_naming_it() -> None:
    out = subprocess.run([sys.executable, "-m", "debug_server.frontend", "--world-size", "2"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "the following arguments are required: --store" in out.stderr


@pytest.mark.job
def test_options_of_rank0s_spawned_frontend_are_not_attach_options() -> None:
    # Rank 0's frontend takes its config from an inherited file, not from options.
    out = subprocess.run([sys.executable, "-m", "debug_server.frontend", "--store", "h:1",
                          "--world-size", "2", "--dump-interval", "5"],
                         env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "unrecognized arguments: --dump-interval 5" in out.stderr


# ---------------------------------------------------------------------------------------------
# torch's own C++ worker, registered without our sidecar


@pytest.mark.job
def test_attached_frontend_finds_torchs_cpp_worker_without_sidecar(tcp_store: Any) -> None:
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    if not hasattr(c10d, "_WorkerServer"):
        pytest.skip("this torch has no C++ WorkerServer")
    cpp = c10d._WorkerServer("127.0.0.1", 0)
    proc = None
    try:
        store = store_client("127.0.0.1", tcp_store.port, 5)
        store.set(url_key(0), f"http://127.0.0.1:{cpp.port}")  # what torch's server writes
        store.set(meta_key(1), json.dumps({"restart": 0}))  # rank 1 never wrote its URL
        proc, line = _start_attached(tcp_store.port, 2)
        assert line.startswith("ready "), line
        base = f"http://127.0.0.1:{line.split()[1]}"
        status, body = request(f"{base}/stacks?format=json")
        assert status == 200
        ranks = json.loads(body)["ranks"]
        assert ranks[0]["status"] == "ok" and ranks[0]["url"] == f"http://127.0.0.1:{cpp.port}"
        assert "most recent call first" in ranks[0]["stacks"]
        assert ranks[1]["status"] == "not registered"
    finally:
        if proc is not None:
            _end(proc)
        cpp.shutdown()


# ---------------------------------------------------------------------------------------------
# A real 2-rank gloo job that hangs, with a token, attached from a separate process


JOB = reference_job('port=0, fetch_timeout=3, auth="token", dump_interval=3600',
                    "h.auth_token", after_start="assert h.wait_registered(60)")


@pytest.mark.job
@pytest.mark.timeout(120)
def test_frontend_attached_by_store_names_the_missing_rank_of_a_real_job(tmp_path: Path) -> None:
    master_port = free_port()  # rank 0's init_process_group hosts the job's TCPStore
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(JOB))
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs: list[subprocess.Popen[bytes]] = []
    attached = None
    try:
        for r in range(2):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
                   "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(master_port), "PYTHONPATH": str(REPO),
                   "OMP_NUM_THREADS": "1"}
            with logs[r].open("wb") as out:
                procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=out,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        tokens: dict[int, str] = {}
        deadline = time.monotonic() + 60
        while len(tokens) < 2 and time.monotonic() < deadline:
            for r in range(2):
                m = re.search(r"^PHASE2 (\S+)$", logs[r].read_text(), re.M)
                if m:
                    tokens[r] = m.group(1)
                assert procs[r].poll() is None, logs[r].read_text()[-3000:]
            time.sleep(0.2)
        assert len(tokens) == 2, [p.read_text()[-2000:] for p in logs]
        token = tokens[0]
        # No token given: the attached frontend reads the job's own from the store.
        attached, line = _start_attached(master_port, 2)
        assert line.startswith("ready "), line
        base = f"http://127.0.0.1:{line.split()[1]}"
        assert request(f"{base}/fr_trace?format=json")[0] == 401  # the job's token guards it too
        deadline = time.monotonic() + 30
        while True:  # rank 0 enters all_reduce #4 a moment after it printed PHASE2
            status, body = request(f"{base}/fr_trace?format=json", headers={TOKEN_HEADER: token})
            assert status == 200, body
            result = json.loads(body)
            missing = [f for f in result["findings"] if f["kind"] == "missing_ranks"]
            if missing or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert [(f["group"], f["seq"], f["op"], f["ranks"]) for f in missing] == \
            [("main_comm", 4, "all_reduce", [1])]
        assert [r["status"] for r in result["ranks"]] == ["ok", "ok"]
    finally:
        # Each rank's process group: the rank and rank 0's frontend child.
        kill_all([*procs, *([attached] if attached is not None else [])])
