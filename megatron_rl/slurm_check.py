"""Pre-flight check of a Slurm job's request against the cluster, before it waits in the queue:

    python -m megatron_rl.slurm_check [--script slurm/run.sh] [sbatch options ...]

Slurm accepts a job that no node can ever run (more GPUs per node than any node has, a partition with
fewer nodes than asked) and leaves it pending unless the site sets `EnforcePartLimits`. This reads the
request from the script's `#SBATCH` lines (one set per heterogeneous component, split at `#SBATCH hetjob`)
and the sbatch options given after it (components separated by `:`, as sbatch takes them, overriding the
script's), asks `sinfo` and `scontrol show partition` what the partitions hold, and prints one line per
condition that cannot be met. Exit status 0: every component can run; 1: some cannot; 2: the check could
not ask Slurm. Written by hand: Slurm itself offers no dry run that judges a request against node sizes
(`sbatch --test-only` only estimates a start time, and accepts requests no node satisfies).
Also the readers of Slurm's answers the running job uses (`minutes`, `job_fields`).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

# sbatch's long and short option names -> the request field they set
_OPTIONS = {"--partition": "partition", "-p": "partition", "--nodes": "nodes", "-N": "nodes",
            "--ntasks-per-node": "ntasks_per_node", "--gpus-per-node": "gpus_per_node",
            "--cpus-per-task": "cpus_per_task", "-c": "cpus_per_task", "--mem": "mem", "--time": "time",
            "-t": "time"}


@dataclass
class Request:
    """One component's request; None: not asked (Slurm's default)."""
    partition: Optional[str] = None
    nodes: Optional[str] = None
    ntasks_per_node: Optional[str] = None
    gpus_per_node: Optional[str] = None
    cpus_per_task: Optional[str] = None
    mem: Optional[str] = None
    time: Optional[str] = None
    given: dict = field(default_factory=dict)  # field -> the option as written, for messages

    def set(self, option: str, value: str) -> None:
        name = _OPTIONS.get(option)
        if name is not None:
            setattr(self, name, value)
            self.given[name] = f"{option}={value}"


@dataclass
class Node:
    name: str
    cpus: int
    memory_mb: int
    gpus: int


def parse_options(words: Sequence[str], into: Request) -> None:
    """sbatch options (`--nodes=2`, `--nodes 2`, `-N 2`, `-N2`) into `into`; other options are ignored."""
    words = list(words)
    i = 0
    while i < len(words):
        word = words[i]
        if word.startswith("--") and "=" in word:
            into.set(*word.split("=", 1))
        elif word in _OPTIONS and i + 1 < len(words):
            into.set(word, words[i + 1])
            i += 1
        elif re.fullmatch(r"-[pNct]\S+", word):
            into.set(word[:2], word[2:])
        i += 1


def script_requests(script: Path) -> list[Request]:
    """The `#SBATCH` lines of `script`, one Request per heterogeneous component."""
    components = [Request()]
    for line in script.read_text().splitlines():
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.startswith("#"):
                break  # sbatch reads #SBATCH lines only before the first command
            continue
        words = shlex.split(line[len("#SBATCH"):], comments=True)
        if words == ["hetjob"] or words == ["packjob"]:
            components.append(Request())
        else:
            parse_options(words, components[-1])
    return components


def apply_command_line(components: list[Request], words: Sequence[str]) -> list[Request]:
    """sbatch options given on the command line, `:` between components, over the script's."""
    groups: list[list[str]] = [[]]
    for word in words:
        if word == ":":
            groups.append([])
        else:
            groups[-1].append(word)
    for k, group in enumerate(groups):
        while k >= len(components):
            components.append(Request())
        parse_options(group, components[k])
    return components


def memory_mb(text: str) -> int:
    """sbatch's --mem (default unit M; K, M, G, T suffixes) in MB; 0: all of a node's memory."""
    match = re.fullmatch(r"(\d+)([KMGT]?)B?", text.strip().upper())
    if not match:
        raise ValueError(f"--mem={text} is not a size")
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2)]
    return int(int(match.group(1)) * scale)


def minutes(text: str) -> Optional[float]:
    """A Slurm time (`MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, `D-HH:MM`, `D-HH:MM:SS`) in minutes; None: unlimited, or
    not a time (e.g. scontrol's `Partition_Limit`)."""
    text = text.strip()
    if not re.fullmatch(r"(\d+-)?\d+(:\d+){0,2}", text):
        return None
    days, _, rest = text.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        hours, mins, secs = (parts + [0, 0])[:3]
        return int(days) * 1440 + hours * 60 + mins + secs / 60
    if len(parts) == 1:
        return float(parts[0])
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    return parts[0] * 60 + parts[1] + parts[2] / 60


def job_fields(job_id: str) -> dict[str, str]:
    """`scontrol show job`'s fields of the job (its first component); {} if scontrol does not answer."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", str(job_id)], capture_output=True, text=True,
                             timeout=2).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(f.split("=", 1) for f in (out[0] if out else "").split() if "=" in f)


def gpu_count(gres: str) -> int:
    """GPUs in sinfo's %G (`gpu:2`, `gpu:a100:4(S:0-1)`, `gpu:a100:4,shard:8`, `(null)`)."""
    total = 0
    for entry in gres.split(","):
        entry = re.sub(r"\(.*?\)", "", entry)
        parts = entry.split(":")
        if parts[0] == "gpu" and len(parts) >= 2 and parts[-1].isdigit():
            total += int(parts[-1])
    return total


def _run(cmd: list[str]) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def cluster_nodes(partition: Optional[str]) -> list[Node]:
    """The nodes of `partition` (the default partition when None), from sinfo."""
    cmd = ["sinfo", "-h", "-N", "-o", "%N|%c|%m|%G"] + (["-p", partition] if partition else [])
    nodes = {}
    for line in _run(cmd).splitlines():
        name, cpus, mem, gres = line.split("|")
        nodes[name] = Node(name, int(re.sub(r"\D.*", "", cpus) or 0), int(re.sub(r"\D.*", "", mem) or 0),
                           gpu_count(gres))
    return list(nodes.values())


def partition_info(partition: str) -> dict[str, str]:
    out = _run(["scontrol", "-o", "show", "partition", partition])
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


def partitions() -> tuple[list[str], Optional[str]]:
    """The cluster's partitions and its default one (sinfo marks it with `*`; None: no default)."""
    names = _run(["sinfo", "-h", "-o", "%P"]).splitlines()
    return [n.rstrip("*") for n in names], next((n[:-1] for n in names if n.endswith("*")), None)


def problems(component: int, request: Request) -> list[str]:
    """What in `request` no node or limit of its partition can meet, one line each."""
    known, default = partitions()
    partition = request.partition or default
    where = f"component {component} (partition {partition})"
    if partition is None:
        return [f"component {component}: no --partition and the cluster has no default partition"]
    if partition not in known:
        return [f"{where}: no such partition; the cluster has {', '.join(known)} (sinfo -s)"]
    nodes = cluster_nodes(partition)
    out = []
    wanted_nodes = int(re.split(r"-", request.nodes)[0]) if request.nodes else 1
    if wanted_nodes > len(nodes):
        out.append(f"{where}: {request.given['nodes']} asks for {wanted_nodes} nodes, the partition has "
                   f"{len(nodes)} ({', '.join(n.name for n in nodes)})")
    fit = list(nodes)
    if request.gpus_per_node:
        gpus = int(re.sub(r"^.*:", "", request.gpus_per_node))
        fit = [n for n in fit if n.gpus >= gpus]
        if not fit:
            most = max((n.gpus for n in nodes), default=0)
            out.append(f"{where}: {request.given['gpus_per_node']}, but its nodes have at most {most} GPUs")
    pool = fit or nodes  # the CPU and memory checks also run when no node has the GPUs
    cpus = int(request.cpus_per_task or 1) * int(request.ntasks_per_node or 1)
    if pool and cpus > max(n.cpus for n in pool):
        asked = " x ".join(request.given[k] for k in ("cpus_per_task", "ntasks_per_node") if k in request.given)
        out.append(f"{where}: {asked} needs {cpus} CPUs per node, its nodes have at most "
                   f"{max(n.cpus for n in pool)}")
    if pool and request.mem and memory_mb(request.mem) > max(n.memory_mb for n in pool):
        out.append(f"{where}: {request.given['mem']}, but its nodes have at most {max(n.memory_mb for n in pool)} MB "
                   "(--mem=0: all of a node's memory)")
    if fit and len(fit) < wanted_nodes <= len(nodes):
        out.append(f"{where}: {wanted_nodes} nodes must each meet the request, {len(fit)} do")
    info = partition_info(partition)
    limit = minutes(info.get("MaxTime", "UNLIMITED"))
    if request.time and limit is not None and (minutes(request.time) or 0) > limit:
        out.append(f"{where}: {request.given['time']} exceeds the partition's MaxTime={info['MaxTime']}")
    max_nodes = info.get("MaxNodes", "UNLIMITED")
    if max_nodes.isdigit() and wanted_nodes > int(max_nodes):
        out.append(f"{where}: {wanted_nodes} nodes exceed the partition's MaxNodes={max_nodes}")
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_rl.slurm_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--script", type=Path, default=Path(__file__).resolve().parents[1] / "slurm" / "run.sh",
                        help="the batch script whose #SBATCH lines are the request (default slurm/run.sh)")
    args, sbatch_options = parser.parse_known_args(argv)
    components = apply_command_line(script_requests(args.script), sbatch_options)
    try:
        found = [line for k, request in enumerate(components) for line in problems(k, request)]
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"slurm_check: cannot ask Slurm ({exc}); run it where sinfo and scontrol work", file=sys.stderr)
        return 2
    for line in found:
        print(line)
    if found:
        print(f"{args.script}: this request can never start on this cluster; change the options above "
              "(on the command line, or in a copy of the script)")
        return 1
    print(f"{args.script}: every component's request fits this cluster's nodes and partition limits")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
