"""The packages' modules (megatron_rl and sandbox) import each other without a circle: every `import` of
one of their modules, top-level or inside a function, read from the source (a lazy import inside a
function is still a circle in the design, only one Python tolerates). And the arrows point down: only
the entry points import the RL loop (megatron_rl.rl, megatron_rl.train)."""

import ast
from pathlib import Path

import megatron_rl
import megatron_rl_sandbox
from megatron_rl import families

# package name -> its directory (the sandbox service is installed as megatron_rl_sandbox from sandbox/)
ROOTS = {"megatron_rl": Path(megatron_rl.__file__).parent,
         "megatron_rl_sandbox": Path(megatron_rl_sandbox.__file__).parent}
# what may import the loop: the loop itself and the entry points that run it (or check its config)
ABOVE_THE_LOOP = ("megatron_rl.rl", "megatron_rl.train", "megatron_rl.eval", "megatron_rl.slurm_job")


def _modules() -> dict[str, Path]:
    out = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            parts = (package, *path.relative_to(root).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the megatron_rl modules it imports (`from pkg import mod` counts as importing `pkg.mod`,
    and `from pkg.mod import name` as importing `pkg.mod`; the bare `megatron_rl` package is left out)."""
    modules = _modules()
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target not in (name, "megatron_rl", "megatron_rl_sandbox"):
                    edges[name].add(target)
                    edges[name] |= _packages_run_first(name, target, modules)
                    break  # the deepest module named is what is imported
    return edges


def _packages_run_first(importer: str, target: str, modules: dict[str, Path]) -> set[str]:
    """Importing a.b.c runs the packages a and a.b first (their __init__), unless the importer is inside one
    (then it is already running)."""
    out = set()
    package = target.rpartition(".")[0]
    while package and package not in ("megatron_rl", "megatron_rl_sandbox"):
        if package in modules and not (importer + ".").startswith(package + "."):
            out.add(package)
        package = package.rpartition(".")[0]
    return out


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_planted_circle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(edges) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_lazy_imports_and_the_packages_an_import_runs():
    edges = import_graph()
    # families/glm4_moe.py imports megatron_rl.checks (a leaf); had it imported megatron_rl.config.x, the
    # package's __init__ (the loader, the schema, which imports families) would run first: a circle
    assert "megatron_rl.config" in edges["megatron_rl.rl.evaluate"] or "megatron_rl.config" in edges[
        "megatron_rl.evaluation.runner"]
    # evaluation/records.py imports is_scored inside a function: that edge is in the graph
    assert "megatron_rl.rollout.collect" in edges["megatron_rl.evaluation.records"]
    assert "megatron_rl.rollout.scheduler" in edges["megatron_rl.rollout.episodes"]


def test_megatron_rl_and_sandbox_have_no_import_circle():
    edges = import_graph()
    assert "megatron_rl_sandbox.limits" in edges["megatron_rl_sandbox.server"]  # the sandbox's own imports seen
    assert circles(edges) == []


def _in(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_only_the_entry_points_import_the_rl_loop():
    """Evaluation, quality, disagg, rollout, trainer and the rest take what they need from below the loop."""
    edges = import_graph()
    assert "megatron_rl.rl.state" in edges["megatron_rl.rl.loop"]  # the walk sees the rl package
    upward = sorted(f"{name} -> {target}" for name, targets in edges.items() for target in targets
                    if _in(target, ("megatron_rl.rl", "megatron_rl.train")) and not _in(name, ABOVE_THE_LOOP))
    assert upward == []


def test_every_family_converter_is_listed_once():
    from megatron_rl.families.convert.dense import DenseDecoderConverter

    listed = {spec.converter for spec in families.FAMILIES.values()}
    defined = set()
    for path in Path(families.__file__).parent.glob("*.py"):
        module = __import__(f"megatron_rl.families.{path.stem}", fromlist=["_"])
        defined |= {v for v in vars(module).values() if isinstance(v, type) and issubclass(v, DenseDecoderConverter)
                    and v.__module__ == module.__name__ and "family" in vars(v)}  # a concrete family names itself
    defined.discard(DenseDecoderConverter)  # the generic base ("dense"), not a family of its own
    assert defined == listed, f"family converters no spec names: {defined - listed}"
    assert len({c.family for c in listed}) == len(listed)
