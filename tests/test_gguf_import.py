"""The GGUF importer: its tokenizers against llama.cpp's own tokenizer tests, each architecture's weights
against the model llama.cpp's converter wrote them from, and models with real vocabularies (Llama 2's,
Qwen2's) imported and served.

llama.cpp's vocabulary-only GGUF files and their test cases (texts, and the ids
each model's own Hugging Face tokenizer gives them) come from `make test`'s
`models/gguf_vocabs.py` into .whl/vocab; these tests need them and are never
skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from gguf import GGUFReader

from common.protocol import runner_pb2
from runner.gguf import build_tokenizer, open_reader, read_metadata
from tests.helpers import gguf_like_llama_cpp, mlx_lm_greedy, on_a_terminal, redrawn, tiny_gguf
from tests.processes import REPO, RunnerProcess, child_environment

VOCAB_DIR = REPO / ".whl" / "vocab"
CASE_SEPARATOR = "\n__ggml_vocab_test__\n"
NEAR_TIE = 0.01  # log-probability gap between mlx-lm's two most likely tokens
# name -> (tokenizer.ggml.model, whether a prompt gets BOS)
VOCABULARIES = {
    "llama-spm": ("llama", True),
    "phi-3": ("llama", True),
    "llama-bpe": ("gpt2", True),
    "gpt-2": ("gpt2", False),
    "qwen2": ("gpt2", False),
}
LLAMA2_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


def vocabulary(name: str) -> Path:
    path = VOCAB_DIR / f"ggml-vocab-{name}.gguf"
    assert path.is_file(), f"{path} is missing: run `python models/gguf_vocabs.py` (make test does)"
    return path


def reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """llama.cpp's test-tokenizer-0 cases: each text and the ids the model's own tokenizer gives it."""
    path = vocabulary(name)
    texts = Path(f"{path}.inp").read_text(encoding="utf-8")
    texts = texts[: -len(CASE_SEPARATOR)] if texts.endswith(CASE_SEPARATOR) else texts
    ids = Path(f"{path}.out").read_text(encoding="utf-8").splitlines()
    cases = list(zip(texts.split(CASE_SEPARATOR), ([int(t) for t in line.split()] for line in ids), strict=True))
    assert len(cases) > 40
    return cases


@pytest.mark.parametrize("name", list(VOCABULARIES))
def test_an_imported_vocabulary_tokenizes_as_its_model_does(name):
    """Every case of llama.cpp's tokenizer test: spaces, newlines and tabs in runs, emoji, CJK, byte fallback,
    digits, apostrophes, mixed scripts. Encoded without special tokens as the reference was; decoded back to the
    text; and a prompt gets BOS in front where the model wants it (the file's flag, or SentencePiece's default)."""
    metadata = read_metadata(open_reader(vocabulary(name)))
    kind, wants_bos = VOCABULARIES[name]
    assert metadata["tokenizer.ggml.model"] == kind
    tokenizer = build_tokenizer(metadata)
    cases = reference_cases(name)
    wrong = [(text, ids, tokenizer.encode(text, add_special_tokens=False).ids) for text, ids in cases]
    wrong = [case for case in wrong if case[1] != case[2]]
    assert not wrong, wrong[:3]
    for text, ids in cases:
        assert tokenizer.decode(ids) == text
    bos = int(metadata["tokenizer.ggml.bos_token_id"])
    first = tokenizer.encode("Hello world").ids
    assert (first[0] == bos and first.count(bos) == 1) if wants_bos else bos not in first


ARCHITECTURE_CONFIGS = {
    "llama": {"head_dim": 16, "rope_theta": 10000.0},
    "qwen2": {"rope_theta": 1000000.0},  # Q/K/V biases
    "qwen3": {"head_dim": 32, "rope_theta": 1000000.0},  # Q/K norms; heads wider than hidden / heads
    "phi3": {"rope_theta": 10000.0},  # Q/K/V in one projection, gate and up in another
    # Four norms a layer, stored as 1 + weight; attention scaled by 1 / sqrt(head_dim); logits soft-capped
    "gemma2": {"head_dim": 32, "rope_theta": 10000.0, "query_pre_attn_scalar": 32},
    # Q/K norms too, and five layers of six slide over a window (4 tokens here, so the 12 tokens pass it)
    "gemma3_text": {
        "head_dim": 32,
        "rope_theta": 1000000.0,
        "query_pre_attn_scalar": 32,
        "num_hidden_layers": 6,
        "sliding_window": 4,
    },
}


@pytest.mark.parametrize("architecture", list(ARCHITECTURE_CONFIGS))
def test_a_model_written_as_llama_cpp_writes_it_imports_back_unchanged(tmp_path, architecture):
    """A random mlx-lm model of each architecture, written to GGUF as llama.cpp's converter writes it (``gguf``'s
    tensor name map, llama's Q/K rows permuted for llama.cpp's RoPE), imports into a folder whose model gives the
    same logits: every tensor lands under its name, in its layout, with the hyperparameters it was built with."""
    import importlib

    from mlx.utils import tree_flatten
    from mlx_lm import load

    config = {
        "model_type": architecture,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": 50257,
        "max_position_embeddings": 512,
        "tie_word_embeddings": architecture != "llama",
        **ARCHITECTURE_CONFIGS[architecture],
    }
    module = importlib.import_module(f"mlx_lm.models.{architecture}")
    mx.random.seed(3)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.update(redrawn(model.parameters()))  # biases and norms non-trivial, as trained ones are
    gguf_file = gguf_like_llama_cpp(model, config, GGUFReader(str(vocabulary("gpt-2"))), tmp_path / "model.gguf")
    done = subprocess.run(
        [sys.executable, "-m", "runner.gguf", str(gguf_file), str(tmp_path / "imported")],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_environment(),
    )
    assert done.returncode == 0, done.stderr
    imported, _ = load(str(tmp_path / "imported"))
    assert sorted(name for name, _ in tree_flatten(imported.parameters())) == sorted(
        name for name, _ in tree_flatten(model.parameters())
    )
    tokens = mx.array([[464, 3139, 286, 4881, 318, 6342, 13, 383, 3139, 286, 8031, 318]])
    expected, got = model(tokens), imported(tokens)
    assert mx.abs(expected - got).max().item() < 1e-4
    assert (expected.argmax(-1) == got.argmax(-1)).all().item()


@pytest.mark.parametrize("vocab_name, architecture", [("llama-spm", "llama"), ("qwen2", "qwen2")])
def test_a_gguf_imports_and_serves_a_chat(tmp_path, vocab_name, architecture):
    """A GGUF with a real model's vocabulary and chat template (random weights: Llama 2's SentencePiece vocabulary
    and chat template; Qwen2's byte-level one and ChatML template) goes through the
    importer's command line into a folder a runner serves: the chat gets the template's tokens (for Llama 2 exactly
    one BOS: the template writes it and the tokenizer does not add a second), mlx-lm's greedy tokens for them, and
    their text."""
    from mlx_lm import load

    gguf_file = tiny_gguf(
        tmp_path / "model.gguf",
        vocabulary(vocab_name),
        architecture,
        chat_template=LLAMA2_CHAT_TEMPLATE if vocab_name == "llama-spm" else None,
    )
    folder = tmp_path / "model"
    done = subprocess.run(
        [sys.executable, "-m", "runner.gguf", str(gguf_file), str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_environment(),
    )
    assert done.returncode == 0, done.stderr
    model, tokenizer = load(str(folder))
    model.set_dtype(mx.float32)
    conversation = [("user", "What is the capital of France?"), ("assistant", "Paris."), ("user", "And of Italy?")]
    rendered = tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in conversation], tokenize=False, add_generation_prompt=True
    )
    expected_prompt = tokenizer.encode(rendered, add_special_tokens=False)
    if vocab_name == "llama-spm":
        # Llama 2's template puts a space before </s>: a lone "▁" piece, as with Llama 2's own tokenizer.
        assert expected_prompt == [1] + tokenizer.encode(
            "[INST] What is the capital of France? [/INST] Paris. ", add_special_tokens=False
        ) + [2] + tokenizer.encode("[INST] And of Italy? [/INST]", add_special_tokens=False)
    expected, gaps = mlx_lm_greedy(model, expected_prompt, 40)
    # Random weights over a large vocabulary give near ties, which float rounding differences between the runner's
    # products and mlx-lm's may break either way: the tokens are compared up to the first one.
    compared = next((i for i, gap in enumerate(gaps) if gap < NEAR_TIE), len(gaps))
    assert compared >= 10
    runner = RunnerProcess(tmp_path / "sockets", target=folder, draft=None).wait_serving()
    try:
        info = runner.client.stub.Info(runner_pb2.InfoRequest(), timeout=5)
        assert info.target.architecture == architecture and info.target.vocab_size == len(tokenizer.vocab)
        messages = [runner_pb2.ChatMessage(role=role, content=content) for role, content in conversation]
        chunks = list(
            runner.client.generate(timeout=120, messages=messages, max_tokens=40, ignore_eos=True, drafter="none")
        )
        plain = list(
            runner.client.generate(timeout=120, prompt="Hello world", max_tokens=5, ignore_eos=True, drafter="none")
        )
    finally:
        assert runner.stop() == 0
    tokens = [t for c in chunks for t in c.token_ids]
    assert chunks[-1].stats.prompt_tokens == len(expected_prompt)
    assert tokens[:compared] == expected[:compared]
    assert "".join(c.text for c in chunks) == tokenizer.decode(tokens)
    # A raw prompt: <s> ▁Hello ▁world for Llama 2 (BOS from the tokenizer); "Hello", " world" for Qwen (no BOS).
    assert plain[-1].stats.prompt_tokens == (3 if vocab_name == "llama-spm" else 2)


def test_the_import_shows_its_progress_on_a_terminal_and_nothing_through_a_pipe(tmp_path):
    gguf_file = tiny_gguf(tmp_path / "model.gguf", vocabulary("qwen2"), "qwen2")
    env = child_environment() | {"TERM": "xterm-256color", "COLUMNS": "100"}
    args = [sys.executable, "-m", "runner.gguf", str(gguf_file)]
    status, screen = on_a_terminal(args + [str(tmp_path / "a")], env)
    assert status == 0, screen
    assert "model.gguf: reading" in screen and "converting and writing" in screen
    piped = subprocess.run(args + [str(tmp_path / "b")], capture_output=True, text=True, timeout=300, env=env)
    assert piped.returncode == 0, piped.stderr
    assert piped.stderr == "" and piped.stdout.startswith("imported ")
