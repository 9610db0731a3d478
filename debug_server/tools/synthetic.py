"""Synthetic Flight Recorder dumps in the exact schema the recorder writes.

Used where a real job cannot produce the case (512 fake ranks, a wrapped ring of 2000 entries)
by tests, benchmarks and fake worker ranks. Pure: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.dumpio import FR_VERSION

_NUMEL = 1024


def make_entry(
    *,
    record_id: int,
    comm: str = "main_comm",
    backend: str = "gloo",
    seq: int = 0,
    p2p_seq: int = 0,
    op: str = "all_reduce",
    state: str = "completed",
    input_sizes: Sequence[Sequence[int]] = ((_NUMEL,),),
    output_sizes: Sequence[Sequence[int]] | None = None,
    dtype: str = "Float",
    is_p2p: bool = False,
    peer_desc: str = "",
    frames: Sequence[dict[str, Any]] | None = None,
    time_created_ns: int | None = None,
    timeout_ms: int = 600_000,
) -> dict[str, Any]:
    """One FR entry as ``FlightRecorderHook.dump_json`` produces it."""
    if output_sizes is None:
        output_sizes = input_sizes
    created = time_created_ns if time_created_ns is not None else 1_700_000_000_000_000_000 + record_id * 1000
    started = created + 10 if state in ("started", "completed") else None
    completed = created + 20 if state == "completed" else None
    name = f"nccl:{op}{(' ' + peer_desc) if peer_desc else ''}"
    return {
        "record_id": record_id,
        "pg_id": 0,
        "process_group": [comm, backend],
        "thread_name": "MainThread",
        "thread_id": 1,
        "collective_seq_id": seq,
        "p2p_seq_id": p2p_seq,
        "op_id": record_id,
        "profiling_name": name,
        "time_created_ns": created,
        "duration_ms": 0.01 if state == "completed" else None,
        "input_sizes": [list(s) for s in input_sizes],
        "input_dtypes": [dtype] * len(input_sizes),
        "output_sizes": [list(s) for s in output_sizes],
        "output_dtypes": [dtype] * len(output_sizes),
        "state": state,
        "time_discovered_started_ns": started,
        "time_discovered_completed_ns": completed,
        "retired": state == "completed",
        "timeout_ms": timeout_ms,
        "is_p2p": is_p2p,
        "frames": list(frames)
        if frames is not None
        else [
            {"name": "train_step", "filename": "train.py", "line": 148},
            {"name": "<module>", "filename": "train.py", "line": 200},
        ],
    }


def make_dump(
    entries: list[dict[str, Any]],
    groups: dict[str, Sequence[int]],
    backend: str = "gloo",
    status: Mapping[str, Mapping[str, int]] | None = None,
    descs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A whole per-rank dump around ``entries``; ``groups`` maps communicator name to ranks.

    ``descs`` gives a group's ``desc`` (c10d's ``group_desc``: ``mesh_tp``); default ``backend``.

    ``pg_status`` is derived from the entries as the recorder does (highest collective seq
    issued, started, completed per group); ``status`` overrides it per group, e.g. for a group
    whose entries the ring no longer holds although its counter went on.
    """
    return {
        "version": FR_VERSION,
        "comm_lib_version": "synthetic",
        "pg_config": {
            name: {"name": name, "desc": (descs or {}).get(name, backend), "ranks": str(list(ranks))}
            for name, ranks in groups.items()
        },
        "pg_status": {name: dict((status or {}).get(name) or _status(entries, name))
                      for name in groups},
        "entries": entries,
    }


def _status(entries: Sequence[Mapping[str, Any]], name: str) -> dict[str, int]:
    enq = started = done = -1
    for e in entries:
        if e["process_group"][0] != name or e.get("is_p2p"):
            continue
        seq = e["collective_seq_id"]
        enq = max(enq, seq)
        if e["state"] in ("started", "completed"):
            started = max(started, seq)
        if e["state"] == "completed":
            done = max(done, seq)
    return {"last_enqueued_collective": enq, "last_started_collective": started,
            "last_completed_collective": done}


def hang_job(
    world_size: int,
    n_entries: int = 2000,
    missing_rank: int | None = None,
    comm: str = "main_comm",
) -> dict[int, dict[str, Any]]:
    """Dumps of a job whose last all_reduce hangs because ``missing_rank`` never issued it.

    Every rank keeps the newest ``n_entries`` (a full ring). The hanging collective is in state
    ``started`` on the ranks that issued it; earlier ones are ``completed``.
    """
    total = n_entries  # sequence numbers 0 .. total-1 on the ranks that issued the last one
    dumps: dict[int, dict[str, Any]] = {}
    ranks = list(range(world_size))
    for r in ranks:
        last = total - 1 if r != missing_rank else total - 2
        first = max(0, last - n_entries + 1)
        entries = [
            make_entry(
                record_id=seq,
                comm=comm,
                seq=seq,
                state="started" if (seq == total - 1) else "completed",
            )
            for seq in range(first, last + 1)
        ]
        dumps[r] = make_dump(entries, {comm: ranks})
    return dumps
