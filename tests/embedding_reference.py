"""An independent reference for the embedding tests: BERT's forward pass in NumPy, float64, one input at a time (no
padding, no mask), from the same safetensors weights, written from the architecture (transformers' BertModel,
sentence-transformers' Pooling and Normalize) and sharing no code with runner/embedding. Tokens come from Hugging
Face's tokenizers, as sentence-transformers gets them (its truncation to max_seq_length included).

No PyTorch here (sentence-transformers and transformers' BERT need it; ONNX Runtime needs an export the package does
not ship), so this stands in for them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file
from tokenizers import Tokenizer


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _gelu(x):
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


class NumpyBert:
    def __init__(self, folder: Path):
        folder = Path(folder)
        self.config = json.loads((folder / "config.json").read_text())
        raw = load_file(str(next(iter(sorted(folder.glob("model*.safetensors"))))))
        self.w = {k.removeprefix("bert."): v.astype(np.float64) for k, v in raw.items() if "position_ids" not in k}
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        max_len = 512
        bert_config = folder / "sentence_bert_config.json"
        if bert_config.exists():
            max_len = json.loads(bert_config.read_text()).get("max_seq_length", 512)
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(max_len)

    def states(self, ids, types=None):
        c, w = self.config, self.w
        eps = c.get("layer_norm_eps", 1e-12)
        n = len(ids)
        types = np.zeros(n, dtype=np.int64) if types is None else np.array(types)
        h = (
            w["embeddings.word_embeddings.weight"][ids]
            + w["embeddings.position_embeddings.weight"][np.arange(n)]
            + w["embeddings.token_type_embeddings.weight"][types]
        )
        h = _layer_norm(h, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"], eps)
        heads = c["num_attention_heads"]
        d = c["hidden_size"] // heads
        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def lin(x, name, p=p):
                return x @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q = lin(h, "attention.self.query").reshape(n, heads, d).transpose(1, 0, 2)
            k = lin(h, "attention.self.key").reshape(n, heads, d).transpose(1, 0, 2)
            v = lin(h, "attention.self.value").reshape(n, heads, d).transpose(1, 0, 2)
            scores = q @ k.transpose(0, 2, 1) / math.sqrt(d)
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            a = (scores @ v).transpose(1, 0, 2).reshape(n, heads * d)
            h = _layer_norm(
                lin(a, "attention.output.dense") + h,
                w[p + "attention.output.LayerNorm.weight"],
                w[p + "attention.output.LayerNorm.bias"],
                eps,
            )
            m = lin(_gelu(lin(h, "intermediate.dense")), "output.dense")
            h = _layer_norm(m + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"], eps)
        return h

    def embed(self, text: str) -> np.ndarray:
        """all-MiniLM-L6-v2's sentence embedding: mean over the tokens, normalised."""
        ids = self.tokenizer.encode(text).ids
        v = self.states(ids).mean(0)
        return v / np.linalg.norm(v)

    def score(self, query: str, document: str) -> float:
        """A BertForSequenceClassification cross-encoder's relevance: sigmoid of the first logit, through the
        pooler (dense + tanh on [CLS])."""
        e = self.tokenizer.encode(query, document)
        first = self.states(e.ids, e.type_ids)[0]
        pooled = np.tanh(first @ self.w["pooler.dense.weight"].T + self.w["pooler.dense.bias"])
        logit = pooled @ self.w["classifier.weight"][0] + self.w["classifier.bias"][0]
        return float(1 / (1 + np.exp(-logit)))


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
