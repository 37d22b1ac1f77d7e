"""Fetch llama.cpp's tokenizer test vocabularies, which the GGUF importer's tokenizer tests read.

    python models/gguf_vocabs.py      (part of make real-model; into .whl/vocab, outside git)

llama.cpp keeps, for each kind of vocabulary it reads, a vocabulary-only GGUF
file (``models/ggml-vocab-NAME.gguf``: the real model's tokens, scores, merges
and token types, no weights) with test texts (``.inp``) and the token ids the
model's own Hugging Face tokenizer gives them (``.out``). They ship inside
llama-cpp-python's source distribution on PyPI (it vendors llama.cpp), which
is taken alone (``pip download --no-deps --no-binary``), checked against a
known sha256, and the files below are extracted. Nothing is done when they
are already there.

- ``llama-spm``: Llama 1/2's SentencePiece vocabulary (32,000 pieces; Mistral
  v0.1 and TinyLlama use the same kind);
- ``phi-3``: Phi-3's SentencePiece vocabulary;
- ``llama-bpe``: Llama 3's byte-level BPE (128,256 tokens);
- ``gpt-2``: GPT-2's byte-level BPE;
- ``qwen2``: Qwen2's byte-level BPE (151,936 tokens; Qwen2.5 and Qwen3 use it too).
"""

from __future__ import annotations

import sys
import tarfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from real_model import DOWNLOADS, download  # noqa: E402

REQUIREMENT = "llama-cpp-python==0.3.36"
SDIST = "llama_cpp_python-0.3.36.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = "llama_cpp_python-0.3.36/vendor/llama.cpp/models/"
VOCABULARIES = ("llama-spm", "phi-3", "llama-bpe", "gpt-2", "qwen2")
VOCAB_DIR = DOWNLOADS / "vocab"


def vocabulary_files(name: str) -> list[Path]:
    return [VOCAB_DIR / f"ggml-vocab-{name}.gguf{suffix}" for suffix in ("", ".inp", ".out")]


def main() -> int:
    wanted = [path for name in VOCABULARIES for path in vocabulary_files(name)]
    if all(path.is_file() for path in wanted):
        print(f"{VOCAB_DIR}: already there")
        return 0
    sdist = download(REQUIREMENT, SDIST, SDIST_SHA256, "--no-binary", ":all:")
    VOCAB_DIR.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as archive:
        for path in wanted:
            source = archive.extractfile(MEMBERS + path.name)
            partial = path.with_suffix(path.suffix + ".part")
            partial.write_bytes(source.read())
            partial.replace(path)
    print(f"{VOCAB_DIR}: {len(wanted)} files from {SDIST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
