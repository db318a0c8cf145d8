"""Corruption stops where it is found: a stage about to compute checks the sha256 of every upstream file it
reads (through the hash memo), so a same-size flipped byte upstream is one line naming the artifact and the
fix, nothing is committed from it, and --verify recomputes it; `inspect verify` lists (and quarantines) every
corrupt artifact, exit 1."""

from __future__ import annotations

import helpers
import pytest
from helpers import computed, needs_shared_data

from flows.reports.inspect_cli import main as inspect_main
from stages.engine import fingerprint
from stages.engine.errors import CorruptArtifactError
from stages.engine.store import Store

pytestmark = needs_shared_data
SMALL = ("data.subset={train: 40, validation: 8, test: 8}",)


def flip(path) -> None:
    blob = bytearray(path.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # same size: the quick (size) check passes
    path.write_bytes(bytes(blob))


def test_a_flipped_byte_upstream_stops_the_computing_stage_and_verify_recomputes_it(store_dir):
    first = helpers.run("tiny-imdb", *SMALL, until="tokenize")
    flip(first["data"].path / "train.arrow")
    with pytest.raises(CorruptArtifactError, match=(
            rf"^tokenize: its upstream data artifact {first['data'].key[:12]} is corrupt \(train.arrow: sha256 "
            r"mismatch\); nothing was computed from it. Run again with --verify to recompute it")):
        helpers.run("tiny-imdb", *SMALL, "tokenize.max_length=64", until="tokenize")
    store = Store(store_dir)
    assert [(s, k) for s, k, _ in store.entries() if s == "tokenize"] == [("tokenize", first["tokenize"].key)]
    assert computed(helpers.run("tiny-imdb", *SMALL, "tokenize.max_length=64", until="tokenize",
                                verify=True)) == {"data", "tokenize"}


def test_inspect_verify_lists_corrupt_artifacts_exit_1_and_quarantines_them(store_dir, capsys):
    first = helpers.run("tiny-imdb", *SMALL, until="tokenize")
    assert inspect_main(["verify"]) == 0
    assert "2 artifacts verified, every file matches its manifest" in capsys.readouterr().out
    flip(first["tokenize"].path / "dataset" / "train" / "data-00000-of-00001.arrow")  # one token id, or near it
    assert inspect_main(["verify"]) == 1
    out = capsys.readouterr().out
    assert f"tokenize  {first['tokenize'].key[:12]}  dataset/train/data-00000-of-00001.arrow: sha256 mismatch" \
        in out, out
    assert "1 of 2 artifacts corrupt" in out
    assert inspect_main(["verify", "--quarantine"]) == 1
    assert "moved to .quarantine/" in capsys.readouterr().out
    assert [s for s, _, _ in Store(store_dir).entries()] == ["data"]
    assert computed(helpers.run("tiny-imdb", *SMALL, until="tokenize")) == {"tokenize"}
    assert inspect_main(["verify"]) == 0


def test_the_upstream_check_rereads_nothing_a_run_just_committed(store_dir, monkeypatch):
    """The commit remembers each file's hash in the memo (computed for the manifest), so the next stage's
    check costs a stat per upstream file, not a read."""
    hashed: list[str] = []
    real = fingerprint.file_sha256
    monkeypatch.setattr(fingerprint, "file_sha256", lambda p: hashed.append(str(p)) or real(p))
    out = helpers.run("tiny-imdb", *SMALL, until="tokenize")
    data = str(out["data"].path)
    assert not [p for p in hashed if p.startswith(data)], hashed
    flip(out["data"].path / "train.arrow")  # and a change is still seen: its stat changed
    with pytest.raises(CorruptArtifactError):
        helpers.run("tiny-imdb", *SMALL, "tokenize.max_length=64", until="tokenize")
    assert [p for p in hashed if p.startswith(data)] == [str(out["data"].path / "train.arrow")]
