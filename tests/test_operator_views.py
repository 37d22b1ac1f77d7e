"""What an operator looks at: the Grafana dashboard (deploy/grafana/mlxserve.json) queries only metrics the
supervisor exports, and ``python -m supervisor top --once`` shows every model with its state and its rate: tokens
a second for a generation model, inputs and requests a second and their mean time for an embedding model."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "mlxserve.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def exported(metrics_text: str) -> set[str]:
    """Every series name the exposition can hold, whether or not a sample has been recorded yet."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_the_dashboard_queries_is_exported(chat_supervisor):
    status, text = chat_supervisor.probe("/metrics")
    assert status == 200
    names = exported(text)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\bmlxserve_\w+", target["expr"])
    }
    assert len(dashboard["panels"]) >= 10 and len(queried) >= 20
    embedding = {"mlxserve_embed_requests_total", "mlxserve_embedded_inputs_total", "mlxserve_embed_seconds_bucket"}
    assert embedding <= queried, f"the embedding panels do not query {sorted(embedding - queried)}"
    assert not sorted(queried - names), f"queried but not exported: {sorted(queried - names)}"


def test_top_once_shows_every_model_its_state_and_the_rate_of_a_running_one(chat_supervisor):
    sup = chat_supervisor
    states = {m.name: m.state for m in sup.client.list_models().models}
    running = threading.Thread(
        target=lambda: list(sup.client.generate(timeout=120, model="pair", prompt="x", max_tokens=600, ignore_eos=True))
    )
    running.start()
    try:
        result = top_once(sup)
    finally:
        running.join(120)
    lines = result.splitlines()
    header = next(line for line in lines if line.startswith("MODEL"))
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in states}
    assert set(rows) == set(states)
    from supervisor.client import STATE_NAMES

    for name, state in states.items():
        assert rows[name].split()[1] == STATE_NAMES[state]
    rate = rows["pair"].split()[header.split().index("TOK/S")]  # no cell before it holds a space
    assert float(rate) > 0  # generating while top looked
    for column in ("IN/S", "REQ/S", "LAT"):  # never asked for embeddings
        assert rows["pair"].split()[header.split().index(column)] == "-"


def top_once(sup) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "supervisor", "top", "--once", "--address", f"127.0.0.1:{sup.port}"]
        + (["--token", sup.token] if sup.token else []),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def embedding_supervisor(tmp_path_factory):
    from common.defaults import MINILM_DIR
    from tests.processes import SupervisorProcess, model_toml

    assert (MINILM_DIR / "model.safetensors").is_file(), f"{MINILM_DIR} is missing: run `make embedding-model`"
    models = model_toml("minilm", target=MINILM_DIR, draft=None) + model_toml("gen", draft=None)
    sup = SupervisorProcess(tmp_path_factory.mktemp("top"), models).wait_ready(120)
    yield sup
    assert sup.stop() == 0


def test_top_shows_an_embedding_models_inputs_requests_and_time_next_to_a_generation(embedding_supervisor):
    """Clients embedding 8 sentences a request and one generating while top looks: the embedding model's row has
    inputs and requests a second (8 inputs a request) and their mean time, the generation model's its tokens a
    second and no embedding figures."""
    sup = embedding_supervisor
    client = sup.openai()
    texts = [f"sentence number {i} of the batch" for i in range(8)]
    client.embeddings.create(model="minilm", input=texts)  # counted before top's first reading: figures, not "-"
    stop = threading.Event()

    def embed() -> None:
        while not stop.is_set():
            client.embeddings.create(model="minilm", input=texts)

    def generate() -> None:
        while not stop.is_set():
            list(sup.client.generate(timeout=120, model="gen", prompt="x", max_tokens=200, ignore_eos=True))

    threads = [threading.Thread(target=embed), threading.Thread(target=generate)]
    for thread in threads:
        thread.start()
    try:
        lines = top_once(sup).splitlines()
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    header = next(line for line in lines if line.startswith("MODEL")).split()
    rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0] in ("minilm", "gen")}
    minilm, gen = rows["minilm"], rows["gen"]
    inputs, requests = float(minilm[header.index("IN/S")]), float(minilm[header.index("REQ/S")])
    latency = minilm[header.index("LAT")]
    assert inputs > 0 and requests > 0 and abs(inputs - 8 * requests) <= 1  # counted together, shown rounded
    assert latency.endswith("ms") and 0 < float(latency.removesuffix("ms")) < 10_000
    assert float(gen[header.index("TOK/S")]) > 0
    assert [gen[header.index(column)] for column in ("IN/S", "REQ/S", "LAT")] == ["-", "-", "-"]
