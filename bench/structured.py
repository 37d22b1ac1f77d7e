"""Constrained decoding's cost and the forced-token drafts (issue #21), on SmolLM2 in-process.

Each schema-heavy request (a chat asking to fill a form, answered under its
JSON schema, greedy) runs in seven ways, alternating the order between repeats:

- free, plain: the same prompt without a grammar, for as many tokens as the
  constrained answer has (``ignore_eos``): the speed to match;
- constrained, plain, forcing off: a mask per token, no forced drafts: what
  the grammar costs;
- constrained, plain: forced tokens fed as certain drafts (runner.constraint);
- both constrained plain ways again with each round's pass fed after its token is read, not queued before
  (``runner.decoders.QUEUE_CONSTRAINED_PASSES`` off: how constrained rounds ran before issue #40 item 4);
- free and constrained with the model's default drafter (n-gram lookup for
  SmolLM2), forced tokens on.

Rates are decode tokens per second after the first token (prefill excluded), as
bench/speculation.py counts them. Goals: constrained >= 0.95x free; forced
drafts >= 1.2x without them on schema-heavy output. The per-token mask and
per-schema compile times of llguidance and the runner-up are bench/grammar.py's.
"""

from __future__ import annotations

import json

from bench.speculation import after_first_token
from common.defaults import SMOLLM2_DIR
from common.settings import RunnerSettings
from runner import decoders
from runner.engine import Engine
from runner.request import GenerationRequest

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = [
    (
        "person",
        "Fill in a form about a software engineer.",
        {
            "type": "object",
            "properties": {
                "first_name": NAME,
                "last_name": NAME,
                "age": {"type": "integer", "minimum": 18, "maximum": 99},
                "email_verified": {"type": "boolean"},
                "programming_languages": {"type": "array", "items": NAME, "maxItems": 3},
                "employment_status": {"enum": ["employed", "self_employed", "unemployed"]},
            },
            "required": ["first_name", "last_name", "age", "email_verified", "programming_languages"],
            "additionalProperties": False,
        },
    ),
    (
        "order",
        "Write an order for office supplies.",
        {
            "type": "object",
            "properties": {
                "order_identifier": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
                "shipping_priority": {"enum": ["standard", "express", "overnight"]},
                "line_items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {
                        "type": "object",
                        "properties": {
                            "product_name": NAME,
                            "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 50},
                        },
                        "required": ["product_name", "quantity_ordered"],
                        "additionalProperties": False,
                    },
                },
            },
            "required": ["order_identifier", "shipping_priority", "line_items"],
            "additionalProperties": False,
        },
    ),
    (
        "weather",
        "Report today's weather in Paris.",
        {
            "type": "object",
            "properties": {
                "city_name": NAME,
                "temperature_celsius": {"type": "integer", "minimum": -50, "maximum": 60},
                "conditions": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
                "wind_speed_kilometres_per_hour": {"type": "integer", "minimum": 0, "maximum": 300},
                "humidity_percentage": {"type": "integer", "minimum": 0, "maximum": 100},
            },
            "required": [
                "city_name",
                "temperature_celsius",
                "conditions",
                "wind_speed_kilometres_per_hour",
                "humidity_percentage",
            ],
            "additionalProperties": False,
        },
    ),
]
REPEATS = 3


def _rate(
    engine: Engine, request: GenerationRequest, forcing: bool = True, queued: bool = True
) -> tuple[float, float, int, int]:
    """(tokens, seconds) after the first token; forced, and drafted-and-kept counts."""
    engine.grammars.forcing = forcing
    decoders.QUEUE_CONSTRAINED_PASSES = queued
    try:
        for last in engine.generate(request):
            pass
    finally:
        engine.grammars.forcing = True
        decoders.QUEUE_CONSTRAINED_PASSES = True
    s = last.stats
    return *after_first_token(s), s.forced, s.accepted


def run() -> None:
    engine = Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=0))
    rows = {}
    for name, ask, schema in SCHEMAS:
        grammar = json.dumps({"json_schema": schema})
        messages = (("user", ask),)
        base = {"messages": messages, "cache_prompt": False, "max_tokens": 300}
        constrained = GenerationRequest(**base, grammar=grammar, drafter="none")
        # The constrained answer's length sets the free runs' length.
        for last in engine.generate(constrained):
            pass
        length = last.stats.generated_tokens
        free = {**base, "max_tokens": length, "ignore_eos": True}
        configs = {
            "free, plain": (GenerationRequest(**free, drafter="none"), True, True),
            "constrained, plain, forcing off": (constrained, False, True),
            "constrained, plain, forcing off, passes not queued": (constrained, False, False),
            "constrained, plain (forced tokens as drafts)": (constrained, True, True),
            "constrained, plain (forced tokens as drafts), passes not queued": (constrained, True, False),
            "free, default drafter": (GenerationRequest(**free), True, True),
            "constrained, default drafter and forced tokens": (GenerationRequest(**base, grammar=grammar), True, True),
        }
        for label, (request, forcing, queued) in configs.items():  # warm-up
            _rate(engine, request, forcing, queued)
        for repeat in range(REPEATS):
            order = list(configs.items()) if repeat % 2 == 0 else list(configs.items())[::-1]
            for label, (request, forcing, queued) in order:
                tokens, seconds, forced, accepted = _rate(engine, request, forcing, queued)
                total = rows.setdefault(label, [0, 0.0, 0, 0])
                total[0] += tokens
                total[1] += seconds
                total[2] += forced
                total[3] += accepted
    print(
        f"## constrained decoding: SmolLM2-135M-Instruct ({engine.target.compute_dtype}), {len(SCHEMAS)} JSON "
        f"schemas, greedy, {REPEATS} alternated repeats\n"
    )
    print("| decoding | tok/s | vs free, plain | forced per token | drafts kept per token |")
    print("| --- | --- | --- | --- | --- |")
    free_rate = rows["free, plain"][0] / rows["free, plain"][1]
    for label, (tokens, seconds, forced, accepted) in rows.items():
        rate = tokens / seconds
        print(f"| {label} | {rate:.1f} | {rate / free_rate:.2f}x | {forced / tokens:.2f} | {accepted / tokens:.2f} |")
    plain_on = rows["constrained, plain (forced tokens as drafts)"]
    plain_off = rows["constrained, plain, forcing off"]
    print(
        f"\nForced tokens as drafts vs not (plain decoder): "
        f"{(plain_on[0] / plain_on[1]) / (plain_off[0] / plain_off[1]):.2f}x.\n"
    )


if __name__ == "__main__":
    run()
