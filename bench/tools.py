"""What tool calls and the penalties cost (issue #21), on SmolLM2 in-process, greedy.

Three comparisons, each against free decoding of the same number of tokens
(``ignore_eos``), alternating the order between repeats:

- a required tool call in the generic layout (SmolLM2's template has no tool
  support: the tools in a system message, the answer held to
  ``{"tool_calls": [...]}`` by its grammar): decode tok/s, the share of forced
  tokens, and the time from the request to the complete call;
- ``tool_choice: auto`` on a marker family (hermes, SmolLM2 told so with
  ``tool_format``) answering in text: the lazy grammar's cost on text that
  never calls (each token masked, rounds not pipelined);
- presence, frequency and repetition penalties: their counts live on the
  device, so pipelined rounds should stay pipelined (goal: >= 0.95x free).

Rates are decode tokens per second after the first token (prefill excluded),
as bench/speculation.py counts them.
"""

from __future__ import annotations

import json
import time

from bench.speculation import after_first_token
from common.defaults import SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest

TOOLS = json.dumps(
    [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The current weather in a city",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 40},
                        "unit": {"enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city", "unit"],
                },
            },
        },
        {
            "type": "function",
            "function": {
                "name": "book_table",
                "description": "Book a table at a restaurant",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "restaurant": {"type": "string", "maxLength": 40},
                        "people": {"type": "integer", "minimum": 1, "maximum": 20},
                        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
                    },
                    "required": ["restaurant", "people", "time"],
                },
            },
        },
    ]
)
ASKS = ["What is the weather in Paris?", "Book a table for four at Chez Marcel at 20:00."]
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
REPEATS = 3


def _run(engine: Engine, request: GenerationRequest) -> tuple[int, float, int, float]:
    """(tokens, seconds) after the first token, forced tokens, and seconds from the request to the end."""
    started = time.perf_counter()
    for last in engine.generate(request):
        pass
    s = last.stats
    return *after_first_token(s), s.forced, time.perf_counter() - started


def _compare(engines: dict, configs: dict) -> dict:
    """Each config's totals over the repeats, alternated: {label: [tokens, seconds, forced, wall, runs]}."""
    for label, (engine, request) in configs.items():  # warm-up (and the tokenizer index, compiled grammars)
        _run(engines[engine], request)
    rows = {}
    for repeat in range(REPEATS):
        order = list(configs.items()) if repeat % 2 == 0 else list(configs.items())[::-1]
        for label, (engine, request) in order:
            tokens, seconds, forced, wall = _run(engines[engine], request)
            total = rows.setdefault(label, [0, 0.0, 0, 0.0, 0])
            for index, value in enumerate((tokens, seconds, forced, wall, 1)):
                total[index] += value
    return rows


def run() -> None:
    engines = {
        "generic": Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0)),
        "hermes": Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0, tool_format="hermes")),
    }
    configs = {}
    for index, ask in enumerate(ASKS):
        messages = (("user", ask),)
        call = GenerationRequest(messages=messages, tools=TOOLS, tool_choice="required", drafter="none", max_tokens=120)
        for last in engines["generic"].generate(call):
            pass
        same = {"messages": messages, "max_tokens": last.stats.generated_tokens, "ignore_eos": True, "drafter": "none"}
        configs[f"{index}: free"] = ("generic", GenerationRequest(**same, cache_prompt=False))
        configs[f"{index}: tool call (generic, required)"] = ("generic", call)
        text = {**same, "max_tokens": 80}
        configs[f"{index}: free, 80"] = ("hermes", GenerationRequest(**text))
        configs[f"{index}: auto, lazy grammar, text"] = ("hermes", GenerationRequest(**text, tools=TOOLS))
        configs[f"{index}: penalties"] = ("hermes", GenerationRequest(**text, **PENALTIES))
    rows = _compare(engines, configs)

    def summed(kind: str) -> list:
        return [sum(v[i] for k, v in rows.items() if k.split(": ", 1)[1] == kind) for i in range(5)]

    dtype = engines["generic"].target.compute_dtype
    print(
        f"## tool calls and penalties: SmolLM2-135M-Instruct ({dtype}), {len(ASKS)} requests, greedy, {REPEATS} alternated repeats\n"
    )
    print("| decoding | tok/s | vs free, same length | forced per token | request to last token |")
    print("| --- | --- | --- | --- | --- |")
    for kind, base in (
        ("free", "free"),
        ("tool call (generic, required)", "free"),
        ("free, 80", "free, 80"),
        ("auto, lazy grammar, text", "free, 80"),
        ("penalties", "free, 80"),
    ):
        tokens, seconds, forced, wall, runs = summed(kind)
        b_tokens, b_seconds, *_ = summed(base)
        rate = tokens / seconds
        print(
            f"| {kind} | {rate:.1f} | {rate / (b_tokens / b_seconds):.2f}x | {forced / tokens:.2f} | "
            f"{1000 * wall / runs:.0f} ms |"
        )
    print()


if __name__ == "__main__":
    run()
