"""Real rank processes that a test watches while they run.

Each rank runs the same script with its own environment; its output goes to a log file the test
polls for marker lines (a pipe would fill up and block the rank). Every rank runs in its own
session, so ``close()`` ends it and anything it started (rank 0's frontend) by process group.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from mpjob import free_port, rank_env

_R = TypeVar("_R", bound="RankProcs")


class RankProcs:
    """``world_size`` processes running ``script`` (dedented) in ``tmp``; ``env(rank)`` each."""

    def __init__(self, tmp: Path, script: str, world_size: int,
                 env: Callable[[int], dict[str, str]],
                 wrap: Callable[[int, list[str]], list[str]] | None = None) -> None:
        """``wrap(rank, argv)``: the command line that starts the rank (a wrapper around it:
        ``bash -c``, ``timeout``); default ``argv`` itself."""
        self.tmp = tmp
        self.script = tmp / "rank_script.py"
        self.script.write_text(textwrap.dedent(script))
        self.lines = self.script.read_text().splitlines()
        self.logs = [tmp / f"rank{r}.log" for r in range(world_size)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for r in range(world_size):
            with self.logs[r].open("wb") as out:
                argv = [sys.executable, str(self.script)]
                self.procs.append(subprocess.Popen(
                    wrap(r, argv) if wrap is not None else argv, env=env(r), cwd=tmp, stdout=out,
                    stderr=subprocess.STDOUT, start_new_session=True))

    def wait_for(self, rank: int, pattern: str, timeout: float = 60) -> re.Match[str]:
        """The first line of ``rank``'s output matching ``pattern``; fails if the rank dies."""
        deadline = time.monotonic() + timeout
        while not (m := re.search(pattern, self.logs[rank].read_text(), re.M)):
            assert self.procs[rank].poll() is None and time.monotonic() < deadline, self.log(rank)
            time.sleep(0.02)
        return m

    def line_of(self, marker: str) -> int:
        """The 1-based line of the script that ends with ``# marker``."""
        return 1 + next(i for i, ln in enumerate(self.lines) if ln.endswith(f"# {marker}"))

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text()[-3000:]

    def __enter__(self: _R) -> _R:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)  # works on a stopped process too
            except ProcessLookupError:
                pass
            p.wait(10)


class DumpDirJob(RankProcs):
    """``world_size`` ranks of ``script`` on one host (torchrun's variables, a free master
    port), each with ``DUMP_DIR`` (``self.dump_dir``) and ``extra`` in its environment; the
    dump path comes from ``start_debug_server(dump_dir=...)``, never the environment."""

    def __init__(self, tmp: Path, script: str, world_size: int,
                 extra: dict[str, str] | None = None) -> None:
        self.dump_dir = tmp / "dumps"
        port = free_port()

        def env(r: int) -> dict[str, str]:
            e = rank_env(r, world_size, port, {"DUMP_DIR": str(self.dump_dir), **(extra or {})})
            e.pop("TORCHCOMM_FR_DUMP_TEMP_FILE", None)
            return e

        super().__init__(tmp, script, world_size, env)
