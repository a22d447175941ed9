"""Which waiting execution gets the next free slot of a sandbox server.

Executions belong to priority classes (training rollouts, evaluation, quality inspection,
environment builds). `FairScheduler` is the bookkeeping, with no I/O and an injectable clock,
so its order can be checked by hand; `SlotGate` is the asyncio adapter the server awaits.

- Weighted fair queueing across classes (start-time fair queueing with unit cost per
  execution): an execution of class c arriving at virtual time V gets the start tag
  S = max(V, F_c) and advances the class's finish tag F_c = S + 1 / weight_c; a free slot goes
  to the waiting head with the smallest tag (ties: the class order of `CLASSES`, then
  arrival), and V becomes that tag. Over a backlog, class c gets weight_c / sum(weights) of the
  dispatches; a class that was idle restarts at V, so it cannot hoard credit, and a class that
  arrives during a flood of other work is served at the next free slot. Weights share
  dispatches, not slot-seconds: quotas are what bound how many slots long jobs of one class hold.
- Quota: at most `quota` executions of a class run at once (0 = no quota beyond capacity).
- Admission control: an execution that cannot start at once is refused (`Refused`, naming the
  class) when its class already has `max_queue` waiting, or the server `max_queue` in total.
- A request of several executions (a Verify's tests) is admitted as a whole (`submit_many`): all
  of them start or wait, or none does; one that could never fit (more than the class's slots and
  queue together) is refused for good (ValueError). Admitting one test at a time let some tests
  run and the rest be refused, and the client's retry ran the first ones again.
- With a single class this is the previous behaviour: FIFO, refused when all slots are busy
  and `max_queue` are waiting.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import time
from typing import AsyncIterator, Callable, Mapping, Optional

CLASSES = ("training", "evaluation", "quality", "build")
DEFAULT_CLASS = "training"
DEFAULT_WEIGHTS = {"training": 4.0, "evaluation": 2.0, "quality": 1.0, "build": 1.0}


@dataclasses.dataclass(frozen=True)
class ClassPolicy:
    """How one priority class is scheduled."""

    weight: float = 1.0
    """Share of dispatches while several classes wait (relative to the other weights); > 0."""
    quota: int = 0
    """Most executions of this class running at once; 0 = only the server capacity bounds it."""
    max_queue: int = 0
    """Most executions of this class waiting before new ones are refused; 0 = the server's max_queue."""

    def __post_init__(self) -> None:
        if not self.weight > 0:
            raise ValueError(f"class weight must be > 0, got {self.weight}")
        if self.quota < 0 or self.max_queue < 0:
            raise ValueError(f"class quota and max_queue must be >= 0 (0 = no own limit), got "
                             f"quota={self.quota} max_queue={self.max_queue}")


def check_class(name: str) -> str:
    if name not in CLASSES:
        raise ValueError(f"unknown priority class {name!r}; allowed: {', '.join(CLASSES)}")
    return name


class Refused(Exception):
    """Admission control: the execution's class (or the server) has too many waiting."""


@dataclasses.dataclass(eq=False)
class Ticket:
    """One execution's place in the scheduler (identity-hashed)."""

    cls: str
    tag: float
    seq: int
    arrived: float
    started: Optional[float] = None
    held: bool = False  # entered `SlotGate.hold`, which gives it back however it ends

    @property
    def wait_s(self) -> float:
        assert self.started is not None, "the ticket has not started"
        return self.started - self.arrived


@dataclasses.dataclass
class _ClassState:
    policy: ClassPolicy
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    running: int = 0
    started: int = 0
    finished: int = 0
    refused: int = 0
    finish_tag: float = 0.0
    waits: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=256))


class FairScheduler:
    """Weighted fair queueing with quotas over `capacity` slots (no I/O; see the module doc).

    `submit` returns a ticket that has either started (`ticket.started` is set) or waits;
    `release` / `cancel` return the tickets that started because a slot or quota freed."""

    def __init__(self, capacity: int, max_queue: int, policies: Optional[Mapping[str, ClassPolicy]] = None,
                 clock: Callable[[], float] = time.monotonic, window: int = 256) -> None:
        if capacity < 1 or max_queue < 0:
            raise ValueError(f"capacity must be >= 1 and max_queue >= 0, got {capacity} and {max_queue}")
        policies = dict(policies or {})
        for name in policies:
            check_class(name)
        self.capacity, self.max_queue, self.clock = capacity, max_queue, clock
        self._classes = {name: _ClassState(policies.get(name, ClassPolicy(weight=DEFAULT_WEIGHTS[name])),
                                           waits=collections.deque(maxlen=window)) for name in CLASSES}
        self.vtime = 0.0
        self.running = 0
        self.queued = 0
        self._seq = 0

    def policy(self, cls: str) -> ClassPolicy:
        return self._classes[check_class(cls)].policy

    def _quota(self, state: _ClassState) -> int:
        return state.policy.quota or self.capacity

    def _class_max_queue(self, state: _ClassState) -> int:
        return state.policy.max_queue or self.max_queue

    def submit(self, cls: str) -> Ticket:
        """Admit one execution of class `cls`; raises `Refused` when it can neither start nor wait."""
        return self.submit_many(cls, 1)[0]

    def submit_many(self, cls: str, count: int) -> list[Ticket]:
        """Admit `count` executions of class `cls` together, or none: raises `Refused` when they cannot
        all start or wait now, and ValueError when they never could."""
        state = self._classes[check_class(cls)]
        slots = min(self.capacity, self._quota(state))
        room = min(self._class_max_queue(state), self.max_queue)
        if count > slots + room:
            raise ValueError(f"{count} executions in one request can never be admitted: class {cls} has "
                             f"{slots} slots and room for {room} waiting on this server")
        startable = 0 if state.queue else max(0, min(self.capacity - self.running, self._quota(state) - state.running))
        waiting = max(0, count - startable)
        limit = self._class_max_queue(state)
        if waiting and (len(state.queue) + waiting > limit or self.queued + waiting > self.max_queue):
            state.refused += count
            raise Refused(f"class {cls}: {state.running} running and {len(state.queue)} waiting (max {limit}); "
                          f"{self.running} running and {self.queued} waiting on the server "
                          f"(capacity {self.capacity}, max queue {self.max_queue}); {count} more asked for")
        return [self._admit(cls, state) for _ in range(count)]

    def _admit(self, cls: str, state: _ClassState) -> Ticket:
        tag = max(self.vtime, state.finish_tag)
        ticket = Ticket(cls, tag, self._seq, self.clock())
        # Invariant: after every change nothing that could start is left waiting, so a class with
        # an empty queue, a free slot and room in its quota starts at once without jumping anyone.
        if not state.queue and self.running < self.capacity and state.running < self._quota(state):
            self._start(ticket, state)
        else:  # room was checked by submit_many
            state.queue.append(ticket)
            self.queued += 1
        self._seq += 1
        state.finish_tag = tag + 1.0 / state.policy.weight
        return ticket

    def release(self, ticket: Ticket) -> list[Ticket]:
        """A started execution ended; returns the tickets that start in its place."""
        assert ticket.started is not None, "release of a ticket that never started"
        state = self._classes[ticket.cls]
        state.running -= 1
        state.finished += 1
        self.running -= 1
        return self._dispatch()

    def cancel(self, ticket: Ticket) -> list[Ticket]:
        """The caller gave up: a waiting ticket leaves its queue, a started one is released."""
        if ticket.started is not None:
            return self.release(ticket)
        state = self._classes[ticket.cls]
        state.queue.remove(ticket)
        self.queued -= 1
        return []  # a ticket leaving a queue frees no slot and no quota

    def _start(self, ticket: Ticket, state: _ClassState) -> None:
        ticket.started = self.clock()
        state.running += 1
        state.started += 1
        state.waits.append(ticket.wait_s)
        self.running += 1
        self.vtime = max(self.vtime, ticket.tag)

    def _dispatch(self) -> list[Ticket]:
        started = []
        while self.running < self.capacity:
            best: Optional[tuple[float, int, int]] = None
            for index, state in enumerate(self._classes.values()):
                if state.queue and state.running < self._quota(state):
                    head = state.queue[0]
                    if best is None or (head.tag, index, head.seq) < best:
                        best = (head.tag, index, head.seq)
            if best is None:
                break
            state = list(self._classes.values())[best[1]]
            ticket = state.queue.popleft()
            self.queued -= 1
            self._start(ticket, state)
            started.append(ticket)
        return started

    def backpressure(self, cls: Optional[str] = None) -> float:
        """0 (idle) .. 1 (new executions are refused): waiting / max_queue, for the server or, with
        `cls`, the larger of the server's and that class's own."""
        level = self.queued / self.max_queue if self.max_queue else float(self.running >= self.capacity)
        if cls is not None:
            state = self._classes[check_class(cls)]
            limit = self._class_max_queue(state)
            level = max(level, len(state.queue) / limit if limit else float(state.running >= self._quota(state)))
        return min(1.0, level)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per class: policy, queued, running, counters, wait mean/max over the recent window of
        started executions, and how long the oldest waiting one has waited so far."""
        now = self.clock()
        out = {}
        for name, state in self._classes.items():
            waits = state.waits
            out[name] = {
                "weight": state.policy.weight, "quota": self._quota(state), "max_queue": self._class_max_queue(state),
                "queued": len(state.queue), "running": state.running, "started": state.started,
                "finished": state.finished, "refused": state.refused,
                "wait_mean_s": sum(waits) / len(waits) if waits else 0.0, "wait_max_s": max(waits, default=0.0),
                "oldest_wait_s": now - state.queue[0].arrived if state.queue else 0.0,
                "backpressure": self.backpressure(name),
            }
        return out


class SlotGate:
    """The server's awaitable view of a `FairScheduler`: `async with gate.slot(cls) as ticket`."""

    def __init__(self, scheduler: FairScheduler) -> None:
        self.scheduler = scheduler
        self._waiters: dict[Ticket, asyncio.Future] = {}

    @contextlib.asynccontextmanager
    async def slot(self, cls: str) -> AsyncIterator[Ticket]:
        ticket = self.scheduler.submit(cls)  # Refused propagates to the caller
        async with self.hold(ticket):
            yield ticket

    def admit(self, cls: str, count: int) -> list[Ticket]:
        """Admit `count` executions at once (see `FairScheduler.submit_many`); each is then run
        under `hold(ticket)`, which every admitted ticket must enter (or `drop`)."""
        return self.scheduler.submit_many(cls, count)

    def drop(self, ticket: Ticket) -> None:
        """Give an admitted ticket up without running it."""
        self._wake(self.scheduler.cancel(ticket))

    @contextlib.asynccontextmanager
    async def hold(self, ticket: Ticket) -> AsyncIterator[Ticket]:
        """Wait until `ticket` has started, then hold its slot for the body."""
        ticket.held = True
        if ticket.started is None:
            future = asyncio.get_running_loop().create_future()
            self._waiters[ticket] = future
            try:
                await future
            except BaseException:  # cancelled while waiting (the client gave up): leave the queue
                self._waiters.pop(ticket, None)
                self._wake(self.scheduler.cancel(ticket))
                raise
        try:
            yield ticket
        finally:
            self._wake(self.scheduler.release(ticket))

    def _wake(self, tickets: list[Ticket]) -> None:
        for ticket in tickets:
            future = self._waiters.pop(ticket, None)  # None: admitted, not yet held (it sees `started`)
            if future is not None and not future.done():
                future.set_result(None)
