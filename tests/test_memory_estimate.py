"""The memory estimate (runner.footprint) against what real runners measure when they fill their context."""

from __future__ import annotations

import threading

import pytest

from runner.defaults import SMOLLM2_DIR
from runner.footprint import ModelFootprint, estimate
from tests.processes import SupervisorProcess, model_toml

TOLERANCE = 0.25
SMOLLM2_CONTEXT = 1024


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """One generation per model that fills its whole context, run side by side; then GetMemory."""
    models = model_toml("pair") + model_toml("smol", target=SMOLLM2_DIR, draft=None, max_context=SMOLLM2_CONTEXT)
    sup = SupervisorProcess(tmp_path_factory.mktemp("estimate"), models).wait_ready(180)
    try:
        before = {m.name: m for m in sup.client.get_memory().models}
        results = {}

        def fill(name: str, context: int) -> None:
            ids = [100 + (i * 7) % 3000 for i in range(context - 64)]
            chunks = list(sup.client.generate(timeout=600, model=name, prompt_ids=ids, max_tokens=64, ignore_eos=True))
            results[name] = chunks[-1]

        threads = [threading.Thread(target=fill, args=("pair", 8192)),
                   threading.Thread(target=fill, args=("smol", SMOLLM2_CONTEXT))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(600)
        after = {m.name: m for m in sup.client.get_memory().models}
        yield before, after, results
    finally:
        assert sup.stop() == 0


@pytest.mark.parametrize("name", ["pair", "smol"])
def test_estimate_is_within_a_quarter_of_the_measured_peak(filled, name):
    before, after, results = filled
    assert results[name].stats.prompt_tokens + results[name].stats.generated_tokens == (
        8192 if name == "pair" else SMOLLM2_CONTEXT)
    memory = after[name].memory
    print(f"{name}: estimate {memory.estimate / 2**20:.0f} MiB, measured peak {memory.peak_rss / 2**20:.0f} MiB")
    assert before[name].memory.estimate > 0
    assert abs(memory.estimate - memory.peak_rss) <= TOLERANCE * memory.peak_rss, (memory.estimate, memory.peak_rss)


def test_the_estimate_counts_the_form_the_weights_take():
    smol = ModelFootprint.of(SMOLLM2_DIR)
    assert smol.parameters == 134_515_008 and smol.context_length == 8192
    quantized = estimate([smol], "checkpoint", "cpu", context=1024)
    dequantized = estimate([smol], "float32", "cpu", context=1024)
    assert quantized.weights < smol.parameters * 1.2  # ~4.5 bits a weight, not 32
    assert dequantized.weights > 4 * smol.parameters  # float32
    # layers x KV heads x head dim x (K and V) x 4 bytes x tokens
    assert dequantized.kv_cache == 30 * 3 * 64 * 2 * 4 * 1024
    assert estimate([smol], "float32", "gpu", context=1024).prefill == 0  # fused attention: no score matrix
