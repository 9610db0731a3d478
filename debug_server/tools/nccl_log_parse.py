"""Reading NCCL_DEBUG=INFO lines into per-process state, for ``tools/nccl_log.py``.

:class:`LogParser` takes the lines of each file and keeps, per process (host and pid): the last
opCount and op per communicator, the init lines, the ``[rankN]:`` prefixes and devices seen, and
every WARN/ERROR message once with who printed it. :meth:`LogParser.resolve_ranks` then gives
each process its rank by the rules in ``nccl_log``'s docstring. What the result says, and how it
is printed, is ``nccl_log``'s.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

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
INIT_WORDS_RE = re.compile(r"bootstrap|ncclCommInit|\binit\b|socket interface|Init FAILED", re.I)
"""A message about communicator setup (reported as an init failure)."""
_FILE_RANK_RE = re.compile(r"(?:^|[^a-z])rank[_\-.]?(\d+)", re.IGNORECASE)
_NUM_RE = re.compile(r"\d+")

Who = tuple[str, int] | str
"""Who printed a message: a process (host, pid), or a description ("rank 3", "file x.log")."""


@dataclass(slots=True)
class CommState:  # one process's view of one communicator
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
class Proc:
    """One process (host and pid) and what its lines said."""

    host: str
    pid: int
    files: list[str] = field(default_factory=list)
    devs: set[int] = field(default_factory=set)
    prefix_ranks: set[int] = field(default_factory=set)
    global_ranks: set[int] = field(default_factory=set)
    ptr_to_key: dict[str, str] = field(default_factory=dict)
    comms: dict[str, CommState] = field(default_factory=dict)
    init_order: list[tuple[str, int, int]] = field(default_factory=list)  # (key, rank, nranks)
    warn_count: int = 0
    rank: int | None = None
    rank_source: str = "unknown"

    @property
    def label(self) -> str:
        return f"{self.host}:{self.pid}"

    def comm(self, key: str) -> CommState:
        st = self.comms.get(key)
        if st is None:
            st = self.comms[key] = CommState(key)
        return st


@dataclass(slots=True)
class Msg:
    """One distinct WARN/ERROR message and who printed it."""

    level: str
    kind: str
    message: str
    source: str
    procs: list[Who] = field(default_factory=list)
    count: int = 0


class LogParser:
    """The state of every process in the logs fed so far."""

    def __init__(self) -> None:
        self.procs: dict[tuple[str, int], Proc] = {}
        self.msgs: dict[tuple[str, str], Msg] = {}
        self.nccl_lines = 0
        self.coll_lines = 0
        self.files: list[str] = []
        self.file_procs: dict[str, list[tuple[str, int]]] = {}
        # Non-NCCL error lines, attributed once the file's processes are known.
        self.pending: list[tuple[str, int | None, str, str, str]] = []

    def feed(self, name: str, lines: Iterable[str]) -> None:
        """Read one file's lines (``name`` is how the file is reported)."""
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
                proc = self.procs[pkey] = Proc(m["host"], int(m["pid"]))
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
                init = src.split(":")[0] in _INIT_SOURCES or bool(INIT_WORDS_RE.search(msg))
                self.add_msg(level, "init" if init else "warn", msg, src, pkey)
            elif level == "INFO":
                cm = _COLL_RE.match(msg)
                if cm:
                    self._coll_line(proc, msg, cm)
                elif im := _INIT_RE.search(msg):
                    self._init_line(proc, msg, im)
        self.file_procs[name] = list(seen)

    def _coll_line(self, proc: Proc, msg: str, cm: re.Match[str]) -> None:
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
        st = proc.comm(key)
        if nr and st.nranks is None:
            st.nranks = int(nr["n"])
        count = int(cm["count"], 16)
        st.coll_lines += 1
        # The maximum, not the last line: interleaved threads may print out of order.
        if st.last_count is None or count >= st.last_count:
            st.last_count = count
            st.last_count_hex = cm["count"].lower()
            st.last_op = cm["op"]

    def _init_line(self, proc: Proc, msg: str, im: re.Match[str]) -> None:
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
        st = proc.comm(key)
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

    def add_msg(self, level: str, kind: str, msg: str, src: str, who: Who) -> None:
        """Count one more ``msg``, and ``who`` among those who printed it."""
        entry = self.msgs.get((level, msg))
        if entry is None:
            entry = self.msgs[(level, msg)] = Msg(level, kind, msg, src)
        entry.count += 1
        if who not in entry.procs:
            entry.procs.append(who)

    def resolve_ranks(self) -> list[str]:
        """Give every process its rank (``Proc.rank``, ``rank_source``); returns notes."""
        for name, pkeys in self.file_procs.items():
            if len(pkeys) == 1:
                proc = self.procs[pkeys[0]]
                fr = rank_from_filename(name, proc.pid)
                if fr is not None and proc.rank is None:
                    proc.rank, proc.rank_source = fr, "file name"
        for proc in self.procs.values():
            _rank_from_lines(proc)
        notes: list[str] = []
        hosts = {p.host for p in self.procs.values()}
        if len(hosts) > 1 and any(p.rank_source == "device" for p in self.procs.values()):
            notes.append(
                "some ranks are taken from the [device] field, which is the local GPU and repeats "
                "across hosts; log with NCCL_DEBUG_SUBSYS=INIT,COLL so init lines give the ranks"
            )
        by_rank: dict[int, list[Proc]] = {}
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


def _rank_from_lines(proc: Proc) -> None:
    """globalrank, else the largest communicator's init line, else the prefix, else the device."""
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


def rank_from_filename(name: str, pid: int) -> int | None:
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
