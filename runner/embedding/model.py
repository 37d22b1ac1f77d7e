"""The encoders in MLX: BERT and (XLM-)RoBERTa, as sentence-transformers and transformers lay out their weights, with
a padding mask so rows of different lengths run in one batch; and the two cross-encoder heads (BERT's pooler and
classifier; RoBERTa's classification head). Own code, not mlx-embeddings (GPL-3.0, and it loads through the hub):
the forward pass is the same few operations on mlx.core, checked against an independent NumPy reference from the
same weights in tests/test_embeddings.py.

A decoder embedding model (Qwen3-Embedding) is mlx-lm's own model class (``decoder``): its causal mask already
keeps a right-padded row's real tokens from seeing the padding after them, and the last real token is pooled.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

NEG = -1e9  # added to the scores of padding positions (exp underflows to 0 in float32 and float16 alike)


class Embeddings(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden = config["hidden_size"]
        self.word_embeddings = nn.Embedding(config["vocab_size"], hidden)
        self.position_embeddings = nn.Embedding(config["max_position_embeddings"], hidden)
        self.token_type_embeddings = nn.Embedding(max(1, config.get("type_vocab_size", 2)), hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-12))
        # RoBERTa counts positions from padding_idx + 1 (its padding token's own position).
        self.position_offset = config.get("pad_token_id", 1) + 1 if config.get("model_type") in ROBERTA else 0

    def __call__(self, ids: mx.array, types: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1]) + self.position_offset
        h = self.word_embeddings(ids) + self.position_embeddings(positions)[None] + self.token_type_embeddings(types)
        return self.LayerNorm(h)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)


class AttentionOutput(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, eps: float):
        super().__init__()
        self.heads = heads
        self.self = SelfAttention(hidden)  # transformers' name for it
        self.output = AttentionOutput(hidden, eps)

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        b, n, d = h.shape
        inner = self.self

        def split(x):
            return x.reshape(b, n, self.heads, d // self.heads).transpose(0, 2, 1, 3)

        q, k, v = split(inner.query(h)), split(inner.key(h)), split(inner.value(h))
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(d // self.heads), mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(b, n, d)
        return self.output.LayerNorm(self.output.dense(out) + h)


class Dense(nn.Module):
    def __init__(self, inputs: int, outputs: int):
        super().__init__()
        self.dense = nn.Linear(inputs, outputs)


class Output(nn.Module):
    def __init__(self, intermediate: int, hidden: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(intermediate, hidden)
        self.LayerNorm = nn.LayerNorm(hidden, eps=eps)


ACTIVATIONS = {"gelu": nn.gelu, "gelu_new": nn.gelu_approx, "gelu_pytorch_tanh": nn.gelu_approx, "relu": nn.relu}
ROBERTA = {"roberta", "xlm-roberta", "camembert"}


class Layer(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        hidden, eps = config["hidden_size"], config.get("layer_norm_eps", 1e-12)
        self.attention = Attention(hidden, config["num_attention_heads"], eps)
        self.intermediate = Dense(hidden, config["intermediate_size"])
        self.output = Output(config["intermediate_size"], hidden, eps)
        act = config.get("hidden_act", "gelu")
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not one of {', '.join(ACTIVATIONS)}")
        self.act = ACTIVATIONS[act]

    def __call__(self, h: mx.array, mask: mx.array) -> mx.array:
        h = self.attention(h, mask)
        return self.output.LayerNorm(self.output.dense(self.act(self.intermediate.dense(h))) + h)


class Encoder(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.layer = [Layer(config) for _ in range(config["num_hidden_layers"])]


class Pooler(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)


class EncoderModel(nn.Module):
    """BERT or RoBERTa: token states of a padded batch (``lengths``: each row's real tokens)."""

    def __init__(self, config: dict, pooler: bool = False):
        super().__init__()
        self.embeddings = Embeddings(config)
        self.encoder = Encoder(config)
        if pooler:
            self.pooler = Pooler(config["hidden_size"])

    def __call__(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        real = mx.arange(ids.shape[1])[None] < lengths[:, None]  # (batch, tokens)
        h = self.embeddings(ids, types)
        mask = mx.where(real, 0.0, NEG).astype(h.dtype)[:, None, None, :]
        for layer in self.encoder.layer:
            h = layer(h, mask)
        return h


class RobertaHead(nn.Module):
    def __init__(self, hidden: int, labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, labels)


class CrossEncoder(nn.Module):
    """``*ForSequenceClassification``: one logit per pair (its first label), from the first token's state."""

    def __init__(self, config: dict):
        super().__init__()
        self.roberta_head = config.get("model_type") in ROBERTA
        labels = max(1, len(config.get("id2label") or {}) or config.get("num_labels", 1))
        self.encoder_model = EncoderModel(config, pooler=not self.roberta_head)
        hidden = config["hidden_size"]
        self.classifier = RobertaHead(hidden, labels) if self.roberta_head else nn.Linear(hidden, labels)

    def __call__(self, ids: mx.array, types: mx.array, lengths: mx.array) -> mx.array:
        first = self.encoder_model(ids, types, lengths)[:, 0]
        if self.roberta_head:
            logits = self.classifier.out_proj(mx.tanh(self.classifier.dense(first)))
        else:
            logits = self.classifier(mx.tanh(self.encoder_model.pooler.dense(first)))
        return logits[:, 0]


def load_encoder(config: dict, weights: dict[str, mx.array], rerank: bool) -> nn.Module:
    """The model with its weights: names as transformers saves them (with or without the ``bert.``/``roberta.``
    prefix); anything the model has no place for, or a place with no weight, raises ValueError naming it."""
    model = CrossEncoder(config) if rerank else EncoderModel(config)
    prefixes = ("bert.", "roberta.", "model.")
    renamed = {}
    for name, value in weights.items():
        if name.endswith("position_ids") or (not rerank and name.startswith(("pooler.", "bert.pooler."))):
            continue  # a buffer; the pooler an embedding model does not use
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        if rerank and not name.startswith("classifier."):
            name = "encoder_model." + name
        renamed[name] = value
    model.load_weights(list(renamed.items()), strict=True)
    return model
