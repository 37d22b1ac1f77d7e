"""Configuration: TOML in, one clear message naming the key for every mistake."""

import time

import pytest

from common.defaults import DEFAULT_DRAFT, DEFAULT_TARGET
from supervisor.config import ConfigError, default_config, from_dict, load, parse_duration, parse_size, resolve_gguf
from tests.processes import REPO, SupervisorProcess, model_toml, serve_expecting_refusal, terminate

GOOD = {"models": {"m": {"target": str(DEFAULT_TARGET), "draft": str(DEFAULT_DRAFT)}}}


def with_model(**fields):
    return {"models": {"m": {"target": str(DEFAULT_TARGET), **fields}}}


def test_a_good_config_loads(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'''
listen = "127.0.0.1:6000"
max_loaded = 1
health_period = "500ms"
[models.m]
target = "{DEFAULT_TARGET}"
draft = "{DEFAULT_DRAFT}"
soft_limit = "1GiB"
hard_limit = "2GiB"
keep_alive = "5m"
cache_limit = "unbounded"
''')
    config = load(path)
    m = config.models["m"]
    assert m.soft_limit == 2**30 and m.hard_limit == 2 * 2**30 and m.keep_alive == 300
    assert m.runner.cache_limit == "unbounded" and config.health_period == 0.5 and config.loaded_cap == 1


def test_zero_config_serves_the_default_pair_on_loopback():
    config = default_config()
    assert config.models["default"].target == DEFAULT_TARGET and config.listen.startswith("127.0.0.1:")


@pytest.mark.parametrize(
    "data, key",
    [
        ({}, "models"),
        ({**GOOD, "colour": "blue"}, "colour"),
        (with_model(flavour=1), "models.m.flavour"),
        ({"models": {"m": {}}}, "models.m.target"),
        (with_model(target="/no/such/folder"), "models.m.target"),
        (with_model(draft="/no/such/draft"), "models.m.draft"),
        (with_model(num_draft_tokens=-1), "models.m.num_draft_tokens"),
        (with_model(num_draft_tokens="three"), "models.m.num_draft_tokens"),
        (with_model(soft_limit="lots"), "models.m.soft_limit"),
        (with_model(soft_limit="2GiB", hard_limit="1GiB"), "models.m.soft_limit"),
        (with_model(keep_alive="forever"), "models.m.keep_alive"),
        (with_model(release_interval=0), "models.m.release_interval"),
        ({**GOOD, "listen": "0.0.0.0:6000"}, "listen"),
        ({**GOOD, "probe_port": 70000}, "probe_port"),
        ({**GOOD, "max_restarts": 0}, "max_restarts"),
        ({**GOOD, "tls_cert": "cert.pem"}, "tls_cert"),
        ({**GOOD, "runtime_dir": "/tmp/" + "r" * 100}, "runtime_dir"),  # no unix socket's path is that long
        ({"models": {"bad name!": {"target": str(DEFAULT_TARGET)}}}, "models.bad name!"),
    ],
)
def test_mistakes_name_their_key(tmp_path, data, key):
    with pytest.raises(ConfigError) as caught:
        from_dict(data, tmp_path)
    assert caught.value.key == key
    assert str(caught.value).startswith(f"config: {key}: ")


@pytest.mark.parametrize(
    "key, address",
    [
        ("listen", "0.0.0.0:6000"),
        ("listen", "192.0.2.7:6000"),
        ("listen", "[::]:6000"),
        ("http_listen", "0.0.0.0:8080"),
        ("http_listen", "[2001:db8::1]:8080"),
        ("ollama_listen", "0.0.0.0:11434"),
        ("probe_host", "0.0.0.0"),
    ],
)
def test_remote_listen_needs_allow_remote(tmp_path, key, address):
    with pytest.raises(ConfigError) as caught:
        from_dict({**GOOD, key: address}, tmp_path)
    assert caught.value.key == key
    assert str(caught.value) == (
        f"config: {key}: {address} is not a loopback address: set allow_remote = true to bind it"
    )
    config = from_dict({**GOOD, key: address, "allow_remote": True, "auth_token": "t"}, tmp_path)
    assert getattr(config, key) == address and config.allow_remote and config.auth_token == "t"


@pytest.mark.parametrize(
    "key, address",
    [
        ("listen", "127.0.0.1:6000"),
        ("listen", "localhost:6000"),
        ("listen", "[::1]:6000"),
        ("listen", "unix:///tmp/mlxserve.sock"),
        ("http_listen", "127.0.0.2:8080"),
        ("http_listen", ""),
        ("ollama_listen", "127.0.0.1:11434"),
    ],
)
def test_loopback_listen_needs_no_allow_remote(tmp_path, key, address):
    assert getattr(from_dict({**GOOD, key: address}, tmp_path), key) == address


def test_ollama_listen_is_off_by_default_and_not_the_http_address(tmp_path):
    assert from_dict(GOOD, tmp_path).ollama_listen == ""
    with pytest.raises(ConfigError) as caught:
        from_dict({**GOOD, "http_listen": "127.0.0.1:9000", "ollama_listen": "127.0.0.1:9000"}, tmp_path)
    assert caught.value.key == "ollama_listen"


def test_sizes_and_durations():
    assert parse_size("k", "512MiB") == 512 * 2**20 and parse_size("k", "2GB") == 2 * 10**9 and parse_size("k", 7) == 7
    assert parse_duration("k", "250ms") == 0.25 and parse_duration("k", "2m") == 120 and parse_duration("k", 3) == 3


def test_bad_config_stops_start_up_with_one_message_and_starts_nothing(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(f'[models.m]\ntarget = "{DEFAULT_TARGET}"\nhard_limit = "very big"\n')
    done = serve_expecting_refusal(path)
    assert done.returncode == 2
    assert (
        done.stderr.strip() == "supervisor: config: models.m.hard_limit: 'very big' is not a size such as 512MiB or 2GB"
    )
    assert "runner" not in done.stderr


def test_unwritable_runtime_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = tmp_path / "c.toml"
    path.write_text(
        f'runtime_dir = "{blocker}/run"\nprobe_port = 0\nlisten = "127.0.0.1:0"\n'
        f'[models.m]\ntarget = "{DEFAULT_TARGET}"\n'
    )
    done = serve_expecting_refusal(path)
    assert done.returncode == 2 and f"runtime_dir {blocker}/run is not usable" in done.stderr


def test_public_generate_request_shares_the_runner_fields():
    """The supervisor forwards a request by re-reading its bytes as the runner's message."""
    from common.protocol import runner_pb2
    from supervisor.protocol import supervisor_pb2

    def fields(descriptor, skip=()):
        return {(f.name, f.number, f.type, f.has_presence) for f in descriptor.fields if f.name not in skip}

    # model and defaulted are the supervisor's own (which runner, and which sampling defaults it fills in)
    assert fields(supervisor_pb2.GenerateRequest.DESCRIPTOR, skip=("model", "defaulted")) == fields(
        runner_pb2.GenerateRequest.DESCRIPTOR
    )
    assert supervisor_pb2.GenerateRequest.DESCRIPTOR.fields_by_name["defaulted"].number not in {
        f.number for f in runner_pb2.GenerateRequest.DESCRIPTOR.fields
    }


SMOLLM2_GGUF = REPO / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # from make real-model


def test_a_gguf_target_is_imported_once_and_reused(tmp_path):
    """A model's target may be a .gguf file: reading the config imports nothing; at start-up (``resolve_gguf``)
    it is imported into the GGUF cache folder once (in a child process), and a later start finds that folder and
    imports nothing."""
    data = {"gguf_cache_dir": "cache", "models": {"smol": {"target": str(SMOLLM2_GGUF)}}}
    config = from_dict(data, tmp_path)
    assert config.models["smol"].target == SMOLLM2_GGUF and not (tmp_path / "cache").exists()
    folder = resolve_gguf(config).models["smol"].target
    assert folder.parent == tmp_path / "cache" and folder.name.startswith("SmolLM2-135M-Instruct.Q4_1-")
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    written = (folder / "model.safetensors").stat().st_mtime_ns
    assert resolve_gguf(from_dict(data, tmp_path)).models["smol"].target == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written  # not imported again
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [folder.name]  # no partial folder left


def test_an_import_no_start_can_reach_again_is_removed_at_the_next_import(tmp_path):
    """A GGUF file downloaded again (changed in place) is imported again under a new key: the old import, and one
    whose file is gone, would stay on disk for good (~100 MB each here, tens of GB for a large model); the next
    import removes them, and what an import killed part-way left a day ago or more. An import from before the
    records, one still reachable, one whose file's drive is not mounted now, and one under way, stay."""
    import json
    import os
    import shutil

    from supervisor.gguf_cache import SOURCE, imported_folder

    cache, gguf = tmp_path / "cache", tmp_path / "smol.gguf"
    shutil.copyfile(SMOLLM2_GGUF, gguf)
    first = imported_folder(gguf, cache)
    assert json.loads((first / SOURCE).read_text())["path"] == str(gguf.resolve())
    here = tmp_path.stat().st_dev
    gone = cache / "gone-0123456789ab"  # an import whose file was deleted since (with its folder)
    shutil.copytree(first, gone)
    deleted = {"path": str(tmp_path / "models" / "deleted.gguf"), "size": 1, "mtime_ns": 1, "device": here}
    (gone / SOURCE).write_text(json.dumps(deleted))
    # A stand-in for a drive that is not mounted now (one cannot be unmounted here): the file's nearest existing
    # folder is on another device than the file was. The file may come back; its import stays.
    unplugged = cache / "unplugged-0123456789ab"
    shutil.copytree(first, unplugged)
    (unplugged / SOURCE).write_text(json.dumps({**deleted, "device": here + 1}))
    # What imports killed part-way left: one two days ago (removed), one now (an import under way: kept).
    killed, running = cache / "big-0123456789ab.partial-7-00c0ffee", cache / "big-0123456789ab.partial-8-00c0ffee"
    for partial in (killed, running):
        (partial / "shards").mkdir(parents=True)
        (partial / "shards" / "model-00001.safetensors").write_bytes(b"\0" * 1024)
    two_days_ago = time.time() - 2 * 86400
    for path in (killed, killed / "shards", killed / "shards" / "model-00001.safetensors"):
        os.utime(path, (two_days_ago, two_days_ago))
    unrecorded = cache / "older-0123456789ab"  # made before imports were recorded: left alone
    unrecorded.mkdir()
    (unrecorded / "config.json").write_text("{}")
    assert imported_folder(gguf, cache) == first and gone.is_dir()  # a reused import removes nothing

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # downloaded again
    second = imported_folder(gguf, cache)
    assert second != first and (second / "config.json").is_file()
    assert sorted(p.name for p in cache.iterdir()) == sorted(
        [second.name, unrecorded.name, unplugged.name, running.name]
    )


def test_a_gguf_the_importer_refuses_is_a_config_error_naming_the_key(tmp_path):
    truncated = tmp_path / "cut.gguf"
    with open(SMOLLM2_GGUF, "rb") as f:
        truncated.write_bytes(f.read(5_000_000))
    data = {"gguf_cache_dir": "cache", "models": {"m": {"target": str(DEFAULT_TARGET), "draft": str(truncated)}}}
    config = from_dict(data, tmp_path)
    with pytest.raises(ConfigError) as error:
        resolve_gguf(config)
    assert error.value.key == "models.m.draft" and "extends past the end of the file" in str(error.value)
    assert not any((tmp_path / "cache").iterdir())  # the cut-short import left nothing behind
    with pytest.raises(ConfigError, match="no such file"):
        from_dict({"models": {"m": {"target": str(tmp_path / "missing.gguf")}}}, tmp_path)


def test_the_supervisor_serves_a_gguf_file_named_in_its_config(tmp_path):
    """What a user with a GGUF download does: name the file in the config and ask the model."""
    supervisor = SupervisorProcess(
        tmp_path, f'[models.smol]\ntarget = "{SMOLLM2_GGUF}"\n', gguf_cache_dir=str(tmp_path / "cache")
    ).wait_ready(180)
    try:
        reply = supervisor.openai().chat.completions.create(
            model="smol",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=12,
            temperature=0,
        )
    finally:
        assert terminate(supervisor.process, 30) == 0
    assert "Paris" in reply.choices[0].message.content


def test_a_deep_runtime_dir_and_a_long_model_name_still_serve(tmp_path):
    """A unix socket's path holds at most 107 bytes on Linux: a runtime_dir of 85 bytes and a model named with 62
    characters would make a path of 154. The runner listens on the name's digest instead, and answers."""
    folder = tmp_path / ("d" * (81 - len(str(tmp_path)) - 1))  # its runtime_dir (FOLDER/run) is 85 bytes
    name = "a-model-whose-name-is-long-as-some-are-" + "x" * 23
    supervisor = SupervisorProcess(folder, model_toml(name, draft=None)).wait_ready(120)
    try:
        chunks = list(supervisor.client.generate(timeout=60, model=name, prompt="x", max_tokens=3, ignore_eos=True))
        sockets = [str(path) for path in supervisor.runtime_dir.glob("*.sock")]
    finally:
        assert terminate(supervisor.process, 30) == 0
    assert len(str(supervisor.runtime_dir)) == 85 and chunks[-1].stats.generated_tokens == 3
    assert len(sockets) == 1 and len(sockets[0]) <= 107 and name not in sockets[0]


def test_prompt_cache_dir_is_relative_to_the_config_and_made_or_refused_naming_its_key(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[models.m]\ntarget = "{DEFAULT_TARGET}"\nprompt_cache_dir = "cache/prompts"\n')
    runner = load(path).models["m"].runner
    assert runner.prompt_cache_dir == tmp_path / "cache" / "prompts" and runner.prompt_cache_dir.is_dir()
    assert "--prompt-cache-dir" in runner.to_argv()  # the runner gets it
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path.write_text(f'[models.m]\ntarget = "{DEFAULT_TARGET}"\nprompt_cache_dir = "{blocker}/prompts"\n')
    with pytest.raises(ConfigError) as caught:
        load(path)
    assert "models.m.prompt_cache_dir: cannot make" in str(caught.value)
