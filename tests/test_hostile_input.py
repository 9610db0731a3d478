"""Hostile and broken analyzer input: refused in one line, nothing executed.

tests/test_fr_trace.py and tests/test_dumpio.py cover a ``__reduce__`` to ``os.system``, a
truncated pickle, garbage bytes, a wrong version and an ``__import__`` ranks string; this file
adds what they do not: an empty file, other code-running pickle shapes (protocol 0 ``GLOBAL``,
``INST``, ``eval`` at the top level, a payload nested in a set), more ``ranks`` expressions, and
hostile data arriving over the network at the frontend.
"""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import _scenarios as S
import pytest

from debug_server.config import ServerConfig
from debug_server.dumpio import DumpError, parse_ranks, safe_loads
from debug_server.frontend.app import make_frontend_app
from debug_server.readers.storeview import StaticRegistry
from debug_server.tools import fr_trace, synthetic


def _write_clean(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for r, dump in S.clean().items():
        (d / f"rank_{r}").write_bytes(pickle.dumps(dump))


def _one_line_error(capsys: Any) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[0].startswith("error: ") and "Traceback" not in "\n".join(err)
    # One line per refused file, then at most one hint.
    assert all(e.startswith("error: rank_") for e in err[:-1]), err
    assert err[-1].startswith(("hint: ", "error: ")), err
    return err[0]


def test_empty_file_is_refused_in_one_line(tmp_path: Path, capsys: Any) -> None:
    d = tmp_path / "d"
    _write_clean(d)
    (d / "rank_1").write_bytes(b"")
    assert fr_trace.main([str(d)]) == 1
    assert "rank_1" in _one_line_error(capsys)


def _payloads(marker: Path) -> dict[str, bytes]:
    cmd = f"touch {marker}".encode()

    class TopLevel:
        def __reduce__(self) -> Any:
            return (eval, (f"open({str(marker)!r}, 'w')",))

    class Nested:
        def __reduce__(self) -> Any:
            return (os.system, (cmd.decode(),))

    return {
        # protocol 0, hand-written: GLOBAL os.system, then REDUCE
        "global_opcode": b"cos\nsystem\n(S'" + cmd + b"'\ntR.",
        # protocol 0 INST opcode: calls os.system(cmd) without any REDUCE
        "inst_opcode": b"(S'" + cmd + b"'\nios\nsystem\n.",
        "eval_top_level": pickle.dumps(TopLevel()),
        "nested_in_set": pickle.dumps({"version": "2.10", "entries": [], "x": {("a", Nested())}}),
        "getattr_chain": (b"\x80\x04cbuiltins\ngetattr\n(cbuiltins\n__import__\n(Vos\ntRVsystem\n"
                          b"tR(V" + cmd + b"\ntR."),
    }


@pytest.mark.parametrize("kind", ["global_opcode", "inst_opcode", "eval_top_level",
                                  "nested_in_set", "getattr_chain"])
def test_code_running_pickles_are_refused_and_never_run(tmp_path: Path, capsys: Any,
                                                        kind: str) -> None:
    marker = tmp_path / "pwned"
    data = _payloads(marker)[kind]
    with pytest.raises((pickle.UnpicklingError, DumpError, ValueError, EOFError)):
        safe_loads(data)
    d = tmp_path / "d"
    _write_clean(d)
    (d / "rank_0").write_bytes(data)
    assert fr_trace.main([str(d)]) == 1
    line = _one_line_error(capsys)
    assert "rank_0" in line
    assert not marker.exists()


@pytest.mark.parametrize("ranks", [
    "__import__('os').system('touch {m}')",
    "[0, 1] + [__import__('os').system('touch {m}')]",
    "[i for i in range(2)]",
    "list(range(2))",
    "(0, 1)",
    "{{0, 1}}",
    "[0, 1]; import os",
    "[0x1, 1e0]",
    "[" + "0, " * 10 + "open('{m}', 'w')]",
])
def test_ranks_expressions_are_refused_without_eval(tmp_path: Path, capsys: Any,
                                                    ranks: str) -> None:
    marker = tmp_path / "X"
    value = ranks.format(m=marker)
    with pytest.raises(DumpError, match="refused pg_config ranks"):
        parse_ranks(value)
    d = tmp_path / "d"
    d.mkdir()
    for r, dump in S.clean().items():
        dump["pg_config"]["main_comm"]["ranks"] = value
        (d / f"rank_{r}").write_text(json.dumps(dump))
    assert fr_trace.main([str(d)]) == 1
    assert "refused pg_config ranks" in _one_line_error(capsys)
    assert not marker.exists()


async def test_hostile_ranks_from_a_worker_never_run_and_never_break_a_page(
        aiohttp_client: Any, fake_job: Any, tmp_path: Path) -> None:
    marker = tmp_path / "X"
    dumps = synthetic.hang_job(2, n_entries=5, missing_rank=1)
    for dump in dumps.values():
        dump["pg_config"]["main_comm"]["ranks"] = f"__import__('os').system('touch {marker}')"
    urls = await fake_job(dumps)
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2),
                                                    StaticRegistry(urls)))
    for path in ("/", "/fr_trace", "/stacks", "/fr_trace?format=json"):
        resp = await client.get(path, headers={"Accept": "*/*"})
        body = await resp.text()
        assert resp.status == 200 and "Traceback" not in body, path
    assert not marker.exists()


def _canned_worker(profile: str, counters: str) -> Any:
    from aiohttp import web

    async def torch_profile(request: web.Request) -> web.Response:
        return web.Response(text=profile, content_type="application/json")

    async def wait_counter_values(request: web.Request) -> web.Response:
        return web.Response(text=counters, content_type="application/json")

    app = web.Application()
    app.router.add_post("/handler/torch_profile", torch_profile)
    app.router.add_post("/handler/wait_counter_values", wait_counter_values)
    return app


_HOSTILE_EVENTS = [
    {"ph": "X", "cat": "kernel", "name": "<script>alert(1)</script>", "pid": {"a": [1]},
     "tid": [1, 2], "ts": 1e308, "dur": -5},
    {"ph": "s", "id": {"x": 1}, "pid": None, "tid": True, "ts": 0},
    {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": "<b>not a dict</b>"},
    {"ph": "X", "ts": "0", "dur": "1"}, 7, None, "x",
]


@pytest.mark.parametrize(("profile", "counters"), [
    ("[" * 100_000, "[" * 100_000),  # deeper than the JSON parser's recursion limit
    ('{"traceEvents": [{"ph": "X", "ts": NaN, "dur": Infinity}]}', '{"c": {"total_calls": NaN}}'),
    (json.dumps({"traceEvents": _HOSTILE_EVENTS, "baseTimeNanoseconds": -1}),
     json.dumps({"<script>alert(2)</script>": {"total_calls": 2, "max_time_us": 1e308},
                 "x" * 100_000: {"total_calls": "<b>"}})),
    (json.dumps({"traceEvents": "nope"}), json.dumps([{"c": 1}])),
])
async def test_hostile_profiles_and_counters_from_workers_never_break_a_page(
        aiohttp_client: Any, aiohttp_server: Any, profile: str, counters: str) -> None:
    server = await aiohttp_server(_canned_worker(profile, counters))
    urls = [str(server.make_url("")).rstrip("/")]
    client = await aiohttp_client(make_frontend_app(ServerConfig(port=0, fetch_timeout=2),
                                                    StaticRegistry(urls)))
    for path in ("/profile?duration=0.1", "/profile/trace.json", "/wait_counters",
                 "/wait_counters?format=json", "/profile?format=json"):
        for accept in ("*/*", "text/html"):
            resp = await client.get(path, headers={"Accept": accept})
            body = await resp.text()
            assert resp.status == 200, (path, body[:300])
            assert "Traceback" not in body, path
            if resp.content_type == "text/html":
                assert "<script>alert" not in body, path
            if path == "/profile/trace.json":  # data, not a page: valid JSON, names as sent
                assert resp.content_type == "application/json"
                json.loads(body)
