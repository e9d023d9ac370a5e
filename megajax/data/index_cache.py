"""On-disk cache for index arrays (GPT document/sample/shuffle indices, blending indices, data checks).

An entry is a few .npy files plus a JSON manifest, all named by a hash of the description of their inputs
(data fingerprint, sample count, sequence length, seed, ...), so a change of any input is a miss. Writes
are atomic (temporary file, then rename; the manifest last) and the manifest holds a CRC of every array:
an entry that is incomplete, truncated or altered is rebuilt, never trusted. Several processes building
the same entry at once each write identical bytes, and the last rename wins.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np

log = logging.getLogger("megajax.data")


def describe(description: dict) -> str:
    """A stable hash of a description (JSON with sorted keys)."""
    text = json.dumps(description, sort_keys=True, default=str)
    return hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()


def digest(array: np.ndarray) -> str:
    """A fingerprint of an array's contents (for data the indices depend on)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str((array.dtype.str, array.shape)).encode())
    flat = np.ascontiguousarray(array).reshape(-1)
    step = 1 << 24
    for lo in range(0, flat.size, step):
        h.update(flat[lo: lo + step].tobytes())
    return h.hexdigest()


def _crc(array: np.ndarray) -> int:
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    crc, step = 0, 1 << 26
    for lo in range(0, flat.size, step):
        crc = zlib.crc32(flat[lo: lo + step], crc)
    return crc


class IndexCache:
    """Entries are looked up in each of `dirs` in order and saved in the first one that is writable."""

    def __init__(self, dirs: Sequence[str | os.PathLike]):
        self.dirs = [Path(d) for d in dirs]

    def _paths(self, folder: Path, stem: str, names: Sequence[str]) -> tuple[Path, dict[str, Path]]:
        return folder / f"{stem}-manifest.json", {n: folder / f"{stem}-{n}.npy" for n in names}

    def load(self, stem: str, description: dict, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The arrays of a valid entry (memory-mapped), or None (missing, stale or corrupt: rebuild)."""
        for folder in self.dirs:
            manifest, paths = self._paths(folder, stem, names)
            if not manifest.is_file():
                continue
            try:
                meta = json.loads(manifest.read_text())
                if meta.get("description") != json.loads(json.dumps(description, default=str)):
                    raise ValueError("description differs")
                arrays = {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}
                for n, a in arrays.items():
                    if _crc(a) != meta["crc"][n] or list(a.shape) != meta["shape"][n]:
                        raise ValueError(f"{paths[n].name} does not match its checksum")
                return arrays
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("index cache %s is unusable (%s): rebuilding it", manifest, e)
        return None

    def save(self, stem: str, description: dict, arrays: dict[str, np.ndarray]) -> Path | None:
        """Writes an entry into the first writable folder; returns its manifest path (None: nowhere)."""
        for folder in self.dirs:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                manifest, paths = self._paths(folder, stem, list(arrays))
                for n, a in arrays.items():
                    _atomic(paths[n], lambda f, a=a: np.save(f, a, allow_pickle=False))
                meta = {"description": description, "crc": {n: _crc(a) for n, a in arrays.items()},
                        "shape": {n: list(a.shape) for n, a in arrays.items()}}
                text = json.dumps(meta, indent=1, default=str).encode()
                _atomic(manifest, lambda f: f.write(text))
                return manifest
            except OSError as e:
                log.info("cannot write the index cache in %s (%s); trying the next place", folder, e)
        log.warning("no writable index cache directory among %s: indices will be rebuilt next time",
                    [str(d) for d in self.dirs])
        return None


def _atomic(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
