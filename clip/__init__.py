"""OpenAI's CLIP (ViT models) in plain PyTorch, with OpenAI's package API (openai/CLIP d05afc4
`clip/clip.py`).

    model, preprocess = clip.load("ViT-B/16")
    logits_per_image, _ = model(preprocess(image)[None], clip.tokenize(["a photo of a cat."]))

Checkpoints are OpenAI's files, downloaded once into `cache_dir()` and checked against the SHA256 in
their URL. OpenAI CLIP (architecture, vocabulary, checkpoints) is released under the MIT licence.
"""

import hashlib
import os
import re
import warnings

import torch
from torchvision.transforms import CenterCrop, Compose, InterpolationMode, Normalize, Resize
from torchvision.transforms import ToTensor

from .model import CLIP, build_model
from .tokenizer import tokenize

__all__ = ["available_models", "load", "tokenize", "cache_dir", "build_model", "CLIP", "transform",
           "crop"]

# the SHA256 of OpenAI's checkpoint files, which their URLs hold (and _download checks)
SHA256 = {
    "ViT-B/32": "40d365715913c9da98579312b702a82c18be219cc2a73407c4526f58eba950af",
    "ViT-B/16": "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f",
    "ViT-L/14": "b8cca3fd41ae0c99ba7e8951adf17d267cdb84cd88be6f7c2e0eca1737a03836",
    "ViT-L/14@336px": "3035c92b350959924f9f00213499208652fc7ea050643e8b385c2dac08641f02"}
BASE = "https://openaipublic.azureedge.net/clip/models"
MODELS = {name: f"{BASE}/{sha}/{re.sub('[/@]', '-', name)}.pt" for name, sha in SHA256.items()}

MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def available_models():
    return list(MODELS)


def cache_dir(download_root=None):
    """download_root, else $CLIP_CACHE, else ~/.cache/clip."""
    folder = download_root or os.environ.get("CLIP_CACHE") or "~/.cache/clip"
    return os.path.abspath(os.path.expanduser(folder))


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _download(url, root):
    """The cached file of `url` and its SHA256, downloading it if absent (to a temporary name, kept
    only if it matches); a file that fails its SHA256 raises."""
    path = os.path.join(root, os.path.basename(url))
    sha256 = url.split("/")[-2]
    if not os.path.isfile(path):
        os.makedirs(root, exist_ok=True)
        torch.hub.download_url_to_file(url, path, hash_prefix=sha256, progress=True)
    elif _sha256(path) != sha256:
        raise OSError(f"{path}: not the SHA256 {sha256} of {url}; delete it to download it again")
    return path, sha256


def _convert_image_to_rgb(image):
    return image.convert("RGB")


def crop(n_px):
    """The image OpenAI's preprocess sees: the shorter side to n_px (bicubic), the centre n_px x
    n_px (a PIL image)."""
    return Compose([Resize(n_px, interpolation=InterpolationMode.BICUBIC), CenterCrop(n_px)])


def transform(n_px):
    """OpenAI's preprocess: crop(n_px), then RGB, CLIP's mean and std."""
    return Compose([crop(n_px), _convert_image_to_rgb, ToTensor(), Normalize(MEAN, STD)])


def load(name_or_path, device="cpu", download_root=None):
    """(model, preprocess) of a model name in available_models() or a checkpoint file: an fp32 model
    in eval mode on `device`, with `model.name` (as given) and `model.sha256` (of the file read)."""
    if name_or_path in MODELS:
        path, sha256 = _download(MODELS[name_or_path], cache_dir(download_root))
    elif os.path.isfile(name_or_path):
        path, sha256 = name_or_path, _sha256(name_or_path)
    else:
        raise FileNotFoundError(f"model {name_or_path} not found; available: {available_models()}")
    try:  # OpenAI's files are TorchScript archives: only their weights are read
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.load is deprecated"
            state_dict = torch.jit.load(path, map_location="cpu").state_dict()
    except RuntimeError:  # not an archive: a plain state dict
        state_dict = torch.load(path, map_location="cpu", weights_only=True)
    model = build_model(state_dict).to(device)
    model.name, model.sha256 = name_or_path, sha256
    return model, transform(model.visual.input_resolution)
