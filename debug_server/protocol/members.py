"""Group member lists cross the wire once per frontend, not once per rank.

Every rank's FR dump carries the full member list of every group it belongs to
(``pg_config.<g>.ranks``, a string such as ``"[0, 1, ..., 16383]"``). One fan-out over N ranks
of an N-member group therefore moves and parses O(N^2) bytes: 1.8 GB at 16384 ranks, 96 % of
the reply. So our frontend tells our workers which lists it already holds:

- the frontend sends ``pgknown=<d1>,<d2>,...`` (:func:`known_param`: the digests of the
  longest lists it has seen, within a URL budget) to our own handler only;
- the worker replaces each list whose digest is named by ``"@<digest>"`` (:func:`share`);
- the frontend puts its one copy back right after parsing (:func:`inline`), the same ``str``
  object for every rank, so parsing it once (``dumpio.group_members``) serves all ranks.

A list the frontend has not seen yet comes in full and is learnt (:func:`learn`), so the first
fetch costs what it always did and later ones do not. Torch's clients never send ``pgknown``
and get torch's format unchanged; torch's C++ workers are never sent it. The cache is
content-addressed (digest -> text) and never forgets a digest it advertised, so a reference is
always resolvable; it stops learning beyond :data:`MAX_LISTS` lists or :data:`MAX_CHARS`.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["MIN_CHARS", "PARAM", "inline", "known_param", "learn", "map_lists", "parse_known",
           "refer_text", "share"]

PARAM = "pgknown"
MIN_CHARS = 64
"""Lists up to this many characters always travel in full (a reference would save little)."""
MAX_LISTS = 4096
MAX_CHARS = 64 * 1024 * 1024
MAX_PARAM_CHARS = 1100
"""Room the ``pgknown`` value may take in the URL (64 digests; ``since`` needs the rest)."""
_DIGEST_CHARS = 16
_REF = "@"

_lock = threading.Lock()
_text_of: dict[str, str] = {}
_digest_of: dict[str, str] = {}
_weight: dict[str, int] = {}  # digest -> characters it saved or would save (how to rank them)
_chars = 0
_by_len: dict[int, list[str]] = {}  # length -> digests of lists learnt (refer_text's candidates)


@functools.lru_cache(maxsize=256)
def digest(text: str) -> str:
    # Cached: an agent references the same 100 KB world list in each of its ranks' dumps
    # (blake2b over it is ~75 us; the lookup hashes the str once, then compares by identity).
    return hashlib.blake2b(text.encode(), digest_size=_DIGEST_CHARS // 2).hexdigest()


def _lists(dump: Mapping[str, Any]) -> Iterable[dict[str, Any]]:
    cfg = dump.get("pg_config")
    if isinstance(cfg, Mapping):
        for c in cfg.values():
            if isinstance(c, dict):
                yield c


# -- worker side ----------------------------------------------------------------------------


def parse_known(raw: str) -> frozenset[str]:
    """The ``pgknown`` value: comma-separated hex digests; raises ValueError with one line."""
    if len(raw) > 64 * (_DIGEST_CHARS + 1) * 4:
        raise ValueError("too long")
    out = frozenset(d for d in raw.split(",") if d)
    for d in out:
        if len(d) != _DIGEST_CHARS or any(c not in "0123456789abcdef" for c in d):
            raise ValueError(f"{d[:20]!r} is not a {_DIGEST_CHARS}-digit hex digest")
    return out


def map_lists(dump: Mapping[str, Any], ref: Callable[[str], str | None]) -> Mapping[str, Any]:
    """``dump`` with each long member list (a string over :data:`MIN_CHARS`, not already a
    reference) replaced by ``"@" + ref(text)`` where ``ref`` gives a name; a new dict only when
    something changed (the provider's own dump is never modified)."""
    cfg = dump.get("pg_config")
    if not isinstance(cfg, Mapping):
        return dump
    new_cfg: dict[str, Any] = {}
    changed = False
    for key, c in cfg.items():
        raw = c.get("ranks") if isinstance(c, Mapping) else None
        name = ref(raw) if isinstance(raw, str) and len(raw) > MIN_CHARS and \
            not raw.startswith(_REF) else None
        if name is not None:
            new_cfg[key] = {**c, "ranks": _REF + name}
            changed = True
        else:
            new_cfg[key] = c
    return {**dump, "pg_config": new_cfg} if changed else dump


def share(dump: Mapping[str, Any], known: frozenset[str]) -> Mapping[str, Any]:
    """``dump`` with each member list the frontend holds replaced by its reference."""
    if not known:
        return dump
    return map_lists(dump, lambda text: d if (d := digest(text)) in known else None)


# -- frontend side --------------------------------------------------------------------------


def learn(dump: Mapping[str, Any]) -> None:
    """Remember the long member lists of one parsed reply (full ones only)."""
    for c in _lists(dump):
        raw = c.get("ranks")
        if not isinstance(raw, str) or len(raw) <= MIN_CHARS or raw.startswith(_REF):
            continue
        d = _remember(raw)
        if d is not None:
            c["ranks"] = _text_of[d]  # one shared object: parsed and hashed once downstream


def _remember(raw: str) -> str | None:
    """``raw``'s digest, learnt now where it is new and the cache has room (else None)."""
    global _chars
    with _lock:
        d = _digest_of.get(raw)
        if d is None:
            if len(_text_of) >= MAX_LISTS or _chars + len(raw) > MAX_CHARS:
                return None
            d = digest(raw)
            _digest_of[raw] = d
            _text_of[d] = raw
            _chars += len(raw)
            same = _by_len.setdefault(len(raw), [])
            if d not in same:
                same.append(d)
        _weight[d] = _weight.get(d, 0) + len(raw)
        return d


_CONFIG_KEY = '"pg_config":'
_RANKS_KEY = '"ranks":"'


def refer_text(text: str) -> str:
    """A reply's JSON ``text`` with each long member list under ``pg_config`` replaced by its
    reference, as a worker told ``pgknown`` writes it; :func:`inline` puts the one shared copy
    back after parsing. For replies whose writer cannot be told (torch's C++ workers write
    the world's list in every reply): 4096 ranks' lists are 96 % of each ``onlyactive`` reply,
    so parsing, hashing and holding them once per list instead of once per rank is most of what
    such a reply costs the frontend.

    Reads compact JSON as torch writes it (``"ranks":"[0, 1, ...]"``; any other spelling is
    left as it is). A list not yet held is learnt here (within the cache's bounds). A value
    with a backslash is left alone: its text is not the string it stands for.
    """
    start = text.find(_CONFIG_KEY)
    if start < 0:
        return text
    parts: list[str] = []
    done = 0
    i = text.find(_RANKS_KEY, start)
    while i >= 0:
        v = i + len(_RANKS_KEY)
        end = text.find('"', v)
        if end < 0:
            break
        d = _held(text, v, end) if end - v > MIN_CHARS else None
        if d is not None:
            parts += (text[done:v], _REF, d)
            done = end
        i = text.find(_RANKS_KEY, end)
    if not parts:
        return text
    parts.append(text[done:])
    return "".join(parts)


def _held(text: str, v: int, end: int) -> str | None:
    """The digest of the list ``text[v:end]``, learnt now where it is new."""
    for d in _by_len.get(end - v, ()):
        known = _text_of.get(d)
        if known is not None and text.startswith(known, v):  # one memcmp, no copy
            with _lock:
                _weight[d] = _weight.get(d, 0) + len(known)
            return d
    raw = text[v:end]
    if "\\" in raw or raw.startswith(_REF):
        return None
    return _remember(raw)


def inline(dump: Mapping[str, Any]) -> None:
    """Put the frontend's copy back for every reference in ``dump`` (in place). A reference it
    does not hold is left for the analyzer to refuse as an unparseable member list."""
    for c in _lists(dump):
        raw = c.get("ranks")
        if isinstance(raw, str) and raw.startswith(_REF):
            text = _text_of.get(raw[len(_REF):])
            if text is not None:
                c["ranks"] = text
                _weight[raw[len(_REF):]] = _weight.get(raw[len(_REF):], 0) + len(text)


def known_param(budget: int = MAX_PARAM_CHARS) -> str | None:
    """``pgknown`` for the next fan-out: the lists that saved the most bytes first."""
    with _lock:
        ranked = sorted(_text_of, key=lambda d: -_weight.get(d, 0))
    picked = ranked[: max(0, budget // (_DIGEST_CHARS + 1))]
    return ",".join(picked) if picked else None
