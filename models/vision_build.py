"""What the vision models' build scripts share: SmolLM2's tokenizer with a family's tokens added at their ids, JSON
files written as the hub writes them, and what their self-checks share (a Qwen-style layout of one image, the
greedy loop)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_TOKENIZER = ROOT / "models" / "smollm2" / "tokenizer.json"
BASE_VOCAB = 49152  # SmolLM2-135M-Instruct's


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def extend_tokenizer(out: Path, tokens: list[str], special=lambda token: True) -> dict:
    """SmolLM2's tokenizer with ``tokens`` added in order from id 49152 (special where ``special(token)``), saved as
    ``out/tokenizer.json``. Returns the ``added_tokens_decoder`` of its ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer

    if not BASE_TOKENIZER.exists():
        raise SystemExit(f"missing SmolLM2's tokenizer: {BASE_TOKENIZER} (make real-model)")
    tok = Tokenizer.from_file(str(BASE_TOKENIZER))
    if tok.get_vocab_size(with_added_tokens=True) != BASE_VOCAB:
        raise SystemExit(f"{BASE_TOKENIZER} is not SmolLM2's {BASE_VOCAB}-token vocabulary")
    for token in tokens:
        added = AddedToken(token, normalized=False, special=special(token))
        (tok.add_special_tokens if special(token) else tok.add_tokens)([added])
    for i, token in enumerate(tokens):
        if tok.token_to_id(token) != BASE_VOCAB + i:
            raise SystemExit(f"{token} got id {tok.token_to_id(token)}, want {BASE_VOCAB + i}")
    tok.save(str(out / "tokenizer.json"))
    return {
        str(i): {
            "content": t.content,
            "lstrip": t.lstrip,
            "normalized": t.normalized,
            "rstrip": t.rstrip,
            "single_word": t.single_word,
            "special": t.special,
        }
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }


def greedy(logits, step, n: int) -> list[int]:
    """``n`` greedy tokens from the last row of ``logits`` (1, vocab), each next row from ``step(token)``."""
    import mlx.core as mx

    tokens = []
    for _ in range(n):
        tokens.append(int(mx.argmax(logits[0])))
        logits = step(tokens[-1])
    return tokens


QWEN_USER_IMAGE = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Describe the image.<|im_end|>\n"


def qwen_layout(out: Path, generation: str, image_pad: int, image_tokens: int, image):
    """mlx-vlm's model and processor for the Qwen-style checkpoint in ``out``, its chat template's prompt for one
    image and a question (checked: the user's turn as Qwen lays it out, then ``generation``), and the processor's
    inputs for ``image`` there (checked: ``image_tokens`` of ``image_pad``)."""
    import mlx_vlm
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    model, processor = mlx_vlm.load(str(out))
    print(f"loaded {type(model).__module__}.{type(model).__name__} / {type(processor).__name__}")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe the image."}]}]
    prompt = load_tokenizer(out).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == QWEN_USER_IMAGE + generation, prompt
    inputs = processor(text=[prompt], images=[image])
    ids = inputs["input_ids"][0].tolist()
    assert ids.count(image_pad) == image_tokens, ids
    return model, processor, prompt, inputs
