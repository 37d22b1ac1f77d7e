"""Every default the runner and the supervisor share, in one place, importable without MLX.

The supervisor process never loads MLX: its config, CLI and clients take their
defaults from here, and the runner's argument parser does too.
"""

from pathlib import Path

# The embedded default model pair (written by models/train.py) and the imported real model.
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"
DEFAULT_TARGET = MODELS_DIR / "default" / "target"
DEFAULT_DRAFT = MODELS_DIR / "default" / "draft"
SMOLLM2_DIR = MODELS_DIR / "smollm2"  # make real-model (outside git)
GEMMA3_DIR = MODELS_DIR / "gemma3-270m"  # make real-model (outside git): Gemma 3 270M, base model, Q4_K_M
MINILM_DIR = MODELS_DIR / "all-minilm-l6-v2"  # make embedding-model (outside git): sentence-transformers' folder

# Decoding.
DEFAULT_NUM_DRAFT_TOKENS = 1  # best fixed k in bench/speculation.py on the default pair; seeded sampling uses it
MAX_NUM_DRAFT_TOKENS = 16
DEFAULT_MAX_DRAFT_TOKENS = 6  # the deepest round the adaptive depth tries
DEFAULT_NGRAM_MAX = 4  # prompt lookup: the longest suffix it matches...
DEFAULT_NGRAM_MIN = 2  # ...and the shortest
DEFAULT_RELEASE_INTERVAL = 256  # mlx-lm's KVCache.step: the cache grows in steps of this many tokens
DEFAULT_PREFILL_CHUNK = 2048  # the most prompt tokens one forward pass takes (a GPU's: its attention is fused)
# On the CPU, attention computes the whole (chunk x context) square of scores, the masked half included, so
# smaller chunks compute less of it: prefill at 1,500 tokens measured 1.36x faster with chunks of at most 256
# than 2048 on the default pair, 1.14x on SmolLM2 (2-core Xeon, 2026-12-06; docs/design.md, "Long prompts").
CPU_PREFILL_CHUNK = 256
# On the CPU, attention materialises a (heads x chunk x context) float32 score matrix: chunks are
# sized to keep it under this many bytes (measured on the default pair at 8000 tokens: chunks of
# 256 prefill as fast as 2048 with a third of the peak memory).
DEFAULT_PREFILL_SCORE_BYTES = 64 * 2**20
MIN_PREFILL_CHUNK = 16
DTYPES = ("auto", "checkpoint", "float32")
DEFAULT_DTYPE = "auto"

# The runner process.
DEFAULT_MAX_QUEUE = 512  # requests that may wait for a place in the batch (Ollama waits up to 512)
DEFAULT_MAX_PENDING_ROUNDS = 4096  # rounds a slow client may let wait before its request is stopped
DEFAULT_PROMPT_CACHE_DISK = 8 * 2**30  # the prompt cache's disk tier, when prompt_cache_dir is set
DEFAULT_MAX_BATCH = 16  # requests decoded together; chosen from bench/batching.py
DEFAULT_STREAM_INTERVAL = 0.05  # seconds a stream gathers tokens while many requests decode (runner.server)
COALESCE_FROM = 8  # requests decoding from which streams gather their tokens
DEFAULT_STALL_AFTER = 30.0  # seconds without progress of the MLX thread before health says NOT_SERVING
DEFAULT_GRACE = 10.0
MAX_MESSAGE_BYTES = 8 * 2**20
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]
