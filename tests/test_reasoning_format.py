"""Which format a model's reasoning takes, read from real chat templates, and an answer split into reasoning and
content as it streams, the same whatever the pieces it comes in (common/reasoning.py; issue #38, first step)."""

from __future__ import annotations

import pytest

from common.reasoning import ReasoningFormat, ReasoningSplitter, detect, of_setting

# Qwen3's template, the parts about reasoning, as Qwen/Qwen3-8B's tokenizer_config.json writes them.
QWEN3 = """{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')
                    .split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
# DeepSeek-R1's distills: the generation prompt opens the block.
DEEPSEEK_R1_GENERATION = "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>\n"
DEEPSEEK_R1 = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{% set content = message['content'] %}"
    "{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{'<｜Assistant｜><think>\\n'}}{% endif %}"
)
# gpt-oss: harmony's channels.
GPT_OSS = (
    "{%- if message.thinking %}{{- '<|start|>assistant<|channel|>analysis<|message|>' + message.thinking + "
    "'<|end|>' }}{%- endif %}{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
SMOLLM2 = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
)


def test_each_family_is_told_from_its_template():
    qwen3 = detect(QWEN3, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert qwen3 == ReasoningFormat("think", opened=False, switchable=True)
    assert detect(DEEPSEEK_R1, DEEPSEEK_R1_GENERATION) == ReasoningFormat("think", opened=True)
    assert detect(GPT_OSS).kind == "harmony"
    assert detect(SMOLLM2) is None and detect(None) is None
    assert of_setting("none", qwen3) is None and of_setting("auto", qwen3) is qwen3
    assert of_setting("think", None) == ReasoningFormat("think")


def pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def split(fmt: ReasoningFormat, parts: list[str], thinking: bool = True) -> tuple[str, str]:
    splitter = ReasoningSplitter(fmt, thinking)
    reasoning, content = "", ""
    for part in parts:
        r, c = splitter.feed(part)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    "fmt, text, expected",
    [
        (
            ReasoningFormat("think"),
            "<think>\n7 is 3 plus 4.\n</think>\n\nThe answer is 7.",
            ("7 is 3 plus 4.", "The answer is 7."),
        ),
        (ReasoningFormat("think", opened=True), "7 is 3 plus 4.</think>\n\nSeven.", ("7 is 3 plus 4.", "Seven.")),
        (
            ReasoningFormat("think"),
            "No block here, <think> later is text.",
            ("", "No block here, <think> later is text."),
        ),
        (ReasoningFormat("think"), "<think>\ncut short by max_tokens", ("cut short by max_tokens", "")),
        (ReasoningFormat("think"), "<think>\n\n</think>\n\nSkipped.", ("", "Skipped.")),
        (
            ReasoningFormat("harmony", start="<|channel|>", end="<|end|>"),
            "<|channel|>analysis<|message|>Add them.<|end|><|start|>assistant<|channel|>final<|message|>7<|return|>",
            ("Add them.", "7"),
        ),
    ],
)
def test_an_answer_splits_the_same_whatever_pieces_it_streams_in(fmt, text, expected):
    for size in (1, 2, 3, 5, 8, len(text)):
        assert split(fmt, pieces(text, size)) == expected, size


def test_each_switch_asks_the_template_or_the_prompt_what_its_model_needs():
    from common.errors import InvalidRequest
    from common.reasoning import Plan, plan

    qwen3 = detect(QWEN3, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    r1 = detect(DEEPSEEK_R1, DEEPSEEK_R1_GENERATION)
    harmony = detect(GPT_OSS)
    assert plan(qwen3) == Plan(True)  # the model's default
    assert plan(qwen3, think="off") == Plan(False, kwargs={"enable_thinking": False})
    assert plan(qwen3, effort="none").thinking is False
    assert plan(qwen3, kwargs={"enable_thinking": False}).thinking is False  # the template's own switch
    assert plan(qwen3, think="on", budget=7) == Plan(True, 7, {"enable_thinking": True})
    assert plan(qwen3, effort="low").budget == 1024 and plan(qwen3, effort="high").budget is None
    # A template that opens the block and cannot be switched: the block closed, empty, after the prompt.
    assert plan(r1, think="off") == Plan(False, empty_block="\n</think>\n\n")
    assert plan(of_setting("think", None), think="off").empty_block == "<think>\n\n</think>\n\n"
    assert plan(harmony, effort="minimal").kwargs == {"reasoning_effort": "low"}
    for fmt, fields, named in (
        (None, {"think": "on"}, "think"),
        (None, {"budget": 3}, "reasoning_budget"),
        (None, {"effort": "low"}, "reasoning_effort"),
        (harmony, {"think": "off"}, "think"),
        (harmony, {"budget": 3}, "reasoning_budget"),
    ):
        with pytest.raises(InvalidRequest) as refused:
            plan(fmt, **fields)
        assert refused.value.field == named
    assert plan(None, think="off") == Plan(False) and plan(None, effort="none") == Plan(False)


@pytest.mark.parametrize(
    ("fmt", "thinking", "text", "start"),
    [
        (ReasoningFormat("think"), True, "<think>\nstop here\n</think>\n\nanswer", len("<think>\nstop here\n</think>")),
        (ReasoningFormat("think"), True, "<thi", None),  # may still open a block
        (ReasoningFormat("think"), True, "  <think>\nstill thinking", None),
        (ReasoningFormat("think"), True, "no block", 0),
        (ReasoningFormat("think", opened=True), True, "thinking", None),
        (ReasoningFormat("think", opened=True), True, "thought</think>\n\nanswer", len("thought</think>")),
        (ReasoningFormat("think", opened=True), False, "answer", 0),  # switched off: an empty block was prompted
    ],
)
def test_the_answer_starts_after_the_block(fmt, thinking, text, start):
    from common.reasoning import answer_start

    assert answer_start(text, fmt, thinking) == start


def harmony_tokenizer():
    """A tokenizer with harmony's special tokens (models/reasoning's BPE, with gpt-oss's markers added as special
    tokens, as o200k_harmony has them) and gpt-oss's template: no gpt-oss checkpoint can be had here."""
    from pathlib import Path

    from transformers import PreTrainedTokenizerFast

    folder = Path(__file__).resolve().parents[1] / "models" / "reasoning"
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    markers = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|return|>", "<|call|>"]
    tokenizer.add_special_tokens({"additional_special_tokens": markers})
    tokenizer.chat_template = GPT_OSS
    return tokenizer


def test_a_harmony_answer_keeps_its_channels_as_text_and_splits_stop_strings_on_the_final_one():
    """The runner's text stream keeps harmony's markers (special tokens) for the splitter, stop strings look at the
    final channel only, and ``<|end|>`` (the end of the analysis message) does not end the turn."""
    from common.reasoning import answer_start
    from runner.request import end_of_turn_ids
    from runner.stopping import StoppingCriteria

    tokenizer = harmony_tokenizer()
    fmt = detect(GPT_OSS)
    analysis, final = "The user adds 12 and 7, which is 19.", "It is 19."
    text = f"<|channel|>analysis<|message|>{analysis}<|end|><|start|>assistant<|channel|>final<|message|>{final}"
    ids = tokenizer.encode(text, add_special_tokens=False)

    def stream(stop=(), keep_special=True):
        criteria = StoppingCriteria(
            tokenizer, frozenset(), stop, 1000, lambda t: answer_start(t, fmt), keep_special=keep_special
        )
        out = []
        for token in ids:
            decision = criteria(token)
            out.append(decision.text)
            if decision.finish_reason is not None:
                return "".join(out)
        return "".join(out) + criteria.finish()

    def split(streamed):
        splitter = ReasoningSplitter(fmt)
        reasoning, content = splitter.feed(streamed)
        more_reasoning, more_content = splitter.finish()
        return reasoning + more_reasoning, content + more_content

    assert split(stream()) == (analysis, final)
    assert split(stream(stop=("which",))) == (analysis, final)  # only in the analysis: no stop
    assert split(stream(stop=("19.",)))[1] == "It is "  # in the final channel: it stops there
    assert "<|channel|>" not in stream(keep_special=False)  # why the stream keeps them for harmony
    end = tokenizer.convert_tokens_to_ids("<|end|>")
    assert end in end_of_turn_ids(tokenizer) and end not in end_of_turn_ids(tokenizer, harmony=True)
