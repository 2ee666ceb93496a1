"""The import graph of src/tinylm: no cycles, and nothing imports from a floor above its own.

The layout tells the story from text to a served model, and the imports must follow it downwards: a module
may import from its own floor or any floor below, never from above. The floors, lowest first:

    floor  modules                                       why there
    -----  --------------------------------------------  -----------------------------------------------
    0      tinylm.errors, tinylm.atomic, tinylm.config,  what everything needs: the one exception, safe
           tinylm.jsonfile, tinylm.device, tinylm.lock,  writes, the configuration dataclasses, reading
           tinylm.workers                                versioned JSON files, where the arithmetic runs,
                                                         one writer per folder, worker processes
    1      tinylm.tokenizers.*                           text <-> ids
    2      tinylm.data.*                                 corpora, and the token shards made with a tokenizer
    3      tinylm.model.*                                every model family (n-gram counting reads shards)
    4      tinylm.run, tinylm.checkpoint                 a trained model on disk: save and load
    5      tinylm.evaluate, tinylm.generate.*,           what one does with a trained model: measure it
           tinylm.compare, tinylm.explain.*,             (compare is evaluate over several runs; task_eval
           tinylm.task_eval, tinylm.scoring,             scores replies on built-in tasks, scoring the
           tinylm.harness                                log-likelihood of continuations, harness
                                                         answering lm-evaluation-harness's requests), sample
                                                         from it, account for and plot it (the training
                                                         loop reports with explain, so it sits below train)
    6      tinylm.train.*                                training a model (it evaluates and samples)
    7      tinylm.serve.*, tinylm.export.*,              a trained run behind HTTP, or in another format;
           tinylm.finetune                               fine-tuning (it may import a model first)
    8      tinylm.cli, tinylm.__main__, tinylm           the command line, and the package's public names

In particular nothing in run.py, config.py, model/, data/ or tokenizers/ imports from train/,
serve/, export/ or the CLI.

How an import becomes an edge (every import in the file counts, inside functions and under
``TYPE_CHECKING`` too, since both still say "this module needs that one"):

- ``import tinylm.a.b`` is an edge to ``tinylm.a.b``;
- ``from tinylm.a import b`` is an edge to ``tinylm.a.b`` when that is a module, else to the package
  ``tinylm.a`` (its __init__);
- relative imports are resolved against the importing module's package first.

Importing ``tinylm.a.b`` also runs ``tinylm/a/__init__.py``, but that implicit step is not an edge:
a package __init__ may import its own submodules as long as none of them imports the __init__ back
(which would then show up as a cycle).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# module or package -> floor: a package's floor covers everything in it, except for the top package,
# whose entry is its __init__ alone; a module takes the floor of the longest name that covers it
FLOORS: dict[str, int] = {
    "tinylm.errors": 0, "tinylm.atomic": 0, "tinylm.config": 0, "tinylm.jsonfile": 0, "tinylm.device": 0,
    "tinylm.lock": 0, "tinylm.workers": 0,
    "tinylm.tokenizers": 1,
    "tinylm.data": 2,
    "tinylm.model": 3,
    "tinylm.run": 4, "tinylm.checkpoint": 4,
    "tinylm.evaluate": 5, "tinylm.generate": 5, "tinylm.compare": 5, "tinylm.explain": 5,
    "tinylm.train": 6,
    "tinylm.serve": 7, "tinylm.export": 7, "tinylm.finetune": 7, "tinylm.task_eval": 5, "tinylm.scoring": 5,
    "tinylm.harness": 5,
    "tinylm.cli": 8, "tinylm.__main__": 8, "tinylm": 8,
}


def modules(src: Path, top: str) -> dict[str, Path]:
    """Every module of the package ``top`` under ``src``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((src / top).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: dict[str, Path], top: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of a module of ``top`` in the module ``name``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name
                while target and target not in known:  # `import tinylm.a.B` of a name in a module
                    target = target.rpartition(".")[0]
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base.split(".")[0] != top:
                continue
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield (sub if sub in known else base), node.lineno


def import_graph(src: Path, top: str = "tinylm") -> dict[str, dict[str, int]]:
    """module -> {imported module: the first line that imports it}, within the package ``top``."""
    known = modules(src, top)
    graph: dict[str, dict[str, int]] = {}
    for name, path in known.items():
        edges: dict[str, int] = {}
        for target, line in imports(name, path, known, top):
            if target != name:
                edges.setdefault(target, line)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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
    return sorted(found)


def floor(name: str, floors: dict[str, int] = FLOORS) -> int | None:
    matches = [prefix for prefix in floors if name == prefix or ("." in prefix and name.startswith(prefix + "."))]
    return floors[max(matches, key=len)] if matches else None


def upward(graph: dict[str, dict[str, int]], floors: dict[str, int] = FLOORS) -> list[str]:
    """Every import of a module on a higher floor than the importer's, as 'a (floor) -> b (floor), line n'."""
    out = []
    for name, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            a, b = floor(name, floors), floor(target, floors)
            if a is not None and b is not None and b > a:
                out.append(f"{name} (floor {a}) -> {target} (floor {b}), line {line}")
    return out


def describe_cycle(graph: dict[str, dict[str, int]], component: list[str]) -> str:
    """A cycle's modules and the imports that tie them together."""
    members = set(component)
    ties = [f"{a} -> {b} (line {line})" for a in component for b, line in sorted(graph[a].items()) if b in members]
    return f"{' <-> '.join(component)}: " + "; ".join(ties)


GRAPH = import_graph(SRC)


def test_every_module_has_a_floor():
    missing = [name for name in GRAPH if floor(name) is None]
    assert not missing, f"give these modules a floor in FLOORS (and in the docstring's table): {missing}"


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "import cycles:\n" + "\n".join(describe_cycle(GRAPH, c) for c in found)


def test_no_imports_up_the_floors():
    found = upward(GRAPH)
    assert not found, "imports from a higher floor:\n" + "\n".join(found)


# ----- the checker itself, on a package made up for the purpose ------------------------------------


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    """pkg/: low.py, high.py, sub/ (__init__, a, b); low imports high (upward), sub.a and sub.b import each other."""
    files = {
        "pkg/__init__.py": "",
        "pkg/low.py": "def f():\n    from pkg.high import g\n",
        "pkg/high.py": "import pkg.low\nfrom pkg import sub\n",
        "pkg/sub/__init__.py": "from .a import x\n",
        "pkg/sub/a.py": "from . import b\nx = 1\n",
        "pkg/sub/b.py": "from pkg.sub.a import x\nfrom pkg.sub import a\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def test_the_graph_resolves_every_form_of_import(toy: Path):
    graph = import_graph(toy, "pkg")
    assert graph["pkg.low"] == {"pkg.high": 2}  # inside a function
    assert graph["pkg.high"] == {"pkg.low": 1, "pkg.sub": 2}  # `from pkg import sub`: sub is a package
    assert graph["pkg.sub"] == {"pkg.sub.a": 1}  # relative, from a package's __init__
    assert graph["pkg.sub.a"] == {"pkg.sub.b": 1}  # `from . import b`: a submodule
    assert graph["pkg.sub.b"] == {"pkg.sub.a": 1}
    assert graph["pkg"] == {}


def test_the_checks_find_cycles_and_upward_imports(toy: Path):
    graph = import_graph(toy, "pkg")
    assert cycles(graph) == [["pkg.high", "pkg.low"], ["pkg.sub.a", "pkg.sub.b"]]
    floors = {"pkg.low": 0, "pkg.high": 1, "pkg.sub": 1, "pkg": 2}
    assert upward(graph, floors) == ["pkg.low (floor 0) -> pkg.high (floor 1), line 2"]
    assert floor("pkg.sub.a", floors) == 1  # a package's floor covers its modules
    assert floor("pkg.lowest", floors) is None  # whole name parts only; the top package covers its __init__ alone


def test_a_package_importing_its_submodules_is_no_cycle_until_one_imports_it_back(toy: Path):
    assert all("pkg.sub" not in c for c in cycles(import_graph(toy, "pkg")))  # pkg.sub imports pkg.sub.a
    (toy / "pkg/sub/a.py").write_text("from pkg.sub import x\n")  # x is a name in the __init__, not a module
    graph = import_graph(toy, "pkg")
    assert graph["pkg.sub.a"] == {"pkg.sub": 1}
    assert cycles(graph) == [["pkg.high", "pkg.low"], ["pkg.sub", "pkg.sub.a"]]
