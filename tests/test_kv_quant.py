"""Quantized KV caches (kv_bits, runner/kv_quant.py) on the default pair: 8-bit answers as float does, speculation
equals plain decoding at 8 and 4 bits, the release rule still releases, prompt-cache entries are stored at their
quantized size and hit with the tokens of a cold prefill, and the memory estimate counts quantized bytes.
Quantized requests decode in batches (runner.kv_quant.BatchQuantizedKVCache) with their tokens alone, and one
batch_memory admits more of them. A runner process says what it does in Info and refuses a group size its heads
cannot take."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.footprint import ModelFootprint, estimate
from common.protocol import runner_pb2
from common.settings import RunnerSettings, SettingsError
from runner.engine import Engine
from runner.kv_quant import BatchQuantizedKVCache, KVQuantization
from runner.request import GenerationRequest
from runner.worker import MlxWorker
from tests.helpers import most_active
from tests.processes import RunnerProcess

PROMPT = "The for statement is used to iterate over"


@pytest.fixture(scope="module")
def engines():
    return {
        bits: Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=2**30, kv_bits=bits))
        for bits in (0, 8, 4)
    }


def tokens_of(engine: Engine, prompt: str = PROMPT, tokens: int = 400, **fields):
    out, last = [], None
    for last in engine.generate(GenerationRequest(prompt=prompt, max_tokens=tokens, ignore_eos=True, **fields)):
        out += last.token_ids
    return out, last.stats


def test_8_bit_answers_as_float_does_and_speculation_equals_plain_decoding_at_8_and_4_bits(engines):
    plain = {bits: tokens_of(engine, drafter="none", cache_prompt=False) for bits, engine in engines.items()}
    float_tokens = plain[0][0]
    agreement = next((i for i, (a, b) in enumerate(zip(float_tokens, plain[8][0])) if a != b), len(float_tokens))
    assert agreement >= 200  # measured: all 400 (bench/kv_quant.py has the figures for longer runs and 4 bits)
    for bits in (8, 4):
        for drafter in ("model", "ngram"):
            tokens, stats = tokens_of(engines[bits], drafter=drafter, num_draft_tokens=3, cache_prompt=False)
            assert tokens == plain[bits][0], (bits, drafter)
            assert stats.drafted > stats.accepted > 0  # it drafted, and rewound the quantized cache
            assert stats.releases >= 2 and stats.release_positions[0] >= 256  # the 256-token crossing, the end


def test_prompt_cache_entries_are_quantized_and_hit_with_a_cold_prefills_tokens(engines):
    sizes = {}
    for bits, engine in engines.items():
        engine.prompt_cache.clear()
        tokens_of(engine, tokens=1000, drafter="none")
        (entry,) = engine.prompt_cache._entries.values()
        kinds = {type(layer) for layer in entry.caches[0]}
        assert kinds == ({QuantizedKVCache} if bits else {KVCache})
        sizes[bits] = engine.prompt_cache.nbytes
    assert sizes[8] < 0.35 * sizes[0] and sizes[4] < 0.22 * sizes[0]  # float32: 4 bytes a value
    follow_up = PROMPT + " the items of a list, and"
    cold = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0, kv_bits=8))
    expected, _ = tokens_of(cold, follow_up, 64, drafter="none")
    engines[8].prompt_cache.clear()
    tokens_of(engines[8], follow_up + " more", 64, drafter="none")  # an entry that shares all but the end
    tokens, stats = tokens_of(engines[8], follow_up, 64, drafter="none")
    assert stats.cached_tokens > 0 and tokens == expected


def test_a_cache_stays_float_until_it_passes_quantized_kv_start():
    engine = Engine.load(
        DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=2**30, kv_bits=8, quantized_kv_start=300)
    )
    tokens_of(engine, tokens=100, drafter="none")
    (short,) = engine.prompt_cache._entries.values()
    assert {type(layer) for layer in short.caches[0]} == {KVCache}
    engine.prompt_cache.clear()
    tokens_of(engine, tokens=400, drafter="none")
    (long,) = engine.prompt_cache._entries.values()
    assert {type(layer) for layer in long.caches[0]} == {QuantizedKVCache}


def test_the_estimate_counts_quantized_bytes():
    target, draft = ModelFootprint.of(DEFAULT_TARGET), ModelFootprint.of(DEFAULT_DRAFT)
    full = estimate([target, draft], "float32", "cpu").kv_cache
    eight = estimate([target, draft], "float32", "cpu", kv_bits=8).kv_cache
    draft_kv = draft.kv_bytes("float32", target.context_length)
    assert (eight - draft_kv) == pytest.approx((full - draft_kv) * (1 + 8 / 64) / 4, rel=0.01)  # 1.125 of 4 bytes


def test_bad_kv_settings_are_refused_naming_the_key():
    for fields, key in (({"kv_bits": 3}, "kv_bits"), ({"kv_group_size": 48}, "kv_group_size")):
        with pytest.raises(SettingsError) as caught:
            RunnerSettings(**fields)
        assert caught.value.key == key


def test_a_runner_with_kv_bits_says_so_and_refuses_a_group_its_heads_cannot_take(tmp_path):
    runner = RunnerProcess(tmp_path / "kv8", "--kv-bits", "8").wait_serving()
    try:
        info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
        assert info.kv_bits == 8 and info.kv_group_size == 64 and info.max_batch > 1

        def answer(prompt):
            chunks = runner.client.generate(timeout=120, prompt=prompt, max_tokens=32, ignore_eos=True)
            return [t for c in chunks for t in c.token_ids]

        prompts = [PROMPT, "A class definition", "The import statement", "Exceptions are"]
        alone = [answer(p) for p in prompts]
        assert all(len(a) == 32 for a in alone)
        with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent requests are served, batched
            assert list(pool.map(answer, prompts)) == alone
    finally:
        assert runner.stop() == 0
    bad = RunnerProcess(tmp_path / "bad", "--kv-bits", "4", "--kv-group-size", "128")
    assert bad.process.wait(120) == 2
    problems = [line for line in bad.stderr.splitlines() if line.startswith("runner:")]
    assert len(problems) == 1 and "kv_group_size 128 does not divide the attention heads' width (64)" in problems[0]


def dequantized(cache) -> tuple:
    """A quantized layer's keys and values as float (every row, every position it holds)."""
    keys, values = cache.keys_and_values()
    return tuple(mx.dequantize(*part, group_size=cache.group_size, bits=cache.bits) for part in (keys, values))


def quantized_layer(length: int, seed: int, bits: int = 8) -> QuantizedKVCache:
    layer = KVCache()
    mx.random.seed(seed)
    layer.update_and_fetch(mx.random.normal((1, 2, length, 64)), mx.random.normal((1, 2, length, 64)))
    return layer.to_quantized(group_size=64, bits=bits)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_batch_holds_each_rows_values_through_merge_extend_filter_and_extract(bits):
    rows = [quantized_layer(n, seed, bits) for seed, n in enumerate((5, 12, 9))]
    batch = BatchQuantizedKVCache.merge(rows[:2])
    batch.extend(BatchQuantizedKVCache.merge(rows[2:]))
    # A step appends one token to every row; rows keep their own values, at their own positions.
    step = mx.random.normal((3, 2, 1, 64))
    mask = batch.make_mask(1, return_array=True)  # as attention asks for it, before the step's update
    batch.update_and_fetch(step, step)
    assert mask.shape[0] == 3 and mask[0, 0, 0].tolist() == [False] * 7 + [True] * 6  # row 0: 7 padding positions
    for i, row in enumerate(rows):
        got = batch.extract(i)
        assert got.offset == row.offset + 1 and got.bits == bits
        for mine, theirs in zip(dequantized(got), dequantized(row)):
            assert mx.array_equal(mine[..., : row.offset, :], theirs)
    batch.filter([2, 0])  # row 1 (the longest) leaves: the padding the others share is dropped
    assert batch.left_padding.tolist() == [0, 4] and batch.extract(0).offset == rows[2].offset + 1
    assert batch.nbytes > 0 and not batch.empty()


def test_a_float_batch_is_quantized_whole_once_its_longest_row_passes_the_start():
    kv = KVQuantization(8, 64, start=10)
    rows = []
    for seed, n in enumerate((4, 8)):
        layer = KVCache()
        mx.random.seed(seed)
        layer.update_and_fetch(mx.random.normal((1, 2, n, 64)), mx.random.normal((1, 2, n, 64)))
        rows.append(layer)
    batch = BatchKVCache.merge(rows)
    cache = [batch]
    assert kv.apply(cache) == 0 and cache[0] is batch  # longest row 8 <= 10: float
    batch.update_and_fetch(*(mx.random.normal((2, 2, 3, 64)),) * 2)  # longest row 11
    assert kv.apply(cache) == 1 and isinstance(cache[0], BatchQuantizedKVCache)
    # Each row quantized as it would be alone.
    for i, row in enumerate(rows):
        alone = row.to_quantized(group_size=64, bits=8)
        got = cache[0].extract(i)
        for mine, theirs in zip(dequantized(got), dequantized(alone)):
            assert mx.array_equal(mine[..., : alone.offset, :], theirs)


def test_quantized_requests_decode_in_batches_with_their_tokens_alone_and_more_fit(engines):
    """At 8 bits the batch_memory that holds two float rows holds at least 1.8x as many; every request's greedy
    tokens are its tokens alone (the last one left goes on alone, speculating)."""
    floats, eight = engines[0].cache_cost, engines[8].cache_cost
    budget = floats.batch([256, 256])
    rows = max(n for n in range(1, 64) if eight.batch([256] * n) <= budget)
    assert rows >= 1.8 * 2
    engine = Engine(engines[8].target, engines[8].draft, RunnerSettings(kv_bits=8, prompt_cache=0, batch_memory=budget))
    prompts = [PROMPT, "A class definition", "The import statement", "Exceptions are", "The while", "Assignment"]
    lengths = [60, 40, 60, 50, 60, 80]
    expected = [tokens_of(engines[8], p, n, drafter="none", cache_prompt=False)[0] for p, n in zip(prompts, lengths)]
    worker = MlxWorker(engine, max_queue=8, max_batch=8)
    worker.start()
    try:
        with most_active(worker) as peak:
            jobs = [
                worker.submit(
                    engine.prepare(GenerationRequest(prompt=p, max_tokens=n, ignore_eos=True, cache_prompt=False))
                )
                for p, n in zip(prompts, lengths)
            ]
            got = [[t for r in job.results() for t in r.token_ids] for job in jobs]
        assert peak.most >= 4 and worker.batched_steps > 40
        assert got == expected
    finally:
        worker.stop(cancel_running=True)
        worker.join(10)
