"""The layers read top-down: no project module imports, directly or through others, a module that
imports it back (lazy imports inside functions count too), and ledger / probes / records import
nothing above them."""
import ast
import os

from tests.conftest import REPO

PACKAGES = ("analysis", "conf", "launchers", "ledger", "probes", "records", "sweeps", "hydra_plugins")


def _modules() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for d, _, fs in os.walk(os.path.join(REPO, pkg)):
            for f in fs:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(d, f), REPO)[:-3].replace(os.sep, ".")
                    out[rel.removesuffix(".__init__")] = os.path.join(d, f)
    out["launch"] = os.path.join(REPO, "launch.py")
    return out


def _imports(path: str, mods) -> set[str]:
    """Project modules this file imports (anywhere in it); `from pkg import mod` counts as pkg.mod."""
    out = set()
    tree = ast.parse(open(path).read())
    typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING"
                   for x in ast.walk(n)}
    for n in ast.walk(tree):
        if id(n) in typing_only:  # annotations only, never imported at run time
            continue
        names = []
        if isinstance(n, ast.Import):
            names = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
            names = [f"{n.module}.{a.name}" for a in n.names] + [n.module]
        for name in names:
            while name and name not in mods:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph():
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def test_no_import_cycles():
    g = _graph()
    cycles = []
    state: dict[str, int] = {}

    def visit(m, stack):
        state[m] = 1
        for n in sorted(g[m]):
            if n.startswith(m + ".") or m.startswith(n + "."):
                continue  # a package and its own modules
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_lower_layers_import_nothing_above():
    g = _graph()
    above = ("launch", "launchers", "analysis", "sweeps", "hydra_plugins")
    for m, deps in g.items():
        if m.split(".")[0] in ("ledger", "probes", "records"):
            bad = [d for d in deps if d.split(".")[0] in above]
            assert not bad, f"{m} imports {bad}"
