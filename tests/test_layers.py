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
