"""The release rule: when to hand MLX's freed-buffer pool back to the system.

MLX keeps freed buffers in a pool for reuse. The KV cache grows in steps of
256 tokens, and each growth leaves the old, smaller buffer in that pool, where
no later allocation of the larger size can use it. Releasing the pool
(``mx.clear_cache()``) once per growth step keeps it bounded.

A speculative round emits several tokens at once, so the generated count
usually steps *over* a multiple of the interval rather than landing on it.
The rule therefore fires whenever a round crosses a multiple, which is what
``boundaries_crossed`` counts; checking ``count % interval == 0`` would miss
most of them and leak a buffer per growth.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_RELEASE_INTERVAL = 256


def boundaries_crossed(before: int, after: int, interval: int) -> int:
    """How many multiples of ``interval`` lie in (before, after]."""
    if interval <= 0:
        raise ValueError("interval must be positive")
    if after < before:
        raise ValueError("the generated count cannot go backwards")
    return after // interval - before // interval


@dataclass
class ReleaseSchedule:
    """Applies the release rule round by round and records every release.

    ``release`` is the function that empties the pool (``mx.clear_cache`` in
    the engine); ``enabled=False`` is a debug setting that shows the leak.
    """

    release: Callable[[], object]
    interval: int = DEFAULT_RELEASE_INTERVAL
    enabled: bool = True
    positions: list[int] = field(default_factory=list)  # generated count at each boundary release
    count: int = 0  # every release, the end-of-request ones included

    def after_round(self, before: int, after: int) -> bool:
        """Call once per round with the generated count before and after it."""
        if not self.enabled or boundaries_crossed(before, after, self.interval) == 0:
            return False
        self._release()
        self.positions.append(after)
        return True

    def at_end(self) -> None:
        """Every request ends with a release, whatever the count."""
        if self.enabled:
            self._release()

    def _release(self) -> None:
        self.release()
        self.count += 1
