"""The project's imports go one way, downwards, with no cycle (DESIGN.md, "Layers").

Every import statement of every project file is read (also those inside functions), so a lazy import
that climbs a layer is caught as well as one at the top of a file. Tests are users, not layers.
"""
import ast
import os

from conftest import ROOT

# Lower number = lower layer. A module may import only modules of a strictly lower layer.
LAYERS = {
    "util": 0, "clip": 0,          # helpers; the vendored CLIP, which knows nothing of the project
    "download": 1,                 # fetching and unpacking archives (through clip.stream)
    "data": 2,                     # the datasets; knows nothing of the toy world
    "toyworld": 3,                 # a user of clip and data
    "roles_report": 3,             # roles.md and roles.png from a roles document
    "entropy": 4, "train": 4,      # head roles; the training loop and evaluation
    "runs": 5,                     # run folders: identity, lock, pinned roles
    "dear": 6,                     # the method and its command line
    "tables": 7, "bench": 7,       # reports
    "jobs": 7,                     # run_all.sh's runner: naming, checks, GPU slots (dear.py by path)
}


def project_files():
    files = {name[:-3]: [name] for name in os.listdir(ROOT) if name.endswith(".py")}
    files["clip"] = [os.path.join("clip", n) for n in os.listdir(os.path.join(ROOT, "clip")) if n.endswith(".py")]
    return files


def project_imports(path):
    """The project modules a file imports (top-level name of every `import x` / `from x import y`)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(LAYERS)


def import_graph():
    return {module: set().union(*(project_imports(p) for p in paths)) - {module}
            for module, paths in project_files().items()}


def test_every_module_has_a_layer():
    assert set(project_files()) == set(LAYERS), "a new top-level file needs its place in LAYERS (and DESIGN.md)"


def test_imports_only_go_down():
    upward = [f"{m} imports {n}" for m, deps in import_graph().items() for n in deps if LAYERS[n] >= LAYERS[m]]
    assert not upward, upward


def test_clip_imports_nothing_of_the_project():
    assert import_graph()["clip"] == set()


def test_no_import_cycle():
    graph, state = import_graph(), {}

    def visit(m, path):
        if state.get(m) == "open":
            raise AssertionError("import cycle: " + " -> ".join(path + [m]))
        if state.get(m) != "done":
            state[m] = "open"
            for n in sorted(graph[m]):
                visit(n, path + [m])
            state[m] = "done"
    for m in sorted(graph):
        visit(m, [])


def test_the_checker_sees_a_planted_upward_import(tmp_path, monkeypatch):
    """The check itself works: a lazy `import toyworld` inside a function of data.py is an upward import."""
    planted = tmp_path / "data.py"
    planted.write_text("def f():\n    import toyworld\n    from util import read_json\n")
    assert project_imports(str(planted)) == {"toyworld", "util"}


def top_level_imports(path):
    """[(statement index, {top-level module names})] of a file's top-level import statements."""
    body = ast.parse(open(os.path.join(ROOT, path)).read(), path).body
    out = []
    for i, node in enumerate(body):
        if isinstance(node, ast.Import):
            out.append((i, {a.name.split(".")[0] for a in node.names}))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((i, {node.module.split(".")[0]}))
    return body, out


def test_entry_scripts_ask_for_passive_waiting_before_torch_loads():
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads its thread pool: every script that loads torch
    sets the default (with setdefault, so a user's own setting wins) before its first import that loads it."""
    files = {m: paths[0] for m, paths in project_files().items() if m != "clip"}
    loads = {}

    def loads_torch(module):   # through top-level imports (a lazy one loads torch when it is needed)
        if module not in loads:
            loads[module] = False
            names = set().union(*(n for _, n in top_level_imports(files[module])[1]))
            loads[module] = bool(names & {"torch", "torchvision", "clip"}) or any(
                loads_torch(n) for n in names & set(files))
        return loads[module]
    checked = []
    for module, path in files.items():
        source = open(os.path.join(ROOT, path)).read()
        if '__name__ == "__main__"' not in source or not loads_torch(module):
            continue
        body, imports = top_level_imports(path)
        first = min(i for i, names in imports if names & {"torch", "torchvision", "clip"}
                    or any(loads_torch(n) for n in names & set(files)))
        sets = [i for i, node in enumerate(body) if isinstance(node, ast.Expr) and
                ast.unparse(node) == "os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')"]
        assert sets and sets[0] < first, f"{path}: setdefault OMP_WAIT_POLICY before torch loads"
        checked.append(module)
    assert {"dear", "entropy", "toyworld", "bench"} <= set(checked)
