"""joblib work: results in input order, identical to the serial path."""

from __future__ import annotations

import hashlib

from stages.engine.fingerprint import HashMemo, sha256_many
from stages.engine.parallel import chunked, map_chunks, n_jobs


def squares(xs):
    return [x * x for x in xs]


def test_chunks_cover_every_item_once_in_order():
    for n, parts, sizes in ((10, 3, [4, 3, 3]), (3, 8, [1, 1, 1]), (1, 1, [1]), (100, 7, [15] * 2 + [14] * 5)):
        cut = chunked(list(range(n)), parts)
        assert [x for part in cut for x in part] == list(range(n))
        assert [len(part) for part in cut] == sizes
    assert chunked([], 4) == [[]]


def test_map_chunks_in_worker_processes_equals_the_serial_result(monkeypatch):
    items = list(range(1000))
    assert map_chunks(squares, items, jobs=2) == squares(items) == map_chunks(squares, items, jobs=1)
    monkeypatch.setenv("FINETUNE_JOBS", "3")
    assert n_jobs() == 3 and n_jobs(1) == 1


def test_many_files_hash_in_threads_to_the_serial_digests(tmp_path):
    paths = []
    for i in range(150):
        p = tmp_path / f"f{i:03d}.bin"
        p.write_bytes(bytes([i % 251]) * (i * 997))
        paths.append(p)
    expected = [hashlib.sha256(p.read_bytes()).hexdigest() for p in paths]
    assert sha256_many(paths, HashMemo(), jobs=2) == expected
    assert sha256_many(paths, HashMemo(), jobs=1) == expected
