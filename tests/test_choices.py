"""n > 1 choices through the real supervisor: each choice is its own seeded sample (choice i with seed + i equals
that request alone), the choices after the first share its prefill (they find it in the prompt cache and
prefill one token), and they come back as OpenAI's choices, whole and streamed, with one usage."""

from __future__ import annotations

import openai
import pytest

from supervisor.protocol import supervisor_pb2

PROMPT = "The for statement is used to iterate over the elements of a sequence"


def test_each_choice_is_its_own_seeded_sample(chat_client):
    fields = {
        "model": "pair",
        "prompt": PROMPT,
        "max_tokens": 24,
        "temperature": 0.9,
        "extra_body": {"ignore_eos": True},
    }
    answer = chat_client.completions.create(n=3, seed=5, **fields)
    assert [c.index for c in answer.choices] == [0, 1, 2]
    alone = [chat_client.completions.create(seed=5 + i, **fields).choices[0].text for i in range(3)]
    assert [c.text for c in answer.choices] == alone
    assert len(set(alone)) > 1  # different samples
    assert answer.usage.completion_tokens == 3 * 24


def test_the_other_choices_share_the_first_ones_prefill(chat_supervisor):
    request = supervisor_pb2.GenerateRequest(
        model="pair", prompt_ids=[11 + (i * 7) % 500 for i in range(600)], max_tokens=8, ignore_eos=True, n=4
    )
    chunks = list(chat_supervisor.client.stub.Generate(request, timeout=120, metadata=chat_supervisor.client.metadata))
    finals = {c.choice: c.stats for c in chunks if c.HasField("stats")}
    assert sorted(finals) == [0, 1, 2, 3]
    assert all(f.generated_tokens == 8 and f.prompt_tokens == 600 for f in finals.values())
    assert [finals[i].cached_tokens for i in (1, 2, 3)] == [599, 599, 599]  # all but the last prompt token
    assert sum(1 for c in chunks if c.prompt_tokens) == 1


def test_streamed_choices_equal_the_whole_answer_with_one_usage(chat_client):
    fields = {"model": "smol", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 20}
    whole = chat_client.chat.completions.create(n=2, seed=3, temperature=1.0, **fields)
    chunks = list(
        chat_client.chat.completions.create(
            n=2, seed=3, temperature=1.0, stream=True, stream_options={"include_usage": True}, **fields
        )
    )
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in whole.choices]
    usages = [c.usage for c in chunks if c.usage is not None]
    assert len(usages) == 1 and usages[0].completion_tokens == whole.usage.completion_tokens


def test_too_many_choices_is_a_400(chat_client):
    with pytest.raises(openai.BadRequestError) as caught:
        chat_client.completions.create(model="pair", prompt=PROMPT, max_tokens=4, n=17)
    assert caught.value.body["param"] == "n"


def test_echo_puts_the_prompt_before_the_answer_with_its_tokens_logprobs(chat_client):
    fields = {"model": "pair", "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = chat_client.completions.create(**fields).choices[0].text
    echoed = chat_client.completions.create(echo=True, **fields).choices[0]
    assert echoed.text == PROMPT + plain
    scored = chat_client.completions.create(echo=True, logprobs=2, **fields).choices[0]
    lp = scored.logprobs
    assert "".join(lp.tokens) == scored.text and scored.text.endswith(plain)
    prompt_tokens = len(lp.tokens) - 6
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has no context
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    # Each position's alternatives hold the chosen token too, as OpenAI's and vLLM's (up to logprobs + 1).
    assert all(token in top and len(top) in (2, 3) for token, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # The answer's own logprobs are those it gets without echo.
    alone = chat_client.completions.create(logprobs=2, **fields).choices[0].logprobs
    assert lp.tokens[prompt_tokens:] == alone.tokens
    assert lp.token_logprobs[prompt_tokens:] == pytest.approx(alone.token_logprobs, abs=1e-4)
    # Streamed: the prompt comes with the first chunk.
    streamed = "".join(c.choices[0].text for c in chat_client.completions.create(echo=True, stream=True, **fields))
    assert streamed == echoed.text


def test_logprobs_zero_gives_the_chosen_tokens_logprob_alone(chat_client):
    answer = chat_client.completions.create(model="pair", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0)
    lp = answer.choices[0].logprobs
    assert len(lp.tokens) == 4 and all(v <= 0 for v in lp.token_logprobs)
    assert lp.top_logprobs == [{token: value} for token, value in zip(lp.tokens, lp.token_logprobs)]
