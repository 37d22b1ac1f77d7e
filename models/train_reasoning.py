"""Train a small model that thinks before it answers, with Qwen3's chat template (issue #38's test model).

    python models/train_reasoning.py [--out models/reasoning] [--seed 0]

No reasoning model can be fetched here, so one is built as the default pair was: a llama of ~2M parameters, a
byte-level BPE tokenizer with Qwen's special tokens (``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``) and
``<think>`` / ``</think>`` as added tokens (kept in the decoded text, as Qwen3's are), and Qwen3's real chat
template, trained on arithmetic questions answered the way Qwen3 answers: a ``<think>`` block that works the
sum out, a blank line, then the answer; and, for the conversations the template lays out with
``enable_thinking=False`` (the block given empty in the prompt), the answer alone. The loss counts the
assistant's turn only. Runs on the CPU with MLX and is deterministic for a seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import build_model, fit  # noqa: E402 - the default pair's trainer, beside this file

VOCAB_SIZE = 1024
CONTEXT_LENGTH = 4096
SHAPE = dict(hidden_size=192, num_hidden_layers=4, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK = ["<think>", "</think>"]
# Qwen3's chat template (Qwen/Qwen3-8B's tokenizer_config.json), without its tool-calling branches.
QWEN3_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}{%- set ns.multi_step_tool = false %}"
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}"
    "{%- else %}{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}{%- if loop.last or (not loop.last and reasoning_content) %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
NUMBER_WORDS = "zero one two three four five six seven eight nine ten".split()


def example(rng: np.random.Generator) -> tuple[str, str, str]:
    """(question, reasoning, answer) about a sum or a comparison."""
    a, b = (int(x) for x in rng.integers(0, 50, size=2))
    kind = rng.integers(0, 3)
    if kind == 0:
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", f"The answer is {a + b}."
    if kind == 1:
        big, small = max(a, b), min(a, b)
        return (
            f"What is {big} minus {small}?",
            f"{big} minus {small} is {big - small}.",
            f"The answer is {big - small}.",
        )
    word = NUMBER_WORDS[a % 11]
    return (
        f"Which is larger, {a} or {b}?",
        f"Compare {a} and {b}: {max(a, b)} is larger. In words {a % 11} is {word}.",
        f"{max(a, b)} is larger.",
    )


def render(template, question: str, reasoning: str, answer: str, thinking: bool) -> tuple[str, str]:
    """(the prompt ``template`` (Qwen3's, compiled) lays out, the assistant's turn after it) as Qwen3 writes them."""
    prompt = template.render(
        messages=[{"role": "user", "content": question}],
        add_generation_prompt=True,
        enable_thinking=thinking,
    )
    turn = (f"<think>\n{reasoning}\n</think>\n\n" if thinking else "") + answer + "<|im_end|>\n"
    return prompt, turn


def train_tokenizer(texts: list[str]):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK])
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "reasoning")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--examples", type=int, default=20000)
    args = parser.parse_args()

    mx.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)
    from jinja2 import Environment

    template = Environment().from_string(QWEN3_TEMPLATE)
    pairs = []
    for i in range(args.examples):
        question, reasoning, answer = example(rng)
        pairs.append(render(template, question, reasoning, answer, thinking=i % 5 != 0))  # a fifth not thinking
    tokenizer = train_tokenizer([p + t for p, t in pairs])
    end = tokenizer.token_to_id("<|im_end|>")
    rows = []
    for prompt, turn in pairs:
        prompt_ids, turn_ids = tokenizer.encode(prompt).ids, tokenizer.encode(turn).ids
        rows.append((prompt_ids, turn_ids))
    length = max(len(p) + len(t) for p, t in rows)
    pad = tokenizer.token_to_id("<|endoftext|>")
    tokens = np.full((len(rows), length), pad, dtype=np.int32)
    mask = np.zeros((len(rows), length - 1), dtype=np.float32)
    for i, (prompt_ids, turn_ids) in enumerate(rows):
        ids = prompt_ids + turn_ids
        tokens[i, : len(ids)] = ids
        mask[i, len(prompt_ids) - 1 : len(ids) - 1] = 1.0  # the assistant's turn, its <|im_end|> included

    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=tokenizer.get_vocab_size(),
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=True,
        bos_token_id=pad,
        eos_token_id=end,
        pad_token_id=pad,
        torch_dtype="float16",
        **SHAPE,
    )
    model = build_model(config)

    def batches(step):
        chosen = rng.integers(0, len(rows), size=args.batch)
        return mx.array(tokens[chosen, :-1]), mx.array(tokens[chosen, 1:]), mx.array(mask[chosen])

    fit(model, batches, args.steps, 2e-3, "reasoning")
    if args.out.exists():
        shutil.rmtree(args.out)
    args.out.mkdir(parents=True)
    weights = {k: v.astype(mx.float16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(args.out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(args.out / "tokenizer.json"))
    tokenizer_config = dict(
        tokenizer_class="PreTrainedTokenizerFast",
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=CONTEXT_LENGTH,
        clean_up_tokenization_spaces=False,
        chat_template=QWEN3_TEMPLATE,
    )
    (args.out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    n = sum(v.size for _, v in tree_flatten(model.parameters()))
    print(f"reasoning model: {n / 1e6:.2f}M parameters -> {args.out}")


if __name__ == "__main__":
    main()
