"""Loading pipeline.yaml: `defaults` is deep-merged under each named pipeline (which may `extends`
another), then `--set` overrides, then validation against the schema a project hands in (`Schema`; the
finetuning one is stages/pipeline/loading.py's). Every problem becomes one line naming the YAML path it came
from and the fix. The engine knows no section of the schema: which fields hold paths comes with it."""

from __future__ import annotations

import copy
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import annotated_types as at
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from stages.engine.errors import ConfigError
from stages.engine.paths import PIPELINE_FILE, work_root

DEFAULT_PIPELINE_FILE = PIPELINE_FILE

C = TypeVar("C", bound=BaseModel)  # a pipeline's config model
S = TypeVar("S", bound=BaseModel)  # a sweep's


@dataclass(frozen=True)
class Schema(Generic[C, S]):
    """What a project's pipeline file is validated against: the config model of a pipeline (its fields
    `name`, `overrides` and `config_file` are set by the loader), that of a sweep, and the fields holding
    paths, {(section, key): kind}: a relative one means the folder of the file it is written in (`--set`
    values: the current directory); "always": the field is a path; "local": a hub id or a path, a path when
    it starts with ./ ../ ~ or names something that exists there."""

    pipeline: type[C]
    sweep: type[S]
    path_fields: Mapping[tuple[str, str], str]


def store_root() -> str:
    """The artifact store: $FINETUNE_STORE (a path or an fsspec URL), else artifacts/ in the project (an
    installed wheel: in the current directory)."""
    return os.environ.get("FINETUNE_STORE") or str(work_root() / "artifacts")


# ---------------------------------------------------------------- loading


def _deep_merge(base: dict, top: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.lr=1e-4` -> (['train', 'lr'], 1e-4). Values are YAML (numbers, lists, null, strings)."""
    if "=" not in text:
        raise ConfigError(f"--set {text}: expected KEY=VALUE with a dotted key, e.g. --set train.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {text}: empty key segment; write a dotted key such as train.lr")
    try:
        value = safe_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {text}: value is not valid YAML ({getattr(e, 'problem', e)}); quote it") from None
    except ConfigError as e:
        raise ConfigError(f"--set {text}: {e}") from None
    return parts, yaml_number(value)


def yaml_number(value: Any) -> Any:
    # YAML 1.1 reads 5e-5 as a string; people mean a number (--set, --grid).
    if isinstance(value, str):
        try:
            return float(value) if any(c in value for c in "eE.") else value
        except ValueError:
            return value
    if isinstance(value, dict):
        return {k: yaml_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_number(v) for v in value]
    return value


def overrides_to_dict(overrides: list[str] | dict[str, Any] | None) -> dict:
    """--set strings (or a {dotted.key: value} dict, as Prefect deployments pass) -> nested dict."""
    nested: dict = {}
    if not overrides:
        return nested
    items = (
        [parse_override(o) for o in overrides]
        if isinstance(overrides, list)
        else [(k.split("."), yaml_number(v)) for k, v in overrides.items()]
    )
    for parts, value in items:
        node = nested
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {'.'.join(parts)}: {p} is set to a value and a section at once")
        node[parts[-1]] = value
    return nested


def override_strings(overrides: list[str] | dict[str, Any] | None) -> list[str]:
    """The overrides as `--set` arguments: strings as given, a {dotted.key: value} mapping as key=JSON."""
    if not overrides:
        return []
    if isinstance(overrides, list):
        return [o.strip() for o in overrides]
    return [f"{k}={json.dumps(v, separators=(', ', ': '))}" for k, v in overrides.items()]


MAX_CONFIG_BYTES = 1 << 20  # a pipeline file is a few KB; anything this large is not one
MAX_YAML_NODES = 100_000  # nodes after aliases are expanded: a pipeline file has hundreds


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key given twice in one mapping (PyYAML silently keeps the last) and a
    document whose aliases expand past MAX_YAML_NODES (a "billion laughs" bomb hangs whatever walks it)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key '{key}' appears twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def get_single_data(self):
        node = self.get_single_node()
        if node is None:
            return None
        if _expanded_size(node, {}) > MAX_YAML_NODES:
            raise ConfigError(f"aliases (*name) expand to more than {MAX_YAML_NODES:,} values; write the "
                              f"values out, or use fewer nested aliases")
        return self.construct_document(node)


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """How many nodes `node` stands for once every alias is copied out (shared nodes counted each time)."""
    if id(node) not in memo:
        memo[id(node)] = 1  # a recursive alias counts once, not forever
        children = (node.value if isinstance(node, yaml.SequenceNode) else
                    [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        memo[id(node)] = 1 + sum(_expanded_size(c, memo) for c in children)
    return memo[id(node)]


def safe_yaml(text: str) -> Any:
    """YAML text -> data, with _UniqueKeyLoader's checks (pipeline files and --set values)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)


def read_text_bounded(path: Path, what: str = "pipeline file") -> str:
    """A config file's text: a regular UTF-8 file of at most MAX_CONFIG_BYTES (ConfigError otherwise)."""
    if not path.exists():
        raise ConfigError(f"{path}: {what} not found; pass --config PATH or run from the project root")
    if not path.is_file():
        kind = "a folder" if path.is_dir() else "not a regular file"
        raise ConfigError(f"{path}: {kind}; --config takes a YAML {what} (e.g. mine.yaml)")
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES >> 20} MiB, not a {what} (they are a few KB); "
                          f"check the path")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"{path}: line {line} is not UTF-8 text (byte 0x{raw[e.start]:02x}); a {what} is YAML "
                          f"text, saved as UTF-8") from None


def read_yaml(path: Path) -> dict:
    text = read_text_bounded(path)
    try:
        doc = safe_yaml(text) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path.name}{where}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    except ConfigError as e:
        raise ConfigError(f"{path.name}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path.name}: nested too deeply to be a pipeline file; check its content") from None
    unknown = set(doc) - {"defaults", "pipelines", "sweeps"} if isinstance(doc, dict) else set()
    if unknown:
        raise ConfigError(f"{path.name}: unknown top-level key(s) {sorted(unknown)}; allowed: defaults, pipelines, "
                          f"sweeps")
    if not isinstance(doc, dict) or not any(doc.values()):  # a file of the user's may hold any of the three
        raise ConfigError(f"{path.name}: holds no pipelines:, sweeps: or defaults: mapping; give at least one "
                          f"(a file of yours builds on the project's {DEFAULT_PIPELINE_FILE.name})")
    if not isinstance(doc.get("pipelines") or {}, dict):
        raise ConfigError(f"{path.name}: pipelines must be a mapping of named pipelines")
    if not isinstance(doc.get("sweeps") or {}, dict):
        raise ConfigError(f"{path.name}: sweeps must be a mapping of named sweeps")
    if not isinstance(doc.get("defaults") or {}, dict):
        raise ConfigError(f"{path.name}: defaults must be a mapping of sections")
    return doc


# ---------------------------------------------------------------- a user's file over the project's

def _anchored(value: Any, folder: Path, kind: str) -> Any:
    if isinstance(value, list):
        return [_anchored(v, folder, kind) for v in value]
    if not isinstance(value, str) or not value or value.startswith("pkg:") or "://" in value or "{" in value:
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    if kind == "always" or value.startswith(("./", "../")) or (folder / path).exists():
        return str((folder / path).resolve())
    return value


def anchor_paths(body: dict, folder: Path, path_fields: Mapping[tuple[str, str], str],
                 kinds: tuple[str, ...] = ("always", "local")) -> dict:
    """A pipeline body (or defaults) with its relative paths (of `path_fields` of these kinds) made absolute
    against `folder`."""
    out = copy.deepcopy(body)
    for (section, key), kind in path_fields.items():
        node = out.get(section)
        if isinstance(node, dict) and key in node and kind in kinds:
            node[key] = _anchored(node[key], folder, kind)
    return out


def _anchor_dotted(overrides: dict, folder: Path, path_fields: Mapping[tuple[str, str], str]) -> dict:
    """A sweep's {dotted.key: value} overrides with relative paths made absolute against `folder`."""
    kinds = {f"{s}.{k}": kind for (s, k), kind in path_fields.items()}
    return {k: (_anchored(v, folder, kinds[k]) if k in kinds else v) for k, v in overrides.items()}


def _anchor_sweep(body: Any, folder: Path, path_fields: Mapping[tuple[str, str], str]) -> Any:
    if not isinstance(body, dict):
        return body
    out = dict(body)
    if isinstance(out.get("set"), dict):
        out["set"] = _anchor_dotted(out["set"], folder, path_fields)
    if isinstance(out.get("grid"), dict):
        kinds = {f"{s}.{k}": kind for (s, k), kind in path_fields.items()}
        out["grid"] = {k: ([_anchored(x, folder, kinds[k]) for x in v] if k in kinds and isinstance(v, list) else v)
                       for k, v in out["grid"].items()}
    if isinstance(out.get("variants"), list):
        out["variants"] = [_anchor_dotted(v, folder, path_fields) if isinstance(v, dict) else v
                           for v in out["variants"]]
    return out


def _anchored_doc(path: Path, path_fields: Mapping[tuple[str, str], str]) -> dict:
    doc = read_yaml(path)
    folder = path.resolve().parent
    return {"defaults": anchor_paths(doc.get("defaults") or {}, folder, path_fields),
            "pipelines": {n: anchor_paths(b, folder, path_fields) if isinstance(b, dict) else b
                          for n, b in (doc.get("pipelines") or {}).items()},
            "sweeps": {n: _anchor_sweep(b, folder, path_fields) for n, b in (doc.get("sweeps") or {}).items()}}


def is_project_file(path: Path | str) -> bool:
    return Path(path).resolve() == DEFAULT_PIPELINE_FILE.resolve()


def load_doc(path: Path | str = DEFAULT_PIPELINE_FILE, path_fields: Mapping[tuple[str, str], str] | None = None) \
        -> dict:
    """The pipelines, defaults and sweeps a config file gives, with relative paths (`path_fields`, a
    Schema's) anchored at its folder.
    A user's file (any file but the project's pipeline.yaml) builds on the project's: the project's
    defaults apply beneath the file's own, its pipelines and sweeps are there unless the file defines one
    of the same name, and a pipeline may `extends` a project pipeline (itself included: `demo:` with
    `extends: demo` is the project's demo with the file's changes). `pipelines` is the combined view;
    `layers` keeps the file's (`own`) and the project's (`project`) apart for `extends`."""
    path = Path(path)
    path_fields = path_fields or {}
    own = _anchored_doc(path, path_fields)
    project: dict[str, Any]
    if is_project_file(path) or not DEFAULT_PIPELINE_FILE.is_file():
        project = {"defaults": {}, "pipelines": {}, "sweeps": {}}
    else:
        project = _anchored_doc(DEFAULT_PIPELINE_FILE, path_fields)
    return {"defaults": _deep_merge(project["defaults"], own["defaults"]),
            "defaults_layers": [("defaults", own["defaults"]),
                                (f"{DEFAULT_PIPELINE_FILE.name} defaults", project["defaults"])],
            "pipelines": {**own["pipelines"], **_missing(project["pipelines"], own["pipelines"])},
            "sweeps": {**own["sweeps"], **_missing(project["sweeps"], own["sweeps"])},
            "layers": {"own": own["pipelines"], "project": project["pipelines"]},
            "file": path}


def own_names(path: Path | str) -> list[str]:
    """The pipelines and sweeps a file defines itself (not those it builds on)."""
    doc = read_yaml(Path(path))
    return [*(doc.get("pipelines") or {}), *(doc.get("sweeps") or {})]


def _missing(base: dict, own: dict) -> dict:
    return {k: v for k, v in base.items() if k not in own}


def pipeline_names(path: Path | str = DEFAULT_PIPELINE_FILE) -> list[str]:
    return list(load_doc(path)["pipelines"])


def sweep_names(path: Path | str = DEFAULT_PIPELINE_FILE) -> list[str]:
    return list(load_doc(path)["sweeps"])


def load_sweep(schema: Schema[C, S], name: str, path: Path | str = DEFAULT_PIPELINE_FILE) -> S:
    """A named sweep of the file's `sweeps:`, validated (its variants' configs are checked by whoever expands it)."""
    path = Path(path)
    doc = load_doc(path, schema.path_fields)
    sweeps = doc["sweeps"]
    if name not in sweeps:
        raise ConfigError(f"unknown sweep '{name}'; available: {', '.join(sweeps) or 'none'} "
                          f"(defined under sweeps: in {path.name})")
    body = sweeps[name]
    if not isinstance(body, dict):
        raise ConfigError(f"sweeps.{name}: must be a mapping (pipeline, grid or variants, metric ...)")
    return validate_sweep(schema, name, body, f"sweeps.{name}", doc)


def validate_sweep(schema: Schema[C, S], name: str, body: dict, where: str, doc: dict | None = None) -> S:
    """body -> the schema's sweep; every problem one line naming `where` (the YAML path, or the command's options)."""
    if "name" in body:
        raise ConfigError(f"{where}: 'name' is the sweep's key; remove it")
    try:
        sweep = schema.sweep.model_validate({**body, "name": name})
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                msg = f"unknown key; valid keys here: {', '.join(f for f in schema.sweep.model_fields if f != 'name')}"
            elif err["type"] == "value_error":
                msg = str((err.get("ctx") or {}).get("error", err["msg"]))
            else:
                msg = f"{err['msg']}, got {err.get('input')!r}"
            problems.append(f"{where}{'.' + loc if loc else ''}: {msg}")
        raise ConfigError("; ".join(problems)) from None
    if doc is not None and (pipeline := getattr(sweep, "pipeline", None)) not in doc["pipelines"]:
        raise ConfigError(f"{where}.pipeline: unknown pipeline '{pipeline}'; available: "
                          f"{', '.join(doc['pipelines'])}")
    return sweep


def _chain(doc: dict, name: str | None) -> list[tuple[str, dict]]:
    """The pipeline and the pipelines it extends, nearest first, each as (where it is written, body). A
    pipeline of the user's file extends the file's pipeline of that name, else (or when it names itself)
    the project's."""
    layers = doc.get("layers") or {"own": doc["pipelines"], "project": {}}
    own, project = layers["own"], layers["project"]
    prefix = {"own": "pipelines", "project": f"{DEFAULT_PIPELINE_FILE.name} pipelines"}
    layer = "own" if name in own else "project"
    chain: list[tuple[str, dict]] = []
    seen: set[tuple[str, str]] = set()
    while name is not None:
        if (layer, name) in seen:
            raise ConfigError(f"pipelines.{name}.extends: cycle through {sorted(n for _, n in seen)}; break the loop")
        seen.add((layer, name))
        body = (own if layer == "own" else project).get(name)
        if body is None and chain and chain[-1][0] == f"pipelines.{name}":
            raise ConfigError(f"pipelines.{name}.extends: {name} extends itself, and {DEFAULT_PIPELINE_FILE.name} "
                              f"has no pipeline {name} it could mean; extend another pipeline or remove extends")
        if body is None:
            raise ConfigError(f"{chain[-1][0]}.extends: unknown pipeline '{name}'; available: "
                              f"{', '.join(doc['pipelines'])}")
        if not isinstance(body, dict):
            raise ConfigError(f"pipelines.{name}: must be a mapping of sections, got {type(body).__name__}")
        chain.append((f"{prefix[layer]}.{name}", body))
        parent = body.get("extends")
        if parent is not None and layer == "own" and (parent == name or parent not in own):
            layer = "project"
        name = parent
    return chain


def load_pipeline(schema: Schema[C, Any], name: str, overrides: list[str] | dict | None = None,
                  path: Path | str = DEFAULT_PIPELINE_FILE) -> C:
    """The named pipeline of the file (its `extends` chain over `defaults`, then `overrides`), validated."""
    path = Path(path)
    doc = load_doc(path, schema.path_fields)
    if name not in doc["pipelines"]:
        raise ConfigError(f"unknown pipeline '{name}'; available: {', '.join(doc['pipelines'])} "
                          f"(defined under pipelines: in {path.name})")
    chain = _chain(doc, name)
    merged = copy.deepcopy(doc.get("defaults") or {})
    for _, body in reversed(chain):
        merged = _deep_merge(merged, body)
    for field in ("overrides", "config_file"):
        if field in merged:
            raise ConfigError(f"pipelines.{name}: '{field}' is set by the loader; remove it from {path.name}")
    # --set paths: the current directory's, made absolute here (the export key holds data.path as written)
    over = anchor_paths(overrides_to_dict(overrides), Path.cwd(), schema.path_fields, ("always",))
    merged = _deep_merge(merged, over)
    merged["name"] = name
    merged["overrides"] = override_strings(overrides)
    merged["config_file"] = None if is_project_file(path) else str(path.resolve())
    merged.pop("extends", None)
    try:
        return schema.pipeline.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_describe(schema.pipeline, e, name, chain, doc["defaults_layers"], over)) from None


def inherited_from(cfg: Any, dotted: str) -> str | None:
    """The pipeline a loaded pipeline's field came from by `extends` (`smol-chat` for a `data.split` that a
    pipeline extending smol-chat left as it was), None when the pipeline itself, `--set` or the defaults set
    it, or the config was not loaded by name from its file. For errors that name where a setting came from."""
    try:
        doc = load_doc(cfg.config_file or DEFAULT_PIPELINE_FILE)
        chain = _chain(doc, cfg.name) if cfg.name in doc["pipelines"] else []
    except (ConfigError, OSError):
        return None
    if not chain:
        return None
    over = overrides_to_dict(cfg.overrides)
    loc = tuple(dotted.split("."))
    for prefix in (loc[:i] for i in range(len(loc), 0, -1)):
        if _has(over, prefix) or _has(chain[0][1], prefix):
            return None
        for where, body in chain[1:]:
            if _has(body, prefix):
                return where.rsplit(" ", 1)[-1].removeprefix("pipelines.")
    return None


def _has(d: Any, loc: tuple) -> bool:
    for part in loc:
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def _origin(loc: tuple, name: str, chain: list, defaults: list, over: dict) -> str:
    dotted = ".".join(str(p) for p in loc)
    for prefix in (loc[:i] for i in range(len(loc), 0, -1)):
        if _has(over, prefix):
            return f"--set {dotted}"
        for where, body in chain:
            if _has(body, prefix):
                return f"{where}.{dotted}"
        for where, body in defaults:
            if _has(body, prefix):
                return f"{where}.{dotted}"
    return f"pipelines.{name}.{dotted}"


BOUNDS = {"greater_than_equal": ">=", "greater_than": ">", "less_than": "<", "less_than_equal": "<="}


def _describe(root: type[BaseModel], err: ValidationError, name: str, chain: list, defaults: list, over: dict) -> str:
    problems = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-after")))
        kind, ctx, got = e["type"], e.get("ctx") or {}, e.get("input")
        where = _origin(loc, name, chain, defaults, over) if loc else f"pipelines.{name}"
        if kind == "extra_forbidden":
            model = _model_at(root, loc[:-1])
            valid = ", ".join(model.model_fields) if model else "see pipeline.yaml"
            msg = f"unknown key '{loc[-1]}'; valid keys here: {valid}"
        elif kind == "missing":
            msg = "required; add it to the pipeline or to defaults"
        elif kind in BOUNDS or kind == "int_parsing_size":
            if kind in BOUNDS:
                bound = next(iter(ctx.values()))
                want = f"{BOUNDS[kind]} {int(bound) if isinstance(bound, float) and bound.is_integer() else bound}"
            else:  # an integer too large for pydantic to parse: past any upper bound of the field
                want = _upper_bound(root, loc) or "a smaller integer"
            too_large = kind in ("less_than", "less_than_equal", "int_parsing_size")
            msg = f"must be {want}, got {got!r}" + (f"; {hint}" if too_large and (hint := _fix(root, loc)) else "")
        elif kind == "finite_number":
            msg = f"must be a finite number, got {got!r}"
        elif kind == "literal_error":
            msg = f"must be one of {ctx.get('expected')}, got {got!r}"
            if isinstance(got, bool):
                msg += " (YAML reads yes/no/on/off/true/false as a boolean; quote the word)"
        elif kind.endswith("_parsing") or kind.endswith("_type"):
            want = kind.split("_")[0]
            want = {"int": "an integer", "float": "a number", "bool": "true or false", "string": "a string",
                    "list": "a list", "dict": "a mapping", "model": "a mapping"}.get(want, want)
            msg = f"must be {want}, got {got!r}"
        elif kind == "value_error":
            msg = str(ctx.get("error", e["msg"]))
            field, sep, rest = msg.partition(": ")
            if not loc and sep and re.fullmatch(r"[a-z_]+(\.[a-z_]+)+", field):  # a check across sections
                where, msg = _origin(tuple(field.split(".")), name, chain, defaults, over), rest
        else:
            msg = e["msg"]
        problems.append(f"{where}: {msg}")
    return "; ".join(problems)


def _field_at(root: type[BaseModel], loc: tuple) -> FieldInfo | None:
    model = _model_at(root, loc[:-1]) if loc else None
    return model.model_fields.get(str(loc[-1])) if model else None


def _upper_bound(root: type[BaseModel], loc: tuple) -> str | None:
    """The field's upper bound (`<= 10000`), if it has one."""
    field = _field_at(root, loc)
    return next((f"{op} {getattr(m, attr)}" for m in (field.metadata if field else [])
                 for cls, attr, op in ((at.Le, "le", "<="), (at.Lt, "lt", "<")) if isinstance(m, cls)), None)


def _fix(root: type[BaseModel], loc: tuple) -> str | None:
    """What the field's schema says to do when its value is above its bound (schema.fix)."""
    extra = field.json_schema_extra if (field := _field_at(root, loc)) else None
    return extra.get("fix") if isinstance(extra, dict) else None  # type: ignore[return-value]


def _model_at(root: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    model: Any = root
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if model is None:
            return None
    return model
