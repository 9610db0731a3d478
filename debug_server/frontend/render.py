"""View-models of the rank-0 pages: what each HTML page shows, built from analysis + fan-out.

Renderers format, they do not analyse (docs/architecture.md): everything here is read off the result of
:func:`debug_server.analysis.core.analyze` (verdict, banner order, per-communicator progress,
ranks behind, the tables' models: ``analysis.tables``), the few facts of an FR fetch a page
shows (``fetchfacts.FetchFacts``), and the stacks fan-out's records (``RankResult``:
reachability, stack text). The
templates turn these plain dicts into HTML; :func:`html_table` is the one place HTML is marked
safe (every header and cell is escaped there).

Everything stays bounded at 512+ ranks: the rank grid is one small cell per rank, tables are
bounded or paged, and stacks are grouped by identical content.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jinja2
from markupsafe import Markup, escape

from debug_server.analysis import stackparse, tables
from debug_server.analysis.ranks import format_rank_set, rank_ranges
from debug_server.analysis.verdict import CATEGORY_MEANING
from debug_server.fanout.transport import GONE, RankResult
from debug_server.fanout.transport import OK as ANSWERED
from debug_server.frontend.fetchfacts import FetchFacts
from debug_server.frontend.lanes import lanes_view
from debug_server.protocol.addrs import NOT_REGISTERED
from debug_server.protocol.agentwire import StackClasses
from debug_server.readers import procstate

logger = logging.getLogger(__name__)

PAGE_ROWS = 1000
"""Rows per page of the ``?full=1`` HTML view."""
MAX_REFRESH_S = 3600
LINKED_RANKS = 16
"""Up to this many ranks in a cell are linked one by one; more are one link to the stacks page."""
RANK_TABLE_OPEN = 32
"""The full ranks table starts expanded up to this many ranks, collapsed above."""
CELLS_MAX = 4096
"""Up to this many ranks the overview draws one cell and one table row per rank; above it, one
per run of consecutive ranks alike (state, detail, health, how they answered): 131072 ranks of
which one is odd are three cells, not 131072."""
PROBLEMS_SHOWN = 200


def _runs_table(runs: Sequence[list[Any]], cells: list[dict[str, Any]]) -> str:
    """The runs (``[first, last, (state, detail, health, status, note)]``) as cells (into
    ``cells``) and as the ranks table's rows."""
    from debug_server.protocol.addrs import format_ranks as range_text

    rows, classes = [], []
    for first, last, (state, detail, h, status, note) in runs:
        text = range_text(range(first, last + 1))
        n = last - first + 1
        cells.append({"rank": first, "label": text, "state": state,
                      "title": f"rank{'s' if n > 1 else ''} {text}: {state}; {detail}"})
        how = f"{n} rank{'s' if n > 1 else ''}: {status or 'no record'}" + \
            (f" ({note})" if note else "")
        rows.append([Link(text, f"/stacks#rank-{first}"), state, "", how, h])
        classes.append(_ROW_CLASS.get(state, ""))
    return html_table(["ranks", "state", "worker", "reachability", "health"], rows, classes)

# Grid states (a record's own status "ok" is ANSWERED here)
OK, BEHIND, UNREACHABLE, UNHEALTHY, UNREGISTERED = (
    "ok", "behind", "unreachable", "unhealthy", "not registered")
RANK_STATES = (BEHIND, UNHEALTHY, UNREACHABLE, UNREGISTERED, OK)
"""Grid states, in the order the legend lists them."""


# ---------------------------------------------------------------------------------------------
# The one HTML helper


class Link(NamedTuple):
    """A table cell that links somewhere (text escaped like every other cell)."""

    text: str
    href: str


def _cell(value: Any) -> str:
    if isinstance(value, Link):
        return f'<a href="{escape(value.href)}">{escape(value.text)}</a>'
    if isinstance(value, list | tuple) and value and all(isinstance(v, Link) for v in value):
        return ", ".join(_cell(v) for v in value)
    return str(escape("" if value is None else value))


def html_table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
               row_classes: Sequence[str] | None = None) -> Markup:
    """The one place HTML is marked safe: every header and cell is escaped here.

    Cells are plain values (escaped) or :class:`Link` (or a list of them); ``row_classes``
    gives each row's CSS class ("" for none). No padding: at 512 ranks the page must stay small.
    """
    out = ["<table>\n<thead><tr>"]
    out += [f"<th>{escape(h)}</th>" for h in headers]
    out.append("</tr></thead>\n<tbody>\n")
    for i, row in enumerate(rows):
        cls = row_classes[i] if row_classes else ""
        out.append(f'<tr class="{escape(cls)}">' if cls else "<tr>")
        out += [f"<td>{_cell(v)}</td>" for v in row]
        out.append("</tr>\n")
    out.append("</tbody>\n</table>")
    return Markup("".join(out))


def rank_links(ranks: Sequence[int]) -> list[Link] | Link | str:
    """Ranks linked to their stacks (``/stacks#rank-N``); a long set is one link to the page."""
    rs = sorted(set(ranks))
    if not rs:
        return ""
    if len(rs) <= LINKED_RANKS:
        return [Link(str(r), f"/stacks#rank-{r}") for r in rs]
    return Link(format_rank_set(rs), "/stacks")


# ---------------------------------------------------------------------------------------------
# Shared pieces: query parsing, the verdict banner


def parse_refresh(raw: str) -> int:
    """``?refresh=N``: seconds between reloads (0 = off); read by the page's inline script."""
    n = int(raw)
    if not 0 <= n <= MAX_REFRESH_S:
        raise ValueError(f"must be 0..{MAX_REFRESH_S} seconds")
    return n


def _positions(result: Mapping[str, Any]) -> dict[int, dict[str, Any]]:
    return {r: g for g in result.get("stack_groups", []) for r in g.get("ranks", [])}


def _by_position(ranks: Sequence[int], pos: Mapping[int, Mapping[str, Any]],
                 ) -> dict[tuple[str, bool], list[int]]:
    """``ranks`` by position (summary, in a collective), in the order each position first
    comes in ``ranks``."""
    if len(ranks) > BY_GROUP_ABOVE and list(ranks) == sorted(set(ranks)):  # increasing
        # 131071 ranks waiting at one line: by stack group (a set intersection each), not a
        # lookup per rank. Groups that share a rank (none from the analysis) go rank by rank.
        groups = list({id(g): g for g in pos.values()}.values())
        if sum(len(g.get("ranks", ())) for g in groups) == len(pos):
            want = set(ranks)
            found: dict[tuple[str, bool], list[int]] = {}
            for g in groups:
                rs = want.intersection(g.get("ranks", ()))
                if rs:
                    found.setdefault((g["summary"], bool(g.get("in_collective"))), []).extend(rs)
            return {k: sorted(v) for k, v in sorted(found.items(), key=lambda kv: min(kv[1]))}
    by: dict[tuple[str, bool], list[int]] = {}
    for r in ranks:
        g = pos.get(r)
        if g is not None:
            by.setdefault((g["summary"], bool(g.get("in_collective"))), []).append(r)
    return by


BY_GROUP_ABOVE = 256
"""``_by_position`` goes group by group above this many ranks (a faster way, same answer)."""


def _where(ranks: Sequence[int], pos: Mapping[int, Mapping[str, Any]]) -> str:
    """``rank 1 at time.sleep at demo.py:88 (not in a collective)``, grouped by position."""
    by = _by_position(ranks, pos)
    parts = []
    for (summary, in_coll), rs in list(by.items())[:3]:
        who = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {format_rank_set(rs)}"
        parts.append(f"{who} at {summary}" + ("" if in_coll else " (not in a collective)"))
    return "; ".join(parts)


@dataclass(slots=True)
class Banner:
    """The verdict at a glance: a level (css class), one headline per problem, the full verdict."""

    level: str
    headlines: list[dict[str, Any]] = field(default_factory=list)
    verdict: str = ""
    category: str = ""
    """The analysis' root-cause category (``analysis.verdict.CATEGORIES``), empty when clean."""
    next_step: str = ""
    category_meaning: str = ""
    """What the category means, in a few words (``analysis.verdict.CATEGORY_MEANING``)."""


def banner(result: Mapping[str, Any], world_size: int) -> Banner:
    """Who is missing from what and where it is stuck, from the findings joined with stacks.

    The analysis picks and orders the findings (``headline_findings``: the root cause first), so
    the banner and the verdict never disagree on what matters most.
    """
    findings = result.get("findings", [])
    pos = _positions(result)
    heads = [_missing_head(findings[i], pos) if findings[i]["kind"] == "missing_ranks"
             else _head(findings[i], pos)
             for i in result.get("headline_findings", []) if 0 <= i < len(findings)]
    errors = any(f.get("severity", "error") != "info" for f in findings)
    no_data = result.get("ranks_without_data", [])
    level = "bad" if errors else ("warn" if no_data else "ok")
    if not heads and no_data:
        heads.append({"who": "No data from", "ranks": rank_links(no_data),
                      "what": f"({len(no_data)} of {world_size} ranks)", "where": "", "also": ""})
    category = result.get("category") or ""
    return Banner(level, heads, result.get("verdict", ""), category,
                  result.get("next_step") or "", CATEGORY_MEANING.get(category, ""))


def _missing_head(f: Mapping[str, Any], pos: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    rs = f["ranks"]
    waiting = f.get("waiting") or []
    return {
        "who": "Rank" if len(rs) == 1 else "Ranks", "ranks": rank_links(rs),
        "what": f"{'is' if len(rs) == 1 else 'are'} missing from {f['op']} #{f['seq']} "
                f"on {f.get('group_label') or f['group']}",
        "where": _where(rs, pos),
        "also": _where(waiting, pos) if waiting else "",
    }


def _head(f: Mapping[str, Any], pos: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    return {"who": f["kind"].replace("_", " ").capitalize() + ":", "ranks": rank_links(
        f.get("ranks", [])[:LINKED_RANKS]), "what": f.get("detail", ""),
        "where": _where(f.get("ranks", [])[:3], pos), "also": ""}


def nav_links() -> list[Link]:
    return [Link("overview JSON", "/?format=json"), Link("overview text", "/?format=text"),
            Link("FR JSON", "/fr_trace?format=json"), Link("FR text", "/fr_trace?format=text"),
            Link("stacks JSON", "/stacks?format=json"), Link("stacks text", "/stacks?format=text"),
            Link("trace (Perfetto)", "/fr_trace/trace.json"),
            Link("wait counters JSON", "/wait_counters?format=json"),
            Link("store keys JSON", "/tcpstore?format=json")]


def _stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z")


# ---------------------------------------------------------------------------------------------
# Overview


def _seq(n: int) -> str:
    return "-" if n < 0 else str(n)


def _at(at: Mapping[str, Any] | None) -> str:
    return f"; at {at['summary']}" if at else ""


def _state(rec: RankResult | None, h: str, at: Mapping[str, Any] | None,
            behind: Sequence[str] | None) -> tuple[str, str]:
    """A rank's state and detail on the overview (``behind``: its groups where it is behind)."""
    if rec is None or rec.status == NOT_REGISTERED:
        return UNREGISTERED, (rec.error or rec.status) if rec else "no record"
    if not rec.ok or rec.status == GONE:  # gone: its note says how, and how old its data is
        return UNREACHABLE, rec.error or rec.note or rec.status
    if behind is not None:
        return BEHIND, f"behind on {', '.join(behind)}{_at(at)}"
    if h.startswith("UNHEALTHY"):
        return UNHEALTHY, f"{h}{_at(at)}"
    return OK, f"{h or 'ok'}{_at(at)}"


def overview_model(result: Mapping[str, Any], stacks: Sequence[RankResult],
                   health: Mapping[int, str], world_size: int,
                   health_note: str = "") -> dict[str, Any]:
    """Everything ``index.html`` shows. ``health`` maps rank -> the health line of the page;
    ``health_note``: where that column comes from, when not from this page's own fetch."""
    behind = {b["rank"]: b["groups"] for b in result.get("behind", [])}
    comm_rows, comm_classes = [], []
    for c in result.get("communicators", []):
        comm_rows.append([
            c["name"], c["desc"], c["size"], _seq(c["last_issued"]),
            _seq(c["last_completed_max"]), _seq(c["last_completed_min"]),
            rank_links(c["behind_ranks"]) or "none",
        ])
        comm_classes.append("fail" if c["behind_ranks"] else "")
    reach = {r.rank: r for r in stacks}
    pos = _positions(result)
    cells: list[dict[str, Any]] = []
    problems: list[dict[str, Any]] = []
    more_problems = 0
    runs: list[list[Any]] = []
    counts = dict.fromkeys(RANK_STATES, 0)
    # An answering rank's state and detail by (health text, stack group): made once per pair,
    # not per rank (131071 ranks stalled in one op, or healthy at one place, are one pair).
    answered: dict[tuple[str, int], tuple[str, str]] = {}
    for rank in range(world_size):
        rec = reach.get(rank)
        h = health.get(rank, "")
        at = pos.get(rank)
        if rec is not None and rec.status == ANSWERED and rank not in behind:
            got = answered.get((h, id(at)))
            if got is None:
                got = answered[(h, id(at))] = _state(rec, h, at, None)
            state, detail = got
        else:
            state, detail = _state(rec, h, at, behind.get(rank))
        if state != OK and rec is not None and rec.process is not None:
            detail += f"; process {procstate.describe(rec.process)}"
        counts[state] += 1
        if world_size > CELLS_MAX:  # runs of ranks alike: one cell and one row each
            key = (state, detail, h, rec.status if rec else None, rec.note if rec else None)
            if runs and runs[-1][2] == key and runs[-1][1] == rank - 1:
                runs[-1][1] = rank
            else:
                runs.append([rank, rank, key])
        else:
            cells.append({"rank": rank, "state": state,
                          "title": f"rank {rank}: {state}; {detail}"})
        if state != OK and len(problems) <= PROBLEMS_SHOWN:
            problems.append({"rank": rank, "state": state, "detail": detail,
                             "url": rec.url if rec else None})
        elif state != OK:
            more_problems += 1
    if runs:
        ranks_table = _runs_table(runs, cells)
    else:
        ranks_table = html_table(
            ["rank", "state", "worker", "reachability", "health"],
            [[Link(str(c["rank"]), f"/stacks#rank-{c['rank']}"), c["state"],
              (reach[c["rank"]].url or "") if c["rank"] in reach else "",
              reach[c["rank"]].line() if c["rank"] in reach else "", health.get(c["rank"], "")]
             for c in cells],
            [_ROW_CLASS.get(c["state"], "") for c in cells])
    return {
        "banner": banner(result, world_size),
        "reachable": sum(1 for r in stacks if r.status == ANSWERED),  # not GONE
        "world_size": world_size,
        "counts": [(s, counts[s]) for s in RANK_STATES],
        "cells": cells,
        "problems": problems[:PROBLEMS_SHOWN],
        "problems_more": max(0, len(problems) - PROBLEMS_SHOWN) + more_problems,
        "comms": html_table(["communicator", "backend", "size", "last issued seq",
                             "last completed seq (max)", "last completed seq (min)",
                             "behind / missing ranks"], comm_rows, comm_classes),
        "ranks_table": ranks_table,
        "ranks_open": world_size <= RANK_TABLE_OPEN,
        "health_note": health_note,
        "downloads": nav_links(),
        "stamp": _stamp(),
    }


_ROW_CLASS = {BEHIND: "fail", UNHEALTHY: "warn", UNREACHABLE: "warn", UNREGISTERED: "warn"}


# ---------------------------------------------------------------------------------------------
# Flight Recorder page


@dataclass(slots=True)
class Table:
    """One HTML table and what the reader is told about the rows not in it."""

    html: Markup
    note: str


def _html(t: tables.TableModel) -> Markup:
    """A table model as HTML: its marks as row classes, its rank sets linked to their stacks."""
    rows = t.rows
    if t.rank_column is not None:
        col = t.rank_column
        rows = [row if not ranks else [*row[:col], rank_links(ranks), *row[col + 1:]]
                for row, ranks in zip(t.rows, t.rank_sets, strict=True)]
    return html_table(t.headers, rows, t.marks)


def fr_tables(result: Mapping[str, Any], *, full: bool, page: int) -> tuple[Table, Table]:
    """The Collectives and NCCL Calls tables (``analysis.tables``): bounded by default, every
    row page by page with ``full``."""
    if not full:
        coll = tables.collectives_table(result)
        calls = tables.nccl_calls_table(result)
        return (Table(_html(coll), _bounded_note(coll, "collectives")),
                Table(_html(calls), _bounded_note(calls, "calls")))
    lo = (page - 1) * PAGE_ROWS
    part = list(result.get("collectives", []))[lo : lo + PAGE_ROWS]
    coll = tables.collectives_table(result, part)
    part_calls = list(result.get("nccl_calls", []))[lo : lo + PAGE_ROWS]
    calls = tables.nccl_calls_table(result, part_calls)
    return (Table(_html(coll), _page_note(coll, lo, page)),
            Table(_html(calls), _page_note(calls, lo, page)))


def _bounded_note(t: tables.TableModel, what: str) -> str:
    return f"{len(t.rows)} of {t.total} {what} (failing ones first)" if len(t.rows) < t.total else ""


def _page_note(t: tables.TableModel, lo: int, page: int) -> str:
    return (f"rows {lo + 1}-{lo + len(t.rows)} of {t.total} (page {page})" if t.rows
            else f"page {page} is past the end ({t.total} rows)")


def _findings(result: Mapping[str, Any]) -> list[dict[str, Any]]:
    lines = tables.findings_lines(result)
    out = []
    for f, line in zip(result.get("findings", []), lines, strict=False):
        out.append({"kind": f["kind"], "line": line, "ranks": rank_links(f.get("ranks", [])),
                    "info": f.get("severity") == "info"})
    return out


def render_fr_html(env: jinja2.Environment, result: Mapping[str, Any], fetch: FetchFacts,
                   *, full: bool, page: int, whole: bool) -> str:
    """The Flight Recorder page: the analysis result, and of the fetch only ``fetch``."""
    coll, calls = fr_tables(result, full=full, page=page)
    failing = sum(1 for c in result.get("collectives", []) if not c.get("pass_check"))
    return env.get_template("fr_trace.html").render(
        title="Flight Recorder",
        banner=banner(result, fetch.asked),
        findings=_findings(result),
        failures=list(fetch.failures),
        ranks_answered=fetch.answered, world_size=fetch.asked,
        groups=_html(tables.groups_table(result)),
        collectives=coll.html, collectives_note=coll.note,
        n_collectives=len(result.get("collectives", [])), n_failing=failing,
        calls=calls.html, calls_note=calls.note,
        full=full, page=page, whole=whole, window=fetch.window, scope=fetch.scope,
        lanes=lanes_view(result),
        downloads=nav_links(), stamp=_stamp(),
    )


# ---------------------------------------------------------------------------------------------
# Stacks page


STACK_LINKS_MAX = 1024
"""Above this many ranks a stacks group names its ranks as ranges (``stacks_model``)."""


def _runs(ranks: Sequence[int]) -> list[tuple[int, str]]:
    """Sorted ranks as (first rank, ``first-last``) runs."""
    return [(int(t.split("-", 1)[0]), t) for t in rank_ranges(ranks)]


def _stack_key(text: str) -> tuple[Any, ...]:
    # Thread idents differ on every rank; the frames are what makes two ranks "the same".
    threads = stackparse.parse_threads(text)
    if not threads:
        return ("raw", text)
    return tuple(tuple((f.filename, f.line, f.function) for f in t.frames) for t in threads)


def _frame_text(f: stackparse.Frame) -> str:
    if f.native:  # py-spy --native: a C/C++ function and its library (or source file)
        return f"[native] {f.function} ({f.filename}{f':{f.line}' if f.line else ''})"
    return f"{f.filename}:{f.line} in {f.function}"


def _threads_view(text: str) -> list[dict[str, Any]]:
    threads = stackparse.parse_threads(text)
    main = stackparse.main_thread(threads)
    views = []
    for t in threads:
        views.append({
            "name": ("main thread" if t is main else ("dumping thread" if t.current else "thread"))
                    + (f" {t.ident}" if t.ident else ""),
            "main": t is main,
            "frames": [_frame_text(f) for f in t.frames],
        })
    views.sort(key=lambda v: not v["main"])
    return views


def stacks_model(results: Sequence[RankResult], *, path: str = "/stacks",
                 native: bool = False) -> dict[str, Any]:
    """Ranks with identical stacks grouped (keyed on all frames, native ones included), the
    odd ones (smallest groups) first; ``path`` and ``native`` keep the page's links."""
    by_key: dict[tuple[Any, ...], list[RankResult]] = {}
    # A text's key, parsed once per class of texts alike but for thread ids (131072 texts, a
    # few classes); ranks alike share one text object on the way up: made a class once.
    keys: dict[str, tuple[Any, ...]] = {}
    class_of = StackClasses()
    for r in results:
        if r.ok:
            text = r.body or ""
            cls = class_of(text)
            key = keys.get(cls)
            if key is None:
                key = keys[cls] = _stack_key(text)
        else:
            key = ("failed", r.status)
        by_key.setdefault(key, []).append(r)
    groups = []
    for key, members in by_key.items():
        first = members[0]
        ranks = [m.rank for m in members]
        # Each rank's process as read on its host (fanout.outside): state, CPU, wait channel.
        procs = [f"rank {m.rank}: {procstate.describe(m.process)}" for m in members
                 if m.process is not None][:50]
        if first.ok:
            text = first.body or ""
            pos = stackparse.summarize_text(text)
            summary = pos.summary if pos else "no Python frame"
            if pos and not pos.in_collective:
                summary += " (not in a collective)"
            threads = _threads_view(text)
            groups.append({"ranks": ranks, "ok": True, "summary": summary,
                           "in_collective": bool(pos and pos.in_collective),
                           "main": [t for t in threads if t["main"]],
                           "others": [t for t in threads if not t["main"]],
                           "raw": text, "raw_rank": first.rank, "lines": [],
                           "note": f"rank {first.rank}: {first.note}" if first.note else "",
                           "procs": procs})
        else:
            groups.append({"ranks": ranks, "ok": False, "summary": key[1], "main": [],
                           "others": [], "in_collective": True, "raw": "",
                           "raw_rank": first.rank, "lines": [m.line() for m in members[:50]],
                           "note": "", "procs": procs})
    # Odd ones first; among equally small groups, ranks outside any collective (the likely
    # cause of a hang) before ranks waiting inside one.
    groups.sort(key=lambda g: (not g["ok"], len(g["ranks"]), g["in_collective"], g["ranks"][0]))
    for g in groups:
        g["label"] = (f"{len(g['ranks'])} ranks" if len(g["ranks"]) > 1
                      else f"rank {g['ranks'][0]}")
        g["set"] = format_rank_set(g["ranks"])
        # A big group's ranks as ranges, each linked by its first rank (131072 links are
        # megabytes that no one reads); a smaller one links every rank (``#rank-N``).
        g["runs"] = _runs(g["ranks"]) if len(g["ranks"]) > STACK_LINKS_MAX else None
    return {"groups": groups, "n_ranks": len(results), "stamp": _stamp(), "path": path,
            "native": native}
