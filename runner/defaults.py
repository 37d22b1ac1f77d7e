"""Where the embedded default model pair lives (written by models/train.py)."""

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
DEFAULT_TARGET = MODELS_DIR / "target"
DEFAULT_DRAFT = MODELS_DIR / "draft"
