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
