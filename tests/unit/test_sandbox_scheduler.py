"""The sandbox's slot scheduler without gRPC: service order against hand-computed weighted fair
queueing orders, quotas, admission control, wait statistics and the asyncio gate.

Tags in the comments: an execution of class c gets S = max(V, F_c), then F_c = S + 1/w_c;
the smallest S is served next (ties: training, evaluation, quality, build), V = S served.
Default weights: training 4, evaluation 2, quality 1, build 1."""

from __future__ import annotations

import asyncio

import pytest

from megatron_rl_sandbox.scheduler import ClassPolicy, FairScheduler, Refused, SlotGate


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _label(ticket, names: dict) -> str:
    return names[id(ticket)]


def _submit(sched, names, cls: str, label: str):
    ticket = sched.submit(cls)
    names[id(ticket)] = label
    return ticket


def _drain(sched, running, names) -> list[str]:
    """Capacity-1 server: finish the running ticket, record which one starts next, repeat."""
    order = []
    while running is not None:
        started = sched.release(running)
        assert len(started) <= 1
        running = started[0] if started else None
        if running is not None:
            order.append(_label(running, names))
    return order


def test_service_order_is_the_hand_computed_wfq_order():
    sched, names = FairScheduler(capacity=1, max_queue=100, clock=Clock()), {}
    blocker = _submit(sched, names, "build", "B0")          # tag 0, starts at once; F_build = 1
    assert blocker.started is not None
    for i in range(6):
        _submit(sched, names, "training", f"T{i}")           # tags 0, .25, .5, .75, 1, 1.25
    for i in range(3):
        _submit(sched, names, "evaluation", f"E{i}")         # tags 0, .5, 1
    for i in range(2):
        _submit(sched, names, "quality", f"Q{i}")            # tags 0, 1
    for i in (1, 2):
        _submit(sched, names, "build", f"B{i}")              # tags 1, 2
    assert _drain(sched, blocker, names) == [
        "T0", "E0", "Q0",            # tag 0 (class order breaks the tie)
        "T1",                        # .25
        "T2", "E1",                  # .5
        "T3",                        # .75
        "T4", "E2", "Q1", "B1",      # 1
        "T5",                        # 1.25
        "B2",                        # 2
    ]


def test_backlogged_classes_share_dispatches_by_weight():
    sched, names = FairScheduler(capacity=1, max_queue=1000, clock=Clock()), {}
    blocker = _submit(sched, names, "quality", "blocker")   # tag 0; quality's next tag is 1
    for cls in ("training", "evaluation", "quality", "build"):
        for i in range(100):
            _submit(sched, names, cls, cls)
    order = _drain(sched, blocker, names)
    # the first 80 dispatches are the tags below 10: training k/4 (40), evaluation k/2 (20),
    # quality 1..9 (9, its tag 0 went to the blocker), build 0..9 (10); then one tag-10 training
    first = order[:80]
    assert [first.count(c) for c in ("training", "evaluation", "quality", "build")] == [41, 20, 9, 10]


def test_an_idle_class_restarts_at_virtual_time_and_is_served_next():
    sched, names = FairScheduler(capacity=1, max_queue=100, clock=Clock()), {}
    running = _submit(sched, names, "build", "B0")
    for i in range(1, 10):
        _submit(sched, names, "build", f"B{i}")              # tags 1..9
    for _ in range(5):
        (running,) = sched.release(running)                  # B1..B5 served, V = 5
    assert _label(running, names) == "B5" and sched.vtime == 5
    for i in range(5):
        _submit(sched, names, "training", f"T{i}")           # tags 5, 5.25, 5.5, 5.75, 6 (not 0: no hoarding)
    assert _drain(sched, running, names)[:7] == ["T0", "T1", "T2", "T3", "T4", "B6", "B7"]


def test_quota_caps_running_executions_of_a_class():
    sched, names = FairScheduler(capacity=3, max_queue=100, clock=Clock(),
                                 policies={"build": ClassPolicy(weight=1, quota=1)}), {}
    builds = [_submit(sched, names, "build", f"B{i}") for i in range(5)]
    assert [b.started is not None for b in builds] == [True, False, False, False, False]
    assert sched.running == 1 and sched.queued == 4                     # two slots stay free for others
    t0 = _submit(sched, names, "training", "T0")
    e0 = _submit(sched, names, "evaluation", "E0")
    t1 = _submit(sched, names, "training", "T1")                       # capacity full: waits
    assert t0.started is not None and e0.started is not None and t1.started is None
    assert [_label(t, names) for t in sched.release(builds[0])] == ["T1"]   # T1 tag .25 < B1 tag 1
    assert [_label(t, names) for t in sched.release(t0)] == ["B1"]          # build is under quota again
    assert sched.release(e0) == []                                          # B2 waits: quota 1 reached
    assert sched.stats()["build"]["running"] == 1 and sched.running == 2


def test_admission_control_refuses_per_class_and_per_server():
    sched = FairScheduler(capacity=1, max_queue=3, clock=Clock(),
                          policies={"build": ClassPolicy(weight=1, max_queue=2)})
    sched.submit("build")                                   # runs
    sched.submit("build")
    sched.submit("build")                                   # 2 waiting: build is full
    with pytest.raises(Refused, match="class build: 1 running and 2 waiting"):
        sched.submit("build")
    sched.submit("training")                                # training still admitted: 3 waiting in total
    with pytest.raises(Refused, match="class training: .* 3 waiting on the server"):
        sched.submit("training")
    stats = sched.stats()
    assert (stats["build"]["refused"], stats["training"]["refused"]) == (1, 1)
    assert sched.backpressure() == 1.0 and stats["build"]["backpressure"] == 1.0


def test_one_class_keeps_the_previous_fifo_behaviour():
    sched, names = FairScheduler(capacity=1, max_queue=1, clock=Clock()), {}
    outcomes = []
    for i in range(5):
        try:
            outcomes.append(_submit(sched, names, "training", f"T{i}").started is not None)
        except Refused:
            outcomes.append("refused")
    assert outcomes == [True, False, "refused", "refused", "refused"]   # 1 running, 1 queued, 3 refused

    sched, names = FairScheduler(capacity=2, max_queue=100, clock=Clock()), {}
    running = [_submit(sched, names, "evaluation", f"E{i}") for i in range(6)]
    order = []
    for _ in range(6):
        done = running.pop(0)
        started = sched.release(done)
        running += started
        order += [_label(t, names) for t in started]
    assert order == ["E2", "E3", "E4", "E5"]


def test_cancel_leaves_the_queue_and_wait_statistics_use_the_clock():
    clock = Clock()
    sched = FairScheduler(capacity=1, max_queue=10, clock=clock)
    first = sched.submit("build")
    waiting = sched.submit("training")
    gone = sched.submit("training")
    clock.now = 0.5
    assert sched.stats()["training"]["oldest_wait_s"] == 0.5
    sched.cancel(gone)
    assert sched.queued == 1 and sched.backpressure() == pytest.approx(0.1)
    clock.now = 2.0
    assert sched.release(first) == [waiting]
    stats = sched.stats()["training"]
    assert (stats["started"], stats["wait_mean_s"], stats["wait_max_s"], stats["queued"]) == (1, 2.0, 2.0, 0)


def test_bad_configuration_names_the_value():
    with pytest.raises(ValueError, match="unknown priority class 'rollout'; allowed: training, evaluation"):
        FairScheduler(capacity=1, max_queue=1, policies={"rollout": ClassPolicy()})
    with pytest.raises(ValueError, match="weight must be > 0"):
        ClassPolicy(weight=0)
    with pytest.raises(ValueError, match="unknown priority class"):
        FairScheduler(capacity=1, max_queue=1).submit("urgent")


def test_slot_gate_serves_in_scheduler_order_and_drops_cancelled_waiters():
    async def go():
        gate = SlotGate(FairScheduler(capacity=1, max_queue=10))
        order, release = [], asyncio.Event()

        async def job(cls: str, label: str, hold: bool = False):
            async with gate.slot(cls):
                order.append(label)
                if hold:
                    await release.wait()

        holder = asyncio.create_task(job("build", "B0", hold=True))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(job(c, lab)) for c, lab in
                 (("build", "B1"), ("quality", "Q0"), ("training", "T0"), ("evaluation", "E0"))]
        doomed = asyncio.create_task(job("training", "T-cancelled"))
        await asyncio.sleep(0.01)
        assert gate.scheduler.queued == 5
        doomed.cancel()
        await asyncio.sleep(0.01)
        assert gate.scheduler.queued == 4
        release.set()
        await asyncio.gather(holder, *tasks)
        assert gate.scheduler.running == 0 and gate.scheduler.queued == 0
        return order

    # tags: B1 1, Q0 0, T0 0, E0 0 -> T0, E0, Q0 (tie order), then B1
    assert asyncio.run(go()) == ["B0", "T0", "E0", "Q0", "B1"]


def test_a_request_of_several_executions_is_admitted_whole_or_not_at_all():
    """Capacity 2, room for 3 waiting, 1 running: 4 more can start or wait (1 + 3), 5 cannot, and a refusal
    admits none of them; more than slots + room (5) can never be admitted."""
    sched = FairScheduler(capacity=2, max_queue=3, clock=Clock())
    sched.submit("training")
    with pytest.raises(Refused):
        sched.submit_many("training", 5)
    assert (sched.running, sched.queued) == (1, 0)  # nothing of the refused request stayed
    tickets = sched.submit_many("training", 4)
    assert [t.started is not None for t in tickets] == [True, False, False, False]
    assert (sched.running, sched.queued) == (2, 3)
    with pytest.raises(ValueError, match="can never be admitted"):
        FairScheduler(capacity=2, max_queue=3, clock=Clock()).submit_many("training", 6)


def test_an_admitted_ticket_started_before_it_is_held_runs_and_a_dropped_one_frees_its_place():
    async def go():
        sched = FairScheduler(capacity=1, max_queue=2)
        gate = SlotGate(sched)
        first, second, third = gate.admit("training", 3)
        gate.drop(third)  # never ran (its workspace could not be made): out of the queue
        async with gate.hold(first):
            pass  # its release starts `second` before anyone holds it
        assert second.started is not None
        async with gate.hold(second):
            pass
        return sched.running, sched.queued
    assert asyncio.run(go()) == (0, 0)
