"""Logs a person reads and a collector parses: one record per event, one timestamp, the model and pid as fields."""

import json
import logging
import re

from common.logs import JsonFormatter, TextFormatter, record_from_json

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d")


def runner_line(message: str, level: str = "INFO", **extra) -> str:
    record = logging.LogRecord("runner", getattr(logging, level), "", 0, message, None, None)
    record.process_name, record.model, record.pid = "runner", "default", 2971
    record.created = 1796383492.579
    for key, value in extra.items():
        setattr(record, key, value)
    return JsonFormatter().format(record)


def test_a_runner_record_reaches_the_supervisors_log_as_one_record_with_its_own_time():
    line = runner_line("listening on unix:///tmp/x.sock")
    record = record_from_json(line, "default", 2971)
    text = TextFormatter().format(record)
    assert "\n" not in text and len(TIMESTAMP.findall(text)) == 1
    assert text.endswith("INFO runner[default:2971] listening on unix:///tmp/x.sock")
    assert abs(record.created - 1796383492.579) < 1e-3  # the runner's time, not the time it was read
    entry = json.loads(JsonFormatter().format(record))
    assert entry["model"] == "default" and entry["pid"] == 2971 and entry["process"] == "runner"
    assert entry["message"] == "listening on unix:///tmp/x.sock" and entry["level"] == "INFO"


def test_a_runners_traceback_stays_in_its_record():
    line = runner_line("engine failure", "ERROR", exception="Traceback (most recent call last):\n  boom")
    record = record_from_json(line, "m", 7)
    assert record.levelno == logging.ERROR and record.getMessage() == "engine failure"
    assert (
        TextFormatter()
        .format(record)
        .endswith("ERROR runner[m:7] engine failure\nTraceback (most recent call last):\n  boom")
    )
    assert json.loads(JsonFormatter().format(record))["exception"].endswith("boom")


def test_a_line_that_is_not_a_record_is_kept_as_a_warning_of_its_runner():
    record = record_from_json("runner: cannot load model from /x: no config.json", "m", 7)
    assert record.levelno == logging.WARNING and record.model == "m" and record.pid == 7
    assert (
        TextFormatter().format(record).endswith("WARNING runner[m:7] runner: cannot load model from /x: no config.json")
    )
