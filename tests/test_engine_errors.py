"""Bad requests and bad model folders give clear, typed errors."""

import shutil

import pytest

from common.defaults import DEFAULT_TARGET
from common.errors import InvalidRequest, ModelLoadError, TokenizerMismatch
from runner.engine import Engine, GenerationRequest
from tests.helpers import draft_with_swapped_vocabulary


@pytest.mark.parametrize(
    "fields, bad_field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt="x", max_tokens=0), "max_tokens"),
        (dict(prompt="x", max_tokens=-5), "max_tokens"),
        (dict(prompt="x", temperature=-0.1), "temperature"),
        (dict(prompt="x", temperature=float("nan")), "temperature"),
        (dict(prompt="x", temperature=float("inf")), "temperature"),
        (dict(prompt="x", top_p=0.0), "top_p"),
        (dict(prompt="x", top_p=1.5), "top_p"),
        (dict(prompt="x", top_k=-1), "top_k"),
        (dict(prompt="x", min_p=2.0), "min_p"),
        (dict(prompt="x", num_draft_tokens=-1), "num_draft_tokens"),
        (dict(prompt="x", num_draft_tokens=99), "num_draft_tokens"),
        (dict(prompt_ids=(1, 5, 999_999)), "prompt_ids"),
        (dict(prompt="x", seed=-1), "seed"),
        (dict(prompt="x", stop=tuple(str(i) for i in range(1000))), "stop"),
    ],
)
def test_bad_request_names_the_field(engine, fields, bad_field):
    with pytest.raises(InvalidRequest) as caught:
        next(engine.generate(GenerationRequest(**fields)))
    assert caught.value.field == bad_field


def test_prompt_longer_than_the_context_is_refused_before_any_work(engine):
    ids = tuple([5] * engine.context_length)
    with pytest.raises(InvalidRequest) as caught:
        next(engine.generate(GenerationRequest(prompt_ids=ids)))
    assert caught.value.field == "prompt" and str(engine.context_length) in caught.value.message


def test_engine_still_generates_after_bad_requests(engine):
    with pytest.raises(InvalidRequest):
        next(engine.generate(GenerationRequest(prompt="x", top_p=7)))
    rounds = list(engine.generate(GenerationRequest(prompt="x", max_tokens=5, ignore_eos=True)))
    assert rounds[-1].stats.generated_tokens == 5


def test_missing_model_folder(tmp_path):
    with pytest.raises(ModelLoadError) as caught:
        Engine.load(tmp_path / "nowhere")
    assert "nowhere" in str(caught.value) and "no such folder" in str(caught.value)


def test_corrupt_safetensors(tmp_path):
    broken = tmp_path / "target"
    shutil.copytree(DEFAULT_TARGET, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as caught:
        Engine.load(broken)
    assert str(broken) in str(caught.value)


def test_draft_with_same_size_but_different_vocabulary(tmp_path):
    other = draft_with_swapped_vocabulary(tmp_path / "draft")
    with pytest.raises(TokenizerMismatch) as caught:
        Engine.load(DEFAULT_TARGET, other)
    assert "differs" in str(caught.value)


def test_missing_tokenizer(tmp_path):
    folder = tmp_path / "no-tokenizer"
    shutil.copytree(DEFAULT_TARGET, folder)
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(ModelLoadError) as caught:
        Engine.load(folder)
    assert str(folder) in str(caught.value)


def test_config_whose_shapes_do_not_match_the_weights(tmp_path):
    import json

    folder = tmp_path / "wrong-shapes"
    shutil.copytree(DEFAULT_TARGET, folder)
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 512
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError) as caught:
        Engine.load(folder)
    assert str(folder) in str(caught.value)
