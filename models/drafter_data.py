"""Training data for drafters learnt here (issue #41): a target's own greedy continuations with its hidden states.

    from models.drafter_data import load_target, prompts, greedy_sequences

- ``prompts(tokenizer, count, seed)``: varied prompts as token ids, deterministic for a seed. A model with a chat
  template gets user messages laid out by it (questions on many subjects, and requests over sentences of
  CPython's help text, ``pydoc_data.topics``); one without (the default pair's target, a base model) gets
  passages of that help text to continue. The benchmark's own prompts (bench/speculation.py) are left out.
- ``greedy_sequences(model, prompts, new_tokens)``: the target's greedy continuation of each prompt, batched
  (left-padded rows on mlx-lm's ``BatchKVCache``), and for every position j of prompt + continuation the target's
  last hidden state h_j (its inner model's output, after the final norm: what ``runner.drafting.mtp.HiddenModel``
  keeps) and its greedy choice after j (``labels[j]``, the argmax of its LM head on h_j). One pass: the hidden
  states are the generation's own, no second run over the sequences.

Everything runs on the target as loaded (``load_target``: float32, as the runner runs it on a CPU).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

SUBJECTS = (
    "rivers",
    "the moon",
    "bread",
    "volcanoes",
    "the printing press",
    "honey bees",
    "chess",
    "the water cycle",
    "photosynthesis",
    "the Roman empire",
    "trains",
    "coffee",
    "the immune system",
    "electric cars",
    "the ocean",
    "gardening",
    "the internet",
    "mountains",
    "music theory",
    "recycling",
    "the solar system",
    "sleep",
    "libraries",
    "bicycles",
    "weather forecasts",
    "the human heart",
    "deserts",
    "penguins",
    "a healthy breakfast",
    "learning a language",
    "sorting algorithms",
    "databases",
    "unit tests",
    "recursion",
    "version control",
    "compilers",
    "public speaking",
    "time management",
    "friendship",
    "the history of writing",
)
QUESTIONS = (
    "Write a short paragraph about {}.",
    "Explain {} to a child.",
    "What are three interesting facts about {}?",
    "Describe {} in a few sentences.",
    "Why does {} matter?",
    "Give me some advice about {}.",
    "Write a short story that involves {}.",
    "What is the history of {}?",
)
ABOUT_TEXT = (
    "{}",
    "Explain this: {}",
    "Summarize this in simple words: {}",
    "Continue this text: {}",
    "What does this mean? {}",
)


def _bench_prompts() -> tuple[str, ...]:
    from bench.speculation import DOCUMENT, GROUNDED_CHAT, GROUNDED_TEXT, PROSE

    return (*PROSE, DOCUMENT, *GROUNDED_CHAT, *GROUNDED_TEXT)


def help_sentences() -> list[str]:
    """Sentences of CPython's help text (pydoc_data.topics), cleaned of its layout, in a fixed order."""
    import pydoc_data.topics

    sentences = []
    for name in sorted(pydoc_data.topics.topics):
        text = re.sub(r"\s+", " ", pydoc_data.topics.topics[name])
        for sentence in re.split(r"(?<=[.!?]) ", text):
            words = sentence.split()
            layout = "*" in sentence or "===" in sentence or "---" in sentence
            if 6 <= len(words) <= 40 and sentence[0].isupper() and not layout:
                sentences.append(sentence)
    return sentences


def _overlaps_bench(text: str, bench: tuple[str, ...]) -> bool:
    return any(text[:40] in b or b[:40] in text for b in bench)


def prompts(tokenizer, count: int, seed: int = 0, chat: bool | None = None) -> list[list[int]]:
    """``count`` prompts as token ids (see the module's docstring); ``chat`` None: whether the tokenizer has a chat
    template."""
    rng = random.Random(seed)
    chat = bool(getattr(tokenizer, "has_chat_template", False)) if chat is None else chat
    bench = _bench_prompts()
    sentences = [s for s in help_sentences() if not _overlaps_bench(s, bench)]
    out = []
    while len(out) < count:
        if chat:
            if rng.random() < 0.5:
                text = rng.choice(QUESTIONS).format(rng.choice(SUBJECTS))
            else:
                start = rng.randrange(len(sentences) - 1)
                text = rng.choice(ABOUT_TEXT).format(" ".join(sentences[start : start + rng.choice((1, 1, 2))]))
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        else:
            start = rng.randrange(len(sentences) - 3)
            text = " ".join(sentences[start : start + 3])
            words = text.split()
            text = " ".join(words[: rng.randint(5, min(40, len(words)))])
            ids = tokenizer.encode(text)
        out.append(list(ids))
    return out


@dataclass
class Sequence:
    """One prompt and the target's greedy continuation of it."""

    tokens: list[int]  # prompt + continuation
    prompt_tokens: int
    hidden: np.ndarray  # (len(tokens), width) float32: h_j, the target's last hidden state at position j
    labels: np.ndarray  # (len(tokens),) int32: the target's greedy token after position j (argmax of its head on h_j)


def load_target(folder: str | Path):
    """(model, tokenizer) as the runner loads the target on a CPU: float32, no row padding."""
    from runner.loading.load import load_model

    loaded = load_model(folder, "float32", row_padding=False)
    return loaded.model, loaded.tokenizer


def greedy_sequences(
    model, tokenizer, prompt_ids: list[list[int]], new_tokens: int, batch: int = 16, log=print
) -> list[Sequence]:
    """The target's greedy continuations of ``prompt_ids`` (at most ``new_tokens`` each, ending at an end of turn or
    EOS), with its hidden states and greedy choices at every position (see the module's docstring)."""
    from mlx_lm.models.cache import BatchKVCache

    from runner.drafting.mtp import _text_model, lm_head
    from runner.request import end_of_turn_ids

    text = _text_model(model)
    head = lm_head(model)
    ends = set(tokenizer.eos_token_ids) | set(end_of_turn_ids(tokenizer))
    layers = len(text.model.layers)
    out: list[Sequence] = []
    for first in range(0, len(prompt_ids), batch):
        rows = prompt_ids[first : first + batch]
        width = max(len(r) for r in rows)
        padding = [width - len(r) for r in rows]
        cache = [BatchKVCache(padding) for _ in range(layers)]
        inputs = mx.array([[0] * p + r for p, r in zip(padding, rows)])
        hidden_steps, label_steps = [], []
        done = np.zeros(len(rows), dtype=bool)
        lengths = np.full(len(rows), new_tokens)
        for step in range(new_tokens + 1):
            hidden = text.model(inputs, cache=cache)
            labels = mx.argmax(head(hidden), axis=-1)
            mx.eval(hidden, labels)
            hidden_steps.append(np.array(hidden.astype(mx.float32)))
            label_steps.append(np.array(labels))
            if step == new_tokens:
                break
            chosen = label_steps[-1][:, -1]
            for i, token in enumerate(chosen):
                if not done[i] and int(token) in ends:
                    done[i], lengths[i] = True, step + 1  # the end token is kept, nothing after it
            if done.all():
                break
            inputs = mx.array(chosen)[:, None]
        hidden_all = np.concatenate(hidden_steps, axis=1)  # (rows, width + steps, dim)
        labels_all = np.concatenate(label_steps, axis=1)
        for i, row in enumerate(rows):
            generated = labels_all[i, width - 1 : width - 1 + lengths[i]].tolist()
            tokens = row + generated
            # Positions of tokens: the prompt's after its padding, then one per generated token; the hidden state
            # of the last generated token was computed too (the step that fed it) unless the row stopped early.
            stop = min(padding[i] + len(tokens), hidden_all.shape[1])
            kept = slice(padding[i], stop)
            out.append(
                Sequence(
                    tokens=tokens[: stop - padding[i]],
                    prompt_tokens=len(row),
                    hidden=hidden_all[i, kept],
                    labels=labels_all[i, kept].astype(np.int32),
                )
            )
        log(f"drafter data: {len(out)}/{len(prompt_ids)} sequences", flush=True)
    return out
