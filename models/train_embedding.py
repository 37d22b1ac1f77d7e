"""Two tiny models with random weights in real architectures, for issue #42's tests (no reranker or decoder
embedding model can be fetched here), into models/embedding (outside git):

- ``reranker``: a cross-encoder as ms-marco-MiniLM and bge-reranker's BERT cousins are laid out by transformers
  (``BertForSequenceClassification``, one label: ``bert.*`` with its pooler, ``classifier``), 2 layers, hidden 64,
  on all-MiniLM-L6-v2's tokenizer (so a pair is ``[CLS] query [SEP] document [SEP]`` with segment ids).
- ``qwen3-embedding``: Qwen3-Embedding's layout: a ``Qwen3ForCausalLM`` config whose weights are the bare
  ``Qwen3Model``'s (no ``model.`` prefix, no head), ``modules.json`` with last-token pooling and Normalize, and
  its query prompt in ``config_sentence_transformers.json``; 2 layers, hidden 64, on the same tokenizer (whose
  closing [SEP] stands where Qwen3's tokenizer appends <|endoftext|>: the token pooled).

    python models/train_embedding.py      (make embedding-model, after models/embedding_model.py)

Seeded: the same files every time.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from common.defaults import MINILM_DIR, MODELS_DIR  # noqa: E402

OUT = MODELS_DIR / "embedding"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
VOCAB = 30522


def save(folder: Path, weights: dict, config: dict) -> None:
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.astype(np.float32) for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(MINILM_DIR / name, folder / name)


def reranker(rng: np.random.Generator) -> None:
    hidden, layers, inner = 64, 2, 128
    w = {
        "bert.embeddings.word_embeddings.weight": rng.normal(0, 0.5, (VOCAB, hidden)),
        "bert.embeddings.position_embeddings.weight": rng.normal(0, 0.1, (512, hidden)),
        "bert.embeddings.token_type_embeddings.weight": rng.normal(0, 0.5, (2, hidden)),
        "bert.embeddings.LayerNorm.weight": np.ones(hidden),
        "bert.embeddings.LayerNorm.bias": np.zeros(hidden),
    }
    for i in range(layers):
        p = f"bert.encoder.layer.{i}."
        for name, shape in (
            ("attention.self.query", (hidden, hidden)),
            ("attention.self.key", (hidden, hidden)),
            ("attention.self.value", (hidden, hidden)),
            ("attention.output.dense", (hidden, hidden)),
            ("intermediate.dense", (inner, hidden)),
            ("output.dense", (hidden, inner)),
        ):
            w[p + name + ".weight"] = rng.normal(0, 0.15, shape)
            w[p + name + ".bias"] = rng.normal(0, 0.02, shape[0])
        for name in ("attention.output.LayerNorm", "output.LayerNorm"):
            w[p + name + ".weight"] = 1 + rng.normal(0, 0.05, hidden)
            w[p + name + ".bias"] = rng.normal(0, 0.02, hidden)
    w["bert.pooler.dense.weight"] = rng.normal(0, 0.2, (hidden, hidden))
    w["bert.pooler.dense.bias"] = np.zeros(hidden)
    w["classifier.weight"] = rng.normal(0, 0.5, (1, hidden))
    w["classifier.bias"] = np.zeros(1)
    config = {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "intermediate_size": inner,
        "hidden_act": "gelu",
        "max_position_embeddings": 512,
        "type_vocab_size": 2,
        "vocab_size": VOCAB,
        "layer_norm_eps": 1e-12,
        "pad_token_id": 0,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }
    save(OUT / "reranker", w, config)


def qwen3_embedding(rng: np.random.Generator) -> None:
    hidden, layers, heads, kv_heads, head_dim, inner = 64, 2, 4, 2, 16, 128
    w = {"embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, hidden)), "norm.weight": np.ones(hidden)}
    for i in range(layers):
        p = f"layers.{i}."
        w[p + "self_attn.q_proj.weight"] = rng.normal(0, 0.15, (heads * head_dim, hidden))
        w[p + "self_attn.k_proj.weight"] = rng.normal(0, 0.15, (kv_heads * head_dim, hidden))
        w[p + "self_attn.v_proj.weight"] = rng.normal(0, 0.15, (kv_heads * head_dim, hidden))
        w[p + "self_attn.o_proj.weight"] = rng.normal(0, 0.15, (hidden, heads * head_dim))
        w[p + "self_attn.q_norm.weight"] = np.ones(head_dim)
        w[p + "self_attn.k_norm.weight"] = np.ones(head_dim)
        w[p + "input_layernorm.weight"] = np.ones(hidden)
        w[p + "post_attention_layernorm.weight"] = np.ones(hidden)
        w[p + "mlp.gate_proj.weight"] = rng.normal(0, 0.15, (inner, hidden))
        w[p + "mlp.up_proj.weight"] = rng.normal(0, 0.15, (inner, hidden))
        w[p + "mlp.down_proj.weight"] = rng.normal(0, 0.15, (hidden, inner))
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": inner,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "vocab_size": VOCAB,
    }
    folder = OUT / "qwen3-embedding"
    save(folder, w, config)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_lasttoken": True, "include_prompt": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=2) + "\n")
    prompts = {
        "prompts": {
            "query": "Instruct: Given a web search query, retrieve relevant passages that answer the query\nQuery:",
            "document": "",
        },
        "default_prompt_name": None,
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(prompts, indent=2) + "\n")


def main() -> int:
    if not (MINILM_DIR / "tokenizer.json").exists():
        raise SystemExit(f"{MINILM_DIR} is missing: run models/embedding_model.py first")
    rng = np.random.default_rng(42)
    reranker(rng)
    qwen3_embedding(rng)
    print(f"{OUT}: reranker and qwen3-embedding written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
