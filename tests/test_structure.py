"""The package's shape: the import graph has no circles, shared layers do not come from a sibling
model module, data flows one way, and no file or loop function grows past its size without a
stated reason (docs/ARCHITECTURE.md)."""

import ast
from pathlib import Path

import pytest

WM = Path(__file__).resolve().parents[1] / "wm"
MODELS = {"wm.models.tokenizer", "wm.models.world"}  # a model module may not import another for shared layers
# The folders in the order data flows, written once: a module imports only from its own folder or
# one to its left (docs/ARCHITECTURE.md). wm.version is a leaf; wm (its __init__) is the public face.
LAYERS = ["wm.version", "wm.utils", "wm.config", "wm.data", "wm.models", "wm.checkpoint", "wm.evaluation",
          "wm.training", "wm.export", "wm.experiments", "wm.forecaster", "wm"]
LINE_LIMIT = 600
REASON = "longer than 600 lines because"  # a module past the limit says why in its docstring
LOOP_FUNCTION_LIMIT = 80


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted(WM.rglob("*.py")):
        parts = p.relative_to(WM.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The wm modules `name` imports at module level or inside functions (both run)."""
    tree = ast.parse(path.read_text())
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            out |= subs & known
            if subs - known:  # a name the package itself defines: its __init__ is what runs
                out.add(base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {n: imports(n, p, set(mods)) for n, p in mods.items()}


def test_no_import_circles():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for m in sorted(g[n]):  # every edge, a module's import of its own package's __init__ too
            if state.get(m) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(g):
        if n not in state:
            visit(n)


def test_the_graph_counts_a_package_init_and_what_it_imports():
    g = graph()
    assert "wm.forecaster" in g["wm"]  # `from wm import Forecaster` runs the package's lazy import
    assert "wm.version" in g["wm"] and "wm.version" in g["wm.checkpoint.run_folder"]
    # `from wm import distributed` is an edge to the module, not to the package's __init__
    assert "wm.utils.distributed" in g["wm.evaluation.evaluate"] and "wm" not in g["wm.evaluation.evaluate"]


def test_models_take_shared_layers_from_no_sibling_model():
    g = graph()
    for n in MODELS:
        assert not (g[n] & (MODELS - {n})), f"{n} imports {sorted(g[n] & MODELS)}: shared layers live in wm.models.layers"


def layer(name: str) -> int:
    """The index in LAYERS of the folder (or module) that holds `name`: the longest prefix."""
    held = [i for i, p in enumerate(LAYERS) if name == p or name.startswith(p + ".")]
    assert held, f"{name} lies in no folder of LAYERS: add its folder there"
    return max(held, key=lambda i: len(LAYERS[i]))


def test_every_module_lies_in_a_layer_and_the_root_holds_only_the_public_face():
    for n in modules():
        layer(n)
    root = sorted(p.name for p in WM.glob("*.py"))
    assert root == ["__init__.py", "forecaster.py", "version.py"], f"wm/ holds modules outside a folder: {root}"


def test_data_flows_one_way():
    g = graph()
    for n, deps in g.items():
        for m in deps:
            assert layer(m) <= layer(n), f"{n} ({LAYERS[layer(n)]}) imports {m} ({LAYERS[layer(m)]}), a folder to its right"


def test_the_layer_rule_sees_an_upward_edge():
    assert layer("wm.training.loop") > layer("wm.evaluation.evaluate") > layer("wm.checkpoint.files")
    assert layer("wm.data.synthetic.road") == layer("wm.data") < layer("wm.models.world")


@pytest.mark.parametrize("path", sorted(WM.rglob("*.py")), ids=lambda p: str(p.relative_to(WM.parent)))
def test_no_file_past_600_lines_without_a_stated_reason(path):
    n = len(path.read_text().splitlines())
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert n <= LINE_LIMIT or REASON in doc, f"{path.name} has {n} lines and its docstring says not why ({REASON} ...)"


def test_no_function_over_80_lines_in_the_loop():
    loop = [p for n, p in modules().items() if n in ("wm.training.loop", "wm.training.main")]
    assert loop
    for p in loop:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= LOOP_FUNCTION_LIMIT, f"{p.name}: {node.name} has {n} lines"
