"""What a generation request may ask, decided in one place, and how a generation ends.

``check_fields`` is the one judge of a request's fields, with one wording: the runner calls it when it prepares
a request (``runner.request.prepare``), the supervisor calls it on every request of its gRPC API before it
looks for the model (``check_message``), and the HTTP API calls it before it builds the message (a number past
what the message's field holds, or a string that is not Unicode, would otherwise fail in the protobuf
library). A refusal is ``InvalidRequest`` naming the field, which every API answers as its own "bad request".

What needs the model (the tokenizer, the context length, which drafters it has) is checked by the runner.
Importable without MLX.
"""

from __future__ import annotations

import enum
import json
import math

from .defaults import MAX_MESSAGE_BYTES, MAX_NUM_DRAFT_TOKENS
from .errors import InvalidRequest
from .reasoning import EFFORTS, THINK
from .settings import ADAPTER_NAME, DRAFTERS
from .tool_calls import check_history, check_tools

INT32_MAX = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_LENGTH = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # tokens a request may bias (OpenAI's own limit)
MAX_CHOICES = 16  # choices one request may ask for (n)
ROLES = ("system", "user", "assistant", "tool")
# A request message must reach the runner: the gRPC limit, less room for the fields around the prompt.
MAX_REQUEST_BYTES = MAX_MESSAGE_BYTES - 64 * 1024


class FinishReason(enum.IntEnum):
    """Why a generation ended: the runner's contract's numbers (``runner.proto``'s FinishReason), used as they are
    from the stopping criteria to each API's adapter, which names it in its own words."""

    STOP = 1  # end of sequence, end of turn, or a stop string
    LENGTH = 2  # max_tokens or the context length
    CANCELLED = 3  # the client went away or the runner is stopping
    TOOL_CALLS = 4  # the answer called tools (it stopped, and its calls are complete)


NOT_UNICODE = "is not valid Unicode text (it holds a lone surrogate such as \\ud800)"


def is_unicode(text: str) -> bool:
    """False for a string UTF-8 cannot carry: one with a lone surrogate, which JSON's ``\\ud800`` escapes allow."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(field: str, value: str) -> None:
    if not is_unicode(value):
        raise InvalidRequest(field, NOT_UNICODE)


def check_fields(
    *,
    prompt: str = "",
    prompt_ids=(),
    messages=(),
    max_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int | None = None,
    stop=(),
    num_draft_tokens: int | None = None,
    logprobs: bool = False,
    top_logprobs: int = 0,
    drafter: str = "",
    chat_template_kwargs: str = "",
    grammar: str = "",
    logit_bias=(),
    tools: str = "",
    tool_choice: str = "",
    tool_name: str = "",
    parallel_tool_calls: bool | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    max_context: int = 0,
    resume_ids=(),
    resume_text: int = 0,
    n: int = 0,
    prompt_logprobs: bool = False,
    context_ids=(),
    return_prompt_ids: bool = False,
    adapter: str = "",
    think: str = "",
    reasoning_budget: int | None = None,
    reasoning_effort: str = "",
) -> None:
    """Raise InvalidRequest naming the first field out of range. ``messages``: (role, content) pairs, or
    (role, content, name, tool_call_id, tool_calls[, reasoning, images]) tuples (``common.tool_calls.check_history``);
    ``chat_template_kwargs``: a JSON object, as text; ``tools``: OpenAI's list of tools, as JSON text; ``think``,
    ``reasoning_budget`` and ``reasoning_effort``: a model that thinks (common.reasoning)."""
    if not prompt and not len(prompt_ids) and not len(messages):
        raise InvalidRequest("prompt", "must not be empty (set prompt, prompt_ids or messages)")
    if len(messages) and (prompt or len(prompt_ids)):
        raise InvalidRequest("messages", "set one of prompt, prompt_ids and messages")
    if prompt and len(prompt_ids):
        raise InvalidRequest("prompt", "set prompt or prompt_ids, not both")
    _text("prompt", prompt)
    for name, ids in (("prompt_ids", prompt_ids), ("context_ids", context_ids)):
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in ids):
            raise InvalidRequest(name, f"token ids must lie in [0, {INT32_MAX}]")
    for index, (role, content, *_) in enumerate(messages):
        if role not in ROLES:
            raise InvalidRequest("messages", f"message {index}: role {role!r} is not one of {', '.join(ROLES)}")
        _text("messages", content)
    check_history(messages)
    if adapter and not ADAPTER_NAME.fullmatch(adapter):
        raise InvalidRequest("adapter", "an adapter's name is letters, digits, '.', '_' and '-'")
    if not 1 <= max_tokens <= INT32_MAX:
        raise InvalidRequest("max_tokens", f"must lie in [1, {INT32_MAX}]")
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidRequest("temperature", "must be a finite number >= 0")
    if not 0 <= top_k <= INT32_MAX:
        raise InvalidRequest("top_k", f"must lie in [0, {INT32_MAX}] (0 turns it off)")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise InvalidRequest("top_p", "must lie in (0, 1]")
    if not (math.isfinite(min_p) and 0 <= min_p <= 1):
        raise InvalidRequest("min_p", "must lie in [0, 1]")
    if seed is not None and not 0 <= seed < 2**63:
        raise InvalidRequest("seed", "must lie in [0, 2**63)")
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings")
    for text in stop:
        if not text:  # it would end every answer before its first token: refused, not ignored
            raise InvalidRequest("stop", "a stop string must not be empty")
        _text("stop", text)
        if len(text) > MAX_STOP_LENGTH:
            raise InvalidRequest("stop", f"each stop string is at most {MAX_STOP_LENGTH} characters")
    if num_draft_tokens is not None and not 0 <= num_draft_tokens <= MAX_NUM_DRAFT_TOKENS:
        raise InvalidRequest("num_draft_tokens", f"must lie in [0, {MAX_NUM_DRAFT_TOKENS}]")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("top_logprobs", f"must lie in [0, {MAX_TOP_LOGPROBS}]")
    if top_logprobs and not logprobs:
        raise InvalidRequest("top_logprobs", "needs logprobs")
    if drafter and drafter not in DRAFTERS:
        raise InvalidRequest("drafter", f"must be one of {', '.join(DRAFTERS)} (or empty)")
    template_kwargs(chat_template_kwargs)
    if grammar:
        _text("grammar", grammar)
    bias = dict(logit_bias)
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidRequest("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= INT32_MAX:
            raise InvalidRequest("logit_bias", f"keys must be token ids, not {token!r}")
        # Compared, not converted: NaN fails the comparison, and an integer too big for a float is refused.
        if not (isinstance(value, (int, float)) and -100 <= value <= 100):
            raise InvalidRequest("logit_bias", f"token {token}: the bias must lie in [-100, 100]")
    for name, value in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if not (isinstance(value, (int, float)) and -2 <= value <= 2):
            raise InvalidRequest(name, "must lie in [-2, 2]")
    if not (isinstance(repetition_penalty, (int, float)) and 0 < repetition_penalty <= 10):
        raise InvalidRequest("repetition_penalty", "must lie in (0, 10] (1 turns it off)")
    if not 0 <= max_context <= INT32_MAX:
        raise InvalidRequest("max_context", "must be >= 0 (0: the model's own context)")
    if not 0 <= n <= MAX_CHOICES:
        raise InvalidRequest("n", f"must lie in [1, {MAX_CHOICES}]")
    if len(resume_ids) or resume_text:
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= INT32_MAX for t in resume_ids):
            raise InvalidRequest("resume_ids", f"token ids must lie in [0, {INT32_MAX}]")
        if grammar or tools:
            raise InvalidRequest("resume_ids", "an answer under a grammar or with tools cannot be resumed")
        if not 0 <= resume_text:
            raise InvalidRequest("resume_text", "must be >= 0")
    if think not in THINK:
        raise InvalidRequest("think", 'must be "on" or "off" (or empty: the model\'s default)')
    if reasoning_effort and reasoning_effort not in EFFORTS:
        raise InvalidRequest("reasoning_effort", f"must be one of {', '.join(EFFORTS)}")
    if reasoning_budget is not None:
        if isinstance(reasoning_budget, bool) or not isinstance(reasoning_budget, int):
            raise InvalidRequest("reasoning_budget", "must be an integer")
        if not 0 <= reasoning_budget <= INT32_MAX:
            raise InvalidRequest("reasoning_budget", f"must lie in [0, {INT32_MAX}]")
        if think == "off" or reasoning_effort == "none":
            raise InvalidRequest("reasoning_budget", "a budget for reasoning that is turned off")
    if tools or tool_choice or tool_name:
        _text("tools", tools)
        if check_tools(tools, tool_choice, tool_name, parallel_tool_calls).calls and grammar:
            raise InvalidRequest("grammar", "set one of a grammar (response_format) and tools to call")
        if tools and not len(messages):
            raise InvalidRequest("tools", "tools go with messages (a conversation), not a prompt")


def template_kwargs(text: str) -> dict:
    """The chat template's extra arguments, from their JSON text ("" = none)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidRequest("chat_template_kwargs", "must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidRequest("chat_template_kwargs", "must be a JSON object")
    return value


def check_message(message) -> None:
    """``check_fields`` on a GenerateRequest message (the runner's or the supervisor's), and its size: a request
    the runner could not receive is refused here, saying so, not answered with the transport's error."""
    size = message.ByteSize()
    if size > MAX_REQUEST_BYTES:
        field = "messages" if len(message.messages) else "prompt"
        raise InvalidRequest(
            field,
            f"the request is {size} bytes, more than the {MAX_REQUEST_BYTES} a request may be: the prompt is too long",
        )
    check_fields(**fields_of(message))


def fields_of(message) -> dict:
    """A GenerateRequest message's fields as ``check_fields`` (and the runner's ``GenerationRequest``) take them:
    unset optional fields as their defaults, repeated ones as tuples, messages as (role, content, name,
    tool_call_id, tool_calls, reasoning, images) tuples with tool_calls as (id, name, arguments) triples."""
    return dict(
        prompt=message.prompt,
        prompt_ids=tuple(message.prompt_ids),
        messages=tuple(
            (
                m.role,
                m.content,
                m.name,
                m.tool_call_id,
                tuple((c.id, c.name, c.arguments) for c in m.tool_calls),
                m.reasoning,
                tuple(m.images),
            )
            for m in message.messages
        ),
        max_tokens=message.max_tokens,
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else 1.0,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        num_draft_tokens=message.num_draft_tokens if message.HasField("num_draft_tokens") else None,
        logprobs=message.logprobs,
        top_logprobs=message.top_logprobs,
        drafter=message.drafter,
        chat_template_kwargs=message.chat_template_kwargs,
        grammar=message.grammar,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        tools=message.tools,
        tool_choice=message.tool_choice,
        tool_name=message.tool_name,
        parallel_tool_calls=message.parallel_tool_calls if message.HasField("parallel_tool_calls") else None,
        presence_penalty=message.presence_penalty,
        frequency_penalty=message.frequency_penalty,
        repetition_penalty=message.repetition_penalty if message.HasField("repetition_penalty") else 1.0,
        max_context=message.max_context,
        resume_ids=tuple(message.resume_ids),
        resume_text=message.resume_text,
        n=message.n,
        prompt_logprobs=message.prompt_logprobs,
        context_ids=tuple(message.context_ids),
        return_prompt_ids=message.return_prompt_ids,
        adapter=message.adapter,
        think=message.think,
        reasoning_budget=message.reasoning_budget if message.HasField("reasoning_budget") else None,
        reasoning_effort=message.reasoning_effort,
    )
