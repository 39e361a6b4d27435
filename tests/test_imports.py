"""The recipe's import graph: every module imports on its own in a fresh interpreter, no module-level or lazy
import closes a cycle, and config.py is a leaf (it pulls in no other recipe module)."""
import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import REPO
from recipe.launch import rank_env

MODULES = sorted(".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
                 for p in (REPO / "recipe").rglob("*.py"))


def recipe_imports(module: str) -> set[str]:
    """Recipe modules `module` imports anywhere in its file (function-level imports included)."""
    path = REPO / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = REPO / module.replace(".", "/") / "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("recipe.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "recipe":
            # `from recipe import engine` names a module; `from recipe.x import f` names x
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & set(MODULES)) or {node.module}
    return {m for m in found if m in MODULES and m != module}


def test_import_graph_has_no_cycle():
    graph = {m: recipe_imports(m) for m in MODULES}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError(f"import cycle: {' -> '.join(path[path.index(m):] + [m])}")
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in MODULES:
        visit(m)
    assert graph["recipe.config"] == set()


def test_each_module_imports_alone_and_config_pulls_in_nothing_else():
    code = "import importlib, sys; importlib.import_module(sys.argv[1]); " \
           "print(sorted(m for m in sys.modules if m.split('.')[0] == 'recipe'))"

    def fresh(m):
        return subprocess.run([sys.executable, "-c", code, m], cwd=REPO, env=rank_env(), capture_output=True, text=True,
                              timeout=300)

    with ThreadPoolExecutor(4) as pool:  # a few interpreters at a time: each one imports torch
        procs = dict(zip(MODULES, pool.map(fresh, MODULES)))
    for m, proc in procs.items():
        assert proc.returncode == 0, f"import {m} alone failed:\n{proc.stderr[-2000:]}"
    assert procs["recipe.config"].stdout.split() == ["['recipe',", "'recipe.config']"]
