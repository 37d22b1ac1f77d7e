"""Turning generated token ids into streamed text, with stop strings.

Text is released only when it is final: a token that ends inside a UTF-8
sequence waits for the next one, and the tail that might still grow into a
stop string is held back until it either completes one (then the text is cut
before it) or can no longer do so. A stop string split across rounds or
tokens therefore still stops, and never leaks into the output.
"""

from __future__ import annotations


class IncrementalDecoder:
    """Decodes a growing id sequence without re-decoding all of it each time.

    Keeps a short window of ids: the text of ``ids[prefix:]`` minus the text of
    ``ids[prefix:read]`` is what the newest tokens added. Works for byte-level
    BPE and sentencepiece alike, since it asks the tokenizer itself.
    """

    def __init__(self, tokenizer, skip_special: bool = True):
        self._decode = tokenizer.decode
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""

    def add(self, token: int) -> None:
        self._ids.append(token)
        window = self._ids[self._prefix :]
        before = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = self._decode(window, skip_special_tokens=self._skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix = self._read
            self._read = len(self._ids)

    def finish(self) -> None:
        """Flush whatever is pending (an incomplete character becomes U+FFFD)."""
        before = self._decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        after = self._decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        self.text += after[len(before) :]
        self._prefix = self._read = len(self._ids)


class StopMatcher:
    """Finds the first stop string in a growing text and says how much is safe to send."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.matched = ""  # the stop string found
        self._longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, sent: int, floor: int = 0) -> int | None:
        """Index where the earliest stop string starts, looking only at new text from ``floor`` on (``matched``
        names it)."""
        found = None
        for stop in self.stops:
            index = text.find(stop, max(floor, sent - len(stop) + 1))
            if index != -1 and (found is None or index < found):
                found, self.matched = index, stop
        return found

    def safe_end(self, text: str, sent: int) -> int:
        """End of the text that can be sent: before any suffix that starts a stop string."""
        if not self.stops:
            return len(text)
        start = max(sent, len(text) - self._longest + 1)
        for cut in range(start, len(text)):
            tail = text[cut:]
            if any(stop.startswith(tail) for stop in self.stops):
                return cut
        return len(text)


class TextStream:
    """Feeds tokens one at a time; reports new text and whether a stop string was hit. ``answer_start``: for an
    answer that may reason first (common.reasoning), where its answer starts in its text (None while it may
    still be reasoning): stop strings apply to the answer only."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), answer_start=None, keep_special: bool = False):
        """``keep_special``: special tokens are text too (gpt-oss's harmony channels, which split its answer)."""
        self._decoder = IncrementalDecoder(tokenizer, skip_special=not keep_special)
        self._stops = StopMatcher(stops)
        self._sent = 0
        self.stopped = False
        self._answer_start = answer_start
        self._floor: int | None = None if answer_start is not None and self._stops.stops else 0

    def prime(self, tokens, sent: int) -> None:
        """Go on from an answer another runner started: its ``tokens``, of whose text ``sent`` characters went
        out already (the rest, held back then, may still go out)."""
        for token in tokens:
            self._decoder.add(token)
        self._sent = min(sent, len(self._decoder.text))

    def add(self, token: int) -> str:
        """Add one token; returns the text that became final. Sets ``stopped``."""
        self._decoder.add(token)
        return self._release(final=False)

    def finish(self) -> str:
        """The request is over: flush the held-back tail (unless a stop string ended it)."""
        if self.stopped:
            return ""
        self._decoder.finish()
        return self._release(final=True)

    @property
    def text(self) -> str:
        return self._decoder.text[: self._sent]

    @property
    def stop_string(self) -> str:
        """The stop string that ended the text ("" if none did)."""
        return self._stops.matched if self.stopped else ""

    def _release(self, final: bool) -> str:
        text = self._decoder.text
        if self._floor is None:
            self._floor = self._answer_start(text)
        stop_at = None if self._floor is None else self._stops.find(text, self._sent, self._floor)
        if stop_at is not None:
            self.stopped = True
            end = stop_at
        else:
            end = len(text) if final else self._stops.safe_end(text, self._sent)
        delta = text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta
