"""Training data for drafters learnt here (issue #41): a target's own greedy continuations with its hidden states.

    from models.drafter_data import load_target, prompts, greedy_sequences

- ``prompts(tokenizer, count, seed)``: varied prompts as token ids, deterministic for a seed. A model with a chat
  template gets user messages laid out by it, of five kinds: questions on many subjects; requests over sentences
  of CPython's help text (``pydoc_data.topics``); programming requests (a function to write, a concept to
  explain); requests over a function of CPython's own library (explain it, comment it, rename a name in it, copy
  it); and requests that copy or rearrange a passage or a list (a line per sentence, the sentences with a word,
  a list with a word replaced). An instruct model answers much of what people ask it with code and with the
  text they gave it; a head taught only the first two kinds agreed with SmolLM2 on 0.38 of the positions of such
  answers, against 0.63 on its own kinds'. One without a template (the default pair's target, a base model) gets
  passages of the help text to continue. The benchmark's own prompts (bench/speculation.py) are left out, and the
  concepts asked about leave out those they name (the for and while statements, class definitions). The code
  shown is the running Python's own library, so the prompts are the same for a seed and a Python version.
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

PROMPTS_VERSION = 2  # which kinds of prompt ``prompts`` makes (2: code and copying added; a data cache's key)
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


PROGRAMMING = (
    "reverses a string",
    "counts the words in a sentence",
    "checks whether a number is prime",
    "merges two sorted lists",
    "finds the largest value in a dictionary",
    "removes duplicate items from a list but keeps their order",
    "reads a CSV file and prints its rows",
    "converts a temperature from Celsius to Fahrenheit",
    "returns the n-th Fibonacci number",
    "checks whether a word is a palindrome",
    "flattens a nested list",
    "groups words by their first letter",
    "parses a date written as YYYY-MM-DD",
    "computes the median of a list of numbers",
    "sends a GET request and prints the status code",
    "validates an email address with a regular expression",
    "capitalizes the first letter of every word",
    "computes the factorial of a number",
    "splits a list into chunks of a given size",
    "counts how often each character appears in a string",
)
CONCEPTS = (
    "list comprehensions",
    "decorators",
    "generators",
    "the with statement and context managers",
    "exceptions and try/except",
    "dictionaries",
    "lambda functions",
    "f-strings",
    "type hints",
    "modules and imports",
    "sets",
    "tuples and unpacking",
    "recursion",
    "default arguments",
    "*args and **kwargs",
    "slicing",
)
PROGRAMMING_REQUESTS = (
    "Write a Python function that {}.",
    "Show me how to write a Python function that {}.",
    "Write a short Python script that {}, with a comment on each step.",
)
CONCEPT_REQUESTS = (
    "Explain {} in Python with an example.",
    "How do {} work in Python? Show some code.",
)
CODE_REQUESTS = (
    "Explain what this Python function does.\n\n```python\n{code}\n```",
    "Add a comment to each line of this code.\n\n```python\n{code}\n```",
    "In this function, rename {name} to {new} everywhere and give back the full code.\n\n```python\n{code}\n```",
    "Copy this code exactly, without changes:\n\n{code}",
    "Write a docstring for this function and show the function with it.\n\n{code}",
)
PASSAGE_REQUESTS = (
    "Put each sentence of this text on its own line.\n\n{text}",
    'Quote the sentences of this passage that contain the word "{word}".\n\n{text}',
    "Make a bulleted list of the points this text makes.\n\n{text}",
    "Rewrite this text in the first person plural.\n\n{text}",
)
LIST_REQUESTS = (
    'Rewrite this list with every "{old}" replaced by "{new}":\n{items}',
    "Sort this list alphabetically:\n{items}",
    "Number the items of this list:\n{items}",
)
# Modules of CPython's library whose short top-level functions are the code the requests above show.
CODE_MODULES = tuple(
    (
        "textwrap shlex string fnmatch glob heapq bisect calendar statistics colorsys difflib posixpath csv "
        "random fractions html base64 ipaddress json.encoder urllib.parse email.utils gettext tokenize pprint "
        "reprlib dataclasses functools copy configparser shutil tempfile filecmp mimetypes graphlib "
        "contextlib decimal datetime inspect dis logging warnings collections linecache traceback plistlib "
        "uuid fileinput subprocess platform sysconfig pkgutil"
    ).split()
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


def library_functions() -> list[tuple[str, list[str]]]:
    """Short top-level functions (4-20 lines) of ``CODE_MODULES``' source, each with its parameters' names, in a fixed
    order."""
    import ast
    import importlib
    import inspect
    import warnings

    out = []
    for name in CODE_MODULES:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                source = inspect.getsource(importlib.import_module(name))
            except (ImportError, OSError, TypeError):
                continue
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef):
                code = ast.get_source_segment(source, node) or ""
                if 4 <= code.count("\n") + 1 <= 20 and len(code) <= 700:
                    names = [a.arg for a in node.args.args if a.arg not in ("self", "cls") and len(a.arg) > 1]
                    out.append((code, names))
    return out


def _chat_text(rng: random.Random, sentences: list[str], functions: list[tuple[str, list[str]]]) -> str:
    """One user message of the five kinds in the module's docstring."""
    kind = rng.random()
    if kind < 0.3:
        return rng.choice(QUESTIONS).format(rng.choice(SUBJECTS))
    if kind < 0.5:
        start = rng.randrange(len(sentences) - 1)
        return rng.choice(ABOUT_TEXT).format(" ".join(sentences[start : start + rng.choice((1, 1, 2))]))
    if kind < 0.65:
        if rng.random() < 0.6:
            return rng.choice(PROGRAMMING_REQUESTS).format(rng.choice(PROGRAMMING))
        return rng.choice(CONCEPT_REQUESTS).format(rng.choice(CONCEPTS))
    if kind < 0.85 and functions:
        code, names = rng.choice(functions)
        request = rng.choice(CODE_REQUESTS if names else [r for r in CODE_REQUESTS if "{name}" not in r])
        name = rng.choice(names) if names else ""
        return request.format(code=code, name=name, new=f"{name}_{rng.choice(('value', 'arg', 'in', 'x'))}")
    if rng.random() < 0.6:
        start = rng.randrange(len(sentences) - 4)
        text = " ".join(sentences[start : start + rng.randint(2, 4)])
        words = [w for w in (w.strip(".,;:()") for w in text.split()) if len(w) >= 5]
        return rng.choice(PASSAGE_REQUESTS).format(text=text, word=rng.choice(words) if words else "the")
    items = rng.sample(SUBJECTS, rng.randint(3, 6))
    old = rng.choice(items).split()[-1]
    listed = "\n".join(f"- {item}" for item in items)
    return rng.choice(LIST_REQUESTS).format(items=listed, old=old, new=rng.choice(("topic", "thing", "subject")))


def _overlaps_bench(text: str, bench: tuple[str, ...]) -> bool:
    return any(text[:40] in b or b[:40] in text for b in bench)


def prompts(tokenizer, count: int, seed: int = 0, chat: bool | None = None) -> list[list[int]]:
    """``count`` prompts as token ids (see the module's docstring); ``chat`` None: whether the tokenizer has a chat
    template."""
    rng = random.Random(seed)
    chat = bool(getattr(tokenizer, "has_chat_template", False)) if chat is None else chat
    bench = _bench_prompts()
    sentences = [s for s in help_sentences() if not _overlaps_bench(s, bench)]
    functions = library_functions() if chat else []
    out = []
    while len(out) < count:
        if chat:
            text = _chat_text(rng, sentences, functions)
            if _overlaps_bench(text, bench):
                continue
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
