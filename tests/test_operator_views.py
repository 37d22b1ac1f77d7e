"""What an operator looks at: the Grafana dashboard (deploy/grafana/mlxserve.json) queries only metrics the
supervisor exports, and ``python -m supervisor top --once`` shows every model with its state and its rate."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path

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
    assert not sorted(queried - names), f"queried but not exported: {sorted(queried - names)}"


def test_top_once_shows_every_model_its_state_and_the_rate_of_a_running_one(chat_supervisor):
    sup = chat_supervisor
    states = {m.name: m.state for m in sup.client.list_models().models}
    running = threading.Thread(
        target=lambda: list(sup.client.generate(timeout=120, model="pair", prompt="x", max_tokens=600, ignore_eos=True))
    )
    running.start()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "supervisor", "top", "--once", "--address", f"127.0.0.1:{sup.port}"]
            + ["--token", sup.token],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        running.join(120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    header = next(line for line in lines if line.startswith("MODEL"))
    rows = {line.split()[0]: line for line in lines if line.split() and line.split()[0] in states}
    assert set(rows) == set(states)
    from supervisor.client import STATE_NAMES

    for name, state in states.items():
        assert rows[name].split()[1] == STATE_NAMES[state]
    rate = rows["pair"].split()[header.split().index("TOK/S")]  # no cell before it holds a space
    assert float(rate) > 0  # generating while top looked
