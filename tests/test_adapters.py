"""LoRA adapters over one base (runner/loading/adapters.py; issue #37): an adapter changes the answer, and greedy output
with it equals mlx-lm's ``load(..., adapter_path=...)``; requests with different adapters (and none) decode as
rows of one batch, each as it would alone; the prompt cache never gives one adapter's KV to another; a model
names its adapters in the config and a request picks one with ``model: "NAME:ADAPTER"``.

The adapters are random LoRA weights in mlx-lm's adapter format (``adapter_config.json`` and
``adapters.safetensors``, as ``mlx_lm.lora`` writes them) over the default pair's target.
"""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import openai
import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.errors import InvalidRequest
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from tests.helpers import collect
from tests.processes import SupervisorProcess, child_environment, model_toml

PROMPT = "The for statement is used to iterate over the elements of a sequence"
MLX_LM_WITH_ADAPTER = """
import json, sys
from common.cpu_blas import reexec_with_fast_blas
reexec_with_fast_blas()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
folder, adapter, ids, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
model, _ = load(folder, adapter_path=adapter)
model.set_dtype(mx.float32)  # as the runner computes on the CPU (dtype auto)
print(json.dumps([token for token, _ in generate_step(mx.array(ids), model, max_tokens=n)]))
"""


def write_adapter(folder, keys: tuple[str, ...], rank: int, seed: int, scale: float = 20.0):
    """A LoRA adapter of the default target (8 layers, hidden 384, 2 KV heads of 64) with random weights."""
    sizes = {"self_attn.q_proj": (384, 384), "self_attn.v_proj": (384, 128), "self_attn.o_proj": (384, 384)}
    mx.random.seed(seed)
    weights = {}
    for layer in range(8):
        for key in keys:
            inputs, outputs = sizes[key]
            weights[f"model.layers.{layer}.{key}.lora_a"] = 0.05 * mx.random.normal((inputs, rank))
            weights[f"model.layers.{layer}.{key}.lora_b"] = 0.05 * mx.random.normal((rank, outputs))
    folder.mkdir(parents=True)
    mx.save_safetensors(str(folder / "adapters.safetensors"), weights)
    config = {
        "fine_tune_type": "lora",
        "num_layers": 8,
        "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)},
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        "terse": write_adapter(root / "terse", ("self_attn.q_proj", "self_attn.v_proj"), rank=8, seed=1),
        "loud": write_adapter(root / "loud", ("self_attn.q_proj", "self_attn.o_proj"), rank=4, seed=2),
    }


@pytest.fixture(scope="module")
def engine(adapters):
    folders = ",".join(f"{name}={path}" for name, path in adapters.items())
    return Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(adapters=folders, prompt_cache=2**28))


def greedy(engine, n: int = 48, **fields) -> list[int]:
    request = GenerationRequest(prompt=PROMPT, max_tokens=n, ignore_eos=True, cache_prompt=False, **fields)
    return collect(engine.generate(request))[0]


def test_an_adapter_changes_the_answer_and_equals_mlx_lms(engine, adapters):
    ids = engine.tokenizer.encode(PROMPT)
    reference = subprocess.Popen(
        [sys.executable, "-c", MLX_LM_WITH_ADAPTER, str(DEFAULT_TARGET), str(adapters["terse"]), json.dumps(ids), "48"],
        stdout=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    base = greedy(engine, drafter="none")
    terse = greedy(engine, drafter="none", adapter="terse")
    theirs = json.loads(reference.communicate(timeout=600)[0].strip().splitlines()[-1])
    assert terse == theirs and terse != base
    assert greedy(engine, adapter="terse") == terse  # speculating with the base's draft: the same greedy answer
    assert greedy(engine, drafter="none", adapter="loud") not in (base, terse)


def test_an_unknown_adapter_is_refused_naming_the_field(engine):
    with pytest.raises(InvalidRequest) as caught:
        engine.prepare(GenerationRequest(prompt=PROMPT, adapter="nope"))
    assert caught.value.field == "adapter" and "its adapters: terse, loud" in caught.value.message


def test_the_prompt_cache_keeps_each_adapters_entries_apart(engine):
    long_prompt = PROMPT + " and the while statement repeats a block while a condition holds." * 4

    def run(adapter: str, n: int = 16, cache: bool = True):
        request = GenerationRequest(
            prompt=long_prompt, max_tokens=n, adapter=adapter, drafter="none", cache_prompt=cache
        )
        tokens, _, last = collect(engine.generate(request))
        return tokens, last.stats.cached_tokens

    alone, _ = run("loud", cache=False)
    for adapter in ("", "terse"):  # entries of the same prompt under other adapters
        run(adapter, n=4)
    tokens, cached = run("loud")
    assert cached == 0 and tokens == alone  # nothing of the others' was taken
    tokens, cached = run("loud")
    assert cached > 0 and tokens == alone  # its own entry now


@pytest.fixture(scope="module")
def sup(adapters, tmp_path_factory):
    table = "{" + ", ".join(f'{name} = "{path}"' for name, path in adapters.items()) + "}"
    models = model_toml("pair", max_batch=8) + f"adapters = {table}\n"
    process = SupervisorProcess(tmp_path_factory.mktemp("adapters-sup"), models).wait_ready(120)
    yield process
    assert process.stop() == 0


def test_requests_pick_an_adapter_by_name_and_batch_with_others(sup):
    """pair, pair:terse and pair:loud at once, twice each (rows of one batch): each answer is the one it gets
    alone."""
    client = sup.openai()

    def complete(model: str) -> str:
        answer = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
        )
        return answer.choices[0].text

    names = ["pair", "pair:terse", "pair:loud"]
    alone = {name: complete(name) for name in names}
    assert len(set(alone.values())) == 3
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(complete, names * 2))
    assert together == [alone[name] for name in names * 2]
    listed = {m.id for m in client.models.list()}
    assert {"pair", "pair:terse", "pair:loud"} <= listed
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="pair:nope", prompt=PROMPT, max_tokens=4)
