"""The store's seam: a third backend, written here (a dict of bytes), gets the whole cache from the one `Store`
(compute, hit, verify, gc) without a line of the engine changed, on a two-stage graph of file-writing
bodies (no torch)."""

from __future__ import annotations

from pathlib import Path

from helpers import as_graph, run_pipeline

from stages.engine.stage import Stage
from stages.engine.status import find_garbage, remove_garbage
from stages.engine.store import Store
from stages.pipeline.loading import load_pipeline


class DictBackend:
    """Objects as bytes in a dict, keyed by path: what a new backend implements (stages/engine/backends.py)."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.logs: dict[str, list[bytes]] = {}

    def _under(self, path: str) -> dict[str, bytes]:
        prefix = f"{path}/" if path else ""
        return {k[len(prefix):]: v for k, v in self.objects.items() if k.startswith(prefix)}

    def local_path(self, path: str) -> None:
        return None

    def url(self, path: str = "") -> str:
        return f"dict://{path}"

    def exists(self, path: str) -> bool:
        return not path or path in self.objects or bool(self._under(path))

    def read(self, path: str) -> bytes | None:
        return self.objects.get(path)

    def write(self, path: str, data: bytes, create: bool = False) -> None:
        if create and path in self.objects:
            raise FileExistsError(path)
        self.objects[path] = data

    def append(self, log: str, line: bytes) -> None:
        self.logs.setdefault(log, []).append(line)

    def lines(self, log: str) -> list[bytes]:
        return list(self.logs.get(log, []))

    def files(self, path: str) -> dict[str, int]:
        return {k: len(v) for k, v in self._under(path).items()}

    def folders(self, path: str) -> list[str]:
        return sorted({k.split("/", 1)[0] for k in self._under(path) if "/" in k})

    def get_file(self, path: str, dest: Path) -> None:
        dest.write_bytes(self.objects[path])

    def put_file(self, src: Path, path: str, create: bool = False) -> None:
        self.write(path, src.read_bytes(), create)

    def remove(self, path: str) -> None:
        for k in [path, *(f"{path}/{k}" for k in self._under(path))]:
            self.objects.pop(k, None)

    def move(self, src: str, dst: str) -> None:
        for k, v in self._under(src).items():
            self.objects[f"{dst}/{k}"] = v
        self.remove(src)

    def lease(self, path: str, what: str, keys: list[tuple[str, str]] | None = None) -> None:
        return None

    def unwritable(self) -> None:
        return None

    def transfers(self) -> None:
        return None


def body_a(ctx) -> dict:
    (ctx.out_dir / "a.txt").write_text("a")
    return {}


def body_b(ctx) -> dict:
    (ctx.out_dir / "b.txt").write_text("b<" + (ctx.upstream["data"] / "a.txt").read_text())
    return {"chars": 3}


GRAPH = as_graph([Stage(name="data", body=body_a, reads=("data",)),
                  Stage(name="tokenize", body=body_b, reads=("tokenize",), upstream=("data",))])


def test_a_dict_backend_gets_the_whole_cache_from_the_one_store(tmp_path):
    cfg, objects = load_pipeline("tiny-imdb", []), DictBackend()
    store = Store(objects, cache=tmp_path / "machine-1")
    first = {o.stage: o for o in run_pipeline(cfg, store, GRAPH)}
    assert [o.computed for o in first.values()] == [True, True]
    keys = {s: o.key for s, o in first.items()}
    assert objects.read(f"tokenize/{keys['tokenize']}/b.txt") == b"b<a"  # committed as objects, manifest included
    assert f"tokenize/{keys['tokenize']}/manifest.json" in objects.objects
    assert store.refs("tiny-imdb") == keys and [e["event"] for e in store.events()] == ["computed", "computed"]

    # another machine (an empty local cache): both hits, decided from manifests, nothing downloaded
    other = Store(objects, cache=tmp_path / "machine-2")
    again = run_pipeline(cfg, other, GRAPH)
    assert [o.computed for o in again] == [False, False] and not any(o.path.exists() for o in again)
    assert other.verify_all(full=True) == {}  # downloads, then hashes every file

    objects.objects[f"data/{keys['data']}/a.txt"] = b"x"  # same size, other content
    assert Store(objects, cache=tmp_path / "machine-3").verify_all(full=True) == {
        f"data/{keys['data']}": ["a.txt: sha256 mismatch"]}

    garbage = remove_garbage(other, find_garbage(other, keep={("tokenize", keys["tokenize"])}))
    assert {(g.kind, g.stage) for g in garbage if g.removed} == {("artifact", "data")}
    assert other.problems("data", keys["data"]) == ["not in store"]
    assert not other.problems("tokenize", keys["tokenize"])
    assert not any(k.startswith(f"data/{keys['data']}") for k in objects.objects)
