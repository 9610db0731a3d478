"""Do the ranks' calls of one collective agree? Op, sizes and dtypes, and each op's own size rules.

``items`` below are one sequence number's cells: (class index, signature id, state, frames id),
with signature ids into the merge's table (``Merge.sigs``): (profiling_name, op, in_sizes,
out_sizes, in_dtypes, out_dtypes).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from debug_server.analysis.merge import Merge
from debug_server.analysis.ranks import ranks_phrase

__all__ = ["compare", "fmt_sizes", "intrinsic_problem", "signatures", "user_line"]

_ALL_GATHER = frozenset(
    {
        "all_gather", "_all_gather_base", "all_gather_base", "all_gather_into_tensor",
        "all_gather_single", "allgather", "allgather_base", "all_gather_into_tensor_coalesced",
    }
)  # fmt: skip
_REDUCE_SCATTER = frozenset(
    {
        "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_base", "reduce_scatter_tensor",
        "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
    }
)  # fmt: skip
# Not in the two sets above: c10d closes an uneven all_gather (a run of ``_broadcast_oop``) with
# ``ALLGATHER_coalesced`` and an uneven reduce_scatter (``_reduce_oop``) with
# ``REDUCE_SCATTER_coalesced``; the digest folds the run into one signature whose sizes are the
# broadcasts' (input = output), so the all_gather / reduce_scatter size rules do not apply to it.
# The ranks' runs are still compared with each other (op, every size, dtypes).
_ALL_TO_ALL = frozenset(
    {
        "all_to_all",
        "all_to_all_single",
        "alltoall",
        "alltoall_base",
        "all_to_all_v_single",
        "all_to_all_v",
    }
)
_VARIABLE = frozenset({"all_gather_v", "reduce_scatter_v"})
_ALL_REDUCE = frozenset({"all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced"})

Item = tuple[int, int, int, int]

_OWN_DIR = __file__.rsplit("/", 2)[0] + "/"  # the package root: debug_server/


def _numel(sizes: tuple[tuple[int, ...], ...]) -> int:
    return sum(math.prod(s) for s in sizes)


def fmt_sizes(sizes: tuple[tuple[int, ...], ...]) -> str:
    """``((2, 3),)`` -> ``[[2, 3]]``."""
    return str([list(s) for s in sizes])


def _uneven_list(ins: tuple[tuple[int, ...], ...], outs: tuple[tuple[int, ...], ...],
                 group_size: int) -> bool:
    """One tensor on one side, one per rank on the other: the list form, which may be uneven."""
    return group_size > 1 and len(ins) == 1 and len(outs) == group_size


def intrinsic_problem(sig: tuple[Any, ...], group_size: int) -> str | None:
    """A size rule one rank's op breaks on its own (e.g. all_gather output != input x size)."""
    op, ins, outs = sig[1], sig[2], sig[3]
    if not ins or not outs:
        return None
    # all_gather: this rank's input is one slot of the output; reduce_scatter the mirror image.
    if op in _ALL_GATHER:
        return _slot_rule(ins, outs, group_size, ("input", "output"))
    if op in _REDUCE_SCATTER:
        return _slot_rule(outs, ins, group_size, ("output", "input"))
    if op in _ALL_REDUCE and ins != outs:
        return f"input sizes {fmt_sizes(ins)} != output sizes {fmt_sizes(outs)}"
    return None


def user_line(frames: Sequence[Mapping[str, Any]]) -> str | None:
    """``train.py:148 in step``: the innermost frame outside torch and this package."""
    def inside(f: Mapping[str, Any]) -> bool:
        fn = str(f.get("filename", ""))
        return "/torch/" in fn or fn.startswith(_OWN_DIR) or fn.startswith("<frozen")

    top = next((f for f in frames if not inside(f)), frames[0] if frames else None)
    if top is None:
        return None
    return f"{top.get('filename')}:{top.get('line')} in {top.get('name')}"


def _size_key(sig: tuple[Any, ...]) -> Any:
    op = sig[1]
    if op in _ALL_TO_ALL or op in _VARIABLE:
        return None
    if op == "scatter":
        return sig[3]
    if op == "gather":
        return sig[2]
    # The list forms of all_gather / reduce_scatter may be uneven: each rank's own tensor differs,
    # the per-rank list must not.
    if op in _ALL_GATHER and len(sig[2]) == 1 and len(sig[3]) > 1:
        return ("out", sig[3])
    if op in _REDUCE_SCATTER and len(sig[3]) == 1 and len(sig[2]) > 1:
        return ("in", sig[2])
    return (sig[2], sig[3])


def _dtype_key(sig: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(sorted(set(sig[4]) | set(sig[5])))


_KEYS = (("type_mismatch", lambda s: s[1]), ("size_mismatch", _size_key),
         ("dtype_mismatch", _dtype_key))  # fmt: skip


def _split_majority(groups: dict[Any, list[int]]) -> tuple[list[int], bool]:
    """Ranks outside the strict majority (culprits) and whether that was decidable."""
    counts = sorted((len(v) for v in groups.values()), reverse=True)
    if len(counts) > 1 and counts[0] > counts[1]:
        top = max(groups, key=lambda k: len(groups[k]))
        return sorted(r for k, v in groups.items() if k != top for r in v), True
    return sorted(r for v in groups.values() for r in v), False


def _describe(label: str, key: Any) -> str:
    if label == "type_mismatch":
        return str(key)
    if label == "dtype_mismatch":
        return "/".join(key) or "no tensors"
    if key is None:
        return "?"
    if isinstance(key, tuple) and len(key) == 2 and key[0] in ("in", "out"):
        return f"{key[0]} {fmt_sizes(key[1])}"
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, tuple) for k in key):
        return f"in {fmt_sizes(key[0])} out {fmt_sizes(key[1])}"
    return fmt_sizes(key)


def signatures(
    m: Merge, items: Sequence[Item], cls_ranks: list[list[int]]
) -> list[dict[str, Any]]:
    """What each side of a mismatch issued, and from which line (largest side first)."""
    by_sig: dict[int, tuple[list[int], int]] = {}
    for ci, sg, _, fr in items:
        rs, fr0 = by_sig.get(sg, ([], fr))
        rs.extend(cls_ranks[ci])
        by_sig[sg] = (rs, fr0)
    out = []
    for sg, (rs, fr) in sorted(by_sig.items(), key=lambda kv: (-len(kv[1][0]), min(kv[1][0]))):
        sig = m.sigs[sg]
        out.append({
            "ranks": sorted(rs), "op": sig[1],
            "input_sizes": [list(x) for x in sig[2]], "output_sizes": [list(x) for x in sig[3]],
            "dtypes": sorted(set(sig[4]) | set(sig[5])),
            "line": user_line(m.frames[fr]) if fr >= 0 else None,
        })  # fmt: skip
    return out


def compare(
    m: Merge, items: Sequence[Item], cls_ranks: list[list[int]], gsize: int, complete: bool
) -> tuple[str | None, list[int], str | None]:
    """(kind, culprit ranks, text) of the first disagreement among ``items``, or (None, [], None).

    Op first, then sizes, then dtypes; ``complete`` (every member issued it) lets all_to_all's
    totals be compared.
    """
    by_sig: dict[int, list[int]] = {}
    for ci, sg, _, _ in items:
        by_sig.setdefault(sg, []).extend(cls_ranks[ci])
    for label, keyf in _KEYS:
        groups: dict[Any, list[int]] = {}
        for sg, rs in by_sig.items():
            groups.setdefault(keyf(m.sigs[sg]), []).extend(rs)
        if len(groups) > 1:
            culprits, decided = _split_majority(groups)
            desc = "; ".join(
                f"{ranks_phrase(rs)}: {_describe(label, k)}"
                for k, rs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
            )
            what = label.replace("_", " ")
            culprit_txt = f" (culprit {ranks_phrase(culprits)})" if decided else ""
            return label, culprits, f"{what}{culprit_txt}: {desc}"
    return _compare_totals(m, items, by_sig, gsize, complete)


def _compare_totals(
    m: Merge, items: Sequence[Item], by_sig: dict[int, list[int]], gsize: int, complete: bool
) -> tuple[str | None, list[int], str | None]:
    # all_to_all: per-rank sizes legitimately differ; the totals must agree.
    sig0 = m.sigs[items[0][1]]
    if sig0[1] in _ALL_TO_ALL and complete:
        tin = sum(_numel(m.sigs[sg][2]) * len(rs) for sg, rs in by_sig.items())
        tout = sum(_numel(m.sigs[sg][3]) * len(rs) for sg, rs in by_sig.items())
        if tin != tout:
            rs = sorted(r for v in by_sig.values() for r in v)
            return (
                "size_mismatch",
                rs,
                f"{sig0[1]}: total input numel {tin} != total output numel {tout}",
            )
    # Same op, sizes, dtypes: any intrinsic rule broken by some ranks?
    bad: list[int] = []
    prob = None
    for sg, rs in by_sig.items():
        p = intrinsic_problem(m.sigs[sg], gsize)
        if p:
            bad.extend(rs)
            prob = p
    if bad:
        return "size_mismatch", sorted(bad), f"{sig0[1]} on {ranks_phrase(bad)}: {prob}"
    return None, [], None


def _slot_rule(one: tuple[tuple[int, ...], ...], whole: tuple[tuple[int, ...], ...], group_size: int, names: tuple[str, str]) -> str | None:
    """``one`` (this rank's part) must fill a slot of ``whole``: one of the slots of a list
    (uneven: slots may differ), else exactly ``1 / group_size`` of it."""
    part, full = names
    if _uneven_list(one, whole, group_size):
        if _numel(one) not in {math.prod(w) for w in whole}:
            return f"{part} numel {_numel(one)} fits none of the {group_size} {full} slots"
        return None
    if _numel(whole) != _numel(one) * group_size:
        return (f"{full} numel {_numel(whole)} != {part} numel {_numel(one)} x group size "
                f"{group_size}")
    return None
