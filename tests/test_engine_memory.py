"""The pool leak and its fix, reproduced on the CPU with the pool cap raised as on Metal/CUDA."""

import mlx.core as mx
import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import CACHE_LIMIT_UNBOUNDED, RunnerSettings
from runner.engine import Engine, GenerationRequest

GENERATED = 3000
PROMPT = "Assignment statements are used to (re-)bind names to values"
TRANSIENT_ALLOWANCE = 16 * 2**20


def kv_bytes_per_token(engine) -> int:
    """Bytes one token adds to the KV caches of the target and the draft."""
    total = 0
    for loaded in (engine.target, engine.draft):
        args = loaded.model.args
        head_dim = args.head_dim or args.hidden_size // args.num_attention_heads
        itemsize = getattr(mx, loaded.dtype).size
        total += args.num_hidden_layers * 2 * args.num_key_value_heads * head_dim * itemsize
    return total


def peak_pool_during(engine) -> tuple[int, object]:
    """Largest pool size seen between rounds of one long speculative generation."""
    mx.clear_cache()
    peak = 0
    for last in engine.generate(
        GenerationRequest(prompt=PROMPT, max_tokens=GENERATED, num_draft_tokens=3, ignore_eos=True)
    ):
        peak = max(peak, mx.get_cache_memory())
    return peak, last


@pytest.fixture(scope="module")
def pools():
    previous = mx.set_cache_limit(0)
    mx.set_cache_limit(previous)
    try:
        measured = {}
        for release in (True, False):
            engine = Engine.load(
                DEFAULT_TARGET,
                DEFAULT_DRAFT,
                RunnerSettings(cache_limit=CACHE_LIMIT_UNBOUNDED, release_enabled=release),
            )
            assert mx.set_cache_limit(mx.get_memory_limit()) == mx.get_memory_limit()  # really unbounded
            measured[release] = (*peak_pool_during(engine), engine)
        yield measured
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()


def growth_bound(engine, total_tokens: int) -> int:
    """What the pool may hold between two releases, at most.

    (a) The buffer the one KV growth inside an interval leaves behind: the old
        keys/values of every layer of both models, at most the whole cache so
        far (rounded up to the 256-token step).
    (b) Round transients (attention scores, RoPE and concat temporaries) whose
        shapes grow with the context, so MLX cannot reuse them from one round to
        the next. One interval's worth is bounded by three more caches' size
        here (measured on the default pair at 3000 tokens, 27 MB cache: ~50 MB
        when the draft model ran one row a pass; ~78 MB since it queues the next
        round's first draft with the verification, a pass of k + 1 rows:
        runner.drafting.drafters.ModelDrafter.queue_next).
    Plus a fixed allowance for logits and small buffers. The leak without the
    release is the sum of (a) over every growth, which this bound cannot hold.
    """
    steps = -(-total_tokens // 256)
    full_cache = kv_bytes_per_token(engine) * steps * 256
    return 4 * full_cache + TRANSIENT_ALLOWANCE


def test_release_keeps_the_pool_to_one_growth_step(pools):
    peak, last, engine = pools[True]
    assert last.stats.generated_tokens == GENERATED
    assert len(last.stats.release_positions) == GENERATED // 256
    bound = growth_bound(engine, last.stats.prompt_tokens + GENERATED)
    assert peak < bound, f"pool reached {peak / 2**20:.1f} MB, bound {bound / 2**20:.1f} MB"


def test_without_release_the_pool_grows_several_times_larger(pools):
    fixed_peak, _, _ = pools[True]
    leaky_peak, last, engine = pools[False]
    assert last.stats.release_positions == [] and last.stats.releases == 0
    print(f"pool peak with release {fixed_peak / 2**20:.1f} MB, without {leaky_peak / 2**20:.1f} MB")
    assert leaky_peak > 3 * fixed_peak, (leaky_peak, fixed_peak)
    assert leaky_peak > growth_bound(engine, last.stats.prompt_tokens + GENERATED)
