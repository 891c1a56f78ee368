"""TokenRelay: a decode stream's tokens carried from engine to client off the event loop.

Once a streamed response has started, most of what a router does is forward tokens: one
read from the engine, one write to the client, a token at a time. On trio each token is
a wake-up of the run loop (``epoll_wait``, the task's rescheduling, a read, a write),
which costs several times the system calls themselves. The relay is one thread per
router that waits on the engine sockets of the streams it carries with an epoll object of
its own and, for each piece that arrives, de-chunks it, scans it
(:meth:`~narwhal.engines.stream.DecodeStream.take`), rewrites it for the client (the
request's :class:`~narwhal.router.requests.StreamShaper`) and writes it to the client
socket, without the event loop.

It carries only the plain middle of a stream and hands the stream back to its request's
task for anything else, with nothing lost: an event other than tokens (the finishing
event, usage, ``[DONE]``, an error), the body's end or a broken read (the stream raises
them on its next step, as if read there), a write the client's socket does not take whole
(the rest is written by the task, under its backpressure and send timeout rules), the
engine silent for the stream's silence bound (the task's deadline then fires), or the
task cancelled (a client gone, a shutdown: it takes the stream back before it closes
anything). A stream is carried only when both of its ends are sockets and the event loop
runs on the system clock; otherwise (in-memory streams, virtual time, ``server.token_relay:
"loop"``) the task relays it as before.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from typing import Final

import trio

from narwhal.engines.stream import DecodeStream
from narwhal.http.messages import ResponseWriter
from narwhal.router.requests import StreamShaper

try:
    from narwhal import _crelay
except ImportError:  # pragma: no cover (built where a compiler was found)
    _crelay = None  # type: ignore[assignment]

__all__ = ["Carried", "TokenRelay"]

log = logging.getLogger("narwhal.router")

_RECV: Final = 65536
#: How long a cancelled task waits for the relay to give its stream back.
_RELEASE_WAIT_S: Final = 5.0
_IN: Final = select.EPOLLIN


class Carried:
    """What the relay did with a stream, once it handed it back.

    Attributes:
        tokens: output tokens it forwarded.
        last_token_at: when the bytes of the last of them arrived (the event loop's clock).
        unsent: framed bytes the client's socket did not take (the task writes them).
        failure: an error of the relay itself (the task raises it).
        silent: it gave the stream back because the engine sent nothing for the bound.
    """

    __slots__ = (
        "compiled", "done", "dst", "event", "failure", "last_token_at", "released", "shape",
        "silence_s", "silent", "src", "stream", "tokens", "unsent", "writer",
    )  # fmt: skip

    def __init__(
        self,
        stream: DecodeStream,
        src: int,
        dst: int,
        writer: ResponseWriter,
        shape: StreamShaper,
        silence_s: float,
    ) -> None:
        self.stream = stream
        self.src = src
        self.dst = dst
        self.writer = writer
        self.shape = shape
        self.compiled: _crelay.Job | None = None  # the C loop's job
        self.silence_s = silence_s
        self.tokens = 0
        self.last_token_at = 0.0
        self.unsent = b""
        self.failure: BaseException | None = None
        self.silent = False
        self.released = False
        self.done = False
        self.event = trio.Event()


class TokenRelay:
    """The relay thread of one router (see the module docstring); started at its first
    stream, stopped by :meth:`aclose`.

    Args:
        compiled: run the C loop (None: where it was built and ``time.perf_counter`` is
            ``CLOCK_MONOTONIC``, the clock it reads); False runs the Python loop.
    """

    def __init__(self, *, compiled: bool | None = None) -> None:
        if compiled is None:
            clock = time.get_clock_info("perf_counter").implementation
            compiled = _crelay is not None and clock == "clock_gettime(CLOCK_MONOTONIC)"
        elif compiled and _crelay is None:
            raise RuntimeError("narwhal._crelay was not built (no C compiler at install)")
        #: Whether the loop is C (narwhal._crelay).
        self.compiled = compiled
        self._c: _crelay.Relay | None = None
        self._offset: float | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._lock = threading.Lock()
        self._adopt: list[Carried] = []
        self._release: list[Carried] = []
        self._jobs: dict[int, Carried] = {}
        self._thread: threading.Thread | None = None
        self._epoll: select.epoll | None = None
        self._wake_r = self._wake_w = -1
        self._closed = False
        self._broken = False
        #: Streams carried so far (each stretch of one counts), and now.
        self.carried = 0
        self.active = 0

    @property
    def usable(self) -> bool:
        """Whether streams can be carried (the system clock; not closed or broken)."""
        if self._token is None:
            self._bind()
        return self._offset is not None and not self._closed and not self._broken

    def _bind(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        clock = trio.lowlevel.current_clock()
        # trio's system clock is time.perf_counter() plus a fixed offset; any other
        # clock (virtual time in tests) cannot be read from a thread.
        offset = getattr(clock, "offset", None)
        if type(clock).__name__ == "SystemClock" and isinstance(offset, float):
            self._offset = offset

    def prepare(
        self,
        stream: DecodeStream,
        writer: ResponseWriter,
        shape: StreamShaper,
        silence_s: float,
    ) -> Carried | None:
        """What :meth:`carry` takes to carry ``stream`` to ``writer``, or None when its
        ends cannot be carried (not sockets, a response without a body, virtual time).

        Args:
            shape: each run of token events as the client's.
            silence_s: give the stream back once the engine sent nothing this long.
        """
        if not self.usable:
            return None
        src = stream.relay_fd()
        dst = writer.relay_fd()
        if src < 0 or dst < 0:
            return None
        return Carried(stream, src, dst, writer, shape, silence_s)

    async def carry(self, job: Carried) -> None:
        """Carry a stream until it needs its task (see the module docstring); what
        happened is in ``job``. The task must not touch the stream or the response
        meanwhile."""
        self._start()
        if self._c is not None:
            stream = job.stream
            try:
                job.compiled = self._c.adopt(
                    job.src, job.dst, job.shape.id_prefix, job.shape.strip_ids, job.writer.chunked,
                    stream.max_event_bytes, job.silence_s, stream.last_activity_at - (self._offset or 0.0),
                    lambda: self._handed_back(job),
                )  # fmt: skip
            except RuntimeError:  # pragma: no cover (its loop stopped: it could not wait any more)
                self._broken = True
                log.error("the token relay's loop stopped; relaying on the event loop from now on")
                return  # nothing carried: the task goes on
        else:
            with self._lock:
                self._adopt.append(job)
            self._wake()
        self.carried += 1
        self.active += 1
        try:
            await job.event.wait()
        except BaseException:
            if not job.done:
                if self._c is not None and job.compiled is not None:
                    self._c.release(job.compiled)
                else:
                    with self._lock:
                        self._release.append(job)
                    self._wake()
                with trio.CancelScope(shield=True), trio.move_on_after(_RELEASE_WAIT_S):
                    await job.event.wait()
                if not job.done:  # pragma: no cover (a relay that stopped answering)
                    self._broken = True
                    log.error("the token relay did not give a stream back; relaying on the event loop from now on")
            raise
        finally:
            self.active -= 1
            if job.done and job.compiled is not None:
                self._settle(job)

    def _handed_back(self, job: Carried) -> None:
        """The C loop gave ``job`` back (its thread, holding the GIL)."""
        job.done = True
        assert self._token is not None
        try:
            self._token.run_sync_soon(job.event.set)
        except trio.RunFinishedError:  # pragma: no cover (the run ended first)
            pass

    def _settle(self, job: Carried) -> None:
        """What the C loop did, as the Python loop reports it (the task's thread)."""
        c = job.compiled
        assert c is not None
        offset = self._offset or 0.0
        stream = job.stream
        job.tokens = c.tokens
        job.last_token_at = c.last_token + offset
        stream.carried(c.tokens, job.last_token_at, c.last_activity + offset)
        reason = c.reason
        if reason == _crelay.RAW:
            # A read that was not the plain case: the stream's own code takes it.
            count, run = stream.take(c.raw, stream.last_activity_at)
            if count > 0:
                job.tokens += count
                job.last_token_at = stream.last_activity_at
                job.unsent = job.writer.frame(job.shape(run))
        elif reason == _crelay.UNSENT:
            job.unsent = c.unsent
        elif reason == _crelay.ERROR:
            stream.read_failed(OSError(c.errno, os.strerror(c.errno)))
        elif reason == _crelay.SILENT:
            job.silent = True
        else:
            job.released = reason == _crelay.RELEASED

    # ------------------------------------------------------------------ the thread

    def _start(self) -> None:
        if self._thread is not None:
            return
        if self.compiled:
            self._c = _crelay.Relay()
            self._thread = threading.Thread(target=self._c.run, name="narwhal-token-relay", daemon=True)
            self._thread.start()
            log.info("token relay: started (its C loop)")
            return
        log.info(
            "token relay: started (its Python loop%s)",
            ": narwhal._crelay was not built at install, no C compiler?" if _crelay is None else "",
        )
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._epoll.register(self._wake_r, _IN)
        self._thread = threading.Thread(target=self._main, name="narwhal-token-relay", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # a wake-up is pending already

    def _main(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover (a bug of the relay itself)
            self._broken = True
            log.exception("the token relay stopped; relaying on the event loop from now on")
            for job in list(self._jobs.values()):
                job.failure = exc
                self._hand_back(job)
            with self._lock:
                pending = self._adopt + self._release
                self._adopt.clear()
                self._release.clear()
            for job in pending:
                self._hand_back(job)

    def _loop(self) -> None:
        epoll = self._epoll
        assert epoll is not None
        jobs = self._jobs
        wake = self._wake_r
        step = self._step
        clock = time.perf_counter
        next_check = float("inf")
        while True:
            timeout = -1.0 if next_check == float("inf") else max(0.0, next_check - clock())
            for fd, _ in epoll.poll(timeout):
                if fd == wake:
                    if self._control():
                        return
                    next_check = min(next_check, self._earliest())
                    continue
                job = jobs.get(fd)
                if job is not None:
                    step(job)
            if clock() >= next_check:
                next_check = self._check_silence()

    def _control(self) -> bool:
        """Take new streams and give back released ones; True once closed with none left."""
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        with self._lock:
            adopt, self._adopt = self._adopt, []
            release, self._release = self._release, []
        epoll = self._epoll
        assert epoll is not None
        for job in adopt:
            self._jobs[job.src] = job
            epoll.register(job.src, _IN)
        for job in release:
            job.released = True
            self._hand_back(job)
        return self._closed and not self._jobs

    def _step(self, job: Carried) -> None:
        """One readable engine socket: its bytes forwarded, or the stream handed back."""
        try:
            data = os.read(job.src, _RECV)
        except BlockingIOError:
            return
        except OSError as exc:
            job.stream.read_failed(exc)
            self._hand_back(job)
            return
        if not data:  # the engine closed: the task's read meets the end
            self._hand_back(job)
            return
        try:
            count, run = job.stream.take(data, time.perf_counter() + (self._offset or 0.0))
            if count > 0:
                out = job.writer.frame(job.shape(run))
                job.tokens += count
                job.last_token_at = job.stream.last_activity_at
                try:
                    sent = os.write(job.dst, out)
                except OSError:  # a full buffer, or the client gone: the task's write decides
                    sent = 0
                if sent < len(out):
                    job.unsent = out[sent:]
                    self._hand_back(job)
            elif count < 0:
                self._hand_back(job)
        except Exception as exc:  # pragma: no cover (a bug: the task reports it)
            job.failure = exc
            self._hand_back(job)

    def _hand_back(self, job: Carried) -> None:
        if job.done:
            return
        job.done = True
        if self._jobs.pop(job.src, None) is not None and self._epoll is not None:
            try:
                self._epoll.unregister(job.src)
            except (OSError, ValueError):  # pragma: no cover (closed under us)
                pass
        assert self._token is not None
        try:
            self._token.run_sync_soon(job.event.set)
        except trio.RunFinishedError:  # pragma: no cover (the run ended first)
            pass

    def _earliest(self) -> float:
        """When the first carried stream's silence bound runs out (perf_counter's clock)."""
        offset = self._offset or 0.0
        return min(
            (job.stream.last_activity_at - offset + job.silence_s for job in self._jobs.values()),
            default=float("inf"),
        )

    def _check_silence(self) -> float:
        now = time.perf_counter()
        offset = self._offset or 0.0
        for job in list(self._jobs.values()):
            if job.stream.last_activity_at - offset + job.silence_s <= now:
                job.silent = True
                self._hand_back(job)
        return self._earliest()

    async def aclose(self) -> None:
        """Stop the thread (streams still carried are handed back first)."""
        self._closed = True
        thread = self._thread
        if thread is None:
            return
        if self._c is not None:
            self._c.close()
        else:
            with self._lock:
                self._release.extend(self._jobs.values())
            self._wake()
        await trio.to_thread.run_sync(thread.join, 5.0)
        if not thread.is_alive() and self._c is None:
            if self._epoll is not None:
                self._epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
