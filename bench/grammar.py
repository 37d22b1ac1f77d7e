"""Grammar engines for constrained decoding (issue #21): llguidance vs outlines-core, on two vocabularies.

For each engine and vocabulary: the one-off tokenizer index (once per runner), the compile time of each
JSON schema (once per schema, then cached), and the time to compute the allowed-token mask at each step of
a valid output (on the host, once per generated token; the forward pass runs meanwhile on the device).
The vocabularies are SmolLM2's (49,152 tokens, models/smollm2) and Qwen2's (151,936, llama.cpp's test
vocabulary in .whl/vocab). xgrammar is not measured: on Linux x86_64 its wheel needs torch, transformers and
triton, which this project does not otherwise install.

Each output is the schema's sample instance, tokenized by the vocabulary and fed token by token; the mask
time is the median over its tokens (compute, then consume).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from common.defaults import SMOLLM2_DIR

REPO = Path(__file__).resolve().parent.parent
QWEN2_VOCAB = REPO / ".whl" / "vocab" / "ggml-vocab-qwen2.gguf"

# (name, schema, an instance of it)
SCHEMAS = [
    (
        "flat object",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "admin": {"type": "boolean"}},
            "required": ["name", "age", "admin"],
        },
        {"name": "Ada Lovelace", "age": 36, "admin": True},
    ),
    (
        "nested, arrays with bounds",
        {
            "type": "object",
            "properties": {
                "order": {"type": "string"},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                        "required": ["sku", "qty"],
                    },
                },
            },
            "required": ["order", "items"],
        },
        {"order": "A-1001", "items": [{"sku": "pen", "qty": 3}, {"sku": "ink", "qty": 1}]},
    ),
    (
        "enum, anyOf, optional",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["open", "closed", "pending"]},
                "value": {"anyOf": [{"type": "number"}, {"type": "null"}]},
                "note": {"type": "string"},
            },
            "required": ["status", "value"],
        },
        {"status": "pending", "value": 2.5, "note": "waiting for review"},
    ),
    (
        "string pattern and format",
        {
            "type": "object",
            "properties": {
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "when": {"type": "string", "format": "date"},
                "email": {"type": "string", "format": "email"},
            },
            "required": ["zip", "when", "email"],
        },
        {"zip": "75001", "when": "2026-12-04", "email": "ada@example.org"},
    ),
    (
        "a tool call (function name and arguments)",
        {
            "type": "object",
            "properties": {
                "name": {"const": "get_weather"},
                "arguments": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                    "required": ["city", "unit"],
                },
            },
            "required": ["name", "arguments"],
        },
        {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
    ),
]


def vocabularies() -> dict:
    """name -> a transformers fast tokenizer."""
    from transformers import PreTrainedTokenizerFast

    from runner.gguf import build_tokenizer, open_reader, read_metadata

    found = {}
    if (SMOLLM2_DIR / "tokenizer.json").is_file():
        found["SmolLM2 (49,152)"] = PreTrainedTokenizerFast(tokenizer_file=str(SMOLLM2_DIR / "tokenizer.json"))
    if QWEN2_VOCAB.is_file():
        qwen = build_tokenizer(read_metadata(open_reader(QWEN2_VOCAB)))
        found[f"Qwen2 ({qwen.get_vocab_size():,})"] = PreTrainedTokenizerFast(tokenizer_object=qwen)
    return found


def text_of(instance) -> str:
    return json.dumps(instance)  # the engines' default JSON whitespace: ", " and ": "


class Llguidance:
    name = "llguidance"

    def index(self, hf):
        import llguidance.hf

        return llguidance.hf.from_tokenizer(hf)

    def compile(self, index, schema):
        import llguidance

        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        matcher = llguidance.LLMatcher(index, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def walk(self, index, compiled, tokens) -> list[float]:
        times = []
        for token in tokens:
            start = time.perf_counter()
            mask = compiled.compute_bitmask()  # bytes, one bit per token
            times.append(time.perf_counter() - start)
            if not (mask[token // 8] >> (token % 8)) & 1:
                raise AssertionError(f"llguidance forbids token {token} of a valid instance")
            compiled.consume_token(token)
        return times


class OutlinesCore:
    name = "outlines-core"

    def index(self, hf):
        from outlines_core import Vocabulary

        eos = hf.eos_token_id if hf.eos_token_id is not None else 0
        by_text: dict[str, list[int]] = {}
        for token, token_id in hf.get_vocab().items():
            if token_id == eos:
                continue
            # The text a token stands for ("Ġ" is a space in byte-level vocabularies), as outlines' own
            # tokenizer adapter gives it (outlines itself is not installed here).
            by_text.setdefault(hf.convert_tokens_to_string([token]), []).append(token_id)
        return Vocabulary(eos, by_text)

    def compile(self, index, schema):
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        return Index(build_regex_from_schema(json.dumps(schema)), index)

    def walk(self, index, compiled, tokens) -> list[float]:
        state = compiled.get_initial_state()
        times = []
        for token in tokens:
            start = time.perf_counter()
            allowed = compiled.get_allowed_tokens(state)
            times.append(time.perf_counter() - start)
            if token not in allowed:
                raise AssertionError(f"outlines-core forbids token {token} of a valid instance")
            state = compiled.get_next_state(state, token)
        return times


def run() -> None:
    engines = [Llguidance(), OutlinesCore()]
    print("## grammar engines: JSON-schema constrained decoding, on the host\n")
    print(
        "| engine | vocabulary | tokenizer index (once per runner) | schema compile, median / worst "
        "| mask per token, median / p95 | schemas handled |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for vocab_name, hf in vocabularies().items():
        for engine in engines:
            start = time.perf_counter()
            index = engine.index(hf)
            index_s = time.perf_counter() - start
            compiles, masks, handled, failures = [], [], 0, []
            for name, schema, instance in SCHEMAS:
                tokens = hf.encode(text_of(instance), add_special_tokens=False)
                try:
                    start = time.perf_counter()
                    compiled = engine.compile(index, schema)
                    compiles.append(time.perf_counter() - start)
                    masks += engine.walk(index, compiled, tokens)
                    handled += 1
                except Exception as error:  # noqa: BLE001 - a schema an engine cannot handle is a finding
                    failures.append(f"{name}: {str(error)[:60]}")
            masks.sort()
            p95 = masks[int(0.95 * (len(masks) - 1))] if masks else float("nan")
            compile_ms = (
                f"{statistics.median(compiles) * 1000:.1f} ms / {max(compiles) * 1000:.1f} ms" if compiles else "-"
            )
            mask_us = f"{statistics.median(masks) * 1e6:.0f} us / {p95 * 1e6:.0f} us" if masks else "-"
            print(
                f"| {engine.name} | {vocab_name} | {index_s * 1000:.0f} ms | {compile_ms} | {mask_us} "
                f"| {handled} of {len(SCHEMAS)}{' (' + '; '.join(failures) + ')' if failures else ''} |",
                flush=True,
            )
    print()
