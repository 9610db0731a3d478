"""Which process group each rank's entries belong to: name plus member ranks, never name alone.

Ranks with equal digests form one :class:`RankClass`; :func:`resolve_groups` maps every class's
(name, desc) to one :class:`Group`. Members come from ``pg_config``; PyTorch's gloo dumps name the
world group "0" in entries but write its config under "" (or not at all), so that group is the
world; any other group without members gets the ranks whose entries name it, with a note.
"""

from __future__ import annotations

from debug_server.analysis.digest import RankDigest
from debug_server.analysis.ranks import format_ranks

__all__ = ["Group", "GroupKey", "RankClass", "group_label", "rank_list_text", "resolve_groups"]

GroupKey = tuple[str, tuple[int, ...]]
"""(name, member ranks): two groups may share a name but not both."""


class Group:
    """One process group as the result shows it (``id``) and the verdict names it (``label``)."""

    __slots__ = ("id", "name", "desc", "ranks", "inferred", "rank_set", "label")

    def __init__(
        self, gid: str, name: str, desc: str, ranks: tuple[int, ...], inferred: bool,
        label: str | None = None,
    ) -> None:
        self.id = gid
        self.name = name
        self.desc = desc
        self.ranks = list(ranks)
        self.rank_set = frozenset(ranks)
        self.inferred = inferred
        self.label = label if label is not None else group_label(gid, name, desc, ranks)


def _user_desc(desc: str) -> bool:
    return desc not in ("", "undefined")


def _is_hash(name: str) -> bool:
    """DeviceMesh and split groups get hashed names (40 hex digits): nobody reads those."""
    return len(name) >= 16 and all(ch in "0123456789abcdef" for ch in name.lower())


def rank_list_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``[2, 3]``; long lists collapsed (``[0-63]``, ``[0, 8, 16, ..., 56] (8 ranks)``)."""
    rs = sorted(ranks)
    if len(rs) <= 6:
        return str(rs)
    text = format_ranks(rs)
    if text.count(",") < 6:
        return f"[{text}]"
    return f"[{rs[0]}, {rs[1]}, {rs[2]}, ..., {rs[-1]}] ({len(rs)} ranks)"


def group_label(gid: str, name: str, desc: str, ranks: tuple[int, ...], *,
                desc_shared: bool = False, name_shared: bool = False) -> str:
    """How a person reads a group: the name the user gave it, and its ranks where that is needed.

    ``main_comm`` (a communicator's own name); ``pg 2 (mesh_tp)`` for c10d's numbered groups
    (``pg 2 (mesh_tp [2, 3])`` when another group has that desc); ``mesh_tp [2, 3]`` for a group
    with a hashed name; ``main_comm [0, 1]`` when two groups share a name. The id itself stays in
    the result's ``group`` fields and tooltips.
    """
    rs = rank_list_text(ranks)
    # PyTorch's own groups are named "0", "1"...; the gloo side of a "cpu:gloo,cuda:nccl" group
    # is "0:gloo" (c10d_fr).
    if name.removesuffix(":gloo").isdigit():
        if not _user_desc(desc):
            return f"pg {name} {rs}" if name_shared else f"pg {name}"
        return f"pg {name} ({desc} {rs})" if desc_shared or name_shared else f"pg {name} ({desc})"
    if _is_hash(name):
        return f"{desc} {rs}" if _user_desc(desc) else f"group {rs}"
    return f"{name} {rs}" if name_shared else (gid or "?")


class RankClass:
    """Ranks whose digests are equal, with their signatures and frames in the merge's tables."""

    __slots__ = ("idx", "ranks", "d", "sig_g", "fr_g", "gkeys")

    def __init__(self, idx: int, d: RankDigest) -> None:
        self.idx = idx
        self.ranks: list[int] = [d.rank]
        self.d = d
        self.sig_g: list[int] = []
        self.fr_g: list[int] = []
        self.gkeys: dict[tuple[str, str], GroupKey] = {}
        """(name, desc) as the entries say -> the group it resolved to."""


def resolve_groups(
    classes: list[RankClass], world_size: int, notes: list[str]
) -> dict[GroupKey, Group]:
    """Every group some class's entries name, sorted by (name, ranks); fills ``gkeys``."""
    referenced: dict[tuple[str, str], set[int]] = {}
    for c in classes:
        for name, desc, *_ in (*c.d.colls, *c.d.p2p):
            referenced.setdefault((name, desc), set()).update(c.ranks)
    keys: dict[GroupKey, tuple[str, bool]] = {}
    world = tuple(range(world_size))
    for c in classes:
        for name, desc, shown, rs, inferred in _class_groups(c, world, referenced, notes):
            # Keyed by the entries' own (name, desc): that is what matching looks up.
            c.gkeys[(name, desc)] = (name, rs)
            keys.setdefault((name, rs), (shown, inferred))
    by_name: dict[str, int] = {}
    by_desc: dict[str, int] = {}
    for (name, _), (desc, _) in keys.items():
        by_name[name] = by_name.get(name, 0) + 1
        by_desc[desc] = by_desc.get(desc, 0) + 1
    groups: dict[GroupKey, Group] = {}
    for (name, rs), (desc, inferred) in sorted(keys.items(), key=lambda kv: kv[0]):
        gid = name if by_name[name] == 1 else f"{name}[{format_ranks(rs)}]"
        label = group_label(gid or "?", name, desc, rs, desc_shared=by_desc[desc] > 1,
                            name_shared=by_name[name] > 1)
        groups[(name, rs)] = Group(gid or "?", name, desc, rs, inferred, label)
    return groups


def _class_groups(
    c: RankClass,
    world: tuple[int, ...],
    referenced: dict[tuple[str, str], set[int]],
    notes: list[str],
) -> list[tuple[str, str, str, tuple[int, ...], bool]]:
    """(name, desc, shown desc, members, inferred) per group the class's entries name.

    ``desc`` is the entries' own; the shown one is pg_config's where the entries leave it empty.
    """
    cfg = {name: (desc, rs) for name, desc, rs in c.d.pg if rs}
    unnamed = [rs for name, _, rs in c.d.pg if rs and name == ""]
    names = {(n, dsc) for n, dsc, _ in c.d.colls} | {(n, dsc) for n, dsc, _, _ in c.d.p2p}
    unresolved = [nd for nd in names if nd[0] not in cfg]
    out: list[tuple[str, str, str, tuple[int, ...], bool]] = []
    for name, desc in names:
        if name in cfg:
            desc_cfg, rs = cfg[name]
            out.append((name, desc, desc or desc_cfg, rs, False))
            continue
        if desc == "default_pg" or (len(unresolved) == 1 and unnamed and len(unnamed) == 1):
            # PyTorch's gloo FR names the world group "0" in entries but writes its pg_config
            # under "" (or not at all): the default group is the world.
            rs = unnamed[0] if (desc != "default_pg" and unnamed) else world
        else:
            rs = tuple(sorted(referenced.get((name, desc), set())))
            notes.append(
                f"group {name or '?'}: no ranks in pg_config; members inferred from "
                f"the ranks whose entries name it ({format_ranks(rs)})"
            )
        out.append((name, desc, desc, rs, True))
    return out
