"""A vendored CLIP (OpenAI's ViT models) in plain PyTorch: load, tokenize, available_models.

    import clip
    model, preprocess = clip.load("ViT-B/16", device="cpu")
    text = clip.tokenize(["a photo of a cat.", "a photo of a dog."])
    logits_per_image, _ = model(preprocess(image).unsqueeze(0), text)

Checkpoints are OpenAI's published files, downloaded once into ~/.cache/clip (or `download_root`,
or $CLIP_CACHE) and checked against the SHA256 that is part of their URL. Both the TorchScript
archives that OpenAI publishes (only their state dict is read) and plain state dicts load.
OpenAI CLIP (model architecture, vocabulary, checkpoints) is released under the MIT licence.

Like OpenAI's package, clip/ imports nothing of the project around it. Its users: toyworld.py,
entropy.py, dear.py and bench.py (models, tokenize), and download.py, which fetches dataset archives
through `stream`, the project's one download loop.
"""

import errno
import hashlib
import http.client
import os
import shutil
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
import zipfile

import numpy as np
import torch
from PIL import Image

from .model import CLIP, build_model
from .tokenizer import tokenize

__all__ = ["available_models", "load", "tokenize", "cache_dir", "build_model", "CLIP"]

# name -> URL; the second-to-last path component is the file's SHA256. Tests point this at
# 127.0.0.1.
MODELS = {
    "ViT-B/32": "https://openaipublic.azureedge.net/clip/models/"
    "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af/ViT-B-32.pt",
    "ViT-B/16": "https://openaipublic.azureedge.net/clip/models/"
    "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f/ViT-B-16.pt",
    "ViT-L/14": "https://openaipublic.azureedge.net/clip/models/"
    "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836/ViT-L-14.pt",
    "ViT-L/14@336px": "https://openaipublic.azureedge.net/clip/models/"
    "3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02/ViT-L-14-336px.pt",
}

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def available_models():
    """Names `load` accepts (besides a path to a checkpoint file)."""
    return list(MODELS)


def cache_dir(download_root=None) -> str:
    """Where checkpoints live: download_root, else $CLIP_CACHE, else ~/.cache/clip."""
    root = download_root or os.environ.get("CLIP_CACHE") or os.path.join("~", ".cache", "clip")
    return os.path.abspath(os.path.expanduser(root))


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _progress(done: int, total: int, start: float, name: str, final: bool = False):
    """One progress line on stderr, rewritten in place: MiB done, percent, speed, ETA."""
    elapsed = max(time.time() - start, 1e-6)
    speed = done / elapsed
    if total:
        eta = (total - done) / speed if speed > 0 else 0.0
        msg = (
            f"\rdownloading {name}: {done / 2**20:.1f}/{total / 2**20:.1f} MiB "
            f"({100 * done / total:.0f}%), {speed / 2**20:.1f} MiB/s, ETA {eta:.0f}s"
        )
    else:
        msg = f"\rdownloading {name}: {done / 2**20:.1f} MiB, {speed / 2**20:.1f} MiB/s"
    sys.stderr.write(msg + ("\n" if final else ""))
    sys.stderr.flush()


def stream(response, out, hasher, name: str):
    """Copy an HTTP response into the open file `out` in 1 MiB chunks, feeding `hasher`, with one
    progress line on stderr. Returns (bytes copied, hasher). A broken connection raises OSError
    saying how far it got. The one download loop of the project: download.py fetches the dataset
    archives through it too."""
    total = int(response.headers.get("Content-Length") or 0)
    done, start, last = 0, time.time(), 0.0
    while True:
        try:
            chunk = response.read(1 << 20)
        except (OSError, http.client.HTTPException) as e:
            raise OSError(f"the connection broke after {done} bytes ({e!r})") from None
        if not chunk:
            break
        out.write(chunk)
        hasher.update(chunk)
        done += len(chunk)
        if time.time() - last > 0.5:
            _progress(done, total, start, name)
            last = time.time()
    _progress(done, total, start, name, final=True)
    return done, hasher


def download(url: str, root: str) -> str:
    """Fetch `url` into `root` once and return the file's path.

    The expected SHA256 is the URL's second-to-last path component. A cached file with another
    checksum is fetched again. The download goes to a temporary file that is renamed only after
    its checksum matches; a failed or mismatching download raises and leaves nothing behind.
    """
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise RuntimeError(
            f"the CLIP cache {root} cannot be created ({e.strerror}); "
            "set CLIP_CACHE to a writable folder"
        ) from None
    expected = url.split("/")[-2]
    target = os.path.join(root, os.path.basename(url))
    if os.path.isfile(target):
        actual = sha256_of(target)
        if actual == expected:
            return target
        sys.stderr.write(
            f"{target} has SHA256 {actual}, expected {expected}; downloading it again\n"
        )

    name = os.path.basename(url)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=name + ".", suffix=".part")
    size = 0
    try:
        try:
            with os.fdopen(fd, "wb") as out:  # closing flushes: a full disk may show only there
                try:
                    with urllib.request.urlopen(url, timeout=60) as response:
                        size = int(response.headers.get("Content-Length") or 0)
                        _, h = stream(response, out, hashlib.sha256(), name)
                except OSError as e:
                    if e.errno in DISK_FULL:
                        raise
                    raise RuntimeError(
                        f"download of {url} failed: {e}; check the network (or put "
                        f"the file, with SHA256 {expected}, at {target})"
                    ) from None
        except OSError as e:
            if e.errno in DISK_FULL:  # a full disk is no network fault: say where and how much
                raise RuntimeError(_no_room(target, size, e)) from None
            raise
        actual = h.hexdigest()
        if actual != expected:
            raise RuntimeError(
                f"download of {url} has the wrong checksum: expected SHA256 {expected}, "
                f"got {actual}; the file was not kept, try again"
            )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return target


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _no_room(target: str, size: int, e: OSError) -> str:
    """One line for a download that filled the disk: the file, the bytes it needs, the room left."""
    free = shutil.disk_usage(os.path.dirname(target)).free
    return (
        f"cannot write {target}: {e.strerror} (it needs {size / 2**20:.1f} MiB, "
        f"{free / 2**20:.1f} MiB free there); free some space there, or set CLIP_CACHE "
        "to a folder on another disk"
    )


def _is_torchscript(path: str) -> bool:
    """TorchScript archives are zip files that hold compiled code and a constants.pkl record."""
    if not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as z:
        return any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in z.namelist())


def read_state_dict(path: str) -> dict:
    """The CLIP state dict in a checkpoint file (TorchScript archive or a torch.save'd state dict).

    A dict of the form {"state_dict": {...}} is unwrapped too (training scripts often save that).
    """
    try:
        if _is_torchscript(path):
            # only the weights are read; the archive's code never runs
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # "torch.jit is deprecated"
                sd = torch.jit.load(path, map_location="cpu").state_dict()
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(
            f"{path} is neither a TorchScript archive nor a state dict saved with torch.save "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); delete it or "
            "give another checkpoint"
        ) from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"{path} does not hold a state dict (a dict of tensor names to tensors)")
    return dict(sd)


# CLIP's preprocessing. OpenAI's `_transform` is torchvision's Resize(n_px, bicubic),
# CenterCrop(n_px), RGB, ToTensor and Normalize. On PIL images those are a few lines of PIL and
# torch, written out here: importing torchvision (it loads torch._dynamo) costs a process about as
# much CPU time as importing torch. tests/test_clip.py checks them bit for bit against torchvision.


def resize(image, size):
    """PIL image -> its shorter side `size` (bicubic), the aspect kept: the longer side is
    int(size * long / short), truncated (torchvision's Resize(size) on a PIL image)."""
    w, h = image.size
    long = int(size * max(w, h) / min(w, h))
    new = (size, long) if w <= h else (long, size)  # (width, height)
    return image if new == (w, h) else image.resize(new, Image.BICUBIC)


def center_crop(image, size):
    """The central size x size of a PIL image at least that large; an odd margin rounds half to even
    (Python's round, as torchvision's CenterCrop)."""
    w, h = image.size
    top, left = int(round((h - size) / 2.0)), int(round((w - size) / 2.0))
    return image.crop((left, top, left + size, top + size))


def to_tensor(image, mean=MEAN, std=STD):
    """8-bit RGB PIL image -> float [3, H, W] (or uint8 images [..., H, W, 3] -> [..., 3, H, W]):
    pixels / 255, then (x - mean) / std per channel."""
    x = torch.from_numpy(np.array(image, dtype=np.uint8)).movedim(-1, -3).contiguous()  # [3, H, W]
    x = x.float().div(255)
    return x.sub_(torch.tensor(mean).view(3, 1, 1)).div_(torch.tensor(std).view(3, 1, 1))


class Preprocess:
    """CLIP's test-time preprocessing: shorter side to n_px (bicubic), centre crop, RGB,
    mean/std."""

    def __init__(self, n_px):
        self.n_px = n_px

    def __call__(self, image):  # PIL image -> [3, n_px, n_px]
        image = center_crop(resize(image, self.n_px), self.n_px)
        return to_tensor(image.convert("RGB"))


def transform(n_px: int):
    """CLIP's preprocess for n_px x n_px inputs (what `load` returns beside the model)."""
    return Preprocess(n_px)


def load(name_or_path: str, device=None, download_root=None):
    """Load a CLIP model; returns (model, preprocess).

    name_or_path: a name from available_models() or the path of a checkpoint file.
    device: "cpu", "cuda", a torch.device, or None for CUDA when available, else CPU.
    download_root: where checkpoints are cached (default $CLIP_CACHE, else ~/.cache/clip).

    The model is fp32 and in eval mode (use torch.autocast for speed on GPU). It carries
    model.name (the name, or the path when the file is no known checkpoint) and model.sha256.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    root = cache_dir(download_root)
    if name_or_path in MODELS:
        path, name = download(MODELS[name_or_path], root), name_or_path
    elif os.path.isfile(os.path.expanduser(str(name_or_path))):
        path, name = os.path.expanduser(str(name_or_path)), str(name_or_path)
    else:
        raise ValueError(
            f"model {name_or_path!r} not found; give one of {available_models()} "
            "or the path of a checkpoint file"
        )
    # a downloaded file was just checked against the hash in its URL; hash anything else here
    sha = MODELS[name].split("/")[-2] if name in MODELS else sha256_of(path)
    if name not in MODELS:  # a local copy of a published checkpoint gets its published name
        name = next((n for n, url in MODELS.items() if url.split("/")[-2] == sha), name)

    state_dict = read_state_dict(path)
    try:
        model = build_model(state_dict)
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path} does not hold a CLIP ViT checkpoint that loads: {e}") from None
    model = model.to(device)
    model.name = name
    model.sha256 = sha
    return model, transform(model.visual.input_resolution)
