"""Model names found in the local Hugging Face cache: a hub id whose config.json was downloaded before.

Only the cache is read, never the network. The rules are huggingface_hub's
(`file_download.try_to_load_from_cache`): the hub cache is `$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`; a model `org/name` lives in
`models--org--name/`, its `refs/main` names the commit and `snapshots/<commit>/config.json`
is the file. huggingface_hub is imported lazily (it is transformers' dependency, not
llamem's core's); without it the same rule is applied by hand.
"""

from __future__ import annotations

import os
from pathlib import Path

_REPO_PREFIX = "models--"


def hub_cache_dir() -> Path:
    """The hub cache directory as huggingface_hub would choose it now (read at each call, so a changed
    environment is seen)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_config(name: str) -> tuple[str, Path] | None:
    """(hub id, config.json path) of a model in the local cache: `org/name` in any case, or a bare `name`
    that only one cached organisation holds. None when it is not there."""
    cache = hub_cache_dir()
    repo = _cached_repo(cache, name.strip())
    if repo is None:
        return None
    path = _snapshot_config(cache, repo)
    return (repo, path) if path is not None else None


def _cached_repo(cache: Path, name: str) -> str | None:
    """The cached repo id `name` stands for, matched without regard to case (the hub ignores it)."""
    try:
        folders = [entry.name for entry in os.scandir(cache) if entry.name.startswith(_REPO_PREFIX)]
    except OSError:  # no cache yet, or not a directory
        return None
    repos = {folder[len(_REPO_PREFIX):].replace("--", "/", 1): folder for folder in folders}
    wanted = name.lower()
    exact = [repo for repo in repos if repo.lower() == wanted]
    if exact:
        return exact[0]
    if "/" in name:
        return None
    bare = [repo for repo in repos if repo.lower().partition("/")[2] == wanted]
    return bare[0] if len(bare) == 1 else None


def _snapshot_config(cache: Path, repo: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return _snapshot_config_by_hand(cache, repo)
    try:
        found = try_to_load_from_cache(repo, "config.json", cache_dir=str(cache))
    except ValueError:  # an id the hub would refuse (HFValidationError)
        return None
    return Path(found) if isinstance(found, str) else None


def _snapshot_config_by_hand(cache: Path, repo: str) -> Path | None:
    folder = cache / (_REPO_PREFIX + repo.replace("/", "--"))
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    path = folder / "snapshots" / commit / "config.json"
    return path if path.is_file() else None
