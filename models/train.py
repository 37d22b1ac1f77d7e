"""Train the embedded default model pair from text that ships with CPython.

    python models/train.py [--out models/default] [--seed 0]

Writes ``<out>/target`` (llama, ~14M parameters) and ``<out>/draft`` (llama,
~1M parameters) in the mlx-lm layout: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json.  Both share one byte-level BPE
tokenizer trained on ``pydoc_data.topics``.  The draft is distilled on the
target's own greedy continuations of corpus prompts, which is what makes its
proposals worth verifying.

Runs on the CPU with MLX and is deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
VOCAB_SIZE = 4096
CONTEXT_LENGTH = 8192

TARGET_SHAPE = dict(
    hidden_size=384,
    num_hidden_layers=8,
    intermediate_size=1024,
    num_attention_heads=6,
    num_key_value_heads=2,
)
DRAFT_SHAPE = dict(
    hidden_size=128,
    num_hidden_layers=2,
    intermediate_size=384,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def corpus_documents() -> list[str]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return [topics[name] for name in sorted(topics)]


def train_tokenizer(documents: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, bos_id)])
    return tokenizer


def model_config(shape: dict, tokenizer) -> dict:
    return dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=tokenizer.get_vocab_size(),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id(BOS),
        eos_token_id=tokenizer.token_to_id(EOS),
        pad_token_id=tokenizer.token_to_id(PAD),
        torch_dtype="float16",
        **shape,
    )


def build_model(config: dict) -> llama.Model:
    return llama.Model(llama.ModelArgs.from_dict(config))


def encode_corpus(tokenizer, documents: list[str]) -> np.ndarray:
    eos_id = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(documents):
        ids.extend(encoding.ids)  # starts with BOS (post-processor)
        ids.append(eos_id)
    return np.array(ids, dtype=np.int32)


def windows(ids: np.ndarray, length: int, rng: np.random.Generator, count: int) -> np.ndarray:
    starts = rng.integers(0, len(ids) - length - 1, size=count)
    return np.stack([ids[s : s + length + 1] for s in starts])


def lr_schedule(peak: float, steps: int, warmup: int):
    def schedule(step):
        step = step.astype(mx.float32) if isinstance(step, mx.array) else mx.array(step, mx.float32)
        warm = peak * (step + 1) / warmup
        progress = mx.clip((step - warmup) / max(1, steps - warmup), 0.0, 1.0)
        cosine = 0.1 * peak + 0.9 * peak * 0.5 * (1 + mx.cos(math.pi * progress))
        return mx.where(step < warmup, warm, cosine)

    return schedule


def fit(model, batches, steps: int, peak_lr: float, label: str):
    """Plain next-token cross-entropy training; batches(step) -> (inputs, targets, mask)."""
    optimizer = optim.AdamW(learning_rate=lr_schedule(peak_lr, steps, warmup=max(1, steps // 20)), weight_decay=0.01)

    def loss_fn(model, inputs, targets, mask):
        logits = model(inputs).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, targets, reduction="none")
        return (losses * mask).sum() / mask.sum()

    step_fn = nn.value_and_grad(model, loss_fn)

    start = time.perf_counter()
    for step in range(steps):
        inputs, targets, mask = batches(step)
        loss, grads = step_fn(model, inputs, targets, mask)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        if step % 100 == 0 or step == steps - 1:
            print(
                f"[{label}] step {step:5d}/{steps} loss {loss.item():.3f} ({time.perf_counter() - start:.0f}s)",
                flush=True,
            )


def greedy_continuations(model, prompts: np.ndarray, new_tokens: int, batch: int = 64) -> np.ndarray:
    """The target's own greedy continuations of each prompt row, batched."""
    out = []
    for i in range(0, len(prompts), batch):
        rows = mx.array(prompts[i : i + batch])
        cache = make_prompt_cache(model)
        logits = model(rows, cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        generated = [y]
        for _ in range(new_tokens - 1):
            logits = model(y[:, None], cache=cache)
            y = mx.argmax(logits[:, -1, :], axis=-1)
            generated.append(y)
        mx.eval(generated)
        out.append(np.array(mx.stack(generated, axis=1)))
    return np.concatenate(out).astype(np.int32)


def save_model(model, config: dict, tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            dict(
                tokenizer_class="PreTrainedTokenizerFast",
                bos_token=BOS,
                eos_token=EOS,
                pad_token=PAD,
                model_max_length=CONTEXT_LENGTH,
                clean_up_tokenization_spaces=False,
            ),
            indent=2,
        )
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=700)
    parser.add_argument("--draft-steps", type=int, default=600)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--distill-prompts", type=int, default=1024)
    parser.add_argument("--distill-tokens", type=int, default=96)
    args = parser.parse_args()

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    documents = corpus_documents()
    tokenizer = train_tokenizer(documents)
    ids = encode_corpus(tokenizer, documents)
    print(f"corpus: {len(documents)} documents, {len(ids)} tokens, vocab {tokenizer.get_vocab_size()}", flush=True)

    target_config = model_config(TARGET_SHAPE, tokenizer)
    target = build_model(target_config)
    full_mask = mx.ones((args.batch, args.seq_len))

    def corpus_batches(step):
        rows = windows(ids, args.seq_len, rng, args.batch)
        return mx.array(rows[:, :-1]), mx.array(rows[:, 1:]), full_mask

    fit(target, corpus_batches, args.target_steps, args.lr, "target")
    target.eval()

    prompt_len = 32
    prompts = windows(ids, prompt_len - 1, rng, args.distill_prompts)
    start = time.perf_counter()
    continuations = greedy_continuations(target, prompts, args.distill_tokens)
    print(f"distillation set: {continuations.size} target tokens ({time.perf_counter() - start:.0f}s)", flush=True)
    sequences = np.concatenate([prompts, continuations], axis=1)  # (n, prompt_len + distill_tokens)
    draft_mask_row = np.zeros(sequences.shape[1] - 1, dtype=np.float32)
    draft_mask_row[prompt_len - 1 :] = 1.0  # learn the target's choices, not the corpus'
    draft_batch = args.batch

    def distill_batches(step):
        rows = sequences[rng.integers(0, len(sequences), size=draft_batch)]
        mask = mx.array(np.broadcast_to(draft_mask_row, (draft_batch, len(draft_mask_row))))
        return mx.array(rows[:, :-1]), mx.array(rows[:, 1:]), mask

    draft_config = model_config(DRAFT_SHAPE, tokenizer)
    draft = build_model(draft_config)
    fit(draft, distill_batches, args.draft_steps, 3e-3, "draft")

    if args.out.exists():
        shutil.rmtree(args.out)
    save_model(target, target_config, tokenizer, args.out / "target")
    save_model(draft, draft_config, tokenizer, args.out / "draft")
    for name, model in (("target", target), ("draft", draft)):
        n = sum(v.size for _, v in tree_flatten(model.parameters()))
        print(f"{name}: {n / 1e6:.2f}M parameters -> {args.out / name}")


if __name__ == "__main__":
    main()
