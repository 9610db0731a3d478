"""Fake fleets: real worker apps serving synthetic rings, and a real frontend process over them.

Shared by the benchmarks (``soak.py``, ``bench_frontend.py``, ``bench_ui.py``,
``bench_agents.py``, ``bench_frontend_gc.py``, ``profile_frontend.py``), which find it beside
them (a script's folder is first on ``sys.path``), and by the tests (``tests/test_load.py``, the
c10d worker fakes), whose pytest settings put ``benchmarks/`` on the path (``pyproject.toml``).

- ``start_frontend(urls, ...)``: the frontend as its own process, started the way
  ``start_debug_server`` starts it (``rank.server.spawn_frontend``: the whole config through an
  inherited file), over fixed worker URLs or a TCPStore. Returns ``(process, port)``.
- ``frontend_over(dumps, ...)``: a context manager; one worker thread in this process per dump
  (a few ranks) and a frontend process over them; everything ended on exit.
- ``start_fleet(world, helpers)``: thousands of ranks, spread over a few helper processes
  (``python benchmarks/fakefleet.py --serve FIRST LAST WORLD``), each serving its ranks from one
  event loop; ``stop_fleet`` ends them. ``c10d=True``: ranks that answer as PyTorch's own C++
  worker does (``c10d_dump``, ``make_c10d_worker_app``). Other apps in helper processes (agents of fake hosts):
  ``start_helpers(script, args)``, each helper ending in ``serve_apps(apps)``; ``split`` cuts
  the work between helpers.
- ``/proc`` readings of a process (``status_kb``, ``open_fds``, ``cpu_s``) and the timing
  helpers of the benchmarks (``timed_get``, ``median_of``).

Fake ranks are fakes only in what they serve (``StaticProvider``: a fixed dump, stacks and
health); the HTTP servers, the frontend process and its fan-out are the real ones.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from debug_server.config import FrontendConfig, ServerConfig
from debug_server.rank.server import spawn_frontend, wait_frontend_ready
from debug_server.rank.worker import (
    StaticProvider,
    WorkerThread,
    make_worker_app,
    start_worker_thread,
)
from debug_server.tools import synthetic

REPO = Path(__file__).resolve().parent.parent

RING = 2000
NCCL_TIMING_ENV = "FAKEFLEET_NCCL_TIMING"
"""``1``: ``--c10d-nccl`` fakes write what a group with c10d's timing events writes (``c10d_nccl_dump``)."""
"""Entries in each fake rank's ring in ``start_fleet`` (a full default-size ring)."""
STACK = (
    "Thread 0x00007f0000000001 (most recent call first):\n"
    '  File "/job/train.py", line 88 in hang_phase\n'
    '  File "/job/train.py", line 120 in <module>\n'
)
"""What every fake rank answers for its stacks."""
READY_TIMEOUT_S = 60.0


# ---------------------------------------------------------------------------------------------
# The frontend process


def start_frontend(urls: Sequence[str | None] | None = None, *,
                   store: tuple[str, int] | None = None, world_size: int = 0,
                   stderr: int | None = subprocess.DEVNULL,
                   **server: Any) -> tuple[subprocess.Popen[bytes], int]:
    """A frontend process over ``urls`` (one per rank), or over the ranks registered in a
    TCPStore (``store``, with ``world_size``); ``server``: ``ServerConfig`` fields.

    Binds 127.0.0.1 on a free port unless ``server`` says otherwise. Raises when the process
    does not report ready within ``READY_TIMEOUT_S`` (and leaves no process behind).
    """
    config = FrontendConfig(server=ServerConfig(**{"port": 0, "host": "127.0.0.1", **server}),
                            world_size=len(urls) if urls is not None else world_size,
                            worker_urls=tuple(urls) if urls is not None else None, store=store)
    pending = spawn_frontend(config, stderr=stderr)
    try:
        return pending[0], wait_frontend_ready(pending, 0, timeout=READY_TIMEOUT_S)
    except BaseException:
        end_process(pending[0])
        raise


def end_process(proc: subprocess.Popen[Any], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace_s``; waits for the exit either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def frontend_over(dumps: Mapping[int, Mapping[str, Any]], *, dump_dir: Path | None = None,
                  **server: Any) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """``(process, port)`` of a frontend over one worker thread per rank of ``dumps``.

    With ``dump_dir``, the frontend dumps there and rank r's dump file handler writes
    ``dump_dir/per_rank/rank_r``. The workers and the frontend are ended on exit.
    """
    workers: list[WorkerThread] = []
    proc = None
    try:
        for r in sorted(dumps):
            path = str(dump_dir / "per_rank" / f"rank_{r}") if dump_dir is not None else None
            workers.append(start_worker_thread(StaticProvider(dumps[r], stacks=STACK,
                                                              dump_path=path)))
        if dump_dir is not None:
            server["dump_dir"] = str(dump_dir)
        proc, port = start_frontend([f"http://127.0.0.1:{w.port}" for w in workers], **server)
        yield proc, port
    finally:
        if proc is not None:
            end_process(proc)
        for w in workers:
            w.stop()


# ---------------------------------------------------------------------------------------------
# Many ranks in helper processes


def rank_dumps(world: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One issued-the-hang dump and one missing-rank dump (every other rank has the same data)."""
    two = synthetic.hang_job(2, n_entries=RING, missing_rank=1)
    groups = {"main_comm": list(range(world))}
    return (synthetic.make_dump(two[0]["entries"], groups),
            synthetic.make_dump(two[1]["entries"], groups))


def _memo_middleware(cache: dict[tuple[int, str], tuple[int, bytes, str]], key: int) -> Any:
    """Each distinct question answered once per helper and data: a real rank cuts its own ring
    on its own CPU, in parallel with every other rank; N fakes on this box's 2 cores cannot."""
    from aiohttp import web

    @web.middleware
    async def memo(request: web.Request, handler: Any) -> web.StreamResponse:
        k = (key, request.path_qs)
        hit = cache.get(k)
        if hit is None:
            resp = await handler(request)
            if not isinstance(resp, web.Response) or resp.body is None:
                return resp
            body = resp.body if isinstance(resp.body, bytes) else bytes(resp.body)  # type: ignore[arg-type]
            hit = cache[k] = (resp.status, body, resp.content_type)
        return web.Response(status=hit[0], body=hit[1], content_type=hit[2])

    return memo


def c10d_dump(dump: Mapping[str, Any]) -> dict[str, Any]:
    """``dump`` in c10d's own schema, as torch's C++ worker serves it (checked against a real
    ``_WorkerServer`` over gloo, torch 2.13: ``test_c10d_worker_params``): entries name their
    group by id (``process_group: ["0", "main_comm"]``), ``pg_config`` sits under an empty name,
    ``pg_status`` is keyed by id with counters as strings, ops are ``gloo:<op>``, ``state``
    stays ``scheduled`` (``retired`` says an op finished), discovery times are 0, and entries
    have no ``frames`` (c10d's JSON dump never writes stacks: a 2000-entry ring is ~0.9 MB)."""
    ids = {name: str(i) for i, name in enumerate(dump["pg_config"])}
    entries = [_c10d_entry(e, ids, "gloo", retired=e["state"] == "completed", state="scheduled",
                           time_discovered_completed_ns=0, time_discovered_started_ns=0)
               for e in dump["entries"]]
    return {
        "comm_lib_version": "", "entries": entries, "nccl_comm_state": {},
        # gloo's default group as torch 2.13 writes it; the fleet's dumps have one group
        "pg_config": {"": {"desc": "", "name": "",
                           "ranks": next(iter(dump["pg_config"].values()))["ranks"]}},
        "pg_status": {ids[name]: {k: str(v) for k, v in st.items()}
                      for name, st in dump["pg_status"].items()},
        "version": "2.10"}


def _c10d_entry(e: Mapping[str, Any], ids: Mapping[str, str], backend: str,
                **states: Any) -> dict[str, Any]:
    """One entry of ours as c10d writes it, keys in c10d's (sorted) order; ``states``: its
    ``retired``, ``state`` and discovery times, which the two recorders write differently."""
    out = {
        "collective_seq_id": e["collective_seq_id"],
        "input_dtypes": e["input_dtypes"], "input_sizes": e["input_sizes"],
        "is_p2p": e["is_p2p"], "op_id": e["op_id"], "output_dtypes": e["output_dtypes"],
        "output_sizes": e["output_sizes"], "p2p_seq_id": e["p2p_seq_id"],
        "pg_id": int(ids[e["process_group"][0]]),
        "process_group": [ids[e["process_group"][0]], e["process_group"][0]],
        "profiling_name": f"{backend}:" + e["profiling_name"].partition(":")[2],
        "record_id": e["record_id"], "retired": states["retired"], "state": states["state"],
        "thread_id": "140401007201152", "thread_name": "python",
        "time_created_ns": e["time_created_ns"],
        "time_discovered_completed_ns": states["time_discovered_completed_ns"],
        "time_discovered_started_ns": states["time_discovered_started_ns"],
        "timeout_ms": e["timeout_ms"]}
    return out


def c10d_nccl_dump(dump: Mapping[str, Any], timing: bool = False) -> dict[str, Any]:
    """``dump`` as c10d's NCCL recorder writes it (``dump_nccl_trace_json``, CUDA builds only),
    checked byte for byte against a real worker (torch 2.11+cu130, NCCL 2.28.9, 2 H200s:
    ``scripts/gpu/capture_c10d_nccl.py``; ``tests/data/c10d_nccl_worker.json`` is its head and
    first entries) and ``FlightRecorderDetail.hpp``'s ``dump_json``: keys sorted (nlohmann's
    objects), no spaces, no ``frames`` (the JSON dump never writes stacks), ops ``nccl:<op>``,
    ``pg_config`` keyed by the group's name (here its id, ``"0"``) with the member list as one
    string, ``pg_status`` keyed by id with its three counters as strings, ``retired`` once the
    watchdog let an op go, discovery times 0 where unknown.

    ``timing``: the group records start events (``TORCH_NCCL_ENABLE_TIMING=1``). Without them,
    torch's default, c10d never learns that an op started: ``state`` goes from ``scheduled``
    to ``completed``, ``time_discovered_started_ns`` stays 0 and ``last_started_collective``
    ``-1``; so an op of ours that ``started`` is ``scheduled`` here."""
    ids = {name: str(i) for i, name in enumerate(dump["pg_config"])}
    entries = []
    for e in dump["entries"]:
        t, state = e["time_created_ns"], e["state"]
        if not timing and state == "started":
            state = "scheduled"
        entries.append(_c10d_entry(
            e, ids, "nccl", retired=state == "completed", state=state,
            time_discovered_completed_ns=t + 2000 if state == "completed" else 0,
            time_discovered_started_ns=t + 1000 if timing and state != "scheduled" else 0))

    def status(st: Mapping[str, Any]) -> dict[str, str]:
        out = {k: str(v) for k, v in sorted(st.items())}
        if not timing:
            out["last_started_collective"] = "-1"
        return out

    return {
        "comm_lib_version": "2.28.9", "entries": entries, "nccl_comm_state": {},
        "pg_config": {ids[name]: {"desc": name, "name": ids[name], "ranks": c["ranks"]}
                      for name, c in dump["pg_config"].items()},
        "pg_status": {ids[name]: status(st) for name, st in dump["pg_status"].items()},
        "version": "2.10"}


def c10d_empty_dump() -> dict[str, Any]:
    """A c10d recorder that recorded nothing (c10d writes no ``entries`` key then)."""
    return {"comm_lib_version": "", "nccl_comm_state": {}, "pg_config": {}, "pg_status": {},
            "version": "2.10"}


def _nccl_handler(nccl: Mapping[str, Any]) -> Callable[[Mapping[str, str]], tuple[int, bytes]]:
    """``dump_nccl_trace_json`` as ``FlightRecorderCuda.cpp`` registers it: ``includecollectives``
    and ``onlyactive`` (``true``/``false``) and nothing else (400 otherwise); ``onlyactive``
    leaves out every entry whose completion was discovered."""
    whole = json.dumps(nccl, separators=(",", ":")).encode()
    active = dict(nccl, entries=[e for e in nccl.get("entries", ())
                                 if not e["time_discovered_completed_ns"]])
    if not active["entries"]:
        del active["entries"]
    active_json = json.dumps(active, separators=(",", ":")).encode()
    head = {k: v for k, v in nccl.items() if k != "entries"}
    head_json = json.dumps(head, separators=(",", ":")).encode()

    def answer(params: Mapping[str, str]) -> tuple[int, bytes]:
        flags = {"includecollectives": True, "onlyactive": False}
        for k, v in params.items():
            if k not in flags:
                return 400, b"Invalid parameters - unexpected param passed in"
            if v not in ("true", "false"):
                return 400, f"Invalid value for {k} valid values are true or false".encode()
            flags[k] = v == "true"
        if not flags["includecollectives"]:
            return 200, head_json
        return 200, active_json if flags["onlyactive"] else whole

    return answer


def make_c10d_worker_app(fr_json: bytes, stacks: str = STACK,
                         asked: collections.Counter[str] | None = None,
                         nccl: Mapping[str, Any] | None = None,
                         nccl_answer: Callable[[Mapping[str, str]], tuple[int, bytes]] | None
                         = None) -> Any:
    """A worker that answers as torch's C++ ``WorkerServer``: no ``torchcomms_*`` handlers
    (404), and c10d's ``fr_trace_json`` (its CPU recorder) whole whatever the parameters (torch
    2.13 ignores them, ``onlyactive`` included: ``test_c10d_worker_params``). ``nccl``: the
    NCCL recorder's dump a CUDA build serves as ``dump_nccl_trace_json`` (``_nccl_handler``);
    None: a CPU build, which has no such handler (404). ``asked``: counts each handler asked.
    ``nccl_answer``: instead of ``nccl``, a ``_nccl_handler`` shared by many fakes (its encoded
    replies are held once)."""
    from aiohttp import web

    if nccl_answer is None and nccl is not None:
        nccl_answer = _nccl_handler(nccl)

    async def handler(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if asked is not None:
            asked[name] += 1
        if name == "fr_trace_json":
            return web.Response(body=fr_json, content_type="application/json")
        if name == "dump_nccl_trace_json" and nccl_answer is not None:
            status, body = nccl_answer(request.query)
            return web.Response(status=status, body=body,
                                content_type="application/json" if status == 200 else "text/plain")
        if name == "dump_traceback":
            return web.Response(text=stacks)
        if name == "ping":
            return web.Response(text="pong")
        return web.Response(status=404, text=f"Handler {name} not found")

    app = web.Application()
    app.router.add_post("/handler/{name}", handler)
    return app


async def serve_apps(apps: Sequence[Any]) -> None:
    """The body of a helper process: each ``web.Application`` on its own port of 127.0.0.1, all
    on this loop; prints the ports as one JSON line, then serves until stdin is closed."""
    from aiohttp import web

    runners = []
    ports = []
    for app in apps:
        runner = web.AppRunner(app, handle_signals=False, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
    # A real rank or agent is a process of its own with a small heap; here thousands share one,
    # and each of Python's full collections would scan all of their apps and data again.
    gc.freeze()
    print(json.dumps(ports), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until closed
    for r in runners:
        await r.cleanup()


async def serve_ranks(first: int, last: int, world: int, memo: bool = False,
                      c10d: bool = False, c10d_nccl: bool = False) -> None:
    """Ranks ``first``..``last - 1`` of a ``world``-rank hang, one worker app each (``serve_apps``);
    ``c10d``: answering as torch's C++ worker (``make_c10d_worker_app``); ``c10d_nccl``: as that
    worker on a CUDA build, the ring in its NCCL recorder (``dump_nccl_trace_json``, honouring
    ``onlyactive``) and its CPU recorder empty."""
    full, missing = rank_dumps(world)
    if c10d_nccl:
        empty = json.dumps(c10d_empty_dump(), separators=(",", ":")).encode()
        # NCCL_TIMING_ENV=1: the fakes' groups record start events (TORCH_NCCL_ENABLE_TIMING),
        # as every NCCL fake did before issue 31 (ops "started", started counters set).
        timing = os.environ.get(NCCL_TIMING_ENV) == "1"
        answers = [_nccl_handler(c10d_nccl_dump(d, timing)) for d in (full, missing)]
        await serve_apps([make_c10d_worker_app(empty, nccl_answer=answers[rank == world - 1])
                          for rank in range(first, last)])
        return
    if c10d:
        texts = [json.dumps(c10d_dump(d), separators=(",", ":")).encode() for d in (full, missing)]
        await serve_apps([make_c10d_worker_app(texts[rank == world - 1])
                          for rank in range(first, last)])
        return
    cache: dict[tuple[int, str], tuple[int, bytes, str]] = {}
    apps = []
    for rank in range(first, last):
        data = missing if rank == world - 1 else full
        app = make_worker_app(StaticProvider(data, stacks=STACK))
        if memo:
            app.middlewares.append(_memo_middleware(cache, id(data)))
        apps.append(app)
    await serve_apps(apps)


def start_helpers(script: str, args: Sequence[Sequence[str]]) -> tuple[list[subprocess.Popen[str]],
                                                                      list[str]]:
    """One ``python script *a`` process per ``a`` in ``args``, each ending in ``serve_apps``;
    returns the processes and the URLs of their apps, in order. ``stop_fleet`` ends them."""
    # A helper runs a file as a script: the package must come from this checkout.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    procs: list[subprocess.Popen[str]] = []
    urls: list[str] = []
    try:
        for a in args:
            procs.append(subprocess.Popen([sys.executable, script, *a], stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, text=True, env=env))
        for p in procs:
            assert p.stdout is not None
            urls += [f"http://127.0.0.1:{port}" for port in json.loads(p.stdout.readline())]
    except BaseException:
        stop_fleet(procs)
        raise
    return procs, urls


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """``0..n`` cut into at most ``parts`` non-empty ``(first, last)`` ranges, in order."""
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False) if lo < hi]


def start_fleet(world: int, helpers: int, memo: bool = False, c10d: bool = False,
                c10d_nccl: bool = False) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """``world`` fake ranks (the last one never issued the newest all_reduce) spread over
    ``helpers`` processes; returns the processes and one URL per rank. ``memo``: see
    ``_memo_middleware``; ``c10d``: ranks that answer as torch's C++ worker (whole rings in
    c10d's schema, already encoded once: no serving cost to memoise); ``c10d_nccl``: torch's
    C++ worker on a CUDA build (``serve_ranks``)."""
    return start_helpers(__file__, [["--serve", str(lo), str(hi), str(world),
                                     *(["--memo"] if memo else []), *(["--c10d"] if c10d else []),
                                     *(["--c10d-nccl"] if c10d_nccl else [])]
                                    for lo, hi in split(world, helpers)])


def stop_fleet(fleet: Sequence[subprocess.Popen[str]]) -> None:
    """Closes each helper's stdin (its signal to stop) and waits; kills one that hangs."""
    for p in fleet:
        assert p.stdin is not None
        p.stdin.close()
    for p in fleet:
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        if p.stdout is not None:
            p.stdout.close()


# ---------------------------------------------------------------------------------------------
# Readings of a process, and timing


def status_kb(pid: int, field: str = "VmRSS") -> int:
    """A kB field of ``/proc/<pid>/status``: ``VmRSS`` (resident now), ``VmHWM`` (its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_s(pid: int) -> float:
    """User + system CPU seconds the process has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_get(url: str, accept: str = "*/*") -> tuple[float, bytes]:
    """Seconds a GET of ``url`` took end to end, and the body."""
    t0 = time.perf_counter()
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}),
                                timeout=600) as r:
        body = r.read()
    return time.perf_counter() - t0, body


def median_of(fn: Callable[[], tuple[float, Any]], reps: int) -> tuple[float, Any]:
    """The median of the seconds ``fn`` returns over ``reps`` calls, and the last result."""
    times, last = [], None
    for _ in range(reps):
        t, last = fn()
        times.append(t)
    return statistics.median(times), last


def _main() -> None:
    p = argparse.ArgumentParser(description="A helper process of start_fleet.")
    p.add_argument("--serve", nargs=3, type=int, required=True, metavar=("FIRST", "LAST", "WORLD"))
    p.add_argument("--memo", action="store_true")
    p.add_argument("--c10d", action="store_true")
    p.add_argument("--c10d-nccl", action="store_true")
    args = p.parse_args()
    asyncio.run(serve_ranks(*args.serve, memo=args.memo, c10d=args.c10d,
                            c10d_nccl=args.c10d_nccl))


if __name__ == "__main__":
    _main()
