"""Importing GGUF files: the exact mx.load path against the gguf-reader path, on SmolLM2.

Four files of the same model: the shipped Q4_1 file (every tensor a type
``mx.load`` reads exactly), and the same weights rewritten in llama.cpp's
Q4_K_M layout (``tests.test_real_models.q4_k_m_like``: Q4_K and Q6_K from the
test helpers' encoders, Q5_0 where rows are not a multiple of 256), as
Q5_0/Q5_1 and as Q8_0 (``gguf.quants``' quantizers). ``mx.load`` cannot read
the K and Q5 files; the importer reads them with ``gguf``. For each: import seconds, the folder's size, how far the
imported weights are from llama.cpp's own dequantization of the file, and the
answers to two capital questions (float32 on the CPU, as served).

Then the shipped file named in a supervisor config (imported on the first
load, reused after), and the vocabularies: llama.cpp's vocabulary-only files of
five real models (``models/gguf_vocabs.py``) tokenized by the importer's
tokenizer and by transformers' own GGUF tokenizer builder, against llama.cpp's
test cases.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common.defaults import SMOLLM2_DIR

QUESTIONS = ("What is the capital of France?", "What is the capital of Germany?")


def answers(folder: Path) -> list[str]:
    from common.settings import RunnerSettings
    from runner.engine import Engine
    from runner.request import GenerationRequest

    engine = Engine.load(folder, None, RunnerSettings(prompt_cache=0))
    return [
        "".join(r.text for r in engine.generate(GenerationRequest(messages=(("user", q),), max_tokens=30)))
        .strip()
        .replace("\n", " ")[:60]
        for q in QUESTIONS
    ]


def run() -> None:
    import gguf

    from runner.gguf import import_gguf
    from tests.helpers import differences_from_llama_cpp, rewrite_gguf
    from tests.test_real_models import q4_k_m_like

    Q = gguf.GGMLQuantizationType
    source = SMOLLM2_DIR.parent.parent / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    print("## GGUF import: SmolLM2-135M-Instruct\n")
    print(
        "| file | read by | import | folder | largest difference from llama.cpp's dequantization "
        "| capital of France? | of Germany? |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)

        def q5(name, kind, row_length):
            return None if kind != Q.Q4_1 else (Q.Q5_0 if ".attn_" in name else Q.Q5_1)

        def q8(name, kind, row_length):
            return None if kind != Q.Q4_1 else Q.Q8_0

        files = [
            ("Q4_1 (as shipped), Q8_0 embedding", source, "mx.load"),
            (
                "Q4_K_M layout: Q4_K / Q6_K ffn_down, Q5_0 elsewhere, Q8_0 embedding",
                rewrite_gguf(source, tmp / "q4_k_m.gguf", q4_k_m_like),
                "gguf",
            ),
            ("Q5_0 attention, Q5_1 MLP, Q8_0 embedding", rewrite_gguf(source, tmp / "q5.gguf", q5), "gguf"),
            ("Q8_0 everywhere", rewrite_gguf(source, tmp / "q8.gguf", q8), "mx.load"),
        ]
        for label, path, reader in files:
            out = tmp / f"out-{path.stem}"
            started = time.perf_counter()
            import_gguf(path, out)
            seconds = time.perf_counter() - started
            size = sum(f.stat().st_size for f in out.iterdir()) / 2**20
            difference = max(d for _, d, _ in differences_from_llama_cpp(path, out).values())
            france, germany = answers(out)
            print(
                f"| {label} | {reader} | {seconds:.1f} s | {size:.0f} MiB | {difference:.2g} | {france} | {germany} |"
            )
    print()
    named_in_a_config(source)
    vocabularies()


def named_in_a_config(source: Path) -> None:
    """A config naming the GGUF file: the first load imports it (in a child process), later loads reuse it."""
    from supervisor.config import from_dict

    print("## A GGUF file named in the supervisor's config\n")
    print("| config load | seconds |")
    print("| --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        data = {"gguf_cache_dir": tmp, "models": {"smol": {"target": str(source.resolve())}}}
        for label in ("first (imports)", "second (reuses)"):
            started = time.perf_counter()
            from_dict(data, Path(tmp))
            print(f"| {label} | {time.perf_counter() - started:.3f} |")
    print()


def transformers_tokenizer(metadata: dict):
    """transformers' GGUF tokenizer (``convert_gguf_tokenizer``, given the file's metadata as its reader would)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    fields = {
        name: (
            metadata[f"tokenizer.{key}"].tolist()
            if hasattr(metadata[f"tokenizer.{key}"], "tolist")
            else metadata[f"tokenizer.{key}"]
        )
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in metadata
    }
    return convert_gguf_tokenizer(metadata["general.architecture"], fields)[0]


def vocabularies(repeats: int = 50) -> None:
    from runner.gguf import build_tokenizer, open_reader, read_metadata
    from tests.test_gguf_import import VOCABULARIES, reference_cases, vocabulary

    print("## GGUF vocabularies: llama.cpp's tokenizer test cases\n")
    print(
        "| vocabulary | tokens | read (gguf) | importer: build | cases equal | encode "
        "| transformers' GGUF builder: cases equal | encode |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in VOCABULARIES:
        started = time.perf_counter()
        metadata = read_metadata(open_reader(vocabulary(name)))
        read = time.perf_counter() - started
        cases = reference_cases(name)
        characters = sum(len(text) for text, _ in cases) * repeats
        started = time.perf_counter()
        ours = build_tokenizer(metadata)
        built = time.perf_counter() - started
        row = [name, f"{len(metadata['tokenizer.ggml.tokens']):,}", f"{read:.1f} s", f"{built:.1f} s"]
        for tokenizer in (ours, transformers_tokenizer(metadata)):
            equal = sum(tokenizer.encode(text, add_special_tokens=False).ids == ids for text, ids in cases)
            started = time.perf_counter()
            for _ in range(repeats):
                for text, _ in cases:
                    tokenizer.encode(text, add_special_tokens=False)
            rate = characters / (time.perf_counter() - started)
            row += [f"{equal}/{len(cases)}", f"{rate / 1e6:.1f} M chars/s"]
        print("| " + " | ".join(row) + " |")
    print()
