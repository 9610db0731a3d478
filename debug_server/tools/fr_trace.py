"""Analyze a directory of per-rank Flight Recorder dumps: ``python -m debug_server.fr_trace DIR``.

A drop-in for ``python -m torch.distributed.flight_recorder.fr_trace`` (same flags where both
have them) that says which rank is missing from which collective, checks op types, sizes and
dtypes across ranks, and joins that with the ranks' stacks (``--stacks stacks_<ts>.txt``).

Files are ``<prefix><rank>`` or ``<prefix><rank>.json`` (prefix inferred when ``-p`` is not given),
each a pickle (loaded with a restricted unpickler that refuses anything but plain containers) or
the same dict as JSON, ours or PyTorch's (``_dump_fr_trace()`` / ``_dump_fr_trace_json()``).
``DIR`` may also be one dump cycle's ``fr_snapshot_<ts>.json`` (``frontend.snapshot``: every
rank's dump as the frontend analyzed it, ranks alike written once): the ranks it records as
failed are without data, as they were live.

Exit status: 0 no hang or mismatch found, 2 findings (a hang or a mismatch), 1 unusable input.
Every error is one line on stderr followed by a one-line hint; there is no traceback.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

from tabulate import tabulate

from debug_server.analysis import report, stackparse
from debug_server.analysis.core import analyze_digests
from debug_server.analysis.digest import RankDigest, digest_dump
from debug_server.analysis.groups import group_label
from debug_server.analysis.ranks import format_rank_set, parse_rank_text, rank_ranges
from debug_server.dumpio import DumpError, group_members, load_dump, rank_files

logger = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_UNUSABLE = 1
EXIT_FINDINGS = 2
# Below this many files one process is faster than starting workers.
_POOL_MIN_FILES = 64


class FrTraceError(Exception):
    """An input problem that makes the analysis impossible; ``help`` says what to do."""

    help = "run with -h for usage"

    def __init__(self, message: str, *, lines: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.lines = list(lines) or [message]


class NoDumpFilesError(FrTraceError):
    help = "point DIR at the folder holding rank_<N> or rank_<N>.json files (e.g. <dump_dir>/per_rank), or pass -p PREFIX"


class PrefixError(FrTraceError):
    help = "pass -p PREFIX (the part of the file names before the rank number, e.g. -p rank_)"


class UnreadableDumpError(FrTraceError):
    help = "remove or re-dump the named files, or pass --allow-incomplete-ranks to analyze the rest"


class VersionMismatchError(FrTraceError):
    help = "all dumps of one job must come from the same recorder version; re-dump or remove the odd ones"


class MissingDumpFilesError(FrTraceError):
    help = ("pass --allow-incomplete-ranks to analyze the ranks that have dumps (the others are reported "
            "as without data); on several hosts without a shared dump dir, the other hosts' rank_<N> "
            "files are on those hosts: copy them here")


class SnapshotError(FrTraceError):
    help = ("pass an fr_snapshot_<ts>.json written by the frontend's dumper (or a directory of "
            "per-rank dumps); a truncated one cannot be read: use another cycle's")


MAX_SNAPSHOT_BYTES = 4 << 30


class StacksFileError(FrTraceError):
    help = "pass the stacks_<ts>.txt file written by the rank-0 dumper (sections '=== Rank N ===')"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m debug_server.fr_trace",
        description="Match per-rank Flight Recorder dumps and say which rank hangs where.",
        epilog="exit status: 0 clean, 2 hang or mismatch found (also ranks waiting while others "
               "gave no data), 1 unusable input",
    )
    p.add_argument(
        "trace_dir", nargs="?", help="directory with one dump per rank, named <prefix><rank>[.json]"
        ", or a dump cycle's fr_snapshot_<ts>.json"
    )
    p.add_argument("-p", "--prefix", default=None,
                   help="file name prefix before the rank (inferred if omitted)")
    p.add_argument("-j", "--just_print_entries", action="store_true",
                   help="print entries side by side, one column per rank")
    p.add_argument(
        "--print_stack_trace", action="store_true", help="with -j: add the entries' call stacks"
    )
    p.add_argument(
        "--selected-ranks",
        type=int,
        nargs="+",
        default=None,
        help="only show these ranks (-j columns, NCCL call rows)",
    )
    p.add_argument(
        "--pg-filters", nargs="+", default=None, help="only these process groups (name or desc)"
    )
    p.add_argument(
        "--allow-incomplete-ranks",
        action="store_true",
        help="analyze even when some ranks have no (usable) dump file",
    )
    p.add_argument(
        "--stacks",
        default=None,
        metavar="STACKS_FILE",
        help="stacks_<ts>.txt to join with the FR picture",
    )
    p.add_argument("--json", action="store_true", help="print the analysis result as JSON")
    p.add_argument(
        "-o", "--output", default=None, metavar="OUT.json", help="also write the JSON result here"
    )
    p.add_argument(
        "--chrome-trace",
        default=None,
        metavar="OUT",
        help="also write the entries as a Chrome trace-event JSON (open in ui.perfetto.dev)",
    )
    p.add_argument(
        "--mismatch-cap",
        "--mismatch_cap",
        type=int,
        default=10,
        help="accepted for compatibility; every mismatch is analyzed",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="worker processes for loading (default: CPU count, 1 for few files)",
    )
    return p


class _Ref(NamedTuple):
    """A worker's "same as the digest I sent as ``ref``" plus what differs per rank."""

    ref: tuple[int, int]
    rank: int
    status: tuple[tuple[str, int], ...]
    oldest_ns: int
    n_entries: int
    notes: tuple[str, ...]
    pg_progress: tuple[tuple[str, int, int], ...]
    snap_ns: int


# Per worker process (set by _worker_init): digest key -> local id of the digest already sent,
# so thousands of ranks that did the same thing cost one transfer, not one each.
_seen_in_worker: dict[tuple[Any, ...], int] | None = None

_Loaded = tuple[int, str, "RankDigest | _Ref | None", "str | None"]


def _load_one(rank: int, path: str) -> _Loaded:
    """Load and digest one file; the full dump never leaves this process."""
    try:
        dump = load_dump(path)
        version = str(dump.get("version"))
        d = digest_dump(rank, dump)
        del dump
    except DumpError as e:
        return rank, "", None, str(e)
    except MemoryError:
        return rank, "", None, f"{os.path.basename(path)}: too large to load"
    if _seen_in_worker is None:
        return rank, version, d, None
    key = d.key()
    local = _seen_in_worker.get(key)
    if local is None:
        _seen_in_worker[key] = len(_seen_in_worker)
        # The first digest of a kind travels whole; its notes become per-rank on the way back.
        return rank, version, d, None
    return (
        rank,
        version,
        _Ref((os.getpid(), local), rank, d.status, d.oldest_ns, d.n_entries, d.notes,
             d.pg_progress, d.snap_ns),
        None,
    )


def _worker_init() -> None:
    global _seen_in_worker
    _seen_in_worker = {}


def _load_first(rank: int, path: str) -> tuple[_Loaded, int]:
    out = _load_one(rank, path)
    return out, os.getpid()


def _load_all(
    files: dict[int, str], jobs: int | None
) -> list[tuple[int, str, RankDigest | None, str | None]]:
    items = sorted(files.items())
    n_jobs = jobs if jobs is not None else (os.cpu_count() or 1)
    if n_jobs <= 1 or (jobs is None and len(items) < _POOL_MIN_FILES):
        return [_load_one(r, p) for r, p in items]  # type: ignore[misc]
    # fork: the CLI is single-threaded here, and fork skips re-importing the package per worker.
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
    chunk = max(1, min(64, len(items) // (n_jobs * 8) or 1))
    out: list[tuple[int, str, RankDigest | None, str | None]] = []
    sent: dict[tuple[int, int], RankDigest] = {}
    counters: dict[int, int] = {}
    with concurrent.futures.ProcessPoolExecutor(
        n_jobs, mp_context=ctx, initializer=_worker_init
    ) as ex:
        # Results come back in submission order and each worker handles its items in that
        # order, so a reference always follows the full digest it points at.
        for (rank, version, payload, err), pid in ex.map(
            _load_first, [r for r, _ in items], [p for _, p in items], chunksize=chunk
        ):
            if isinstance(payload, _Ref):
                rep = sent[payload.ref]
                payload = rep._replace(
                    rank=payload.rank, status=payload.status, oldest_ns=payload.oldest_ns,
                    n_entries=payload.n_entries, notes=payload.notes,
                    pg_progress=payload.pg_progress, snap_ns=payload.snap_ns,
                )  # fmt: skip
            elif payload is not None:
                local = counters.get(pid, 0)
                counters[pid] = local + 1
                sent[(pid, local)] = payload
            out.append((rank, version, payload, err))
    return out


def _expected_ranks(digests: Sequence[RankDigest]) -> set[int]:
    ranks: set[int] = set()
    for d in digests:
        ranks.add(d.rank)
        for _, _, rs in d.pg:
            if rs:
                ranks.update(rs)
    return set(range(max(ranks) + 1)) if ranks else set()


def _check_versions(
    loaded: Sequence[tuple[int, str, RankDigest | None, str | None]], files: dict[int, str]
) -> None:
    by_version: dict[str, list[int]] = {}
    for rank, version, d, _ in loaded:
        if d is not None:
            by_version.setdefault(version, []).append(rank)
    if len(by_version) <= 1:
        return
    common = max(by_version, key=lambda v: len(by_version[v]))
    lines = []
    ref = os.path.basename(files[by_version[common][0]])
    for v, ranks in sorted(by_version.items()):
        if v != common:
            for r in ranks[:5]:
                lines.append(f"{os.path.basename(files[r])} has version {v} but {ref} has {common}")
    raise VersionMismatchError(lines[0], lines=lines)


def _gather(args: argparse.Namespace) -> tuple[list[RankDigest], dict[int, str], list[str]]:
    directory = args.trace_dir
    if not os.path.isdir(directory):
        raise NoDumpFilesError(f"no such directory: {directory}")
    try:
        files, notes = rank_files(directory, args.prefix)
    except DumpError as e:
        raise PrefixError(str(e)) from None
    if not files:
        raise NoDumpFilesError(
            f"no dump files in {directory}"
            + (f" with prefix {args.prefix!r}" if args.prefix else "")
        )
    loaded = _load_all(files, args.jobs)
    bad = [(r, err) for r, _, d, err in loaded if d is None]
    unavailable: dict[int, str] = {}
    if bad:
        if not args.allow_incomplete_ranks:
            raise UnreadableDumpError(
                bad[0][1] or "unreadable dump", lines=[e or "unreadable" for _, e in bad]
            )
        for r, err in bad:
            notes.append(f"ignored {err}")
            unavailable[r] = f"unusable dump: {(err or '').split(': ', 1)[-1]}"
    _check_versions(loaded, files)
    digests = [d for _, _, d, _ in loaded if d is not None]
    missing = sorted(_expected_ranks(digests) - set(files))
    if missing:
        if not args.allow_incomplete_ranks:
            raise MissingDumpFilesError(
                f"no dump file for rank{'s' if len(missing) > 1 else ''} "
                f"{format_rank_set(missing)} (group members or gaps in {directory})"
            )
        for r in missing:
            unavailable[r] = "no dump file"
    return digests, unavailable, notes


def read_snapshot(path: str) -> tuple[dict[int, dict[str, Any]], dict[int, str], int]:
    """(rank -> dump, rank -> why it has none, world size) of an ``fr_snapshot_<ts>.json``
    (``snapshot.load``); a file that is not a snapshot is a :class:`SnapshotError` of one line."""
    from debug_server.frontend import snapshot

    try:
        return snapshot.load(path, MAX_SNAPSHOT_BYTES)
    except OSError as e:
        raise SnapshotError(f"cannot read {path}: {e.strerror or e}") from None
    except (ValueError, RecursionError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise SnapshotError(f"{os.path.basename(path)}: not a usable snapshot ({first[:300]})") from None


def _run_snapshot(args: argparse.Namespace, stacks: dict[int, str] | None) -> dict[str, Any]:
    from debug_server.analysis.core import analyze

    dumps, unavailable, world = read_snapshot(args.trace_dir)
    if not dumps:
        raise SnapshotError(f"{os.path.basename(args.trace_dir)}: no rank has a dump "
                            f"({len(unavailable)} recorded as failed)")
    if args.just_print_entries:
        sys.stdout.write(just_print_entries(dumps, args))
        return {}
    return analyze(dumps, world_size=world, stacks=stacks, unavailable=unavailable,
                   pg_filters=args.pg_filters)


def _read_stacks(path: str) -> dict[int, str]:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise StacksFileError(f"cannot read stacks file {path}: {e.strerror or e}") from None
    stacks = stackparse.split_stacks_file(text)
    if not stacks:
        raise StacksFileError(f"{path}: no '=== Rank N ===' sections")
    return stacks


# --------------------------------------------------------------------------------------------
# -j: entries side by side
# --------------------------------------------------------------------------------------------


def _entry_cell(e: dict[str, Any], stack_ids: dict[str, tuple[int, list[str]]] | None) -> str:
    name = str(e.get("profiling_name", "?"))
    op = name.partition(":")[2] or name
    cell = f"{op}(input_sizes={e.get('input_sizes')}, state={e.get('state')})"
    if stack_ids is not None:
        frames = e.get("frames") or []
        key = repr(frames)
        if key not in stack_ids:
            lines = [
                f"{f.get('name')} at {f.get('filename')}:{f.get('line')}"
                for f in frames
                if isinstance(f, dict)
            ]
            stack_ids[key] = (len(stack_ids), lines)
        cell += f" stack_id={stack_ids[key][0]}"
    return cell


def _group_labels(dumps: dict[int, dict[str, Any]]) -> dict[str, str]:
    """Group name -> how a person reads it (``mesh_tp [2, 3]``), from the dumps' pg_config."""
    cfg: dict[str, tuple[str, tuple[int, ...]]] = {}
    for d in dumps.values():
        pgc = d.get("pg_config")
        if not isinstance(pgc, dict):
            continue
        for key, c in pgc.items():
            if not isinstance(c, dict):
                continue
            try:
                rs = group_members(c.get("ranks", "[]"))
            except DumpError:
                continue
            cfg.setdefault(str(c.get("name", key)), (str(c.get("desc", "") or ""), tuple(rs)))
    descs: dict[str, int] = {}
    for desc, _ in cfg.values():
        descs[desc] = descs.get(desc, 0) + 1
    return {name: group_label(name, name, desc, rs, desc_shared=descs[desc] > 1)
            for name, (desc, rs) in cfg.items()}


def select_calls(calls: Sequence[dict[str, Any]], selected: Sequence[int]) -> list[dict[str, Any]]:
    """``--selected-ranks``: the NCCL call rows of those ranks. A row of a class of ranks (its
    ``global_ranks``, above ``NCCL_CALLS_FULL_LIMIT`` pairs) is kept where a selected rank is
    in the class, and then stands for the selected ranks of it alone."""
    sel = set(selected)
    mine_of: dict[str, list[int]] = {}  # a class's rows share its text: each read once
    out = []
    for c in calls:
        text = c.get("global_ranks")
        if not isinstance(text, str):
            if c.get("global_rank") in sel:
                out.append(c)
            continue
        mine = mine_of.get(text)
        if mine is None:
            mine = mine_of[text] = [r for r in parse_rank_text(text) if r in sel]
        if mine:
            out.append({**c, "global_rank": mine[0], "global_ranks": ",".join(rank_ranges(mine))})
    return out


def just_print_entries(dumps: dict[int, dict[str, Any]], args: argparse.Namespace) -> str:
    """Entries of every rank side by side, rows aligned by (group, seq) and P2P by p2p_seq."""
    ranks = [r for r in sorted(dumps) if args.selected_ranks is None or r in args.selected_ranks]
    filters = set(args.pg_filters) if args.pg_filters else None
    group_order: dict[str, int] = {}
    cells: dict[tuple[int, str, int, int], dict[int, list[str]]] = {}
    stack_ids: dict[str, tuple[int, list[str]]] | None = {} if args.print_stack_trace else None
    for r in ranks:
        for e in dumps[r].get("entries", []):
            try:
                pg = e["process_group"]
                gname, gdesc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
                if filters is not None and gname not in filters and gdesc not in filters:
                    continue
                p2p = bool(e.get("is_p2p"))
                seq = int(e["p2p_seq_id"] if p2p else e["collective_seq_id"])
            except (KeyError, TypeError, ValueError, IndexError):
                continue
            gi = group_order.setdefault(gname, len(group_order))
            key = (gi, gname, int(p2p), seq)
            cells.setdefault(key, {}).setdefault(r, []).append(_entry_cell(e, stack_ids))
    headers = ["group", "seq"] + [f"Rank {r}" for r in ranks]
    labels = _group_labels(dumps)
    rows = []
    for key in sorted(cells):
        _, gname, p2p, seq = key
        row = [labels.get(gname, gname), f"p2p {seq}" if p2p else str(seq)]
        row += ["; ".join(cells[key].get(r, [])) for r in ranks]
        rows.append(row)
    out = (
        tabulate(rows, headers=headers, tablefmt="plain", disable_numparse=True)
        if rows
        else "(no entries)"
    )
    if stack_ids:
        srows = [[sid, "\n".join(lines)] for sid, lines in sorted(stack_ids.values())]
        out += "\n\n" + tabulate(
            srows, headers=["stack_id", "frame_stack"], tablefmt="plain", disable_numparse=True
        )
    return out + "\n"


def _just_print(args: argparse.Namespace) -> int:
    try:
        files, notes = rank_files(args.trace_dir, args.prefix)
    except DumpError as e:
        raise PrefixError(str(e)) from None
    if not files:
        raise NoDumpFilesError(f"no dump files in {args.trace_dir}")
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    dumps: dict[int, dict[str, Any]] = {}
    errors = []
    for r, path in sorted(files.items()):
        try:
            dumps[r] = load_dump(path)
        except DumpError as e:
            errors.append(str(e))
    if errors and not args.allow_incomplete_ranks:
        raise UnreadableDumpError(errors[0], lines=errors)
    sys.stdout.write(just_print_entries(dumps, args))
    return EXIT_OK


# --------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------


def _write_chrome_trace(args: argparse.Namespace) -> None:
    """Every readable dump as a Perfetto timeline; in-flight ops end at the newest file's mtime."""
    from debug_server.frontend.export import chrome_trace

    files, _ = rank_files(args.trace_dir, args.prefix)
    dumps: dict[int, dict[str, Any]] = {}
    end_ns = 0
    for r, path in sorted(files.items()):
        try:
            dumps[r] = load_dump(path)
            end_ns = max(end_ns, os.stat(path).st_mtime_ns)
        except (DumpError, OSError):
            continue  # already reported (or allowed) by the analysis
    try:
        with open(args.chrome_trace, "w", encoding="utf-8") as f:
            json.dump(chrome_trace(dumps, end_ns=end_ns or None), f)
    except OSError as e:
        raise FrTraceError(f"cannot write {args.chrome_trace}: {e.strerror or e}") from None
    print(f"note: Chrome trace written to {args.chrome_trace} (open in https://ui.perfetto.dev)",
          file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Run the analysis for parsed arguments; raises :class:`FrTraceError` on unusable input."""
    if not args.trace_dir:
        raise NoDumpFilesError("missing DIR (the directory with the per-rank dump files)")
    snapshot_file = os.path.isfile(args.trace_dir)
    if args.just_print_entries and not snapshot_file:
        return _just_print(args)
    stacks = _read_stacks(args.stacks) if args.stacks else None
    if snapshot_file:
        if args.chrome_trace:
            raise SnapshotError("--chrome-trace reads per-rank dumps: pass their directory")
        result = _run_snapshot(args, stacks)
        if args.just_print_entries:
            return EXIT_OK
    else:
        digests, unavailable, notes = _gather(args)
        for n in notes:
            print(f"note: {n}", file=sys.stderr)
        result = analyze_digests(
            digests, stacks=stacks, unavailable=unavailable, pg_filters=args.pg_filters
        )
    if args.selected_ranks is not None:
        result["nccl_calls"] = select_calls(result["nccl_calls"], args.selected_ranks)
    # json.dumps, not json.dump: only the one-shot call uses the C encoder (json.dump to a file
    # walks the result in Python, 4x slower on the 20 MB result of 512 ranks).
    text = json.dumps(result) if args.output or args.json else ""
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(text)
        except OSError as e:
            raise FrTraceError(f"cannot write {args.output}: {e.strerror or e}") from None
    if args.chrome_trace:
        _write_chrome_trace(args)
    if args.json:
        sys.stdout.write(text)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(report.fr_trace_text(result))
    # Non-zero whenever the verdict names a problem: an error finding, or (category "unknown")
    # ranks that wait while others gave no data, even under --allow-incomplete-ranks.
    errors = [f for f in result["findings"] if f.get("severity") != "info"]
    return EXIT_FINDINGS if errors or result.get("category") else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 clean, 2 findings, 1 unusable input)."""
    args = _parser().parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    try:
        return run(args)
    except FrTraceError as e:
        for line in e.lines:
            print(f"error: {line}", file=sys.stderr)
        print(f"hint: {e.help}", file=sys.stderr)
        return EXIT_UNUSABLE
    except BrokenPipeError:  # `... | head` closed the pipe: not an error of ours
        return EXIT_OK


__all__ = ["FrTraceError", "just_print_entries", "main", "read_snapshot", "run"]

if __name__ == "__main__":
    sys.exit(main())
