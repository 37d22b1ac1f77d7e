"""Tool calls: how a model family writes a call, the conversation laid out for it, the grammar that makes
the answer a valid call, and the answer split back into text and calls as it streams.

MLX-free: the runner uses every unit (it holds the template and the tokenizer), the request check uses
``check_tools``. OpenAI's shape throughout: a tool is ``{"type": "function", "function": {"name",
"description", "parameters"}}``; a call is an id, a name and its arguments as a JSON object's text.

The families, each one parser (``PARSERS``) and, where it can be enforced, one grammar (``grammar``):

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Hermes,
  Qwen 2/2.5/3, SmolLM3, many fine-tunes);
- ``llama3``: a JSON object ``{"name": ..., "parameters": {...}}`` as the whole answer, optionally after
  ``<|python_tag|>``; several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``;
- ``pythonic``: a Python list of calls, ``[get_weather(city="Paris"), ...]`` (Llama 3.2/4's and others'
  pythonic format), read with ``ast`` (literals only); not enforced by a grammar;
- ``generic``: for a template without tool support (SmolLM2's): the tools are described in a system
  message and the answer is a JSON object, ``{"tool_calls": [{"name", "arguments"}, ...]}`` or (unless a
  call is required) ``{"response": "..."}``, as llama.cpp's generic format does; the grammar always holds
  it to one of the two, so the model chooses between answering and calling.

``detect(template)`` names the family a chat template writes (None: the generic layout); a model's
``tool_format`` setting overrides it. How each ``tool_choice`` is decoded:

- ``required`` / a named function: the whole answer is held by the family's grammar to calls of the
  offered functions (one call of the named one), their arguments valid against each function's
  ``parameters`` (no undeclared argument unless the schema says ``additionalProperties``); at most
  ``MAX_CALLS`` calls, one unless ``parallel_tool_calls``;
- ``auto``: the generic layout is held to a call or a response; hermes and mistral decode free text up
  to their marker and calls after it (a lazy grammar, as llama.cpp's); llama3 and pythonic decode freely
  and their calls are parsed from the text (a malformed call stays text, as mlx-lm's and Ollama's
  parsers leave it);
- ``none``: no calls are parsed; the generic layout leaves the tools out of the prompt.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from dataclasses import dataclass, field

from .errors import InvalidRequest


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


# -- the request's tools ------------------------------------------------------------------------------------

FORMATS = ("hermes", "llama3", "mistral", "pythonic", "generic")
CHOICES = ("auto", "none", "required", "function")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
MAX_TOOLS = 128  # OpenAI's limit
MAX_CALLS = 8  # calls in one answer (a small model repeats a call for ever otherwise)
OBJECT = {"type": "object"}


@dataclass(frozen=True)
class Tools:
    """A request's tools, checked: the functions (OpenAI's ``function`` objects), how the answer may use them."""

    functions: tuple[dict, ...]
    choice: str = "auto"  # CHOICES
    name: str = ""  # the function choice "function" calls
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """The answer may call tools (and is parsed for calls)."""
        return bool(self.functions) and self.choice != "none"

    @property
    def offered(self) -> list[dict]:
        """The functions the answer may call: all, or the named one."""
        return [f for f in self.functions if self.choice != "function" or f["name"] == self.name]

    def definitions(self) -> list[dict]:
        """The tools as OpenAI writes them (what chat templates take as ``tools``)."""
        return [{"type": "function", "function": f} for f in self.functions]


def check_tools(tools: str, tool_choice: str = "", tool_name: str = "", parallel_tool_calls=None) -> Tools:
    """The request's tools (``tools``: OpenAI's list as JSON text, "" = none), checked; raises InvalidRequest
    naming the field."""
    functions: list[dict] = []
    if tools:
        try:
            listed = json.loads(tools)
        except (ValueError, RecursionError):
            raise InvalidRequest("tools", "must be a JSON list of tools") from None
        if not isinstance(listed, list):
            raise InvalidRequest("tools", "must be a list of tools")
        if len(listed) > MAX_TOOLS:
            raise InvalidRequest("tools", f"at most {MAX_TOOLS} tools")
        for index, tool in enumerate(listed):
            functions.append(_function(tool, f"tools[{index}]"))
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools", "two tools have the same name")
    choice = tool_choice or "auto"
    if choice not in CHOICES:
        raise InvalidRequest("tool_choice", f"{choice!r} is not one of {', '.join(CHOICES)}")
    if choice in ("required", "function") and not functions:
        raise InvalidRequest("tool_choice", f"{choice!r} needs tools")
    if choice == "function" and tool_name not in {f["name"] for f in functions}:
        raise InvalidRequest("tool_choice", f"names {tool_name!r}, which is not one of the tools")
    if tool_name and choice != "function":
        raise InvalidRequest("tool_choice", 'a function\'s name goes with tool_choice "function"')
    parallel = True if parallel_tool_calls is None else parallel_tool_calls
    return Tools(tuple(functions), choice, tool_name, parallel)


def _function(tool, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest("tools", f'{where}: only {{"type": "function", "function": {{...}}}} tools are supported')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequest("tools", f"{where}.function.name: must be 1-64 letters, digits, _ or -")
    if not isinstance(function.get("description", ""), str):
        raise InvalidRequest("tools", f"{where}.function.description: must be a string")
    parameters = function.get("parameters", OBJECT)
    if not isinstance(parameters, dict):
        raise InvalidRequest("tools", f"{where}.function.parameters: must be a JSON schema (an object)")
    if parameters.get("type", "object") != "object":
        raise InvalidRequest("tools", f"{where}.function.parameters: must describe an object")
    kept = {"name": name, "parameters": parameters}
    if function.get("description"):
        kept["description"] = function["description"]
    if function.get("strict") is True:  # OpenAI's strict: its schema followed exactly, or refused
        kept["strict"] = True
    return kept


def check_history(messages) -> None:
    """The tool parts of a conversation: (role, content, name, tool_call_id, tool_calls) tuples, tool_calls
    as (id, name, arguments) triples; raises InvalidRequest naming the message. A call's arguments may be any
    text: a call cut short by max_tokens (as this server, and OpenAI's, send it) comes back in the history with
    half its arguments, and is laid out as it was written (``arguments_of``)."""
    for index, message in enumerate(messages):
        role, calls = message[0], message[4] if len(message) > 4 else ()
        if calls and role != "assistant":
            raise InvalidRequest("messages", f"message {index}: only an assistant's message has tool_calls")
        for _call_id, name, _arguments in calls:
            if not name:
                raise InvalidRequest("messages", f"message {index}: a tool call needs a function name")


def arguments_of(text: str):
    """An earlier call's arguments as a chat template takes them: the object, or where they are not a JSON
    object (a call cut short), the text as it was written."""
    try:
        value = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


# -- the conversation, laid out for a family --------------------------------------------------------------


def generic_instructions(tools: Tools) -> str:
    """The system message that describes the tools to a model whose template cannot (the generic layout)."""
    listed = json.dumps(tools.definitions(), ensure_ascii=False, indent=1)
    calls = '{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}'
    if tools.choice == "function":
        how = f"Answer with a call of the function {tools.name}, as JSON: {calls}."
    elif tools.choice == "required":
        how = f"Answer with a call of one of them, as JSON: {calls}."
    else:
        how = (
            f"To call tools, answer with JSON: {calls}. To answer the user directly, answer with JSON: "
            '{"response": "<your answer>"}.'
        )
    return f"You can call these tools:\n{listed}\n\n{how}"


# How the generic layout's grammar writes JSON (no whitespace): earlier answers are written back the same way, so
# the next turn's prompt repeats the tokens the model generated and the prompt cache finds them (a cache that
# cannot be trimmed, a sliding window's, is reused only for an exact prefix).
COMPACT = (",", ":")


def conversation(messages, tools: Tools, family: str) -> list[dict]:
    """The chat template's ``messages`` for a conversation of (role, content[, name, tool_call_id, tool_calls])
    tuples: as Hugging Face templates take tool calls and results for a native family; for the generic layout,
    the tools in a system message, earlier calls and answers as the JSON the model writes, tool results as user
    messages (every template takes those)."""
    out: list[dict] = []
    generic = family == "generic"
    for message in messages:
        role, content = message[0], message[1]
        name, call_id, calls = (tuple(message[2:5]) + ("", "", ()))[:3] if len(message) > 2 else ("", "", ())
        if not generic:
            entry: dict = {"role": role, "content": content}
            if calls:
                entry["tool_calls"] = [
                    {"id": i, "type": "function", "function": {"name": n, "arguments": arguments_of(a)}}
                    for i, n, a in calls
                ]
            if role == "tool":
                entry["tool_call_id"] = call_id
                if name:
                    entry["name"] = name
            out.append(entry)
        elif calls:
            written = [{"name": n, "arguments": arguments_of(a)} for _, n, a in calls]
            if tools.calls:  # as the model writes a call
                text = json.dumps({"tool_calls": written}, ensure_ascii=False, separators=COMPACT)
            else:
                text = "\n".join(f"I call {c['name']} with {json.dumps(c['arguments'])}." for c in written)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            text = f"The result of {name or 'the tool'}" + (f" (call {call_id})" if call_id else "") + f": {content}"
            if out and out[-1]["role"] == "user" and out[-1].get("results"):
                out[-1]["content"] += "\n" + text  # results of one turn's calls: one message
            else:
                out.append({"role": "user", "content": text, "results": True})
        elif role == "assistant" and tools.calls:
            answer = json.dumps({"response": content}, ensure_ascii=False, separators=COMPACT)
            out.append({"role": "assistant", "content": answer})
        else:
            out.append({"role": role, "content": content})
    for entry in out:
        entry.pop("results", None)
    if generic and tools.calls:
        instructions = generic_instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{instructions}"}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


# -- the grammar ------------------------------------------------------------------------------------------

# How the JSON inside a call is written: no whitespace between tokens (no runaway, fixed separators are forced
# tokens), as runner.constraint compiles JSON.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# Families whose calls begin with a marker: with tool_choice auto, text runs free until the marker.
LAZY = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (names are [A-Za-z0-9_-], so no escapes beyond JSON's)


def grammar(tools: Tools, family: str, bound=lambda schema: schema, lenient: bool = False) -> str:
    """The request's ``grammar`` (runner.constraint's JSON spec, a Lark grammar) that holds the answer to the
    family's calls of the offered functions, or "" where the answer decodes freely (``none``; ``auto`` for
    llama3 and pythonic, whose calls have no marker to wait for). ``auto`` for hermes and mistral is lazy, as
    llama.cpp's: free text that never holds the family's marker, or such text, the marker and calls.
    ``bound(schema)`` adjusts each function's parameters (runner.constraint's integer bounds); ``lenient``:
    keywords the engine does not implement are left out of the parameters' grammar instead of refused
    (``runner.request.tool_constraint`` says when). Raises InvalidRequest where a call cannot be enforced (the
    pythonic family)."""
    lazy = tools.choice == "auto" and family in LAZY
    if not tools.calls or (tools.choice == "auto" and family != "generic" and not lazy):
        return ""
    if family == "pythonic":
        raise InvalidRequest("tool_choice", f"{tools.choice!r} cannot be enforced for pythonic calls; use auto")
    key = "parameters" if family == "llama3" else "arguments"
    rules, bodies = [], []
    for index, function in enumerate(tools.offered):
        schema = dict(bound(function["parameters"]))
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False  # the declared parameters only, unless the schema allows more
        schema["x-guidance"] = {**JSON_LAYOUT, "lenient": True} if lenient else JSON_LAYOUT
        head = _literal(f'{{"name":"{function["name"]}","{key}":')
        rules.append(f"args{index}: %json {json.dumps(schema)}")
        bodies.append(f'{head} args{index} "}}"')
    rules.append("body: " + " | ".join(bodies))
    # A named function is called once (as OpenAI answers it); otherwise as many calls as parallel allows.
    several = tools.parallel and tools.choice != "function"

    def calls(first: str, separator: str, last: str = "") -> str:
        """first body last, then (separator body last) up to MAX_CALLS in all when several calls may come."""
        more = f" ({separator} body {last}){{0,{MAX_CALLS - 1}}}" if several else ""
        return f"{first} body {last}{more}"

    newline = _literal("\n")
    if family == "generic":
        start = calls(_literal('{"tool_calls":['), '","') + " " + _literal("]}")
        if tools.choice == "auto":
            string = json.dumps({"type": "string", "x-guidance": JSON_LAYOUT})
            start += " | " + _literal('{"response":') + f" %json {string} " + _literal("}")
    elif family == "hermes":
        opening, closing = _literal("<tool_call>\n"), _literal("\n</tool_call>")
        start = calls("HEAD" if lazy else opening, f"{newline} {opening}", closing)
    elif family == "mistral":
        start = calls("HEAD" if lazy else _literal("[TOOL_CALLS]["), '","') + ' "]"'
    else:
        start = calls("", '";"')
    if lazy:
        marker = LAZY[family]
        free = f"/(?s:.*)/ & ~/(?s:.*){re.escape(marker)}(?s:.*)/"
        start = f"TEXT | {start}"
        rules += [f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(marker)}(?s:.*)/", f"FREE: {free}"]
        rules.append(f"HEAD: FREE {_literal(marker + chr(10) if family == 'hermes' else marker + '[')}")
    return json.dumps({"lark": "\n".join([f"start: {start}", *rules])})


# -- the answer, split as it streams ----------------------------------------------------------------------


@dataclass
class Delta:
    """A piece of call number ``index``: its first piece has the id and name (OpenAI's streamed shape)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


class ToolCallStream:
    """Splits an answer's text into content and tool-call deltas as it streams (``feed``, then ``finish``).

    The generic layout (always under its grammar, so written exactly as ``grammar`` lays it out) streams
    truly: a response's text as it is decoded from its JSON string, a call's name once it is complete, its
    arguments piece by piece. A native family streams its text up to where a call may begin, then holds the
    rest and parses it with the family's parser as each call (hermes) or the answer (the others) completes;
    what does not parse as calls is sent as text after all."""

    def __init__(self, family: str):
        self.family = family
        self.calls: list[ToolCall] = []  # complete calls
        self._text = ""  # everything fed
        self._sent = 0  # generic: how far the text is accounted for; native: how far it went out as content
        self._state = "start"
        self._open: ToolCall | None = None  # generic: the call whose arguments are streaming
        self._depth = 0
        self._in_string = False
        self._escaped = False

    @property
    def complete(self) -> bool:
        """No call is open: the generic object closed; a native answer's calls are parsed whole."""
        return self.family != "generic" or self._state == "done"

    def feed(self, text: str) -> tuple[str, list[Delta]]:
        """The answer's next text: (content, deltas) ready to send."""
        self._text += text
        return self._generic() if self.family == "generic" else self._native(final=False)

    def finish(self) -> tuple[str, list[Delta]]:
        """The answer is over: whatever was held back."""
        if self.family == "generic":
            # Cut short before it was a call or a response (max_tokens of 1: '{"'), what came is only the
            # layout's JSON, never the answer's text: nothing to send.
            return self._generic()
        return self._native(final=True)

    # -- generic ------------------------------------------------------------------------------------------

    RESPONSE = '{"response":"'
    CALLS = '{"tool_calls":['

    def _generic(self) -> tuple[str, list[Delta]]:
        content, deltas = "", []
        while True:
            rest = self._text[self._sent :]
            if self._state == "start":
                for prefix, state in ((self.RESPONSE, "response"), (self.CALLS, "call")):
                    if rest.startswith(prefix):
                        self._state, self._sent = state, self._sent + len(prefix)
                        break
                else:
                    if rest and not (self.RESPONSE.startswith(rest) or self.CALLS.startswith(rest)):
                        self._state = "text"
                    return content, deltas
            elif self._state == "text":
                self._sent = len(self._text)
                return content + rest, deltas
            elif self._state == "response":
                decoded, used, ended = _json_string_part(rest)
                content += decoded
                self._sent += used
                if ended:
                    self._state = "done"
                return content, deltas
            elif self._state == "call":
                match = re.match(r'\{"name":"([A-Za-z0-9_-]+)","(?:arguments|parameters)":', rest)
                if match is None:
                    return content, deltas  # not yet whole
                self._open = ToolCall(match.group(1), "")
                deltas.append(Delta(len(self.calls), self._open.id, self._open.name, ""))
                self._sent += match.end()
                self._state, self._depth = "arguments", 0
            elif self._state == "arguments":
                end = self._scan(rest)
                piece = rest[:end]
                if piece:
                    self._open.arguments += piece
                    deltas.append(Delta(len(self.calls), arguments=piece))
                self._sent += end
                if self._depth or not self._open.arguments:
                    return content, deltas
                self.calls.append(self._open)
                self._open, self._state = None, "between"
            elif self._state == "between":
                if rest.startswith("},{"):
                    self._sent += 2
                    self._state = "call"
                elif rest.startswith("}]}") or (rest.startswith("}]") and len(rest) == 2):
                    self._sent = len(self._text)
                    self._state = "done"
                else:
                    return content, deltas
            else:  # done: the object is closed
                self._sent = len(self._text)
                return content, deltas

    def _scan(self, text: str) -> int:
        """How much of ``text`` belongs to the arguments object that is open (tracking its nesting)."""
        for position, char in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return position + 1
        return len(text)

    # -- native families ----------------------------------------------------------------------------------

    MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}

    def _native(self, final: bool) -> tuple[str, list[Delta]]:
        marker = self.MARKERS.get(self.family)
        text = self._text
        if marker is not None:
            start = text.find(marker, self._sent)
            if start < 0:  # send all but a tail that may grow into the marker
                end = len(text) if final else _safe_end(text, self._sent, marker)
                content = text[self._sent : end]
                if self.calls and not content.strip() and not final:
                    return "", []  # whitespace between or after calls: held, dropped unless text follows
                self._sent = end
                return content if content.strip() or not self.calls else "", []
            content, self._sent = text[self._sent : start], start
            if self.calls and not content.strip():
                content = ""  # whitespace between calls is not text
            if self.family == "hermes":
                return self._hermes_blocks(content, final)
            if not final:
                return content, []
            return self._parse_rest(content)
        # llama3 and pythonic: a call is the whole answer, so an answer that may be one is held to its end
        if self._sent == 0 and _may_start_call(text, self.family):
            return self._parse_rest("") if final else ("", [])
        content, self._sent = text[self._sent :], len(text)
        return content, []

    def _hermes_blocks(self, content: str, final: bool) -> tuple[str, list[Delta]]:
        deltas = []
        while True:
            close = self._text.find("</tool_call>", self._sent)
            if close < 0:
                break
            end = close + len("</tool_call>")
            try:
                parsed = parse_hermes(self._text[self._sent : end])
            except ToolCallError:
                parsed = Parsed(self._text[self._sent : end], [])
            if not parsed.calls:  # a broken block stays text
                content += self._text[self._sent : end]
            for call in parsed.calls:
                deltas += self._whole(call)
            self._sent = end
            after = self._text.find("<tool_call>", self._sent)
            if after < 0:
                break
            gap = self._text[self._sent : after]
            content += gap if gap.strip() else ""  # whitespace between calls is not text
            self._sent = after
        if final:
            rest = self._text[self._sent :]
            if rest.strip():
                content += rest  # an unclosed block: text after all
            self._sent = len(self._text)
        return content, deltas

    def _parse_rest(self, content: str) -> tuple[str, list[Delta]]:
        rest = self._text[self._sent :]
        self._sent = len(self._text)
        try:
            parsed = PARSERS[self.family](rest)
        except ToolCallError:
            return content + rest, []
        deltas = []
        for call in parsed.calls:
            deltas += self._whole(call)
        return content + parsed.content, deltas

    def _whole(self, call: ToolCall) -> list[Delta]:
        index = len(self.calls)
        self.calls.append(call)
        return [Delta(index, call.id, call.name, ""), Delta(index, arguments=call.arguments)]


def _safe_end(text: str, sent: int, marker: str) -> int:
    for cut in range(max(sent, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[cut:]):
            return cut
    return len(text)


def _may_start_call(text: str, family: str) -> bool:
    stripped = text.lstrip()
    if family == "llama3":
        return not stripped or stripped.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(stripped)
    return not stripped or stripped.startswith("[")


ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _json_string_part(text: str) -> tuple[str, int, bool]:
    """Decode the start of a JSON string's body: (the text, characters used, whether its closing quote came).
    An escape cut short, or a high surrogate without its pair yet, waits for more."""
    out, position = [], 0
    while position < len(text):
        char = text[position]
        if char == '"':
            return "".join(out), position + 1, True
        if char != "\\":
            out.append(char)
            position += 1
            continue
        if position + 1 >= len(text):
            break
        kind = text[position + 1]
        if kind in ESCAPES:
            out.append(ESCAPES[kind])
            position += 2
            continue
        if position + 6 > len(text):
            break
        code = int(text[position + 2 : position + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: both halves or nothing
            if position + 12 > len(text):
                break
            low = int(text[position + 8 : position + 12], 16)
            out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
            position += 12
            continue
        out.append(chr(code))
        position += 6
    return "".join(out), position, False
