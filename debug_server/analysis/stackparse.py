"""Parse faulthandler-style stack dumps and summarize where a rank is.

Both our workers (``faulthandler.dump_traceback(all_threads=True)``) and PyTorch's C++ worker
(``dump_traceback``) produce the same text; ours (``debug_server.stacks``) add each frame's source line
under it, indented deeper, as ``traceback`` does::

    Thread 0x00007f3c... (most recent call first):
      File "/x/train.py", line 88 in hang_phase
        time.sleep(30)
      File "/x/train.py", line 120 in <module>
        main()

    Current thread 0x00007f3b... (most recent call first):
      File ".../threading.py", line 327 in wait

Frames are listed innermost first. faulthandler marks the thread that *made* the dump as
"Current thread"; in a debug server that is the server thread, never the training loop, so the
main thread is chosen by its outermost frame being ``<module>`` instead. Pure: no torch, and no
file reads: what a line says comes from the stack text (``Frame.source``), never from a source
file where the analysis happens to run.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

from debug_server.analysis.ranks import parse_rank_text

logger = logging.getLogger(__name__)

_THREAD_RE = re.compile(
    r"^(?P<current>Current thread|Thread|Stack)\s*(?P<tid>0x[0-9a-fA-F]+)?[^(]*\(most recent call first\):\s*$"
)
_FRAME_RE = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.+?)\s*$')
# A native frame, as ``pyspy`` writes py-spy's ``--native`` frames into this layout.
_NATIVE_RE = re.compile(r'^\s+Native "(?P<file>.*)"(?:, line (?P<line>\d+))? in (?P<func>.+?)\s*$')

# Function names that mean "this thread is inside a collective or waiting for one".
COLLECTIVE_NAMES = frozenset(
    {
        "all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced",
        "broadcast", "broadcast_object_list", "reduce", "barrier", "monitored_barrier",
        "all_gather", "allgather", "all_gather_single", "all_gather_into_tensor",
        "_all_gather_base", "all_gather_object", "reduce_scatter", "reduce_scatter_tensor",
        "reduce_scatter_single", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
        "alltoall", "alltoall_base", "gather", "scatter", "gather_object", "scatter_object_list",
        "send", "recv", "isend", "irecv", "batch_isend_irecv", "wait", "synchronize",
    }
)  # fmt: skip
# "wait" in these stdlib files is a lock or a queue, not a collective.
_NOT_COLLECTIVE_FILES = ("threading.py", "queue.py", "selectors.py", "subprocess.py")
_NOT_COLLECTIVE_DIRS = ("/asyncio/", "/concurrent/", "/multiprocessing/")
_CALL_RE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")


@dataclass(slots=True)
class Frame:
    """One stack frame as faulthandler prints it."""

    filename: str
    line: int
    function: str
    native: bool = False
    """A C/C++ frame (py-spy ``--native``): ``filename`` is the library or source file."""
    source: str | None = None
    """The frame's source line as the rank read it (``debug_server.stacks``); None when not shipped."""


@dataclass(slots=True)
class Thread:
    """One thread of a dump; ``frames`` innermost first, as printed."""

    ident: str
    current: bool
    frames: list[Frame] = field(default_factory=list)


@dataclass(slots=True)
class Position:
    """Where a rank's main thread is: what a person reads in a verdict."""

    summary: str
    """Short form, e.g. ``all_reduce at train.py:148`` or ``time.sleep at demo.py:88``."""
    position: str
    """``file:line function`` of the frame that matters (the user's line)."""
    in_collective: bool
    """True when any frame is a collective/wait call or lives in torch.distributed or comms.py."""
    call: str | None
    """The call on the frame's shipped source line (``time.sleep``), else None."""
    native: str | None = None
    """The innermost named native frame (``clock_nanosleep``) when the stack has native frames."""
    leaving: str | None = None
    """Set when the thread is tearing down rather than working: ``it is tearing down its
    groups (destroy_process_group)`` or ``the interpreter is exiting (threading._shutdown)``."""


def parse_threads(text: str) -> list[Thread]:
    """Split faulthandler text into threads; unknown lines are ignored, never an error."""
    threads: list[Thread] = []
    cur: Thread | None = None
    frame_indent = -1  # indent of the Python frame line just read; -1: the last line was none
    for raw in text.splitlines():
        m = _THREAD_RE.match(raw.strip()) if not raw.startswith(" ") else None
        if m:
            cur = Thread(ident=m.group("tid") or "", current=m.group("current") == "Current thread")
            threads.append(cur)
            frame_indent = -1
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        if cur is not None and 0 <= frame_indent < indent and raw.strip():
            # The source line under a frame (whatever it says, even 'File "x", line 1 in f').
            cur.frames[-1].source = raw.strip()
            frame_indent = -1
            continue
        frame_indent = -1
        fm = _FRAME_RE.match(raw)
        nm = None if fm else _NATIVE_RE.match(raw)
        if fm or nm:
            if cur is None:
                # Frames without a header (a single-thread dump that lost its first line).
                cur = Thread(ident="", current=False)
                threads.append(cur)
            if fm:
                cur.frames.append(Frame(fm.group("file"), int(fm.group("line")), fm.group("func")))
                frame_indent = indent
            elif nm:
                cur.frames.append(Frame(nm.group("file"), int(nm.group("line") or 0),
                                        nm.group("func"), native=True))
    return threads


def python_frames(frames: list[Frame]) -> list[Frame]:
    """The Python frames of a stack (native ones, from py-spy ``--native``, left out)."""
    return [f for f in frames if not f.native]


def main_thread(threads: list[Thread]) -> Thread | None:
    """The training thread: outermost Python frame is ``<module>``; prefer one that did not dump."""
    with_module = [t for t in threads
                   if (py := python_frames(t.frames)) and py[-1].function == "<module>"]
    for pool in (
        [t for t in with_module if not t.current],
        with_module,
        [t for t in threads if t.frames and not t.current],
        [t for t in threads if t.frames],
    ):
        if pool:
            return pool[0]
    return None


def is_library_frame(frame: Frame) -> bool:
    """True for frames of the communication stack (torch.distributed, our comms wrapper)."""
    f = frame.filename.replace("\\", "/")
    return "torch/distributed/" in f or f.endswith("debug_server/recording/comms.py")


def is_collective_frame(frame: Frame) -> bool:
    """True when this frame means the thread is in (or waiting for) a collective."""
    if is_library_frame(frame):
        return True
    if frame.function not in COLLECTIVE_NAMES:
        return False
    f = frame.filename.replace("\\", "/")
    return not (f.endswith(_NOT_COLLECTIVE_FILES) or any(d in f for d in _NOT_COLLECTIVE_DIRS))


def _source_call(frame: Frame) -> str | None:
    # The innermost Python frame of a sleeping thread is the caller of time.sleep (a C function
    # faulthandler cannot show); the source line the rank shipped names it.
    calls = _CALL_RE.findall(frame.source) if frame.source else []
    return calls[0] if calls else None


def summarize(frames: list[Frame]) -> Position:
    """Summarize a thread's frames (innermost first) as a :class:`Position`.

    The position is that of the Python frames; native frames (py-spy ``--native``) add the
    innermost named C function: ``usleep at hold.py:6 in clock_nanosleep (libc.so.6)``.
    """
    native = next((f for f in frames if f.native and f.function != "??"), None)
    pos = _summarize_python(python_frames(frames))
    if native is None:
        return pos
    return Position(f"{pos.summary} in {native.function} ({native.filename})", pos.position,
                    pos.in_collective, pos.call, native.function)


def _summarize_python(frames: list[Frame]) -> Position:
    if not frames:
        return Position("no Python frame", "?", False, None)
    leaving = _leaving(frames)
    if leaving is not None:
        what, i = leaving
        user = next((f for f in frames[i + 1:] if not is_library_frame(f)), frames[i])
        where = f"{os.path.basename(user.filename)}:{user.line}"
        return Position(f"{frames[i].function} at {where}", f"{where} {user.function}", False,
                        frames[i].function, leaving=what)
    in_coll = any(is_collective_frame(f) for f in frames)
    if in_coll:
        # Report the user's line that called into the collective, named by the collective.
        lib_idx = [i for i, f in enumerate(frames) if is_collective_frame(f)]
        outer = max(lib_idx)
        user = frames[outer + 1] if outer + 1 < len(frames) else frames[outer]
        named = [frames[i].function for i in lib_idx if frames[i].function in COLLECTIVE_NAMES]
        op = named[-1] if named else frames[outer].function
        where = f"{os.path.basename(user.filename)}:{user.line}"
        return Position(f"{op} at {where}", f"{where} {user.function}", True, op)
    top = frames[0]
    where = f"{os.path.basename(top.filename)}:{top.line}"
    call = _source_call(top)
    summary = f"{call} at {where}" if call else f"{top.function} at {where}"
    return Position(summary, f"{where} {top.function}", False, call)


# Frames that mean the thread is leaving, not working: a rank here while its peers wait in a
# collective is tearing down (after an error, or at a normal end others did not reach).
_LEAVING = {
    "destroy_process_group": "it is tearing down its process groups (destroy_process_group)",
    "_shutdown": "the interpreter is exiting (it waits for threads at exit)",
    "_run_exitfuncs": "the interpreter is exiting (atexit handlers)",
}


def _leaving(frames: list[Frame]) -> tuple[str, int] | None:
    for i, f in enumerate(frames):
        what = _LEAVING.get(f.function)
        if what is not None and (f.function != "_shutdown" or f.filename.endswith("threading.py")):
            return what, i
    return None


def summarize_text(text: str) -> Position | None:
    """Parse one rank's stack text and summarize its main thread (None if nothing parsed)."""
    t = main_thread(parse_threads(text))
    if t is None:
        return None
    return summarize(t.frames)


_SECTION_RE = re.compile(r"^=== Rank (\d+)(?::[^\n]*?)? ===\s*$")
_GROUP_RE = re.compile(r"^=== Ranks ([0-9][0-9, \-]*(?:, \.\.\. \(\d+ ranks in all\))?) "
                       r"\((\d+) ranks\) ===\s*$")
_GROUP_FAILED_RE = re.compile(r"^ranks [0-9][0-9, \-]*: (.+)$")
MAX_RANK = 1 << 20


def split_stacks_file(text: str) -> dict[int, str]:
    """Split a ``stacks_<ts>.txt`` file into rank -> that rank's faulthandler text.

    Sections start with ``=== Rank N ===`` or ``=== Rank N: <addr> ===``; text before the first
    section is ignored. A section of ranks alike (``=== Ranks 0-77776, 77778-131071 (131071
    ranks) ===``, ``frontend.dumps.stacks_file``) gives each of its ranks its text (one ``str``
    shared by all), and a failure line of ranks alike (``ranks 100-199: unreachable ...``)
    becomes each rank's own (``rank 100: unreachable ...``). A heading whose ranges do not
    parse, or do not count what it says, is skipped with its section.
    """
    out: dict[int, list[str]] = {}
    groups: list[tuple[list[int], list[str]]] = []
    cur: list[str] | None = None
    for line in text.splitlines():
        m = _SECTION_RE.match(line)
        if m:
            cur = out.setdefault(int(m.group(1)), [])
            continue
        g = _GROUP_RE.match(line) if line.startswith("=== Ranks ") else None
        if g:
            cur = None
            try:
                ranks = parse_rank_text(g.group(1), "stacks section", MAX_RANK)
            except ValueError:
                continue
            if len(ranks) == int(g.group(2)):
                cur = []
                groups.append((ranks, cur))
            continue
        if cur is not None:
            cur.append(line)
    texts = {r: "\n".join(lines).strip("\n") + "\n" for r, lines in out.items()}
    for ranks, lines in groups:
        body = "\n".join(lines).strip("\n") + "\n"
        failed = _GROUP_FAILED_RE.match(body.strip()) if "\n" not in body.strip() else None
        for r in ranks:
            if r not in texts:
                texts[r] = f"rank {r}: {failed.group(1)}\n" if failed else body
    return texts
