"""The import graph runs one way: every module imports only modules on its own floor or below, and no two modules
import each other, directly or round a circle. Read from the source (imports inside functions count: a lazy import
is still a dependency), so a new module must be given a floor here before it can land."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cacheattn", "kernels_numba", "reference")

# From the bottom up. A module belongs to the first floor with a prefix that names it or a package above it.
FLOORS = (
    # 0. Facts and helpers that depend on nothing of ours: the documents' NumPy references, validation, the
    #    bound model (machine constants and formulas), console and docs helpers.
    ("reference", "cacheattn._types", "cacheattn._svg", "cacheattn._validate", "cacheattn._console", "cacheattn._docs",
     "cacheattn._plans", "cacheattn.bounds", "cacheattn.pictures", "cacheattn.traceability",
     "cacheattn.hf.blocks", "cacheattn.hf.models", "cacheattn.exercises.first_kernel"),
    # 1. The kernels.
    ("kernels_numba",),
    # 2. What the operators stand on: array handling, the kernel choice, cache conversion.
    ("cacheattn._arrays", "cacheattn._sass_work", "cacheattn.kernel_choice", "cacheattn.convert"),
    # 3. The operators, and the package that exports them.
    ("cacheattn.ppl", "cacheattn.trtllm", "cacheattn.onnx", "cacheattn.ft", "cacheattn.__init__"),
    # 4. Built on the operators: example inputs, the conformance kit, serving, the engine, the tour.
    ("cacheattn.examples", "cacheattn.testing", "cacheattn.serving", "cacheattn.hf.engine", "cacheattn.hf.__init__",
     "cacheattn.onnx_conformance", "cacheattn.tour"),
    # 5. The measuring room and what teaches from it.
    ("cacheattn.lab", "cacheattn.exercises", "cacheattn.figures", "cacheattn.ladder_figures", "cacheattn.hf.bench",
     "cacheattn.hf.cli"),
    # 6. Entry points.
    ("cacheattn.__main__", "cacheattn._site_hooks"),
)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[".".join(path.relative_to(ROOT).with_suffix("").parts)] = path
    return found


def floor(module: str) -> int:
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    raise AssertionError(f"{module}: no floor in tests/test_layers.py names it; give it one")


def imports(module: str, path: Path, known: dict) -> set[str]:
    """The project modules `module` imports, resolved to files (a package's name to its __init__)."""
    package = module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            base = ".".join(base + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            for candidate in (name, f"{name}.__init__"):
                if candidate in known and candidate != module:
                    out.add(candidate)
                    break
            else:
                # `from package import function`: the name is not a module; the package is, through its parts.
                head = name.rpartition(".")[0]
                while head and head not in known and f"{head}.__init__" not in known:
                    head = head.rpartition(".")[0]
                if head:
                    target = head if head in known else f"{head}.__init__"
                    if target != module:
                        out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    """Module -> the modules it imports. A module naming its own package (`import reference` inside `reference`,
    to reach a sibling as `reference.rope`) reaches the sibling, not the package's exports: that edge is left out."""
    known = modules()
    edges = {module: imports(module, path, known) for module, path in known.items()}
    return {module: {t for t in targets
                     if not (t.endswith(".__init__") and module.startswith(t[:-len("__init__")]))}
            for module, targets in edges.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_floor_and_imports_only_downward():
    edges = graph()
    assert len(edges) > 100 and "cacheattn.kernel_choice" in edges
    upward = [f"{a} (floor {floor(a)}) imports {b} (floor {floor(b)})"
              for a, targets in sorted(edges.items()) for b in sorted(targets) if floor(b) > floor(a)]
    assert upward == []


def test_no_import_circle():
    assert circles(graph()) == []


def test_trtllm_kernel_modules_import_one_way():
    """TensorRT-LLM's kernels within the kernels' floor: the launcher over the two phases, each phase over the
    shared functions only, and the shared functions over neither."""
    edges = graph()
    trt = {name: {t for t in edges[f"kernels_numba.trtllm_{name}"] if t.startswith("kernels_numba.trtllm_")}
           for name in ("common", "context", "generation", "gpt_attention")}
    assert trt == {"common": set(), "context": {"kernels_numba.trtllm_common"},
                   "generation": {"kernels_numba.trtllm_common"},
                   "gpt_attention": {"kernels_numba.trtllm_common", "kernels_numba.trtllm_context",
                                     "kernels_numba.trtllm_generation"}}


def test_the_checks_see_a_circle_and_an_upward_import():
    """The checks can fail: a made-up circle is found, and the bound model importing the lab is upward."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert floor("cacheattn.lab.cases") > floor("cacheattn.bounds")
    assert floor("cacheattn.ppl") > floor("cacheattn.kernel_choice") > floor("kernels_numba._split_k")
