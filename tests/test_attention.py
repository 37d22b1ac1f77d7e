"""runner.loading.attention: small attentions as plain ops (on CUDA, instead of a cuDNN plan per shape).

The rule is for CUDA; here it is turned on for the CPU (MLXSERVE_PLAIN_ATTENTION=1),
where its results must match MLX's own attention, and a model routed through it
must decode the same greedy tokens, plainly, speculating and batched.
"""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from runner.loading.attention import MAX_SCORE_BYTES, applies, attention, plain_attention
from tests.processes import child_environment


def _qkv(b, heads, kv_heads, length, keys, depth=16, seed=0):
    mx.random.seed(seed)
    return (
        mx.random.normal((b, heads, length, depth)),
        mx.random.normal((b, kv_heads, keys, depth)),
        mx.random.normal((b, kv_heads, keys, depth)),
    )


def _close(got, want):
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("b", "heads", "kv_heads", "length", "keys"),
    [(1, 4, 4, 3, 3), (1, 8, 2, 5, 40), (3, 6, 3, 9, 17), (2, 4, 1, 1, 30)],
)
def test_plain_attention_equals_mlx_attention_causal_and_unmasked(b, heads, kv_heads, length, keys):
    q, k, v = _qkv(b, heads, kv_heads, length, keys)
    for mask in ("causal", None):
        _close(
            plain_attention(q, k, v, 0.25, mask),
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask),
        )


def test_plain_attention_equals_mlx_attention_with_array_masks():
    """A batch's masks: boolean per row (left padding), per head, and additive."""
    b, heads, kv_heads, length, keys = 3, 8, 2, 4, 24
    q, k, v = _qkv(b, heads, kv_heads, length, keys, seed=1)
    starts = mx.array([0, 5, 11])  # each row's left padding
    row = (mx.arange(keys)[None] >= starts[:, None])[:, None, None, :]
    causal = (mx.arange(length)[:, None] + keys - length) >= mx.arange(keys)[None]
    boolean = row & causal  # (B, 1, L, S)
    per_head = mx.broadcast_to(boolean, (b, heads, length, keys))
    additive = mx.where(boolean, 0.0, -1e9).astype(mx.float32)
    for mask in (boolean, per_head, additive, causal):
        _close(
            plain_attention(q, k, v, 0.3, mask),
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask),
        )


def test_what_goes_to_mlx_lm_own_attention():
    """One query without an array mask (the vector kernel), and a score matrix over the limit, keep mlx-lm's
    attention; the rest runs as plain ops. Both give MLX's results."""
    q, k, v = _qkv(1, 4, 4, 1, 8)
    _close(attention(q, k, v, None, 1.0, None), mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0))
    keys = MAX_SCORE_BYTES // (4 * 2) + 1  # 1 row x 2 heads x 1 query: one key over the limit
    big = _qkv(1, 2, 2, 1, keys, depth=4)
    mask = mx.ones((1, 1, 1, keys), dtype=mx.bool_)
    _close(attention(*big, None, 0.5, mask), mx.fast.scaled_dot_product_attention(*big, scale=0.5, mask=mask))


def test_on_by_default_only_on_cuda(monkeypatch):
    monkeypatch.delenv("MLXSERVE_PLAIN_ATTENTION", raising=False)
    assert applies() is False  # this machine has no GPU
    monkeypatch.setenv("MLXSERVE_PLAIN_ATTENTION", "1")
    assert applies() is True


GREEDY = r"""
import gc, json, sys
from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from common.settings import RunnerSettings
from runner.engine import Engine
from runner.request import GenerationRequest
from runner.worker import MlxWorker

engine = Engine.load(DEFAULT_TARGET, DEFAULT_DRAFT, RunnerSettings(prompt_cache=0))
prompts = ["Repeat this list: for, while, break, continue. Again: for,", "A class definition defines"]
def request(prompt, **fields):
    return GenerationRequest(prompt=prompt, max_tokens=80, ignore_eos=True, cache_prompt=False, **fields)
def tokens(chunks):
    return [t for chunk in chunks for t in chunk.token_ids]
out = {"plain_attention": engine.target.plain_attention + engine.draft.plain_attention}
out["plain"] = [tokens(engine.generate(request(p, drafter="none"))) for p in prompts]
out["draft k=4"] = [tokens(engine.generate(request(p, drafter="model", num_draft_tokens=4))) for p in prompts]
out["ngram k=3"] = [tokens(engine.generate(request(p, drafter="ngram", num_draft_tokens=3))) for p in prompts]
worker = MlxWorker(engine, max_queue=8, max_batch=4)
worker.start()
jobs = [worker.submit(engine.prepare(request(p))) for p in prompts]
out["batched"] = [tokens(job.results()) for job in jobs]
out["batched_steps"] = worker.batched_steps
worker.stop(cancel_running=True)
worker.join(10)
del jobs, worker  # MLX arrays left to the interpreter's exit abort the process ("terminate called")
gc.collect()
print(json.dumps(out))
"""


def _greedy(setting: str) -> dict:
    env = child_environment() | {"MLXSERVE_PLAIN_ATTENTION": setting}
    done = subprocess.run([sys.executable, "-c", GREEDY], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_model_through_plain_attention_decodes_the_same_greedy_tokens():
    """The default pair with MLX's attention and with the rule on: the same tokens plainly, with either
    drafter (verify passes of several query tokens) and batched (array masks)."""
    mlx_own, plain = _greedy("0"), _greedy("1")
    assert mlx_own["plain_attention"] == 0 and plain["plain_attention"] >= 2  # both models were routed
    assert plain["batched_steps"] > 20
    for key in ("plain", "draft k=4", "ngram k=3", "batched"):
        assert plain[key] == mlx_own[key] == mlx_own["plain"], key
