"""The verdict: which finding is the root cause, its category, the next step, and the prose.

Precedence: a mismatch (op, size, dtype) explains a stuck-everywhere at its seq, and ranks missing
from later ops because they still wait in it; then ranks missing from a collective (CPU-side
divergence); then unmatched P2P; only a stuck-everywhere nothing explains points at the GPU, the
network or NCCL. The result carries that order (``finding_order``) and the banner's pick
(``headline_findings``), so no renderer decides it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.analysis.merge import MISMATCH_KINDS, Merge
from debug_server.analysis.ranks import format_ranks, ranks_phrase
from debug_server.analysis.stackparse import Position

__all__ = ["CATEGORIES", "CATEGORY_MEANING", "Verdict", "category_line", "headlines", "verdict"]

CATEGORIES = ("cpu_divergence", "gpu_or_network", "misconfigured_collective", "unknown")
"""The result's ``category`` (PyTorch's Flight Recorder root-cause classes), absent when clean:
``cpu_divergence`` a rank never reached the collective (or issued collectives in another order);
``gpu_or_network`` every member issued it and none completed it, and nothing else explains that;
``misconfigured_collective`` mismatched op, size or dtype, or unmatched P2P;
``unknown`` the evidence is too thin (ranks without data)."""

CATEGORY_MEANING = {
    "cpu_divergence": "a rank never reached the collective",
    "gpu_or_network": "every member is inside the collective and it does not progress",
    "misconfigured_collective": "the ranks issued different ops, sizes or dtypes",
    "unknown": "too little evidence to tell",
}
"""One short phrase per :data:`CATEGORIES` entry, for the renderers' "Category:" line."""

HEADLINES_MAX = 4
"""The banner names at most this many problems (more only before the first missing rank)."""
HEADLINE_MISSING_MAX = 3

Positions = Mapping[int, Position]
Finding = dict[str, Any]


class Verdict(NamedTuple):
    """What :func:`verdict` decides; ``order`` indexes the merge's findings, root cause first."""

    text: str
    category: str | None
    next_step: str | None
    order: list[int]


def category_line(result: Mapping[str, Any]) -> str:
    """``Category: <name> (<meaning>).`` for a result with a category, else ``""``.

    The next step is already the verdict's last sentence, so this line does not repeat it.
    """
    cat = result.get("category")
    if not cat:
        return ""
    return f"Category: {cat} ({CATEGORY_MEANING.get(cat, '')})."


def verdict(m: Merge, stack_groups: list[dict[str, Any]], positions: Positions) -> Verdict:
    """The verdict over ``m``'s findings (sorted by kind already), joined with the stacks."""
    errors = [f for f in m.findings if f["severity"] == "error"]
    mismatches = [f for f in errors if f["kind"] in MISMATCH_KINDS]
    missing = [f for f in errors if f["kind"] == "missing_ranks"]
    p2p = [f for f in errors if f["kind"] == "unmatched_p2p"]
    stuck = [f for f in errors if f["kind"] == "stuck_everywhere"]
    # A rank missing from one group because it waits in another group's collective is a
    # consequence; the root is a missing rank that is not waiting in any collective.
    waiting_ranks = {r for w in m.waiting for r in w["ranks"]}

    def is_root(f: Finding) -> bool:
        rs = f["ranks"]
        if any(r in positions for r in rs):
            return any(not positions[r].in_collective for r in rs if r in positions)
        return not all(r in waiting_ranks for r in rs)

    missing.sort(key=lambda f: (not is_root(f), len(f["ranks"])))
    roots = [f for f in missing if is_root(f)]
    category, step = _category(
        m, errors, mismatches, roots or ([] if stuck else missing), p2p, stuck, positions
    )
    said = {
        "mismatch": _mismatch_sentences(mismatches, stuck, positions),
        "missing": _missing_sentences(missing, positions),
        "p2p": [f"P2P deadlock or missing peer: {p2p[0]['detail']}."] if p2p else [],
        "stuck": _stuck_sentences(stuck, mismatches, category),
    }
    kinds = (["stuck", "missing", "mismatch", "p2p"] if category == "gpu_or_network"
             else ["mismatch", "missing", "p2p", "stuck"])  # fmt: skip
    parts = [s for k in kinds for s in said[k]]
    if not errors:
        parts.extend(_clean_sentences(m))
    if step:
        parts.append(f"Next step: {step}")
    parts.extend(_context_sentences(m, stack_groups))
    by_kind = {"mismatch": mismatches, "missing": missing, "p2p": p2p, "stuck": stuck}
    ordered = [f for k in kinds for f in by_kind[k]]
    ids = {id(f) for f in ordered}
    ordered += [f for f in m.findings if id(f) not in ids]
    index = {id(f): i for i, f in enumerate(m.findings)}
    return Verdict(" ".join(parts), category, step, [index[id(f)] for f in ordered])


def headlines(findings: Sequence[Mapping[str, Any]], order: Sequence[int]) -> list[int]:
    """The findings the banner names, in ``order``: errors only, at most three missing-rank ones,
    and after the first of those at most :data:`HEADLINES_MAX` in all."""
    errors = [i for i in order if findings[i].get("severity", "error") != "info"]
    is_missing = [findings[i]["kind"] == "missing_ranks" for i in errors]
    first_missing = is_missing.index(True) if True in is_missing else 0
    heads = errors[:first_missing]
    heads += [i for i, mi in zip(errors, is_missing, strict=True) if mi][:HEADLINE_MISSING_MAX]
    for i, mi in zip(errors[first_missing:], is_missing[first_missing:], strict=True):
        if not mi and len(heads) < HEADLINES_MAX:
            heads.append(i)
    return heads


def _mismatch_sentences(
    mismatches: list[Finding], stuck: list[Finding], positions: Positions
) -> list[str]:
    if not mismatches:
        return []
    f = mismatches[0]
    out = [f"Mismatch in {f['detail']}."]
    out.extend(_position_sentences(f["ranks"][:3], positions))
    if (f["group"], f["seq"]) in {(s["group"], s["seq"]) for s in stuck}:
        out.append(
            f"The mismatch is why no rank completes {f['op']} #{f['seq']}: the GPU and "
            "the network are not to blame."
        )
    return out


def _missing_sentences(missing: list[Finding], positions: Positions) -> list[str]:
    out = []
    for f in missing[:2]:
        rs = f["ranks"]
        subj = "Rank" if len(rs) == 1 else "Ranks"
        waiting = f.get("waiting") or []
        verb = "waits" if len(waiting) == 1 else "wait"
        tail = f" ({ranks_phrase(waiting)} {verb} in it)" if waiting else ""
        out.append(
            f"{subj} {format_ranks(rs)} never joined {f['op']} #{f['seq']} on {f['group_label']}{tail}."
        )
        out.extend(_position_sentences(rs, positions))
    return out


def _stuck_sentences(
    stuck: list[Finding], mismatches: list[Finding], category: str | None
) -> list[str]:
    explained = {(f["group"], f["seq"]) for f in mismatches}
    for f in stuck:
        if (f["group"], f["seq"]) in explained:
            continue
        return [
            f"All {len(f['ranks'])} ranks of {f['group_label']} issued {f['op']} #{f['seq']} and "
            "none completed it"
            + ("; no rank is missing and no mismatch explains it, so suspect the GPU, the "
               "network or the NCCL transport." if category == "gpu_or_network" else ".")
        ]
    return []


def _clean_sentences(m: Merge) -> list[str]:
    """No error found: how much was checked, and who might be missing for lack of data."""
    n = sum(1 for c in m.collectives if c["seq"] is not None)
    nr = len(m.data_ranks)
    out = [
        f"No hang or mismatch found in the Flight Recorder data "
        f"({nr} rank{'s' if nr != 1 else ''}, {n} collectives checked)."
        if m.data_ranks else "No Flight Recorder data from any rank; nothing to match."
    ]
    no_data = m.no_data()
    if m.waiting and no_data:
        w = m.waiting[0]
        out.append(
            f"{ranks_phrase(w['ranks']).capitalize()} wait in {w['op']} #{w['seq']} on {w['label']}; "
            f"{ranks_phrase(no_data)} gave no data and may be the ones missing."
        )
    return out


def _context_sentences(m: Merge, stack_groups: list[dict[str, Any]]) -> list[str]:
    """Wrapped rings, ranks without data, and where the main threads are."""
    out = []
    if any(f["kind"] == "history_lost" for f in m.findings):
        out.append(
            "Some ranks' rings wrapped (history_lost); older collectives were checked only where still recorded."
        )
    if m.unavailable:
        by_reason: dict[str, list[int]] = {}
        for r, why in sorted(m.unavailable.items()):
            by_reason.setdefault(why, []).append(r)
        out.append(
            "No data from "
            + "; ".join(f"{ranks_phrase(rs)} ({why})" for why, rs in by_reason.items())
            + "."
        )
    if len(stack_groups) > 1:
        desc = "; ".join(f"{ranks_phrase(g['ranks'])}: {g['summary']}" for g in stack_groups[:6])
        more = f"; and {len(stack_groups) - 6} more stack groups" if len(stack_groups) > 6 else ""
        out.append(f"Main-thread stacks: {desc}{more}.")
    elif stack_groups:
        out.append(f"All ranks with stacks are at {stack_groups[0]['summary']}.")
    return out


def _category(
    m: Merge,
    errors: list[Finding],
    mismatches: list[Finding],
    missing: list[Finding],
    p2p: list[Finding],
    stuck: list[Finding],
    positions: Positions,
) -> tuple[str | None, str | None]:
    """One of :data:`CATEGORIES` and its one-line next step; (None, None) when clean."""
    if mismatches:
        return "misconfigured_collective", _mismatch_step(mismatches[0])
    if missing:
        return "cpu_divergence", _missing_step(missing[0], positions)
    if p2p:
        return _p2p_step(m, p2p[0], positions)
    if stuck:
        return "gpu_or_network", (
            "run `python -m debug_server.preflight` on these hosts (or nccl-tests' "
            "all_reduce_perf), then read the NCCL_DEBUG=INFO logs with "
            "`python -m debug_server.nccl_log`."
        )
    no_data = m.no_data()
    if errors or (m.waiting and no_data):
        return "unknown", (
            f"find out why {ranks_phrase(no_data) if no_data else 'some ranks'} gave no "
            "Flight Recorder data, and compare every rank's stack on /stacks."
        )
    return None, None


def _missing_step(f: Finding, positions: Positions) -> str:
    r = next((r for r in f["ranks"] if r in positions), f["ranks"][0])
    pos = positions.get(r)
    what = f"{f['op']} #{f['seq']} on {f['group_label']}"
    if pos is not None:
        loc = pos.summary if pos.in_collective else pos.position.replace(" ", " in ", 1)
        return (f"find out why rank {r} never reached {what}: its main thread is at {loc} "
                "(/stacks shows every rank).")  # fmt: skip
    return f"look at rank {r}'s stack (/stacks, or stacks_<ts>.txt): it never issued {what}."


def _p2p_step(m: Merge, f: Finding, positions: Positions) -> tuple[str, str]:
    peers = sorted({
        r for c in m.collectives
        if c["group"] == f["group"] and c["p2p_seq"] is not None
        for r in c["missing_ranks"]
    })  # fmt: skip
    away = [r for r in peers if r in positions and not positions[r].in_collective]
    if away:
        return "cpu_divergence", (
            f"find out why rank {away[0]} never posted its side of the P2P op: its main "
            f"thread is at {positions[away[0]].position.replace(' ', ' in ', 1)} "
            "(/stacks shows every rank)."
        )
    return "misconfigured_collective", (
        "post the matching send/recv on the peer, in the same order on both sides "
        f"({f['detail'].split('; ')[0]})."
    )


def _sig_text(sig: Mapping[str, Any]) -> str:
    ins, outs = sig["input_sizes"], sig["output_sizes"]
    sizes = f"{ins}" if ins == outs else f"in {ins} out {outs}"
    return f"{sig['op']} {sizes} {'/'.join(sig['dtypes'])}".rstrip()


def _mismatch_step(f: Mapping[str, Any]) -> str:
    """Make the calls agree: each side's op, sizes and dtypes and its line, odd side first."""
    sigs = f.get("signatures") or []
    if len(sigs) < 2:
        where = f" at {sigs[0]['line']}" if sigs and sigs[0].get("line") else ""
        return f"fix the call{where}: {f['detail']}."
    sides = sorted(sigs, key=lambda s: (len(s["ranks"]), s["ranks"]))
    text = "; ".join(
        f"{ranks_phrase(s['ranks'])} issue{'s' if len(s['ranks']) == 1 else ''} {_sig_text(s)}"
        + (f" at {s['line']}" if s.get("line") else "")
        for s in sides[:3]
    )
    return f"make the calls of {f['op']} #{f['seq']} on {f['group_label']} agree: {text}."


def _position_sentences(ranks: Sequence[int], positions: Positions) -> list[str]:
    out = []
    for r in list(ranks)[:3]:
        pos = positions.get(r)
        if pos is None:
            continue
        call = f" ({pos.call})" if pos.call and not pos.in_collective else ""
        where = "in a collective" if pos.in_collective else "not in a collective"
        loc = pos.summary if pos.in_collective else f"{pos.position.replace(' ', ' in ', 1)}{call}"
        out.append(f"Rank {r}'s main thread is at {loc}, {where}.")
    return out
