"""The prompt cache: reused prefixes give the same tokens, entries are copies, the budget holds."""

from __future__ import annotations

import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.prompt_cache import PromptCache, common_prefix
from runner.request import GenerationRequest
from tests.helpers import collect

PROMPT = "The for statement is used to iterate over the elements of a sequence"
OTHER = "Assignment statements are used to (re-)bind names to values"


@pytest.fixture(scope="module")
def cached():
    """The default pair with a prompt cache (the session's shared engine has the default budget too,
    but these tests look at its counters)."""
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=256 * 2**20))


def run(engine, cache: bool, **fields):
    tokens, text, last = collect(engine.generate(GenerationRequest(ignore_eos=True, cache_prompt=cache, **fields)))
    return tokens, last.stats


def ids(engine, text):
    return tuple(engine.tokenizer.encode(text))


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_hit_gives_the_same_tokens_as_a_cold_prefill(cached, k):
    prompt = ids(cached, PROMPT * 4)
    cold, cold_stats = run(cached, False, prompt_ids=prompt, max_tokens=120, num_draft_tokens=k)
    assert cold_stats.cached_tokens == 0
    run(cached, True, prompt_ids=prompt, max_tokens=60, num_draft_tokens=k)  # fills the cache
    warm, warm_stats = run(cached, True, prompt_ids=prompt, max_tokens=120, num_draft_tokens=k)
    # The entry holds prompt + 60 generated tokens: longer than the new prompt, so a trimmed copy.
    assert warm_stats.cached_tokens == len(prompt) - 1
    assert warm == cold


def test_a_prompt_that_diverges_mid_entry_reuses_the_shared_part(cached):
    shared = ids(cached, PROMPT * 3)
    first = shared + ids(cached, " and then " + OTHER)
    second = shared + ids(cached, " but never " + PROMPT)
    run(cached, True, prompt_ids=first, max_tokens=20)
    cold, _ = run(cached, False, prompt_ids=second, max_tokens=80)
    warm, stats = run(cached, True, prompt_ids=second, max_tokens=80)
    assert common_prefix(list(first), list(second)) <= stats.cached_tokens < len(second)
    assert warm == cold


def test_an_entry_is_never_changed_by_the_requests_that_reuse_it(cached):
    base = ids(cached, OTHER * 3)
    run(cached, True, prompt_ids=base, max_tokens=10)
    # Two different continuations of the same cached prefix, each twice, in alternation.
    a = base + ids(cached, " for example")
    b = base + ids(cached, " in the loop")
    results = [run(cached, True, prompt_ids=p, max_tokens=50) for p in (a, b, a, b)]
    assert all(stats.cached_tokens >= len(base) - 1 for _, stats in results)
    assert results[0][0] == results[2][0] and results[1][0] == results[3][0]
    assert results[0][0] == run(cached, False, prompt_ids=a, max_tokens=50)[0]


def test_the_release_rule_counts_generated_tokens_only(cached):
    prompt = ids(cached, PROMPT * 5)
    run(cached, True, prompt_ids=prompt, max_tokens=5)
    _, stats = run(cached, True, prompt_ids=prompt, max_tokens=600, num_draft_tokens=2)
    assert stats.cached_tokens > 0
    assert len(stats.release_positions) == 2
    for position, multiple in zip(stats.release_positions, (256, 512)):
        assert multiple <= position <= multiple + 2


def test_budget_evicts_least_recently_used_entries(cached):
    cache = PromptCache(budget=0)
    assert not cache.enabled and cache.lookup([1, 2, 3]).tokens == 0
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=64 * 2**20))
    pc = engine.prompt_cache
    run(engine, True, prompt_ids=ids(engine, "0 " + PROMPT), max_tokens=4)
    # A short prompt's entry is one 256-token KV block of the target (8 float32 layers, 2 MiB), and of the
    # draft's 2 layers when it saw every token (its cache is left out when it lags).
    entry = pc.nbytes
    assert pc.entries == 1 and 2 * 2**20 <= entry < 3 * 2**20
    pc.budget = int(2.5 * entry)  # room for two
    for i in range(1, 4):
        run(engine, True, prompt_ids=ids(engine, f"{i} " + PROMPT), max_tokens=4)
    assert pc.entries == 2 and pc.evictions == 2 and pc.nbytes <= pc.budget
    assert run(engine, True, prompt_ids=ids(engine, "3 " + PROMPT), max_tokens=4)[1].cached_tokens > 0
    assert run(engine, True, prompt_ids=ids(engine, "0 " + PROMPT), max_tokens=4)[1].cached_tokens == 0  # evicted
    released = engine.release_memory(prompt_cache=True)
    assert released.evicted_entries == 2 and pc.entries == 0 and pc.nbytes == 0


def test_second_chat_turn_reuses_the_first(smollm2_engine):
    engine = smollm2_engine
    turn1 = (("user", "Name three rivers in France."),)
    first, stats1 = run(engine, True, messages=turn1, max_tokens=40)
    answer = engine.tokenizer.decode(first)
    turn2 = turn1 + (("assistant", answer), ("user", "Which one is the longest?"))
    cold, _ = run(engine, False, messages=turn2, max_tokens=30)
    warm, stats2 = run(engine, True, messages=turn2, max_tokens=30)
    assert stats2.cached_tokens >= stats1.prompt_tokens  # the first turn's prompt and (most of) its answer
    assert warm == cold


@pytest.fixture(scope="module")
def smollm2_engine():
    return Engine.load(SMOLLM2_DIR, None, RunnerSettings(prompt_cache=512 * 2**20))
