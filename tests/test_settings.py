"""A runner's settings: one description, read from a config table or a command line, the same either way."""

import dataclasses
import tempfile
from pathlib import Path

import pytest

from common.defaults import (
    CPU_PREFILL_CHUNK,
    DEFAULT_DRAFT,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_TARGET,
    MAX_NUM_DRAFT_TOKENS,
)
from common.settings import RunnerSettings, SettingsError
from runner.__main__ import parse_args

EVERY_SETTING_CHANGED = RunnerSettings(
    target=DEFAULT_TARGET,
    draft=DEFAULT_DRAFT,
    name="m",
    drafter="ngram",
    block=Path("models/block/default"),
    head=Path("models/heads/default"),
    num_draft_tokens=3,
    max_draft_tokens=9,
    ngram_max=5,
    ngram_min=3,
    release_interval=128,
    release_enabled=False,
    cache_limit=123456,
    prefill_chunk=512,
    dtype="float32",
    max_context=4096,
    max_output_tokens=512,
    reasoning_format="think",
    max_images=2,
    max_image_bytes=1000,
    max_image_pixels=4096,
    image_pixels=4096,
    image_urls="public",
    image_url_hosts="images.internal",
    adapters="terse=/tmp/terse,loud=/tmp/loud",
    prompt_cache=2**30,
    prompt_cache_dir=Path("/tmp/prompts"),
    prompt_cache_disk=2**31,
    prompt_cache_cold_after=90.0,
    kv_bits=8,
    kv_group_size=32,
    quantized_kv_start=128,
    batch_memory=2**29,
    malloc_trim=False,
    max_queue=7,
    max_batch=3,
    max_pending_rounds=99,
    stall_after=12.5,
    stream_interval=0.02,
    tool_format="pythonic",
    grace=3.0,
    debug_rpcs=True,
    kind="embed",
    matryoshka=[256, 128],
    embed_batch=32,
)


# ranks goes with neither disk nor cold tier: its own case.
HOSTFILE = Path(tempfile.mkdtemp()) / "hosts.json"
HOSTFILE.write_text('[["10.0.0.1:32323"], ["10.0.0.2:32323"]]')
A_GROUP = RunnerSettings(target=DEFAULT_TARGET, ranks=2, parallelism="tensor", backend="nccl", hostfile=HOSTFILE)


def test_every_setting_survives_the_command_line():
    for f in dataclasses.fields(RunnerSettings):  # the cases cover every field
        changed = getattr(EVERY_SETTING_CHANGED, f.name) != f.default or getattr(A_GROUP, f.name) != f.default
        assert changed, f.name
    for case in (EVERY_SETTING_CHANGED, A_GROUP):
        args, settings = parse_args(["--listen", "unix:///tmp/x.sock", *case.to_argv()])
        assert settings == case and args.listen == "unix:///tmp/x.sock"


def test_prefill_chunk_auto_is_the_devices_and_a_number_pins_it():
    auto = RunnerSettings()
    assert auto.prefill_chunk is None and auto.prefill_chunk_on("cpu") == CPU_PREFILL_CHUNK
    assert auto.prefill_chunk_on("gpu") == DEFAULT_PREFILL_CHUNK
    pinned = RunnerSettings.from_table({"prefill_chunk": 1024})
    assert pinned.prefill_chunk_on("cpu") == pinned.prefill_chunk_on("gpu") == 1024
    assert RunnerSettings.from_table({"prefill_chunk": "auto"}) == auto
    argv = ["--listen", "127.0.0.1:1", "--target", str(DEFAULT_TARGET), "--prefill-chunk", "auto"]
    assert parse_args(argv)[1] == RunnerSettings(target=DEFAULT_TARGET)
    for bad in (0, -5, "big", 1.5, True):
        with pytest.raises(SettingsError, match="prefill_chunk"):
            RunnerSettings.from_table({"prefill_chunk": bad})


def test_defaults_make_no_flags_and_parse_back_to_defaults():
    settings = RunnerSettings(target=DEFAULT_TARGET)
    assert settings.to_argv() == ["--target", str(DEFAULT_TARGET)]
    assert parse_args(["--listen", "127.0.0.1:1", "--target", str(DEFAULT_TARGET)])[1] == settings


def test_a_config_table_gives_the_same_settings_and_keeps_other_keys():
    table = {
        "target": str(DEFAULT_TARGET),
        "num_draft_tokens": "auto",
        "prompt_cache": "1GiB",
        "stall_after": "1m",
        "cache_limit": "unbounded",
        "keep_alive": "5m",
    }
    settings = RunnerSettings.from_table(table, name="m")
    assert table == {"keep_alive": "5m"}  # not a runner setting: the caller's
    assert settings.target == Path(DEFAULT_TARGET) and settings.num_draft_tokens is None
    assert settings.prompt_cache == 2**30 and settings.stall_after == 60.0 and settings.cache_limit == "unbounded"


@pytest.mark.parametrize(
    "table, key, message",
    [
        ({"num_draft_tokens": MAX_NUM_DRAFT_TOKENS + 1}, "num_draft_tokens", '"auto" or a number'),
        ({"max_batch": 0}, "max_batch", "at least 1"),
        ({"max_batch": "4"}, "max_batch", "expected int, got str"),
        ({"ngram_min": 5}, "ngram_min", "at most ngram_max"),
        ({"drafter": "model"}, "drafter", "needs a draft"),
        ({"drafter": "oracle"}, "drafter", "block, ngram, none"),
        ({"drafter": "block"}, "drafter", "needs block"),
        ({"dtype": "int3"}, "dtype", "is not one of"),
        ({"prompt_cache": "lots"}, "prompt_cache", "is not a size"),
        ({"stall_after": "soon"}, "stall_after", "is not a duration"),
        ({"max_context": 1}, "max_context", "at least 2"),
        ({"max_output_tokens": -1}, "max_output_tokens", ">= 0"),
        ({"adapters": {"a b": "/tmp/x"}}, "adapters", "an adapter's name"),
        ({"reasoning_format": "deepthought"}, "reasoning_format", "not one of auto, none, think, harmony"),
        ({"max_image_pixels": 0}, "max_image_pixels", "at least 1"),
        ({"image_urls": "all"}, "image_urls", "not one of off, public"),
        ({"adapters": {"a": 3}}, "adapters.a", "expected an adapter folder"),
        ({"release_enabled": "yes"}, "release_enabled", "expected bool"),
    ],
)
def test_each_mistake_is_one_error_naming_its_key(table, key, message):
    with pytest.raises(SettingsError) as error:
        RunnerSettings.from_table({"target": str(DEFAULT_TARGET), **table})
    assert error.value.key == key and message in str(error.value)


def test_the_runner_refuses_a_bad_flag_naming_it(capsys):
    with pytest.raises(SystemExit) as done:
        parse_args(["--listen", "127.0.0.1:1", "--target", str(DEFAULT_TARGET), "--max-batch", "many"])
    assert done.value.code == 2 and "--max-batch: 'many' is not a valid int" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--listen", "127.0.0.1:1"])
    assert "--target is required" in capsys.readouterr().err
