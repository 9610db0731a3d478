"""The recorder's stack capture (``recording.frames``): what it returns is the whole stack,
frame for frame and offset for offset, however the capture meets its cached anchor."""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from debug_server.recording import frames


def _walk(skip: int) -> tuple[Any, ...]:
    """The whole stack from ``skip`` frames up, walked frame by frame (no anchor)."""
    f: Any = sys._getframe(skip + 1)
    out: list[Any] = []
    while f is not None:
        out += [f.f_code, f.f_lasti]
        f = f.f_back
    return tuple(out)


def both() -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """The capture (joined) and the reference, both from this function's caller at one offset."""
    head, tail = frames.capture(2)
    return head + tail, _walk(1)


def _check(pairs: list[tuple[tuple[Any, ...], tuple[Any, ...]]]) -> None:
    assert pairs
    for got, want in pairs:
        assert got == want
        assert all(a is b for a, b in zip(got[::2], want[::2], strict=True))


def test_loops_helpers_and_recursion_capture_the_whole_stack() -> None:
    out: list[Any] = []

    def call_site() -> None:
        out.append(both())

    def loop(n: int) -> None:
        for _ in range(n):
            out.append(both())  # the same running frame, one line
            call_site()  # a fresh frame per op under a running one
            out.append(both())  # another line of the running frame

    def down(depth: int, fn: Callable[[], None]) -> None:
        fn() if depth == 0 else down(depth - 1, fn)

    for depth in (0, 3, 30, 7, 7, 1):
        down(depth, lambda: loop(4))
    _check(out)


def test_a_generator_resumed_from_other_callers_is_never_an_anchor() -> None:
    out: list[Any] = []

    def below(depth: int) -> None:
        out.append(both()) if depth == 0 else below(depth - 1)

    def gen(depth: int) -> Iterator[None]:
        while True:
            below(depth)  # the generator's frame persists; its caller changes
            yield

    def caller_a(g: Iterator[None]) -> None:
        for _ in range(3):
            next(g)

    def caller_b(g: Iterator[None]) -> None:
        for _ in range(3):
            next(g)

    # The generator at every distance from the capture's start, whatever anchor distance the
    # capture has reached.
    for depth in range(70):
        g = gen(depth)
        for _ in range(2):
            caller_a(g)
            caller_b(g)
    _check(out)
    callers = {w[4].co_name for _, w in out[:4]}  # depth 0: below, gen, its caller
    assert callers == {"caller_a", "caller_b"}


def test_threads_issuing_by_turns_each_get_their_own_stack() -> None:
    out: list[Any] = []
    turn = [threading.Event(), threading.Event()]

    def worker(me: int, depth: int) -> None:
        def step() -> None:
            for _ in range(5):
                assert turn[me].wait(10)
                turn[me].clear()
                out.append(both())
                turn[1 - me].set()

        def down(d: int) -> None:
            step() if d == 0 else down(d - 1)

        down(depth)

    ts = [threading.Thread(target=worker, args=(i, 3 + 4 * i)) for i in range(2)]
    for t in ts:
        t.start()
    turn[0].set()
    for t in ts:
        t.join(20)
    assert not any(t.is_alive() for t in ts)
    _check(out)


def test_a_returned_frame_is_let_go_after_two_idle_passes(monkeypatch: Any) -> None:
    # The next capture sets a new anchor one frame up from inner: issue's frame.
    monkeypatch.setattr(frames, "_anchor", None)
    monkeypatch.setattr(frames, "_reach", 1)
    class Big:
        pass

    def issue() -> weakref.ref[Big]:
        big = Big()  # a local of the frames the anchor may hold
        ref = weakref.ref(big)

        def inner() -> None:
            frames.capture(1)

        for _ in range(3):
            inner()
        return ref

    ref = issue()
    gc.collect()
    assert ref() is not None  # held by the anchor: issue's frame
    frames.release_idle()  # sees the anchor, unmet since: next time it goes
    frames.release_idle()
    gc.collect()
    assert ref() is None
