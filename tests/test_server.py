from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from fakes import make_job
from httpget import post, request
from mpjob import free_port, reference_job

import debug_server
from debug_server.config import (
    DUMP_PATH_ENV,
    FRONTEND_CONFIG_FD_ENV,
    ConfigError,
    FrontendConfig,
    ServerConfig,
    Settings,
    read_inherited,
    write_inherited,
)
from debug_server.frontend.app import make_frontend_app
from debug_server.frontend.departed import POLL_S
from debug_server.rank.discovery import register_worker
from debug_server.rank.server import start_debug_server, stop_debug_server
from debug_server.rank.worker import HooksProvider, start_worker_thread
from debug_server.readers.storeview import StoreRegistry, store_client
from debug_server.recording import hooks

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def rank_env(monkeypatch: Any, tcp_store: Any) -> Any:
    def set_env(rank: int, world_size: int) -> None:
        for k, v in {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_WORLD_SIZE": world_size,
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": tcp_store.port}.items():
            monkeypatch.setenv(k, str(v))
        monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)

    yield set_env
    stop_debug_server()


def _get(url: str, accept: str = "*/*", timeout: float = 90) -> tuple[int, str]:
    # A first page waits for the frontend's store connection and every rank: the test's own
    # timeout bounds it, not 10 s (a loaded box took longer).
    return request(url, headers={"Accept": accept}, timeout=timeout)


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "debug_server.rank.worker"]


@pytest.mark.job
def test_rank0_serves_pages_and_stop_works_twice(rank_env: Any, tmp_path: Path) -> None:
    rank_env(0, 1)
    handle = start_debug_server(port=0, fetch_timeout=3)
    try:
        assert handle.frontend_url and handle.worker_url.startswith("http://127.0.0.1:")
        status, text = _get(f"{handle.frontend_url}/stacks")
        assert status == 200 and text.startswith("--- Stack groups (main thread; odd ones first) ---\n1 rank (0): ")
        assert "\n=== Rank 0 ===\n" in text
        assert "in test_rank0_serves_pages_and_stop_works_twice" in text
        with pytest.raises(RuntimeError, match="already running"):
            start_debug_server(port=0)
    finally:
        handle.stop()
    assert handle.frontend is not None and handle.frontend.poll() is not None
    handle.stop()
    stop_debug_server()
    stop_debug_server()
    assert _worker_threads() == []


@pytest.mark.job
def test_the_job_log_gets_one_line_from_rank_0_and_none_from_the_others(
        rank_env: Any, caplog: Any) -> None:
    caplog.set_level("INFO", logger="debug_server")
    rank_env(1, 2)
    other = start_debug_server(port=0, fetch_timeout=3)
    assert other.wait_registered(30)
    other.stop()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    rank_env(0, 1)
    handle = start_debug_server(port=0, fetch_timeout=3)
    handle.stop()
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert shown == [f"debug_server: pages at {handle.frontend_url}/"], shown


@pytest.mark.job
def test_port_in_use_is_an_error_naming_the_port(rank_env: Any) -> None:
    rank_env(0, 1)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port}"):
            start_debug_server(port=port, host="127.0.0.1")
    assert _worker_threads() == []
    stop_debug_server()  # nothing running: a no-op


@pytest.mark.job
def test_other_ranks_start_no_frontend_and_register_their_worker(rank_env: Any, tcp_store: Any) -> None:
    rank_env(1, 2)
    handle = start_debug_server()
    assert handle.frontend is None and handle.frontend_url is None
    assert handle.wait_registered(5)
    store = store_client("127.0.0.1", tcp_store.port, 5)
    assert store.get("rank1").decode() == handle.worker_url
    assert json.loads(store.get("rank1_meta"))["pid"] == os.getpid()
    status, _ = post(f"{handle.worker_url}/handler/ping", timeout=5)
    assert status == 200


@pytest.mark.job
def test_dump_dir_defaults_the_per_rank_pickle_path(rank_env: Any, monkeypatch: Any, tmp_path: Path) -> None:
    rank_env(1, 2)
    monkeypatch.delenv(DUMP_PATH_ENV, raising=False)
    default = hooks.dump_path(1)
    start_debug_server(dump_dir=str(tmp_path))
    assert hooks.dump_path(1) == str(tmp_path / "per_rank" / "rank_1")
    assert DUMP_PATH_ENV not in os.environ  # a value handed to the hooks, not the environment
    stop_debug_server()
    assert hooks.dump_path(1) == default  # taken back: it must not outlive the server


@pytest.mark.job
def test_user_set_per_rank_pickle_path_is_kept(rank_env: Any, monkeypatch: Any, tmp_path: Path) -> None:
    rank_env(1, 2)
    monkeypatch.setenv(DUMP_PATH_ENV, "/mine/fr_")
    start_debug_server(dump_dir=str(tmp_path))
    assert hooks.dump_path(1) == "/mine/fr_1"
    stop_debug_server()
    assert os.environ[DUMP_PATH_ENV] == "/mine/fr_"
    # Without a server the hooks take the user's prefix as new_comm read it.
    assert hooks.dump_path(1, Settings.from_env().dump_prefix) == "/mine/fr_1"


@pytest.mark.job
def test_frontend_process_does_not_import_the_recording_side() -> None:
    code = ("import sys, debug_server.frontend.app; "
            "bad = [m for m in ('debug_server.recording.comms', 'debug_server.recording.hooks') if m in sys.modules]; "
            "sys.exit(f'imported {bad}' if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------------------
# The frontend's one config object


def _every_field_set() -> FrontendConfig:
    server = ServerConfig(port=26701, worker_port=26702, host="127.0.0.1", dump_dir="/d",
                          dump_interval=2.5, enabled_dumps=frozenset({"stacks", "per_rank"}),
                          fetch_timeout=1.5, max_concurrency=7, keep_dumps=3, keep_bytes=1 << 20,
                          stall_timeout=9.0, auth_token="t" * 32)
    return FrontendConfig(server=server, world_size=4, store=("node001", 29500),
                          restart_count=2, parent_pid=123, ready_fd=9)


def test_frontend_config_survives_json_with_every_field() -> None:
    config = _every_field_set()
    assert FrontendConfig.from_json(config.to_json()) == config
    urls = FrontendConfig(server=ServerConfig(), world_size=2, worker_urls=("http://h:1", None))
    assert FrontendConfig.from_json(urls.to_json()) == urls


def test_inherited_config_file_is_read_whole_and_closed() -> None:
    config = _every_field_set()
    fd = write_inherited(config)
    assert read_inherited({FRONTEND_CONFIG_FD_ENV: str(fd)}) == config
    with pytest.raises(OSError):
        os.fstat(fd)  # closed by the reader: a child holds no copy beyond start
    assert read_inherited({}) is None


@pytest.mark.parametrize(("text", "why"), [
    ('{"server": {"port": 1}, "world_size": 1, "store": ["h", 1], "colour": 1}',
     "FrontendConfig has no field 'colour'"),
    ('{"server": {"prot": 1}, "world_size": 1, "store": ["h", 1]}',
     "ServerConfig has no field 'prot'"),
    ('{"server": {"port": 70000}, "world_size": 1, "store": ["h", 1]}',
     "port=70000 is not a TCP port"),
    ('{"server": {}, "world_size": 2, "worker_urls": ["http://h:1"]}',
     "1 worker_urls for world_size=2"),
    ('{"server": {}, "world_size": 1}', "exactly one of store"),
    ("not json", "frontend config is not JSON"),
])
def test_bad_frontend_config_is_one_line_naming_the_field(text: str, why: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(why)) as e:
        FrontendConfig.from_json(text)
    assert "\n" not in str(e.value)


TRAINER = """
import os, sys, time
from debug_server import start_debug_server
h = start_debug_server(port=0, fetch_timeout=2)
print("FRONTEND", h.frontend.pid, flush=True)
time.sleep(60)
"""


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie still answers kill(0); the frontend is not our child, so look at its state.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.job
def test_frontend_exits_when_its_trainer_dies(tcp_store: Any, tmp_path: Path) -> None:
    # A one-rank job: with its only rank gone nothing of the job is left to serve (the store,
    # the test's, outlives it); the frontend exits after DEBUG_SERVER_ORPHAN_EXIT_S.
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(tcp_store.port),
           "PYTHONPATH": str(REPO), "DEBUG_SERVER_ORPHAN_EXIT_S": "1"}
    out = (tmp_path / "out.txt").open("w+")
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], env=env, stdout=out,
                               stderr=subprocess.STDOUT, start_new_session=True)
    frontend_pid = None
    try:
        deadline = time.monotonic() + 60
        while frontend_pid is None and time.monotonic() < deadline and trainer.poll() is None:
            m = re.search(r"FRONTEND (\d+)", (tmp_path / "out.txt").read_text())
            frontend_pid = int(m.group(1)) if m else None
            time.sleep(0.1)
        assert frontend_pid, (tmp_path / "out.txt").read_text()
        trainer.kill()
        trainer.wait()
        # The frontend polls its parent every POLL_S; well within 20 polls it is gone
        # (a bound on liveness, not a speed figure: the box may be loaded).
        t0 = time.monotonic()
        while not _pid_gone(frontend_pid) and time.monotonic() - t0 < 20 * POLL_S:
            time.sleep(0.1)
        assert _pid_gone(frontend_pid), "frontend outlived its trainer"
    finally:
        out.close()
        for pid in (trainer.pid, frontend_pid):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        trainer.wait()


# ---------------------------------------------------------------------------------------------
# Interop with torch's own debug server


def test_torchs_frontend_reads_our_workers_stacks(tcp_store: Any, monkeypatch: Any) -> None:
    frontend = pytest.importorskip("torch.distributed.debug._frontend")
    handlers = pytest.importorskip("torch.distributed.debug._debug_handlers")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(tcp_store.port))
    monkeypatch.setenv("WORLD_SIZE", "1")
    worker = start_worker_thread(HooksProvider(0))
    try:
        register_worker(store_client("127.0.0.1", tcp_store.port, 5), make_job(0, 1, tcp_store.port),
                        f"http://127.0.0.1:{worker.port}")
        _, (resp,) = frontend.fetch_all("dump_traceback", timeout=5)
        assert resp.status_code == 200
        assert "in test_torchs_frontend_reads_our_workers_stacks" in resp.text
        dump = handlers.StacksHandler().dump()
        assert dump.startswith("=== Rank 0: http://127.0.0.1:") and "most recent call first" in dump
    finally:
        worker.stop()


async def test_our_frontend_reads_torchs_cpp_workers(aiohttp_client: Any, tcp_store: Any) -> None:
    c10d = pytest.importorskip("torch._C._distributed_c10d")
    if not hasattr(c10d, "_WorkerServer"):
        pytest.skip("this torch has no C++ WorkerServer")
    cpp = c10d._WorkerServer("127.0.0.1", 0)
    try:
        store_client("127.0.0.1", tcp_store.port, 5).set("rank0", f"http://127.0.0.1:{cpp.port}")
        registry = StoreRegistry("127.0.0.1", tcp_store.port, world_size=1, restart_count=0)
        client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=5), registry))
        text = await (await client.get("/stacks", headers={"Accept": "*/*"})).text()
        assert "\n=== Rank 0 ===\n" in text and "most recent call first" in text
        assert "in _run_once" in text  # this test's event loop, waiting on the page
        body = await (await client.get("/fr_trace?format=json")).json()
        assert body["ranks"][0]["status"] == "ok" and body["ranks_with_data"] == [0]
    finally:
        cpp.shutdown()


# ---------------------------------------------------------------------------------------------
# A real 2-rank gloo job that hangs


# port=0: a port picked in advance can be taken meanwhile by a worker's ephemeral bind.
JOB = reference_job('port=0, dump_dir=os.environ["DUMP_DIR"], dump_interval=1, fetch_timeout=3, '
                    'stall_timeout=2', "h.frontend_url")

COLLECTIVE_ROW = re.compile(
    r"^\s*\d+\s+main_comm\s+False\s+4\s+nccl:all_reduce\s+started\s+\{1\}\s+\{0, 1\}", re.M)


def _section(text: str, rank: int) -> str:
    return text.split(f"=== Rank {rank} ===", 1)[1].split("=== Rank ", 1)[0]


def _wait_for(what: str, check: Any, deadline: float, interval: float = 0.5) -> Any:
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except OSError as e:  # not up yet
            last = e
        if last and not isinstance(last, Exception):
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}; last: {str(last)[:2000]}")


@pytest.mark.job
@pytest.mark.timeout(150)
def test_two_rank_gloo_hang_is_diagnosed_end_to_end(tmp_path: Path) -> None:
    script = tmp_path / "rank_script.py"
    script.write_text(textwrap.dedent(JOB))
    lines = script.read_text().splitlines()
    sleep_line = 1 + lines.index("    time.sleep(80)  # SLEEP_LINE")
    store_port, dump_dir = free_port(), tmp_path / "dumps"
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    deadline = time.monotonic() + 90
    try:
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store_port),
                   "DUMP_DIR": str(dump_dir), "OMP_NUM_THREADS": "1",
                   "PYTHONPATH": str(REPO)}
            env.pop(DUMP_PATH_ENV, None)
            logs.append((tmp_path / f"rank{rank}.log").open("w+b"))
            procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path,
                                          stdout=logs[-1], stderr=subprocess.STDOUT,
                                          start_new_session=True))

        def both_in_phase2() -> bool:
            for p, log in zip(procs, logs, strict=True):
                if p.poll() is not None:
                    raise AssertionError(f"a rank exited early:\n{Path(log.name).read_text()[-3000:]}")
            return all(b"PHASE2" in Path(log.name).read_bytes() for log in logs)

        _wait_for("both ranks in phase 2", both_in_phase2, deadline)
        base = re.search(rb"^PHASE2 (http://127\.0\.0\.1:\d+)$", Path(logs[0].name).read_bytes(),
                         re.M).group(1).decode()

        def hang_in_fr_trace() -> str | None:
            text = _get(f"{base}/fr_trace")[1]
            return text if COLLECTIVE_ROW.search(text) else None

        def rank0_in_all_reduce() -> str | None:
            text = _get(f"{base}/stacks")[1]
            return text if "in all_reduce" in _section(text, 0) else None

        text = _wait_for("the hang in /fr_trace", hang_in_fr_trace, deadline)
        assert "Rank 1 never joined all_reduce #4 on main_comm" in text

        stacks = _wait_for("rank 0 inside all_reduce", rank0_in_all_reduce, deadline)
        assert f'rank_script.py", line {sleep_line} in <module>' in _section(stacks, 1)
        assert "in all_reduce" not in _section(stacks, 1)

        def rank0_unhealthy() -> str | None:
            text = _get(f"{base}/")[1]
            return text if re.search(r"^rank 0: ok, UNHEALTHY: main_comm seq 4 all_reduce in flight "
                                     r"for \d+\.\d s", text, re.M) else None

        overview = _wait_for("rank 0 reported stalled", rank0_unhealthy, deadline)
        assert "rank 1: ok, healthy" in overview

        status, body = _get(f"{base}/fr_trace?format=json")
        findings = json.loads(body)["findings"]
        assert {"kind": "missing_ranks", "seq": 4, "ranks": [1]}.items() <= next(
            f for f in findings if f["kind"] == "missing_ranks").items()

        def dumps_written() -> bool:
            names = os.listdir(dump_dir) if dump_dir.exists() else []
            reports = [n for n in names if n.startswith("torchcomms_fr_trace_")]
            return (any(n.startswith("stacks_") for n in names)
                    and any(COLLECTIVE_ROW.search((dump_dir / n).read_text()) for n in reports)
                    # (the stall watchdog also leaves stalled_stacks_r0.txt there)
                    and sorted(n for n in os.listdir(dump_dir / "per_rank")
                               if n.startswith("rank_")) == ["rank_0", "rank_1"])

        _wait_for("dump files", dumps_written, deadline)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the rank and its frontend child
            except ProcessLookupError:
                pass
        for p in procs:
            p.wait(10)
        for log in logs:
            log.close()


def test_public_api_is_the_entry_points_and_what_a_training_script_needs() -> None:
    assert sorted(debug_server.__all__) == [
        "ConfigError", "DebugServer", "FlightRecorderHook", "ReduceOp", "new_comm",
        "start_debug_server", "stop_debug_server"]


@pytest.mark.job
@pytest.mark.timeout(150)
def test_multi_host_links_carry_the_address_other_hosts_reach(
        monkeypatch: Any, tcp_store: Any, caplog: Any) -> None:
    from debug_server.config import is_loopback
    from debug_server.rank.discovery import interface_addresses

    own = next((a for a in interface_addresses() if not is_loopback(a)), None)
    if own is None:
        pytest.skip("this host has no non-loopback IPv4 interface")
    # Rank 0 of two hosts: the store is reached through this host's interface address.
    for k, v in {"RANK": 0, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 1, "MASTER_ADDR": own,
                 "MASTER_PORT": tcp_store.port}.items():
        monkeypatch.setenv(k, str(v))
    monkeypatch.delenv("DEBUG_SERVER_HOST", raising=False)
    caplog.set_level("INFO", logger="debug_server.rank.server")
    handle = start_debug_server(port=0, fetch_timeout=3)
    try:
        assert handle.auth_token
        assert handle.browser_url == f"http://{own}:{handle.frontend_port}/?token={handle.auth_token}"
        assert handle.worker_url == f"http://{own}:{handle.worker_port}"
        assert handle.wait_registered(5)
        assert store_client(own, tcp_store.port, 5).get("rank0").decode() == handle.worker_url
        assert (f"rank 0 worker at {handle.worker_url} (the interface toward MASTER_ADDR {own})"
                in caplog.text)
        # The first page also waits for the frontend's store connection and every rank: on a
        # loaded box that took over 10 s once; the test's own timeout bounds it.
        status, body = request(f"{handle.frontend_url}/?format=json",
                               headers={"X-Debug-Server-Token": handle.auth_token}, timeout=90)
        assert status == 200, body
    finally:
        handle.stop()
