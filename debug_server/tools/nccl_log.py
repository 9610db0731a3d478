"""Read NCCL_DEBUG=INFO logs of a hung job: ``python -m debug_server.nccl_log FILE... [--json]``.

With ``NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL`` every rank logs each collective it enqueues::

    host:pid:tid [0] NCCL INFO AllReduce: opCount 1e sendbuff 0x... count 1024 datatype 7 op 0
        root 0 comm 0x55d5c0 [nranks=8] stream 0x...

so the last ``opCount`` of a rank on a communicator is the last collective that rank *issued*. A
rank whose last opCount is below the others' never issued the next one: that is the rank the
others wait for. This tool reports, per rank and communicator, the last opCount (hex, as NCCL
prints it), the ranks behind, and the WARN/ERROR lines and init failures, each distinct message
once with the ranks that printed it.

Ranks are taken from, in order: the communicator init lines (``comm 0x.. rank 3 nranks 8 ...``,
the rank in the process's largest communicator), a ``[rankN]:`` line prefix, the file name
(``nccl_rank3.log``, ``host.1234.3.log``), and last the ``[device]`` field of the line prefix
(the local GPU, which equals the rank only on one host). Comm pointers are mapped per process to
communicators through the init lines (``commId``/``commHash`` when printed, else ``nranks`` and
order of creation). Lines of newer NCCL versions (``commHash``, no ``[nranks=]``) are accepted.

Exit status: 0 no rank behind and no WARN/ERROR, 2 something found, 1 unusable input.

The lines are read by ``tools/nccl_log_parse.py``; this module sums them up, prints, and is the CLI.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from debug_server.analysis.ranks import format_ranks
from debug_server.tools.nccl_log_parse import (
    INIT_WORDS_RE,
    CommState,
    LogParser,
    Proc,
    Who,
)

__all__ = ["NcclLogError", "analyze_files", "analyze_lines", "main", "render_text"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_FOUND = 2


class NcclLogError(Exception):
    """The input cannot be analysed (missing file, no NCCL lines); the message says why."""


def _summarize(parser: LogParser) -> dict[str, Any]:
    """What ``parser`` read, as the result dict (``files``, ``ranks``, ``communicators``,
    ``behind``, ``messages``, ``notes``, ``found``); this also attributes the pending lines."""
    if parser.nccl_lines == 0:
        raise NcclLogError(
            "no NCCL log lines ('host:pid:tid [dev] NCCL INFO ...') in "
            + ", ".join(parser.files)
            + "; run the job with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL"
        )
    notes = parser.resolve_ranks()
    _attribute_pending(parser)
    procs = sorted(
        parser.procs.values(),
        key=lambda p: (p.rank is None, p.rank if p.rank is not None else 0, p.host, p.pid),
    )
    communicators, behind = _communicators(parser, procs)
    messages = _messages(parser)
    if parser.coll_lines == 0:
        notes.append(
            "no COLL lines: set NCCL_DEBUG_SUBSYS=INIT,COLL (with NCCL_DEBUG=INFO) to see "
            "which collective each rank issued last"
        )
    return {
        "files": parser.files,
        "ranks": [_rank_row(p) for p in procs],
        "communicators": communicators,
        "behind": behind,
        "messages": messages,
        "notes": notes,
        "found": bool(behind or messages),
    }


def _attribute_pending(parser: LogParser) -> None:
    """torch's and Python's error lines: to the process of their rank or file where one is known."""
    for name, rank, level, msg, src in parser.pending:
        who: Who
        if rank is not None:
            owner = [k for k, p in parser.procs.items() if p.rank == rank]
            who = owner[0] if len(owner) == 1 else f"rank {rank}"
        elif len(parser.file_procs.get(name, [])) == 1:
            who = parser.file_procs[name][0]
        else:
            who = f"file {name}"
        if isinstance(who, tuple):
            parser.procs[who].warn_count += 1
        parser.add_msg(level, "init" if INIT_WORDS_RE.search(msg) else "error", msg, src, who)


def _communicators(
    parser: LogParser, procs: Sequence[Proc]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Communicators across processes, and the ranks behind on each; notes failed inits."""
    comms: dict[str, list[tuple[Proc, CommState]]] = {}
    for p in procs:
        for key, st in p.comms.items():
            comms.setdefault(key, []).append((p, st))
    communicators = []
    behind = []
    for key, members in comms.items():
        counts = [st.last_count for _, st in members if st.last_count is not None]
        top_count = max(counts) if counts else None
        max_hex = None if top_count is None else f"{top_count:x}"
        top = max(st.issued for _, st in members)
        communicators.append(
            {
                "comm": key,
                "nranks": next((st.nranks for _, st in members if st.nranks), None),
                "ranks": [p.rank for p, _ in members],
                "max_op_count": max_hex,
                "max_issued": top,
            }
        )
        if top > 0:
            behind += [_behind_row(key, p, st, max_hex, top) for p, st in members if st.issued < top]
        started = [p for p, st in members if st.init_started and not st.init_complete]
        if started and any(st.init_complete for _, st in members):
            for p in started:
                parser.add_msg(
                    "ERROR", "init", f"communicator {key}: Init START without Init COMPLETE",
                    "", (p.host, p.pid),
                )
    return communicators, behind


def _behind_row(key: str, p: Proc, st: CommState, max_hex: str | None, top: int) -> dict[str, Any]:
    return {
        "comm": key,
        "rank": p.rank,
        "host": p.host,
        "pid": p.pid,
        "last_op_count": st.last_count_hex,
        "last_op": st.last_op,
        "max_op_count": max_hex,
        "issued": st.issued,
        "max_issued": top,
        "ops_behind": top - st.issued,
    }


def _messages(parser: LogParser) -> list[dict[str, Any]]:
    messages = []
    for m in parser.msgs.values():
        ranks: list[int] = []
        others: list[str] = []
        for w in m.procs:
            if isinstance(w, tuple) and parser.procs[w].rank is not None:
                ranks.append(parser.procs[w].rank)  # type: ignore[arg-type]
            else:
                others.append(parser.procs[w].label if isinstance(w, tuple) else w)
        messages.append(
            {
                "level": m.level,
                "kind": m.kind,
                "message": m.message,
                "source": m.source,
                "ranks": sorted(set(ranks)),
                "unattributed": others,
                "count": m.count,
            }
        )
    return messages


def _rank_row(p: Proc) -> dict[str, Any]:
    return {
        "rank": p.rank,
        "rank_source": p.rank_source,
        "host": p.host,
        "pid": p.pid,
        "label": f"rank {p.rank}" if p.rank is not None else p.label,
        "files": p.files,
        "comms": [
            {
                "comm": st.key,
                "nranks": st.nranks,
                "comm_rank": st.comm_rank,
                "last_op_count": st.last_count_hex,
                "last_op": st.last_op,
                "coll_lines": st.coll_lines,
            }
            for st in p.comms.values()
        ],
        "warn_count": p.warn_count,
    }


def analyze_lines(named_lines: Iterable[tuple[str, Iterable[str]]]) -> dict[str, Any]:
    """Analyse log text: ``named_lines`` yields ``(file name, lines)``; returns the result dict.

    Raises ``NcclLogError`` when no NCCL line is found. See the module docstring for the rules.
    """
    parser = LogParser()
    for name, lines in named_lines:
        parser.feed(name, lines)
    return _summarize(parser)


def analyze_files(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Analyse NCCL log files (streamed, so multi-GB logs are fine); see ``analyze_lines``.

    Raises ``NcclLogError`` for a missing or unreadable file or when no file has NCCL lines.
    """
    parser = LogParser()
    for path in paths:
        p = Path(path)
        try:
            with p.open(encoding="utf-8", errors="replace") as f:
                parser.feed(str(path), f)
        except IsADirectoryError:
            raise NcclLogError(f"{path} is a directory; pass the log files (e.g. {path}/*.log)") from None
        except OSError as e:
            raise NcclLogError(f"cannot read {path}: {e.strerror or e}") from None
    return _summarize(parser)


def render_text(result: dict[str, Any]) -> str:
    """The result as plain text: one line per rank, then the ranks behind, grouped messages."""
    out: list[str] = []
    n_ranks = len(result["ranks"])
    out.append(
        f"NCCL logs: {len(result['files'])} file(s), {n_ranks} rank(s), "
        f"{len(result['communicators'])} communicator(s)"
    )
    rows = []
    for r in result["ranks"]:
        comms = "; ".join(
            f"{c['comm']}: "
            + (f"{c['last_op']} opCount 0x{c['last_op_count']}" if c["last_op_count"] else "no COLL")
            for c in r["comms"]
        )
        rows.append(
            [
                "?" if r["rank"] is None else r["rank"],
                r["rank_source"],
                f"{r['host']}:{r['pid']}",
                comms or "-",
                r["warn_count"],
            ]
        )
    out.append(tabulate(rows, headers=["rank", "rank from", "host:pid", "last collective per comm",
                                       "WARN/ERROR"]))
    out.append("")
    if result["behind"]:
        out.append("Ranks behind (they never issued the next collective the others did):")
        for b in result["behind"]:
            who = f"rank {b['rank']}" if b["rank"] is not None else f"{b['host']}:{b['pid']}"
            last = f"last {b['last_op']} opCount 0x{b['last_op_count']}" if b["last_op_count"] else "none"
            out.append(
                f"  {who} on {b['comm']}: issued {b['issued']} collectives ({last}), others issued "
                f"{b['max_issued']} (max opCount 0x{b['max_op_count']})"
            )
    else:
        out.append("Ranks behind: none")
    out.append("")
    if result["messages"]:
        out.append("WARN/ERROR lines and init failures (each message once):")
        for m in result["messages"]:
            who = []
            if m["ranks"]:
                who.append(f"{'rank' if len(m['ranks']) == 1 else 'ranks'} {format_ranks(m['ranks'])}")
            who.extend(m["unattributed"])
            kind = " init" if m["kind"] == "init" else ""
            src = f" {m['source']}" if m["source"] else ""
            out.append(f"  [{m['level']}{kind}] {', '.join(who)} (x{m['count']}){src}: {m['message']}")
    else:
        out.append("WARN/ERROR lines: none")
    for n in result["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out)


def build_parser() -> argparse.ArgumentParser:
    """The CLI's argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m debug_server.nccl_log",
        description="Summarise NCCL_DEBUG=INFO logs: last opCount per rank and communicator, the "
        "ranks behind, WARN/ERROR lines and init failures grouped.",
        epilog="exit status: 0 nothing found, 2 a rank behind or a WARN/ERROR, 1 unusable input",
    )
    p.add_argument("files", nargs="+", metavar="FILE", help="NCCL log files (NCCL_DEBUG_FILE output or stdout/stderr)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Analyse the given NCCL logs and print the summary (or ``--json``); returns the exit code.

    0: no rank behind and no WARN/ERROR; 2: something found; 1: unusable input (one line on
    stderr).
    """
    args = build_parser().parse_args(argv)
    try:
        result = analyze_files(args.files)
    except NcclLogError as e:
        print(f"nccl_log: error: {e}", file=sys.stderr)
        return EXIT_UNUSABLE
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(render_text(result))
    return EXIT_FOUND if result["found"] else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
