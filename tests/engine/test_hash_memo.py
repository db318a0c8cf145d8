"""Input-file hashes are remembered across processes (the store's .state/hashes.sqlite): an unchanged file
is not read again; a change to its bytes, mtime or ctime re-hashes it."""

from __future__ import annotations

import hashlib
import os

import pytest

from stages.engine import fingerprint
from stages.engine.fingerprint import HashMemo, inputs_digest
from stages.engine.store import Store


@pytest.fixture
def reads(monkeypatch):
    """Paths whose bytes were read to hash them."""
    seen: list[str] = []
    real = fingerprint.file_sha256

    def counting(path):
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(fingerprint, "file_sha256", counting)
    return seen


def test_a_fresh_process_reads_no_unchanged_file(tmp_path, reads):
    folder = tmp_path / "model"
    folder.mkdir()
    for i in range(3):
        (folder / f"shard{i}.safetensors").write_bytes(os.urandom(1000 + i))
    db = tmp_path / "store" / ".state" / "hashes.sqlite"
    first = inputs_digest([folder], HashMemo(db))
    assert sorted(reads) == ["shard0.safetensors", "shard1.safetensors", "shard2.safetensors"]
    assert first["model/shard1.safetensors"] == hashlib.sha256((folder / "shard1.safetensors").read_bytes()).hexdigest()
    reads.clear()
    assert inputs_digest([folder], HashMemo(db)) == first  # a new memo object: as a new process would
    assert reads == []


def test_any_stat_change_rehashes(tmp_path, reads):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"a" * 4096)
    db = tmp_path / "memo.sqlite"
    before = HashMemo(db).sha256(f)
    st = f.stat()
    f.write_bytes(b"b" * 4096)  # same size; put the old mtime back: only ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    reads.clear()
    after = HashMemo(db).sha256(f)
    assert reads == ["weights.bin"] and after != before
    assert after == hashlib.sha256(b"b" * 4096).hexdigest()
    reads.clear()
    os.utime(f)  # a touch: same bytes, new mtime -> read again, same hash
    assert HashMemo(db).sha256(f) == after and reads == ["weights.bin"]


def test_the_store_keeps_its_memo(tmp_path):
    store = Store(tmp_path / "store")
    f = tmp_path / "x.txt"
    f.write_text("x")
    store.hashes().sha256(f)
    assert (tmp_path / "store" / ".state" / "hashes.sqlite").is_file()
    assert [e for e in store.entries()] == []  # the memo is not an artifact


@pytest.mark.parametrize("garbage", [b"not a database " * 300, b"SQLite format 3\x00" + bytes(4000)],
                         ids=["random", "damaged-header"])
def test_a_garbage_memo_is_moved_aside_with_a_warning_and_rebuilt(tmp_path, reads, caplog, garbage):
    db = tmp_path / ".state" / "hashes.sqlite"
    db.parent.mkdir()
    db.write_bytes(garbage)
    f = tmp_path / "x.txt"
    f.write_text("x")
    with caplog.at_level("WARNING", logger="finetune"):
        assert HashMemo(db).sha256(f) == hashlib.sha256(b"x").hexdigest()
    assert [r.getMessage() for r in caplog.records] == [
        f"{db}: unreadable (file is not a database); moved aside to hashes.sqlite.corrupt and started afresh "
        f"(hashes are recomputed once)"]
    assert (tmp_path / ".state" / "hashes.sqlite.corrupt").read_bytes() == garbage
    HashMemo(db).sha256(f)  # rebuilt: a fresh process reads nothing again
    assert reads == ["x.txt"]


def test_build_output_beside_sources_is_in_no_key(tmp_path):
    module = tmp_path / "accuracy"
    module.mkdir()
    (module / "accuracy.py").write_text("x = 1\n")
    before = inputs_digest([module])
    (module / "__pycache__").mkdir()
    (module / "__pycache__" / "accuracy.cpython-311.pyc").write_bytes(b"\x00compiled")
    (module / "stale.pyc").write_bytes(b"\x00")
    assert inputs_digest([module]) == before == {"accuracy/accuracy.py": hashlib.sha256(b"x = 1\n").hexdigest()}
    (module / "accuracy.py").write_text("x = 2\n")
    assert inputs_digest([module]) != before


def test_code_fingerprints_are_remembered_per_machine_not_per_store(tmp_path, monkeypatch):
    """A worker on a fresh cache or a new store does not walk the code again: the fingerprints live in
    ~/.cache/finetune-code, keyed by the checkout's source files; an unwritable home keeps them in memory."""
    from stages.graph import GRAPH
    from stages.pipeline.loading import load_pipeline

    walks: list[int] = []
    real = fingerprint.code_fingerprint
    monkeypatch.setattr(fingerprint, "code_fingerprint", lambda *a, **k: walks.append(1) or real(*a, **k))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    cfg = load_pipeline("tiny-imdb", [])
    monkeypatch.setattr(fingerprint, "_CODE_MEMO", [])  # as a new process would start
    first = {i.name: i.key.key for i in GRAPH.plan(cfg, Store(tmp_path / "store-a")).items}
    assert len(walks) == len(GRAPH.names)
    assert (tmp_path / "home" / ".cache" / "finetune-code" / "fingerprints.sqlite").is_file()
    monkeypatch.setattr(fingerprint, "_CODE_MEMO", [])
    again = {i.name: i.key.key for i in GRAPH.plan(cfg, Store(tmp_path / "store-b")).items}
    assert again == first and len(walks) == len(GRAPH.names)  # another store, another process: no walk

    (tmp_path / "file-home").write_text("")  # a home that is a file: nothing can be written under it
    monkeypatch.setenv("HOME", str(tmp_path / "file-home"))
    monkeypatch.setattr(fingerprint, "_CODE_MEMO", [])
    assert {i.name: i.key.key for i in GRAPH.plan(cfg, Store(tmp_path / "store-c")).items} == first
    assert len(walks) == 2 * len(GRAPH.names)
