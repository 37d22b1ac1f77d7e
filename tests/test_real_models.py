"""Real models: the imported SmolLM2-135M-Instruct, quantized and float32, a hybrid model, the GGUF importer.

SmolLM2 comes from `make real-model` (which `make test` and CI run first): these
tests need it and are never skipped.
"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import mlx.core as mx
import numpy as np
import pytest

from common.cpu_blas import mkl_library
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET, SMOLLM2_DIR
from common.protocol import runner_pb2
from common.requests import FinishReason
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from tests.helpers import (
    collect,
    differences_from_llama_cpp,
    mlx_lm_greedy,
    rewrite_gguf,
    tiny_cache_list_model,
    tiny_sliding_window_model,
)
from tests.processes import RunnerProcess, child_environment

SMOLLM2_PARAMETERS = 134_515_008
CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def smollm2():
    assert (SMOLLM2_DIR / "config.json").is_file(), f"{SMOLLM2_DIR} is missing: run `make real-model`"
    return SMOLLM2_DIR


def chat_prompt(folder, messages) -> str:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    return load_tokenizer(folder).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# -- the imported folder ------------------------------------------------------------------------------


def test_imported_folder_is_an_mlx_lm_folder(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30
    assert config["quantization"]["bits"] == 4 and config["quantization"]["group_size"] == 32
    assert config["quantization"]["model.embed_tokens"]["bits"] == 8  # the Q8_0 embedding stays 8-bit
    assert config["tie_word_embeddings"] and not config["rope_traditional"]
    tokenizer_config = json.loads((smollm2 / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>" and "<|im_start|>" in tokenizer_config["chat_template"]
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert tokenizer.encode("<|im_start|>user\n", add_special_tokens=False).ids[0] == 1  # one special token
    text = "The capital of France is Paris, 2 + 2 = 4. Ünïcödé too."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def write_gguf(path, architecture: str, tensors: dict, tokenizer_model: str | None = None):
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    if tokenizer_model is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_token_list(["<unk>", "<s>", "</s>", "a"])
    for name, (array, raw_dtype) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def bad_ggufs(folder):
    import gguf

    source = SMOLLM2_DIR.parent.parent / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    truncated = folder / "truncated.gguf"
    with open(source, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    not_gguf = folder / "notes.gguf"
    not_gguf.write_text("this is a text file, not a model\n" * 10)
    mamba = write_gguf(folder / "mamba.gguf", "mamba", {"token_embd.weight": (np.zeros((8, 32), np.float32), None)})
    iq = write_gguf(
        folder / "iq2.gguf",
        "llama",
        {
            "token_embd.weight": (np.zeros((8, 32), np.float32), None),
            "blk.0.attn_q.weight": (np.zeros((4, 66), np.uint8), gguf.GGMLQuantizationType.IQ2_XXS),
        },
    )
    unigram = write_gguf(
        folder / "t5.gguf", "llama", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)}, tokenizer_model="t5"
    )
    return [
        (truncated, "extends past the end of the file"),
        (not_gguf, "is not a GGUF file"),
        (mamba, "unsupported architecture 'mamba'"),
        (iq, "unsupported quantization type IQ2_XXS"),
        (unigram, "unsupported tokenizer model 't5'"),
    ]


def test_importer_refuses_bad_files_with_one_clear_line(tmp_path):
    for path, expected in bad_ggufs(tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "runner.gguf", str(path), str(tmp_path / "out")],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_environment(),
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (path, done.stderr)
        assert expected in lines[0] and lines[0].startswith("runner.gguf: "), lines[0]
        assert not (tmp_path / "out" / "config.json").exists()


# Byte offsets of each block's float16 scale fields: random bytes there could be inf or NaN.
SCALE_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}
WIDER = {"Q2_K": 2, "Q3_K": 3, "Q6_K": 6, "IQ4_NL": 4, "IQ4_XS": 4}  # stored wider than their own bits


@pytest.mark.parametrize("kind", list(SCALE_FIELDS))
def test_each_quantized_type_imports_as_llama_cpp_dequantizes_it(kind):
    """Random blocks of every supported type (random levels and scales: any bit pattern is a valid block) against
    llama.cpp's own dequantization (``gguf.quants``): the types whose groups of 32 share a scale and a bias come
    back bit for bit at their own width; the ones with 16-value sub-blocks or a non-uniform table within half a
    level of a wider grid."""
    import gguf
    from gguf.quants import dequantize

    from runner.gguf import BITS, requantized

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(list(SCALE_FIELDS).index(kind))
    data = rng.integers(0, 256, size=(6, 512 // block * size), dtype=np.uint8)
    for offset in SCALE_FIELDS[kind]:
        fields = data.reshape(-1, size)[:, offset : offset + 2]
        fields[:] = rng.uniform(-0.05, 0.05, size=(len(fields), 1)).astype(np.float16).view(np.uint8)
    expected = dequantize(data, qtype)
    bits = BITS[kind]
    parts = requantized(data, kind, bits)
    got = np.array(mx.dequantize(parts["weight"], parts["scales"], parts["biases"], group_size=32, bits=bits))
    assert got.shape == expected.shape == (6, 512)
    if kind in WIDER:
        level = np.repeat(np.array(parts["scales"]), 32, axis=-1)
        assert np.all(np.abs(got - expected) <= 0.5001 * level)
        assert bits > WIDER[kind]
    else:
        assert np.array_equal(got, expected)


def q4_k_m_like(name, kind, row_length):
    """The types llama.cpp's Q4_K_M recipe gives SmolLM2's tensors: Q4_K, or Q6_K for every third layer's
    ffn_down; a tensor whose rows are not a multiple of 256 (most of them: 576) falls back to Q5_0; the
    embedding stays Q8_0 and the norms F32."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if kind != Q.Q4_1:
        return None
    if row_length % 256:
        return Q.Q5_0
    return Q.Q6_K if ".ffn_down." in name and int(name.split(".")[1]) % 3 == 0 else Q.Q4_K


def test_a_k_quant_file_imports_exactly_and_answers(tmp_path):
    """SmolLM2's GGUF rewritten in llama.cpp's Q4_K_M layout (Q4_K and Q6_K where rows allow, Q5_0 elsewhere,
    Q8_0 embedding): ``mx.load`` cannot read it; the importer does, with a width per layer, every Q4_K, Q5_0 and
    Q8_0 weight exactly llama.cpp's dequantization and every Q6_K one within half a level, and the model answers.

    (Its answer about France drifts - "L'Etoile ... is the capital of France" - from the noise of quantizing the
    Q4_1 weights a second time, with this test's plain-rounding encoders; it still answers Germany right.)"""
    from runner.gguf import GGUFImportError, import_gguf, load_gguf

    source = SMOLLM2_DIR.parent.parent / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    rewritten = rewrite_gguf(source, tmp_path / "smollm2-q4_k_m.gguf", q4_k_m_like)
    with pytest.raises(GGUFImportError, match="cannot load the tensors"):
        load_gguf(rewritten)
    folder = import_gguf(rewritten, tmp_path / "smollm2-q4_k_m")
    config = json.loads((folder / "config.json").read_text())
    down = {f"model.layers.{i}.mlp.down_proj": {"group_size": 32, "bits": 8 if i % 3 == 0 else 4} for i in range(30)}
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 5,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        **down,
    }
    differences = differences_from_llama_cpp(rewritten, folder)
    assert {kind for kind, _, _ in differences.values()} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert all(difference == 0 for kind, difference, _ in differences.values() if kind != "Q6_K")
    assert all(levels <= 0.5001 for kind, _, levels in differences.values() if kind == "Q6_K")
    engine = Engine.load(folder, None, RunnerSettings(prompt_cache=0))
    tokens, text, last = collect(
        engine.generate(GenerationRequest(messages=(("user", "What is the capital of Germany?"),), max_tokens=40))
    )
    assert "Berlin" in text and last.finish_reason == FinishReason.STOP, text


# -- SmolLM2 in a runner started by its CLI ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_runner(smollm2, tmp_path_factory):
    runner = RunnerProcess(
        tmp_path_factory.mktemp("smol") / "sockets", target=smollm2, draft=None, name="smollm2"
    ).wait_serving(180)
    yield runner
    assert runner.stop() == 0


def test_runner_serves_smollm2_in_float32_on_the_cpu_and_says_what_it_is(smollm2_runner):
    info = smollm2_runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
    target = info.target
    assert target.architecture == "llama" and target.parameters == SMOLLM2_PARAMETERS
    assert target.quantization_bits == 4 and target.quantization_group_size == 32  # the checkpoint's
    assert target.dtype == "float32" and "auto: float32 on the CPU" in info.dtype_reason
    assert target.context_length == 8192 and target.vocab_size == 49152 and target.rewindable
    # Each layer's q/k/v and gate/up projections run as one product each, with the logits checked equal as it
    # loaded (runner.loading.fusion)
    assert target.fusion.startswith("on: 30 q/k/v and 30 gate/up groups"), target.fusion
    # 30 layers x 4 products and the tied embedding run one-row inputs as two rows where that measured faster
    # as it loaded, and Info says which, with both times (runner.loading.row_padding)
    if mkl_library():
        assert target.row_padded_layers in (0, 30 * 4 + 1) and "ms a step" in target.row_padding
        assert target.row_padding.startswith("on" if target.row_padded_layers else "off"), target.row_padding
    else:
        assert target.row_padded_layers == 0
    assert info.speculative and info.drafter == "ngram" and info.adaptive_depth  # no draft model: n-gram lookup
    assert 50 * 2**20 < info.runtime_rss < 400 * 2**20


def test_smollm2_answers_a_chat_prompt(smollm2_runner, smollm2):
    chunks = list(smollm2_runner.client.generate(timeout=120, prompt=chat_prompt(smollm2, CAPITAL), max_tokens=40))
    text = "".join(c.text for c in chunks)
    assert "Paris" in text, text
    assert chunks[-1].finish_reason == runner_pb2.FINISH_REASON_STOP  # <|im_end|> ends the turn
    assert "<|im_end|>" not in text


MLX_LM_GREEDY = """
import json, sys
from common.cpu_blas import reexec_with_fast_blas
reexec_with_fast_blas()
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step
from mlx_lm.utils import dequantize_model
folder, dtype, ids, n = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
model, _ = load(folder)
if dtype == "float32":
    dequantize_model(model)
    model.set_dtype(mx.float32)
print(json.dumps([token for token, _ in generate_step(mx.array(ids), model, max_tokens=n)]))
"""


@pytest.mark.parametrize("dtype", ["checkpoint", "float32"])
def test_smollm2_greedy_equals_mlx_lm_generate_step(smollm2, dtype):
    """Weights in the same form on both sides: kept 4-bit, or dequantized to float32. mlx-lm runs in a
    process of its own, at the same time (two cores)."""
    engine = Engine.load(smollm2, None, RunnerSettings(dtype=dtype, prompt_cache=0))
    assert engine.target.is_quantized == (dtype == "checkpoint")
    prompt_ids = engine.tokenizer.encode(chat_prompt(smollm2, STORY))
    reference = subprocess.Popen(
        [sys.executable, "-c", MLX_LM_GREEDY, str(smollm2), dtype, json.dumps(prompt_ids), "210"],
        stdout=subprocess.PIPE,
        text=True,
        env=child_environment(),
    )
    ours, _, last = collect(
        engine.generate(
            GenerationRequest(prompt_ids=tuple(prompt_ids), max_tokens=210, ignore_eos=True, drafter="none")
        )
    )
    theirs = json.loads(reference.communicate(timeout=600)[0].strip().splitlines()[-1])
    assert last.stats.generated_tokens == 210
    assert ours == theirs


def test_a_draft_with_another_vocabulary_is_refused_at_start_up(smollm2, tmp_path):
    runner = RunnerProcess(tmp_path / "sockets", target=smollm2, draft=DEFAULT_DRAFT)
    assert runner.process.wait(180) == 2
    problems = [line for line in runner.stderr.splitlines() if line.startswith("runner:")]
    assert len(problems) == 1, runner.stderr
    assert "draft's tokenizer differs from the target's" in problems[0] and "4096 vs 49152 tokens" in problems[0]


def test_max_context_lowers_the_context(tmp_path):
    runner = RunnerProcess(tmp_path / "sockets", "--max-context", "512").wait_serving()
    try:
        assert runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5).target.context_length == 512
        with pytest.raises(grpc.RpcError) as caught:
            list(runner.client.generate(timeout=30, prompt_ids=[7] * 600, max_tokens=4))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "context of 512" in caught.value.details()
        chunks = list(runner.client.generate(timeout=30, prompt_ids=[7] * 500, max_tokens=100, ignore_eos=True))
        assert chunks[-1].stats.generated_tokens == 12  # the room left in the context
        assert chunks[-1].finish_reason == runner_pb2.FINISH_REASON_LENGTH
    finally:
        assert runner.stop() == 0


# -- a sliding-window model ------------------------------------------------------------------------------


def test_a_sliding_window_model_speculates_past_its_window(tmp_path):
    """Its window layers (RotatingKVCache) cannot be trimmed once the window is full: the runner keeps their state
    before each verification and restores it after a rejection (``runner.rewind``)."""
    folder = tiny_sliding_window_model(tmp_path / "sliding")
    runner = RunnerProcess(tmp_path / "sockets", target=folder, draft=DEFAULT_DRAFT).wait_serving()
    prompt = "The for statement is used to iterate over"
    try:
        info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
        assert info.speculative and info.target.rewindable and "RotatingKVCache" in info.target.cache
        outputs = {}
        for drafter in ("none", "model", "ngram"):
            chunks = list(
                runner.client.generate(
                    timeout=60,
                    prompt=prompt,
                    max_tokens=150,
                    ignore_eos=True,
                    drafter=drafter,
                    num_draft_tokens=0 if drafter == "none" else 3,
                )
            )
            outputs[drafter] = ([t for c in chunks for t in c.token_ids], chunks[-1].stats)
    finally:
        assert runner.stop() == 0
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    expected = mlx_lm_greedy(model, tokenizer.encode(prompt), 150)[0]  # past the 64-token window
    for drafter, (tokens, stats) in outputs.items():
        assert tokens == expected, drafter
    stats = outputs["model"][1]
    assert stats.drafted > 0 and stats.accepted < stats.drafted  # rejections happened, and were rewound


def test_a_cache_list_model_speculates_and_batches(tmp_path):
    """falcon_h1's cache is a CacheList per layer (a Mamba state beside a KV cache): the runner rewinds each
    cache in it as a layer of its own, so the model speculates, and it decodes in a batch - each request's
    tokens equal to mlx-lm's greedy ones."""
    import threading

    folder = tiny_cache_list_model(tmp_path / "falcon_h1")
    runner = RunnerProcess(tmp_path / "sockets", "--max-batch", "4", target=folder, draft=DEFAULT_DRAFT).wait_serving()
    prompts = ["The for statement is used to iterate over", "A class definition", "The import statement"]
    try:
        info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
        assert info.speculative and info.target.rewindable and info.target.cache == "CacheList"
        alone = {}
        for drafter in ("none", "model"):
            chunks = list(
                runner.client.generate(
                    timeout=60,
                    prompt=prompts[0],
                    max_tokens=80,
                    ignore_eos=True,
                    drafter=drafter,
                    num_draft_tokens=0 if drafter == "none" else 3,
                )
            )
            alone[drafter] = ([t for c in chunks for t in c.token_ids], chunks[-1].stats)
        together = {}

        def client(prompt):
            chunks = list(runner.client.generate(timeout=120, prompt=prompt, max_tokens=80, ignore_eos=True))
            together[prompt] = ([t for c in chunks for t in c.token_ids], chunks[-1].stats)

        threads = [threading.Thread(target=client, args=(prompt,)) for prompt in prompts]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        assert runner.stop() == 0
    from mlx_lm import load

    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    expected = {prompt: mlx_lm_greedy(model, tokenizer.encode(prompt), 80)[0] for prompt in prompts}
    for drafter, (tokens, _) in alone.items():
        assert tokens == expected[prompts[0]], drafter
    stats = alone["model"][1]
    assert stats.drafted > 0 and stats.accepted < stats.drafted  # rejections happened, and were rewound
    for prompt, (tokens, _) in together.items():
        assert tokens == expected[prompt], prompt
    assert sum(stats.depths.get(0, 0) for _, stats in together.values()) > 0  # some steps were batched


def test_default_pair_speculates_with_its_draft(engine):
    assert engine.speculative and engine.default_drafter == "model"
    assert engine.target.path == DEFAULT_TARGET and engine.target.compute_dtype == "float32"
