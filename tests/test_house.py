"""House rules checked on the source: no import cycle among the modules of ``parallel_models`` and
``conversion``; no file in ``parallel_models`` over 500 lines; every module opens with a
docstring and is named in ``docs/ARCHITECTURE.md``; data flows one way (checkpoint formats and
utilities never reach the models or RL, the models never reach the inference engine or RL, the
engine never reaches RL, and RL uses the engine only through ``parallel_models.inference``); and
no branch on an HF ``model_type`` outside the family modules (``parallel_models/llama/families/``).

Imports are collected with ``ast`` (no module is imported). Which imports count:
- top-level imports (module body, including ``if`` / ``try`` / ``with`` blocks there) must form
  no cycle: they run when the module is imported, so a cycle there is an import-order hazard;
- function-local imports count too: a local import is how a cycle is usually hidden, and the
  data-flow rule (format code never imports model code, utilities never import higher layers)
  holds for them as well. ``if TYPE_CHECKING:`` imports do not run and are not counted.
``from package import name`` counts as importing ``package.name`` when that is a module, else
``package``; importing ``a.b.c`` also runs ``a/__init__`` and ``a.b/__init__``, but a package's
``__init__`` importing its own submodules is how packages work, so edges to a module's own
parent packages are not counted.
"""

from __future__ import annotations

import ast
import functools
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("parallel_models", "conversion")
MAX_LINES = 500


def _modules() -> dict[str, str]:
    """module name -> file path, for every .py file of the packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, pkg)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                rel = os.path.relpath(os.path.join(dirpath, name), ROOT)[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = \
                    os.path.join(dirpath, name)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _parse(path: str) -> ast.Module:
    """The syntax tree of the file at ``path``, parsed once per content of the file: the tests
    below read the same ~300 files (each parse of them all is seconds of CPU)."""
    st = os.stat(path)
    return _parse_version(path, st.st_mtime_ns, st.st_size)


@functools.cache
def _parse_version(path: str, mtime_ns: int, size: int) -> ast.Module:
    with open(path) as f:
        return ast.parse(f.read(), filename=path)


def _imports(module: str, path: str, modules: dict[str, str]) -> dict[str, tuple[int, bool]]:
    """Intra-package modules ``module`` imports -> (line, top-level?)."""
    tree = _parse(path)
    is_pkg = path.endswith("__init__.py")
    found: dict[str, tuple[int, bool]] = {}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def add(target: str | None, line: int, top: bool) -> None:
        if target is None or target == module:
            return
        if target not in found or (top and not found[target][1]):
            found[target] = (line, top)

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(resolve(alias.name), child.lineno, top)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = module.split(".")
                    parent = parts if is_pkg else parts[:-1]
                    parent = parent[: len(parent) - (child.level - 1)]
                    base = ".".join(parent + ([base] if base else []))
                for alias in child.names:
                    full = f"{base}.{alias.name}"
                    add(resolve(full) if full in modules else resolve(base), child.lineno, top)
            inner = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                   ast.Lambda, ast.ClassDef))
            # class bodies run at import time: their imports are top-level too
            if isinstance(child, ast.ClassDef):
                inner = top
            visit(child, inner)

    visit(tree, True)
    return found


@functools.cache  # the sources do not change during a session; the tests only read the graph
def _graph(top_only: bool) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    modules = _modules()
    graph = {}
    for mod, path in modules.items():
        edges = _imports(mod, path, modules)
        graph[mod] = {t: line for t, (line, top) in edges.items() if top or not top_only}
    return graph, modules


def _find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle (as a list of modules, first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, {})):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def _describe(cycle: list[str], graph, modules) -> str:
    steps = [f"{a} ({os.path.relpath(modules[a], ROOT)}:{graph[a][b]}) -> {b}"
             for a, b in zip(cycle, cycle[1:])]
    return "import cycle:\n  " + "\n  ".join(steps)


@pytest.mark.parametrize("top_only", [True, False], ids=["top-level", "with-local-imports"])
def test_no_import_cycle(top_only):
    graph, modules = _graph(top_only)
    cycle = _find_cycle(graph)
    assert cycle is None, _describe(cycle, graph, modules)


def test_cycle_finder_finds_a_planted_cycle():
    """The checker itself: a cycle through three modules is found and named."""
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _find_cycle(graph) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": 1}, "b": {}}) is None


def test_local_imports_are_collected(tmp_path):
    """Function-local and relative imports are seen (and marked as such)."""
    pkg = tmp_path / "parallel_models"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def f():\n    from parallel_models import high\n")
    (pkg / "high.py").write_text("from .low import f\n")
    modules = {"parallel_models": str(pkg / "__init__.py"), "parallel_models.low": str(pkg / "low.py"),
               "parallel_models.high": str(pkg / "high.py")}
    assert _imports("parallel_models.low", modules["parallel_models.low"], modules) == {
        "parallel_models.high": (2, False)}
    assert _imports("parallel_models.high", modules["parallel_models.high"], modules) == {
        "parallel_models.low": (1, True)}


def test_no_file_over_the_size_limit():
    too_long = []
    for mod, path in _modules().items():
        if not mod.startswith("parallel_models"):
            continue
        with open(path) as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            too_long.append(f"{os.path.relpath(path, ROOT)}: {n} lines")
    assert not too_long, f"files over {MAX_LINES} lines: " + ", ".join(too_long)


def test_every_module_has_a_docstring():
    missing = [os.path.relpath(path, ROOT) for mod, path in sorted(_modules().items())
               if not ast.get_docstring(_parse(path))]
    assert not missing, "modules without a docstring saying what they are for: " + ", ".join(missing)


ARCHITECTURE = os.path.join(ROOT, "docs", "ARCHITECTURE.md")


def test_architecture_names_every_module():
    """docs/ARCHITECTURE.md's layout names every module (``parallel_models/.../x.py``) and no
    module that is gone, so the document cannot drift from the code."""
    with open(ARCHITECTURE) as f:
        text = f.read()
    named = set(re.findall(r"`((?:parallel_models|conversion)/[\w/]+\.py)`", text))
    modules = {os.path.relpath(path, ROOT) for path in _modules().values()}
    assert not modules - named, ("modules missing from docs/ARCHITECTURE.md: "
                                 + ", ".join(sorted(modules - named)))
    assert not named - modules, ("docs/ARCHITECTURE.md names modules that do not exist: "
                                 + ", ".join(sorted(named - modules)))


def _reachable(graph, start: str) -> dict[str, str]:
    """Modules reachable from ``start`` -> the module that imports each first (for messages)."""
    seen, todo = {start: ""}, [start]
    while todo:
        node = todo.pop()
        for nxt in graph.get(node, {}):
            if nxt not in seen:
                seen[nxt] = node
                todo.append(nxt)
    return seen


def _chain(seen: dict[str, str], end: str) -> str:
    path = [end]
    while seen[path[-1]]:
        path.append(seen[path[-1]])
    return " -> ".join(reversed(path))


# (modules under this prefix, must not reach these) -- the one-way data flow of DESIGN.md
LAYERS = [
    ("parallel_models.llama.checkpoint_utils", ("parallel_models.registry", "parallel_models.models",
                                                "parallel_models.llama.modeling", "parallel_models.rl")),
    ("parallel_models.utils", ("parallel_models.pipeline", "parallel_models.registry",
                               "parallel_models.llama.modeling", "parallel_models.rl")),
    ("parallel_models.llama", ("parallel_models.inference", "parallel_models.rl")),
    ("parallel_models.heads", ("parallel_models.inference", "parallel_models.rl")),
    ("parallel_models.inference", ("parallel_models.rl",)),
]


@pytest.mark.parametrize("prefix,forbidden", LAYERS, ids=[p for p, _ in LAYERS])
def test_lower_layers_do_not_import_higher_ones(prefix, forbidden):
    """Checkpoint code never reaches the registry or the model classes (they pass in what it
    needs); utilities never reach the pipeline, the models or RL. Local imports count."""
    graph, _ = _graph(top_only=False)
    bad = []
    for mod in sorted(graph):
        if mod != prefix and not mod.startswith(prefix + "."):
            continue
        seen = _reachable(graph, mod)
        bad += [_chain(seen, f) for f in forbidden if f in seen]
    assert not bad, "layering broken:\n  " + "\n  ".join(bad[:10])


# a comparison of a model_type string (``model_type ==`` / ``!=`` / ``in`` / ``not in``): what
# differs between families is asked of the family object (parallel_models/llama/families/)
_MODEL_TYPE_BRANCH = re.compile(r"model_type\s*(==|!=|\bin\b|\bnot\s+in\b)")
FAMILIES_DIR = os.path.join("parallel_models", "llama", "families")


def _model_type_branches(root: str) -> list[str]:
    hits = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, "parallel_models")):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == FAMILIES_DIR or rel_dir.startswith(FAMILIES_DIR + os.sep):
            continue
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            with open(os.path.join(dirpath, name)) as f:
                for n, line in enumerate(f, 1):
                    if _MODEL_TYPE_BRANCH.search(line):
                        hits.append(f"{os.path.join(rel_dir, name)}:{n}: {line.strip()}")
    return hits


def test_no_model_type_branch_outside_the_families():
    hits = _model_type_branches(ROOT)
    assert not hits, ("branch on model_type outside parallel_models/llama/families/ (give the "
                      "family a hook instead):\n  " + "\n  ".join(hits))


def test_model_type_branch_finder_finds_a_planted_branch(tmp_path):
    pkg = tmp_path / "parallel_models" / "rl"
    pkg.mkdir(parents=True)
    (pkg / "x.py").write_text("if cfg.model_type == 'qwen2':\n    pass\nok = 'model_type'\n")
    fam = tmp_path / FAMILIES_DIR
    fam.mkdir(parents=True)
    (fam / "y.py").write_text("if family.model_type in names:\n    pass\n")
    assert _model_type_branches(str(tmp_path)) == [
        os.path.join("parallel_models", "rl", "x.py") + ":1: if cfg.model_type == 'qwen2':"]


def _deep_imports(graph, prefix: str, package: str) -> list[str]:
    """Imports by modules under ``prefix`` of a module *inside* ``package`` (not the package
    itself), as ``importer -> imported``."""
    return [f"{mod} -> {target}" for mod in sorted(graph)
            if mod == prefix or mod.startswith(prefix + ".")
            for target in sorted(graph[mod]) if target.startswith(package + ".")]


def test_rl_uses_the_inference_engine_through_its_package_only():
    """RL imports the inference engine only as ``parallel_models.inference`` (its public names,
    ``parallel_models/inference/__init__.py``), never one of its modules; and the engine never
    imports RL. Local imports count."""
    graph, _ = _graph(top_only=False)
    deep = _deep_imports(graph, "parallel_models.rl", "parallel_models.inference")
    assert not deep, "rl/ imports inference modules directly:\n  " + "\n  ".join(deep)
    back = _deep_imports(graph, "parallel_models.inference", "parallel_models.rl") + [
        f"{m} -> parallel_models.rl" for m in sorted(graph)
        if m.startswith("parallel_models.inference") and "parallel_models.rl" in graph[m]]
    assert not back, "the inference engine imports RL:\n  " + "\n  ".join(back)


def test_deep_inference_imports_are_found(tmp_path):
    """The rule's checker: ``from parallel_models.inference.engine import X`` under rl/ is found,
    ``from parallel_models.inference import X`` is not."""
    pkg = tmp_path / "parallel_models"
    (pkg / "inference").mkdir(parents=True)
    (pkg / "rl").mkdir()
    for f in ("__init__.py", "inference/__init__.py", "inference/engine.py", "rl/__init__.py"):
        (pkg / f).write_text("")
    (pkg / "rl" / "good.py").write_text("from parallel_models.inference import RolloutEngine\n")
    (pkg / "rl" / "bad.py").write_text(
        "def f():\n    from parallel_models.inference.engine import RolloutEngine\n")
    modules = {"parallel_models": pkg / "__init__.py",
               "parallel_models.inference": pkg / "inference" / "__init__.py",
               "parallel_models.inference.engine": pkg / "inference" / "engine.py",
               "parallel_models.rl": pkg / "rl" / "__init__.py",
               "parallel_models.rl.good": pkg / "rl" / "good.py",
               "parallel_models.rl.bad": pkg / "rl" / "bad.py"}
    modules = {k: str(v) for k, v in modules.items()}
    graph = {m: {t: line for t, (line, _) in _imports(m, p, modules).items()}
             for m, p in modules.items()}
    assert _deep_imports(graph, "parallel_models.rl", "parallel_models.inference") == [
        "parallel_models.rl.bad -> parallel_models.inference.engine"]
