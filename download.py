"""Download and unpack CoOp benchmark datasets into the layout data.py reads (`python data.py
download`).

Every archive streams through clip.stream (the one download loop) into a temporary file, is checked
(byte count against the server's Content-Length, and MD5 where a published value is known), renamed
into place, then unpacked with every member checked first (no path and no link may point outside the
target folder, judged by name alone) into a temporary folder beside the archive, which is then moved
into place: a cut-off unpack never looks done. Split JSONs and a few small files live on Google
Drive (links in CoOp's DATASETS.md); they are fetched with the standard library.
All URLs can be replaced: --mirror for the archives, --gdrive-url (or $DEAR_GDRIVE_URL) for Drive.

Used by data.py (`python data.py download NAME --root DATA`); imports clip (for `clip.stream`) only.
"""

import dataclasses
import hashlib
import html
import os
import re
import shutil
import stat
import sys
import tarfile
import urllib.parse
import urllib.request
import zipfile

import clip

GDRIVE_URL = "https://drive.usercontent.google.com/download"


class DownloadError(Exception):
    """A failed download or a rejected archive; the message says what to do instead."""


@dataclasses.dataclass(frozen=True)
class Source:
    """One file to fetch. Paths are relative to --root."""

    url: str = ""  # plain URL (replaced by --mirror/<file name> when a mirror is given)
    drive: str = ""  # or a Google Drive file id
    # published checksum where known (torchvision's tables); "" = byte-count check only
    md5: str = ""
    extract_to: str = ""  # unpack the archive into this folder ...
    save_as: str = ""  # ... or keep the file under this name
    creates: str = ""  # present after success: the step is skipped when it exists
    move: tuple = ()  # (from, to): rename after unpacking (FGVCAircraft keeps only data/)


# imagenet/classnames.txt on Drive (CoOp DATASETS.md)
CLASSNAMES = "1-61f_ol79pViBFDG_IDlUQSwoLcn2XXF"
VGG = "https://www.robots.ox.ac.uk/~vgg/data"
SOURCES = {
    "eurosat": [
        Source(
            url="https://huggingface.co/datasets/torchgeo/eurosat/resolve/"
            "c877bcd43f099cd0196738f714544e355477f3fd/EuroSAT.zip",
            md5="c8fa014336c82ac7804f0398fcb19387",
            extract_to="eurosat",
            creates="eurosat/2750",
        )
    ],
    "dtd": [
        Source(
            url=f"{VGG}/dtd/download/dtd-r1.0.1.tar.gz",
            md5="fff73e5086ae6bdbea199a49dfb8a4c1",
            extract_to=".",
            creates="dtd/images",
        )
    ],
    "oxford_pets": [
        Source(
            url=f"{VGG}/pets/data/images.tar.gz",
            md5="5c4f3ee8e5d25df40f4fd59a7f44e54c",
            extract_to="oxford_pets",
            creates="oxford_pets/images",
        ),
        Source(
            url=f"{VGG}/pets/data/annotations.tar.gz",
            md5="95a8c909bbe2e81eed6a22bccdf3f68f",
            extract_to="oxford_pets",
            creates="oxford_pets/annotations",
        ),
    ],
    "oxford_flowers": [
        Source(
            url=f"{VGG}/flowers/102/102flowers.tgz",
            md5="52808999861908f626f3c1f4e79d11fa",
            extract_to="oxford_flowers",
            creates="oxford_flowers/jpg",
        ),
        Source(
            url=f"{VGG}/flowers/102/imagelabels.mat",
            md5="e0620be6f572b9609742df49c70aed4d",
            save_as="oxford_flowers/imagelabels.mat",
        ),
        Source(
            drive="1AkcxCXeK_RCGCEC_GvmWxjcjaNhu-at0", save_as="oxford_flowers/cat_to_name.json"
        ),
    ],
    "food101": [
        Source(
            url="http://data.vision.ee.ethz.ch/cvl/food-101.tar.gz",
            md5="85eeb15f3717b99a5da872d97d918f87",
            extract_to=".",
            creates="food-101/images",
        )
    ],
    "fgvc_aircraft": [
        Source(
            url=f"{VGG}/fgvc-aircraft/archives/fgvc-aircraft-2013b.tar.gz",
            extract_to=".",
            creates="fgvc_aircraft/variants.txt",
            move=("fgvc-aircraft-2013b/data", "fgvc_aircraft"),
        )
    ],
    "sun397": [
        Source(
            url="http://vision.princeton.edu/projects/2010/SUN/SUN397.tar.gz",
            md5="8ca2778205c41d23104230ba66911c7a",
            extract_to="sun397",
            creates="sun397/SUN397",
        )
    ],
    "ucf101": [
        Source(
            drive="10Jqome3vtUA2keJkNanAiFpgbyC9Hc2O",
            extract_to="ucf101",
            creates="ucf101/UCF-101-midframes",
        )
    ],
    "imagenet": [Source(drive=CLASSNAMES, save_as="imagenet/classnames.txt")],
    "imagenetv2": [
        Source(
            url="https://s3-us-west-2.amazonaws.com/imagenetv2public/"
            "imagenetv2-matched-frequency.tar.gz",
            extract_to="imagenetv2",
            creates="imagenetv2/imagenetv2-matched-frequency-format-val",
        ),
        Source(drive=CLASSNAMES, save_as="imagenetv2/classnames.txt"),
    ],
    "imagenet_a": [
        Source(
            url="https://people.eecs.berkeley.edu/~hendrycks/imagenet-a.tar",
            extract_to="imagenet-adversarial",
            creates="imagenet-adversarial/imagenet-a",
        ),
        Source(drive=CLASSNAMES, save_as="imagenet-adversarial/classnames.txt"),
    ],
    "imagenet_r": [
        Source(
            url="https://people.eecs.berkeley.edu/~hendrycks/imagenet-r.tar",
            extract_to="imagenet-rendition",
            creates="imagenet-rendition/imagenet-r",
        ),
        Source(drive=CLASSNAMES, save_as="imagenet-rendition/classnames.txt"),
    ],
    "imagenet_sketch": [Source(drive=CLASSNAMES, save_as="imagenet-sketch/classnames.txt")],
}
MANUAL = {  # images that have no stable public URL
    "imagenet": "ImageNet images: from https://image-net.org, "
    "extracted to imagenet/images/{train,val}/<wnid>/",
    "imagenet_sketch": "ImageNet-Sketch images: from "
    "https://github.com/HaohanWang/ImageNet-Sketch, extracted to imagenet-sketch/images/<wnid>/",
    "caltech101": "Caltech101: 101_ObjectCategories.tar.gz from "
    "https://data.caltech.edu/records/mzrjq-6wc02 (inside caltech-101.zip), extracted to "
    "caltech-101/101_ObjectCategories/",
    "stanford_cars": "StanfordCars: cars_train/, cars_test/ (the original links are dead; see CoOp "
    "issue #61) in stanford_cars/",
}


# ----------------------------------------------------------------------------- fetching


def _save(response, dest, md5="", label=""):
    """Stream a response into dest + '.part', check it, then rename to dest."""
    total = int(response.headers.get("Content-Length") or 0)
    part = dest + ".part"
    try:
        with open(part, "wb") as f:
            try:
                done, digest = clip.stream(response, f, hashlib.md5(), label)
            except OSError as e:
                raise DownloadError(f"{label}: {e}; run the command again") from None
        if total and done != total:
            raise DownloadError(
                f"{label}: got {done} bytes, the server announced {total}; the download was "
                f"cut off, run the command again"
            )
        if md5 and digest.hexdigest() != md5:
            raise DownloadError(
                f"{label}: MD5 {digest.hexdigest()} does not match the published {md5}; the file "
                f"is damaged or was changed on the server. Nothing was unpacked."
            )
        os.replace(part, dest)
    finally:
        if os.path.exists(part):
            os.remove(part)
    return dest


def _open(url):
    try:
        return urllib.request.urlopen(
            urllib.request.Request(url, headers={"User-Agent": "dear-data/1"}), timeout=60
        )
    except (OSError, ValueError) as e:  # URLError/HTTPError are OSErrors
        raise DownloadError(
            f"cannot download {url} ({e}); check the connection, or fetch it by hand "
            f"(--mirror points at a copy)"
        ) from None


def fetch_url(url, dest, md5=""):
    with _open(url) as response:
        return _save(response, dest, md5, os.path.basename(dest))


def fetch_drive(file_id, dest, md5="", gdrive_url=None):
    """A Google Drive file with the standard library. Large files answer first with an HTML page
    ("can't scan for viruses"); its form carries the confirm/uuid fields that release the file."""
    base = gdrive_url or os.environ.get("DEAR_GDRIVE_URL") or GDRIVE_URL
    manual = (
        "Fetch it by hand from "
        f"https://drive.google.com/file/d/{file_id}/view and save it as {dest}"
    )
    url = f"{base}?{urllib.parse.urlencode({'id': file_id, 'export': 'download', 'confirm': 't'})}"
    for _ in range(2):
        with _open(url) as response:
            if "text/html" not in response.headers.get("Content-Type", ""):
                return _save(response, dest, md5, os.path.basename(dest))
            page = response.read().decode("utf-8", "replace")
        form = re.search(r'<form[^>]*action="([^"]+)"', page)
        fields = dict(
            re.findall(r'<input[^>]*type="hidden"[^>]*name="([^"]+)"[^>]*value="([^"]*)"', page)
        )
        if not form or "id" not in fields:
            break
        action = urllib.parse.urljoin(url, html.unescape(form.group(1)))
        url = f"{action}?{urllib.parse.urlencode({k: html.unescape(v) for k, v in fields.items()})}"
    raise DownloadError(
        f"Google Drive did not hand out file {file_id} (quota or region block). {manual}"
    )


# ----------------------------------------------------------------------------- safe extraction
# Every member is checked by name, before anything is written, against rules that need no file on
# disk: the archive is unpacked into a new, empty folder, so only the archive itself says where a
# path leads.


def _inside(target, path):
    """Whether path lies in the folder target (a component-wise test:
    /data/xy is not inside /data/x)."""
    target = os.path.realpath(target)
    path = os.path.realpath(path)
    return path == target or path.startswith(target + os.sep)


def _resolve(name, base, links):
    """Follow `name` from the folder `base` (components inside the target) by name alone.

    Returns (components it lands on, "") or (None, why it is refused): an absolute name, '..'
    climbing above the target, or a step through one of the archive's own links (`links`, whose
    targets are not on disk until extraction, so a path through them could lead anywhere). The last
    component may be a link."""
    if name.startswith(("/", "\\")) or os.path.isabs(name):
        return None, "has an absolute path"
    parts, steps = list(base), [c for c in name.split("/") if c not in ("", ".")]
    for i, step in enumerate(steps):
        if step == "..":
            if not parts:
                return None, "climbs out of the target folder with '..'"
            parts.pop()
            continue
        parts.append(step)
        if i + 1 < len(steps) and "/".join(parts) in links:
            return None, f"goes through the link {'/'.join(parts)} of the same archive"
    return parts, ""


def _check_members(archive, target, members):
    """members: (name, kind, link target) with kind file | dir | symlink | hardlink | other.
    Raises DownloadError on the first member that could write or point outside target."""
    links = {
        "/".join(c for c in name.split("/") if c not in ("", "."))
        for name, kind, _ in members
        if kind in ("symlink", "hardlink")
    }
    for name, kind, linkname in members:
        parts, why = _resolve(name, (), links)
        if why:
            raise DownloadError(
                f"{archive}: member {name} {why}; refusing to unpack (nothing was written)"
            )
        if (not parts and kind != "dir") or not _inside(
            target, os.path.join(target, *parts)
        ):  # "./" is fine
            raise DownloadError(
                f"{archive}: member {name} would land outside {target}; refusing to unpack"
            )
        if kind in ("symlink", "hardlink"):
            # a symlink is read from its folder, a hard link from the top
            base = parts[:-1] if kind == "symlink" else ()
            where, why = _resolve(linkname, base, links | {"/".join(parts)})
            if why or (kind == "hardlink" and not where):
                raise DownloadError(
                    f"{archive}: link {name} -> {linkname} {why or 'names no file'}; refusing to "
                    f"unpack (nothing was written)"
                )
        elif kind == "other":
            raise DownloadError(f"{archive}: member {name} is a device or pipe; refusing to unpack")


def safe_extract(archive, target):
    """Unpack a zip or tar archive into target after checking every member (`_check_members`): no
    absolute names, no '..' out of target, no links (zip: none at all; tar: only to members inside,
    never through another link), no device files. A refused archive writes nothing."""
    try:
        if zipfile.is_zipfile(archive):
            with zipfile.ZipFile(archive) as z:
                for info in z.infolist():
                    if stat.S_ISLNK(
                        info.external_attr >> 16
                    ):  # unpacked as a plain file, so never right
                        raise DownloadError(
                            f"{archive}: member {info.filename} is "
                            "a symbolic link; refusing to unpack"
                        )
                _check_members(
                    archive,
                    target,
                    [(i.filename, "dir" if i.is_dir() else "file", "") for i in z.infolist()],
                )
                os.makedirs(target, exist_ok=True)
                z.extractall(target)
            return
        if not tarfile.is_tarfile(archive):
            raise DownloadError(
                f"{archive} is neither a zip nor a tar archive; delete it and download again"
            )
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            kinds = [
                (
                    m.name,
                    "symlink"
                    if m.issym()
                    else "hardlink"
                    if m.islnk()
                    else "file"
                    if m.isfile()
                    else "dir"
                    if m.isdir()
                    else "other",
                    m.linkname,
                )
                for m in members
            ]
            _check_members(archive, target, kinds)
            os.makedirs(target, exist_ok=True)
            # the stdlib's own guard as a second line of defence
            tar.extractall(target, filter="data")
    except (
        tarfile.TarError,
        zipfile.BadZipFile,
        EOFError,
    ) as e:  # a damaged archive, or the stdlib's guard
        raise DownloadError(
            f"{archive}: cannot unpack it ({e}); delete it and download again"
        ) from None


def _merge(src, dst):
    """Move the tree src into dst: a path dst lacks arrives in one rename (so it appears complete or
    not at all); folders present on both sides are merged, files replaced."""
    if not os.path.lexists(dst):
        os.replace(src, dst)
    elif os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(dst):
        for entry in sorted(os.listdir(src)):
            _merge(os.path.join(src, entry), os.path.join(dst, entry))
    elif os.path.isdir(src) or os.path.isdir(dst):
        raise DownloadError(
            f"{dst} is in the way of the unpacked {os.path.basename(src)}; move it aside and rerun"
        )
    else:
        os.replace(src, dst)


# ----------------------------------------------------------------------------- one dataset


def fetch_source(src, root, mirror=None, gdrive_url=None):
    if src.creates and os.path.exists(os.path.join(root, src.creates)):
        print(f"present: {os.path.join(root, src.creates)}", file=sys.stderr)
        return
    url = src.url
    if url and mirror:
        url = mirror.rstrip("/") + "/" + os.path.basename(urllib.parse.urlparse(url).path)
    if src.save_as:
        dest = os.path.join(root, src.save_as)
        if os.path.exists(dest):
            print(f"present: {dest}", file=sys.stderr)
            return
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        if src.drive:
            fetch_drive(src.drive, dest, src.md5, gdrive_url)
        else:
            fetch_url(url, dest, src.md5)
        return
    name = os.path.basename(urllib.parse.urlparse(url).path) if url else f"drive-{src.drive}"
    archive = os.path.join(root, ".downloads", name)
    os.makedirs(os.path.dirname(archive), exist_ok=True)
    if src.drive:
        fetch_drive(src.drive, archive, src.md5, gdrive_url)
    else:
        fetch_url(url, archive, src.md5)
    target = os.path.join(root, src.extract_to)
    # unpacked here first, so a cut-off unpack never looks finished
    unpacking = archive + ".unpacking"
    shutil.rmtree(unpacking, ignore_errors=True)  # what an interrupted run left
    print(f"unpacking {name} into {target}", file=sys.stderr)
    safe_extract(archive, unpacking)
    if src.move:  # (from, to) relative to root; `from` lies in what was unpacked
        inner = os.path.relpath(os.path.join(root, src.move[0]), target)
        os.makedirs(os.path.dirname(os.path.join(root, src.move[1])), exist_ok=True)
        _merge(os.path.join(unpacking, inner), os.path.join(root, src.move[1]))
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    _merge(unpacking, target)
    shutil.rmtree(unpacking, ignore_errors=True)
    os.remove(archive)  # unpacked: the archive is no longer needed


def download_dataset(spec, root, mirror=None, gdrive_url=None, sources=None):
    """Fetch what has a public URL for one dataset (images, split JSON, extra files);
    say what is manual."""
    if spec.reader == "toyworld":
        print(
            "toyworld needs no download: make it with  python toyworld.py dataset --root DATA",
            file=sys.stderr,
        )
        return
    sources = SOURCES if sources is None else sources
    root = os.path.abspath(os.path.expanduser(str(root)))
    os.makedirs(root, exist_ok=True)
    steps = list(sources.get(spec.name, []))
    if spec.drive:  # the split JSON of CoOp (Zhou et al.)
        steps.append(Source(drive=spec.drive, save_as=os.path.join(spec.folder, spec.split)))
    if not steps and spec.name not in MANUAL:
        raise DownloadError(
            f"no download is known for {spec.name}; see "
            f"https://github.com/KaiyangZhou/CoOp/blob/main/DATASETS.md"
        )
    for src in steps:
        fetch_source(src, root, mirror, gdrive_url)
    if spec.name in MANUAL:
        print(f"by hand: {MANUAL[spec.name]} (under {root})", file=sys.stderr)
    print(f"done: check with  python data.py check {spec.name} --root {root}", file=sys.stderr)
