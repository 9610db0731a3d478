"""``DEBUG_SERVER_START_MARKS``: how often a c10d-backed CUDA communicator records a start mark.

The marks themselves need a GPU (``scripts/gpu/check_cuda_semantics.py`` checks that a burst of 200
collectives gets its first one marked, one per ``MARK_GAP_US`` by default, each reading ``started``); here,
what each setting means.
"""

from __future__ import annotations

import pytest

from debug_server.config import Settings
from debug_server.recording.groups import MARK_GAP_US, MARKS_ENV, _mark_gap_ns


def test_start_marks_default_to_one_per_mark_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MARKS_ENV, raising=False)
    assert _mark_gap_ns(Settings.from_env()) == MARK_GAP_US * 1000 == 500_000


def test_start_marks_all_setting_marks_every_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MARKS_ENV, "all")
    assert _mark_gap_ns(Settings.from_env()) == 0


@pytest.mark.parametrize(("value", "gap"), [("1", 500_000), ("all", 0), (" ALL ", 0), ("0", None)])
def test_start_marks_setting_gives_the_gap_between_marks(monkeypatch: pytest.MonkeyPatch, value: str,
                                                         gap: int | None) -> None:
    monkeypatch.setenv(MARKS_ENV, value)
    assert _mark_gap_ns(Settings.from_env()) == gap


def test_start_marks_unknown_setting_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MARKS_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"^environment variable DEBUG_SERVER_START_MARKS='sometimes': "
                       r"expected 1, all or 0$"):
        _mark_gap_ns(Settings.from_env())
