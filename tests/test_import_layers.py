"""The package's import graph: no circle, no layer importing one above it, chains at most six
modules long, and a root that holds only the base and the entry points users import, each a real
module (none a sys.modules alias of another).

The graph is read from the source (ast), counting every import between the modules of
python/fused_reducer: relative and absolute, at the top of a module or inside a function (a lazy
import still runs, and still ties the two modules). `from pkg import name` is an edge to the
module pkg.name when there is one, else to pkg; the package a module sits in (its parents'
__init__.py, run by Python before it) is no edge, and neither is the compiled extension `_C`
(it imports nothing of the package). No spawn.
"""
import ast
import importlib
import importlib.util
import pathlib
import sys

import fused_reducer

PACKAGE = pathlib.Path(fused_reducer.__file__).parent
MAX_CHAIN = 6  # modules in the longest import chain
# The root: the base (errors, settings, build info; _build_torch.py is written by setup.py) and
# the entry points of docs/API.md, "Modules".
ENTRY_POINTS = ("accelerate", "lightning", "pipelining", "plan", "torchft", "transformers")
BASE = {"__init__", "build", "errors", "settings"}
# The extras an entry point needs (any one of them), as docs/INSTALL.md names them.
EXTRAS = {"accelerate": ("accelerate",), "transformers": ("transformers",),
          "lightning": ("pytorch_lightning", "lightning"), "torchft": ("torchft",)}


def _dotted(path):
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package=PACKAGE):
    """{module: its .py file} and {module: the modules it imports}, names relative to the
    package ("" is fused_reducer/__init__.py)."""
    modules = {_dotted(p): p for p in package.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        here = name.split(".") if name else []
        if path.name != "__init__.py":
            here = here[:-1]  # the package the module is in
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(".".join(a.name.split(".")[1:]) for a in node.names
                               if a.name.split(".")[0] == package.name)
            elif isinstance(node, ast.ImportFrom):
                module = node.module.split(".") if node.module else []
                if node.level:
                    base = here[:len(here) - (node.level - 1)] + module
                elif module[:1] == [package.name]:
                    base = module[1:]
                else:
                    continue  # another package's import
                for alias in node.names:
                    sub = ".".join(base + [alias.name])
                    targets.add(sub if sub in modules else ".".join(base))
        # "" only from `from .. import _C` and the like (the extension, or a parent's names)
        edges[name] = {t for t in targets if t in modules and t not in (name, "")}
    return modules, edges


def longest_chains(edges):
    """{module: the longest import chain starting there}; raises AssertionError on a circle,
    naming it."""
    chains, open_ = {}, []

    def visit(module):
        if module in chains:
            return chains[module]
        assert module not in open_, \
            "import circle: " + " -> ".join(open_[open_.index(module):] + [module])
        open_.append(module)
        below = [visit(t) for t in sorted(edges[module])]
        open_.pop()
        chains[module] = [module] + max(below, key=len, default=[])
        return chains[module]

    for module in sorted(edges):
        visit(module)
    return chains


def _named(chain):
    return " -> ".join(m or "fused_reducer" for m in chain)


def test_package_modules_import_each_other_without_a_circle():
    """No circle of imports anywhere in the package, lazy imports inside functions included."""
    _, edges = import_graph()
    assert "tuning.plan" in edges and "core.wrapper" in edges, sorted(edges)
    longest_chains(edges)  # raises on a circle, naming it


def test_longest_import_chain_is_at_most_six_modules():
    """Every chain of imports (lazy ones included) is at most MAX_CHAIN modules long."""
    _, edges = import_graph()
    chains = longest_chains(edges)
    longest = max(chains.values(), key=len)
    assert len(longest) >= 4, _named(longest)  # the graph was read at all
    too_long = sorted(_named(c) for c in chains.values() if len(c) > MAX_CHAIN)
    assert not too_long, f"import chains longer than {MAX_CHAIN} modules: {too_long}"


def test_no_layer_imports_one_above_it():
    """The core and the transports import nothing of the tuning layer, the sharded optimizer or
    the entry points at the root (the tuning layer plugs into the core through core/plugins.py);
    the tuning layer imports no entry point (the planner is tuning/plan.py, which plan.py names)."""
    _, edges = import_graph()
    above = {"core": ("tuning", "sharded", *ENTRY_POINTS),
             "transports": ("tuning", "sharded", *ENTRY_POINTS), "tuning": ENTRY_POINTS}
    upward = sorted((m, t) for m, targets in edges.items() for t in targets
                    if t.split(".")[0] in above.get(m.split(".")[0], ()))
    assert not upward, f"a layer imports one above it: {upward}"


def _assigns_sys_modules(tree):
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and ast.unparse(target.value) == "sys.modules":
                return True
        if isinstance(node, ast.Call) and ast.unparse(node.func) in (
                "sys.modules.__setitem__", "sys.modules.update", "sys.modules.setdefault"):
            return True
    return False


def test_the_root_holds_the_base_and_the_entry_points_each_a_real_module():
    """The root's modules are the base and the entry points of docs/API.md, no module of the
    package writes into sys.modules (an alias), and each entry point imports as itself (its own
    file, its own name) with an __all__ of names it has."""
    modules, _ = import_graph()
    root = {p.stem for p in PACKAGE.glob("*.py")} - {"_build_torch"}
    wanted = BASE | set(ENTRY_POINTS)
    assert root == wanted, (f"modules at the package root besides the base and the entry points: "
                            f"{sorted(root - wanted)}; missing: {sorted(wanted - root)}")
    aliases = sorted(m or "__init__" for m, path in modules.items()
                     if _assigns_sys_modules(ast.parse(path.read_text())))
    assert not aliases, f"modules that write into sys.modules (aliases of another): {aliases}"
    imported = []
    for name in ENTRY_POINTS:
        if not all(any(importlib.util.find_spec(n) for n in needs)
                   for needs in [EXTRAS.get(name, ())] if needs):
            continue  # its extra is not installed here
        module = importlib.import_module(f"fused_reducer.{name}")
        assert module.__name__ == f"fused_reducer.{name}", (name, module.__name__)
        assert sys.modules[f"fused_reducer.{name}"] is module
        assert pathlib.Path(module.__file__) == PACKAGE / f"{name}.py", (name, module.__file__)
        assert module.__all__ and all(hasattr(module, n) for n in module.__all__), \
            (name, module.__all__)
        imported.append(name)
    assert {"pipelining", "plan"} <= set(imported), imported
