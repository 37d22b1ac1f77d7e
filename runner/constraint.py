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
until max_tokens): a JSON consumer could not hold more anyway.
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
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHED_GRAMMARS:
                self._compiled.popitem(last=False)
        return matcher.deep_copy()

    def constraint(self, spec: str) -> Constraint:
        return Constraint(self.compile(spec), self.vocab_size, self.forcing)


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "the grammar is invalid"


class ConstraintBroken(InvalidRequest):
    """The matcher refused a token the mask allowed, or could not go on (a grammar beyond llguidance's limits at
    decode time): that request ends with this error, the others go on (runner.session)."""

    def __init__(self, message: str):
        super().__init__("grammar", message)


class Constraint:
    """One request's grammar state."""

    def __init__(self, matcher, vocab_size: int, forcing: bool = True):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.forcing = forcing

    def mask(self) -> np.ndarray:
        """The allowed tokens at the current position: a bitmask, one bit per token (uint8, little-endian)."""
        return np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)

    @staticmethod
    def allows(mask: np.ndarray, token: int) -> bool:
        return token // 8 < mask.size and bool((mask[token // 8] >> (token % 8)) & 1)

    def only(self, mask: np.ndarray) -> int | None:
        """The one token ``mask`` allows, if it allows exactly one."""
        nonzero = np.flatnonzero(mask)
        if nonzero.size != 1:
            return None
        byte = int(nonzero[0])
        bits = int(mask[byte])
        if bits & (bits - 1):
            return None
        token = byte * 8 + bits.bit_length() - 1
        return token if token < self.vocab_size else None

    def forced(self, limit: int, stop_ids: frozenset[int]) -> tuple[list[int], np.ndarray]:
        """The tokens the grammar forces from here (consumed), at most ``limit``, stopping before a token in
        ``stop_ids`` (the stopping criteria end a request there); and the mask after them."""
        tokens = []
        mask = self.mask()
        while self.forcing and len(tokens) < limit and not self.matcher.is_stopped():
            token = self.only(mask)
            if token is None or token in stop_ids:
                break
            self.consume(token)
            tokens.append(token)
            mask = self.mask()
        return tokens, mask

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token) or self.matcher.is_error():
            raise ConstraintBroken(f"the grammar refused token {token}: {self.matcher.get_error()}")

    def rollback(self, count: int) -> None:
        if count and not self.matcher.rollback(count):
            raise ConstraintBroken(f"the grammar could not take back {count} tokens: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and its end was consumed."""
        return self.matcher.is_stopped()


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
