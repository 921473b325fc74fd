"""Shared test helpers: tiny random CLIPs loaded the way a real checkpoint is, and the pretrained
toy CLIP.

The toy CLIP's pretraining (about 2 minutes on 2 cores) starts in a process of its own as soon as
the collected tests are known to need it, and runs beside the other tests; it is kept in
~/.cache/dear/tests/<key>, the key naming the files and versions that decide its weights
(DEAR_TEST_CACHE= turns the keeping off).
"""

import hashlib
import http.server
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

# the tests' models are tiny: a second thread adds CPU time only
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from clip.model import CLIP, build_model  # noqa: E402


def tiny_state_dict(seed=0, vision_layers=4, vision_width=64, vision_heads=4, patch=8,
                    resolution=32, text_layers=2, text_width=64, text_heads=4, embed_dim=32,
                    context_length=77):
    """A random CLIP state dict with OpenAI's key names, plus the head counts that tiny
    checkpoints carry (a width that is not a multiple of 64 does not give them)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = CLIP(embed_dim=embed_dim, image_resolution=resolution, vision_layers=vision_layers,
                     vision_width=vision_width, vision_patch_size=patch, vision_heads=vision_heads,
                     context_length=context_length, vocab_size=49408, transformer_width=text_width,
                     transformer_heads=text_heads, transformer_layers=text_layers)
    heads = dict(vision_heads=torch.tensor(vision_heads), text_heads=torch.tensor(text_heads))
    return {**{k: v.detach().clone() for k, v in model.state_dict().items()}, **heads}


def tiny_clip(**sizes):
    """A random tiny CLIP (fp32, eval mode) built through build_model, as a checkpoint is loaded."""
    return build_model(tiny_state_dict(**sizes))


TEXTS = os.path.join(ROOT, "tests", "texts")


def reviewed(name, text):
    """assert text == tests/texts/NAME: what users read, stated once and reviewed as a diff.
    DEAR_REVIEW=1 rewrites the file instead; `git diff tests/texts` then shows the change."""
    path = os.path.join(TEXTS, name)
    if os.environ.get("DEAR_REVIEW"):
        os.makedirs(TEXTS, exist_ok=True)
        pathlib.Path(path).write_text(text)
    assert text.splitlines() == pathlib.Path(path).read_text().splitlines(), name


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device; skipped where there is none")


@pytest.hookimpl(trylast=True)  # after -k and -m: only the selected tests start the commands
def pytest_collection_modifyitems(config, items):
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))

    def late(item):  # waits for the toy CLIP (1), or for a command run beside the others (2)
        names = set(getattr(item, "fixturenames", ()))
        return ("toy_cache" in names) + 2 * bool({"smoke", "quick_start"} & names)

    items.sort(key=late)  # those last: until then this process runs the rest
    wanted = {f for item in items for f in getattr(item, "fixturenames", ())}
    BACKGROUND.update((k, None) for k in ("smoke", "quick_start") if k in wanted)
    if wanted & {"toy_cache", "smoke", "quick_start"}:
        start_pretraining()
        start_background()
        # the pretraining and the commands after it are the suite's longest chain: this process
        # yields the CPU to them and runs its tests in the gaps
        os.nice(10)


def toy_dir():
    h = hashlib.sha256(torch.__version__.encode())
    for name in ("toyworld.py", "clip/model.py", "clip/__init__.py"):
        with open(os.path.join(ROOT, name), "rb") as f:
            h.update(f.read())
    keep = os.environ.get("DEAR_TEST_CACHE", os.path.expanduser("~/.cache/dear/tests"))
    return os.path.join(keep or os.path.join(ROOT, ".pytest_toy"), h.hexdigest()[:16])


PRETRAIN, BACKGROUND = {}, {}
# Every test process reads CLIP checkpoints and head roles from here (the toy CLIP once pretrained,
# the roles that tests compute for their own tiny checkpoints, keyed by their SHA256)
TOY = os.environ["CLIP_CACHE"] = toy_dir()
os.makedirs(TOY, exist_ok=True)
WORK = tempfile.mkdtemp(prefix="dear-tests-")
# The two slowest checks run as commands of their own beside the other tests, once the toy CLIP is
# there: `run_all.sh --smoke`, and the README's quick start (DeAR on the toy, then zero-shot).
QUICK_START = (f"import sys; sys.path.insert(0, {ROOT!r}); import dear; a = ['--dataset', "
               "'toyworld', '--root', 'data', '--out', 'runs']; dear.main(a); "
               "dear.main(a + ['--method', 'zeroshot'])")
COMMANDS = {"smoke": ["bash", os.path.join(ROOT, "run_all.sh"), "--smoke"],
            "quick_start": [sys.executable, "-c", QUICK_START]}
PRETRAIN_COMMAND = [sys.executable, "-c",
                    "import sys, toyworld; toyworld.ensure_pretrained(sys.argv[1])", TOY]


def start_pretraining():
    if os.path.exists(os.path.join(TOY, "done")) or PRETRAIN:
        return
    log = open(os.path.join(TOY, "pretrain.log"), "w")
    PRETRAIN["proc"] = subprocess.Popen(PRETRAIN_COMMAND, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=ROOT)


def start_background():
    """Start the background commands once the pretraining (if any) has ended."""
    proc = PRETRAIN.get("proc")
    if proc is not None and proc.poll() is None:
        return
    if proc is not None and proc.returncode == 0:
        open(os.path.join(TOY, "done"), "w").close()
    for name, running in BACKGROUND.items():
        if running is None:
            os.makedirs(os.path.join(WORK, name))
            log = open(os.path.join(WORK, name + ".log"), "w")
            env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1")
            env.pop("GPUS", None)
            BACKGROUND[name] = subprocess.Popen(COMMANDS[name], cwd=os.path.join(WORK, name),
                                                env=env, stdout=log, stderr=subprocess.STDOUT)


def pytest_runtest_logfinish(nodeid, location):
    if None in BACKGROUND.values():  # not started yet: is the pretraining over?
        start_background()


@pytest.fixture(scope="session")
def toy_cache():
    """$CLIP_CACHE, once it holds the pretrained toy CLIP."""
    if "proc" in PRETRAIN:
        if PRETRAIN["proc"].wait() != 0:
            pytest.fail(open(os.path.join(TOY, "pretrain.log")).read()[-2000:])
    elif not os.path.exists(os.path.join(TOY, "done")):
        subprocess.run(PRETRAIN_COMMAND, check=True, cwd=ROOT)
    open(os.path.join(TOY, "done"), "w").close()
    return TOY


def finished(name, runs):
    """Wait for a background command (starting it first if the pretraining has just ended):
    (its runs folder, its process)."""
    if BACKGROUND.get(name) is None:
        start_background()
    BACKGROUND[name].wait()
    return pathlib.Path(WORK) / name / runs, BACKGROUND[name]


@pytest.fixture(scope="session")
def smoke(toy_cache):  # the toy CLIP first: a failed pretraining fails here
    return finished("smoke", "runs-smoke")


@pytest.fixture(scope="session")
def quick_start(toy_cache):
    return finished("quick_start", "runs")


def pytest_sessionfinish(session):
    for proc in [PRETRAIN.get("proc")] + list(BACKGROUND.values()):
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()  # no process left behind, not even a zombie
    shutil.rmtree(WORK, ignore_errors=True)


# more than ten folders, names with spaces
CLASSES = [f"class {i:02d} with spaces" for i in range(12)]


@pytest.fixture(scope="session")
def world(tmp_path_factory):
    """A tiny CLIP checkpoint file and a folder dataset of 12 classes whose colour is the class."""
    root = tmp_path_factory.mktemp("world")
    torch.save(tiny_state_dict(text_layers=4), root / "tiny.pt")
    gen = torch.Generator().manual_seed(0)
    for name in CLASSES:
        os.makedirs(root / "shapes" / name)
        colour = torch.rand(3, generator=gen) * 255
        for i in range(10):
            pixels = (colour + torch.randn(32, 32, 3, generator=gen) * 20).clamp(0,
                    255).byte().numpy()
            Image.fromarray(pixels).save(root / "shapes" / name / f"{i}.png")
    return root


@pytest.fixture
def server():
    """A local HTTP server: routes maps a path (with its query) to the body served."""
    routes = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = routes.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        log_message = lambda self, *args: None

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01},
                     daemon=True).start()
    yield routes, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
