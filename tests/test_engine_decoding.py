"""Speculative decoding on the embedded pair: exactness, releases, limits, stop conditions."""

import pytest

from common.defaults import CPU_PREFILL_CHUNK, DEFAULT_PREFILL_CHUNK
from common.requests import FinishReason
from runner.engine import GenerationRequest
from runner.prefill import PROBE_CHUNK
from tests.helpers import collect

PROMPT = "The for statement is used to iterate over the elements of a sequence"


@pytest.fixture(scope="module")
def plain_600(engine):
    return collect(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=600, num_draft_tokens=0, ignore_eos=True))
    )


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_greedy_speculative_equals_plain_greedy_and_releases_at_crossings(engine, plain_600, k):
    plain_tokens, plain_text, _ = plain_600
    tokens, text, last = collect(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=600, num_draft_tokens=k, ignore_eos=True))
    )
    assert tokens == plain_tokens
    assert text == plain_text
    stats = last.stats
    assert stats.generated_tokens == 600 and last.finish_reason == FinishReason.LENGTH
    assert stats.drafted > 0 and stats.rounds < 600  # it really drafted
    # One release in the round that crossed 256 and one in the round that crossed 512:
    # the recorded count is the first one at or past the multiple, at most k past it.
    assert len(stats.release_positions) == 2
    for position, multiple in zip(stats.release_positions, (256, 512)):
        assert multiple <= position <= multiple + k
    assert stats.releases == 3  # the two boundaries and the end of the request


def test_rounds_report_what_they_emit(engine):
    rounds = list(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=120, num_draft_tokens=4, ignore_eos=True))
    )
    stats = rounds[-1].stats
    assert sum(len(r.token_ids) for r in rounds) == stats.generated_tokens == 120
    assert len(rounds) == stats.rounds
    assert sum(r.drafted for r in rounds) == stats.drafted
    assert sum(r.accepted for r in rounds) == stats.accepted
    assert all(len(r.token_ids) == r.accepted + 1 for r in rounds[:-1])
    assert 0 < stats.acceptance_rate <= 1
    assert stats.tokens_per_round == pytest.approx(120 / stats.rounds)
    assert stats.time_to_first_token > 0 and stats.decode_seconds > 0 and stats.tokens_per_second > 0
    assert stats.prompt_tokens == len(engine.tokenizer.encode(PROMPT))
    assert stats.peak_memory >= stats.active_memory > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 7, 11])
def test_never_more_than_max_tokens_even_when_a_round_accepts_more(engine, max_tokens):
    tokens, _, last = collect(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=max_tokens, num_draft_tokens=6, ignore_eos=True))
    )
    assert len(tokens) == max_tokens == last.stats.generated_tokens
    assert last.finish_reason == FinishReason.LENGTH


def test_prompt_as_token_ids_equals_prompt_as_text(engine):
    ids = tuple(engine.tokenizer.encode(PROMPT))
    by_text = collect(engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=40, ignore_eos=True)))[0]
    by_ids = collect(engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=40, ignore_eos=True)))[0]
    assert by_ids == by_text


def test_stop_string_split_across_rounds_stops_and_does_not_leak(engine, plain_600):
    _, plain_text, _ = plain_600
    # Pick a stop string that starts mid-text and spans several tokens (so several rounds at k=1).
    start = len(plain_text) // 3
    stop = plain_text[start : start + 12]
    assert len(engine.tokenizer.encode(stop)) > 3
    tokens, text, last = collect(
        engine.generate(
            GenerationRequest(prompt=PROMPT, max_tokens=600, num_draft_tokens=1, ignore_eos=True, stop=(stop,))
        )
    )
    assert last.finish_reason == FinishReason.STOP
    assert text == plain_text[: plain_text.index(stop)]
    assert stop not in text
    assert len(tokens) < 600


def test_stop_string_never_seen_streams_everything(engine, plain_600):
    _, plain_text, _ = plain_600
    _, text, last = collect(
        engine.generate(
            GenerationRequest(
                prompt=PROMPT, max_tokens=600, num_draft_tokens=3, ignore_eos=True, stop=("\x00never\x00",)
            )
        )
    )
    assert text == plain_text and last.finish_reason == FinishReason.LENGTH


def test_eos_stops_generation_and_is_not_emitted(plain_600):
    """Declare a token the target really emits as end-of-sequence: generation stops before it."""
    from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
    from runner.engine import Engine

    plain_tokens, _, _ = plain_600
    eos = plain_tokens[40]
    engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    engine.tokenizer.add_eos_token(engine.tokenizer.convert_ids_to_tokens(eos))
    tokens, _, last = collect(engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=600, num_draft_tokens=3)))
    assert last.finish_reason == FinishReason.STOP
    assert eos not in tokens
    assert tokens == plain_tokens[: plain_tokens.index(eos)]
    ignoring, _, _ = collect(
        engine.generate(GenerationRequest(prompt=PROMPT, max_tokens=600, num_draft_tokens=3, ignore_eos=True))
    )
    assert ignoring == plain_tokens


def test_a_long_prompt_prefills_in_chunks_of_at_most_the_devices_cap(engine):
    """prefill_chunk "auto": 256 tokens a pass on the CPU (its attention computes a chunk's whole square of
    scores, the masked half too), 2048 on a GPU; the first pass is the 128-token probe."""
    ids = tuple(100 + (i * 7) % 3000 for i in range(900))
    _, _, last = collect(
        engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=4, ignore_eos=True, cache_prompt=False))
    )
    chunks = list(last.stats.prefill_chunks)
    cap = CPU_PREFILL_CHUNK if engine.device == "cpu" else DEFAULT_PREFILL_CHUNK
    assert sum(chunks) == len(ids) - 1 and chunks[0] == PROBE_CHUNK, chunks
    assert max(chunks) == min(cap, len(ids) - 1 - PROBE_CHUNK), chunks
