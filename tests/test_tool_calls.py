"""common.tool_calls, unit by unit: each family's way of writing a call, parsed back; the family recognised
from templates; a request's tools checked; the conversation laid out for a family; the grammar that holds an
answer to calls (compiled by llguidance over SmolLM2's real vocabulary); the answer split into text and call
deltas as it streams, however its text is cut."""

from __future__ import annotations

import json

import jsonschema
import pytest

from common.defaults import SMOLLM2_DIR
from common.errors import InvalidRequest
from common.tool_calls import PARSERS, ToolCallError, ToolCallStream, check_tools, conversation, detect, grammar

WEATHER = {"city": "Paris", "unit": "celsius"}
WEATHER_JSON = json.dumps(WEATHER)


def args(call) -> dict:
    return json.loads(call.arguments)


def test_hermes_blocks_one_per_call_with_text_before():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>'
    )
    parsed = PARSERS["hermes"](text)
    assert parsed.content == "Let me check."
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert args(parsed.calls[0]) == WEATHER and parsed.calls[0].id != parsed.calls[1].id
    assert PARSERS["hermes"]("No call here.").calls == []
    with pytest.raises(ToolCallError):
        PARSERS["hermes"]('<tool_call>{"name": "x", "arguments": {')
    with pytest.raises(ToolCallError):
        PARSERS["hermes"]('<tool_call>{"arguments": {}}</tool_call>')


def test_llama3_json_and_python_tag():
    parsed = PARSERS["llama3"](
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}'
    )
    assert parsed.content == "" and parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    two = PARSERS["llama3"]('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert [c.name for c in two.calls] == ["a", "b"]
    assert PARSERS["llama3"]("{not json} is prose").calls == []


def test_mistral_list_after_its_marker():
    parsed = PARSERS["mistral"](
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]'
    )
    assert parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    with pytest.raises(ToolCallError):
        PARSERS["mistral"]("[TOOL_CALLS] not json")


def test_pythonic_calls_read_as_literals_only():
    parsed = PARSERS["pythonic"]('[get_weather(city="Paris", unit="celsius"), get_time(tz="CET", exact=True)]')
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    assert args(parsed.calls[1]) == {"tz": "CET", "exact": True}
    with pytest.raises(ToolCallError):
        PARSERS["pythonic"]("[get_weather(city=open('/etc/passwd').read())]")  # never evaluated
    assert PARSERS["pythonic"]("[1, 2] is a list").calls == []


def test_generic_answers_parse_back():
    call = {"tool_calls": [{"name": "get_weather", "arguments": WEATHER}]}
    parsed = PARSERS["generic"](json.dumps(call))
    assert parsed.calls[0].name == "get_weather" and args(parsed.calls[0]) == WEATHER
    assert PARSERS["generic"](json.dumps({"response": "It is sunny."})).content == "It is sunny."


def test_families_are_recognised_from_templates():
    smollm2 = json.loads((SMOLLM2_DIR / "tokenizer_config.json").read_text())["chat_template"]
    assert detect(smollm2) is None  # no tool support: the generic layout
    assert detect("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}") == "hermes"
    assert detect("{% if tools %}[TOOL_CALLS]{% endif %}") == "mistral"
    assert detect("{% if tools %}<|python_tag|>{% endif %}") == "llama3"
    assert detect(None) is None


WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def tools(choice: str = "auto", name: str = "", parallel=None):
    return check_tools(json.dumps(TOOLS), choice, name, parallel)


@pytest.mark.parametrize(
    "fields, words",
    [
        (("[1]",), "tools[0]: only"),
        (('[{"type": "function", "function": {"name": "has space"}}]',), "tools[0].function.name"),
        (('[{"type": "function", "function": {"name": "f", "parameters": []}}]',), "parameters: must be a JSON schema"),
        (('[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]',), "an object"),
        ((json.dumps(TOOLS + TOOLS[:1]),), "same name"),
        ((json.dumps(TOOLS), "sometimes"), "tool_choice: 'sometimes'"),
        (("", "required"), "needs tools"),
        ((json.dumps(TOOLS), "function", "launch"), "'launch', which is not one of the tools"),
        ((json.dumps(TOOLS), "auto", "get_time"), 'goes with tool_choice "function"'),
    ],
)
def test_bad_tools_are_refused_naming_where(fields, words):
    with pytest.raises(InvalidRequest) as caught:
        check_tools(*fields)
    assert words in str(caught.value)


def test_the_offered_functions_follow_the_choice():
    assert [f["name"] for f in tools().offered] == ["get_weather", "get_time"]
    assert [f["name"] for f in tools("function", "get_time").offered] == ["get_time"]
    assert not tools("none").calls and tools().parallel and not tools(parallel=False).parallel


HISTORY = (
    ("user", "Weather in Paris?"),
    ("assistant", "", "", "", (("call_1", "get_weather", '{"city": "Paris"}'),)),
    ("tool", '{"sky": "clear"}', "get_weather", "call_1", ()),
)


def test_a_native_family_gets_the_history_as_hugging_face_templates_take_it():
    laid_out = conversation(HISTORY, tools(), "hermes")
    assert laid_out[1]["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    assert laid_out[2] == {
        "role": "tool",
        "content": '{"sky": "clear"}',
        "tool_call_id": "call_1",
        "name": "get_weather",
    }


def test_the_generic_layout_describes_the_tools_and_writes_calls_as_the_model_does():
    laid_out = conversation((("system", "Be brief."), *HISTORY), tools(), "generic")
    assert laid_out[0]["role"] == "system" and laid_out[0]["content"].startswith("Be brief.\n\nYou can call")
    assert '"get_time"' in laid_out[0]["content"]
    # as the model writes it under the grammar, byte for byte (so the next prompt repeats its tokens)
    assert laid_out[2]["content"] == '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'
    assert laid_out[3] == {"role": "user", "content": 'The result of get_weather (call call_1): {"sky": "clear"}'}
    # tool_choice "none": no tools described, the earlier call in words (the model must not imitate JSON)
    plain = conversation(HISTORY, tools("none"), "generic")
    assert plain[0]["role"] == "user" and plain[1]["content"].startswith("I call get_weather with")


@pytest.fixture(scope="module")
def index():
    import llguidance.hf
    from transformers import AutoTokenizer

    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(SMOLLM2_DIR)), eos_token=[2])


def accepts(index, spec: str, text: str) -> bool:
    import llguidance
    from tokenizers import Tokenizer

    lark = json.loads(spec)["lark"]
    matcher = llguidance.LLMatcher(index, llguidance.LLMatcher.grammar_from_lark(lark), log_level=0)
    ids = Tokenizer.from_file(str(SMOLLM2_DIR / "tokenizer.json")).encode(text).ids
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


CALL = '{"name":"get_weather","arguments":{"city":"Paris","unit":"celsius"}}'


@pytest.mark.parametrize(
    "family, choice, good, bad",
    [
        ("generic", "auto", ['{"response":"Hi."}', '{"tool_calls":[' + CALL + "]}"], ['{"response": "Hi."}', "Hi."]),
        ("generic", "required", ['{"tool_calls":[' + CALL + "," + CALL + "]}"], ['{"response":"Hi."}']),
        (
            "generic",
            "function",
            ['{"tool_calls":[{"name":"get_time","arguments":{}}]}'],
            ['{"tool_calls":[' + CALL + "]}"],
        ),
        ("hermes", "required", ["<tool_call>\n" + CALL + "\n</tool_call>"], [CALL]),
        ("mistral", "required", ["[TOOL_CALLS][" + CALL + "]"], [CALL]),
        ("llama3", "required", ['{"name":"get_time","parameters":{}}'], ['{"name":"get_time","arguments":{}}']),
        # auto, lazily: free text without the marker, or text, the marker and calls held to the schemas
        (
            "hermes",
            "auto",
            [
                "It is sunny.",
                "<tool_call>\n" + CALL + "\n</tool_call>",
                "Let me look.\n<tool_call>\n" + CALL + "\n</tool_call>",
            ],
            ["Let me look. <tool_call> it is sunny", "<tool_call>\n" + CALL],
        ),
        ("mistral", "auto", ["It is sunny.", "Sure. [TOOL_CALLS][" + CALL + "]"], ["[TOOL_CALLS] sunny"]),
    ],
)
def test_the_grammar_holds_the_answer_to_calls_of_the_offered_functions(index, family, choice, good, bad):
    spec = grammar(tools(choice, "get_time" if choice == "function" else ""), family)
    for text in good:
        assert accepts(index, spec, text), text
    wrap = {
        "generic": '{{"tool_calls":[{}]}}',
        "hermes": "<tool_call>\n{}\n</tool_call>",
        "mistral": "[TOOL_CALLS][{}]",
    }
    for text in bad + [  # an argument the function does not declare, a value outside its enum, a missing one
        wrap.get(family, "{}").format('{"name":"get_weather","arguments":{"city":"Paris","launch":true}}'),
        wrap.get(family, "{}").format('{"name":"get_weather","arguments":{"city":"Paris","unit":"kelvin"}}'),
        wrap.get(family, "{}").format('{"name":"get_weather","arguments":{"unit":"celsius"}}'),
    ]:
        assert not accepts(index, spec, text), text


def test_what_the_grammar_leaves_free_and_what_it_refuses():
    assert grammar(tools("auto"), "llama3") == ""  # no marker to wait for: free text, calls parsed
    assert grammar(tools("none"), "generic") == ""
    one = json.loads(grammar(tools("required", parallel=False), "generic"))["lark"]
    assert "{0," not in one.splitlines()[0]
    with pytest.raises(InvalidRequest, match="pythonic"):
        grammar(tools("required"), "pythonic")


def stream(family: str, text: str, cuts) -> tuple[str, list, ToolCallStream]:
    """Feed ``text`` cut at ``cuts``: the content and the calls put together from the deltas."""
    split = ToolCallStream(family)
    pieces, start = [], 0
    for cut in [*cuts, len(text)]:
        pieces.append(split.feed(text[start:cut]))
        start = cut
    pieces.append(split.finish())
    content = "".join(c for c, _ in pieces)
    calls: dict[int, list] = {}
    for _, deltas in pieces:
        for d in deltas:
            if d.id:
                assert d.index not in calls and d.name  # the first piece of a call has its id and name
                calls[d.index] = [d.name, ""]
            calls[d.index][1] += d.arguments
    return content, [calls[i] for i in sorted(calls)], split


GENERIC_CALLS = '{"tool_calls":[' + CALL + ',{"name":"get_time","arguments":{"note":"a \\"}\\" brace"}}]}'
ANSWERS = [
    (
        "generic",
        GENERIC_CALLS,
        "",
        [["get_weather", '{"city":"Paris","unit":"celsius"}'], ["get_time", '{"note":"a \\"}\\" brace"}']],
    ),
    ("generic", '{"response":"Caf\\u00e9 \\ud83d\\ude00 \\"ok\\"\\n"}', 'Café 😀 "ok"\n', []),
    (
        "hermes",
        "Let me look.\n<tool_call>\n" + CALL + "\n</tool_call>",
        "Let me look.\n",
        [["get_weather", json.dumps(WEATHER, separators=(",", ":"))]],
    ),
    ("hermes", "A <tool_ca and no call.", "A <tool_ca and no call.", []),
    (
        "hermes",
        "<tool_call>\n" + CALL + "\n</tool_call>\n<tool_call>\n" + CALL + "\n</tool_call>\n",
        "",
        [["get_weather", json.dumps(WEATHER)]] * 2,
    ),
    ("mistral", "[TOOL_CALLS][" + CALL + "]", "", [["get_weather", json.dumps(WEATHER)]]),
    ("llama3", '{"name": "get_time", "parameters": {}}', "", [["get_time", "{}"]]),
    ("llama3", "{Not a call} at all.", "{Not a call} at all.", []),
    ("pythonic", '[get_weather(city="Paris", unit="celsius")]', "", [["get_weather", json.dumps(WEATHER)]]),
    ("pythonic", "Plain text.", "Plain text.", []),
]


@pytest.mark.parametrize("family, text, content, calls", ANSWERS)
def test_an_answer_splits_into_text_and_calls_however_it_is_cut(family, text, content, calls):
    whole = stream(family, text, [])
    assert whole[0] == content
    assert [[n, json.loads(a)] for n, a in whole[1]] == [[n, json.loads(a)] for n, a in calls]
    for step in (1, 2, 3, 7):  # one character at a time, and other cuts: the same content and calls
        cut = stream(family, text, range(step, len(text), step))
        assert cut[0] == whole[0] and cut[1] == whole[1], step
    assert whole[2].complete


def test_generic_call_arguments_stream_as_they_are_decoded():
    split = ToolCallStream("generic")
    content, deltas = split.feed('{"tool_calls":[{"name":"get_weather","arguments":{"ci')
    assert content == "" and [(d.index, d.name, d.arguments) for d in deltas] == [
        (0, "get_weather", ""),
        (0, "", '{"ci'),
    ]
    assert not split.complete
    content, deltas = split.feed('ty":"Paris"}}]}')
    assert [d.arguments for d in deltas] == ['ty":"Paris"}'] and split.complete and split.calls[0].name == "get_weather"


# -- in the runner, on SmolLM2 ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hermes_engine():
    """SmolLM2 told it writes hermes calls (``tool_format``): its template does not describe the tools, but the
    grammar, the decode loop and the splitter are the native path's."""
    from common.settings import RunnerSettings
    from runner.engine import Engine

    engine = Engine.load(SMOLLM2_DIR, None, RunnerSettings(tool_format="hermes", prompt_cache=0))
    yield engine
    del engine
    import gc

    gc.collect()


def split_answer(engine, **fields):
    from runner.request import GenerationRequest
    from tests.helpers import collect

    request = GenerationRequest(
        messages=(("user", "What is the weather in Paris? Call get_weather."),), tools=json.dumps(TOOLS), **fields
    )
    prepared = engine.prepare(request)
    tokens, text, last = collect(engine.generate(request))
    splitter = ToolCallStream(prepared.tool_format)
    content, deltas = splitter.feed(text)
    tail, more = splitter.finish()
    return tokens, content + tail, splitter.calls, last


def test_a_native_family_call_is_held_to_its_schema_and_parsed_back(hermes_engine):
    assert hermes_engine.tool_format == "hermes"
    tokens, content, calls, last = split_answer(hermes_engine, tool_choice="required", max_tokens=80)
    assert content == "" and len(calls) >= 1 and last.stats.forced > 0
    for call in calls:
        jsonschema.validate(
            json.loads(call.arguments),
            next(t for t in TOOLS if t["function"]["name"] == call.name)["function"]["parameters"],
        )
    # Greedy output under the tool grammar is the same with speculation (n-gram drafts) on and off.
    for drafter in ("ngram", "none"):
        again, *_ = split_answer(hermes_engine, tool_choice="required", max_tokens=80, drafter=drafter)
        assert again == tokens, drafter


def test_native_auto_is_free_text_or_text_then_calls_never_a_broken_call(hermes_engine):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2), (1.0, 3)):
        _, content, calls, last = split_answer(
            hermes_engine, tool_choice="auto", max_tokens=60, temperature=temperature, seed=seed
        )
        assert "<tool_call>" not in content  # a marker is always followed by a whole, valid call
        for call in calls:
            assert call.name in {"get_weather", "get_time"} and isinstance(json.loads(call.arguments), dict)
