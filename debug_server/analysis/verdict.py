"""The verdict: which finding is the root cause, its category, the next step, and the prose.

:mod:`.causes` decides what explains what across groups (a rank's stream runs its ops in issue
order whatever the group, so an op a peer never joined blocks everything after it). The roots
come first, each followed by the findings it explains; the category and the next step follow
the first root. Only a stuck-everywhere that nothing explains points at the GPU, the network or
NCCL. The result carries that order (``finding_order``) and the banner's pick
(``headline_findings``), so no renderer decides it again.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from debug_server.analysis.causes import Causes, cause_order
from debug_server.analysis.merge import MISMATCH_KINDS, Merge
from debug_server.analysis.order import ops_text
from debug_server.analysis.ranks import format_ranks, ranks_phrase
from debug_server.analysis.silent import next_step as silent_step
from debug_server.analysis.silent import process_phrase
from debug_server.analysis.stackparse import Position
from debug_server.analysis.streams import UNKNOWN_T

__all__ = ["CATEGORIES", "CATEGORY_MEANING", "Verdict", "category_line", "headlines", "verdict"]

CATEGORIES = ("cpu_divergence", "gpu_busy", "gpu_or_network", "misconfigured_collective",
              "unknown")
"""The result's ``category`` (PyTorch's Flight Recorder root-cause classes, and ``gpu_busy``),
absent when clean:
``cpu_divergence`` a rank never reached the collective (or issued collectives in another order);
``gpu_busy`` every member issued it, and some members' GPUs started it while a rank's GPU has it
enqueued, not started (its stream is busy with earlier work);
``gpu_or_network`` every member's GPU started it (or no start data can exist) and none completed
it, and nothing else explains that;
``misconfigured_collective`` mismatched op, size or dtype, or unmatched P2P;
``unknown`` the evidence is too thin (ranks without data)."""

CATEGORY_MEANING = {
    "cpu_divergence": "a rank never reached the collective, or ranks issued collectives in "
                      "different orders",
    "gpu_busy": "a rank's GPU has not started the collective its peers' GPUs are in",
    "gpu_or_network": "every member is inside the collective and it does not progress",
    "misconfigured_collective": "the ranks issued different ops, sizes or dtypes",
    "unknown": "too little evidence to tell",
}
"""One short phrase per :data:`CATEGORIES` entry, for the renderers' "Category:" line."""

HEADLINES_MAX = 4
"""The banner names at most this many problems (more only before the first missing rank)."""
HEADLINE_MISSING_MAX = 3
HEADLINE_ROOTS_MAX = 3
"""The verdict tells at most this many independent problems (roots) in full."""
CONSEQUENCES_SHOWN = 3
"""Consequences named under each root in the prose (all of them are in ``finding_order``)."""

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
    """The verdict over ``m``'s findings (sorted by kind already), joined with the stacks.

    The root cause comes first, each with the findings it explains after it (:mod:`.causes`):
    category and next step follow the first root.
    """
    causes = Causes(m, m.groups, positions)
    roots, ordered = cause_order(causes)
    _mark_consequences(causes, roots, ordered)
    root = roots[0] if roots else None
    category, step = _category(m, root, causes, positions)
    parts: list[str] = []
    explained = {id(f) for f in ordered} - {id(f) for f in roots}
    for f in roots[:HEADLINE_ROOTS_MAX]:
        parts.extend(_root_sentences(f, m, positions, category if f is root else None))
        parts.extend(_thread_sentences(f, m))
        parts.extend(_consequence_sentences(f, ordered, explained))
    if len(roots) > HEADLINE_ROOTS_MAX:
        parts.append(f"And {len(roots) - HEADLINE_ROOTS_MAX} more independent problems (see the findings).")
    if root is None:
        parts.extend(_clean_sentences(m))
    if step:
        parts.append(f"Next step: {step}")
    parts.extend(_context_sentences(m, stack_groups))
    ids = {id(f) for f in ordered}
    ordered = ordered + [f for f in m.findings if id(f) not in ids]
    index = {id(f): i for i, f in enumerate(m.findings)}
    return Verdict(" ".join(parts), category, step, [index[id(f)] for f in ordered])


def _mark_consequences(causes: Causes, roots: list[Finding], ordered: list[Finding]) -> None:
    """Each consequence says what explains it (``explained_by``: the rank through which it does,
    that rank's op, and the finding that covers it), so renderers can show it under its cause."""
    root_ids = {id(f) for f in roots}
    for f in ordered:
        if id(f) in root_ids:
            continue
        edges = causes.edges(f)
        if not edges:
            continue
        e = next((e for e in edges if id(e.cause) in root_ids), edges[0])
        c = e.cause
        by = {"kind": c["kind"], "group": c["group"], "group_label": c["group_label"],
              "seq": c["seq"], "p2p_seq": c.get("p2p_seq"), "op": c["op"], "rank": e.rank}
        if e.op is not None:
            g = causes.by_id.get(e.op[0])
            by.update(group=e.op[0], group_label=g.label if g is not None else e.op[0],
                      op=e.op_name, seq=None if e.op[1] else e.op[2],
                      p2p_seq=e.op[2] if e.op[1] else None)
        f["explained_by"] = by


def headlines(findings: Sequence[Mapping[str, Any]], order: Sequence[int]) -> list[int]:
    """The findings the banner names, in ``order``: errors only (not the ops of an order
    inversion, which the inversion names), at most three missing-rank ones, and after the first
    of those at most :data:`HEADLINES_MAX` in all."""
    # An inversion's own ops are the inversion: their stuck or missing findings stay out.
    errors = [i for i in order if findings[i].get("severity", "error") != "info"
              and (findings[i].get("explained_by") or {}).get("kind") != "order_inversion"]
    is_missing = [findings[i]["kind"] == "missing_ranks" for i in errors]
    first_missing = is_missing.index(True) if True in is_missing else 0
    heads = errors[:first_missing]
    heads += [i for i, mi in zip(errors, is_missing, strict=True) if mi][:HEADLINE_MISSING_MAX]
    for i, mi in zip(errors[first_missing:], is_missing[first_missing:], strict=True):
        if not mi and len(heads) < HEADLINES_MAX:
            heads.append(i)
    return heads


def _op_text(f: Mapping[str, Any]) -> str:
    """``all_reduce #24 on mesh_tp [2, 3]``, ``recv p2p #3 on pp [2, 3]``."""
    if f.get("seq") is None and f.get("p2p_seq") is not None:
        return f"{f['op']} p2p #{f['p2p_seq']} on {f['group_label']}"
    return f"{f['op']} #{f['seq']} on {f['group_label']}"


def _root_sentences(
    f: Finding, m: Merge, positions: Positions, category: str | None
) -> list[str]:
    """What one root finding says, with where its ranks are."""
    kind = f["kind"]
    if kind in MISMATCH_KINDS:
        out = [f"Mismatch in {f['detail']}."]
        out.extend(_position_sentences(f["ranks"][:3], positions))
        if any(s["kind"] == "stuck_everywhere" and (s["group"], s["seq"]) == (f["group"], f["seq"])
               for s in m.findings):
            out.append(f"The mismatch is why no rank completes {f['op']} #{f['seq']}: the GPU and "
                       "the network are not to blame.")
        return out
    if kind == "missing_ranks":
        rs = f["ranks"]
        subj = "Rank" if len(rs) == 1 else "Ranks"
        waiting = f.get("waiting") or []
        verb = "waits" if len(waiting) == 1 else "wait"
        tail = f" ({ranks_phrase(waiting)} {verb} in it)" if waiting else ""
        silent = f.get("silent") or {}
        head = f"{subj} {format_ranks(rs)} never joined {_op_text(f)}{tail}."
        if silent and all(ev.get("in_collective") for ev in silent.values()):
            # Stopped inside a collective: which one, its FR cannot say (it gave none).
            head = (f"{ranks_phrase(waiting).capitalize()} {verb} in {_op_text(f)}, and "
                    f"{ranks_phrase(rs)} cannot take part: stopped inside a collective.")
        return [head, *_silent_sentences(f, m), *_position_sentences(rs, positions),
                *_process_sentences(rs, m, f, positions)]
    if kind == "unmatched_p2p":
        out = []
        for u in (f.get("unmatched") or [])[:2]:
            need = "recv" if u["op"] == "send" else "send"
            verb = "send to" if u["op"] == "send" else "recv from"
            out.append(f"Rank {u['peer']} never posted the {need} that rank {u['rank']} waits for "
                       f"({verb} rank {u['peer']}, p2p #{u['p2p_seq']} on {f['group_label']}).")
        if not out:
            out.append(f"P2P deadlock or missing peer: {f['detail']}.")
        out.extend(_position_sentences(f["ranks"][:3], positions))
        return out
    if kind == "order_inversion":
        return _inversion_sentences(f, positions)
    if kind == "stuck_everywhere":
        head = (f"All {len(f['ranks'])} ranks of {f['group_label']} issued {f['op']} #{f['seq']} "
                "and none completed it")
        if category == "gpu_busy":
            return [head + ".", *_busy_sentences(f, m)]
        if category == "unknown":
            return [head + "; no rank's record says its GPU started it (start timing is off), so "
                    "it cannot tell whether one GPU is behind or the network is stuck."]
        return [head + ("; every member's GPU is inside it, and no rank is missing and no "
                        "mismatch explains it, so suspect the GPU, the network or the NCCL "
                        "transport." if category == "gpu_or_network" else ".")]
    return [f"{f['detail']}."]


def _inversion_sentences(f: Finding, positions: Positions) -> list[str]:
    """The two orders, the odd ranks first, and why neither side can complete."""
    rs, others = f["ranks"], f["others"]
    subj = ranks_phrase(rs)
    streams = ("Each rank runs its collectives in the order it issued them, so none of these "
               "completes.")
    if f.get("undecided"):
        a, b = (side["ranks"] for side in f["sides"])
        out = [f"Ranks issued collectives in different orders, as many ranks each way, so it "
               f"cannot tell which side is odd: {ranks_phrase(a)} issued {ops_text(f['ops'])}; "
               f"{ranks_phrase(b)} issued {ops_text(f['others_ops'])} (or one side skipped an op "
               f"the other waits in). {streams}"]
    elif f.get("certain", True):
        out = [f"Ranks issued collectives in different orders: {subj} issued "
               f"{ops_text(f['ops'])}; {ranks_phrase(others)} issued "
               f"{ops_text(f['others_ops'])}. {streams}"]
    else:
        first = f["ops"][0]
        verb = "waits" if len(others) == 1 else "wait"
        out = [f"{subj.capitalize()} never joined {_op_text(f)} ({ranks_phrase(others)} {verb} "
               f"in it): {'it' if len(rs) == 1 else 'they'} issued {ops_text([first])} first, "
               f"which {ranks_phrase(others)} issue{'s' if len(others) == 1 else ''} after it. "
               f"The ranks issued these collectives in different orders (or {subj} skipped "
               f"{_op_text(f)}). {streams}"]
    out.extend(_position_sentences(f["ranks"][:1] + f["others"][:1], positions))
    return out


def _busy_sentences(f: Finding, m: Merge) -> list[str]:
    """``Rank 1's GPU has not started it ...``: the busy ranks, what their stream last
    completed and for how long the op has waited there."""
    late, started = f["not_started"], f["started"]
    subj = "Rank" if len(late) == 1 else "Ranks"
    out = [f"{subj} {format_ranks(late)}'s GPU{'s have' if len(late) > 1 else ' has'} it "
           f"enqueued but not started, while {ranks_phrase(started)}'s GPU"
           f"{'s are' if len(started) > 1 else ' is'} inside it: "
           f"{'that stream is' if len(late) == 1 else 'those streams are'} busy with earlier work "
           "(a long kernel, a host-device copy, a synchronisation) or the GPU is stuck."]
    r = late[0]
    c = m.class_of.get(r)
    if c is not None:
        ops = m.ops(c)
        k = (f["group"], False, f["seq"])
        t, snap = ops.time(k), m.digest_of[r].snap_ns
        last = ops.done[-1] if ops.done else None
        parts = []
        if last is not None:
            g = next((g for g in m.groups.values() if g.id == last[1][0]), None)
            parts.append(f"its stream last completed {m.sigs[last[2]][1]} #{last[1][2]} on "
                         f"{g.label if g is not None else last[1][0]}")
        if snap and t != UNKNOWN_T and snap > t:
            parts.append(f"{f['op']} #{f['seq']} was enqueued {(snap - t) / 1e9:.1f} s before "
                         "its record was read")
        if parts:
            out.append(f"Rank {r}: " + "; ".join(parts) + ".")
    return out


def _consequence_sentences(root: Finding, ordered: list[Finding], explained: set[int]) -> list[str]:
    """The findings listed under ``root`` (up to the next root), as one sentence."""
    start = next(i for i, f in enumerate(ordered) if f is root)
    under: list[Finding] = []
    for f in ordered[start + 1:]:
        if id(f) not in explained:
            break
        if _same_op_and_ranks(f, root):
            continue  # the root says it already (an inversion's op the odd ranks never issued)
        under.append(f)
    if not under:
        return []
    phrases = [_consequence_phrase(f) for f in under[:CONSEQUENCES_SHOWN]]
    more = len(under) - CONSEQUENCES_SHOWN
    return ["Because of it: " + "; ".join(phrases)
            + (f"; and {more} more" if more > 0 else "") + "."]


def _same_op_and_ranks(f: Finding, root: Finding) -> bool:
    return (f["kind"] == "missing_ranks" and root["kind"] == "order_inversion"
            and (f["group"], f["seq"], f["ranks"]) == (root["group"], root["seq"], root["ranks"]))


def _consequence_phrase(f: Finding) -> str:
    cause = f.get("explained_by")
    why = ""
    if cause and cause.get("rank") is None:
        why = " (the calls disagree)"
    elif cause:
        how = "has {} ahead of it" if f["kind"] == "stuck_everywhere" else "waits in {}"
        why = f" (rank {cause['rank']} {how.format(_op_text(cause))})"
    if f["kind"] == "stuck_everywhere":
        return f"{_op_text(f)} does not complete on any rank{why}"
    if f["kind"] == "missing_ranks":
        return f"{ranks_phrase(f['ranks'])} never joined {_op_text(f)}{why}"
    if f["kind"] == "unmatched_p2p":
        return f"{ranks_phrase(f['ranks'])} never posted the peer side of {_op_text(f)}{why}"
    return f"{f['detail']}{why}"


def _clean_sentences(m: Merge) -> list[str]:
    """No error found: how much was checked, and who might be missing for lack of data.

    Never "no hang" while ranks wait and others gave no data: those may be the missing ones.
    """
    n = sum(1 for c in m.collectives if c["seq"] is not None)
    nr = len(m.data_ranks)
    checked = f"({nr} rank{'s' if nr != 1 else ''}, {n} collectives checked)"
    no_data = m.no_data()
    if m.waiting and no_data:
        w = m.waiting[0]
        return [
            f"{ranks_phrase(w['ranks']).capitalize()} wait{'s' if len(set(w['ranks'])) == 1 else ''} "
            f"in {w['op']} #{w['seq']} on {w['label']} "
            f"and {ranks_phrase(no_data)} gave no data: {'it' if len(no_data) == 1 else 'they'} "
            f"may be the one{'s' if len(no_data) > 1 else ''} missing. The ranks with data agree "
            f"{checked}."
        ]
    if not m.data_ranks:
        return ["No Flight Recorder data from any rank; nothing to match."]
    return [f"No hang or mismatch found in the Flight Recorder data {checked}."]


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
    m: Merge, root: Finding | None, causes: Causes, positions: Positions
) -> tuple[str | None, str | None]:
    """One of :data:`CATEGORIES` and its one-line next step, from the root; (None, None) when clean."""
    if root is None:
        no_data = m.no_data()
        if m.waiting and no_data:
            return "unknown", (
                f"find out why {ranks_phrase(no_data)} gave no Flight Recorder data, and compare "
                "every rank's stack on /stacks."
            )
        return None, None
    kind = root["kind"]
    if kind in MISMATCH_KINDS:
        return "misconfigured_collective", _mismatch_step(root)
    if kind == "missing_ranks":
        return "cpu_divergence", _missing_step(root, causes, positions)
    if kind == "unmatched_p2p":
        return _p2p_step(root, causes, positions)
    if kind == "order_inversion":
        return "cpu_divergence", _inversion_step(root)
    if kind == "stuck_everywhere" and root.get("not_started") and root.get("started"):
        late = root["not_started"]
        return "gpu_busy", (
            f"look at what {ranks_phrase(late)}'s GPU runs before {root['op']} #{root['seq']} "
            "(nvidia-smi, py-spy dump --native, or a profile of the step); if nothing should be "
            "running, move the job off that GPU.")
    if kind == "stuck_everywhere" and root.get("not_started") and not root.get("started"):
        return "unknown", (
            "turn start timing on (TORCH_NCCL_ENABLE_TIMING=1, or call start_debug_server "
            "before the first process group: it turns timing on) so the record says which GPU "
            "is behind; if every GPU then starts the op, run `python -m debug_server.preflight`.")
    return "gpu_or_network", (
        "run `python -m debug_server.preflight` on these hosts (or nccl-tests' "
        "all_reduce_perf), then read the NCCL_DEBUG=INFO logs with "
        "`python -m debug_server.nccl_log`."
    )


def _inversion_step(f: Finding) -> str:
    """Issue them in one order on every rank: the odd ranks' call sites first."""
    lines = [f"{o['op']} #{o['seq']} on {o['group_label']}"
             + (f" at {o['line']}" if o.get("line") else "") for o in f["ops"] if o["issued"]]
    return (f"issue these collectives in one order on every rank: {ranks_phrase(f['ranks'])} "
            f"issued {', then '.join(lines)} (look for iteration over a set or dict, a "
            "rank-dependent branch, or a second thread issuing collectives).")


def _elsewhere(causes: Causes, r: int, f: Finding) -> str:
    """`` and went on to barrier #3 on pg 0 (default_pg) at train.py:90`` when the FR shows
    where rank ``r`` is blocked instead; else ``""``."""
    held = causes.blocked_in(r, f)
    if held is None:
        return ""
    what, line = held
    return f"; it went on to {what}" + (f" at {line}" if line else "") + " instead"


def _missing_step(f: Finding, causes: Causes, positions: Positions) -> str:
    for key, ev in (f.get("silent") or {}).items():
        step = silent_step(ev, int(key))
        if step:
            return step
    r = next((r for r in f["ranks"] if r in positions), f["ranks"][0])
    pos = positions.get(r)
    what = _op_text(f)
    if pos is not None and pos.leaving:
        return (f"find out why rank {r} is leaving while its peers wait in {what} ({pos.leaving} "
                f"at {pos.position.replace(' ', ' in ', 1)}): look for an error earlier in its "
                "log, or a loop that ends sooner on that rank.")
    if pos is not None:
        loc = pos.summary if pos.in_collective else pos.position.replace(" ", " in ", 1)
        return (f"find out why rank {r} never reached {what}: its main thread is at {loc} "
                "(/stacks shows every rank).")  # fmt: skip
    return (f"look at rank {r}'s stack (/stacks, or stacks_<ts>.txt): it never issued "
            f"{what}{_elsewhere(causes, r, f)}.")


def _p2p_step(f: Finding, causes: Causes, positions: Positions) -> tuple[str, str]:
    """A peer that is elsewhere (its stack, or blocked in another op) diverged on the CPU; peers
    that both wait for each other posted their P2P ops in an order that cannot match."""
    for r in f["ranks"]:
        pos = positions.get(r)
        if pos is not None and not pos.in_collective:
            return "cpu_divergence", (
                f"find out why rank {r} never posted its side of the P2P op: its main "
                f"thread is at {pos.position.replace(' ', ' in ', 1)} (/stacks shows every rank)."
            )
        away = _elsewhere(causes, r, f)
        if away:
            u = next((u for u in f.get("unmatched") or () if u["peer"] == r), None)
            need = ("recv" if u["op"] == "send" else "send") if u else "side"
            waiter = f" for rank {u['rank']}" if u else ""
            where = f" (its main thread is at {pos.summary})" if pos is not None else ""
            return "cpu_divergence", (
                f"find out why rank {r} never posted its {need}{waiter} on "
                f"{f['group_label']}{away}{where}."
            )
    u = _idle_peer(f, causes.m)
    if u is not None:
        # (What it completed last is not said: a live window may hold none of it.)
        return "cpu_divergence", (
            f"find out where rank {u['peer']} is: it has no op in flight, so it never "
            f"reached its {'recv' if u['op'] == 'send' else 'send'} for rank {u['rank']} on "
            f"{f['group_label']}; its stack (/stacks, or stacks_<ts>.txt) shows the line.")
    return "misconfigured_collective", (
        "post the matching send/recv on the peer, in the same order on both sides "
        f"({f['detail'].split('; ')[0]})."
    )


def _idle_peer(f: Finding, m: Merge) -> dict[str, Any] | None:
    """An unmatched P2P op whose peer has data and nothing in flight at all: the peer is away
    on its CPU (a loop that stopped, a sleep, a branch), not posting in another order."""
    for u in f.get("unmatched") or ():
        c = m.class_of.get(u["peer"])
        if c is not None and not m.ops(c).blocked:
            return dict(u)
    return None


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


def _thread_sentences(f: Finding, m: Merge) -> list[str]:
    """Two threads of one rank issuing on the finding's group(s): their order is not fixed."""
    gids = {f["group"]} | {o["group"] for o in f.get("ops") or ()}
    out = []
    for c in m.class_list:
        for name, desc, names in c.d.threads:
            g = m.groups.get(c.gkeys.get((name, desc), ("", ())))
            if g is None or g.id not in gids:
                continue
            out.append(f"{ranks_phrase(c.ranks).capitalize()} issued ops on {g.label} from "
                       f"{len(names)} threads ({', '.join(names[:4])}): the order in which two "
                       "threads issue collectives differs between ranks; issue them from one "
                       "thread, or give the other thread a group of its own.")
            gids.discard(g.id)
    return out[:2]


def _silent_sentences(f: Finding, m: Merge) -> list[str]:
    """``Rank 2 cannot answer: its main thread holds the GIL in a C call at train.py:47.``"""
    out = []
    for key, ev in list((f.get("silent") or {}).items())[:3]:
        proc = ev.get("process")
        where = ev.get("position")
        what = process_phrase(proc, gil=ev.get("holds_gil", False), where=where or "")
        if not what and where:
            what = f"its stack, read from outside, is at {where}"
        elif not what:
            what = "it gave no data"
        out.append(f"Rank {key} cannot answer: {what}.")
    return out


def _process_sentences(ranks: Sequence[int], m: Merge, f: Finding,
                       positions: Positions) -> list[str]:
    """The process state of answering ranks where it says more than their stack does (a rank
    waiting inside a collective sleeps in the kernel as it should: nothing to add)."""
    silent = f.get("silent") or {}
    out = []
    for r in list(ranks)[:3]:
        pos = positions.get(r)
        if str(r) in silent or (pos is not None and pos.in_collective):
            continue
        what = process_phrase(m.processes.get(r))
        if what:
            out.append(f"Rank {r}: {what}.")
    return out


def _position_sentences(ranks: Sequence[int], positions: Positions) -> list[str]:
    out = []
    for r in list(ranks)[:3]:
        pos = positions.get(r)
        if pos is None:
            continue
        call = f" ({pos.call})" if pos.call and not pos.in_collective else ""
        where = "in a collective" if pos.in_collective else "not in a collective"
        if pos.leaving:
            out.append(f"Rank {r} is leaving: {pos.leaving} at "
                       f"{pos.position.replace(' ', ' in ', 1)}, not in a collective.")
            continue
        loc = pos.summary if pos.in_collective else f"{pos.position.replace(' ', ' in ', 1)}{call}"
        out.append(f"Rank {r}'s main thread is at {loc}, {where}.")
    return out
