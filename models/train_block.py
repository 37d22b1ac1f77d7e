"""Block drafters (runner/drafting/block.py, ``drafter = "block"``) in DFlash's checkpoint layout: trained here, and one
random-weight stand-in for a published checkpoint.

    python models/train_block.py [--only NAME ...] [--out models/block]

Writes under ``models/block/`` (git-ignored):

* ``default/``: a block drafter for the default pair's target (models/default/target), trained here;
* ``smollm2/``: one for SmolLM2-135M-Instruct (models/smollm2), trained here;
* ``dflash_random/``: random weights for models/default/target, exactly as z-lab's published DFlash drafters
  (``z-lab/Qwen3-8B-DFlash-b16`` and the like) lay theirs out (no record of the target: checked by shape only),
  for the tests' loader check (no hub access here).

Training: the drafter (one DFlash decoder layer, the target's embedding and LM head reused, frozen) is conditioned
on the target's hidden states after three of its layers (the last one's after the final norm) at every position
before the block, and given the pending token's embedding followed by ``block_size - 1`` embeddings of the mask
token; it learns the ``block_size - 1`` tokens that follow, all at once (non-causal within the block). Its data:
models/drafter_data.py's (shared with the head drafter of models/train_drafter.py): the target's own greedy
continuations of varied prompts (help-text passages for the default target, chat messages for SmolLM2), the
bench's own prompts left out; the three layers' hidden states come from a second pass over each sequence. Each
step takes one sequence and 48 block anchors in its continuation, in one pass (a mask per anchor: the context
before it and its own block). The hidden states are the target's in float32, as the runner computes them on the
CPU. A target vocabulary larger than 8192 tokens (SmolLM2's 49152) is cut, for the drafter, to the 8192 tokens the
target writes most in this data (``draft_vocab``, an extra tensor, and ``dflash_config.draft_vocab_size``: the
head's cost over the whole vocabulary was most of a step's, and of a draft pass's; a sampled softmax over it left
the tokens it never sampled with logits that won the argmax: 0.06 of first drafts kept). Each training reports its
held-out acceptance by depth and its wall time. Deterministic for a seed.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import mlx.optimizers as optim  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models.drafter_data import greedy_sequences, load_target, prompts  # noqa: E402
from runner.drafting.block import (  # noqa: E402
    ARCHITECTURE,
    BlockConfig,
    BlockDraftModel,
    install_taps,
    rows_head,
    target_identity,
)
from runner.drafting.mtp import _text_model, lm_head  # noqa: E402

OUT = ROOT / "models" / "block"
BLOCK_SIZE = 7  # 6 drafts: the adaptive depth's deepest (max_draft_tokens' default)
ANCHORS = 48
DRAFT_VOCAB = 8192  # a larger vocabulary is cut to the target's most written tokens (the head's cost)


QUICK: set[str] = set()  # drafters trained briefly, for the tests (``--quick``): greedy output, not acceptance


def spec(name: str) -> dict:
    settings = _specs()[name]
    if name in QUICK:
        settings.update(prompts=16, tokens=24, steps=40)
    return settings


def _specs() -> dict:
    return {
        "default": dict(
            target=ROOT / "models" / "default" / "target",
            chat=False,
            prompts=384,
            tokens=96,
            layers=1,
            steps=800,
            lr=3e-3,
        ),
        "smollm2": dict(
            target=ROOT / "models" / "smollm2",
            chat=True,
            prompts=160,
            tokens=96,
            layers=1,
            steps=400,
            lr=3e-3,
            normalize_taps=True,
        ),
    }


def taps_for(layers: int) -> list[int]:
    """Three layers: early, middle and the last (after the final norm)."""
    return [min(2, layers - 1), layers // 2, layers - 1]


def dflash_config(target_config: dict, layers: list[int], mask: int, block: int, hidden_layers: int = 1, **extra):
    """A config in DFlash's published layout for a drafter over a target of ``target_config``."""
    args = target_config.get("text_config", target_config)
    width = int(args["hidden_size"])
    heads = int(args["num_attention_heads"])
    head_dim = int(args.get("head_dim") or width // heads)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": width,
        "num_hidden_layers": hidden_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(args.get("num_key_value_heads") or heads),
        "head_dim": head_dim,
        "intermediate_size": 2 * width,
        "vocab_size": int(args["vocab_size"]),
        "rms_norm_eps": 1e-6,
        "rope_theta": float(args.get("rope_theta", 10000.0)),
        "rope_scaling": None,
        "max_position_embeddings": int(args.get("max_position_embeddings", 8192)),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block,
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": layers, **extra},
        "torch_dtype": "bfloat16",
    }


def save(folder: Path, config: dict, model: BlockDraftModel, dtype=mx.float32) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    weights = {
        k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in tree_flatten(model.parameters())
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def mask_token(tokenizer) -> int:
    """A token the target never writes in its answers: the pad token, else the last id."""
    for name in ("pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int) and value not in tokenizer.eos_token_ids:
            return value
    return len(tokenizer.get_vocab()) - 1


def build_random(out: Path) -> None:
    """The published layout with random weights over models/default/target (bfloat16, as published)."""
    folder = ROOT / "models" / "default" / "target"
    target_config = json.loads((folder / "config.json").read_text())
    config = dflash_config(target_config, [1, 4, 7], mask=2, block=8)
    mx.random.seed(1)
    model = BlockDraftModel(BlockConfig.from_dict(config))
    save(out / "dflash_random", config, model, mx.bfloat16)
    print(f"dflash_random: random weights in DFlash's layout -> {out / 'dflash_random'}", flush=True)


# -- data ---------------------------------------------------------------------------------------------------------


def features_of(target, taps, sequences: list[list[int]], batch: int = 16) -> list[mx.array]:
    """The target's tapped features at every position of each sequence ((1, L, taps * width) each), rows batched
    (padded at the end: causal attention keeps the padding out of every real position)."""
    from mlx_lm.models.cache import make_prompt_cache

    out = []
    for first in range(0, len(sequences), batch):
        rows = sequences[first : first + batch]
        width = max(len(r) for r in rows)
        taps.hidden = {}
        try:
            target(mx.array([r + [0] * (width - len(r)) for r in rows]), cache=make_prompt_cache(target))
            features = taps.features()
        finally:
            taps.hidden = None
        mx.eval(features)
        out += [features[i : i + 1, : len(r)] for i, r in enumerate(rows)]
    return out


# -- training -----------------------------------------------------------------------------------------------------


def block_loss(drafter, embed, head, features, sequence, anchors, mask_id, block):
    """Cross-entropy of the drafts of each anchor's block (anchors: positions of the pending token), the later
    positions weighted less (a draft counts only when those before it are kept). ``head``: the target's head over
    the drafter's vocabulary (``draft_vocab``, where it has one: labels outside it do not count). Returns the loss,
    the logits and the labels (indices into the drafter's vocabulary; -1 outside it)."""
    length = features.shape[1]
    ids = mx.array(sequence)
    anchors_mx = mx.array(anchors)
    inputs = mx.full((len(anchors), block), mask_id, dtype=mx.int32)
    inputs[:, 0] = ids[anchors_mx]
    positions = anchors_mx[:, None] + mx.arange(1, block)[None]
    labels = ids[mx.minimum(positions, length - 1)]
    valid = positions < length
    vocab = getattr(drafter, "draft_vocab", None)
    if vocab is not None:
        index = mx.minimum(mx.searchsorted(vocab, labels).astype(mx.int32), vocab.shape[0] - 1)
        valid = valid & (vocab[index] == labels)
        labels = mx.where(valid, index, -1)
    weights = valid.astype(mx.float32) * (0.8 ** mx.arange(block - 1))[None]
    visible = mx.arange(length)[None] < anchors_mx[:, None]  # (B, L): the context before each block
    mask = mx.concatenate([visible, mx.ones((len(anchors), block), dtype=mx.bool_)], axis=1)[:, None, None, :]
    contexts = drafter.context(features, 0)
    hidden = drafter(embed(inputs), anchors_mx, contexts, mask)
    logits = head(hidden[:, 1:]).astype(mx.float32)
    losses = nn.losses.cross_entropy(logits, mx.maximum(labels, 0), reduction="none")
    return (losses * weights).sum() / weights.sum(), logits, labels


def draft_vocabulary(data, vocab: int) -> np.ndarray | None:
    """The DRAFT_VOCAB tokens the target writes most often in the continuations, sorted; None where the target's
    vocabulary is no larger."""
    if vocab <= DRAFT_VOCAB:
        return None
    counts = np.bincount(np.concatenate([np.array(t[p:]) for t, p in data]), minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:DRAFT_VOCAB]).astype(np.int32)


def drafter_head(target, drafter):
    vocab = getattr(drafter, "draft_vocab", None)
    return lm_head(target) if vocab is None else rows_head(target, vocab)


HELD_OUT = 16  # sequences kept out of training, for the acceptance report


def build_data(name: str, seed: int = 0, cache: Path | None = None):
    """(target, tokenizer, taps, mask token, [(tokens, prompt length)], [features]) for ``name``; ``cache``: an
    .npz file that holds the data (read when present, else written)."""
    settings = spec(name)
    began = time.perf_counter()
    target, tokenizer = load_target(settings["target"])
    layers = taps_for(len(_text_model(target).model.layers))
    if cache is not None and cache.is_file():
        saved = np.load(cache)
        count = int(saved["count"])
        data = [(saved[f"tokens{i}"].tolist(), int(saved[f"prompt{i}"])) for i in range(count)]
        features = [mx.array(saved[f"features{i}"]) for i in range(count)]
        return target, tokenizer, layers, mask_token(tokenizer), data, features
    ids = prompts(tokenizer, settings["prompts"] + HELD_OUT, seed, chat=settings["chat"])
    sequences = greedy_sequences(target, tokenizer, ids, settings["tokens"], log=lambda *a, **k: None)
    data = [(s.tokens, s.prompt_tokens) for s in sequences if len(s.tokens) - s.prompt_tokens > BLOCK_SIZE]
    del sequences  # their last hidden states: the block drafter reads three layers (features_of)
    generated = time.perf_counter() - began
    taps = install_taps(target, layers)
    features = features_of(target, taps, [sequence for sequence, _ in data])
    print(
        f"[{name}] data: {len(data)} sequences, {sum(len(t) - p for t, p in data)} target tokens "
        f"({generated:.0f}s to generate, {time.perf_counter() - began - generated:.0f}s for the hidden states)",
        flush=True,
    )
    if cache is not None:
        arrays = {"count": np.array(len(data))}
        for i, ((tokens, prompt), feature) in enumerate(zip(data, features)):
            arrays[f"tokens{i}"], arrays[f"prompt{i}"] = np.array(tokens), np.array(prompt)
            arrays[f"features{i}"] = np.array(feature)
        np.savez(cache, **arrays)
    return target, tokenizer, layers, mask_token(tokenizer), data, features


def fit(name, drafter, target, data, features, mask_id, steps: int, lr: float, seed: int = 0) -> None:
    """Train ``drafter`` on all but the last HELD_OUT sequences."""
    text = _text_model(target)
    embed, head = text.model.embed_tokens, drafter_head(target, drafter)
    rng = np.random.default_rng(seed)
    training = len(data) - HELD_OUT
    schedule = optim.cosine_decay(lr, steps, end=lr / 20)
    optimizer = optim.AdamW(learning_rate=lambda step: mx.minimum(1.0, (step + 1) / 30) * schedule(step))

    def loss_fn(model, index, anchors):
        sequence, _ = data[index]
        return block_loss(model, embed, head, features[index], sequence, anchors, mask_id, BLOCK_SIZE)[0]

    step_fn = nn.value_and_grad(drafter, loss_fn)
    started = time.perf_counter()
    for step in range(steps):
        index = int(rng.integers(training))
        sequence, prompt = data[index]
        anchors = rng.integers(prompt - 1, len(sequence) - 1, size=ANCHORS).tolist()
        loss, grads = step_fn(drafter, index, anchors)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(drafter, grads)
        mx.eval(drafter.parameters(), optimizer.state, loss)
        if step % 250 == 0 or step == steps - 1:
            print(
                f"[{name}] step {step:4d}/{steps} loss {loss.item():.3f} ({time.perf_counter() - started:.0f}s)",
                flush=True,
            )


def train(name: str, out: Path, seed: int = 0) -> None:
    settings = spec(name)
    began = time.perf_counter()
    target, _, layers, mask_id, data, features = build_data(name, seed)
    config, drafter = new_drafter(settings, target, layers, mask_id, data, settings["layers"], seed)
    fit(name, drafter, target, data, features, mask_id, settings["steps"], settings["lr"], seed)
    report(name, drafter, target, data, features, mask_id)
    save(out / name, config, drafter)
    print(f"[{name}] {time.perf_counter() - began:.0f}s in all -> {out / name}", flush=True)


def new_drafter(settings, target, layers, mask_id, data, hidden_layers: int, seed: int = 0):
    """(config, a freshly initialised drafter) for ``target``; its vocabulary cut to the most written tokens where
    the target's is large (``draft_vocabulary``)."""
    target_config = json.loads((Path(settings["target"]) / "config.json").read_text())
    vocab = draft_vocabulary(data, _text_model(target).model.embed_tokens.weight.shape[0])
    extra = {"target": target_identity(settings["target"])}
    if settings.get("normalize_taps"):
        extra["normalize_taps"] = True
    if vocab is not None:
        extra["draft_vocab_size"] = len(vocab)
    config = dflash_config(target_config, layers, mask_id, BLOCK_SIZE, hidden_layers, **extra)
    mx.random.seed(seed)
    drafter = BlockDraftModel(BlockConfig.from_dict(config))
    if vocab is not None:
        drafter.draft_vocab = mx.array(vocab)
        drafter.freeze(keys=["draft_vocab"], recurse=False)
    return config, drafter


def report(name, drafter, target, data, features, mask_id) -> list[float]:
    """Acceptance by depth on the held-out sequences' blocks at every position of their continuations: a greedy
    draft i counts when drafts 1..i all equal the target's tokens. Returns the shares kept at depth 1..6."""
    text = _text_model(target)
    embed, head = text.model.embed_tokens, drafter_head(target, drafter)
    kept = np.zeros(BLOCK_SIZE - 1)
    blocks = 0
    for index in range(len(data) - HELD_OUT, len(data)):
        sequence, prompt = data[index]
        anchors = list(range(prompt - 1, len(sequence) - BLOCK_SIZE))
        _, logits, labels = block_loss(drafter, embed, head, features[index], sequence, anchors, mask_id, BLOCK_SIZE)
        right = np.array(mx.argmax(logits, axis=-1) == labels)
        kept += np.cumprod(right, axis=1).sum(axis=0)
        blocks += len(anchors)
    shares = [kept[i] / blocks for i in range(BLOCK_SIZE - 1)]
    rates = ", ".join(f"{i + 1}: {share:.2f}" for i, share in enumerate(shares))
    print(f"[{name}] held-out sequences, drafts 1..i all kept at depth i: {rates}", flush=True)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--only", nargs="*", default=["dflash_random", "default", "smollm2"])
    parser.add_argument("--quick", nargs="*", default=[], help="train these briefly (the tests' SmolLM2 drafter)")
    args = parser.parse_args()
    QUICK.update(args.quick)
    for name in args.only:
        if name == "dflash_random":
            build_random(args.out)
        else:
            train(name, args.out)


if __name__ == "__main__":
    main()
