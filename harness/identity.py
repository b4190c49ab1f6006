"""What a run ran on, by content: its inputs' fingerprints, and where it stands against its recipe.

The launcher writes ``identity.json`` into the run directory before any worker starts (:func:`run_identity`):

* ``data``: per input setting (``data.dir``, ``validation.dir``, ``data.train_file``, ...), a fingerprint of what
  that setting names (the pipeline's ``fingerprint``: :func:`cifar10.data.fingerprint` and the others): its
  layout, its size (``counts``: examples, classes), a ``digest`` of its content, the published data set it is
  where its content matches that set's published digests (``dataset``: CIFAR-10, SQuAD v1.1, ImageNet-1k), and
  the ``name`` a page gives it;
* ``recipe``: the experiment the run was composed from and the computed settings in which it departs from that
  experiment's recipe (:func:`harness.recipe.departures`; none: the run is at the recipe's size).

A run's identity (:func:`harness.records.configuration`) is its resolved config less the seed, the operational
settings and the inputs' paths, plus its inputs' digests: the same data in two folders is one configuration, two
data sets in one folder are two.

A fingerprint is made once per input and kept beside it (``.slamb-fingerprint-<name>.json`` in its folder, or
under ``$XDG_CACHE_HOME/slamb/fingerprints`` where that folder is read-only), with the names, sizes and
modification times of the files (or folders) it was made from; it is made again when one of them changes.
The small sets are hashed whole (CIFAR-10's 180 MB, SQuAD's 40 MB); a tree of a million images is listed
(names and sizes), never read; BERT's shards are hashed at their ends.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Iterable

from .atomic import atomic_write_json

FILE = "identity.json"
VERSION = 1  # of the fingerprints: a kept one of another version is made again
CHUNK = 1 << 20


def md5_file(path: Path) -> str:
    """The MD5 of a file's bytes: the digest data sets publish (torchvision's CIFAR-10, SQuAD's files)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "md5").hexdigest()


def ends_digest(path: Path, size: int = CHUNK) -> str:
    """sha256 of a file's length and its first and last ``size`` bytes: a large file told apart without reading
    it whole (BERT's shards: their examples differ from the first bytes on)."""
    h = hashlib.sha256()
    length = path.stat().st_size
    h.update(str(length).encode())
    with open(path, "rb") as f:
        h.update(f.read(size))
        if length > size:
            f.seek(max(size, length - size))
            h.update(f.read(size))
    return h.hexdigest()


def digest_of(parts) -> str:
    """sha256 of a JSON-able value, its keys sorted: the digest of a list of files' digests or of a manifest."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _signature(paths: Iterable[Path], anchor: Path) -> list:
    out = []
    for p in paths:
        st = p.stat()
        out.append([os.path.relpath(p, anchor), st.st_size if p.is_file() else 0, st.st_mtime_ns])
    return out


def _kept_at(anchor: Path, name: str) -> list[Path]:
    """Where the fingerprint of input ``name`` at ``anchor`` (a folder) is kept: in the folder, else in the user's
    cache."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slamb" / "fingerprints"
    key = hashlib.sha256(f"{anchor.resolve()}\0{name}".encode()).hexdigest()[:24]
    return [anchor / f".slamb-fingerprint-{name}.json", base / f"{key}.json"]


def kept(anchor: Path, name: str, watched: Iterable[Path], make: Callable[[], dict]) -> dict:
    """``make()``'s fingerprint of input ``name`` in folder ``anchor``, kept there and made again where one of the
    ``watched`` paths (the files it reads, or the folders whose listing it is) changed name, size or time."""
    anchor = Path(anchor)
    signature = _signature(sorted(watched), anchor)
    places = _kept_at(anchor, name)
    for place in places:
        try:
            record = json.loads(place.read_text())
        except (OSError, ValueError):
            continue
        if record.get("version") == VERSION and record.get("signature") == signature:
            return record["fingerprint"]
    fingerprint = make()
    for place in places:
        try:
            place.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json({"version": VERSION, "signature": signature, "fingerprint": fingerprint}, place)
            break
        except OSError:  # a read-only data folder: the user's cache
            continue
    return fingerprint


def count(n: int, what: str) -> str:
    """``n`` things: "1 shard", "2 shards", "10 classes"."""
    return f"{n:,} {what}" if n == 1 else f"{n:,} {what}{'es' if what.endswith('s') else 's'}"


def run_identity(fingerprints: dict[str, dict], recipe: dict | None) -> dict:
    """The record ``identity.json`` holds (see the module's doc)."""
    return {"data": fingerprints, "recipe": recipe}


def data_digest(identity: dict | None) -> str | None:
    """One digest of every input of a run (None for a run recorded before fingerprints)."""
    if not identity or not identity.get("data"):
        return None
    return digest_of({k: v["digest"] for k, v in identity["data"].items()})


def data_names(identity: dict | None) -> list[str]:
    """What a run read, as a page names it (``[]`` for a run recorded before fingerprints)."""
    if not identity or not identity.get("data"):
        return []
    return [f"{fp['name']}, digest {fp['digest'][:12]}" for fp in identity["data"].values()]


def load(run_dir) -> dict | None:
    path = Path(run_dir) / FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def save(run_dir, identity: dict) -> None:
    atomic_write_json(identity, Path(run_dir) / FILE)


def check_same_data(saved: dict | None, current: dict, where) -> None:
    """Refuse to continue (or call finished) the run in ``where``, recorded on ``saved`` data, on other data
    under the same settings: the paths may agree while the content does not (a folder written again)."""
    if not saved or not saved.get("data"):
        return  # recorded before fingerprints: its paths were checked (harness.checkpoint.check_inputs)
    for key in sorted(set(saved["data"]) | set(current["data"])):
        old, new = saved["data"].get(key), current["data"].get(key)
        if (old or {}).get("digest") != (new or {}).get("digest"):
            raise ValueError(
                f"the run in {where} was trained on {key} = {old['name'] if old else 'nothing'} (digest "
                f"{old['digest'][:12] if old else '-'}), and {key} now holds {new['name'] if new else 'nothing'} "
                f"(digest {new['digest'][:12] if new else '-'}): resuming would mix two data sets under one run. "
                f"Point {key} at the run's data again, or start this run over with trainer.resume=never "
                "(or another run directory)")
