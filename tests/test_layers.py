"""The project's imports go one way, downwards, with no cycle (README.md, "Layout"); dear.py is the
method and its command line, with no run orchestration in it.

Every import statement of every project file is read (also those inside functions), so a lazy import
that climbs a layer is caught as well as one at the top of a file. Tests are users, not layers.
"""

import ast
import re
import subprocess
import os

from conftest import ROOT

# Lower number = lower layer. A module may import only modules of a strictly lower layer.
LAYERS = {
    "util": 0,
    "clip": 0,  # helpers; the vendored CLIP, which knows nothing of the project
    "download": 1,  # fetching and unpacking archives (through clip.stream)
    "data": 2,  # the datasets; knows nothing of the toy world
    "toyworld": 3,  # a user of clip and data
    "roles_report": 3,  # roles.md and roles.png from a roles document
    "entropy": 4,
    "train": 4,  # head roles; the training loop and evaluation
    "config": 5,  # Config, the per-dataset tables, resolve
    "runs": 6,  # one run: its folder and identity, what it reads, results.json;
    # the method comes from above as arguments (make_model, make_loss)
    "dear": 7,  # the method and its command line
    "tables": 8,
    "bench": 8,  # reports
    "jobs": 8,  # run_all.sh's runner: naming, checks, GPU slots (dear.py by path)
}


def project_files():
    files = {name[:-3]: [name] for name in os.listdir(ROOT) if name.endswith(".py")}
    files["clip"] = [
        os.path.join("clip", n) for n in os.listdir(os.path.join(ROOT, "clip")) if n.endswith(".py")
    ]
    return files


def project_imports(path):
    """The project modules a file imports (top-level name of every `import x` / `from x import
    y`)."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(LAYERS)


def import_graph():
    return {
        module: set().union(*(project_imports(p) for p in paths)) - {module}
        for module, paths in project_files().items()
    }


def test_every_module_has_a_layer():
    assert set(project_files()) == set(LAYERS), (
        "a new top-level file needs its place in LAYERS (and the README)"
    )


def test_imports_only_go_down():
    upward = [
        f"{m} imports {n}"
        for m, deps in import_graph().items()
        for n in deps
        if LAYERS[n] >= LAYERS[m]
    ]
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
    """The check itself works: a lazy `import toyworld` inside a function of data.py is an upward
    import."""
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
    """OpenMP reads OMP_WAIT_POLICY once, when torch loads its thread pool: every script that loads
    torch sets the default (with setdefault, so a user's own setting wins) before its first import
    that loads it."""
    files = {m: paths[0] for m, paths in project_files().items() if m != "clip"}
    loads = {}

    def loads_torch(module):  # through top-level imports (a lazy one loads torch when it is needed)
        if module not in loads:
            loads[module] = False
            names = set().union(*(n for _, n in top_level_imports(files[module])[1]))
            loads[module] = bool(names & {"torch", "torchvision", "clip"}) or any(
                loads_torch(n) for n in names & set(files)
            )
        return loads[module]

    checked = []
    for module, path in files.items():
        source = open(os.path.join(ROOT, path)).read()
        if '__name__ == "__main__"' not in source or not loads_torch(module):
            continue
        body, imports = top_level_imports(path)
        first = min(
            i
            for i, names in imports
            if names & {"torch", "torchvision", "clip"}
            or any(loads_torch(n) for n in names & set(files))
        )
        sets = [
            i
            for i, node in enumerate(body)
            if isinstance(node, ast.Expr)
            and ast.unparse(node) == "os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')"
        ]
        assert sets and sets[0] < first, f"{path}: setdefault OMP_WAIT_POLICY before torch loads"
        checked.append(module)
    assert {"dear", "entropy", "toyworld", "bench"} <= set(checked)


# What runs.py does and dear.py must not: run folders, files, logs, results, the roles stage.
ORCHESTRATION = {
    "run",
    "_run_locked",
    "run_dir",
    "variant_name",
    "dataset_tag",
    "eval_only_config",
    "export_roles",
    "Interrupted",
    "check_same",
    "RunLock",
    "pin_roles",
    "inputs",
    "load_clip",
    "load_roles",
    "build_eval_sets",
    "harmonic_mean",
    "log",
}
# Modules for files, folders, clocks and hashes: what orchestration needs and the method does not.
FILE_MODULES = {
    "os",
    "time",
    "shutil",
    "pathlib",
    "hashlib",
    "socket",
    "fcntl",
    "tempfile",
    "glob",
    "util",
    "io",
    "pickle",
}
# Calls that write or read files or checkpoints (os.* calls are caught by the import of os).
OMP_DEFAULT = "os.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')"
FILE_CALLS = {"open", "atomic_save", "write_atomic", "write_json_atomic", "read_json"}


def method_file_problems(path):
    """What in a file is run orchestration: names it defines, modules it imports, file calls it
    makes. torch.load and torch.save count; `clip.load` and `model.load_state_dict` are not file
    calls here."""
    tree = ast.parse(open(os.path.join(ROOT, path)).read(), path)
    problems = []
    # `os` for one thing only: OpenMP's passive waiting, set before torch loads (BENCH.md)
    omp = [n for n in ast.walk(tree) if isinstance(n, ast.Expr) and ast.unparse(n) == OMP_DEFAULT]
    os_uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "os"]
    only_omp = bool(omp) and len(os_uses) == len(omp)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in ORCHESTRATION:
            problems.append(f"defines {node.name}")
        elif isinstance(node, ast.Import):
            problems += [
                f"imports {a.name}"
                for a in node.names
                if a.name.split(".")[0] in FILE_MODULES and not (a.name == "os" and only_omp)
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in FILE_MODULES
        ):
            problems.append(f"imports from {node.module}")
        elif isinstance(node, ast.Call):
            f = node.func
            name = (
                f.id
                if isinstance(f, ast.Name)
                else f.attr
                if isinstance(f, ast.Attribute)
                else None
            )
            owner = (
                f.value.id
                if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                else None
            )
            if name in FILE_CALLS or (name in ("save", "load") and owner == "torch"):
                problems.append(f"calls {name} (line {node.lineno})")
    return problems


def test_dear_py_is_the_method_and_its_command_line():
    """dear.py defines no run orchestration, imports no file or clock module and opens no file: all
    of that is runs.py's. It stays short enough to read in one sitting."""
    assert method_file_problems("dear.py") == []
    lines = [line for line in open(os.path.join(ROOT, "dear.py")) if line.strip()]
    assert len(lines) <= 450, f"dear.py has {len(lines)} non-blank lines; the method fits in 450"


def test_the_orchestration_check_allows_os_for_the_openmp_default_only(tmp_path):
    planted = tmp_path / "dear.py"
    planted.write_text("import os\nos.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')\n")
    assert method_file_problems(str(planted)) == []
    planted.write_text(
        "import os\nos.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')\n"
        "def f(p):\n    return os.path.exists(p)\n"
    )
    assert method_file_problems(str(planted)) == ["imports os"]


def test_the_orchestration_check_sees_planted_orchestration(tmp_path):
    planted = tmp_path / "dear.py"
    planted.write_text(
        "import os\nimport torch\ndef run_dir(c):\n    pass\n"
        "def f(m):\n    torch.save(m, 'x')\n    m.load_state_dict({})\n"
        "    open('log.txt', 'a')\n"
    )
    assert method_file_problems(str(planted)) == [
        "imports os",
        "defines run_dir",
        "calls save (line 6)",
        "calls open (line 8)",
    ]


# Documents that are not in this repository: a file must cite the official source itself
# (repository, file, commit) instead of pointing a reader to notes they do not have.
ABSENT_DOCS = re.compile(r"anchors\.md|paper\.md|SPEC\.md|DESIGN\.md|research/|\.\./shared")


def test_no_file_points_to_a_document_outside_the_repository():
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    if not tracked:  # not a git checkout (an unpacked archive): read the usual places instead
        tracked = [
            os.path.relpath(os.path.join(d, f), ROOT)
            for d, _, fs in os.walk(ROOT)
            for f in fs
            if ".git" not in d
        ]
    texts = [
        p
        for p in tracked
        if p.endswith((".py", ".sh", ".md", ".txt", ".toml", ".cfg", ".tsv")) or p == ".ci/run"
    ]
    found = [
        f"{p}:{i}"
        for p in texts
        if os.path.isfile(os.path.join(ROOT, p))
        for i, line in enumerate(open(os.path.join(ROOT, p), errors="replace"), 1)
        if ABSENT_DOCS.search(line) and p != "tests/test_layers.py"
    ]
    assert not found, found
