"""Shared test set-up: one CPU thread per process (the CI box has 2 cores); fixtures more than
one tier uses."""

import asyncio
import json
import os
import threading
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def loop():
    """An event loop running in a thread of its own (as the reward service's), for episodes."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)


# The parallel pass (launch/test.sh) hands whole files to pytest-xdist workers in collection order
# (with --no-loadscope-reorder; xdist's default order, most tests first, puts the slow files of few
# tests last, where one worker runs them while the other idles). Longest first keeps the tail short:
# files are sorted by their seconds in durations.json (a file it lacks counts as DEFAULT_FILE_S).
# `MEGATRON_RL_RECORD_DURATIONS=1 bash launch/test.sh` updates it from the parallel pass.
DURATIONS = Path(__file__).with_name("durations.json")
DEFAULT_FILE_S = 20.0
_recorded: dict[str, float] = {}


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config, items):
    try:
        seconds = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(_file_of(item.nodeid), len(first_seen))
    items.sort(key=lambda item: (-seconds.get(_file_of(item.nodeid), DEFAULT_FILE_S),
                                 first_seen[_file_of(item.nodeid)]))


def _recording(config) -> bool:
    # the controller of an xdist run (workers report to it; the serial pass would record a part of each file)
    return os.environ.get("MEGATRON_RL_RECORD_DURATIONS") == "1" and bool(getattr(config.option, "numprocesses", 0)) \
        and not hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    _recorded[_file_of(report.nodeid)] = _recorded.get(_file_of(report.nodeid), 0.0) + report.duration


def pytest_sessionfinish(session):
    if _recording(session.config) and _recorded:  # files this run did not run keep their seconds
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}
        seconds.update({name: round(value, 1) for name, value in _recorded.items()})
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=1) + "\n")
