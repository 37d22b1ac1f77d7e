"""A model that thinks before it answers, served with its reasoning apart from its answer in every API (issue #38):
OpenAI's ``reasoning_content`` (and its Responses API's reasoning items), Anthropic's ``thinking`` blocks,
Ollama's ``message.thinking``, the gRPC chunks' ``reasoning``; streamed and not, each read with the official
client. The model is ``models/reasoning`` (``models/train_reasoning.py``: ~1.7M parameters trained to answer
arithmetic in Qwen3's way, under Qwen3's real chat template); ``enable_thinking=False`` gives no reasoning.

The switches in each API (think off; a budget of reasoning tokens, its end forced), a grammar that holds the answer
and not the reasoning, stop strings on the answer only, and the same greedy answer alone, batched and with every
drafter.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.processes import SupervisorProcess, model_toml

REASONING_MODEL = Path(__file__).resolve().parents[1] / "models" / "reasoning"
ASK = [{"role": "user", "content": "What is 12 plus 7?"}]
BLOCK = re.compile(r"<think>\n(.*)\n</think>\n\n(.*)", re.DOTALL)


@pytest.fixture(scope="module")
def sup(tmp_path_factory):
    assert (REASONING_MODEL / "config.json").is_file(), f"{REASONING_MODEL} is missing: run `make reasoning-model`"
    models = model_toml("thinker", target=REASONING_MODEL, draft=None) + model_toml(
        "thinker-drafted", target=REASONING_MODEL, draft=REASONING_MODEL
    )
    process = SupervisorProcess(tmp_path_factory.mktemp("reasoning"), models).wait_ready(120)
    yield process
    assert process.stop() == 0


def as_written(sup, messages, **template_kwargs) -> str:
    """The model's greedy answer as it writes it, block and all: the conversation laid out by its template here
    and sent as a raw prompt, which nothing splits."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(REASONING_MODEL)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    chunks = sup.client.generate(timeout=60, model="thinker", prompt=prompt, max_tokens=64)
    return "".join(chunk.text for chunk in chunks)


@pytest.fixture(scope="module")
def written(sup):
    """(its reasoning, its answer) for ASK, as it writes them (the block's newlines are the template's)."""
    match = BLOCK.fullmatch(as_written(sup, ASK))
    assert match, "the model does not write a <think> block"
    return match.group(1), match.group(2)


def test_openai_chat_gives_the_reasoning_apart_streamed_and_not(sup, written):
    THOUGHT, ANSWER = written
    client = sup.openai()
    answer = client.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=64)
    message = answer.choices[0].message
    assert message.reasoning_content == THOUGHT and message.content == ANSWER
    assert 0 < answer.usage.completion_tokens_details.reasoning_tokens < answer.usage.completion_tokens
    chunks = list(
        client.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=64, stream=True)
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == THOUGHT
    assert "".join(d.content or "" for d in deltas) == ANSWER
    off = (
        client.chat.completions.create(
            model="thinker",
            messages=ASK,
            temperature=0,
            max_tokens=64,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        .choices[0]
        .message
    )
    assert off.content == as_written(sup, ASK, enable_thinking=False) and not getattr(off, "reasoning_content", None)


def test_an_earlier_turns_reasoning_goes_back_as_the_template_wants_it(sup, written):
    THOUGHT, ANSWER = written
    client = sup.openai()
    conversation = [
        *ASK,
        {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT},
        {"role": "user", "content": "What is 5 plus 3?"},
    ]
    message = (
        client.chat.completions.create(model="thinker", messages=conversation, temperature=0, max_tokens=64)
        .choices[0]
        .message
    )
    expected = BLOCK.fullmatch(as_written(sup, conversation))
    assert (message.reasoning_content, message.content) == (expected.group(1), expected.group(2))


def test_anthropic_gives_thinking_blocks_with_their_signatures(sup, written):
    THOUGHT, ANSWER = written
    claude = sup.anthropic()
    fields = {"model": "thinker", "max_tokens": 64, "messages": ASK, "extra_body": {"temperature": 0}}
    message = claude.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == THOUGHT and message.content[0].signature
    assert message.content[1].text == ANSWER
    with claude.messages.stream(**fields) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].thinking == THOUGHT and final.content[1].text == ANSWER
    assert "thinking" in kinds or "content_block_delta" in kinds
    again = claude.messages.create(  # the earlier turn's thinking block comes back with the history
        **{**fields, "messages": [*ASK, {"role": "assistant", "content": message.content}, ASK[0]]}
    )
    assert again.content[-1].type == "text"


def test_ollama_gives_message_thinking(sup, written):
    THOUGHT, ANSWER = written
    client = sup.ollama()
    answer = client.chat(model="thinker", messages=ASK, options={"temperature": 0, "num_predict": 64})
    assert answer.message.thinking == THOUGHT and answer.message.content == ANSWER
    parts = list(client.chat(model="thinker", messages=ASK, options={"temperature": 0, "num_predict": 64}, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == THOUGHT
    assert "".join(p.message.content for p in parts) == ANSWER
    assert "thinking" in client.show("thinker").capabilities


def test_responses_give_a_reasoning_item_and_grpc_its_own_field(sup, written):
    THOUGHT, ANSWER = written
    client = sup.openai()
    response = client.responses.create(model="thinker", input=ASK[0]["content"], temperature=0, max_output_tokens=64)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == THOUGHT and response.output_text == ANSWER
    assert response.usage.output_tokens_details.reasoning_tokens > 0
    with client.responses.stream(model="thinker", input=ASK[0]["content"], temperature=0, max_output_tokens=64) as s:
        deltas = [e.delta for e in s if e.type == "response.reasoning_text.delta"]
        final = s.get_final_response()
    assert "".join(deltas) == THOUGHT and final.output_text == ANSWER
    chunks = list(sup.client.generate(timeout=60, model="thinker", messages=ASK, max_tokens=64))
    assert "".join(c.reasoning for c in chunks) == THOUGHT and "".join(c.text for c in chunks) == ANSWER


def tokens_of(text: str) -> int:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return len(load_tokenizer(REASONING_MODEL).encode(text, add_special_tokens=False))


@pytest.mark.parametrize("budget", [0, 3])
def test_a_budget_ends_the_reasoning_in_every_api(sup, written, budget):
    """The reasoning has at most ``budget`` tokens, its end forced there, and the answer follows it."""
    THOUGHT, _ = written
    assert tokens_of(THOUGHT) > budget + 2, "the model's own reasoning is too short to cut"
    client = sup.openai()
    answer = client.chat.completions.create(
        model="thinker", messages=ASK, temperature=0, max_tokens=64, extra_body={"reasoning_budget": budget}
    )
    message = answer.choices[0].message
    assert tokens_of(getattr(message, "reasoning_content", None) or "") <= budget and message.content
    assert answer.usage.completion_tokens_details.reasoning_tokens <= budget
    assert answer.choices[0].finish_reason == "stop"
    claude = sup.anthropic()
    message = claude.messages.create(
        model="thinker",
        max_tokens=64,
        messages=ASK,
        extra_body={"temperature": 0},
        thinking={"type": "enabled", "budget_tokens": budget},
    )
    thinking = [block.thinking for block in message.content if block.type == "thinking"]
    assert tokens_of("".join(thinking)) <= budget and message.content[-1].type == "text" and message.content[-1].text
    chunks = list(
        sup.client.generate(timeout=60, model="thinker", messages=ASK, max_tokens=64, reasoning_budget=budget)
    )
    assert tokens_of("".join(c.reasoning for c in chunks)) <= budget and "".join(c.text for c in chunks)
    assert chunks[-1].stats.reasoning_tokens <= budget and chunks[-1].stats.forced >= 1  # the end, forced


def test_think_off_gives_no_reasoning_in_every_api(sup):
    """Each API's switch turns the reasoning off: the answer is the model's without a block."""
    plain = as_written(sup, ASK, enable_thinking=False)
    client = sup.openai()
    message = (
        client.chat.completions.create(
            model="thinker", messages=ASK, temperature=0, max_tokens=64, reasoning_effort="none"
        )
        .choices[0]
        .message
    )
    assert message.content == plain and not getattr(message, "reasoning_content", None)
    claude = sup.anthropic()
    off = claude.messages.create(
        model="thinker", max_tokens=64, messages=ASK, extra_body={"temperature": 0}, thinking={"type": "disabled"}
    )
    assert [block.type for block in off.content] == ["text"] and off.content[0].text == plain
    ollama = sup.ollama().chat(
        model="thinker", messages=ASK, think=False, options={"temperature": 0, "num_predict": 64}
    )
    assert ollama.message.content == plain and not ollama.message.thinking
    response = client.responses.create(
        model="thinker", input=ASK[0]["content"], temperature=0, max_output_tokens=64, reasoning={"effort": "none"}
    )
    assert [item.type for item in response.output] == ["message"] and response.output_text == plain
    chunks = list(sup.client.generate(timeout=60, model="thinker", messages=ASK, max_tokens=64, think="off"))
    assert "".join(c.text for c in chunks) == plain and not "".join(c.reasoning for c in chunks)
    on = sup.ollama().chat(model="thinker", messages=ASK, think=True, options={"temperature": 0, "num_predict": 64})
    assert on.message.thinking  # and on again


def test_switches_a_model_cannot_honour_are_refused(sup):
    import anthropic
    import openai

    client = sup.openai()
    with pytest.raises(openai.BadRequestError, match="reasoning_effort"):
        client.chat.completions.create(model="thinker", messages=ASK, reasoning_effort="extreme")
    with pytest.raises(openai.BadRequestError, match="reasoning_budget"):
        client.completions.create(model="thinker", prompt="2+2=", extra_body={"reasoning_budget": 4})
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        sup.anthropic().messages.create(
            model="thinker", max_tokens=8, messages=ASK, thinking={"type": "enabled", "budget_tokens": -1}
        )
    import ollama

    with pytest.raises(ollama.ResponseError, match="think"):
        sup.ollama().chat(model="thinker", messages=ASK, think="extreme")


SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def test_a_json_schema_holds_the_answer_not_the_reasoning(sup):
    """50 answers sampled at temperature 1 under a schema: each reasons freely (its block is not JSON) and then
    answers with a valid object."""
    client = sup.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SCHEMA}}
    choices = []
    for seed in range(5):
        answer = client.chat.completions.create(
            model="thinker", messages=ASK, temperature=1, max_tokens=96, n=10, seed=seed, response_format=fmt
        )
        choices += answer.choices
    assert len(choices) == 50
    reasoned = 0
    for choice in choices:
        value = json.loads(choice.message.content)
        assert set(value) == {"answer", "sure"} and isinstance(value["answer"], int)
        assert isinstance(value["sure"], bool)
        reasoned += bool(getattr(choice.message, "reasoning_content", None))
    assert reasoned >= 45, f"only {reasoned} of 50 reasoned: the grammar held the reasoning"


def test_stop_strings_apply_to_the_answer_only(sup, written):
    THOUGHT, ANSWER = written
    in_thought = next(word for word in THOUGHT.split() if word not in ANSWER and len(word) > 1)
    client = sup.openai()
    fields = {"model": "thinker", "messages": ASK, "temperature": 0, "max_tokens": 64}
    choice = client.chat.completions.create(**fields, stop=[in_thought]).choices[0]
    assert (choice.message.reasoning_content, choice.message.content) == (THOUGHT, ANSWER)
    in_answer = ANSWER.strip()[-2:]
    choice = client.chat.completions.create(**fields, stop=[in_answer]).choices[0]
    assert choice.message.reasoning_content == THOUGHT and choice.message.content == ANSWER[: ANSWER.rindex(in_answer)]


def test_greedy_answers_are_the_same_alone_batched_and_with_every_drafter(sup):
    """With a budget and a grammar (the phase held as a constraint), greedy answers do not depend on the drafter
    or on the batch they decode in."""
    questions = [f"What is {a} plus {b}?" for a, b in ((12, 7), (3, 30), (41, 8), (25, 25))]
    fmt = json.dumps({"json_schema": SCHEMA})

    def ask(question, model="thinker", drafter="none", budget=5, grammar=fmt):
        chunks = sup.client.generate(
            timeout=60,
            model=model,
            messages=[{"role": "user", "content": question}],
            max_tokens=64,
            drafter=drafter,
            reasoning_budget=budget,
            grammar=grammar,
        )
        return [(c.reasoning, c.text) for c in chunks]

    def joined(parts):
        return "".join(r for r, _ in parts), "".join(t for _, t in parts)

    for budget, grammar in ((5, fmt), (5, ""), (1000, fmt)):
        alone = [joined(ask(q, budget=budget, grammar=grammar)) for q in questions]
        assert not grammar or all(json.loads(text) for _, text in alone)
        for model, drafter in (("thinker", "ngram"), ("thinker-drafted", "model")):
            drafted = [joined(ask(q, model, drafter, budget, grammar)) for q in questions]
            assert drafted == alone, (model, drafter, budget, grammar)
        with ThreadPoolExecutor(len(questions)) as pool:
            batched = list(pool.map(lambda q, b=budget, g=grammar: joined(ask(q, budget=b, grammar=g)), questions))
        assert batched == alone, (budget, grammar)


def test_an_earlier_turns_reasoning_reaches_a_template_that_keeps_it(sup):
    """Qwen3's template keeps the reasoning of the assistant's turns after the last user message (here the last
    message): sent back in each API's own field, it is in the prompt (counted), and without it not."""
    thought = "I should add the two numbers, then say the sum."
    least = tokens_of(thought) - 2  # its tokens, give or take a merge with the newlines around it

    def openai_tokens(reasoning):
        assistant = {"role": "assistant", "content": "The sum is 19."}
        if reasoning:
            assistant["reasoning_content"] = reasoning
        answer = sup.openai().chat.completions.create(model="thinker", messages=[*ASK, assistant], max_tokens=1)
        return answer.usage.prompt_tokens

    assert openai_tokens(thought) >= openai_tokens("") + least

    def anthropic_tokens(blocks):
        assistant = {"role": "assistant", "content": [*blocks, {"type": "text", "text": "The sum is 19."}]}
        return sup.anthropic().messages.count_tokens(model="thinker", messages=[*ASK, assistant]).input_tokens

    block = {"type": "thinking", "thinking": thought, "signature": "x"}
    assert anthropic_tokens([block]) >= anthropic_tokens([]) + least

    def ollama_tokens(reasoning):  # Ollama counts what it evaluated: a system message of its own, not cached
        system = {"role": "system", "content": f"Session {len(reasoning)}."}
        assistant = {"role": "assistant", "content": "The sum is 19.", "thinking": reasoning}
        answer = sup.ollama().chat(model="thinker", messages=[system, *ASK, assistant], options={"num_predict": 1})
        return answer.prompt_eval_count

    assert ollama_tokens(thought) >= ollama_tokens("") + least


def test_a_tool_call_grammar_holds_the_answer_after_the_reasoning(sup):
    """tool_choice required: the reasoning is free (a budget bounds it: this model, trained on sums, rambles before
    tools), then the answer is a call the grammar held (its arguments valid JSON for the function's parameters)."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "parameters": {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                    "additionalProperties": False,
                },
            },
        }
    ]
    answer = sup.openai().chat.completions.create(
        model="thinker",
        messages=ASK,
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
        extra_body={"reasoning_budget": 8},
    )
    message = answer.choices[0].message
    assert message.reasoning_content and answer.choices[0].finish_reason == "tool_calls"
    (call,) = message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "add" and set(arguments) == {"a", "b"}
    assert all(isinstance(v, int) for v in arguments.values())
