"""What a drafter head folder (runner/drafting/head.py, trained by models/train_drafter.py) was trained for, and
whether it fits a target: read without MLX, so the settings check a model entry before any runner starts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

KEY = "drafter_head"  # the config.json entry that says what the head was trained for


def config_hash(config: dict) -> str:
    """The sha256 of a target's config.json as parsed (key order and layout ignored)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _text(config: dict) -> dict:
    return {**config, **(config.get("text_config") or {})}


def read_head_config(folder: str | Path) -> dict:
    """The head folder's config.json; ValueError naming what is wrong with the folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is no folder")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{folder}/config.json cannot be read: {error}") from None
    if not isinstance(config.get(KEY), dict):
        raise ValueError(f"{folder} is no drafter head (its config.json has no {KEY!r}: models/train_drafter.py)")
    if not (folder / "model.safetensors").is_file():
        raise ValueError(f"{folder}/model.safetensors is missing")
    return config


def mismatch(head_config: dict, target_config: dict) -> str:
    """Why a head does not fit a target ("" when it does): another vocabulary, width or architecture. A target of the
    same shape with another config (other weights of one architecture) is allowed: its drafts are only worse."""
    trained = head_config[KEY]
    target = _text(target_config)
    checks = (
        ("vocabulary", trained.get("vocab_size"), target.get("vocab_size")),
        ("width", trained.get("hidden_size"), target.get("hidden_size")),
        ("architecture", trained.get("model_type"), target.get("model_type")),
    )
    for what, theirs, ours in checks:
        if theirs != ours:
            return (
                f"the head was trained for {trained.get('target', 'another target')} "
                f"({what} {theirs}), this target's {what} is {ours}"
            )
    return ""


def same_target(head_config: dict, target_config: dict) -> bool:
    """Whether the head was trained for this very config (not only the same shape)."""
    return head_config[KEY].get("target_config_sha256") == config_hash(target_config)


def problem(head: str | Path, target: str | Path | None) -> str:
    """What is wrong with ``head`` as a drafter head for ``target`` ("" when nothing is, or when the head or the target
    is no folder with a config.json here yet: a GGUF file or a hub name, which the runner checks once it has loaded
    it; the supervisor's config refuses a head folder that is missing)."""
    if not (Path(head) / "config.json").is_file():
        return ""
    try:
        config = read_head_config(head)
    except ValueError as error:
        return str(error)
    if target is None or not (Path(target) / "config.json").is_file():
        return ""
    try:
        target_config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return ""  # the target's own load reports it
    return mismatch(config, target_config)
