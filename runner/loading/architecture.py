"""What a model folder is, read without loading its weights: its config and mlx-lm's model class.

For the checks made before a load (whether a runner group can split the model: ``runner.group``,
``runner.pipeline``); the load itself is ``runner.loading.load``.
"""

from __future__ import annotations

from pathlib import Path


def architecture(folder: str | Path) -> tuple[dict, type]:
    """A model folder's config and mlx-lm's model class for it, without loading weights; ValueError says why
    not (for the checks made before a load, such as whether a group can split the model)."""
    from mlx_lm.utils import _get_classes, load_config

    try:
        config = load_config(Path(folder))
        return config, _get_classes(config)[0]
    except Exception as error:  # noqa: BLE001 - any cause, in one line
        raise ValueError(f"its config cannot be read: {error}") from None
