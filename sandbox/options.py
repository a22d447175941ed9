"""The sandbox server's command line: options, and their parsing into runtime images and per-class
scheduling policies (server.py runs what they describe)."""

from __future__ import annotations

import argparse
import dataclasses
import os

from megatron_rl_sandbox.limits import Limits
from megatron_rl_sandbox.proto import DEFAULT_MESSAGE_BYTES
from megatron_rl_sandbox.scheduler import CLASSES, DEFAULT_WEIGHTS, ClassPolicy


def parse_images(values: list[str]) -> dict[str, str]:
    images = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--image expects name=/path, got {value!r}")
        images[name] = path
    return images


def parse_class_values(text: str, cast: type, option: str) -> dict:
    """`training=4,build=1` -> {"training": 4.0, "build": 1.0}; names must be priority classes."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in CLASSES:
            raise SystemExit(f"{option} expects class=value pairs with classes from {', '.join(CLASSES)}, "
                             f"got {item!r}")
        try:
            out[name] = cast(value)
        except ValueError:
            raise SystemExit(f"{option}: {name}={value!r} is not a {cast.__name__}") from None
    return out


def class_policies(weights: str, quotas: str, max_queues: str) -> dict[str, ClassPolicy]:
    """Per-class scheduling policy from the --class-* options (unset: default weight, no own limits)."""
    w = {**DEFAULT_WEIGHTS, **parse_class_values(weights, float, "--class-weights")}
    q = parse_class_values(quotas, int, "--class-quota")
    m = parse_class_values(max_queues, int, "--class-max-queue")
    try:
        return {c: ClassPolicy(weight=w[c], quota=q.get(c, 0), max_queue=m.get(c, 0)) for c in CLASSES}
    except ValueError as exc:
        raise SystemExit(f"sandbox server: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_rl_sandbox.server",
                                description="The sandbox gRPC server: runs untrusted code under hard limits.")
    p.add_argument("--address", default="127.0.0.1:0", help="host:port or unix:/path (port 0 picks one)")
    p.add_argument("--advertise", default=None, help="address written to the discovery file (default: host:port)")
    p.add_argument("--runtime", default="bwrap", choices=["bwrap", "apptainer", "process"])
    p.add_argument("--image", action="append", default=[], help="name=/path (rootfs dir, SIF or sandbox dir)")
    p.add_argument("--apptainer-cmd", default="apptainer")
    p.add_argument("--allow-unisolated", action="store_true", help="required for --runtime process")
    p.add_argument("--allow-network", action="store_true", help="let requests turn the network on")
    p.add_argument("--limiter", default="auto", choices=["auto", "cgroup-v1", "cgroup-v2", "rlimit"])
    p.add_argument("--capacity", type=int, default=os.cpu_count() or 1, help="concurrent executions")
    p.add_argument("--max-queue", type=int, default=256, help="waiting executions before refusing")
    p.add_argument("--class-weights", default=",".join(f"{c}={w:g}" for c, w in DEFAULT_WEIGHTS.items()),
                   help="weighted fair queueing weights per priority class (unset classes keep their default)")
    p.add_argument("--class-quota", default="", help="most running executions per class, e.g. build=1,quality=1")
    p.add_argument("--class-max-queue", default="",
                   help="most waiting executions per class before refusing (default: --max-queue), e.g. build=64")
    p.add_argument("--max-sessions", type=int, default=512)
    p.add_argument("--session-idle-timeout-s", type=float, default=1800.0,
                   help="close sessions no call has used this long (a client that died never closes its "
                        "own); 0 keeps them until closed")
    p.add_argument("--prewarm", type=int, default=8, help="ready workspaces kept mounted")
    p.add_argument("--sandbox-uid", type=int, default=65534,
                   help="as root: the unprivileged host uid every command runs as and workspaces belong to "
                        "(default 65534, nobody); never 0")
    p.add_argument("--sandbox-gid", type=int, default=65534, help="as root: the host gid of commands (never 0)")
    p.add_argument("--max-message-bytes", type=int, default=DEFAULT_MESSAGE_BYTES,
                   help="largest request or reply (the client's max_message_bytes must be the same); a reply's "
                        "outputs are cut to fit and flagged truncated")
    p.add_argument("--remember-bytes", type=int, default=256 * 2**20,
                   help="most bytes of replies kept for idempotent retries (the oldest are forgotten first)")
    p.add_argument("--work-dir", default=None,
                   help="where workspaces live (default: a fresh temp dir, removed at exit; one that a killed "
                   "server left is removed by the next server started with the same TMPDIR). Locked while the "
                   "server runs: a second server on the same directory is refused")
    p.add_argument("--run-dir", default=None, help="write the discovery file into <run-dir>/sandbox/")
    p.add_argument("--name", default=None, help="server name in results and the discovery file")
    p.add_argument("--drain-s", type=float, default=30.0,
                   help="grace period for running calls when draining (SIGTERM or SIGINT)")
    p.add_argument("--ignore-sigterm", action="store_true",
                   help="log SIGTERM and serve on; only SIGINT drains (a server the training job stops itself)")
    for field in dataclasses.fields(Limits):
        if field.name != "network":
            p.add_argument(f"--default-{field.name.replace('_', '-')}", type=type(field.default),
                           default=field.default)
    return p
