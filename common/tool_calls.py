"""Tool-call formats: how a model family writes a call, recognised from its chat template, and parsed back.

Issue #21's groundwork, MLX-free (the supervisor's API adapters parse answers;
the runner recognises the family from the template it holds). Not yet wired
to the APIs: tool calls are still refused there (supervisor/http_api.py,
``NOT_HONOURED``). One unit per family, each with ``parse(text)`` giving the
text before the calls and the calls:

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one
  block per call (Hermes, Qwen 2/2.5/3, SmolLM3, many fine-tunes);
- ``llama3``: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole
  answer, optionally after ``<|python_tag|>``; several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``;
- ``pythonic``: a Python list of calls, ``[get_weather(city="Paris"), ...]``
  (Llama 3.2/4's and others' pythonic format), read with ``ast`` (literals only);
- ``generic``: for a template without tool support (SmolLM2's): the tools are
  described in the system prompt and the answer is a JSON object, either
  ``{"tool_calls": [{"name", "arguments"}]}`` or ``{"response": "..."}``, as
  llama.cpp's generic format does; a grammar can force one of the two.

``detect(template)`` names the family a chat template writes (None: use generic).
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (what OpenAI's function.arguments holds)
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass
class Parsed:
    content: str  # the answer's text outside the calls
    calls: list[ToolCall]


class ToolCallError(ValueError):
    """The answer started a call it did not finish well (bad JSON, no name)."""


def _call(obj, arguments_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ToolCallError(f"a tool call needs a name: {obj!r}")
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ToolCallError(f"{obj['name']}: its arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise ToolCallError(f"{obj['name']}: its arguments must be an object")
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise ToolCallError(f"a tool call is not JSON: {error}") from None


HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    calls = [_call(_json(block)) for block in HERMES_BLOCK.findall(text)]
    start = text.find("<tool_call>")
    if start >= 0 and not calls and "</tool_call>" not in text:
        raise ToolCallError("a <tool_call> block is not closed")
    return Parsed(text[:start].strip() if start >= 0 else text, calls)


def parse_llama3(text: str) -> Parsed:
    body = text.split("<|python_tag|>", 1)[1] if "<|python_tag|>" in text else text
    stripped = body.strip()
    if not stripped.startswith("{"):
        return Parsed(text, [])
    parts = [part for part in stripped.split(";") if part.strip()] if stripped.count("}{") == 0 else [stripped]
    try:
        objects = [json.loads(part) for part in parts]
    except ValueError:
        return Parsed(text, [])  # prose that starts with a brace
    if not all(isinstance(o, dict) and "name" in o for o in objects):
        return Parsed(text, [])
    return Parsed("", [_call(o, "parameters") for o in objects])


def parse_mistral(text: str) -> Parsed:
    if "[TOOL_CALLS]" not in text:
        return Parsed(text, [])
    before, after = text.split("[TOOL_CALLS]", 1)
    calls = _json(after.strip())
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list):
        raise ToolCallError("[TOOL_CALLS] must be followed by a JSON list")
    return Parsed(before.strip(), [_call(c) for c in calls])


def parse_pythonic(text: str) -> Parsed:
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]") and "(" in stripped):
        return Parsed(text, [])
    try:
        tree = ast.parse(stripped, mode="eval").body
    except SyntaxError:
        return Parsed(text, [])
    if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) for e in tree.elts):
        return Parsed(text, [])
    calls = []
    for element in tree.elts:
        if not isinstance(element.func, ast.Name) or element.args:
            raise ToolCallError("a pythonic call takes keyword arguments only")
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords}
        except ValueError:
            raise ToolCallError(f"{element.func.id}: its arguments must be literals") from None
        calls.append(ToolCall(element.func.id, json.dumps(arguments, ensure_ascii=False)))
    return Parsed("", calls)


def parse_generic(text: str) -> Parsed:
    stripped = text.strip()
    if not stripped.startswith("{"):
        return Parsed(text, [])
    obj = _json(stripped)
    if isinstance(obj, dict) and "tool_calls" in obj:
        if not isinstance(obj["tool_calls"], list):
            raise ToolCallError("tool_calls must be a list")
        return Parsed("", [_call(c) for c in obj["tool_calls"]])
    if isinstance(obj, dict) and isinstance(obj.get("response"), str):
        return Parsed(obj["response"], [])
    raise ToolCallError('the answer must be {"tool_calls": [...]} or {"response": "..."}')


PARSERS = {
    "hermes": parse_hermes,
    "llama3": parse_llama3,
    "mistral": parse_mistral,
    "pythonic": parse_pythonic,
    "generic": parse_generic,
}


def generic_schema(tools: list[dict], required: bool) -> dict:
    """The JSON schema of a generic-layout answer to ``tools`` (OpenAI's function tools): a call of one of them,
    with arguments valid against its parameters, or (unless ``required``) a text response."""
    calls = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool["function"]["name"]},
                    "arguments": tool["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for tool in tools
        ]
    }
    call = {
        "type": "object",
        "properties": {"tool_calls": {"type": "array", "items": calls, "minItems": 1}},
        "required": ["tool_calls"],
        "additionalProperties": False,
    }
    if required:
        return call
    answer = {
        "type": "object",
        "properties": {"response": {"type": "string"}},
        "required": ["response"],
        "additionalProperties": False,
    }
    return {"anyOf": [call, answer]}


def detect(template: str | None) -> str | None:
    """The family a chat template writes tool calls in; None when it has no tool support (use ``generic``)."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    if "[func_name1(" in template or "pythonic" in template:
        return "pythonic"
    return None
