"""A worker's FR reply, parsed once: the typed record the fan-out hands on, never re-encoded.

A record (``transport.RankResult``) carries its reply's timing (``elapsed_s``, ``done_ns``) and
either the text as it came (``body``) or, where the fan-out had to read it as it arrived, the
parsed dump (``dump``; ``body`` is then ``""``, answered). Three things read a reply on arrival:

- a ``stacks=true`` reply is split at the wire's separator (``wire.STACKS_SEP``): the FR JSON
  stays the body, the stacks text goes to the page's stacks (:func:`stacks_apart`);
- a reply over :data:`CUT_ON_ARRIVAL_BYTES` (torch's C++ worker sends its whole ring, ~0.9 MB)
  is parsed and cut to the window at once, so a fan-out over thousands of such workers never
  holds all their rings (:func:`cutter`; c10d's own text is cut reading only what the window
  keeps: ``protocol.frtext.cut_dump``);
- torch's C++ worker's two recorders become one dump (:func:`merge_c10d`).

Every other reply is parsed once, after its round, by :func:`parse_dumps` (on a thread where the
round's bodies are big: :func:`parse_off_loop`), which also puts back the member lists sent as
references (``members``). The window facts (``frwindow.WINDOW_KEY``, ``activecover``) are keys
of the dump itself. :class:`FrData` is what an FR fetch returns: the records and the dumps.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.errors import first_line
from debug_server.fanout import c10d_workers
from debug_server.fanout.transport import FAILED, RankResult
from debug_server.protocol import activecover, fastjson, frtext, frwindow, members
from debug_server.protocol.names import SINCE, WINDOW
from debug_server.protocol.wire import split_stacks

Cut = Callable[[dict[str, Any]], dict[str, Any]]
Each = Callable[[RankResult], Awaitable[None]]
Keep = Callable[[dict[str, Any]], dict[str, Any]]
"""What a fan-out keeps of each parsed reply (``kept_on_arrival``)."""


@dataclass(slots=True)
class FrData:
    """Every rank's FR fetch: the records, and the parsed dumps of the ranks that answered."""

    results: list[RankResult]
    dumps: dict[int, dict[str, Any]]
    window: dict[str, int] | None = None
    """Per group, the first seq fetched (``frwindow``); None for whole rings or active only."""
    scope: str | None = None
    """What the data is, where it is not a live fetch (the post-mortem viewer: "as the dumper
    wrote it"); the page shows it instead of the fetch window."""

    def unavailable(self) -> dict[int, str]:
        return {r.rank: r.line() for r in self.results if r.rank not in self.dumps}


INLINE_BYTES = 256 * 1024
"""Replies smaller than this in all are parsed on the event loop, not on a thread: the hop and
the GIL hand-over between threads cost more than parsing them (an agent's 8 ranks' windows are
about 20 KB; 1024 agents on one box spent 2x the CPU on their fr replies with the hops)."""
INLINE_DUMPS = 64
"""Up to this many dumps are cut to the window on the event loop (a few entries each)."""
CUT_ON_ARRIVAL_BYTES = 256 * 1024
"""A windowed FR reply larger than this is cut to the window as it arrives (:func:`cutter`)."""


def parse_dumps(results: Sequence[RankResult]) -> dict[int, dict[str, Any]]:
    """Each OK record's dump (parsed here unless it was on arrival); a body that is not a JSON
    object turns its record into a failure."""
    dumps: dict[int, dict[str, Any]] = {}
    for r in results:
        if not r.ok:
            continue
        try:
            dump = r.json()
        except ValueError as e:
            r.status, r.error = FAILED, f"reply is not JSON ({first_line(e, 200, empty='')})"
            continue
        if not isinstance(dump, dict):
            r.status, r.error = FAILED, "reply is not a JSON object"
            continue
        members.inline(dump)  # lists sent as references (pgknown), one shared copy
        members.learn(dump)
        dumps[r.rank] = dump
    return dumps


async def parse_off_loop(results: Sequence[RankResult]) -> dict[int, dict[str, Any]]:
    """``parse_dumps`` on a thread where the bodies are big (``INLINE_BYTES``), else here."""
    if sum(len(r.body) for r in results if r.body) < INLINE_BYTES:
        return parse_dumps(results)
    return await asyncio.get_running_loop().run_in_executor(None, parse_dumps, results)


def cut_all(dumps: Mapping[int, dict[str, Any]],
            since: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """Every dump cut to the job's window (the workers' own cuts may keep a little more); ranks
    that share their dump's parts are cut once and share the cut (``frwindow.window_all``)."""
    return frwindow.window_all(dumps, since)


async def cut_off_loop(dumps: Mapping[int, dict[str, Any]],
                       since: Mapping[str, int]) -> dict[int, dict[str, Any]]:
    """``cut_all`` on a thread for many dumps (``INLINE_DUMPS``), else here."""
    if len(dumps) <= INLINE_DUMPS:
        return cut_all(dumps, since)
    return await asyncio.get_running_loop().run_in_executor(None, cut_all, dumps, since)


def param_cut(params: Mapping[str, str]) -> Cut | None:
    """The window an FR request's parameters ask for (None: whole rings or active entries)."""
    if SINCE in params:
        return frwindow.Window(since=frwindow.parse_since(params[SINCE]))
    if WINDOW in params:
        return frwindow.Window(slack=int(params[WINDOW]))
    return None


def fr_object(r: RankResult) -> dict[str, Any] | None:
    """The record's reply as a dump (parsed where it was not yet); None where it is not a JSON
    object (``parse_dumps`` reports that with its own line)."""
    if r.dump is not None:
        return r.dump
    try:
        dump = fastjson.loads(r.body or "")
    except ValueError:
        return None
    return dump if isinstance(dump, dict) else None


def keep_parsed(r: RankResult, dump: dict[str, Any]) -> None:
    """``dump`` becomes the record's reply: answered, parsed, no text kept."""
    r.dump, r.body = dump, ""


def cut_reply(body: str, cut: Cut) -> dict[str, Any] | None:
    """``body`` parsed and cut to the window; None when it is not a JSON object. A whole c10d
    ring is cut from its text, parsing only what the window keeps (``frtext``), where its text
    allows."""
    if isinstance(cut, frwindow.Window):
        fast = frtext.cut_dump(body, cut)
        if fast is not None:
            return fast
    try:
        dump = fastjson.loads(body)
    except ValueError:
        return None
    return cut(dump) if isinstance(dump, dict) else None


def cutter(cut_for: Callable[[RankResult], Cut | None]) -> Each:
    """An ``each`` (``transport.fan_out``) that parses a big reply and cuts it to the window
    ``cut_for`` chooses for its record (None: left whole) as it arrives."""

    async def each(r: RankResult) -> None:
        if r.ok and r.body is not None and len(r.body) > CUT_ON_ARRIVAL_BYTES:
            cut = cut_for(r)
            if cut is not None:
                dump = await asyncio.get_running_loop().run_in_executor(None, cut_reply,
                                                                        r.body, cut)
                if dump is not None:
                    keep_parsed(r, dump)

    return each


def cut_on_arrival(cut: Cut | None) -> Each | None:
    """:func:`cutter` with one window for every record (None: no cut, no ``each``)."""
    return None if cut is None else cutter(lambda r: cut)


def kept_on_arrival(keep: Keep, then: Each | None) -> Each:
    """An ``each`` that runs ``then`` (a cut), then parses each answered reply and keeps only
    ``keep`` of it (``keep_parsed``): a fan-out that reads little of each reply (the straggler
    poll's times) holds that little as the replies come, not every reply's text and dump
    (131072 windows of 16 entries: 3.8 GB parsed)."""

    async def each(r: RankResult) -> None:
        if then is not None:
            await then(r)
        if r.ok:
            dump = fr_object(r)
            if dump is not None:  # else parse_dumps says why it is not understood
                keep_parsed(r, keep(dump))

    return each


def lists_referred(then: Each | None) -> Each:
    """An ``each`` that runs ``then`` (a cut), then writes each long member list of a reply
    still held as text as a reference (``members.refer_text``; :func:`parse_dumps` puts the one
    shared copy back): torch's C++ workers send the world's list in every reply, 96 % of an
    ``onlyactive`` one at 4096 ranks."""

    async def each(r: RankResult) -> None:
        if then is not None:
            await then(r)
        if r.ok and r.body:
            r.body = members.refer_text(r.body)

    return each


def stacks_apart(stacks: dict[int, str], then: Each | None) -> Each:
    """An ``each`` that moves a ``stacks=true`` reply's stacks text into ``stacks`` (its FR JSON
    stays the body), then runs ``then``."""

    async def each(r: RankResult) -> None:
        if r.ok and r.body is not None:
            r.body, text = split_stacks(r.body)
            if text is not None:
                stacks[r.rank] = text
        if then is not None:
            await then(r)

    return each


def merge_c10d(pairs: Sequence[tuple[RankResult, RankResult]], active: bool = False,
               ) -> list[tuple[dict[str, Any] | None, frozenset[str]]]:
    """Each rank's CPU and NCCL recorder replies as one dump (``c10d_workers.merge``), and the
    CPU groups renamed; None where the CPU reply stays as it is (a reply that is not a JSON
    object, or an NCCL recorder that names no group). ``active``: the NCCL replies are
    ``onlyactive`` ones, read as such a cut (``activecover.mark``)."""
    out: list[tuple[dict[str, Any] | None, frozenset[str]]] = []
    for cpu, nccl in pairs:
        a, b = fr_object(cpu), fr_object(nccl)
        if a is None or b is None or not c10d_workers.has_groups(b):
            out.append((None, frozenset()))
            continue
        merged, renamed = c10d_workers.merge(a, activecover.mark(b) if active else b)
        out.append((merged, renamed))
    return out


def marked_active(r: RankResult) -> dict[str, Any] | None:
    """An ``onlyactive`` reply's dump with its cut's facts (``activecover.mark``)."""
    dump = fr_object(r)
    return None if dump is None else activecover.mark(dump)


__all__ = ["CUT_ON_ARRIVAL_BYTES", "INLINE_BYTES", "INLINE_DUMPS", "FrData", "cut_off_loop",
           "cutter", "lists_referred", "merge_c10d", "parse_dumps", "parse_off_loop", "stacks_apart"]
