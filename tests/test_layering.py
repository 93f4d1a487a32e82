"""The product's layout: imports point one way, and the product names no work-log entries.

Import cycles are found over every import in the package's modules, module-level or inside a
function (a lazy import is still a cycle: the two modules cannot be understood or tested apart).
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "deployments", "kernels", "training", "protos", "loadtest", "bench", "models")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The project modules `path` imports (an `import a.b.c` or `from a.b import c` names a.b.c
    when that is a module, else its nearest enclosing package module)."""
    name = _module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(tree):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" for a in node.names] + [mod]
            # `from pkg import sub` names the submodule; `from mod import obj` the module
            targets = [t for t in targets if t in modules] or [mod]
        for t in targets:
            r = resolve(t)
            if r and r != name:
                found.add(r)
    return found


def import_graph(packages=PACKAGES) -> dict[str, set[str]]:
    files = [p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts]
    files = [p for p in files if "specdecode" not in p.parts or p.parent.name != "protos"]
    modules = {_module_name(p) for p in files}
    graph = {_module_name(p): _imports(p, modules) for p in files}
    # a module importing its own package's __init__ (e.g. `from engine.x import y` resolves through
    # `engine`) is not a dependency on its siblings: package __init__s that only re-export are
    # kept as nodes like any other module
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared piece into a module below both): " + "; ".join(
        " <-> ".join(c) for c in found
    )


# Work-log vocabulary: entries of the development log ("stop 31", "stops 40-45"), sessions and
# relative days. The product says what it is; the history is in git.
WORK_LOG = re.compile(r"\b(stops? \d+|session \d+|today|yesterday|tonight)\b", re.IGNORECASE)
# where the words are the product's own vocabulary, not the work log
ALLOWED = {
    "tests/test_layering.py",  # this test names the words it looks for
    "models/chat_heldout_prompts.json",  # prompts the model wrote: data, not the product's prose
}


def work_log_lines(paths: list[str]) -> list[str]:
    hits = []
    for rel in paths:
        if rel in ALLOWED:
            continue
        path = ROOT / rel
        if WORK_LOG.search(rel):
            hits.append(f"{rel}: file name")
        try:
            text = path.read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if WORK_LOG.search(line):
                hits.append(f"{rel}:{i}: {line.strip()[:100]}")
    return hits


def test_work_log_finder_finds_planted_words(tmp_path, monkeypatch):
    f = tmp_path / "x.py"
    f.write_text("# k = 6: measured at stop 34\nx = 1  # as of today\nstop = 3  # a stop token\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert [h.split(":")[1] for h in work_log_lines(["x.py"])] == ["1", "2"]


def test_no_work_log_words_in_tracked_files():
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    hits = work_log_lines(listed.stdout.splitlines())
    assert not hits, "work-log words in the product (state the reason, keep history in git):\n" + "\n".join(
        hits[:60]
    )
