"""Models by name (issue #37): pulled from a hub with progress over every interface, checked before the weights
come, resumed, verified, and served on request under each ``pull`` setting; offline from the cache.

No hub can be reached from this machine: ``tests.hub_standin`` stands in for the Hugging Face hub (it says so),
and the real ``huggingface_hub`` client talks to it through ``HF_ENDPOINT``. It serves the real SmolLM2 folder
and its real GGUF file.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys
import threading

import grpc
import httpx
import ollama
import openai
import pytest

from common.defaults import DEFAULT_TARGET, SMOLLM2_DIR
from tests.helpers import on_a_terminal
from tests.hub_standin import Repo, StandInHub
from tests.processes import SupervisorProcess, model_toml, wait_until

SMOL_GGUF = SMOLLM2_DIR.parent.parent / ".whl" / "SmolLM2-135M-Instruct.Q4_1.gguf"  # models/real_model.py
ASK = [{"role": "user", "content": "What is the capital of France?"}]


def smol_files(**more) -> dict:
    files = {p.name: p for p in SMOLLM2_DIR.iterdir() if not p.name.startswith(".")}
    return {**files, **more}


def huge_safetensors() -> bytes:
    """A weights file whose header claims 80 GB of float32 (its data never comes: the pull is refused first)."""
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [200000, 100000], "data_offsets": [0, 80_000_000_000]}}
    )
    return struct.pack("<Q", len(header)) + header.encode() + b"\0" * 64


@pytest.fixture(scope="module")
def standin():
    llama = json.loads((SMOLLM2_DIR / "config.json").read_text())
    repos = {
        # the twins a pull must leave: PyTorch's weights beside the safetensors, a README
        "org/smol": Repo(smol_files(**{"pytorch_model.bin": b"\0" * 4096, "README.md": b"# SmolLM2\n"})),
        "org/smol-gguf": Repo(
            {"SmolLM2-135M-Instruct.Q4_1.gguf": SMOL_GGUF, "SmolLM2-135M-Instruct.Q8_0.gguf": b"GGUF" + b"\0" * 4096}
        ),
        "org/resumed": Repo(smol_files()),
        "org/shared": Repo(smol_files()),
        "org/slow": Repo(smol_files()),
        "org/corrupt": Repo(smol_files()),
        "org/gated": Repo(smol_files(), gated=True),
        "org/alien": Repo(smol_files(**{"config.json": json.dumps({**llama, "model_type": "alien"}).encode()})),
        "org/huge": Repo(
            {"config.json": (SMOLLM2_DIR / "config.json").read_bytes(), "model.safetensors": huge_safetensors()}
        ),
    }
    with StandInHub(repos) as hub:
        yield hub


def hub_env(standin, cache, **more) -> dict:
    return {"HF_ENDPOINT": standin.endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1", **more}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hub-cache")


@pytest.fixture(scope="module")
def sup(standin, cache, tmp_path_factory):
    """pull = "any": requests may name any repository; the APIs may pull."""
    models = model_toml("pair", target=DEFAULT_TARGET, draft=None, load_at_start=False)
    folder = tmp_path_factory.mktemp("hub-any")
    # GGUF files it pulls are imported under the test's folder, not the user's ~/.cache/mlxserve/gguf (where each
    # run left a ~100 MB import of a temporary path that no later run could reach).
    process = SupervisorProcess(
        folder, models, env=hub_env(standin, cache), pull="any", max_loaded=2, gguf_cache_dir=str(folder / "gguf")
    ).wait_ready(60)
    yield process
    assert process.stop() == 0


def cli(standin, cache, *args, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, **hub_env(standin, cache), **env}
    command = [sys.executable, "-m", "supervisor", *args]
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)


def test_the_cli_pulls_only_what_a_runner_needs(standin, cache):
    before = cli(standin, cache, "estimate", "org/smol")  # before a pull: the config and the weights' headers
    assert before.returncode == 0 and before.stdout.startswith("org/smol: "), before.stderr
    assert standin.weight_bytes_sent("org/smol") < 100_000
    done = cli(standin, cache, "pull", "org/smol")
    assert done.returncode == 0, done.stderr
    assert "org/smol: 9" in done.stdout and "pulling manifest" in done.stderr and "success" in done.stderr
    folder = next(cache.glob("models--org--smol/snapshots/*"))
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not standin.requests("org/smol", "pytorch_model.bin") and not standin.requests("org/smol", "README.md")
    estimated = cli(standin, cache, "estimate", "org/smol")  # from the cache now
    assert estimated.returncode == 0 and estimated.stdout.startswith("org/smol: "), estimated.stderr


def test_ollamas_pull_streams_its_progress_records_and_takes_one_quantization(sup, standin):
    records = list(sup.ollama().pull("org/smol-gguf:Q4_1", stream=True))
    statuses = [r.status for r in records]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    files = [r for r in records if r.digest]
    assert files and all(r.digest.startswith("sha256:") and r.total for r in files)
    assert files[-1].completed == files[-1].total == SMOL_GGUF.stat().st_size
    assert not standin.requests("org/smol-gguf", "SmolLM2-135M-Instruct.Q8_0.gguf")  # not every quantization
    # and served by that name: imported once, then answered
    answer = sup.ollama().chat(model="org/smol-gguf:Q4_1", messages=ASK, options={"temperature": 0, "num_predict": 8})
    assert answer.message.content


def test_grpc_pull_streams_progress_and_a_request_by_repo_answers_as_the_folder_does(sup, standin):
    progress = list(sup.client.pull("org/smol@main", timeout=300))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    assert any(p.file == "model.safetensors" and p.completed == p.total > 0 for p in progress)
    client = sup.openai()
    named = client.chat.completions.create(model="org/smol", messages=ASK, temperature=0, max_tokens=12)
    assert named.choices[0].message.content and named.model == "org/smol"
    listed = {m.id for m in client.models.list()}
    assert {"pair", "org/smol", "org/smol-gguf:Q4_1"} <= listed
    assert "org/smol" in {m.model for m in sup.ollama().list().models}


def test_a_cut_connection_resumes_where_it_stopped(sup, standin):
    standin.cut["model.safetensors"] = 30_000_000  # the next transfer of it stops after 30 MB
    records = list(sup.ollama().pull("org/resumed", stream=True))
    assert records[-1].status == "success"
    gets = [r for method, r in standin.requests("org/resumed", "model.safetensors") if method == "GET"]
    resumed = [int(r.removeprefix("bytes=").rstrip("-")) for r in gets if r.endswith("-")]
    assert resumed and 10_000_000 < resumed[0] <= 30_000_000  # the rest, from what had arrived (whole chunks)
    assert gets.count("") == 1  # the whole file was asked for once


def test_a_pull_shows_in_the_metrics_and_top_while_it_runs(sup, standin):
    standin.rate["org/slow"] = 25 * 2**20  # ~4 s for its 94 MiB
    pulling = threading.Thread(target=lambda: list(sup.ollama().pull("org/slow", stream=True)))
    pulling.start()
    try:
        assert wait_until(lambda: any(p.model == "org/slow" and p.completed for p in sup.client.get_status().pulls), 30)
        assert 'mlxserve_pull_total_bytes{model="org/slow"}' in sup.probe("/metrics")[1]
        top = subprocess.run(
            [sys.executable, "-m", "supervisor", "top", "--once", "--address", f"127.0.0.1:{sup.port}"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "pulling org/slow: " in top.stdout, top.stdout
    finally:
        pulling.join(120)
    assert not sup.client.get_status().pulls  # done: gone from the list


def test_two_pulls_of_one_repository_share_one_download(sup, standin):
    results = []

    def pull():
        results.append(list(sup.ollama().pull("org/shared", stream=True))[-1].status)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    whole = [r for method, r in standin.requests("org/shared", "model.safetensors") if method == "GET" and not r]
    assert results == ["success", "success"] and len(whole) == 1


def test_a_file_that_differs_from_its_sha256_is_deleted_and_named(sup, standin, cache):
    standin.corrupt.add("model.safetensors")
    try:
        with pytest.raises(ollama.ResponseError) as caught:
            list(sup.ollama().pull("org/corrupt", stream=True))
        assert "model.safetensors" in caught.value.error and "sha256" in caught.value.error
    finally:
        standin.corrupt.discard("model.safetensors")
    assert not list(cache.glob("models--org--corrupt/snapshots/*/model.safetensors"))


def test_what_cannot_be_served_is_refused_before_its_weights_come(sup, standin):
    with pytest.raises(ollama.ResponseError) as alien:
        list(sup.ollama().pull("org/alien", stream=True))
    assert "model type 'alien'" in alien.value.error and standin.weight_bytes_sent("org/alien") == 0
    with pytest.raises(ollama.ResponseError) as huge:
        list(sup.ollama().pull("org/huge", stream=True))
    assert "GiB to serve" in huge.value.error and huge.value.status_code == 429
    assert standin.weight_bytes_sent("org/huge") < 4096  # its header, read with a byte range
    with pytest.raises(ollama.ResponseError) as gated:
        list(sup.ollama().pull("org/gated", stream=True))
    assert (
        gated.value.status_code == 403 and "org/gated is gated" in gated.value.error and "HF_TOKEN" in gated.value.error
    )


def test_a_gated_repository_comes_with_hf_token(standin, tmp_path):
    done = cli(standin, tmp_path, "pull", "org/gated", HF_TOKEN=StandInHub.TOKEN)
    assert done.returncode == 0, done.stderr


def test_the_architectures_a_pull_accepts_are_the_importers():
    from runner.gguf import SUPPORTED_ARCHITECTURES
    from supervisor.hub import GGUF_ARCHITECTURES

    assert set(GGUF_ARCHITECTURES) == set(SUPPORTED_ARCHITECTURES)


def test_a_repository_that_does_not_exist_is_a_404_in_each_apis_shape(sup):
    with pytest.raises(ollama.ResponseError) as pulled:
        list(sup.ollama().pull("org/nope", stream=True))
    assert pulled.value.status_code == 404 and "no model org/nope on the hub" in pulled.value.error
    with pytest.raises(grpc.RpcError) as grpc_pull:
        list(sup.client.pull("org/nope", timeout=60))
    assert grpc_pull.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(openai.NotFoundError) as chat:
        sup.openai().chat.completions.create(model="org/nope", messages=ASK, max_tokens=4)
    assert "org/nope" in chat.value.body["message"]
    answer = httpx.post(
        sup.base_url.removesuffix("/v1") + "/v1/messages",
        json={"model": "org/nope", "max_tokens": 4, "messages": ASK},
        timeout=60,
    )
    assert answer.status_code == 404 and answer.json()["type"] == "error"


def test_the_pull_setting_decides_what_a_request_may_name(standin, cache, tmp_path):
    """never: only configured names; cached: what the hub cache holds (org/smol, pulled above), loaded on
    request; any: also pulled (the sup fixture's tests). The APIs' pulls are refused unless any."""
    models = model_toml("pair", target=DEFAULT_TARGET, draft=None, load_at_start=False)
    for setting in ("never", "cached"):
        process = SupervisorProcess(tmp_path / setting, models, env=hub_env(standin, cache), pull=setting).wait_ready(
            60
        )
        try:
            client = process.openai()
            if setting == "cached":
                assert client.chat.completions.create(model="org/smol", messages=ASK, max_tokens=4).choices
                assert "org/smol" in {m.id for m in client.models.list()}
            else:
                with pytest.raises(openai.NotFoundError):
                    client.chat.completions.create(model="org/smol", messages=ASK, max_tokens=4)
            with pytest.raises(openai.NotFoundError) as uncached:
                client.chat.completions.create(model="org/never-pulled", messages=ASK, max_tokens=4)
            assert "configured: pair" in uncached.value.body["message"]
            with pytest.raises(ollama.ResponseError) as refused:
                list(process.ollama().pull("org/smol", stream=True))
            assert refused.value.status_code == 403 and 'pull = "any"' in refused.value.error
        finally:
            assert process.stop() == 0


def test_offline_a_configured_repository_is_served_from_the_cache(standin, cache, tmp_path):
    models = model_toml("smol", target="org/smol", draft=None)
    process = SupervisorProcess(tmp_path, models, env=hub_env(standin, cache, HF_HUB_OFFLINE="1")).wait_ready(120)
    try:
        before = len(standin.fetched)
        answer = process.openai().chat.completions.create(model="smol", messages=ASK, temperature=0, max_tokens=8)
        assert answer.choices[0].message.content and len(standin.fetched) == before  # nothing asked of the hub
    finally:
        assert process.stop() == 0
    missing = model_toml("gone", target="org/never-pulled", draft=None)
    refused = subprocess.run(
        [sys.executable, "-m", "supervisor", "serve", "--config", str(write_config(tmp_path / "gone", missing))],
        env={**os.environ, **hub_env(standin, cache, HF_HUB_OFFLINE="1")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "models.gone.target" in refused.stderr and "offline" in refused.stderr


def write_config(folder, models_toml: str):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "supervisor.toml"
    path.write_text('http_listen = ""\nprobe_port = 0\nlisten = "127.0.0.1:0"\n' + models_toml.replace("'", '"'))
    return path


def test_the_cli_shows_a_bar_with_bytes_rate_and_time_left_on_a_terminal(standin, tmp_path):
    standin.rate["org/resumed"] = 40 * 2**20  # slow enough for the bar to be drawn a few times
    env = {**os.environ, **hub_env(standin, tmp_path), "COLUMNS": "120"}
    status, out = on_a_terminal([sys.executable, "-m", "supervisor", "pull", "org/resumed"], env)
    standin.rate.pop("org/resumed")
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # what the screen shows, colours and moves aside
    assert status == 0, shown
    assert re.search(r"pulling org/resumed .* [\d.]+/101\.9 MB [\d.]+ MB/s \d:\d\d:\d\d", shown), shown
    assert re.search(r"org/resumed: 97\.2 MiB in \S+/models--org--resumed/snapshots/", shown), shown
