"""The import direction of components/embshard (docs/architecture.md): DAG -> stages -> jobs -> algorithms ->
types/schemas, no cycle between packages or top-level modules, no job importing another job.

The graph is built with `ast` from every import in the source, module-level AND inside functions (most of the
package imports lazily, so a cycle through function-level imports is still a cycle of the design). A unit is a
package (embshard.bench, embshard.planners, ...), a top-level module (embshard.stages), or one job module
(embshard.jobs.bench): imports inside a unit are free.
"""
from __future__ import annotations

import ast
import collections
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "components")
PKG = "embshard"

# The layers, top to bottom. A unit may import its own layer or any layer below it, never one above.
LAYERS: dict[str, tuple[str, ...]] = {
    # What the DAG and people call: the command line, the local runners, the public API (embshard.load_planner).
    "entry": ("embshard", "embshard.__main__", "embshard.cli", "embshard.pipeline", "embshard.airflow_local",
              "embshard.run_owner", "embshard.prune"),
    # The stage table (what a DAG task runs), its report, the outer loop shared by the DAG and the CLI, the
    # params and the pod configuration.
    "stages": ("embshard.stages", "embshard.stage_report", "embshard.outer_loop", "embshard.params", "embshard.k8s"),
    "jobs": ("embshard.jobs",),  # and every embshard.jobs.<name>
    "algorithms": ("embshard.bench", "embshard.costmodel", "embshard.policy", "embshard.planners", "embshard.export",
                   "embshard.ingest", "embshard.ruler", "embshard.evaluation", "embshard.placement_report",
                   "embshard.heuristics", "embshard.torchrec_compat", "embshard.refine"),
    "types": ("embshard.types", "embshard.schemas", "embshard.errors", "embshard.checks", "embshard.storage",
              "embshard.features", "embshard.tableset", "embshard.placement", "embshard.hardware", "embshard.pools",
              "embshard.registry", "embshard.run_context", "embshard.stats", "embshard.version",
              "embshard.run_layout", "embshard.collectives", "embshard.signals", "embshard.imports"),
}
ORDER = list(LAYERS)  # index 0 is the top

# Algorithm units are independent of one another except along these edges (what both need moves down into the
# types layer otherwise). Each edge is a dependency of the method, not of convenience.
ALGORITHM_EDGES = {
    ("embshard.planners", "embshard.policy"),     # the learned planner runs the policy network
    ("embshard.planners", "embshard.costmodel"),  # planners score plans with the cost model (costmodel.scoring)
    ("embshard.planners", "embshard.heuristics"),  # the greedy baselines and proposers use the proxies
    ("embshard.planners", "embshard.torchrec_compat"),  # the TorchRec baseline speaks TorchRec's vocabulary
    ("embshard.policy", "embshard.costmodel"),    # the policy is trained on the cost model's estimates
    ("embshard.policy", "embshard.heuristics"),   # ... and validated against the greedy baselines' proxies
    ("embshard.export", "embshard.torchrec_compat"),  # the export writes TorchRec plans in that vocabulary
    ("embshard.bench", "embshard.ingest"),        # the benchmark replays the ingest's traces and bag lengths
    ("embshard.export", "embshard.ingest"),       # a training job checks its plan against the table spec it was
                                                  # planned from, read as the CLI reads it (ingest.spec.read_tables)
    ("embshard.ruler", "embshard.bench"),         # the ruler measures shards with the benchmark's protocol
    ("embshard.evaluation", "embshard.ruler"),    # the evaluation measures with the ruler ...
    ("embshard.evaluation", "embshard.bench"),    # ... and the balanced estimate with measure_placement ...
    ("embshard.evaluation", "embshard.planners"),  # ... the plans of the planners it compares ...
    ("embshard.evaluation", "embshard.refine"),   # ... refined by measurement for a "NAME+refineK" entry
    ("embshard.refine", "embshard.ruler"),        # a measured refinement measures its candidates with the ruler ...
    ("embshard.refine", "embshard.bench"),        # ... on the settings and hardware the benchmark resolves ...
    ("embshard.refine", "embshard.planners"),     # ... the candidates being the planners' plans
}


def modules(root: str = ROOT) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(os.path.join(root, PKG)):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "jobs":
        return ".".join(parts[:3])
    return ".".join(parts[:2])


def imports(module: str, path: str, mods: dict[str, str]) -> set[str]:
    """Every embshard module that `module` imports, wherever the import statement is."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    pkg = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = pkg.split(".")
                base_parts = base_parts[:len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for a in node.names:
                cand = f"{base}.{a.name}"
                targets.append(cand if cand in mods else base)  # `from . import x`: the module x, else base
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in mods:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t.split(".")[0] == PKG:
                found.add(t)
    return found


def unit_graph(mods: dict[str, str] | None = None) -> dict[str, set[str]]:
    mods = modules() if mods is None else mods
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for m, path in mods.items():
        graph[unit(m)]
        for t in imports(m, path, mods):
            if unit(t) != unit(m):
                graph[unit(m)].add(unit(t))
    return dict(graph)


def layer_of(u: str) -> str | None:
    if u.startswith("embshard.jobs."):
        return "jobs"
    return next((name for name, units in LAYERS.items() if u in units), None)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(graph: dict[str, set[str]]) -> dict[str, list]:
    """What breaks the rules: unclassified units, cycles, jobs importing jobs, imports against the direction."""
    found: dict[str, list] = {"unclassified": sorted(u for u in graph if layer_of(u) is None),
                              "cycles": cycles(graph), "job_imports_job": [], "upward": [], "algorithm_edges": []}
    for a, bs in graph.items():
        for b in sorted(bs):
            la, lb = layer_of(a), layer_of(b)
            if la is None or lb is None:
                continue
            if la == lb == "jobs" and a != "embshard.jobs" and b != "embshard.jobs":
                found["job_imports_job"].append((a, b))
            elif ORDER.index(lb) < ORDER.index(la):
                found["upward"].append((a, b))
            elif la == lb == "algorithms" and (a, b) not in ALGORITHM_EDGES:
                found["algorithm_edges"].append((a, b))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return unit_graph()


def test_every_unit_has_a_layer(graph):
    assert violations(graph)["unclassified"] == [], "add the new module to LAYERS"


def test_no_import_cycle_between_packages_or_modules(graph):
    assert violations(graph)["cycles"] == []


def test_no_job_imports_another_job(graph):
    assert violations(graph)["job_imports_job"] == []


def test_imports_run_one_way(graph):
    found = violations(graph)
    assert found["upward"] == [], "DAG -> stages -> jobs -> algorithms -> types: never upward"
    assert found["algorithm_edges"] == [], "algorithm packages import only along ALGORITHM_EDGES"


def test_every_allowed_algorithm_edge_is_used(graph):
    """ALGORITHM_EDGES is the real graph, not a wish list: an edge no import uses leaves the list (so it cannot
    come back unnoticed)."""
    gone = sorted((a, b) for a, b in ALGORITHM_EDGES if b not in graph.get(a, set()))
    assert gone == [], f"remove from ALGORITHM_EDGES: {gone}"


def test_the_checker_sees_function_level_imports_and_every_kind_of_violation(tmp_path):
    """A synthetic package: the rules must catch what they are for (a checker that passes everything would too)."""
    pkg = tmp_path / PKG
    for sub in ("jobs", "bench", "planners"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "types.py").write_text("def f():\n    from .stages import x\n")  # upward, inside a function
    (pkg / "stages.py").write_text("from .jobs import a\n")
    (pkg / "jobs" / "a.py").write_text("def g():\n    from . import b\n")  # a job importing a job
    (pkg / "jobs" / "b.py").write_text("from ..bench import m\nfrom .. import types\n")  # closes a loop
    (pkg / "bench" / "m.py").write_text("def h():\n    from ..planners import p\n")  # algorithm -> algorithm
    (pkg / "planners" / "p.py").write_text("from ..bench.m import h\n")  # ... and back: a cycle
    g = unit_graph(modules(str(tmp_path)))
    assert g["embshard.types"] == {"embshard.stages"}
    found = violations(g)
    assert found["job_imports_job"] == [("embshard.jobs.a", "embshard.jobs.b")]
    assert ("embshard.types", "embshard.stages") in found["upward"]
    assert ("embshard.bench", "embshard.planners") in found["algorithm_edges"]
    assert ["embshard.bench", "embshard.planners"] in found["cycles"]
    assert ["embshard.jobs.a", "embshard.jobs.b", "embshard.stages", "embshard.types"] in found["cycles"]
