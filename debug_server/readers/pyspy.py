"""Stacks read from outside a rank with py-spy: the rank is never signalled, never interrupted.

A rank whose main thread holds the GIL inside a C call cannot run its worker thread, so its
own ``dump_traceback`` answer never comes. py-spy reads the interpreter's frames from another
process (``process_vm_readv``): with ``--nonblocking`` the rank is not even paused, and a
``usleep`` or ``poll`` it sits in sleeps its full time. With ``--native`` py-spy must pause the
rank while it unwinds the native stack (tens of milliseconds; the kernel restarts an
interrupted ``nanosleep``/``poll`` transparently, since no signal handler runs), so native
frames are read only when asked for (``/stacks?native=1``, ``/pyspy_dump``).

Who reads whom:

- The frontend (or its host's agent) reads the ranks on its own host (pid and host from their
  registration).
- A rank on another host is read by a worker on that host that still answers: the rank's
  own worker (``POST /handler/pyspy_dump``, torch's name and params: py-spy on itself from a
  child process), or, when that rank holds the GIL, another rank's worker on that host
  (``pyspy_dump?pid=<pid>``). A host where every rank holds the GIL has nobody left to ask.

Whom: only a pid that a rank of this job announced on this host, still the same process (start
time) and of the same user (``jobpids.check``), whatever the process tree looks like (ranks
under ``bash -c``, ``timeout``, ``numactl`` wrappers are cousins). Permissions: under Yama
``ptrace_scope=1`` (the Ubuntu default) only ancestors may ptrace, so every rank names its
host's reader as its tracer (``ptracer.PtracerKeeper``, ``prctl(PR_SET_PTRACER, pid)``);
``PTRACER_ENV=0`` skips it (``docs/settings.md``). ``ptrace_scope=2`` needs CAP_SYS_PTRACE, and a container
needs it too (``--cap-add SYS_PTRACE``). Every failure is one line with its fix.

The binary: ``$PYSPY_ENV`` (a path; ``0`` turns py-spy off), else ``py-spy`` on PATH,
else the one beside this interpreter (a venv's ``bin``, where ``pip install`` puts it).

py-spy's JSON is rewritten in faulthandler's layout so that every reader of stacks (grouping,
summaries, the verdict) reads it unchanged; a native frame is a line of its own::

    Thread 0x00007f9a41b0c740 [tid 11874, "MainThread", idle, holds the GIL] (most recent call first):
      Native "libc.so.6" in clock_nanosleep
      Native "callproc.c", line 943 in _call_function_pointer
      File "/x/train.py", line 88 in hang_phase
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import sysconfig
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from debug_server.config import PTRACER_ENV as PTRACER_ENV
from debug_server.config import PYSPY_ENV
from debug_server.protocol.names import NATIVE, NONBLOCKING, PID, PYSPY_HANDLER
from debug_server.readers import jobpids
from debug_server.stacks import with_source

logger = logging.getLogger(__name__)

HANDLER = PYSPY_HANDLER
"""The worker handler (torch's name): py-spy on this process, or on a sibling with ``pid=``."""
TIMEOUT_S = 1.0
"""Bound on one ``--nonblocking`` read (they take ~10 ms)."""
NATIVE_TIMEOUT_S = 10.0
"""Bound on one ``--native`` read (~0.1 s with torch on CPU; CUDA libraries have more symbols)."""
HELPER_SLACK_S = 0.5
"""What asking another worker to run py-spy may take beyond py-spy's own bound."""
MAX_OUTPUT = 8 * 1024 * 1024
MAX_PARALLEL = 8
"""py-spy processes the frontend runs at once."""

# Kinds of failure. UNAVAILABLE and NOT_PERMITTED are where the opt-in signal path may step in.
UNAVAILABLE = "unavailable"
NOT_PERMITTED = "not permitted"
GONE = "gone"
REFUSED = "refused"
FAILED = "failed"

_CAP_SYS_PTRACE = 19


class PySpyError(Exception):
    """A py-spy read that did not happen; ``str()`` is one line that says why and what to do."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason


# ---------------------------------------------------------------------------------------------
# Finding and running py-spy


# ``Settings.pyspy`` as this process's entry point read it (``use_setting``: the rank's
# ``start_debug_server``, the frontend's and the agent's ``main``); None: look for it.
_setting: str | None = None


def use_setting(setting: str | None) -> None:
    """Where py-spy is for this process (``Settings.pyspy``: a path, ``0`` for off, None: on
    ``PATH`` or next to Python); set once by the entry point."""
    global _setting
    _setting = setting


def locate(setting: str | None = None) -> str:
    """The py-spy binary to run (``setting``, else ``use_setting``'s, else found); raises
    ``PySpyError(UNAVAILABLE)`` with the fix."""
    explicit = setting if setting is not None else _setting
    if explicit == "0":
        raise PySpyError(UNAVAILABLE, f"py-spy is off (${PYSPY_ENV}=0)")
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return explicit
        raise PySpyError(UNAVAILABLE, f"py-spy not found at ${PYSPY_ENV}={explicit}: point it at "
                                      "the binary, or unset it and pip install py-spy")
    found = shutil.which("py-spy")
    if found:
        return found
    dirs = [d for d in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)) if d]
    for d in dict.fromkeys(dirs):
        cand = os.path.join(d, "py-spy")
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise PySpyError(UNAVAILABLE, f"py-spy not found (not on PATH, not in {dirs[0]}): "
                                  f"pip install py-spy, or set ${PYSPY_ENV}=/path/to/py-spy")


def _ptrace_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def permission_fix(pid: int) -> str:
    """One line: why ptrace of ``pid`` is refused here and what lets it through."""
    scope = _ptrace_scope()
    cap = _has_cap_sys_ptrace()
    if scope == 3:
        return (f"py-spy may not read pid {pid}: kernel.yama.ptrace_scope=3 forbids ptrace "
                "until reboot")
    if scope == 2 and not cap:
        return (f"py-spy may not read pid {pid}: kernel.yama.ptrace_scope=2 needs "
                "CAP_SYS_PTRACE (in a container: --cap-add SYS_PTRACE)")
    if scope == 1:
        return (f"py-spy may not read pid {pid}: kernel.yama.ptrace_scope=1 and the rank did "
                f"not name this reader as its tracer (prctl PR_SET_PTRACER; "
                f"${PTRACER_ENV}=0, a reader that restarted seconds ago, or an older "
                "debug_server?): set kernel.yama.ptrace_scope=0 or grant CAP_SYS_PTRACE")
    return (f"py-spy may not read pid {pid}: ptrace not permitted (another user's process, or "
            "a container without CAP_SYS_PTRACE: --cap-add SYS_PTRACE; Kubernetes: "
            "securityContext.capabilities.add [SYS_PTRACE])")


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("Error:"):
            return ln.removeprefix("Error:").strip()[:300]
    return lines[0][:300] if lines else "no output"


def explain(pid: int, rc: int, stderr: str) -> PySpyError:
    """Turn a failed py-spy run into one line with the fix."""
    low = stderr.lower()
    if "permission denied" in low or "operation not permitted" in low or "os error 1)" in low:
        return PySpyError(NOT_PERMITTED, permission_fix(pid))
    if not os.path.exists(f"/proc/{pid}"):
        return PySpyError(GONE, f"pid {pid} has exited")
    if "nonblocking" in low and "native" in low:
        return PySpyError(FAILED, "py-spy cannot read native frames without pausing the process")
    return PySpyError(FAILED, f"py-spy failed on pid {pid} (exit {rc}): {_first_error_line(stderr)}")


def command(exe: str, pid: int, *, native: bool, subprocesses: bool = False) -> list[str]:
    # --nonblocking unless native frames are asked for: py-spy can only unwind native frames
    # of a paused process, so that read pauses the rank for its duration.
    return [exe, "dump", "--pid", str(pid), "--json", "--native" if native else "--nonblocking",
            *(["--subprocesses"] if subprocesses else [])]


def read(pid: int, *, native: bool = False, subprocesses: bool = False,
         timeout: float | None = None, setting: str | None = None) -> str:
    """py-spy's dump of ``pid`` in faulthandler's layout; raises ``PySpyError`` (one line).

    Blocking, up to ``timeout`` (``TIMEOUT_S`` / ``NATIVE_TIMEOUT_S``); the py-spy process is
    killed when it runs over.
    """
    exe = locate(setting)
    limit = timeout if timeout is not None else (NATIVE_TIMEOUT_S if native else TIMEOUT_S)
    run_env = {**os.environ, "RUST_BACKTRACE": "0", "RUST_LIB_BACKTRACE": "0"}
    try:
        proc = subprocess.run(command(exe, pid, native=native, subprocesses=subprocesses),
                              capture_output=True,
                              timeout=limit, env=run_env, stdin=subprocess.DEVNULL, check=False)
    except subprocess.TimeoutExpired:  # run() has killed it by then
        raise PySpyError(FAILED, f"py-spy did not finish reading pid {pid} within {limit:.1f} s") from None
    except OSError as e:
        raise PySpyError(UNAVAILABLE, f"py-spy at {exe} cannot run: {e.strerror or e}") from None
    stderr = proc.stderr[:MAX_OUTPUT].decode("utf-8", errors="replace")
    if proc.returncode != 0:
        raise explain(pid, proc.returncode, stderr)
    try:
        data = json.loads(proc.stdout[:MAX_OUTPUT])
    except ValueError:
        raise PySpyError(FAILED, f"py-spy output for pid {pid} is not JSON "
                                 f"({_first_error_line(stderr or proc.stdout.decode(errors='replace'))})") from None
    # Read on the rank's own host: its source lines ship with the stack (debug_server.stacks).
    return with_source(to_text(data, pid))


# ---------------------------------------------------------------------------------------------
# py-spy JSON -> faulthandler layout

_HEX_NAME = re.compile(r"^0x[0-9a-fA-F]+$")


def _one_line(value: Any) -> str:
    return " ".join(str(value).split())


def _frame_line(frame: Mapping[str, Any]) -> str:
    name = _one_line(frame.get("name") or "??")
    line = frame.get("line") if isinstance(frame.get("line"), int) else 0
    if frame.get("module") is None:  # a Python frame: py-spy leaves "module" empty for those
        filename = _one_line(frame.get("filename") or "?")
        # py-spy names the qualified name (``Trainer.step``, ``f.<locals>.g``), faulthandler
        # the code's own (``step``, ``g``): the same place must read the same from both.
        name = name.rsplit(".", 1)[-1] if not name.startswith("<") else name
        return f'  File "{filename}", line {line} in {name}'
    # A native frame. An unresolved one is only an address, different on every rank (ASLR):
    # "??" keeps identical stacks identical.
    if _HEX_NAME.match(name):
        name = "??"
    filename = _one_line(frame.get("short_filename") or os.path.basename(str(frame.get("filename") or "?")))
    at = f", line {line}" if line > 0 else ""
    return f'  Native "{filename}"{at} in {name}'


def _thread_header(thread: Mapping[str, Any], pid: int | None) -> str:
    tid = thread.get("thread_id")
    ident = f"0x{tid:016x}" if isinstance(tid, int) and tid >= 0 else "0x0"
    facts = []
    if pid is not None and thread.get("pid") not in (None, pid):  # --subprocesses
        facts.append(f"pid {thread['pid']}")
    if thread.get("os_thread_id") is not None:
        facts.append(f"tid {thread['os_thread_id']}")
    if thread.get("thread_name"):
        facts.append(json.dumps(_one_line(thread["thread_name"])))
    facts.append("active" if thread.get("active") else "idle")
    if thread.get("owns_gil"):
        facts.append("holds the GIL")
    # No "(" before "(most recent call first)": that is how readers find the header.
    detail = ", ".join(facts).replace("(", "[").replace(")", "]")
    return f"Thread {ident} [{detail}] (most recent call first):"


def to_text(data: Any, pid: int | None = None) -> str:
    """py-spy ``dump --json`` output (a list of threads) in faulthandler's layout; a thread of
    a process other than ``pid`` (``--subprocesses``) names its pid."""
    if not isinstance(data, list):
        raise PySpyError(FAILED, "py-spy JSON is not a list of threads")
    parts = []
    for thread in data:
        if not isinstance(thread, Mapping):
            continue
        frames = thread.get("frames") if isinstance(thread.get("frames"), list) else []
        lines = [_thread_header(thread, pid)]
        lines += [_frame_line(f) for f in frames if isinstance(f, Mapping)]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# Whom a py-spy read may target


def check_target(pid: int, announced: Mapping[str, Any] | None) -> None:
    """Raise ``PySpyError`` unless ``pid`` is a rank of this job that this process may read:
    ``announced`` is the registration sidecar of the rank that claims it (``jobpids.check``).
    ``GONE`` when there is no such process here, ``REFUSED`` otherwise."""
    reason = jobpids.check(pid, announced)
    if reason is None:
        return
    if not os.path.exists(f"/proc/{pid}"):
        raise PySpyError(GONE, f"pid {pid} does not exist on {socket.gethostname()}")
    raise PySpyError(REFUSED, reason)


# ---------------------------------------------------------------------------------------------
# The frontend's side


@dataclass(slots=True)
class Outcome:
    """One rank's py-spy read: the text and who read it, or why it did not happen."""

    text: str | None = None
    reader: str = ""
    error: PySpyError | None = None


Ask = Callable[[Any, Mapping[str, str], float], Awaitable[Any]]
"""``ask(helper_addr, params, timeout)`` POSTs ``pyspy_dump`` to a worker; returns a record
with ``ok``, ``body`` and ``line()`` (``fanout.RankResult``)."""


def header(native: bool, reader: str, timed_out: bool) -> str:
    """The line that opens a rank's section when py-spy, not the worker, produced it."""
    how = "py-spy --native" if native else "py-spy"
    tail = "; worker not answering" if timed_out else ""
    return f"({how}: read from outside the process by {reader}{tail})"


class PySpyCapture:
    """The frontend's py-spy reads: its own host directly, other hosts through their workers."""

    def __init__(self, timeout: float = TIMEOUT_S, native_timeout: float = NATIVE_TIMEOUT_S,
                 max_parallel: int = MAX_PARALLEL) -> None:
        self.timeout = timeout
        self.native_timeout = native_timeout
        self.host = socket.gethostname()
        """The frontend's host name (registrations carry ``socket.gethostname()`` too)."""
        self.max_parallel = max_parallel
        self._sem: asyncio.Semaphore | None = None

    def _limit(self, native: bool) -> float:
        return self.native_timeout if native else self.timeout

    async def read_local(self, pid: int, native: bool, announced: Mapping[str, Any] | None) -> str:
        check_target(pid, announced)
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.max_parallel)
        async with self._sem:
            return await asyncio.get_running_loop().run_in_executor(
                None, lambda: read(pid, native=native, timeout=self._limit(native)))

    async def _ask(self, ask: Ask, helper: Any, pid: int | None, native: bool) -> str:
        # PyTorch's C++ worker runs its own pyspy_dump and takes any non-empty value as "on":
        # send only the flags that are on, as PyTorch's frontend does.
        params = {NATIVE: "1"} if native else {NONBLOCKING: "1"}
        if pid is not None:
            params[PID] = str(pid)
        res = await ask(helper, params, self._limit(native) + HELPER_SLACK_S)
        if res.ok and res.body is not None:
            return str(res.body)
        raise PySpyError(FAILED, res.line().split(": ", 1)[-1])

    async def read_rank(self, rank: int, meta: Mapping[str, Any] | None, *, native: bool,
                        own: Any | None, siblings: Sequence[Any], ask: Ask) -> Outcome:
        """py-spy of one rank: locally if it is on this host, else through a worker there.

        ``own``: the rank's own worker address when it answers (it reads itself), else None;
        ``siblings``: addresses of answering workers on the rank's host.
        """
        pid = meta.get("pid") if isinstance(meta, Mapping) else None
        host = meta.get("host") if isinstance(meta, Mapping) else None
        known = isinstance(pid, int) and isinstance(host, str)
        errors: list[PySpyError] = []
        if known and host == self.host:
            try:
                return Outcome(await self.read_local(pid, native, meta), "the frontend")
            except PySpyError as e:
                if e.kind == GONE:
                    return Outcome(error=e)
                errors.append(e)
        helpers: list[tuple[Any, int | None, str]] = []
        if own is not None:  # PyTorch's own worker too: it has pyspy_dump, on itself
            helpers.append((own, None, "its own worker"))
        others = [s for s in siblings if s.rank != rank] if known else []
        if others:  # spread the stuck ranks of a host over its answering workers
            s = others[rank % len(others)]
            helpers.append((s, pid, f"rank {s.rank}'s worker"))
        for helper, target, reader in helpers:
            try:
                return Outcome(await self._ask(ask, helper, target, native), reader)
            except PySpyError as e:
                errors.append(e)
        if not errors:
            why = (f"no answering worker on host {host} to run py-spy there" if known else
                   "no pid/host registered for this rank (a worker without debug_server's sidecar)")
            return Outcome(error=PySpyError(UNAVAILABLE, why))
        # The first reason is the frontend's own (or the nearest helper's): the one to fix.
        first = errors[0]
        return Outcome(error=PySpyError(first.kind, "; ".join(dict.fromkeys(e.reason for e in errors))))

    async def fill(self, results: Sequence[Any], addrs: Sequence[Any], *, ask: Ask,
                   native: bool = False, every: bool = False, ok: str = "ok",
                   timed_out: str = "timed out") -> dict[int, PySpyError]:
        """Read ranks with py-spy and put the text into their records; returns the failures.

        ``every``: every rank (``/pyspy_dump``, ``/stacks?native=1``); else only the ranks
        whose worker timed out. A rank read this way gets a header line naming the reader;
        one that could not be read keeps its record, with the reason in one line.
        """
        by_rank = {a.rank: a for a in addrs}
        answering = {r.rank for r in results if r.status == ok}
        hosts: dict[str, list[Any]] = {}
        for r in sorted(answering):
            meta = by_rank[r].meta if r in by_rank else None
            if isinstance(meta, Mapping) and isinstance(meta.get("host"), str):
                hosts.setdefault(meta["host"], []).append(by_rank[r])
        todo = [r for r in results if r.rank in by_rank and by_rank[r.rank].url is not None
                and (r.status == timed_out or (every and r.status == ok))]

        async def one(r: Any) -> Outcome:
            meta = by_rank[r.rank].meta
            host = meta.get("host") if isinstance(meta, Mapping) else None
            own = by_rank[r.rank] if r.rank in answering else None
            return await self.read_rank(r.rank, meta, native=native, own=own,
                                        siblings=hosts.get(host, []) if isinstance(host, str) else [],
                                        ask=ask)

        outcomes = await asyncio.gather(*(one(r) for r in todo))
        failures: dict[int, PySpyError] = {}
        for r, out in zip(todo, outcomes, strict=True):
            was_timed_out = r.status == timed_out
            if out.text is not None:
                r.body = f"{header(native, out.reader, was_timed_out)}\n{out.text}"
                r.note = (f"worker timed out after {r.elapsed_s:.1f} s; " if was_timed_out else "") \
                    + f"stacks read by py-spy{' --native' if native else ''} ({out.reader})"
                r.status = ok
                if was_timed_out:
                    r.error = None
                continue
            assert out.error is not None
            failures[r.rank] = out.error
            if was_timed_out:
                r.error = f"{r.error or r.status}; no py-spy stacks: {out.error.reason}"
            else:  # the worker's own Python stacks stay; say why the native ones are missing
                r.note = f"no py-spy stacks: {out.error.reason}"
                r.body = f"(no py-spy stacks: {out.error.reason})\n{r.body or ''}"
        return failures

