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
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tabulate import tabulate

from debug_server.analysis.core import format_ranks

__all__ = ["NcclLogError", "analyze_files", "analyze_lines", "main", "render_text"]

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_FOUND = 2

# NCCL's line prefix: "host:pid:tid [cudaDev] NCCL INFO " and, for WARN, "host:pid:tid [cudaDev]
# file.cc:123 NCCL WARN " (debug.cc). Searched, not matched, so launcher prefixes such as
# "[rank3]:" or "[default0]:" in front do not hide the line.
_NCCL_RE = re.compile(
    r"(?P<host>[^\s:\[\]]+):(?P<pid>\d+):(?P<tid>\d+) \[(?P<dev>\d+)\] "
    r"(?:(?P<src>[\w.\-/]+:\d+) )?NCCL (?P<level>INFO|WARN|ABORT|TRACE|ERROR)\b ?(?P<msg>.*)$"
)
_RANK_PREFIX_RE = re.compile(r"^\s*\[rank(?P<rank>\d+)\]:")
_COLL_RE = re.compile(r"^(?P<op>[A-Za-z]\w*): opCount (?P<count>[0-9a-fA-F]+)\b")
_COMM_PTR_RE = re.compile(r"\bcomm (?P<ptr>0x[0-9a-fA-F]+)")
_COMM_HASH_RE = re.compile(r"\b(?:commHash|commId) (?P<hash>(?:0x)?[0-9a-fA-F]+)")
_NRANKS_RE = re.compile(r"\[nranks=(?P<n>\d+)\]")
_GLOBALRANK_RE = re.compile(r"\bglobalrank (?P<rank>\d+)")
_INIT_RE = re.compile(
    r"\bcomm (?P<ptr>0x[0-9a-fA-F]+) rank (?P<rank>\d+) nranks (?P<nranks>\d+)", re.IGNORECASE
)
# torch's own error lines ("[rank0]:[E1120 10:00:00.123 ProcessGroupNCCL.cpp:632] [PG ID 0 ...]
# Watchdog caught collective operation timeout ...") and the Python exceptions NCCL raises.
_TORCH_ERR_RE = re.compile(r"^\s*(?:\[rank\d+\]:)?\[E\d{4} [^\]]*\] (?P<msg>.*)$")
_PY_ERR_RE = re.compile(r"^\s*(?:\[rank\d+\]:)?\s*(?P<msg>[\w.]*(?:Error|Exception): .*)$")
# Per-rank decorations that make otherwise identical messages differ.
_RANK_NOISE_RE = re.compile(r"\[(?:PG ID [^\]]*|Rank \d+)\]\s*")
_INIT_SOURCES = ("init.cc", "bootstrap.cc", "socket.cc", "net_socket.cc", "transport.cc")
_INIT_WORDS_RE = re.compile(r"bootstrap|ncclCommInit|\binit\b|socket interface|Init FAILED", re.I)
_FILE_RANK_RE = re.compile(r"(?:^|[^a-z])rank[_\-.]?(\d+)", re.IGNORECASE)
_NUM_RE = re.compile(r"\d+")


class NcclLogError(Exception):
    """The input cannot be analysed (missing file, no NCCL lines); the message says why."""


@dataclass(slots=True)
class _CommState:
    key: str
    nranks: int | None = None
    comm_rank: int | None = None
    last_count: int | None = None
    last_count_hex: str | None = None
    last_op: str | None = None
    coll_lines: int = 0
    init_started: bool = False
    init_complete: bool = False

    @property
    def issued(self) -> int:
        """How many collectives this rank issued on the communicator.

        The larger of the last opCount + 1 and the number of COLL lines: older NCCL counts
        opCount up per collective, NCCL 2.28 prints ``opCount 0`` on every line (seen on H200
        hosts), and a log cut at the start has fewer lines than opCounts.
        """
        return max((self.last_count + 1) if self.last_count is not None else 0, self.coll_lines)


@dataclass(slots=True)
class _Proc:
    host: str
    pid: int
    files: list[str] = field(default_factory=list)
    devs: set[int] = field(default_factory=set)
    prefix_ranks: set[int] = field(default_factory=set)
    global_ranks: set[int] = field(default_factory=set)
    ptr_to_key: dict[str, str] = field(default_factory=dict)
    comms: dict[str, _CommState] = field(default_factory=dict)
    init_order: list[tuple[str, int, int]] = field(default_factory=list)  # (key, rank, nranks)
    warn_count: int = 0
    rank: int | None = None
    rank_source: str = "unknown"

    @property
    def label(self) -> str:
        return f"{self.host}:{self.pid}"


@dataclass(slots=True)
class _Msg:
    level: str
    kind: str
    message: str
    source: str
    procs: list[tuple[str, int] | str] = field(default_factory=list)
    count: int = 0


class _Analyzer:
    def __init__(self) -> None:
        self.procs: dict[tuple[str, int], _Proc] = {}
        self.msgs: dict[tuple[str, str], _Msg] = {}
        self.nccl_lines = 0
        self.coll_lines = 0
        self.files: list[str] = []
        self.file_procs: dict[str, list[tuple[str, int]]] = {}
        # Non-NCCL error lines, attributed once the file's processes are known.
        self.pending: list[tuple[str, int | None, str, str, str]] = []

    # -- parsing -----------------------------------------------------------------------------

    def feed(self, name: str, lines: Iterable[str]) -> None:
        self.files.append(name)
        seen: dict[tuple[str, int], None] = {}
        for line in lines:
            if "NCCL" not in line and "[E" not in line and "Error" not in line:
                continue
            m = _NCCL_RE.search(line)
            if m is None:
                self._other_line(name, line)
                continue
            self.nccl_lines += 1
            pkey = (m["host"], int(m["pid"]))
            proc = self.procs.get(pkey)
            if proc is None:
                proc = self.procs[pkey] = _Proc(m["host"], int(m["pid"]))
            if pkey not in seen:
                seen[pkey] = None
                if name not in proc.files:
                    proc.files.append(name)
            proc.devs.add(int(m["dev"]))
            pm = _RANK_PREFIX_RE.match(line)
            if pm:
                proc.prefix_ranks.add(int(pm["rank"]))
            level, msg = m["level"], m["msg"].strip()
            if level in ("WARN", "ABORT", "ERROR"):
                proc.warn_count += 1
                src = m["src"] or ""
                init = src.split(":")[0] in _INIT_SOURCES or bool(_INIT_WORDS_RE.search(msg))
                self._add_msg(level, "init" if init else "warn", msg, src, pkey)
            elif level == "INFO":
                self._info(proc, msg)
        self.file_procs[name] = list(seen)

    def _info(self, proc: _Proc, msg: str) -> None:
        cm = _COLL_RE.match(msg)
        if cm:
            self.coll_lines += 1
            gm = _GLOBALRANK_RE.search(msg)
            if gm:
                proc.global_ranks.add(int(gm["rank"]))
            ptr_m = _COMM_PTR_RE.search(msg)
            ptr = ptr_m["ptr"].lower() if ptr_m else None
            key = proc.ptr_to_key.get(ptr) if ptr else None
            nr = _NRANKS_RE.search(msg)
            if key is None:
                hm = _COMM_HASH_RE.search(msg)
                if hm:
                    key = f"commHash {hm['hash'].lower()}"
                elif nr:
                    key = f"nranks={nr['n']}#0"
                else:
                    key = "comm ?"
                if ptr:
                    proc.ptr_to_key[ptr] = key
            st = proc.comms.get(key)
            if st is None:
                st = proc.comms[key] = _CommState(key)
            if nr and st.nranks is None:
                st.nranks = int(nr["n"])
            count = int(cm["count"], 16)
            st.coll_lines += 1
            # The maximum, not the last line: interleaved threads may print out of order.
            if st.last_count is None or count >= st.last_count:
                st.last_count = count
                st.last_count_hex = cm["count"].lower()
                st.last_op = cm["op"]
            return
        im = _INIT_RE.search(msg)
        if im:
            ptr = im["ptr"].lower()
            rank, nranks = int(im["rank"]), int(im["nranks"])
            key = proc.ptr_to_key.get(ptr)
            if key is None:
                hm = _COMM_HASH_RE.search(msg)
                if hm:
                    key = f"commId {hm['hash'].lower()}"
                else:
                    # No id printed: the k-th communicator of this size in each process is taken
                    # to be the same communicator (creation order is the same on every rank).
                    k = sum(1 for _, _, n in proc.init_order if n == nranks)
                    key = f"nranks={nranks}#{k}"
                proc.ptr_to_key[ptr] = key
                proc.init_order.append((key, rank, nranks))
            st = proc.comms.get(key)
            if st is None:
                st = proc.comms[key] = _CommState(key)
            st.nranks, st.comm_rank = nranks, rank
            if "Init START" in msg:
                st.init_started = True
            if "Init COMPLETE" in msg:
                st.init_complete = True

    def _other_line(self, name: str, line: str) -> None:
        m = _TORCH_ERR_RE.match(line) or _PY_ERR_RE.match(line)
        if m is None:
            return
        msg = m["msg"].strip()
        if m.re is _PY_ERR_RE and not re.search(r"nccl|c10d|Dist\w*Error", msg, re.I):
            return
        pm = _RANK_PREFIX_RE.match(line)
        self.pending.append(
            (name, int(pm["rank"]) if pm else None, "ERROR", _RANK_NOISE_RE.sub("", msg), "")
        )

    def _add_msg(
        self, level: str, kind: str, msg: str, src: str, who: tuple[str, int] | str
    ) -> None:
        entry = self.msgs.get((level, msg))
        if entry is None:
            entry = self.msgs[(level, msg)] = _Msg(level, kind, msg, src)
        entry.count += 1
        if who not in entry.procs:
            entry.procs.append(who)

    # -- resolution --------------------------------------------------------------------------

    def _resolve_ranks(self) -> list[str]:
        notes: list[str] = []
        for name, pkeys in self.file_procs.items():
            if len(pkeys) == 1:
                proc = self.procs[pkeys[0]]
                fr = _rank_from_filename(name, proc.pid)
                if fr is not None and proc.rank is None:
                    proc.rank, proc.rank_source = fr, "file name"
        for proc in self.procs.values():
            from_init = None
            if proc.init_order:
                biggest = max(n for _, _, n in proc.init_order)
                from_init = next(r for _, r, n in proc.init_order if n == biggest)
            if len(proc.global_ranks) == 1:
                proc.rank, proc.rank_source = next(iter(proc.global_ranks)), "globalrank"
            elif from_init is not None:
                proc.rank, proc.rank_source = from_init, "init"
            elif len(proc.prefix_ranks) == 1:
                proc.rank, proc.rank_source = next(iter(proc.prefix_ranks)), "[rank] prefix"
            elif proc.rank is None and len(proc.devs) == 1:
                proc.rank, proc.rank_source = next(iter(proc.devs)), "device"
        hosts = {p.host for p in self.procs.values()}
        if len(hosts) > 1 and any(p.rank_source == "device" for p in self.procs.values()):
            notes.append(
                "some ranks are taken from the [device] field, which is the local GPU and repeats "
                "across hosts; log with NCCL_DEBUG_SUBSYS=INIT,COLL so init lines give the ranks"
            )
        by_rank: dict[int, list[_Proc]] = {}
        for p in self.procs.values():
            if p.rank is not None:
                by_rank.setdefault(p.rank, []).append(p)
        for r, ps in sorted(by_rank.items()):
            if len(ps) > 1:
                notes.append(
                    f"rank {r} is claimed by several processes "
                    f"({', '.join(p.label for p in ps)}); they are listed separately"
                )
        return notes

    def result(self) -> dict[str, Any]:
        if self.nccl_lines == 0:
            raise NcclLogError(
                "no NCCL log lines ('host:pid:tid [dev] NCCL INFO ...') in "
                + ", ".join(self.files)
                + "; run the job with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL"
            )
        notes = self._resolve_ranks()
        for name, rank, level, msg, src in self.pending:
            who: tuple[str, int] | str
            if rank is not None:
                owner = [k for k, p in self.procs.items() if p.rank == rank]
                who = owner[0] if len(owner) == 1 else f"rank {rank}"
            elif len(self.file_procs.get(name, [])) == 1:
                who = self.file_procs[name][0]
            else:
                who = f"file {name}"
            if isinstance(who, tuple):
                self.procs[who].warn_count += 1
            self._add_msg(level, "init" if _INIT_WORDS_RE.search(msg) else "error", msg, src, who)

        procs = sorted(
            self.procs.values(),
            key=lambda p: (p.rank is None, p.rank if p.rank is not None else 0, p.host, p.pid),
        )

        def who_label(p: _Proc) -> str:
            return f"rank {p.rank}" if p.rank is not None else p.label

        # Communicators across processes.
        comms: dict[str, list[tuple[_Proc, _CommState]]] = {}
        for p in procs:
            for key, st in p.comms.items():
                comms.setdefault(key, []).append((p, st))
        communicators = []
        behind = []
        for key, members in comms.items():
            counts = [st.last_count for _, st in members if st.last_count is not None]
            nranks = next((st.nranks for _, st in members if st.nranks), None)
            top_count = max(counts) if counts else None
            top = max(st.issued for _, st in members)
            communicators.append(
                {
                    "comm": key,
                    "nranks": nranks,
                    "ranks": [p.rank for p, _ in members],
                    "max_op_count": None if top_count is None else f"{top_count:x}",
                    "max_issued": top,
                }
            )
            if top > 0:
                for p, st in members:
                    if st.issued < top:
                        behind.append(
                            {
                                "comm": key,
                                "rank": p.rank,
                                "host": p.host,
                                "pid": p.pid,
                                "last_op_count": st.last_count_hex,
                                "last_op": st.last_op,
                                "max_op_count": None if top_count is None else f"{top_count:x}",
                                "issued": st.issued,
                                "max_issued": top,
                                "ops_behind": top - st.issued,
                            }
                        )
            started = [p for p, st in members if st.init_started and not st.init_complete]
            if started and any(st.init_complete for _, st in members):
                for p in started:
                    self._add_msg(
                        "ERROR", "init", f"communicator {key}: Init START without Init COMPLETE",
                        "", (p.host, p.pid),
                    )

        messages = []
        for m in self.msgs.values():
            ranks: list[int] = []
            others: list[str] = []
            for w in m.procs:
                if isinstance(w, tuple) and self.procs[w].rank is not None:
                    ranks.append(self.procs[w].rank)  # type: ignore[arg-type]
                else:
                    others.append(self.procs[w].label if isinstance(w, tuple) else w)
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
        if self.coll_lines == 0:
            notes.append(
                "no COLL lines: set NCCL_DEBUG_SUBSYS=INIT,COLL (with NCCL_DEBUG=INFO) to see "
                "which collective each rank issued last"
            )
        ranks_out = [
            {
                "rank": p.rank,
                "rank_source": p.rank_source,
                "host": p.host,
                "pid": p.pid,
                "label": who_label(p),
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
            for p in procs
        ]
        return {
            "files": self.files,
            "ranks": ranks_out,
            "communicators": communicators,
            "behind": behind,
            "messages": messages,
            "notes": notes,
            "found": bool(behind or messages),
        }


def _rank_from_filename(name: str, pid: int) -> int | None:
    """``nccl_rank3.log`` -> 3; ``host.1234.3.log`` (a number after the pid) -> 3; else None."""
    stem = Path(name).name
    m = _FILE_RANK_RE.search(stem)
    if m:
        return int(m[1])
    nums = [int(n) for n in _NUM_RE.findall(stem)]
    if pid in nums:
        after = nums[nums.index(pid) + 1 :]
        if after:
            return after[0]
    return None


def analyze_lines(named_lines: Iterable[tuple[str, Iterable[str]]]) -> dict[str, Any]:
    """Analyse log text: ``named_lines`` yields ``(file name, lines)``; returns the result dict.

    Raises ``NcclLogError`` when no NCCL line is found. See the module docstring for the rules.
    """
    an = _Analyzer()
    for name, lines in named_lines:
        an.feed(name, lines)
    return an.result()


def analyze_files(paths: Sequence[str | Path]) -> dict[str, Any]:
    """Analyse NCCL log files (streamed, so multi-GB logs are fine); see ``analyze_lines``.

    Raises ``NcclLogError`` for a missing or unreadable file or when no file has NCCL lines.
    """
    an = _Analyzer()
    for path in paths:
        p = Path(path)
        try:
            with p.open(encoding="utf-8", errors="replace") as f:
                an.feed(str(path), f)
        except IsADirectoryError:
            raise NcclLogError(f"{path} is a directory; pass the log files (e.g. {path}/*.log)") from None
        except OSError as e:
            raise NcclLogError(f"cannot read {path}: {e.strerror or e}") from None
    return an.result()


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
