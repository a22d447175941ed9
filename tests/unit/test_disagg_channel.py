"""The control channel of disaggregated mode (megatron_rl/disagg/channel.py): the hub's queues,
stop event, specs, heartbeats and progress reports, reached through the TCP proxies generators use."""

from __future__ import annotations

import dataclasses
import os
import queue
import socket
import stat
import threading
import time

import pytest

from megatron_rl.disagg import channel
from megatron_rl.disagg.channel import Hub, Progress, connect, connect_from_file, connect_with_file, heartbeat, hub_path

pytestmark = pytest.mark.serial  # heartbeat and stop waits are bounded in wall-clock time


@dataclasses.dataclass
class _Spec:
    index: int
    name: str


@pytest.fixture
def hub():
    h = Hub([_Spec(0, "a"), _Spec(1, "b")], experience_size=2, host="127.0.0.1", timeout_s=5.0)
    yield h
    h.close()


def _non_loopback_address() -> str | None:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: picks the interface of the default route
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_queues_stop_and_specs_through_the_endpoint(hub):
    conn = connect(*hub.address, hub.key)
    hub.requests.put({"request": 1})
    assert conn.get_request(timeout=1) == {"request": 1}
    with pytest.raises(queue.Empty):
        conn.get_request(timeout=0.05)
    conn.put_experience("g0", timeout=0.1)
    conn.put_experience("g1", timeout=0.1)
    with pytest.raises(queue.Full):  # bounded: the buffer's back-pressure reaches the generator
        conn.put_experience("g2", timeout=0.1)
    assert [hub.experience.get_nowait(), hub.experience.get_nowait()] == ["g0", "g1"]
    assert conn.spec(1) == _Spec(1, "b")
    assert not conn.stopping()
    hub.stop.set()
    assert conn.stopping()


def test_a_loopback_hub_listens_on_the_loopback_only(hub):
    assert hub._server.address[0] == "127.0.0.1"
    other = _non_loopback_address()
    if other is not None:
        with pytest.raises(OSError):
            connect(other, hub.address[1], hub.key)


def test_a_hub_for_other_nodes_is_reachable_at_its_network_address():
    other = _non_loopback_address()
    if other is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    h = Hub([_Spec(0, "a")], 1, other, 5.0)
    try:
        conn = connect(*h.address, h.key)
        h.requests.put(7)
        assert h.address[0] == other and conn.get_request(timeout=1) == 7
    finally:
        h.close()


def test_the_wrong_key_is_refused(hub):
    from multiprocessing import AuthenticationError

    with pytest.raises(AuthenticationError):
        connect(*hub.address, b"x" * 32)


def test_hub_file_is_owner_only_and_connects(hub, tmp_path):
    path = hub.publish(tmp_path)
    assert path == hub_path(tmp_path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    conn = connect_from_file(tmp_path, wait_s=5)
    hub.requests.put("x")
    assert conn.get_request(timeout=1) == "x"
    conn, key = connect_with_file(tmp_path, wait_s=5)  # a generator started separately: the key signs weights
    assert key == hub.key and conn.spec(0).name == "a"


def test_connecting_waits_for_the_file_and_gives_up_on_a_stale_one(hub, tmp_path):
    def later() -> None:
        time.sleep(0.5)
        hub.publish(tmp_path)

    threading.Thread(target=later).start()
    start = time.monotonic()
    connect_from_file(tmp_path, wait_s=10, poll_s=0.1)
    assert time.monotonic() - start >= 0.5
    other = tmp_path / "other"  # a file whose hub has gone (a port nobody listens on)
    hub_path(other).parent.mkdir(parents=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    hub_path(other).write_text(f'{{"host": "127.0.0.1", "port": {dead_port}, "key": "00", "num_generators": 1}}')
    with pytest.raises(TimeoutError, match="ConnectionRefusedError"):
        connect_from_file(other, wait_s=1, poll_s=0.1)


def test_check_names_a_generator_that_never_joined_or_fell_silent(hub):
    now = hub.started
    hub.check(now + 4)  # nobody joined yet, within the timeout
    with pytest.raises(RuntimeError, match="generator 0 has not connected within rollout.generator_timeout_s=5s"):
        hub.check(now + 6)
    conn = connect(*hub.address, hub.key)
    conn.join(0, {"host": "node7"})
    conn.join(1, {"host": "node8"})
    joined_at = time.monotonic()
    hub.check(joined_at + 4)
    conn.beat(1)
    with pytest.raises(RuntimeError, match="generator 0 on node7 has sent no heartbeat"):
        hub.check(joined_at + 5.5)  # generator 1 beat later; generator 0 only joined
    assert not hub.all_ready()
    conn.ready(0)
    assert not hub.all_ready()
    conn.ready(1)  # counts as a beat too
    ready_at = time.monotonic()
    assert hub.all_ready()
    conn.stopped(0)  # a generator that said it stopped is not waited for
    hub.check(ready_at + 4.9)
    with pytest.raises(RuntimeError, match="generator 1 on node8"):
        hub.check(ready_at + 5.5)


def test_check_names_a_generator_whose_loop_makes_no_progress_though_it_beats():
    """A beat carries how long ago the generator's main loop last made progress (its own clock);
    the trainer raises once that exceeds the progress timeout, with the heartbeat still fresh."""
    h = Hub([_Spec(0, "a"), _Spec(1, "b")], 1, "127.0.0.1", timeout_s=100.0, progress_timeout_s=60.0)
    try:
        conn = connect(*h.address, h.key)
        conn.join(0, {"host": "node7"})
        conn.join(1, {"host": "node8"})
        conn.beat(0, 10.0)
        conn.beat(1, 0.0)
        beat_at = time.monotonic()
        h.check(beat_at + 4)  # generator 0 idle ~14 s, within 60 s
        conn.beat(0, 58.0)  # its heartbeat thread beats on; the loop has been stuck for 58 s
        conn.beat(1)  # a beat that does not say: generator 1's last progress stays where it was
        at = time.monotonic()
        h.check(at + 1.5)
        with pytest.raises(RuntimeError, match=r"generator 0 on node7 has made no progress for 6\ds \(rollout\."
                                               r"generator_progress_timeout_s=60\) though its heartbeat goes on"):
            h.check(at + 4)
        conn.beat(0, 0.5)  # it made progress again
        h.check(time.monotonic() + 4)
        conn.stopped(0)
        with pytest.raises(RuntimeError, match="generator 1 on node8 has made no progress"):
            h.check(beat_at + 61)  # its heartbeat is fresh (within 100 s), its last progress is not
        assert "last progress" in h.describe()
    finally:
        h.close()


def test_a_heartbeat_thread_reports_the_main_loops_progress(monkeypatch):
    """The generator's loop stuck (no stamps) with its heartbeat thread running is detected after
    the progress timeout; a loop that stamps is not; a heartbeat without a progress clock counts as
    no progress."""
    monkeypatch.setattr(channel, "HEARTBEAT_S", 0.1)
    h = Hub([_Spec(0, "a"), _Spec(1, "b"), _Spec(2, "c")], 1, "127.0.0.1", timeout_s=30.0, progress_timeout_s=1.0)
    until = threading.Event()
    try:
        stuck, going = Progress(), Progress()
        for index, clock in ((0, stuck), (1, going), (2, None)):
            conn = connect(*h.address, h.key)
            conn.join(index, {"host": f"node{index}"})
            heartbeat(conn, index, until, clock)

        def loop() -> None:
            while not until.wait(0.05):
                going.stamp()

        threading.Thread(target=loop, daemon=True).start()
        time.sleep(1.6)
        with pytest.raises(RuntimeError, match=r"generator 0 on node0 has made no progress for \ds"):
            h.check()
        h.registry.stop(0)
        with pytest.raises(RuntimeError, match="generator 2 on node2 has made no progress"):
            h.check()
        h.registry.stop(2)
        h.check()  # generator 1 beats and makes progress
    finally:
        until.set()
        h.close()


def test_heartbeat_thread_keeps_a_generator_alive_and_stop_is_waited_for(hub, monkeypatch):
    """A beating generator is waited for until it says it stopped; one that fell silent (dead:
    no beat for 3 heartbeat periods) is not."""
    monkeypatch.setattr(channel, "HEARTBEAT_S", 0.2)
    conn = connect(*hub.address, hub.key)
    conn.join(0, {"host": "here"})
    until = threading.Event()
    beating = heartbeat(conn, 0, until)
    first = hub.registry.snapshot()[1][0]
    time.sleep(1.0)
    assert hub.registry.snapshot()[1][0] > first + 0.3
    hub.stop.set()
    assert hub.wait_stopped(0.2) == [0]  # still beating, has not confirmed
    conn.stopped(0)
    assert hub.wait_stopped(0.2) == []
    conn.join(1, {"host": "there"})  # joins, then never beats
    until.set()
    beating.join()
    time.sleep(3 * channel.HEARTBEAT_S + 0.1)
    started = time.monotonic()
    assert hub.wait_stopped(5.0) == [] and time.monotonic() - started < 1.0


def test_a_generator_that_reports_a_failure_stops_the_trainer_at_once(hub):
    conn = connect(*hub.address, hub.key)
    conn.join(1, {"host": "node8"})
    conn.stopped(1, "RuntimeError: CUDA out of memory")
    with pytest.raises(RuntimeError, match=r"generator 1 on node8 failed: RuntimeError: CUDA out of memory"):
        hub.check(hub.started)  # no timeout involved
    assert "generator 0: never connected" in hub.describe() and "generator 1 on node8: stopped" in hub.describe()


def test_a_closed_hub_frees_its_port_and_leaves_no_busy_thread():
    """After close: the port refuses connections, the serving threads end, and nothing spins
    (the managers server's own accept loop retried a closed listener at full speed)."""
    h = Hub([_Spec(0, "a")], experience_size=1, host="127.0.0.1", timeout_s=5.0)
    endpoint = connect(h.address[0], h.address[1], h.key)
    assert endpoint.spec(0).name == "a"
    h.close()
    h.close()  # twice is harmless
    assert not h._thread.is_alive()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(h.address, timeout=2.0)
    busy_before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - busy_before < 0.3  # a spinning thread would use the whole second
