"""Constrained decoding: a grammar decides which tokens may come next.

A request may carry a grammar (``GenerationRequest.grammar``, a JSON object:
``{"json_schema": {...}}``, ``{"json_object": true}``, ``{"regex": "..."}`` or
``{"lark": "..."}``). llguidance turns it into a matcher over the model's
vocabulary; the matcher follows every token the request emits and gives, at
each position, the bitmask of tokens the grammar allows. Why llguidance (and
not xgrammar or outlines-core): docs/design.md ("Constrained output"), measured
by bench/grammar.py.

Units, each with one job:

- ``Grammars`` (one per engine): the tokenizer index, built once on first use
  (0.4-1.4 s for a 49k-150k vocabulary), and compiled grammars, cached per
  grammar text (a request copies the cached matcher). Compiling is where a bad
  grammar is refused: ``InvalidRequest`` naming ``grammar`` and the cause.
- ``Constraint`` (one per request): the matcher's state, the mask at the
  current position, the tokens the grammar forces (where it allows exactly one
  token: they go into the next forward pass as certain drafts, with no drafter
  and no verification), and ``allows``/``consume``/``rollback`` for walking a
  speculative proposal and taking back what the target rejected.
- ``apply_masks``: the masks on a block of logits, as MLX ops (unpacking the
  bits on the device), so they run on every backend (CPU, CUDA, Metal).

JSON is compiled without flexible whitespace (``{"a":1}``, separators fixed):
a model cannot run away emitting whitespace (Ollama's #18567), and fixed
separators are forced tokens. For the same reason an integer without bounds is
bounded to +-(2**53 - 1), JSON's interoperable range (SmolLM2 at temperature 1 wrote an unbounded integer's digits
until max_tokens): a JSON consumer could not hold more anyway. A number's
digits are bounded the same way (``NumberBound``): at most 17 significant
digits (what a float64 holds), 24 digits before the exponent and 3 in it;
past them the mask leaves only what ends the number (SmolLM2 at temperature 1
otherwise wrote ``2.46288874348788888888...`` until max_tokens).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

import mlx.core as mx
import numpy as np

from common.errors import InvalidRequest

# Compiled grammars kept per engine (a request copies one: cheaper than compiling again).
CACHED_GRAMMARS = 64
# No whitespace between JSON tokens, the usual separators: nothing for a model to run away with.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
KINDS = ("json_schema", "json_object", "regex", "lark")
SAFE_INTEGER = (-(2**53 - 1), 2**53 - 1)  # JSON's interoperable range (RFC 8259, section 6)
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
LITERALS = ("const", "enum", "default", "examples")  # values, not schemas: left as they are


def bounded_integers(schema):
    """``schema`` with every integer that has no bound given JSON's interoperable bounds (a copy)."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    copy = {key: value if key in LITERALS else bounded_integers(value) for key, value in schema.items()}
    kind = schema.get("type")
    if (kind == "integer" or (isinstance(kind, list) and kind == ["integer"])) and not any(b in schema for b in BOUNDS):
        copy["minimum"], copy["maximum"] = SAFE_INTEGER
    return copy


# Bounds on what compiling and following one grammar may cost (llguidance's own limits, tightened): a pathological
# grammar is refused in a second or two instead of holding the runner.
LIMITS = {"initial_lexer_fuel": 1_000_000, "step_lexer_fuel": 200_000, "max_grammar_size": 200_000}


def grammar_text(spec: str) -> str:
    """llguidance's grammar for ``spec`` (the request's ``grammar`` field); raises InvalidRequest."""
    import llguidance

    try:
        parsed = json.loads(spec)
    except json.JSONDecodeError as error:
        raise InvalidRequest("grammar", f"is not JSON: {error}") from None
    except RecursionError:
        raise InvalidRequest("grammar", "is nested too deeply") from None
    if not isinstance(parsed, dict) or len(parsed) != 1 or next(iter(parsed)) not in KINDS:
        raise InvalidRequest("grammar", f"must be an object with one of {', '.join(KINDS)}")
    kind, value = next(iter(parsed.items()))
    try:
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if kind == "json_schema":
            if not isinstance(value, dict):
                raise InvalidRequest("grammar", "json_schema must be a JSON object (a schema)")
            try:
                value = bounded_integers(value)
            except RecursionError:
                raise InvalidRequest("grammar", "the schema is nested too deeply") from None
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=JSON_OPTIONS)
        if not isinstance(value, str):
            raise InvalidRequest("grammar", f"{kind} must be a string")
        return (
            llguidance.LLMatcher.grammar_from_regex(value)
            if kind == "regex"
            else llguidance.LLMatcher.grammar_from_lark(value)
        )
    except ValueError as error:
        raise InvalidRequest("grammar", str(error)) from None


SIGNIFICANT_DIGITS = 17  # a float64 round-trips through 17 significant digits
MANTISSA_DIGITS = 24  # digits before the exponent, leading zeros of a fraction included
EXPONENT_DIGITS = 3  # a float64's exponent is at most 308


class DigitTables:
    """Per token of a vocabulary: how many digits its text begins with, and whether it begins with a '.'
    (what could continue a JSON number), as packed bitmasks of the tokens to forbid when only ``r`` more digits
    may come (``forbidden``)."""

    def __init__(self, index, vocab_size: int):
        lead = np.zeros(vocab_size, dtype=np.int16)
        dot = np.zeros(vocab_size, dtype=bool)
        for token in range(min(vocab_size, index.vocab_size)):
            text = index.decode_bytes([token])
            count = len(text) - len(text.lstrip(b"0123456789"))
            lead[token] = count
            dot[token] = text[:1] == b"."
        self.lead, self.dot = lead, dot
        self.longest = int(lead.max()) if vocab_size else 0  # no token holds more digits: nothing to forbid below
        self._packed: dict[tuple[int, bool], np.ndarray] = {}

    def forbidden(self, remaining: int, no_fraction: bool) -> np.ndarray:
        """The packed bitmask of tokens that would pass ``remaining`` more digits (and, with ``no_fraction``, that
        would open a fraction, which needs a digit)."""
        key = (max(remaining, 0), no_fraction)
        packed = self._packed.get(key)
        if packed is None:
            tokens = self.lead > key[0]
            if no_fraction:
                tokens = tokens | self.dot
            packed = self._packed[key] = np.packbits(tokens, bitorder="little")
        return packed


class NumberBound:
    """Where a JSON answer is inside a number, and how many digits it has there: a small lexer over the bytes of
    the tokens a request consumed (strings skipped, escapes followed), with its state saved per token so a
    rollback takes it back. ``limit`` gives how many more digits may come, or None outside a number."""

    def __init__(self, index):
        self._index = index
        # (in a string, escaped, number phase or None, significant digits, mantissa digits, exponent digits)
        self._state = (False, False, None, 0, 0, 0)
        self._history: list[tuple] = []

    def consume(self, token: int) -> None:
        self._history.append(self._state)
        in_string, escaped, phase, significant, mantissa, exponent = self._state
        for byte in self._index.decode_bytes([token]):
            char = chr(byte)
            if in_string:
                if escaped:
                    escaped = False
                elif char == "\\":
                    escaped = True
                elif char == '"':
                    in_string = False
            elif char == '"':
                in_string, phase = True, None
            elif "0" <= char <= "9":
                if phase is None:
                    phase, significant, mantissa, exponent = "integer", 0, 0, 0
                if phase in ("integer", "fraction"):
                    mantissa += 1
                    significant += 1 if significant or char != "0" else 0
                else:
                    phase, exponent = "exponent", exponent + 1
            elif char == "-" and phase is None:
                phase, significant, mantissa, exponent = "integer", 0, 0, 0
            elif char == "." and phase == "integer":
                phase = "fraction"
            elif char in "eE" and phase in ("integer", "fraction"):
                phase = "sign"
            elif char in "+-" and phase == "sign":
                pass
            else:
                phase = None
        self._state = (in_string, escaped, phase, significant, mantissa, exponent)

    def rollback(self, count: int) -> None:
        for _ in range(min(count, len(self._history))):
            self._state = self._history.pop()

    def limit(self) -> tuple[int, bool] | None:
        """(digits that may still come, whether a fraction may no longer open), or None where any may."""
        _, _, phase, significant, mantissa, exponent = self._state
        if phase in ("integer", "fraction"):
            remaining = min(SIGNIFICANT_DIGITS - significant, MANTISSA_DIGITS - mantissa)
            return remaining, phase == "integer" and remaining <= 0
        if phase in ("sign", "exponent"):
            return EXPONENT_DIGITS - exponent, False
        return None


class Grammars:
    """The tokenizer index and the compiled grammars of one engine."""

    def __init__(self, tokenizer, vocab_size: int, end_ids=()):
        """``end_ids``: every token that may end an answer (EOS and the template's end of turn): the grammar
        allows each of them once it is complete."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._end_ids = sorted(end_ids)
        self._index = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._digits: DigitTables | None = None
        self._lock = threading.Lock()  # requests are prepared on gRPC threads
        self.forcing = True  # feed forced tokens as certain drafts (bench/structured.py turns it off to compare)

    def index(self):
        """llguidance's view of the vocabulary (built once, on the first constrained request)."""
        if self._index is None:
            import llguidance.hf

            hf = getattr(self._tokenizer, "_tokenizer", self._tokenizer)
            try:
                self._index = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self._end_ids or None)
            except (ValueError, TypeError, AttributeError) as error:
                raise InvalidRequest("grammar", f"this model's tokenizer cannot be constrained: {error}") from None
        return self._index

    def compile(self, spec: str):
        """A fresh matcher for ``spec``: a copy of the cached one, compiled on first use."""
        import llguidance

        with self._lock:
            matcher = self._compiled.get(spec)
            if matcher is not None:
                self._compiled.move_to_end(spec)
                return matcher.deep_copy()
            index = self.index()
        grammar = grammar_text(spec)
        matcher = llguidance.LLMatcher(index, grammar, log_level=0, limits=llguidance.LLParserLimits(**LIMITS))
        if matcher.is_error():
            raise InvalidRequest("grammar", _first_line(matcher.get_error()))
        probe = matcher.deep_copy()
        probe.compute_bitmask()
        if probe.is_error():  # a schema that refers to itself with no way to end: it admits no answer at all
            raise InvalidRequest("grammar", "admits no answer (nothing can be written that it accepts)")
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def digits(self) -> DigitTables:
        if self._digits is None:
            tables = DigitTables(self.index(), self.vocab_size)
            with self._lock:
                self._digits = self._digits or tables
        return self._digits

    def constraint(self, spec: str, json_output: bool | None = None) -> Constraint:
        """A request's constraint for ``spec``; ``json_output``: the whole answer is JSON, so its numbers'
        digits are bounded (``NumberBound``); by default, for JSON schemas and objects."""
        matcher = self.compile(spec)
        if json_output is None:
            json_output = spec.lstrip().startswith(('{"json_schema"', '{"json_object"'))
        numbers = NumberBound(self.index()) if json_output else None
        return Constraint(matcher, self.vocab_size, self.forcing, numbers, self.digits() if json_output else None)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"


class ConstraintBroken(InvalidRequest):
    """The matcher refused a token the mask allowed, or could not go on (a grammar beyond llguidance's limits at
    decode time): that request ends with this error, the others go on (runner.session)."""

    def __init__(self, message: str):
        super().__init__("grammar", message)


class Constraint:
    """One request's grammar state."""

    spent = False  # never: it holds the answer to its end (runner.thinking's phase is spent once it answers)

    def __init__(self, matcher, vocab_size: int, forcing: bool = True, numbers=None, digits=None):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.forcing = forcing
        self.numbers: NumberBound | None = numbers  # JSON answers: where a number's digits are
        self.digits: DigitTables | None = digits

    def mask(self) -> np.ndarray:
        """The allowed tokens at the current position: a bitmask, one bit per token (uint8, little-endian). Inside
        a JSON number that has all the digits it may have, the tokens that would add more are left out (unless
        nothing else is allowed)."""
        mask = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():  # no way on from here (a part of the grammar that admits nothing)
            raise ConstraintBroken(f"admits no way on from here: {_first_line(self.matcher.get_error())}")
        limit = self.numbers.limit() if self.numbers is not None else None
        if limit is None:
            return mask
        remaining, no_fraction = limit
        if remaining >= self.digits.longest and not no_fraction:
            return mask
        bounded = mask & ~_fit(self.digits.forbidden(remaining, no_fraction), mask.size)
        return bounded if bounded.any() else mask

    @staticmethod
    def allows(mask: np.ndarray, token: int) -> bool:
        return allows(mask, token)

    def only(self, mask: np.ndarray) -> int | None:
        """The one token ``mask`` allows, if it allows exactly one."""
        return only_token(mask, self.vocab_size)

    def forced(self, limit: int, stop_ids: frozenset[int]) -> tuple[list[int], np.ndarray]:
        """The tokens the grammar forces from here (consumed), at most ``limit``, stopping before a token in
        ``stop_ids`` (the stopping criteria end a request there); and the mask after them."""
        return forced_tokens(self, limit, stop_ids)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise ConstraintBroken(f"the grammar refused token {token}: {self.matcher.get_error()}")
        if self.numbers is not None:
            self.numbers.consume(token)

    def rollback(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            raise ConstraintBroken(f"the grammar could not take back {count} tokens: {self.matcher.get_error()}")
        if count and self.numbers is not None:
            self.numbers.rollback(count)

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end was consumed."""
        return self.matcher.is_stopped()


def allows(mask: np.ndarray | None, token: int) -> bool:
    """Whether ``mask`` (None: no mask) allows ``token``."""
    return mask is None or (token // 8 < mask.size and bool((mask[token // 8] >> (token % 8)) & 1))


def only_token(mask: np.ndarray | None, vocab_size: int) -> int | None:
    """The one token ``mask`` allows, if it allows exactly one (None for no mask)."""
    if mask is None:
        return None
    nonzero = np.flatnonzero(mask)
    if nonzero.size != 1:
        return None
    byte = int(nonzero[0])
    bits = int(mask[byte])
    if bits & (bits - 1):
        return None
    token = byte * 8 + bits.bit_length() - 1
    return token if token < vocab_size else None


def forced_tokens(constraint, limit: int, stop_ids: frozenset[int]) -> tuple[list, np.ndarray | None]:
    """What ``constraint`` (a Constraint, or runner.thinking's phase) forces from here, consumed: each token its
    mask allows alone, at most ``limit``, stopping before one in ``stop_ids`` or at the grammar's end; and the
    mask after them."""
    tokens = []
    mask = constraint.mask()
    while constraint.forcing and len(tokens) < limit and not constraint.finished:
        token = constraint.only(mask)
        if token is None or token in stop_ids:
            break
        constraint.consume(token)
        tokens.append(token)
        mask = constraint.mask()
    return tokens, mask


def apply_masks(logits: mx.array, masks: list[np.ndarray | None]) -> mx.array:
    """``logits`` (rows, vocab) with each row's disallowed tokens at -inf; a None mask leaves its row as is."""
    if all(m is None for m in masks):
        return logits
    vocab = logits.shape[-1]
    width = (vocab + 7) // 8
    full = np.full(width, 0xFF, dtype=np.uint8)
    packed = np.stack([full if m is None else _fit(m, width) for m in masks])
    bits = (mx.array(packed)[:, :, None] >> mx.arange(8, dtype=mx.uint8)) & 1
    allowed = bits.reshape(len(masks), -1)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(-mx.inf, logits.dtype))


def _fit(mask: np.ndarray, width: int) -> np.ndarray:
    if mask.size >= width:
        return mask[:width]
    return np.concatenate([mask, np.zeros(width - mask.size, dtype=np.uint8)])
