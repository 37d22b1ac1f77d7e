"""Train an EAGLE-style drafter head for a target (issue #41 item 2): ``drafter = "head"``, ``head = "OUT"``.

    python -m models.train_drafter --target FOLDER --out DIR [--prompts N] [--tokens N] [--epochs N] [--seed S]

The head (runner/drafting/head.py) is one decoder layer of the target's own architecture over the target's last hidden
state and the next token's embedding, with the target's embedding and LM head (or, with ``--draft-vocab N``, the
target's LM-head rows of the N tokens it chose most often: EAGLE-3's reduced vocabulary). It learns from the target
itself (models/drafter_data.py): the target's greedy continuations of varied prompts, with its hidden states at
every position. At position i the head reads (h_i, token i+1) and learns the target's greedy token after i+1
(cross-entropy) and its hidden state h_{i+1} (a regression of its normed output, as EAGLE does: its output is
what its chained steps read in place of h_{i+1}). With ``--unroll 2`` (the default) it also learns its second
chained step (EAGLE-3's training-time test): at position i+1 it reads its own output at i, not h_{i+1}, and attends
to the target's pairs before it, as when it drafts two tokens ahead. The target stays frozen; only the head's fc,
norms and layer learn.

Deterministic for a seed (the data's prompts and order, the initial fc, the batches' order). Prints each stage's
wall time and the held-out top-1 agreement with the target (the first draft's acceptance, teacher-forced).
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import random
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from common.heads import KEY, config_hash
from models.drafter_data import PROMPTS_VERSION, greedy_sequences, load_target, prompts
from runner.drafting.head import build_head, save_head, trainable_keys
from runner.drafting.mtp import _text_model, lm_head


class _PrefixCache:
    """A stand-in KV cache for the unrolled step: its keys and values are those of the real pairs, then its own; its
    offset stays 0, so the unrolled step's positions are the real ones (RoPE), and the mask says who sees whom."""

    def __init__(self, keys=None, values=None):
        self.keys, self.values, self.offset = keys, values, 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
            return keys, values
        return mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)


def make_batches(sequences, batch: int, rng: random.Random):
    """Rows of similar length together, right-padded: (hidden, next tokens, labels, target hidden, mask)."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i].tokens))
    groups = [order[i : i + batch] for i in range(0, len(order), batch)]
    rng.shuffle(groups)
    for group in groups:
        rows = [sequences[i] for i in group]
        length = max(len(s.tokens) for s in rows) - 1
        width = rows[0].hidden.shape[1]
        hidden = np.zeros((len(rows), length, width), np.float32)
        after = np.zeros((len(rows), length), np.int32)  # token i+1
        labels = np.zeros((len(rows), length), np.int32)  # the target's token after i+1
        target = np.zeros((len(rows), length, width), np.float32)  # h_{i+1}
        mask = np.zeros((len(rows), length), np.float32)
        for r, s in enumerate(rows):
            n = len(s.tokens) - 1
            hidden[r, :n] = s.hidden[:n]
            after[r, :n] = s.tokens[1:]
            labels[r, :n] = s.labels[1 : n + 1]
            target[r, :n] = s.hidden[1 : n + 1]
            mask[r, :n] = 1.0
        yield tuple(mx.array(a) for a in (hidden, after, labels, target, mask))


def make_loss(head, embed, logits_of, t2d, unroll: int, reg_weight: float):
    def step_loss(x, labels, target, mask):
        normed = head.final_norm(x)
        logits = logits_of(normed)
        if t2d is not None:
            mapped = t2d[labels]
            mask = mask * (mapped >= 0)
            labels = mx.maximum(mapped, 0)
        ce = nn.losses.cross_entropy(logits, labels)
        scale = mx.mean(target * target, axis=-1) + 1e-6
        reg = mx.mean((normed - target) ** 2, axis=-1) / scale
        total = mx.maximum(mask.sum(), 1.0)
        correct = ((mx.argmax(logits, axis=-1) == labels) * mask).sum()
        return ((ce + reg_weight * reg) * mask).sum() / total, correct, total

    def loss_fn(model, hidden, after, labels, target, mask):
        length = hidden.shape[1]
        x = model.project(embed(after), hidden)
        cache = _PrefixCache()
        first = model.decode(x, cache, mask="causal")
        loss, correct, total = step_loss(first, labels, target, mask)
        if unroll > 1 and length > 2:
            # Step 2 at position p = i+1 (p = 1..L-1): its own output at i in place of h_{i+1}, token i+2; it sees
            # the target's pairs before p (keys 0..p-1) and its own key at p. Row 0 is a stand-in (it sees itself)
            # that keeps the positions (RoPE) those of the real pairs.
            x2 = model.project(embed(after[:, 1:]), first[:, :-1])
            x2 = mx.concatenate([mx.zeros_like(x2[:, :1]), x2], axis=1)
            positions = mx.arange(length)
            allowed = mx.concatenate(
                [positions[None, :] < positions[:, None], positions[None, :] == positions[:, None]], axis=1
            )
            second = model.decode(x2, _PrefixCache(cache.keys, cache.values), mask=allowed)
            loss2, _, _ = step_loss(second[:, 1:], labels[:, 1:], target[:, 1:], mask[:, 1:])
            loss = loss + loss2
        return loss, (correct, total)

    return loss_fn


def agreement(head, embed, logits_of, t2d, batches) -> float:
    """Teacher-forced top-1 agreement with the target's greedy token over ``batches`` (the first draft's chance)."""
    correct = total = 0.0
    for hidden, after, labels, _, mask in batches:
        x = head.decode(head.project(embed(after), hidden), None, mask="causal")
        chosen = mx.argmax(logits_of(head.final_norm(x)), axis=-1)
        if t2d is not None:
            chosen = head.d2t[chosen]
        correct += float(((chosen == labels) * mask).sum())
        total += float(mask.sum())
    return correct / max(total, 1.0)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="the target's folder (mlx-lm layout)")
    parser.add_argument("--out", type=Path, required=True, help="the head's folder (written)")
    parser.add_argument("--prompts", type=int, default=160, help="prompts the target answers (training data)")
    parser.add_argument("--tokens", type=int, default=128, help="the longest continuation of each")
    parser.add_argument("--held-out", type=int, default=16, help="of those, kept out of training (agreement)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2, help="sequences per training step")
    parser.add_argument("--gen-batch", type=int, default=32, help="sequences per generation batch")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--reg-weight", type=float, default=0.5, help="the hidden-state regression's weight")
    parser.add_argument("--unroll", type=int, default=2, choices=(1, 2), help="chained steps trained (1 or 2)")
    parser.add_argument(
        "--draft-vocab", type=int, default=-1, help="a reduced vocabulary of N tokens (0: none; -1: 8192 past 16k)"
    )
    parser.add_argument(
        "--init", choices=("random", "target"), default="random", help="the layer's start (target: a copy of its last)"
    )
    parser.add_argument("--data-cache", type=Path, help="keep the generated data in this file, reuse it when there")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    started = time.perf_counter()
    mx.random.seed(args.seed)
    model, tokenizer = load_target(args.target)
    text = _text_model(model)
    config = json.loads((args.target / "config.json").read_text())
    vocab = int(text.args.vocab_size)
    data_started = time.perf_counter()
    key = (str(args.target), config_hash(config), PROMPTS_VERSION, args.prompts, args.tokens, args.seed)
    sequences = _cached(args.data_cache, key)
    if sequences is None:
        ids = prompts(tokenizer, args.prompts, seed=args.seed)
        sequences = greedy_sequences(model, tokenizer, ids, args.tokens, batch=args.gen_batch)
        if args.data_cache is not None:
            args.data_cache.parent.mkdir(parents=True, exist_ok=True)
            args.data_cache.write_bytes(pickle.dumps((key, sequences)))
    positions = sum(len(s.tokens) - 1 for s in sequences)
    data_seconds = time.perf_counter() - data_started
    print(f"data: {len(sequences)} sequences, {positions} positions in {data_seconds:.0f}s", flush=True)
    held_out, training = sequences[: args.held_out], sequences[args.held_out :]

    draft_vocab = args.draft_vocab if args.draft_vocab >= 0 else (8192 if vocab > 16384 else 0)
    draft_tokens = None
    if draft_vocab and draft_vocab < vocab:
        counts = np.bincount(np.concatenate([s.labels for s in training]), minlength=vocab)
        draft_tokens = sorted(np.argsort(-counts, kind="stable")[:draft_vocab].tolist())
        held = np.concatenate([s.labels for s in held_out]) if held_out else np.zeros(0, np.int32)
        covered = np.isin(held, draft_tokens).mean() if held.size else float("nan")
        print(f"reduced vocabulary: {draft_vocab} of {vocab} tokens cover {covered:.3f} of held-out choices")
    head = build_head(model, draft_tokens, copy_layer=args.init == "target")
    t2d = None
    if draft_tokens:
        table = np.full(vocab, -1, np.int32)
        table[draft_tokens] = np.arange(len(draft_tokens))
        t2d = mx.array(table)
        logits_of = head.lm_head
    else:
        target_head = lm_head(model)
        logits_of = target_head
    embed = text.model.embed_tokens
    # Only the head's own weights learn (the reduced head's rows are the target's, frozen).
    if draft_tokens:
        head.lm_head.freeze()
        head.freeze(recurse=False, keys=["d2t"])
    rng = random.Random(args.seed)
    steps_per_epoch = math.ceil(len(training) / args.batch)
    steps = steps_per_epoch * args.epochs
    warmup = max(1, steps // 20)
    schedule = optim.join_schedules(
        [optim.linear_schedule(1e-5, args.lr, warmup), optim.cosine_decay(args.lr, steps - warmup, args.lr * 0.05)],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.0)
    loss_fn = make_loss(head, embed, logits_of, t2d, args.unroll, args.reg_weight)
    value_and_grad = nn.value_and_grad(head, loss_fn)
    train_started = time.perf_counter()
    step = 0
    for epoch in range(args.epochs):
        seen = right = 0.0
        losses = []
        for batch in make_batches(training, args.batch, rng):
            (loss, (correct, total)), grads = value_and_grad(head, *batch)
            optimizer.update(head, grads)
            mx.eval(head.parameters(), optimizer.state, loss, correct, total)
            losses.append(loss.item())
            seen += total.item()
            right += correct.item()
            step += 1
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(losses):.3f}, train agreement {right / seen:.3f} "
            f"({time.perf_counter() - train_started:.0f}s)",
            flush=True,
        )
    train_seconds = time.perf_counter() - train_started
    held = agreement(head, embed, logits_of, t2d, make_batches(held_out, args.batch, random.Random(0)))
    print(f"held-out agreement (first draft, teacher-forced): {held:.3f}")
    assert trainable_keys(head)
    args_text = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    head_config = {
        **args_text,
        "num_hidden_layers": 1,
        KEY: {
            "target": str(args.target),
            "target_config_sha256": config_hash(config),
            "vocab_size": vocab,
            "hidden_size": int(text.args.hidden_size),
            "model_type": config.get("model_type"),
            "layer_index": _layer_index(head, model),
            "draft_vocab": len(draft_tokens) if draft_tokens else 0,
            "trained": {
                "prompts": args.prompts,
                "tokens": args.tokens,
                "positions": positions,
                "epochs": args.epochs,
                "steps": steps,
                "unroll": args.unroll,
                "seed": args.seed,
                "held_out_agreement": round(held, 4),
                "data_seconds": round(data_seconds),
                "train_seconds": round(train_seconds),
            },
        },
    }
    save_head(head, args.out, head_config)
    size = sum(v.nbytes for _, v in tree_flatten(head.parameters())) / 2**20
    print(f"wrote {args.out} ({size:.1f} MiB in float32) in {time.perf_counter() - started:.0f}s in all")


def _cached(path: Path | None, key: tuple):
    """The sequences kept in ``path`` for the same target, kinds of prompt, prompts, tokens and seed, or None."""
    if path is None or not path.is_file():
        return None
    kept, sequences = pickle.loads(path.read_bytes())
    return sequences if kept == key else None


def _layer_index(head, model) -> int:
    from runner.drafting.head import full_attention_index

    return full_attention_index(_text_model(model))


if __name__ == "__main__":
    main()
