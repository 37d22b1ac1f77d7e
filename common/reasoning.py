"""Models that think before they answer: which format a model's reasoning takes, and an answer split into its
reasoning and its content as it streams (issue #38).

MLX-free (the runner splits what it decodes; the tests read real chat templates). Two families:

- ``think``: the reasoning in a ``<think> ... </think>`` block before the answer (Qwen3, QwQ, DeepSeek-R1 and
  its distills, SmolLM3). Some templates open the block in the prompt themselves (DeepSeek-R1's ends the
  generation prompt with ``<think>\\n``): the answer then starts inside it (``opened``). A template that takes
  ``enable_thinking`` (Qwen3, SmolLM3) can be asked not to think (``switchable``).
- ``harmony``: gpt-oss's channels, ``<|channel|>analysis<|message|> ... <|end|>`` for the reasoning and
  ``<|channel|>final<|message|> ... <|return|>`` for the answer (``commentary`` carries tool calls, kept as
  content here).

``detect`` names the format from the template (and what its generation prompt ends with); the ``reasoning_format``
setting overrides it or turns it off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import InvalidRequest

FORMATS = ("think", "harmony")
THINK = ("", "on", "off")  # a request's think: the model's default, on, off
EFFORTS = ("none", "minimal", "low", "medium", "high")  # a request's reasoning_effort (OpenAI's words)
# The reasoning budget an effort gives a model that thinks in a block (its template takes no effort itself):
# "none" turns thinking off, "high" leaves it unbounded (max_tokens bounds it). gpt-oss's template takes the
# effort itself (its "Reasoning: low" line).
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": None}
HARMONY_CHANNEL, HARMONY_MESSAGE = "<|channel|>", "<|message|>"
HARMONY_ENDS = ("<|end|>", "<|return|>", "<|call|>")
HARMONY_FINAL = HARMONY_CHANNEL + "final" + HARMONY_MESSAGE  # the answer's header: what follows is the answer


@dataclass(frozen=True)
class ReasoningFormat:
    kind: str  # FORMATS
    start: str = "<think>"
    end: str = "</think>"
    opened: bool = False  # the generation prompt opens the block: the answer starts inside it
    switchable: bool = False  # the template takes enable_thinking (thinking can be turned off)


def detect(template: str | None, generation_prompt: str = "") -> ReasoningFormat | None:
    """The reasoning format a chat template writes, or None for a model that does not reason apart.
    ``generation_prompt``: what the template renders for a one-message conversation with the generation prompt
    (whether it opens the block itself)."""
    if not template:
        return None
    if HARMONY_CHANNEL in template and "analysis" in template:
        return ReasoningFormat("harmony", start=HARMONY_CHANNEL, end="<|end|>")
    if "</think>" in template or "<think>" in template:
        opened = generation_prompt.rstrip().endswith("<think>")
        return ReasoningFormat("think", opened=opened, switchable="enable_thinking" in template)
    return None


def of_setting(setting: str, detected: ReasoningFormat | None) -> ReasoningFormat | None:
    """The format a model's ``reasoning_format`` setting gives: "auto" (what was detected), "none", or a family
    named (with the detected details where the family is the same)."""
    if setting in ("", "auto"):
        return detected
    if setting == "none":
        return None
    if detected is not None and detected.kind == setting:
        return detected
    return (
        ReasoningFormat(setting, start=HARMONY_CHANNEL, end="<|end|>")
        if setting == "harmony"
        else ReasoningFormat(setting)
    )


def answer_start(text: str, fmt: ReasoningFormat, thinking: bool = True) -> int | None:
    """Where the answer starts in ``text`` (an answer as written, block and all), or None while it may still be
    reasoning: stop strings apply to the answer only (runner.stopping). A block the prompt opened (``opened``,
    and thinking) is reasoning until its end; otherwise the answer starts at once unless it opens a block."""
    if fmt.kind == "harmony":
        at = text.find(HARMONY_CHANNEL + "final")
        if at < 0:
            opening = HARMONY_CHANNEL in text or HARMONY_CHANNEL.startswith(text.lstrip())
            return None if opening else 0
        message = text.find(HARMONY_MESSAGE, at)
        return None if message < 0 else message + len(HARMONY_MESSAGE)
    if not (fmt.opened and thinking):
        stripped = text.lstrip()
        if not stripped.startswith(fmt.start):
            return None if fmt.start.startswith(stripped) else 0
    at = text.find(fmt.end)
    return None if at < 0 else at + len(fmt.end)


@dataclass(frozen=True)
class Plan:
    """How one request's answer reasons: what its switches (think, reasoning_budget, reasoning_effort) and its
    chat template's arguments ask of its model's format."""

    thinking: bool  # the answer may reason (a block the prompt opens is expected)
    budget: int | None = None  # the most reasoning tokens, its end forced there (runner.thinking); None: unbounded
    kwargs: dict = field(default_factory=dict)  # the chat template's arguments, with what the switches set
    empty_block: str = ""  # text after the generation prompt: an empty block, for a model that cannot be switched


NOT_A_REASONER = "this model does not reason apart from its answer (its reasoning_format is none)"


def plan(
    fmt: ReasoningFormat | None, think: str = "", budget: int | None = None, effort: str = "", kwargs=None
) -> Plan:
    """The request's plan for a model whose format is ``fmt``; raises InvalidRequest naming the switch the model
    cannot honour. ``kwargs``: the chat template's arguments the request gave (``enable_thinking`` False there is
    ``think`` off when the switches say nothing)."""
    kwargs = dict(kwargs or {})
    if fmt is None:
        for name, asked in (("think", think == "on"), ("reasoning_budget", budget is not None)):
            if asked:
                raise InvalidRequest(name, NOT_A_REASONER)
        if effort not in ("", "none"):
            raise InvalidRequest("reasoning_effort", NOT_A_REASONER)
        return Plan(False, kwargs=kwargs)
    off = think == "off" or effort == "none" or (not think and not effort and kwargs.get("enable_thinking") is False)
    if fmt.kind == "harmony":
        if off:
            raise InvalidRequest("think", "this model always reasons (gpt-oss's harmony format): ask a low effort")
        if budget is not None:
            raise InvalidRequest(
                "reasoning_budget", "is enforced for models that think in a block, not harmony's: ask an effort"
            )
        if effort:
            kwargs["reasoning_effort"] = "low" if effort == "minimal" else effort
        return Plan(True, kwargs=kwargs)
    if off:
        if fmt.switchable:
            kwargs["enable_thinking"] = False
            return Plan(False, kwargs=kwargs)
        empty = ("\n" if fmt.opened else f"{fmt.start}\n\n") + f"{fmt.end}\n\n"
        return Plan(False, kwargs=kwargs, empty_block=empty)
    if fmt.switchable and (think == "on" or effort or budget is not None):
        kwargs["enable_thinking"] = True
    return Plan(True, budget if budget is not None else EFFORT_BUDGETS.get(effort), kwargs)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``marker`` (held back until more comes)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """Splits an answer's text into (reasoning, content) as it streams: ``feed(text)`` gives what can be sent
    now, ``finish()`` what was held back. ``thinking``: whether the answer may think at all (False: a think
    block that comes anyway is still reasoning, but one the prompt opened is not expected)."""

    def __init__(self, fmt: ReasoningFormat, thinking: bool = True):
        self.fmt = fmt
        self.thinking = thinking
        self.state = "inside" if fmt.kind == "think" and fmt.opened and thinking else "start"
        self._fresh = self.state == "inside"  # at the block's start: its opening newlines are not reasoning
        self._pending = ""
        self.reasoning_chars = 0
        self._channel = ""  # harmony: the channel of the message being read

    @property
    def in_reasoning(self) -> bool:
        return self.state in ("inside", "analysis")

    def feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        if self.fmt.kind == "harmony":
            return self._harmony(final=False)
        return self._think(final=False)

    def finish(self) -> tuple[str, str]:
        if self.fmt.kind == "harmony":
            return self._harmony(final=True)
        return self._think(final=True)

    # -- <think> blocks ---------------------------------------------------------------------------------------

    def _think(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        start, end = self.fmt.start, self.fmt.end
        while self._pending:
            text = self._pending
            if self.state == "start":
                stripped = text.lstrip()
                if stripped.startswith(start):
                    self._pending = stripped[len(start) :]
                    self.state = "inside"
                    self._fresh = True
                    continue
                if not final and (not stripped or start.startswith(stripped)):
                    break  # may still become the block's start
                self.state = "content"
                continue
            if self.state == "inside":  # the newlines that open and close the block are the template's
                if self._fresh:
                    text = text.lstrip("\n")
                    self._fresh = not text
                at = text.find(end)
                if at >= 0:
                    reasoning += text[:at].rstrip("\n")
                    self._pending = text[at + len(end) :]
                    self.state = "after"
                    continue
                held = _held(text, end)  # a partial end marker, and the newlines before it, wait
                body = text[: len(text) - held]
                keep = 0 if final else held + len(body) - len(body.rstrip("\n"))
                reasoning += text[: len(text) - keep]
                self._pending = text[len(text) - keep :]
                break
            if self.state == "after":  # the blank lines between the block and the answer are neither
                stripped = text.lstrip("\n")
                if not stripped and not final:
                    self._pending = ""
                    break
                self._pending = stripped
                self.state = "content"
                continue
            content += text  # content
            self._pending = ""
        self.reasoning_chars += len(reasoning)
        return reasoning, content

    # -- harmony channels ---------------------------------------------------------------------------------------

    def _harmony(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while self._pending:
            text = self._pending
            if self.state == "plain":  # not harmony after all: all of it is the answer
                content += text
                self._pending = ""
                break
            if self.state in ("start", "between"):
                text = text.lstrip()
                opening = "<|start|>assistant"
                if text.startswith(opening):
                    text = text[len(opening) :]
                elif opening.startswith(text) and not final:
                    self._pending = text
                    break  # may be the next message's opening
                if not text:
                    self._pending = ""
                    break
                if not text.startswith(HARMONY_CHANNEL[: len(text)]) and not text.startswith(HARMONY_CHANNEL):
                    self.state = "plain"
                    self._pending = text
                    continue
                message = text.find(HARMONY_MESSAGE)
                if message < 0:
                    if final:
                        self._pending = ""
                    else:
                        self._pending = text
                    break  # the channel's header is not whole yet
                header = text[len(HARMONY_CHANNEL) : message].split()
                self._channel = header[0] if header else ""
                self.state = "analysis" if self._channel == "analysis" else "message"
                self._pending = text[message + len(HARMONY_MESSAGE) :]
                continue
            ends = [(text.find(marker), marker) for marker in HARMONY_ENDS if marker in text]
            if ends:
                at, marker = min(ends)
                piece, self._pending = text[:at], text[at + len(marker) :]
                self.state = "between"
            else:
                keep = 0 if final else max(_held(text, marker) for marker in HARMONY_ENDS)
                piece, self._pending = text[: len(text) - keep], text[len(text) - keep :]
            if self._channel == "analysis":
                reasoning += piece
            else:
                content += piece
            if not ends:
                break
        self.reasoning_chars += len(reasoning)
        return reasoning, content
