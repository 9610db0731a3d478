"""The Prometheus text format (0.0.4) of ``/metrics``' per-rank families, written directly.

``prometheus_client``'s ``generate_latest`` makes a sample object per sample and writes each
line in Python, checking every label name: at 131072 ranks (1.4 million samples, 81 MB of
text) one cycle's families took 9 s of the frontend's CPU (``benchmarks/bench_tree.py``,
``/metrics``). Here a family is its HELP and TYPE lines as ``generate_latest`` writes them, then
its samples, labels sorted by name, values as ``floatToGoString`` writes them; and ranks that
read alike (a run of the health poll, the ranks at one seq of a group) are one value and one
label set, their lines joined in C with only the rank between them. ``tests/test_metrics_text``
reads both writers' text of random cycles as Prometheus does (each family's HELP, TYPE and
samples) and finds them equal.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prometheus_client.utils import floatToGoString

PREFIX = "debug_server"


def _doc(doc: str) -> str:
    return doc.replace("\\", r"\\").replace("\n", r"\n")


def _esc(value: str) -> str:
    """A label value as the text format quotes it."""
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def value_text(v: float) -> str:
    """``floatToGoString(v)`` of a float: ``repr`` where that is what it writes (finite, not
    a positive value of 7 digits or more before the point), else its own answer."""
    text = repr(v)
    if text[-1] in "fn" or (v > 0 and text.find(".") > 6):  # inf, nan; Go's exponent form
        return floatToGoString(v)
    return text


def _key(v: float) -> Any:
    """``v`` as a key of values alike: -0.0 and 0.0 are equal but written apart."""
    return v if v != 0 else (v, repr(v))


class Family:
    """One gauge family's text (UTF-8 parts): ``add`` a sample; ``add_ranks`` one per rank of
    ranks that share a value and labels; ``add_values`` ranks with their values, one
    ``add_ranks`` per distinct value."""

    def __init__(self, name: str, doc: str, labels: Sequence[str]) -> None:
        self.name = f"{PREFIX}_{name}"
        self.labels = tuple(labels)
        self._sorted = sorted(self.labels)
        self._parts = [f"# HELP {self.name} {_doc(doc)}\n# TYPE {self.name} gauge\n".encode()]

    def _label_text(self, given: Mapping[str, str]) -> str:
        return ",".join(f'{k}="{_esc(given[k])}"' for k in self._sorted)

    def add(self, labels: Sequence[str], value: float) -> None:
        """One sample; ``labels`` in the family's order (``GaugeMetricFamily.add_metric``)."""
        inner = self._label_text(dict(zip(self.labels, labels, strict=True)))
        head = f"{self.name}{{{inner}}}" if inner else self.name
        self._parts.append(f"{head} {value_text(float(value))}\n".encode())

    def add_ranks(self, ranks: Iterable[int], value: float,
                  others: Mapping[str, str] | None = None) -> None:
        """One sample per rank of ``ranks``, each ``value`` and ``others`` (the labels but
        ``rank``), in the order of ``ranks``: their lines made by one ``join``."""
        given = {**(others or {}), "rank": "\0"}
        head, _, tail = f"{self.name}{{{self._label_text(given)}}} {value_text(float(value))}\n"\
            .partition("\0")
        lines = (tail + head).join(map(str, ranks))
        if lines:
            self._parts.append(f"{head}{lines}{tail}".encode())

    def add_values(self, pairs: Iterable[tuple[float, Iterable[int]]],
                   others: Mapping[str, str] | None = None) -> None:
        """``(value, its ranks)`` pairs, the ranks of each distinct value joined as one: a
        value per rank (131072 ranks' ages, ms apart) costs a dict entry each, ranks alike
        nothing more. Lines come by value, not in rank order (Prometheus reads a family's
        samples in any order)."""
        by: dict[Any, tuple[float, list[int]]] = {}
        for v, ranks in pairs:
            v = float(v)
            held = by.get(_key(v))
            if held is None:
                by[_key(v)] = (v, list(ranks))
            else:
                held[1].extend(ranks)
        for v, ranks in by.values():
            self.add_ranks(ranks, v, others)

    def parts(self) -> list[bytes]:
        return self._parts


def parts(families: Iterable[Family]) -> list[bytes]:
    """The families' text, one after the other, as UTF-8 parts (the text is their join)."""
    return [p for f in families for p in f.parts()]


def write(families: Iterable[Family]) -> bytes:
    """The families' text as one UTF-8 body."""
    return b"".join(parts(families))
