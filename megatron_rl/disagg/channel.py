"""The control channel of disaggregated mode: prompt requests, experience and liveness between
trainer rank 0 and the generators, over TCP, so that generators may run on other nodes.

Trainer rank 0 hosts a `Hub`: the request queue, the bounded experience queue (its bound is the
buffer's back-pressure), the stop event, every generator's spec and a heartbeat registry. A
`multiprocessing.managers` server (a thread of rank 0, authenticated with a random key) serves
one `Endpoint` over them, and each generator calls it through a proxy (`connect`); the
trainer uses the objects themselves. Why the standard library's managers rather than gRPC
(which the sandbox uses): the payloads are Python objects of this package (rollouts, specs)
that both ends already share, and a remote call keeps the queues' timeouts and
`queue.Full`/`queue.Empty` semantics (the exception is raised again at the caller), which a
hand-written protocol would have to rebuild.

Generators started by rank 0 itself (one node, `rollout.generator_nodes=0`) get the address
directly; generators started separately (`rollout.generator_nodes > 0`: the Slurm job's
generator step, or by hand) find it in `<run_dir>/disagg/hub.json` (owner-only permissions:
it holds the key), which the trainer writes once the hub listens.

Liveness: every generator calls `Registry.beat` every `HEARTBEAT_S` from a thread of its own
and the hub keeps the trainer's clock of the last beat; `Hub.check` raises when a generator
that has joined falls silent, or one that never joined is overdue, for longer than the timeout
(rollout.generator_timeout_s): the process died or lost its connection. A beat from that thread
says nothing about the generator's main loop, which may hang (in an engine call, say) while
the thread beats on; so the loop stamps a `Progress` clock as it goes (between requests, engine
calls, chunks, turns and weight buckets, and while it waits), each beat carries how long ago
the last stamp was, and `Hub.check` also raises when a generator has made no progress for
rollout.generator_progress_timeout_s.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import queue
import secrets
import socket
import threading
import time
from multiprocessing.managers import BaseManager
from pathlib import Path
from typing import Any, Optional

HUB_FILE = "hub.json"  # under <run_dir>/disagg/
HEARTBEAT_S = 2.0


def hub_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "disagg" / HUB_FILE


class Registry:
    """Which generators have joined, when each was last heard from (trainer clock), which stopped."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.joined: dict[int, dict[str, Any]] = {}
        self.last_beat: dict[int, float] = {}
        self.stopped: set[int] = set()
        self.failed: dict[int, str] = {}
        self.ready: set[int] = set()  # engine loaded: about to join the weight group
        self.last_progress: dict[int, float] = {}  # the main loop's last progress (trainer clock)

    def join(self, index: int, info: dict[str, Any]) -> None:
        with self._lock:
            self.joined[index] = dict(info)
            self.last_beat[index] = self.last_progress[index] = time.monotonic()

    def beat(self, index: int, idle_s: Optional[float] = None) -> None:
        """`idle_s`: how long ago the generator's main loop last made progress (None: not said)."""
        with self._lock:
            now = time.monotonic()
            self.last_beat[index] = now
            if idle_s is not None:
                self.last_progress[index] = now - max(float(idle_s), 0.0)

    def progress(self) -> dict[int, float]:
        with self._lock:
            return dict(self.last_progress)

    def set_ready(self, index: int) -> None:
        with self._lock:
            self.ready.add(index)
            self.last_beat[index] = time.monotonic()

    def stop(self, index: int, error: Optional[str] = None) -> None:
        with self._lock:
            self.stopped.add(index)
            if error is not None:
                self.failed[index] = error

    def snapshot(self) -> tuple[dict[int, dict[str, Any]], dict[int, float], set[int]]:
        with self._lock:
            return dict(self.joined), dict(self.last_beat), set(self.stopped)

    def failure(self, index: int) -> Optional[str]:
        with self._lock:
            return self.failed.get(index)

    def num_ready(self) -> int:
        with self._lock:
            return len(self.ready)


class Endpoint:
    """What a generator may call on the hub (one proxy per generator: every call is one
    request and one reply on an authenticated connection of the calling thread)."""

    def __init__(self, hub: "Hub") -> None:
        self._hub = hub

    def spec(self, index: int) -> Any:
        return self._hub.specs[index]

    def get_request(self, timeout: float) -> Any:
        """The next prompt request; raises queue.Empty after `timeout` seconds without one."""
        return self._hub.requests.get(timeout=timeout)

    def put_experience(self, item: Any, timeout: float) -> None:
        """Into the bounded experience queue; raises queue.Full after `timeout` seconds."""
        self._hub.experience.put(item, timeout=timeout)

    def stopping(self) -> bool:
        return self._hub.stop.is_set()

    def join(self, index: int, info: dict[str, Any]) -> None:
        self._hub.registry.join(index, info)

    def beat(self, index: int, idle_s: Optional[float] = None) -> None:
        self._hub.registry.beat(index, idle_s)

    def ready(self, index: int) -> None:
        """The engine is loaded; the generator joins the weight group once the trainer does."""
        self._hub.registry.set_ready(index)

    def stopped(self, index: int, error: Optional[str] = None) -> None:
        """The generator is done: after the trainer's stop (error None) or because it failed."""
        self._hub.registry.stop(index, error)


class _Manager(BaseManager):
    pass


_Manager.register("endpoint")


class Hub:
    """Trainer rank 0's end: the shared objects and the server that exposes them."""

    def __init__(self, specs: list[Any], experience_size: int, host: str, timeout_s: float,
                 progress_timeout_s: float = 1800.0) -> None:
        """`host`: the address generators connect to; the server listens on every interface
        unless it is a loopback address (generators on this node only). `timeout_s`: of the
        heartbeat (and of connecting); `progress_timeout_s`: of a generator's main loop."""
        self.specs, self.timeout_s, self.progress_timeout_s = list(specs), timeout_s, progress_timeout_s
        self.requests: queue.Queue = queue.Queue()
        self.experience: queue.Queue = queue.Queue(maxsize=experience_size)
        self.stop = threading.Event()
        self.registry = Registry()
        self.key = secrets.token_bytes(32)
        self.started = time.monotonic()

        class Served(BaseManager):  # this hub's endpoint
            pass

        endpoint = Endpoint(self)
        Served.register("endpoint", callable=lambda: endpoint)
        listen = host if host.startswith("127.") else ""
        self._server = Served(address=(listen, 0), authkey=self.key).get_server()
        self.address = (host, self._server.address[1])
        self._closed = threading.Event()
        self._server.stop_event = self._closed  # ends each connection's serving loop (Server.serve_client)
        self._thread = threading.Thread(target=self._serve, name="disagg-hub", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Accept connections, each served by a thread of the manager's server, until `close`.

        Not the server's own `serve_forever`: its accept loop retries a closed listener forever
        (a thread spinning at full speed after `close`: 8 of them starved the test process of the
        GIL), and on its way out it resets sys.stdout and sys.stderr to the process's originals."""
        while True:
            try:
                conn = self._server.listener.accept()
            except OSError:  # an aborted connection; or the listener is gone
                if self._closed.is_set():
                    return
                continue
            if self._closed.is_set():  # close()'s own wake-up call
                conn.close()
                return
            threading.Thread(target=self._server.handle_request, args=(conn,), daemon=True).start()

    def connection(self) -> dict[str, Any]:
        return {"host": self.address[0], "port": self.address[1], "key": self.key.hex(),
                "num_generators": len(self.specs)}

    def publish(self, run_dir: str | Path) -> Path:
        """Write the connection file for generators started separately (owner-only: it holds the key)."""
        path = hub_path(run_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.connection(), f)
        os.replace(tmp, path)
        return path

    def check(self, now: Optional[float] = None) -> None:
        """Raise RuntimeError if a generator failed, is silent (joined) or overdue (not joined)
        past the timeout, or has made no progress past the progress timeout."""
        now = time.monotonic() if now is None else now
        joined, last_beat, stopped = self.registry.snapshot()
        last_progress = self.registry.progress()
        for index in range(len(self.specs)):
            failure = self.registry.failure(index)
            if failure is not None:
                where = joined.get(index, {}).get("host", "?")
                raise RuntimeError(f"generator {index} on {where} failed: {failure}; see logs/generator{index}.log")
            if index in stopped:
                continue
            if index not in joined:
                if now - self.started > self.timeout_s:
                    raise RuntimeError(f"generator {index} has not connected within rollout.generator_timeout_s="
                                       f"{self.timeout_s:g}s of the trainer's start (is the generator step running? "
                                       "see logs/generator*.log)")
                continue
            silent = now - last_beat[index]
            if silent > self.timeout_s:
                where = joined[index].get("host", "?")
                raise RuntimeError(f"generator {index} on {where} has sent no heartbeat for {silent:.0f}s "
                                   f"(rollout.generator_timeout_s={self.timeout_s:g}): its process died or "
                                   f"cannot reach the trainer; see logs/generator{index}.log")
            idle = now - last_progress[index]
            if idle > self.progress_timeout_s:
                where = joined[index].get("host", "?")
                raise RuntimeError(f"generator {index} on {where} has made no progress for {idle:.0f}s "
                                   f"(rollout.generator_progress_timeout_s={self.progress_timeout_s:g}) though its "
                                   "heartbeat goes on: it hangs (in an engine call, a reward wait or a weight "
                                   f"update); see logs/generator{index}.log (py-spy dump --pid <its pid> shows where)")

    def all_ready(self) -> bool:
        """Every generator has loaded its engine (the trainer may build the weight group: the
        wait for a generator that is loading stays here, where `check` sees it fail)."""
        return self.registry.num_ready() == len(self.specs)

    def describe(self) -> str:
        """Each generator's host and when it was last heard from, for error messages."""
        joined, last_beat, stopped = self.registry.snapshot()
        last_progress = self.registry.progress()
        now, parts = time.monotonic(), []
        for index in range(len(self.specs)):
            if index not in joined:
                parts.append(f"generator {index}: never connected")
                continue
            state = "stopped" if index in stopped else (f"last heartbeat {now - last_beat[index]:.0f}s ago, "
                                                        f"last progress {now - last_progress[index]:.0f}s ago")
            parts.append(f"generator {index} on {joined[index].get('host', '?')}: {state}")
        return "; ".join(parts)

    def wait_stopped(self, timeout_s: float) -> list[int]:
        """After `stop` is set: wait until every joined generator that is still beating has said
        it stopped; returns those that did not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            joined, last_beat, stopped = self.registry.snapshot()
            now = time.monotonic()
            left = sorted(i for i in set(joined) - stopped if now - last_beat[i] < 3 * HEARTBEAT_S)
            if not left or now > deadline:
                return left
            time.sleep(0.1)

    def close(self) -> None:
        """Stop accepting (connections already served end with their generators) and free the port."""
        if self._closed.is_set():
            return
        self._closed.set()
        try:  # wake the accept call blocked in _serve: closing the socket under it would not
            socket.create_connection(self.address, timeout=2.0).close()
        except OSError:
            pass
        self._thread.join(timeout=5.0)
        self._server.listener.close()


class Progress:
    """A generator's main loop's last sign of progress, on its own clock: the loop calls `stamp()`
    as it goes, the heartbeat thread reports `idle_s()` (seconds, so no clocks are compared)."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def stamp(self) -> None:
        self._last = time.monotonic()

    def idle_s(self) -> float:
        return time.monotonic() - self._last


def heartbeat(endpoint: Any, index: int, until: threading.Event,
              progress: Optional[Progress] = None) -> threading.Thread:
    """Beat every HEARTBEAT_S in a daemon thread until `until` is set (or the hub is gone), each
    beat with `progress.idle_s()`; without `progress` the beats say nothing about progress, so
    after the hub's progress timeout the generator counts as hung."""
    def run() -> None:
        while not until.wait(HEARTBEAT_S):
            try:
                endpoint.beat(index, None if progress is None else progress.idle_s())
            except (OSError, EOFError):
                return

    thread = threading.Thread(target=run, name="heartbeat", daemon=True)
    thread.start()
    return thread


def connect(host: str, port: int, key: bytes) -> Any:
    """A generator's proxy of the hub's `Endpoint` (its connection is authenticated with `key`)."""
    manager = _Manager(address=(host, port), authkey=key)
    manager.connect()
    return manager.endpoint()


def connect_from_file(run_dir: str | Path, wait_s: float, poll_s: float = 0.5) -> Any:
    """Connect with `<run_dir>/disagg/hub.json`, waiting up to `wait_s` for the trainer to write
    it and to accept (a file left by an earlier start of the job is retried until it is replaced)."""
    return connect_with_file(run_dir, wait_s, poll_s)[0]


def connect_with_file(run_dir: str | Path, wait_s: float, poll_s: float = 0.5) -> tuple[Any, bytes]:
    """`connect_from_file`, and the hub's key it connected with (it authenticates the weight store)."""
    path = hub_path(run_dir)
    deadline = time.monotonic() + wait_s
    last_error = "the file does not exist yet"
    while time.monotonic() < deadline:
        try:
            info = json.loads(path.read_text())
            key = bytes.fromhex(info["key"])
            return connect(info["host"], int(info["port"]), key), key
        except FileNotFoundError:
            pass
        except (OSError, EOFError, ValueError, KeyError, multiprocessing.AuthenticationError) as exc:
            # a file left by an earlier start, or the hub not up yet
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(poll_s)
    raise TimeoutError(f"no trainer hub to connect to within {wait_s:g}s ({path}: {last_error})")
