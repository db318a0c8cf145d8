"""Reading the aclImdb dataset as Stanford ships it: the extracted folder (train/test x pos/neg, one review
per file) or aclImdb_v1.tar.gz, in the BLOOM article's order (test/pos, test/neg, train/pos, train/neg,
each by sorted file name), as frames of id, text and label (pos 1, neg 0).

Its 50,000 files are many small reads: the folder is read by joblib threads (file reads release the GIL);
a gzipped tarball is decompressed by one thread while another walks the tar stream. Either way the rows
are exactly those of a serial read (bench/parallel_cpu.py measures both).
"""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from stages.engine.errors import MissingInputError
from stages.engine.parallel import map_chunks, n_jobs

PARALLEL_MIN_FILES = 2000  # fewer review files are read serially (starting workers costs more)


def read_texts(paths: Sequence[Path]) -> list[str]:
    return [Path(f).read_text(encoding="utf-8") for f in paths]


def read_folder(root: Path, jobs: int | None = None) -> dict[str, pd.DataFrame]:
    """The 50k review files, read by joblib threads (file reads release the GIL), in aclImdb order."""
    listing: list[tuple[str, int, Path]] = []
    for split in ("test", "train"):
        for label_name, label in (("pos", 1), ("neg", 0)):
            folder = root / split / label_name
            if not folder.is_dir():
                raise MissingInputError(f"{root}: aclImdb folder lacks {split}/{label_name}; point data.path at "
                                        f"the extracted aclImdb folder")
            listing += [(f"{split}/{label_name}/{f}", label, folder / f) for f in sorted(os.listdir(folder))]
    texts = map_chunks(read_texts, [p for _, _, p in listing], jobs=jobs, min_items=PARALLEL_MIN_FILES,
                       prefer="threads")
    frames = {}
    for split in ("test", "train"):
        rows = [(i, t, label) for (i, label, _), t in zip(listing, texts, strict=True) if i.startswith(split + "/")]
        frames[split] = pd.DataFrame(rows, columns=["id", "text", "label"])
    return frames


def _acl_members(stream: Any) -> list[tuple[str, str, str, str]]:
    """(split, pos|neg, file name, text) of every aclImdb/{train,test}/{pos,neg}/*.txt member of an
    uncompressed tar stream, read front to back."""
    out = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.isfile() and len(parts) == 4 and parts[1] in ("train", "test") and parts[2] in ("pos", "neg"):
                # the stream stands at the member's data: read it directly (a third of the walk's time
                # went to extractfile's file object per member); extractfile when it does not
                if tar.fileobj.tell() == m.offset_data:
                    data = tar.fileobj.read(m.size)
                else:
                    data = tar.extractfile(m).read()  # type: ignore[union-attr]
                out.append((parts[1], parts[2], parts[3], data.decode("utf-8")))
    return out


def _gunzip_into(path: Path, fd: int) -> None:
    with gzip.open(path) as src, os.fdopen(fd, "wb", buffering=1 << 20) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def _read_tar_members(path: Path, jobs: int | None = None) -> list[tuple[str, str, str, str]]:
    """A gzipped tarball is decompressed by one joblib thread (zlib releases the GIL) while another walks
    the tar stream; the members come out in the same order as a serial read."""
    gzipped = _is_gzip(path)
    if not gzipped or n_jobs(jobs) == 1:
        with (gzip.open(path) if gzipped else open(path, "rb")) as f:
            return _acl_members(f)
    from joblib import Parallel, delayed

    r, w = os.pipe()
    reader = os.fdopen(r, "rb", buffering=1 << 20)

    def walk() -> list[tuple[str, str, str, str]]:
        try:
            members = _acl_members(reader)
            while reader.read(1 << 20):  # the tar's end padding: the other thread writes until the gzip ends
                pass
            return members
        finally:
            reader.close()  # a failed walk stops the decompressing thread (broken pipe) instead of blocking it

    # a failure of either thread is raised here: a corrupt gzip never passes for a shorter tar
    _, members = Parallel(n_jobs=2, prefer="threads")([delayed(_gunzip_into)(path, w), delayed(walk)()])
    return members


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def read_tarball(path: Path, jobs: int | None = None) -> dict[str, pd.DataFrame]:
    texts: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for split, label_name, name, text in _read_tar_members(path, jobs):
        texts.setdefault((split, label_name), []).append((name, text))
    frames = {}
    for split in ("test", "train"):
        rows = []
        for label_name, label in (("pos", 1), ("neg", 0)):
            for f, text in sorted(texts.get((split, label_name), [])):
                rows.append((f"{split}/{label_name}/{f}", text, label))
        frames[split] = pd.DataFrame(rows, columns=["id", "text", "label"])
    if not any(len(f) for f in frames.values()):
        raise MissingInputError(f"{path}: no aclImdb/{{train,test}}/{{pos,neg}}/*.txt members; is it aclImdb_v1.tar.gz?")
    return frames
