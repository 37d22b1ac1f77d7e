"""A generation request, and the same request prepared once: validated, tokenized, resolved.

The gRPC handler prepares a request before it queues (so a bad field is an
immediate INVALID_ARGUMENT), and the prepared request is what the MLX thread
generates from: nothing is validated or tokenized twice.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
from dataclasses import dataclass, fields

from common.errors import ContextExceeded, InvalidRequest
from common.reasoning import HARMONY_FINAL, Plan, ReasoningFormat
from common.reasoning import plan as reasoning_plan
from common.requests import check_fields, template_kwargs
from common.tool_calls import Tools, check_tools, conversation
from common.tool_calls import grammar as tool_grammar

from .sampling import SamplingParams

log = logging.getLogger("runner")

# End-of-turn tokens of common chat templates; a template that writes one of them ends a turn with it.
END_OF_TURN = (
    "<|im_end|>",
    "<|eot_id|>",
    "<end_of_turn>",
    "<|end|>",
    "<|eot|>",
    "<|END_OF_TURN_TOKEN|>",
    "</s>",
    "<|endoftext|>",
    "<｜end▁of▁sentence｜>",
)
# The fields common.requests.check_fields judges: its parameters, which a GenerationRequest has by the same names.
CHECKED = tuple(inspect.signature(check_fields).parameters)
# A text longer than this many characters per token of context cannot fit: refused before tokenizing.
MAX_CHARS_PER_TOKEN = 32
COUNTING_CONTEXT = 2**31 - 1  # no context limit when a prompt is only counted


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str = ""
    prompt_ids: tuple[int, ...] = ()  # used instead of ``prompt`` when given
    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    num_draft_tokens: int | None = None  # None = the engine's setting; 0 = no drafting
    ignore_eos: bool = False
    request_id: str = ""
    # (role, content[, name, tool_call_id, tool_calls, reasoning]): laid out by the chat template (common.tool_calls)
    messages: tuple[tuple, ...] = ()
    chat_template_kwargs: str = ""  # a JSON object
    logprobs: bool = False
    top_logprobs: int = 0
    drafter: str = ""  # "" = the engine's setting
    cache_prompt: bool = True  # reuse and keep KV caches in the prompt cache
    grammar: str = ""  # constrained output (runner.constraint); "" = free text
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    tools: str = ""  # OpenAI's function tools, a JSON list (common.tool_calls)
    tool_choice: str = ""  # "auto" (""), "none", "required" or "function" (call tool_name)
    tool_name: str = ""
    parallel_tool_calls: bool | None = None  # None = True
    presence_penalty: float = 0.0  # runner.penalties
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_context: int = 0  # > 0: the context this request may fill, below the model's (Ollama's num_ctx)
    resume_ids: tuple[int, ...] = ()  # an answer another runner started: its tokens follow the prompt
    resume_text: int = 0  # and this many characters of its text were sent already
    n: int = 0  # choices (0: 1); runner.server decodes them together, one shared prefill
    prompt_logprobs: bool = False  # score the prompt's tokens (its whole prefill, no prompt-cache reuse)
    context_ids: tuple[int, ...] = ()  # an earlier exchange's tokens, before the prompt (Ollama's context)
    return_prompt_ids: bool = False  # the first chunk carries the prompt's token ids
    adapter: str = ""  # a LoRA adapter of the model's (runner.loading.adapters); "" = the base alone
    think: str = ""  # a model that thinks (common.reasoning.plan): "on", "off", "" = its default
    reasoning_budget: int | None = None  # the most reasoning tokens (its end forced there); None = unbounded
    reasoning_effort: str = ""  # common.reasoning.EFFORTS


@dataclass(frozen=True)
class PreparedRequest:
    """Everything the decode loop needs, checked and resolved."""

    request: GenerationRequest
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int  # resolved: 0 when the engine cannot or should not draft
    max_tokens: int  # capped by the room left in the context
    seed: int
    eos_ids: frozenset[int]
    logprobs: bool = False
    top_logprobs: int = 0
    cache_prompt: bool = True
    constraint: object = None  # runner.constraint.Constraint: the request's grammar state, or None
    tool_format: str = ""  # the answer is split into text and calls of this family (common.tool_calls); "" = not
    adapter: int = 0  # the request's LoRA adapter's index in the engine's (0: the base alone)
    reasoning: ReasoningFormat | None = None  # its answer's reasoning is split from its content (a chat of a
    # model that thinks apart: common.reasoning)
    thinking: bool = False  # and it may reason (not switched off)
    # An image request (runner.vision.VisionInput): prompt_ids are then the prompt cache's keys, its images' tokens
    # ids of their digests beyond the vocabulary; the model is fed these real ids and the images' embeddings.
    vision_input: object = None

    @property
    def request_id(self) -> str:
        return self.request.request_id


def chat_ids(
    request: GenerationRequest,
    tokenizer,
    context_length: int,
    tools: Tools | None = None,
    tool_format: str = "",
    reasoning: Plan | None = None,
    vision: bool = False,
    tokenize: bool = True,
):
    """The conversation laid out by the model's chat template, ready for the assistant's turn; with tools (or
    earlier calls) laid out for the model's ``tool_format`` (``common.tool_calls.conversation``); ``reasoning``:
    what the request's switches ask of the template (its arguments, an empty block after the prompt);
    ``vision``: a model that sees, whose template takes each message as parts (its images, then its text);
    ``tokenize`` False: the text (an image request's, which the model's processor tokenizes)."""
    if not getattr(tokenizer, "has_chat_template", False):
        raise InvalidRequest("messages", "this model has no chat template: send a prompt instead")
    if sum(len(m[1]) for m in request.messages) + len(request.tools) > context_length * MAX_CHARS_PER_TOKEN:
        characters = sum(len(m[1]) for m in request.messages) + len(request.tools)
        raise ContextExceeded("messages", context_length, characters=characters)
    kwargs = reasoning.kwargs if reasoning is not None else template_kwargs(request.chat_template_kwargs)
    if tools is not None and (tools.functions or any(len(m) > 2 and (m[3] or m[4]) for m in request.messages)):
        messages = conversation(request.messages, tools, tool_format)
        if tool_format != "generic" and tools.functions:
            kwargs["tools"] = tools.definitions()
    else:
        messages = [{"role": m[0], "content": m[1]} for m in request.messages]
    aligned = len(messages) == len(request.messages)
    for message, entry in zip(request.messages, messages):  # an earlier turn's reasoning, as templates name it
        if len(message) > 5 and message[5] and entry["role"] == "assistant":
            entry["reasoning_content"] = entry["thinking"] = message[5]
        if len(message) > 6 and message[6]:
            if not aligned:
                raise InvalidRequest("messages", "images with tools laid out in the generic layout are not taken")
            entry["_images"] = len(message[6])

    def apply(entries):
        if vision:  # as parts: the message's images, then its text
            entries = [
                {
                    **{k: v for k, v in e.items() if k != "_images"},
                    "content": [{"type": "image"}] * e.get("_images", 0)
                    + ([{"type": "text", "text": e["content"]}] if e.get("content") or not e.get("_images") else []),
                }
                for e in entries
            ]
        return tokenizer.apply_chat_template(entries, add_generation_prompt=True, tokenize=tokenize, **kwargs)

    try:
        ids = apply(messages)
    except Exception as error:  # noqa: BLE001 - a template raises whatever it likes (jinja2, TypeError, ...)
        folded = fold_system_messages(messages)
        if folded is None:
            raise InvalidRequest("messages", f"the chat template refused them: {error}") from None
        try:  # a template that takes a system message only first (Gemma's, Llama 2's): fold the others in
            ids = apply(folded)
        except Exception:  # noqa: BLE001
            raise InvalidRequest("messages", f"the chat template refused them: {error}") from None
    if not tokenize:
        return ids + (reasoning.empty_block if reasoning is not None else "")
    if reasoning is not None and reasoning.empty_block:  # thinking off for a model that cannot skip it
        ids = list(ids) + list(tokenizer.encode(reasoning.empty_block, add_special_tokens=False))
    return [int(t) for t in ids]


def fold_system_messages(messages: list[dict]) -> list[dict] | None:
    """The conversation with every system message after the first message (Anthropic's mid-conversation system
    messages, a system message of OpenAI's after the first turn) folded into the nearest user message (the one
    before it, else the one after), for templates that refuse a system message anywhere but first; None where
    there is none to fold."""
    late = [i for i, m in enumerate(messages) if m["role"] == "system" and i > 0]
    if not late:
        return None
    out = [dict(m) for m in messages]
    for index in late:
        if all(m is None or m["role"] == "system" for m in out[:index]):  # system messages that open it: one
            out[0]["content"] = f"{out[0]['content']}\n\n{out[index]['content'] or ''}"
            out[index] = None
            continue
        users = [i for i in range(index - 1, -1, -1) if out[i] is not None and out[i]["role"] == "user"]
        users = users or [i for i in range(index + 1, len(out)) if out[i]["role"] == "user"]
        text = out[index]["content"] or ""
        if users:
            user = out[users[0]]
            before = users[0] < index
            user["content"] = f"{user['content']}\n\n{text}" if before else f"{text}\n\n{user['content']}"
        else:  # no user message at all: a user message of its own
            out[index] = {**out[index], "role": "user"}
            continue
        out[index] = None
    return [m for m in out if m is not None]


def end_of_turn_ids(tokenizer, harmony: bool = False) -> frozenset[int]:
    """Tokens the chat template ends a turn with (for SmolLM2 ``<|im_end|>``). In harmony's format (gpt-oss)
    ``<|end|>`` ends one message of the turn (its analysis), not the turn: its ends are EOS tokens of its own
    (``<|return|>``, ``<|call|>``)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return frozenset()
    ends = [token for token in END_OF_TURN if token in template and not (harmony and token == "<|end|>")]
    # One lookup per token, not the vocabulary: get_vocab() builds a dict of it, 20 ms a request for Qwen's.
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in ends}
    return frozenset(
        i for token, i in ids.items() if isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == token
    )


def prompt_ids_of(
    request: GenerationRequest,
    tokenizer,
    vocab_size: int,
    context_length: int,
    tools=None,
    tool_format: str = "",
    reasoning: Plan | None = None,
    vision: bool = False,
) -> list[int]:
    ids = own_prompt_ids(request, tokenizer, vocab_size, context_length, tools, tool_format, reasoning, vision)
    if not request.context_ids:
        return ids
    context = [int(t) for t in request.context_ids]
    if any(t >= vocab_size for t in context):
        raise InvalidRequest("context_ids", f"token ids must lie in [0, {vocab_size})")
    if ids and context and ids[0] == getattr(tokenizer, "bos_token_id", None) and adds_bos(request, tokenizer):
        ids = ids[1:]  # the context begins with it already: not a second one in the middle
    return context + ids


def adds_bos(request: GenerationRequest, tokenizer) -> bool:
    """Whether laying the request out put a BOS token before it: the chat template writes ``bos_token``, or the
    tokenizer adds one to a text. (SmolLM2's BOS is ``<|im_start|>``, which its template writes as a turn's start:
    that one is the conversation's own, and stays.)"""
    if request.messages:
        return "bos_token" in (getattr(tokenizer, "chat_template", None) or "")
    return not request.prompt_ids and bool(getattr(tokenizer, "add_bos_token", False))


def own_prompt_ids(
    request: GenerationRequest,
    tokenizer,
    vocab_size: int,
    context_length: int,
    tools=None,
    tool_format: str = "",
    reasoning: Plan | None = None,
    vision: bool = False,
) -> list[int]:
    if request.messages:
        return chat_ids(request, tokenizer, context_length, tools, tool_format, reasoning, vision)
    if request.prompt_ids:
        ids = [int(t) for t in request.prompt_ids]
        if any(t < 0 or t >= vocab_size for t in ids):
            raise InvalidRequest("prompt_ids", f"token ids must lie in [0, {vocab_size})")
        return ids
    if len(request.prompt) > context_length * MAX_CHARS_PER_TOKEN:
        raise ContextExceeded("prompt", context_length, characters=len(request.prompt))
    return tokenizer.encode(request.prompt)


def prepare(
    request: GenerationRequest,
    *,
    tokenizer,
    vocab_size: int,
    context_length: int,
    default_num_draft_tokens: int,
    can_draft: bool,
    grammars=None,
    tool_format: str = "generic",
    counting: bool = False,
    max_output_tokens: int = 0,
    adapters: tuple[str, ...] = (),
    reasoning: ReasoningFormat | None = None,
    vision=None,
    image_limits=None,
) -> PreparedRequest:
    """Validate (``common.requests.check_fields``: the same judge as the supervisor's) and tokenize ``request``
    once; raises InvalidRequest naming the field. ``tool_format``: how this model writes tool calls.
    ``counting``: only to count its prompt's tokens (Anthropic's count_tokens), so a prompt longer than the
    context is counted, not refused (the request's size is bounded by the gRPC message's).
    ``max_output_tokens``: the model's cap on an answer (its setting; 0 = none); ``adapters``: the names of the
    model's LoRA adapters, in their order (runner.loading.adapters)."""
    check_fields(**{f.name: getattr(request, f.name) for f in fields(request) if f.name in CHECKED})
    if request.max_context:
        context_length = min(context_length, request.max_context)
    if counting:
        context_length = COUNTING_CONTEXT
    tools = check_tools(request.tools, request.tool_choice, request.tool_name, request.parallel_tool_calls)
    pictures = [(i, m[6]) for i, m in enumerate(request.messages) if len(m) > 6 and m[6]]
    if pictures and vision is None:
        raise InvalidRequest(
            "messages", f"message {pictures[0][0]}: this model does not take images (it reads text only)"
        )
    asked = {
        "think": request.think == "on",
        "reasoning_budget": request.reasoning_budget is not None,
        "reasoning_effort": request.reasoning_effort not in ("", "none"),
    }
    if not request.messages and any(asked.values()):
        field = next(name for name, value in asked.items() if value)
        raise InvalidRequest(field, "goes with messages (a chat): a prompt is the model's text as it is")
    thinking = reasoning_plan(
        reasoning if request.messages else None,
        request.think,
        request.reasoning_budget,
        request.reasoning_effort,
        template_kwargs(request.chat_template_kwargs),
    )
    seen = None  # an image request's input (runner.vision)
    if pictures:
        for name in ("prompt_logprobs", "context_ids"):
            if getattr(request, name):
                raise InvalidRequest(name, "is not taken with images")
        text = chat_ids(request, tokenizer, context_length, tools, tool_format, thinking, vision=True, tokenize=False)
        every = [image for _, images in pictures for image in images]
        prompt_ids, seen = vision.input(text, every, image_limits, vocab_size)
    else:
        prompt_ids = prompt_ids_of(
            request, tokenizer, vocab_size, context_length, tools, tool_format, thinking, vision is not None
        )
    if any(t >= vocab_size for t in request.resume_ids):
        raise InvalidRequest("resume_ids", f"token ids must lie in [0, {vocab_size})")
    prompt_ids = prompt_ids + list(request.resume_ids)  # a resumed answer goes on from its tokens
    if seen is not None:
        seen = seen.resumed(list(request.resume_ids))
    if request.resume_ids and request.max_tokens <= len(request.resume_ids):
        raise InvalidRequest("resume_ids", "the answer has all its max_tokens already")
    if len(prompt_ids) >= context_length:
        raise ContextExceeded("messages" if request.messages else "prompt", context_length, tokens=len(prompt_ids))
    if not prompt_ids:
        raise InvalidRequest("prompt", "is empty once tokenized")
    if any(token >= vocab_size for token, _ in request.logit_bias):
        raise InvalidRequest("logit_bias", f"token ids must lie in [0, {vocab_size})")
    constraint = grammars.constraint(request.grammar) if request.grammar else None
    if tools.calls:
        constraint = tool_constraint(grammars, tools, tool_format, request.request_id)
    if thinking.thinking and (constraint is not None or thinking.budget is not None):
        constraint = thinking_phase(tokenizer, reasoning, thinking.budget, constraint, vocab_size, grammars.forcing)
    k = default_num_draft_tokens if request.num_draft_tokens is None else request.num_draft_tokens
    asked = min(request.max_tokens, max_output_tokens) if max_output_tokens else request.max_tokens
    eos_ids = frozenset() if request.ignore_eos else frozenset(tokenizer.eos_token_ids)
    if request.messages and not request.ignore_eos:
        eos_ids |= end_of_turn_ids(tokenizer, harmony=reasoning is not None and reasoning.kind == "harmony")
    return PreparedRequest(
        request=request,
        prompt_ids=prompt_ids,
        params=SamplingParams(request.temperature, request.top_k, request.top_p, request.min_p),
        num_draft_tokens=k if can_draft else 0,
        max_tokens=min(asked - len(request.resume_ids), context_length - len(prompt_ids)),
        seed=request.seed if request.seed is not None else secrets.randbits(63),
        eos_ids=eos_ids,
        logprobs=request.logprobs,
        top_logprobs=request.top_logprobs,
        cache_prompt=request.cache_prompt and not request.prompt_logprobs,  # every prompt position is scored
        constraint=constraint,
        tool_format=tool_format if tools.calls else "",
        adapter=adapter_index(request.adapter, adapters),
        reasoning=reasoning if request.messages else None,
        thinking=thinking.thinking,
        vision_input=seen,
    )


def thinking_phase(tokenizer, fmt: ReasoningFormat, budget: int | None, grammar, vocab_size: int, forcing: bool = True):
    """The reasoning of a model that thinks in a block, held as a constraint (runner.thinking): its end forced
    at ``budget`` (fed as certain drafts unless ``forcing`` is off: bench/reasoning.py compares), the request's
    ``grammar`` (if any) on the answer after it."""
    from .thinking import ThinkingPhase

    if fmt.kind == "harmony":  # free until the final channel opens (budgets are refused for harmony: plan)
        start, end = [], list(tokenizer.encode(HARMONY_FINAL, add_special_tokens=False))
        phase = ThinkingPhase(grammar, start, end, None, vocab_size, opened=True)
    else:
        start = list(tokenizer.encode(fmt.start, add_special_tokens=False))
        end = list(tokenizer.encode(fmt.end, add_special_tokens=False))
        phase = ThinkingPhase(grammar, start, end, budget, vocab_size, opened=fmt.opened)
    phase.forcing = forcing
    return phase


def adapter_index(name: str, adapters: tuple[str, ...]) -> int:
    """A request's adapter as its index in the model's (1 on; 0: the base alone); refused naming ``adapter``."""
    if not name:
        return 0
    if name not in adapters:
        listed = ", ".join(adapters) if adapters else "none"
        raise InvalidRequest("adapter", f"this model has no adapter {name!r} (its adapters: {listed})")
    return adapters.index(name) + 1


def tool_constraint(grammars, tools: Tools, tool_format: str, request_id: str = ""):
    """The grammar that holds the answer to calls of the offered tools (``common.tool_calls.grammar``), or
    None where it decodes freely; a parameters schema the engine cannot compile is refused naming ``tools``.

    A schema holding keywords the engine does not implement (Claude Code's ``propertyNames``) is held to the rest
    of itself, with a warning in the log, unless a function is marked ``strict``: an agent checks its tools'
    arguments itself, as it must with every server that does not constrain them, and refusing would refuse the
    whole tool set (Claude Code could not run at all)."""
    from .constraint import bounded_integers

    spec = tool_grammar(tools, tool_format, bounded_integers)
    if not spec:
        return None
    # The whole answer is JSON (and a call's markers hold no quote or digit) unless free text may come first.
    json_output = not (tools.choice == "auto" and tool_format != "generic")
    lenient = False
    try:
        constraint = grammars.constraint(spec, json_output=json_output)
    except InvalidRequest as error:
        relaxable = "Unimplemented keys" in error.message and not any(f.get("strict") for f in tools.functions)
        if not relaxable:
            raise InvalidRequest("tools", f"the functions' parameters cannot be enforced: {error.message}") from None
        log.warning(
            "request %s: tools: %s; their calls are held to the rest of each schema (mark a function strict to "
            "have it refused instead)",
            request_id or "-",
            error.message.removeprefix("grammar: "),
        )
        lenient = True
        try:
            constraint = grammars.constraint(
                tool_grammar(tools, tool_format, bounded_integers, lenient=True), json_output=json_output
            )
        except InvalidRequest as error:
            message = f"the functions' parameters cannot be enforced: {error.message}"
            raise InvalidRequest("tools", message) from None
    for function in tools.offered:  # each alone, so one that admits no arguments at all is refused here
        schema = dict(bounded_integers(function["parameters"]))
        if lenient:
            schema["x-guidance"] = {"lenient": True}
        try:
            grammars.compile(json.dumps({"json_schema": schema}))
        except InvalidRequest as error:
            why = error.message.removeprefix("grammar: ")
            raise InvalidRequest("tools", f"{function['name']}: its parameters cannot be enforced: {why}") from None
    return constraint
