"""The package's modules import each other without a cycle, and no layer imports one above it.
"""



def test_package_modules_import_each_other_without_a_cycle():
    """Every relative import (top-level or inside a function) between the modules of
    python/fused_reducer and its subpackages is an edge; the planner side (autotune, plan,
    profile, costmodel, probe) is on no cycle."""
    import ast
    import pathlib
    import fused_reducer
    package = pathlib.Path(fused_reducer.__file__).parent

    def dotted(path):
        parts = list(path.relative_to(package).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {dotted(p): p for p in package.rglob("*.py")}
    edges = {}
    for name, path in modules.items():
        here = name.split(".") if name else []
        if path.name != "__init__.py":
            here = here[:-1]  # the package the module is in
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 1:
                base = here[:len(here) - (node.level - 1)]
                if node.module:
                    targets.add(".".join(base + node.module.split(".")))
                targets.update(".".join(base + (node.module.split(".") if node.module else [])
                                        + [a.name]) for a in node.names)
        edges[name] = {t for t in targets if t in modules and t not in (name, "")}

    def reaches(start, goal, seen=()):
        return any(t == goal or (t not in seen and reaches(t, goal, seen + (t,)))
                   for t in edges[start])

    planner_side = ("tuning.autotune", "tuning.plan", "tuning.profile", "tuning.costmodel",
                    "tuning.probe")
    assert all(m in edges for m in planner_side), sorted(edges)
    on_cycle = [m for m in planner_side if reaches(m, m)]
    assert not on_cycle, f"import cycle through {on_cycle}: {edges}"
    # The layers: the core and the transports import nothing above them (the tuning layer plugs
    # into the core through core/plugins.py).
    above = ("tuning", "sharded", "integrations")
    upward = sorted((m, t) for m, targets in edges.items() if m.split(".")[0] in ("core", "transports")
                    for t in targets if t.split(".")[0] in above)
    assert not upward, f"the core or the transports import a layer above them: {upward}"
