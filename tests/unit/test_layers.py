"""The layer rule, read from the source with ``ast`` (nothing is imported):

- the core (config, errors, sequence_parallel, topology, comm, loss, logprobs, zero, deepspeed_shm, masks, sharding,
  strategies, kernels, memory, schedule, dynamic, step_stats, ops, and cost: the cost model, which the runtime's
  scheduler prices documents with and the planner and bench read) imports nothing from models, launch,
  train, bench, report, hf or plan;
- models, launch and hf import the core only; train the core, models, launch and hf; bench those,
  train (it times the training step through train.run_training), report's plotting helper, rows,
  renderer and targets, and plan's hardware profiles and model shapes;
  plan the core, models, hf, launch and report's rows and renderer (--calibrate);
  report the core only (nothing of train, bench or plan);
- only comm.py talks to torch.distributed (launch/ and train/, which start the world, may too; and
  bench/trainer.py, which runs DeepSpeed's own Ulysses path: it reproduces that path's raw calls and
  the gloo errors they raise, and stands in for one of them, so it must call what that code calls);
- every folder of the package is a package (has __init__.py), so an install ships it;
- no import circles: no module reaches itself through the modules it imports (KNOWN_CYCLES would
  list any still being taken apart; it is empty).

docs/design.md states the rule; a new top-level module or folder must be given a layer here.
"""
from __future__ import annotations

import ast
import os
from typing import Dict, List, Optional, Set, Tuple

import ds_seqpar

PACKAGE = "ds_seqpar"
CORE = frozenset({"config", "errors", "sequence_parallel", "topology", "comm", "loss", "logprobs", "zero",
                  "sharding", "strategies", "kernels", "memory", "masks", "schedule", "dynamic", "step_stats", "ops",
                  "cost", "deepspeed_shm"})
TOOLS = frozenset({"models", "launch", "train", "bench", "report", "hf", "plan", "dashboard"})
# layer -> the layers it may import besides itself ("report.plotting": that one module of report)
ALLOWED = {
    "core": {"core"},
    "models": {"core"},
    "launch": {"core"},
    "hf": {"core"},
    "train": {"core", "models", "launch", "hf"},
    "bench": {"core", "models", "launch", "hf", "train", "report.plotting", "report.rows", "report.render",
              "report.targets",                     # bench writes rows and renders them; report never reads bench
              "plan.hardware"},                     # the gpu suite: a device's peak
    "report": {"core"},
    "plan": {"core", "models", "hf", "launch", "report.rows", "report.render"},   # the own LM's ModelConfig; HF
                                            # configs through hf/; --calibrate's ranks, the rows it reads and writes
    "dashboard": set(),                     # the wandb view: plain data, imports nothing of the package
    "root": {"core"},                       # ds_seqpar/__init__.py: the public API is the core's
    "cli": {"core", "models", "launch", "hf", "train", "bench", "report", "plan", "dashboard"},     # the entry point over all commands
}
DIST_ALLOWED = ("comm", "launch", "train")  # may call torch.distributed
# a third party's calls (DeepSpeed's ALST under --trainer), reproduced as it makes them
DIST_ALLOWED_MODULES = ("ds_seqpar.bench.trainer",)
DIST = "torch.distributed"


def layer_of(module: str) -> Optional[str]:
    """ds_seqpar.strategies.ring -> "core"; ds_seqpar.bench.main -> "bench"; None: no layer given."""
    parts = module.split(".")
    if parts == [PACKAGE]:
        return "root"
    top = parts[1]
    if top in CORE:
        return "core"
    if top in TOOLS or top == "cli":
        return top
    return None


def _allowed(importer: str, imported: str) -> bool:
    mine, theirs = layer_of(importer), layer_of(imported)
    theirs = "core" if theirs == "root" else theirs          # ds_seqpar itself re-exports the core
    if mine == theirs:
        return True
    ok = ALLOWED.get(mine, set())
    return theirs in ok or any(imported == f"{PACKAGE}.{x}" or imported.startswith(f"{PACKAGE}.{x}.")
                               for x in ok if "." in x)


# ---------------------------------------------------------------------------------------------
# reading the source


def modules(root: str) -> Dict[str, str]:
    """{dotted module name: file path} of every .py file under the package folder ``root``."""
    base = os.path.dirname(root)
    out = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), base)[:-3].split(os.sep)
                name = ".".join(rel[:-1] if rel[-1] == "__init__" else rel)
                out[name] = os.path.join(folder, f)
    return out


def _resolve(module: str, is_package: bool, level: int, target: Optional[str]) -> str:
    """The absolute name of ``from <.. level><target> import ...`` written in ``module``."""
    if level == 0:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def imports_of(module: str, path: str, known: Set[str]) -> Tuple[Set[str], List[str]]:
    """(the package modules ``module`` imports, its uses of torch.distributed as 'line N: what'),
    from the file's syntax tree; imports inside functions count too."""
    tree = ast.parse(open(path).read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    found: Set[str] = set()
    dist_uses: List[str] = []
    dist_names: Set[str] = set()            # local names bound to torch.distributed
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
                if alias.name == DIST or alias.name.startswith(DIST + "."):
                    dist_uses.append(f"line {node.lineno}: import {alias.name}")
                    dist_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            for alias in node.names:
                full = f"{base}.{alias.name}"
                # ``from . import comm`` imports the module ds_seqpar.comm; ``from .x import name``, x
                found.add(full if full in known else base)
                if base == DIST or base.startswith(DIST + ".") or full == DIST:
                    dist_uses.append(f"line {node.lineno}: from {base} import {alias.name}")
                    if full == DIST:
                        dist_names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "torch" and node.attr == "distributed":
                dist_uses.append(f"line {node.lineno}: torch.distributed")
    for node in ast.walk(tree):             # calls through an alias: dist.all_reduce(...)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in dist_names \
                and node.value.id != "torch":
            dist_uses.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}, dist_uses


def violations(root: str) -> List[str]:
    """Every break of the layer rule in the package folder ``root``, one line each ([] when none)."""
    found = modules(root)
    known = set(found)
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
            out.append(f"{os.path.relpath(folder, os.path.dirname(root))}/ has no __init__.py: an install "
                       f"(packages = find:) would leave it out")
    for module, path in sorted(found.items()):
        layer = layer_of(module)
        if layer is None:
            out.append(f"{module}: in no layer; give it one in tests/unit/test_layers.py and docs/design.md")
            continue
        imported, dist_uses = imports_of(module, path, known)
        for target in sorted(imported):
            if layer_of(target) is not None and not _allowed(module, target):
                out.append(f"{module} ({layer}) imports {target} ({layer_of(target)})")
        top = module.split(".")[1] if "." in module else ""
        if top not in DIST_ALLOWED and module not in DIST_ALLOWED_MODULES:
            out += [f"{module} uses torch.distributed ({use}); go through ds_seqpar.comm" for use in dist_uses]
    return out


# ---------------------------------------------------------------------------------------------
# import circles

# Circles still in the package, each the set of modules that reach one another. None is left: bench's
# split into one harness and one module per suite took its three apart. Nothing may join this set.
KNOWN_CYCLES: frozenset = frozenset()


def import_graph(root: str) -> Dict[str, Set[str]]:
    """{module: the package modules its import statements name} for the package folder ``root``.

    Imports inside functions count: a lazy import is how a circle hides (it only moves the failure
    from import time to the first call, and keeps the modules inseparable). The packages above a
    module, which Python runs before it, are not edges: every package's __init__.py imports its own
    submodules, so with those edges every package would be a circle."""
    found = modules(root)
    return {m: imports_of(m, path, set(found))[0] - {m} for m, path in found.items()}


def circles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The import circles of ``graph``: its strongly connected components of more than one module
    (Tarjan), each sorted, in sorted order."""
    order: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out: List[List[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v] & graph.keys():
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:              # v is the first of its component reached: pop the component
            members = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(members) > 1:
                out.append(sorted(members))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return sorted(out)


def one_loop(graph: Dict[str, Set[str]], members: List[str]) -> str:
    """A shortest path from the circle's first module back to itself, 'a -> b -> a' (breadth-first)."""
    start, inside = members[0], set(members)
    came_from: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & inside):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return " -> ".join([start] + path[::-1][1:] + [start])
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise ValueError(f"{members} is not a circle of the graph")


def circle_report(graph: Dict[str, Set[str]]) -> List[str]:
    """The circles not in KNOWN_CYCLES and the known ones that are gone, one line each ([] when none)."""
    found = circles(graph)
    new = [f"import circle: {one_loop(graph, c)}" for c in found if frozenset(c) not in KNOWN_CYCLES]
    gone = [f"{sorted(c)} is no longer a circle: remove it from KNOWN_CYCLES"
            for c in sorted(KNOWN_CYCLES - {frozenset(c) for c in found}, key=sorted)]
    return new + gone


# ---------------------------------------------------------------------------------------------
# the rule holds for the package, and the checker catches each kind of break


def test_the_package_keeps_the_layer_rule():
    root = os.path.dirname(ds_seqpar.__file__)
    broken = violations(root)
    assert not broken, "layer rule broken (docs/design.md):\n" + "\n".join(broken)


def test_every_module_was_read():
    # a checker that reads nothing passes everything: the core and the tools must be there
    found = modules(os.path.dirname(ds_seqpar.__file__))
    for name in ("ds_seqpar.comm", "ds_seqpar.strategies.ring_loop", "ds_seqpar.kernels.linear.forward",
                 "ds_seqpar.bench.main", "ds_seqpar.train.trainer", "ds_seqpar.report.plotting"):
        assert name in found, sorted(found)
    imported, _ = imports_of("ds_seqpar.sequence_parallel", found["ds_seqpar.sequence_parallel"], set(found))
    assert {"ds_seqpar.comm", "ds_seqpar.strategies", "ds_seqpar.sharding.layouts"} <= imported, imported


FAKE = {
    "__init__.py": "from .config import X\n",
    "config.py": "X = 1\n",
    "comm.py": "import torch.distributed as dist\n\ndef f():\n    return dist.get_rank()\n",
    "loss.py": "def f():\n    from .train import main   # a lazy import still counts\n",
    "kernels/__init__.py": "",
    "kernels/base.py": "from ..bench import cases\nfrom .. import models\n",
    "kernels/fine.py": "from . import base\nfrom ..config import X\n",
    "models/__init__.py": "import torch\n\ndef f(x):\n    return torch.distributed.all_reduce(x)\n",
    "train/__init__.py": "from ..models import f\nfrom ..launch import g\nimport torch.distributed\n",
    "launch/__init__.py": "def g():\n    pass\n",
    "bench/__init__.py": "",
    "bench/cases.py": "from ..train import f\nfrom ..report.plotting import save\nfrom ..report import main\n",
    "report/__init__.py": "",
    "report/plotting.py": "def save():\n    pass\n",
    "report/main.py": "from ..bench.cases import x\nfrom torch import distributed\n",
    "stray.py": "",
    "sharding/layouts.py": "",
}


def _fake_package(tmp_path) -> str:
    root = tmp_path / PACKAGE
    for rel, text in FAKE.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(root)


def test_checker_finds_every_kind_of_break_in_a_fake_package(tmp_path):
    got = violations(_fake_package(tmp_path))
    assert got == [
        "ds_seqpar/sharding/ has no __init__.py: an install (packages = find:) would leave it out",
        "ds_seqpar.bench.cases (bench) imports ds_seqpar.report.main (report)",
        "ds_seqpar.kernels.base (core) imports ds_seqpar.bench.cases (bench)",
        "ds_seqpar.kernels.base (core) imports ds_seqpar.models (models)",
        "ds_seqpar.loss (core) imports ds_seqpar.train (train)",
        "ds_seqpar.models uses torch.distributed (line 4: torch.distributed); go through ds_seqpar.comm",
        "ds_seqpar.report.main (report) imports ds_seqpar.bench.cases (bench)",
        "ds_seqpar.report.main uses torch.distributed (line 2: from torch import distributed); go through "
        "ds_seqpar.comm",
        "ds_seqpar.stray: in no layer; give it one in tests/unit/test_layers.py and docs/design.md",
    ], "\n".join(got)


def test_the_cost_model_is_core(tmp_path):
    """cost/ is the core's: the runtime's scheduler prices with it, so it may not reach the planner."""
    assert [layer_of(f"ds_seqpar.{m}") for m in ("cost", "cost.pairs", "plan.search")] == ["core", "core", "plan"]
    root = tmp_path / PACKAGE
    for rel, text in {"__init__.py": "", "strategies/__init__.py": "", "plan/__init__.py": "",
                      "plan/search.py": "from ..cost import z\n",
                      "cost/__init__.py": "from ..plan.search import x\nfrom ..strategies import y\n"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    assert violations(str(root)) == ["ds_seqpar.cost (core) imports ds_seqpar.plan.search (plan)"]


def test_relative_imports_resolve_against_the_importing_module():
    assert _resolve("ds_seqpar.kernels.base", False, 2, "bench") == "ds_seqpar.bench"
    assert _resolve("ds_seqpar.kernels", True, 1, "base") == "ds_seqpar.kernels.base"        # in __init__.py
    assert _resolve("ds_seqpar.kernels.linear.forward", False, 3, None) == "ds_seqpar"
    assert _resolve("ds_seqpar.comm", False, 0, "torch.distributed") == "torch.distributed"


def test_the_package_has_no_import_circle():
    graph = import_graph(os.path.dirname(ds_seqpar.__file__))
    broken = circle_report(graph)
    assert not broken, ("import circles (lazy imports count; a name that both sides need belongs in a module "
                        "that imports neither, as ds_seqpar/errors.py holds the exceptions):\n" + "\n".join(broken))


CIRCLES = {
    "__init__.py": "from .config import X\n",
    "config.py": "from .kernels import K\nX = 1\n",
    "kernels/__init__.py": "from .base import K\n",           # the package imports its submodule: no circle
    "kernels/base.py": "K = 1\n\ndef f():\n    from ..config import X   # lazy, still a circle\n",
    "hf/__init__.py": "",
    "hf/a.py": "from . import b\n",
    "hf/b.py": "from .a import x\nfrom .. import config\n",
    "hf/c.py": "from .a import x\n",                           # reaches a circle, is in none
}


def test_circles_are_found_through_lazy_and_relative_imports(tmp_path):
    root = tmp_path / PACKAGE
    for rel, text in CIRCLES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    graph = import_graph(str(root))
    assert circles(graph) == [["ds_seqpar.config", "ds_seqpar.kernels", "ds_seqpar.kernels.base"],
                              ["ds_seqpar.hf.a", "ds_seqpar.hf.b"]], circles(graph)
    assert one_loop(graph, ["ds_seqpar.config", "ds_seqpar.kernels", "ds_seqpar.kernels.base"]) == \
        "ds_seqpar.config -> ds_seqpar.kernels -> ds_seqpar.kernels.base -> ds_seqpar.config"
    assert circle_report(graph)[:2] == ["import circle: ds_seqpar.config -> ds_seqpar.kernels -> "
                                        "ds_seqpar.kernels.base -> ds_seqpar.config",
                                        "import circle: ds_seqpar.hf.a -> ds_seqpar.hf.b -> ds_seqpar.hf.a"]
    # the known circles are not in this package: each must be reported gone
    assert len(circle_report(graph)) == 2 + len(KNOWN_CYCLES), circle_report(graph)
