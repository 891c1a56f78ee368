"""narwhal.http.sockwatch: many sockets watched for readability from one task."""

from __future__ import annotations

import logging
import socket

import pytest
import trio

from narwhal.http import sockwatch
from narwhal.http.sockwatch import SocketWatch

pytestmark = pytest.mark.skipif(not sockwatch.available(), reason="no epoll")


class _Reading:
    """A socket pair, ``a`` watched: its callback reads what ``b`` sent into ``calls``."""

    def __init__(self) -> None:
        self.a, self.b = socket.socketpair()
        self.a.setblocking(False)
        self.calls: list[bytes] = []
        self.called = trio.Event()

    def on_readable(self) -> None:
        self.calls.append(self.a.recv(100))
        self.called.set()


async def test_a_callback_runs_while_its_socket_is_readable_and_not_after_unwatch() -> None:
    watch = SocketWatch()
    pair = _Reading()
    a, b, calls, called, on_readable = pair.a, pair.b, pair.calls, pair.called, pair.on_readable
    with a, b, trio.fail_after(5):
        watch.watch(a.fileno(), on_readable)
        assert len(watch) == 1
        await trio.sleep(0.05)
        assert calls == []  # nothing to read
        b.send(b"one")
        await called.wait()
        assert calls == [b"one"]  # read, so level-triggered epoll does not call again
        await trio.sleep(0.05)
        assert calls == [b"one"]
        watch.unwatch(a.fileno())
        watch.unwatch(a.fileno())  # unwatching twice is harmless
        assert len(watch) == 0
        b.send(b"two")
        await trio.sleep(0.05)
        assert calls == [b"one"]


async def test_a_failing_callback_is_logged_and_unwatched_others_still_run(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = SocketWatch()
    a, b = socket.socketpair()
    c, d = socket.socketpair()
    c.setblocking(False)
    seen: list[bytes] = []
    called = trio.Event()

    def record() -> None:
        seen.append(c.recv(100))
        called.set()

    def broken() -> None:
        raise RuntimeError("boom")

    with a, b, c, d, trio.fail_after(5):
        caplog.set_level(logging.ERROR, logger="narwhal.http")
        watch.watch(a.fileno(), broken)
        watch.watch(c.fileno(), record)
        b.send(b"x")
        await trio.sleep(0.05)  # the broken callback ran (and was unwatched) first
        d.send(b"y")
        await called.wait()
        assert seen == [b"y"] and len(watch) == 1
        assert any("socket watch callback failed" in r.message for r in caplog.records)


async def test_aclose_closes_the_set_and_ends_the_task_and_a_later_watch_starts_afresh() -> None:
    watch = SocketWatch()
    await watch.aclose()  # never started: nothing to do
    pair = _Reading()
    a, b, calls, called, on_readable = pair.a, pair.b, pair.calls, pair.called, pair.on_readable

    def tasks() -> list[str]:
        root = trio.lowlevel.current_root_task()
        return [t.name for n in root.child_nurseries for t in n.child_tasks if t.name.startswith("narwhal.http")]

    with a, b, trio.fail_after(5):
        watch.watch(a.fileno(), on_readable)
        ep = watch._epoll
        assert ep is not None and not ep.closed
        assert tasks() == ["narwhal.http.socket-watch"]
        await watch.aclose()
        assert ep.closed and len(watch) == 0 and tasks() == []
        b.send(b"one")
        await trio.sleep(0.05)
        assert calls == []  # closed: nothing is watched
        # Watched again: a new set and a new task.
        watch.watch(a.fileno(), on_readable)
        await called.wait()
        assert calls == [b"one"] and tasks() == ["narwhal.http.socket-watch"]
        watch.unwatch(a.fileno())
        await watch.aclose()
        assert tasks() == []
