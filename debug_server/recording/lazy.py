"""A Flight Recorder dump whose entries are built only when they are kept.

Building an entry (its stack, sizes, dtypes, thread name) costs microseconds, and a worker asked
for the live window (``analysis.frwindow``) keeps a handful of a 2000-entry ring. So the
recorders first produce a :class:`LazyDump`: the dump without its entries (``head``) and, per
entry, its source (an ``OpRecord``, or an entry already built) with the :class:`Source` that
knows how to read it. A :data:`Cut` picks entries from their *keys* (at least
:data:`KEY_FIELDS`, with the values the built entry will have); only the picked ones are built.
Without a cut no key is made and every entry is built, as a full read always did.

The cut is a parameter, not an import: the recording side knows nothing of the analysis; the
per-rank worker passes ``frwindow``'s window in.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BUILT", "FRESH", "KEY_FIELDS", "Cut", "LazyDump", "Source"]

KEY_FIELDS = ("record_id", "process_group", "collective_seq_id", "profiling_name", "state",
              "retired", "is_p2p", "time_created_ns", "time_discovered_completed_ns")
"""Entry fields every key carries: what the window and the frontier read, and the ids."""

Cut = Callable[[Mapping[str, Any], Sequence[Mapping[str, Any]]],
               tuple[Sequence[int], Mapping[str, Any]]]
"""``cut(head, keys)`` -> (indices of the kept entries in output order, fields added to the
dump). ``head`` is the dump without entries, ``keys`` one key per entry in dump order."""


@dataclass(frozen=True, slots=True)
class Source:
    """How entries of one kind are keyed and built (one per dump and kind, not per entry)."""

    key: Callable[[Any], Mapping[str, Any]]
    """The entry's key, its fields read once (at least :data:`KEY_FIELDS`), which a cut reads
    as it would read the built entry's (c10d's own entry keeps ``gloo:`` in its name and 0 for
    an unknown time, which the window reads as it reads ``nccl:`` and None)."""
    build: Callable[[Any, Any], dict[str, Any]]
    """The whole entry; from its key's values when a key was made (``None``: none was)."""
    created: Callable[[Any], Any]
    """The entry's ``time_created_ns`` (a merged timeline is ordered by it)."""
    fresh: bool = False
    """``build`` makes a new dict (renumbering may change it in place)."""


def _itself(e: Any) -> Any:
    return e


def _built(e: Any, key: dict[str, Any] | None) -> Any:
    return e


_created = operator.methodcaller("get", "time_created_ns")
BUILT = Source(_itself, _built, _created)
"""Entries already built (a served dump): each is its own key, and never changed here."""
FRESH = Source(_itself, _built, _created, fresh=True)
"""Entries just built for this dump alone (c10d's repaired entries): each is its own key."""


@dataclass(slots=True)
class LazyDump:
    """One FR dump (torch schema) with entries not yet built; see the module doc."""

    head: dict[str, Any]
    """Every top-level field but ``entries`` (``version``, ``pg_config``, ``pg_status``...)."""
    items: list[Any] = field(default_factory=list)
    """Per entry, in dump order: what its source reads (a record, a built entry)."""
    sources: list[Source] = field(default_factory=list)
    """Per entry, in dump order: its :class:`Source`."""
    renumber: bool = False
    """Built entries get ``record_id`` = their position in this dump (a merged timeline)."""
    _keys: list[Mapping[str, Any]] | None = None

    @classmethod
    def of(cls, dump: Mapping[str, Any]) -> LazyDump:
        """A built dump as a lazy one: its entries are their own keys (never copied here)."""
        out = cls({k: v for k, v in dump.items() if k != "entries"})
        entries = dump.get("entries")
        if isinstance(entries, list):
            out.extend(entries, BUILT)
        return out

    def extend(self, items: Sequence[Any], source: Source) -> None:
        self.items.extend(items)
        self.sources.extend([source] * len(items))
        self._keys = None

    def keys(self) -> list[Mapping[str, Any]]:
        """Every entry's key, in dump order (made once)."""
        if self._keys is None:
            self._keys = [s.key(it) for s, it in zip(self.sources, self.items, strict=True)]
        return self._keys

    def merged(self, other: LazyDump, head: dict[str, Any]) -> LazyDump:
        """This dump's entries then ``other``'s under ``head``, ordered by creation time (a
        stable sort: equal times keep that order), record ids renumbered along the result."""
        items, sources = self.items + other.items, self.sources + other.sources
        order = sorted(range(len(items)), key=lambda i: sources[i].created(items[i]) or 0)
        return LazyDump(head, [items[i] for i in order], [sources[i] for i in order], True)

    def finish(self, cut: Cut | None = None) -> dict[str, Any]:
        """The dump with its entries: all of them, or those ``cut`` picks (plus its fields)."""
        out = dict(self.head)
        items, sources = self.items, self.sources
        extra: Mapping[str, Any] = {}
        if cut is None:
            entries = [s.build(it, None) for s, it in zip(sources, items, strict=True)]
            picked: Sequence[int] = range(len(entries))
        else:
            keys = self.keys()
            picked, extra = cut(out, keys)
            entries = [sources[i].build(items[i], keys[i]) for i in picked]
        if self.renumber:
            for n, i in enumerate(picked):
                if sources[i].fresh:
                    entries[n]["record_id"] = i
                else:  # the caller's own dict: a copy
                    entries[n] = {**entries[n], "record_id": i}
        out["entries"] = entries
        out.update(extra)
        return out
