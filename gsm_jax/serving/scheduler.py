"""The engine's own thread, and the bounded admission queue in front of it.

The engine is stepped by one thread only (`EngineLoop`); everything else talks to
it through an inbox that the loop drains before each step: new requests, aborts,
calls. A request is a `Ticket`: the HTTP layer builds it, the loop submits it, and
the engine's callbacks (same thread) feed its `on_token` / `on_finish`.

Admission is bounded: `submit` refuses with `QueueFull` once `max_queue` requests
are waiting (not yet decoding), and with `Draining` after `drain` started. A
ticket aborted while queued, prefilling or decoding is ended by `Engine.abort`, its
slot free for the next step (no decode goes on for a client that left).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gsm_jax.errors import GSMJaxError
from gsm_jax.serving.engine import Engine, Request, RequestRecord, clock

__all__ = ["Draining", "EngineLoop", "QueueFull", "Ticket"]

log = logging.getLogger("gsm_jax.serving")


class QueueFull(GSMJaxError):
    """The admission queue is full (HTTP 503 with Retry-After)."""


class Draining(GSMJaxError):
    """The server is shutting down and takes no new requests (HTTP 503)."""


class Ticket:
    """One request on its way through the loop. `on_token(ticket, token)` and
    `on_finish(ticket)` run on the engine thread: keep them short."""

    def __init__(self, request: Request, *,
                 on_token: Callable[[Ticket, int], None] | None = None,
                 on_finish: Callable[[Ticket], None] | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self.request = request
        self.arrival = clock()
        self.on_token = on_token
        self.on_finish = on_finish
        self.meta = dict(meta or {})
        self.record: RequestRecord | None = None
        self.submitted = False
        self.finished = threading.Event()

    @property
    def done(self) -> bool:
        return self.finished.is_set()


class EngineLoop:
    """Steps `engine` on a daemon thread while it has work; sleeps on the inbox otherwise."""

    def __init__(self, engine: Engine, *, max_queue: int = 1024,
                 on_step: Callable[[Engine], None] | None = None) -> None:
        if int(max_queue) < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue!r}")
        self.engine = engine
        self.max_queue = int(max_queue)
        self.on_step = on_step
        self._inbox: deque[tuple[str, Any]] = deque()
        self._cv = threading.Condition()
        self._queued = 0  # tickets submitted, not yet decoding (inbox + engine queue)
        self._running = 0
        self._draining = False
        self._stopped = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="gsm-jax-engine", daemon=True)
        engine.on_token = self._token
        engine.on_finish = self._finish

    # ---------------------------------------------------------------- control

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_waiting(self) -> int:
        return self._queued

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def has_work(self) -> bool:
        with self._cv:
            return bool(self._inbox) or self._queued > 0 or self._running > 0

    def submit(self, ticket: Ticket) -> Ticket:
        """Queue a ticket (validate its request first: `engine._check`)."""
        with self._cv:
            if self._draining or self._stopped:
                raise Draining("the server is shutting down: no new requests")
            if self._queued >= self.max_queue:
                raise QueueFull(f"the admission queue is full ({self.max_queue} waiting)")
            self._queued += 1
            ticket.submitted = True
            self._inbox.append(("submit", ticket))
            self._cv.notify()
        return ticket

    def abort(self, ticket: Ticket, reason: str = "abort") -> None:
        """End a ticket's request at the next step (a client that went away)."""
        with self._cv:
            if ticket.done or not ticket.submitted:  # never queued: nothing to end
                return
            self._inbox.append(("abort", (ticket, reason)))
            self._cv.notify()

    def call(self, fn: Callable[[Engine], Any], timeout: float = 30.0) -> Any:
        """Run `fn(engine)` on the engine thread between steps; return its result."""
        box: dict[str, Any] = {}
        done = threading.Event()

        def run(engine: Engine) -> None:
            try:
                box["value"] = fn(engine)
            except BaseException as e:  # re-raised in the caller
                box["error"] = e
            done.set()

        with self._cv:
            self._inbox.append(("call", run))
            self._cv.notify()
        if not done.wait(timeout):
            raise TimeoutError("the engine thread did not answer")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def drain(self, timeout: float) -> bool:
        """Refuse new requests; wait up to `timeout` s for the ones in flight; abort what
        is left ("shutdown"). True if everything finished in time."""
        with self._cv:
            self._draining = True
        deadline = time.monotonic() + max(0.0, float(timeout))
        while self.has_work and time.monotonic() < deadline and self.alive:
            time.sleep(0.02)
        clean = not self.has_work
        if not clean:
            self.call(lambda eng: [eng.abort(r, "shutdown") for r in _records(eng)])
        return clean

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- engine thread

    def _token(self, rec: RequestRecord, token: int) -> None:
        ticket: Ticket = rec.meta["ticket"]
        if rec.n_tokens == 1:  # it left the queue
            with self._cv:
                self._queued -= 1
                self._running += 1
        if ticket.on_token is not None and ticket.on_token(ticket, token) == "stop":
            self.engine.abort(rec, "stop")  # a stop string matched: end it now

    def _finish(self, rec: RequestRecord) -> None:
        ticket: Ticket = rec.meta["ticket"]
        with self._cv:
            if rec.n_tokens == 0:
                self._queued -= 1
            else:
                self._running -= 1
        self._finish_ticket(ticket)

    def _finish_ticket(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ticket.finished.set()
        if ticket.on_finish is not None:
            try:
                ticket.on_finish(ticket)
            except Exception:  # a listener's bug must not stop the engine
                log.exception("on_finish failed for request %s", ticket.request.request_id)

    def _handle(self, kind: str, item: Any) -> None:
        eng = self.engine
        if kind == "submit":
            ticket: Ticket = item
            rec = eng.submit(ticket.request, arrival=ticket.arrival)
            rec.meta["ticket"] = ticket
            ticket.record = rec
        elif kind == "abort":
            ticket, reason = item  # the inbox is in order: its submit came first
            if ticket.record is not None:
                eng.abort(ticket.record, reason)
        elif kind == "call":
            item(eng)

    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cv:
                    while not self._inbox and not eng.has_work and not self._stopped:
                        self._cv.wait(timeout=0.5)
                    if self._stopped:
                        break
                    items = list(self._inbox)
                    self._inbox.clear()
                for kind, item in items:
                    try:
                        self._handle(kind, item)
                    except Exception as e:  # a bad request fails alone
                        log.exception("engine inbox item failed")
                        if kind == "submit":
                            item.meta["error"] = str(e)
                            with self._cv:
                                self._queued -= 1
                            self._finish_ticket(item)
                if eng.has_work:
                    eng.step()
                if self.on_step is not None:
                    self.on_step(eng)
        except BaseException as e:  # the engine died: the server reports it (health 503)
            self.error = e
            log.exception("the engine thread died")
            for rec in _records(eng):
                self._finish_ticket(rec.meta["ticket"])


def _records(engine: Engine) -> list[RequestRecord]:
    """Every request the engine still holds (queued, prefilling, decoding)."""
    recs = [w.record for w in engine.waiting]
    if engine._prefilling is not None:
        recs.append(engine._prefilling.item.record)
    recs.extend(r for r in engine.slots if r is not None)
    return recs
