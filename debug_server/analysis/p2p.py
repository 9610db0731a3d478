"""P2P matching: pending sends and receives per directed peer pair, in ``p2p_seq_id`` order.

Never mixed with collectives. Pending ops of one directed pair complete in order (NCCL and gloo
both require it), so the k-th pending send pairs with the k-th pending receive; a side with no
partner is unmatched unless the peer was read too early to tell (in flight).
"""

from __future__ import annotations

from typing import Any

from debug_server.analysis import skew
from debug_server.analysis.groups import Group, GroupKey
from debug_server.analysis.merge import Merge
from debug_server.analysis.sigcheck import fmt_sizes

__all__ = ["match_p2p"]

Side = tuple[int, int, int, int, int, int]
"""(p2p_seq, signature id, state, frames id, rank, time created: the class's first rank's)."""


def match_p2p(m: Merge, g: Group, gkey: GroupKey) -> None:
    """Append ``g``'s P2P rows, NCCL call sources and findings to ``m``."""
    sends, recvs = _pending(m, g, gkey)
    unmatched: list[dict[str, Any]] = []
    times: list[int] = []
    for pair in sorted(set(sends) | set(recvs)):
        s_list = sorted(sends.get(pair, []))
        r_list = sorted(recvs.get(pair, []))
        for k in range(max(len(s_list), len(r_list))):
            s = s_list[k] if k < len(s_list) else None
            r = r_list[k] if k < len(r_list) else None
            u = _match_one(m, g, pair, s, r)
            if u is not None:
                unmatched.append(u)
                times.append((s or r)[5] or (1 << 62))  # type: ignore[index]
    if unmatched:
        # The op waited in longest first: later ones are often consequences of it.
        unmatched = [u for _, _, u in sorted(zip(times, range(len(times)), unmatched,
                                                 strict=True), key=lambda x: x[:2])]
        lines = [_unmatched_text(u, g) for u in unmatched]
        more = f"; and {len(lines) - 4} more" if len(lines) > 4 else ""
        m.finding(
            "unmatched_p2p", g, None, unmatched[0]["op"], sorted({u["peer"] for u in unmatched}),
            "; ".join(lines[:4]) + more, p2p_seq=unmatched[0]["p2p_seq"],
            waiting=sorted({u["rank"] for u in unmatched}), unmatched=unmatched[:64],
        )  # fmt: skip


def _unmatched_text(u: dict[str, Any], g: Group) -> str:
    """``rank 3 waits in recv from rank 2 (p2p #3 on pp [2, 3]) but rank 2 has no matching send``."""
    peer, holder = u["peer"], u["rank"]
    verb = "send to" if u["op"] == "send" else "recv from"
    need = "receive" if u["op"] == "send" else "send"
    return (f"rank {holder} waits in {verb} rank {peer} (p2p #{u['p2p_seq']} on {g.label}) but "
            f"rank {peer} has no matching {need}")


def _pending(
    m: Merge, g: Group, gkey: GroupKey
) -> tuple[dict[tuple[int, int], list[Side]], dict[tuple[int, int], list[Side]]]:
    """Pending sends and receives per (global src, global dst)."""
    order = sorted(g.ranks)
    sends: dict[tuple[int, int], list[Side]] = {}
    recvs: dict[tuple[int, int], list[Side]] = {}
    bad = 0
    for c in m.class_list:
        ptimes = {(n, dsc): ts for n, dsc, ts in c.d.p2p_times}
        for name, desc, _ndone, pending in c.d.p2p:
            if c.gkeys.get((name, desc)) != gkey:
                continue
            ts = ptimes.get((name, desc), ())
            for j, (p2p_seq, sidx, st, fidx, op, src, dst) in enumerate(pending):
                try:
                    gs, gd = order[src], order[dst]
                except IndexError:
                    bad += 1
                    continue
                rec = (p2p_seq, c.sig_g[sidx], st, c.fr_g[fidx] if fidx >= 0 else -1)
                t = ts[j] if j < len(ts) else 0
                for r in c.ranks:
                    if op == "send" and r == gs:
                        sends.setdefault((gs, gd), []).append((*rec, r, t))
                    elif op == "recv" and r == gd:
                        recvs.setdefault((gs, gd), []).append((*rec, r, t))
                    else:
                        bad += 1
    if bad:
        m.notes.append(f"group {g.id}: {bad} P2P entries name peers outside the group; skipped")
    return sends, recvs


def _match_one(
    m: Merge, g: Group, pair: tuple[int, int], s: Side | None, r: Side | None
) -> dict[str, Any] | None:
    """Append the row of one send/recv pairing; the side left without a partner, if any."""
    src, dst = pair
    ref = s or r
    assert ref is not None
    sig = m.sigs[ref[1]]
    missing: list[int] = []
    in_flight: list[int] = []
    mismatch = None
    unmatched = None
    if s is None or r is None:
        holder, peer = (src, dst) if r is None else (dst, src)
        peer_read = m.digest_of[peer].snap_ns if peer in m.digest_of else 0
        if peer not in m.digest_of:
            m.notes.append(
                f"{g.label}: rank {holder} waits in {sig[1]} with rank {peer}, which gave no data"
            )
        elif peer_read and ref[5] and peer_read - ref[5] < skew.IN_FLIGHT_GRACE_NS:
            # The peer was read before (or just after) this op was posted: it may post its side
            # a moment later, or have matched and finished it already.
            in_flight = [peer]
        else:
            missing = [peer]
            unmatched = {"rank": holder, "peer": peer, "op": "send" if r is None else "recv",
                         "p2p_seq": ref[0]}  # fmt: skip
    elif m.sigs[s[1]][2] != m.sigs[r[1]][3]:
        mismatch = (
            f"size mismatch: send {fmt_sizes(m.sigs[s[1]][2])} on rank {src} vs "
            f"recv {fmt_sizes(m.sigs[r[1]][3])} on rank {dst}"
        )
        m.finding("size_mismatch", g, None, "send/recv", [src, dst],
                  f"p2p #{s[0]} on {g.label}: {mismatch}", p2p_seq=s[0])  # fmt: skip
    sides = [x for x in (s, r) if x is not None]
    row = m.add_row(
        g, ref[1], ref[3], seq=None, p2p_seq=ref[0], state=min(x[2] for x in sides),
        missing=missing, present=sorted({x[4] for x in sides}), expected=sorted({src, dst}),
        lost=[], in_flight=in_flight, mismatch=mismatch,
    )
    m.calls_src.append((row, [([x[4]], x[2]) for x in sides]))
    return unmatched
