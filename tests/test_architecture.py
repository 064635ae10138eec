"""The package's shape, as docs/ARCHITECTURE.md draws it: imports point down the layers, there is
no import cycle (counting imports inside functions: none may hide one), the Engine and evaluation
never ask which strategy they hold, and no parallel module knows a concrete model."""

import ast
from pathlib import Path
from tests.conftest import run_patiently

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "distlab"

# Top to bottom; a module may import its own layer and the layers below it (docs/ARCHITECTURE.md).
LAYERS = [
    ("commands", ["distlab", "distlab.__main__", "distlab.cli"]),
    ("tools", ["distlab.tools", "distlab.bench", "distlab.launch"]),
    ("training", ["distlab.train"]),
    ("planning", ["distlab.plan"]),  # prices the strategies' own components; a run's summary reads it
    ("strategies", ["distlab.parallel"]),
    ("collectives, data, models", ["distlab.comm", "distlab.data", "distlab.models"]),
    ("runtime", ["distlab.runtime"]),
    ("errors", ["distlab.errors"]),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> set[tuple[str, bool]]:
    """(imported distlab module, whether the import is inside a function or class)."""
    tree = ast.parse(MODULES[module].read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("distlab")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("distlab"):
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target and target != module:
                out.add((target, node.col_offset > 0))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} belongs to no layer of ARCHITECTURE.md: add it to LAYERS and the page"
    return best[0]


def test_every_module_belongs_to_a_layer_and_imports_point_down():
    upward = [f"{m} ({LAYERS[_layer(m)][0]}) -> {t} ({LAYERS[_layer(t)][0]})"
              for m, targets in GRAPH.items() for t, _ in targets if _layer(t) < _layer(m)]
    assert not upward, "imports up the layers:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_even_through_imports_inside_functions():
    graph = {m: {t for t, _ in targets} for m, targets in GRAPH.items()}
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _source(module: str) -> str:
    return MODULES[module].read_text()


def test_the_engine_and_evaluation_never_ask_which_strategy_they_hold():
    for module in ("distlab.parallel.engine", "distlab.train.evaluate"):
        tree = ast.parse(_source(module))
        engine_class = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Engine"]
        bodies = engine_class or [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "evaluate"]
        assert bodies, module
        for body in bodies:
            calls = [n.func.id for n in ast.walk(body) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
            assert "isinstance" not in calls, f"{module} asks isinstance"
            names = {n.attr for n in ast.walk(body) if isinstance(n, ast.Attribute)}
            names |= {n.id for n in ast.walk(body) if isinstance(n, ast.Name)}
            assert not names & {"pipeline", "PipelineStage", "Zero", "DataParallel", "zero", "pp"}, (
                f"{module} branches on a strategy: {sorted(names & {'pipeline', 'PipelineStage', 'Zero', 'DataParallel', 'zero', 'pp'})}")


# What a model may declare (plans), the step's share of a loss it adds itself and the structure a batch carries
# beside its tokens (a packed window's): no model in them.
MODEL_CONTRACTS = {"distlab.models.plans", "distlab.models.aux_loss", "distlab.models.spec", "distlab.models.contract",
                   "distlab.models.packing",
                   "distlab.models.parameter_roles"}  # (what an optimizer makes of any model's parameters)
# fine-tuning's converters: the training layer puts them on any model (LoRA's adapters, its typed spec; a 4-bit
# weight's layout, which the planner prices too); the strategies meet an adapted layer only through a protocol
# (parallel.protocols.LowRankAdapted)
CONVERTERS = {"distlab.models.lora", "distlab.models.nf4"}


def test_the_tools_never_import_a_benchmark():
    """Benchmarks use the tools (plots, summaries), never the other way: a tool that needs something a
    benchmark has takes it from below (machine facts from the runtime, byte words from errors)."""
    found = sorted(f"{module} -> {t}" for module, targets in GRAPH.items() if module.startswith("distlab.tools")
                   for t, _ in targets if t.startswith("distlab.bench"))
    assert not found, found


def test_no_parallel_module_imports_a_concrete_model():
    concrete = {m for m in MODULES if m.startswith("distlab.models.") and m not in MODEL_CONTRACTS}
    for module, targets in GRAPH.items():
        if module.startswith("distlab.parallel"):
            assert not {t for t, _ in targets} & concrete, f"{module} imports {sorted({t for t, _ in targets} & concrete)}"


def test_importing_the_strategies_loads_no_concrete_model():
    """The real import closure (a package's ``__init__`` runs first): ``import distlab.parallel`` -- and
    the whole training layer above it -- loads no model's module (the training layer: fine-tuning's converters
    aside, which fit any model); models load when a run builds one."""
    import sys
    concrete = sorted(m for m in MODULES if m.startswith("distlab.models.") and m not in MODEL_CONTRACTS)
    loaded = "print(sorted(m for m in sys.modules if m in {concrete!r}))"
    probe = f"import sys, distlab.parallel\n{loaded}\nimport distlab.train\n{loaded}"
    strategies, training = run_patiently([sys.executable, "-c", probe.format(concrete=concrete)], 120, check=True,
                                         cwd=ROOT).stdout.split("\n")[:2]
    assert strategies == "[]", f"import distlab.parallel loads {strategies}"
    assert set(ast.literal_eval(training)) <= CONVERTERS, f"import distlab.train loads {training}"


def test_the_engine_never_asks_whether_a_component_is_there():
    """No optional strategy members: nothing in the Engine compares one of its own attributes -- or a
    local taken from one -- with None, reads one with a getattr default or declares one optional
    (``self.x: T | None``) -- a new parallelism joins as a component of the list, and cannot pass this
    test by adding a member the Engine tests for. Evaluation asks the Engine, not the mesh, what its
    components need."""
    tree = ast.parse(_source("distlab.parallel.engine"))
    engine = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "Engine")

    def on_self(node) -> bool:
        while isinstance(node, ast.Attribute):
            node = node.value
        return isinstance(node, ast.Name) and node.id == "self"

    # a local taken from a member (``norm = self._norm``, ``a, self.b = self.b, None``) stands for it
    taken = set()
    for node in ast.walk(engine):
        if isinstance(node, ast.Assign) and any(on_self(v) for v in ast.walk(node.value)
                                                if isinstance(v, ast.Attribute)):
            for target in node.targets:
                taken |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}

    def from_self(node) -> bool:
        return on_self(node) or (isinstance(node, ast.Name) and node.id in taken)

    found = []
    for node in ast.walk(engine):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops):
            sides = [node.left, *node.comparators]
            if any(isinstance(c, ast.Constant) and c.value is None for c in sides) and any(from_self(c) for c in sides):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.AnnAssign) and on_self(node.target) and "None" in ast.unparse(node.annotation):
            found.append(f"line {node.lineno}: an optional member {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and node.args and on_self(node.args[0]):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    assert not found, "the Engine asks whether a member is there:\n" + "\n".join(found)
    evaluate = ast.parse(_source("distlab.train.evaluate"))
    asked = sorted({n.attr for n in ast.walk(evaluate) if isinstance(n, ast.Attribute)
                    and isinstance(n.value, ast.Name) and n.value.id == "mesh"} & {"ep", "cp", "tp", "pp"})
    assert not asked, f"evaluation asks the mesh for {asked}: ask the Engine's components"


def test_the_trainer_names_no_model_family():
    """Sampling and the snapshot record ask the model (models.snapshot_record, build_model): the Trainer
    reads no list of model names and builds no model class by name."""
    tree = ast.parse(_source("distlab.train.trainer"))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & {"TEXT_MODELS", "MOE_MODELS", "GPT", "gpt_from_state", "MLP"}, sorted(
        names & {"TEXT_MODELS", "MOE_MODELS", "GPT", "gpt_from_state", "MLP"})


def test_no_private_name_is_used_outside_its_module():
    """A leading underscore means "this file only": nothing imports one from another distlab module or
    reads one through a module it imported (``from distlab.x import _helper``, ``x._helper``)."""
    found = []
    for module in MODULES:
        tree = ast.parse(_source(module))
        aliases = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("distlab"):
                for a in n.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{module}: from {n.module} import {a.name}")
                    if f"{n.module}.{a.name}" in MODULES:
                        aliases[a.asname or a.name] = f"{n.module}.{a.name}"
            elif isinstance(n, ast.Import):
                aliases |= {a.asname: a.name for a in n.names if a.name.startswith("distlab") and a.asname}
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases \
                    and n.attr.startswith("_") and not n.attr.startswith("__"):
                found.append(f"{module}: {n.value.id}.{n.attr}")
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_no_module_is_over_450_lines():
    """Rooms by idea: a module past ~450 lines splits where its ideas part (a reading side from a
    writing side, a registry from what it registers); no paragraph excuses it."""
    long = [f"{module}: {path.read_text().count(chr(10))} lines" for module, path in MODULES.items()
            if path.read_text().count("\n") > 450]
    assert not long, "modules over 450 lines:\n" + "\n".join(long)


def test_no_layer_asks_whether_a_model_has_a_member():
    """A model is a contract (distlab.models.contract.ModelContract): every member a layer asks of a model
    -- or of a module its plans name -- has a default on the base, so nothing reads one with getattr or
    tests for it with hasattr by name (a new family cannot pass this test by adding a member the code
    tests for)."""
    from distlab.models.contract import ModelContract
    members = {n for n in vars(ModelContract) if not n.startswith("_")} | {
        "kv_heads_per_rank", "active_weights", "sequence_group", "sequence_grad", "part", "place", "tok", "pos"}
    found = []
    for module in MODULES:
        for node in ast.walk(ast.parse(_source(module))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in members:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.JoinedStr) \
                    and "_parallel_plan" in ast.unparse(node.args[1]):
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "a layer asks whether a model has a member:\n" + "\n".join(found)


def test_the_step_route_in_architecture_names_files_and_functions_that_exist():
    """docs/ARCHITECTURE.md's route block is generated (scripts/step_route.py --write); a file or function it
    names that no longer exists means the code moved without the block being made again."""
    import re
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    block = text[text.index("<!-- step-route: generated"):text.index("<!-- step-route: end -->")]
    stale = []
    for path, names in re.findall(r"^  (distlab/\S+\.py): (.+)$", block, flags=re.M):
        if not (ROOT / path).is_file():
            stale.append(path)
            continue
        defined = set(re.findall(r"^\s*def (\w+)", (ROOT / path).read_text(), flags=re.M))
        stale += [f"{path}: {n}" for n in names.split(", ") if not n.startswith("<") and n not in defined]
    assert not stale, "the route block names what is gone (python scripts/step_route.py --write):\n" + "\n".join(stale)


def test_the_readme_stays_one_page():
    """The README is the front door: at most 300 lines (the rest lives in docs/)."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
