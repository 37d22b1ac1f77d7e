"""The memory estimate (common.footprint) against what real runners measure when they fill their context."""

from __future__ import annotations

import threading

import pytest

from common.defaults import DEFAULT_TARGET, SMOLLM2_DIR
from common.footprint import Estimate, ModelFootprint, default_prompt_cache_bytes, estimate
from common.settings import RunnerSettings
from runner.batch_memory import BatchMemory, CacheCost
from runner.loading.load import load_model
from supervisor.config import ModelConfig
from supervisor.memory import batch_memory_budget, prompt_cache_budget
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

        threads = [
            threading.Thread(target=fill, args=("pair", 8192)),
            threading.Thread(target=fill, args=("smol", SMOLLM2_CONTEXT)),
        ]
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
        8192 if name == "pair" else SMOLLM2_CONTEXT
    )
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


@pytest.mark.parametrize("folder, dtype", [(DEFAULT_TARGET, "checkpoint"), (SMOLLM2_DIR, "float32")])
def test_a_cache_costs_what_the_footprint_says(folder, dtype):
    """The runner measures a request's cache on the loaded model; the supervisor's estimate reads the folder.
    They agree, per 256 positions."""
    cost = CacheCost.measure(load_model(folder, dtype).model)
    assert cost.per_row == 0 and cost.per_token * 256 == ModelFootprint.of(folder).kv_bytes(dtype, 256)


def test_batch_memory_admits_while_the_projected_batch_fits():
    class Prepared:  # what BatchMemory reads of a runner.request.PreparedRequest
        def __init__(self, prompt: int, max_tokens: int):
            self.prompt_ids, self.max_tokens = [0] * prompt, max_tokens

    cost = CacheCost(per_token=1000, per_row=0)
    assert cost.batch([300, 100]) == 2 * 512 * 1000  # every row as long as the longest, in 256-token steps
    memory = BatchMemory(cost, budget=3 * 512 * 1000)
    short, long = Prepared(100, 200), Prepared(100, 4000)
    assert memory.admits([short, short], short)  # three rows of 512 positions
    assert not memory.admits([short, short, short], short)
    assert memory.admits([], long)  # alone, always (the model was admitted for a whole context)
    assert not memory.admits([short], long)  # two rows of 4352 positions
    assert BatchMemory(cost, None).admits([long] * 15, long)


def test_the_batch_budget_is_the_room_above_the_estimate():
    needed = Estimate(weights=500, kv_cache=100, prefill=50, runtime=350)  # total 1000
    model = ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET))
    assert batch_memory_budget(model, needed, prompt_cache=200, available=5000) == 100 + 5000 - 1000 - 200
    assert batch_memory_budget(model, needed, prompt_cache=200, available=900) == 100  # one request, as admitted
    limited = ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET), soft_limit=1600)
    assert batch_memory_budget(limited, needed, prompt_cache=600, available=5000) == 100 + 600
    hard = ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET), hard_limit=3000)
    assert batch_memory_budget(hard, needed, prompt_cache=0, available=5000) == 100 + 1000
    assert (
        batch_memory_budget(ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET, batch_memory=12345)), needed, 0)
        == 12345
    )
    assert batch_memory_budget(model, None, 0) is None


def test_the_prompt_cache_takes_no_more_than_half_the_room_above_the_estimate():
    needed = Estimate(weights=500 * 2**20, kv_cache=100 * 2**20, prefill=50 * 2**20, runtime=350 * 2**20)
    model = ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET))
    default = default_prompt_cache_bytes()
    assert prompt_cache_budget(model, needed, available=2**50) == default  # plenty of room: the default
    assert prompt_cache_budget(model, needed, available=needed.total + 300 * 2**20) == min(default, 150 * 2**20)
    assert prompt_cache_budget(model, needed, available=needed.total // 2) == 0  # admitted into no room
    limited = ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET), soft_limit=needed.total + 64 * 2**20)
    assert prompt_cache_budget(limited, needed, available=2**50) == min(default, 64 * 2**20)
    assert prompt_cache_budget(ModelConfig("m", RunnerSettings(target=DEFAULT_TARGET, prompt_cache=7)), needed) == 7
