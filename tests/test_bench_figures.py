"""The benchmarks draw their figures: a short run of the release rule's writes a PNG with both runs."""

from __future__ import annotations

from bench import release_rule

PNG = b"\x89PNG\r\n\x1a\n"


def test_a_short_release_rule_run_writes_its_figure_and_table(tmp_path, capsys):
    path = tmp_path / "release_rule.png"
    release_rule.run(tokens=300, path=path)
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000  # a drawn figure, not an empty canvas
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| o")}
    assert set(rows) == {"on", "off"}
    assert int(rows["on"].split("|")[2]) >= 1  # the rule released at the 256-token boundary
    assert int(rows["off"].split("|")[2]) == 0


def test_a_line_figure_has_a_panel_per_measure(tmp_path):
    from bench.figures import line_figure

    path = line_figure(
        tmp_path / "batching.png",
        "Batching",
        [
            {"title": "throughput", "x": "clients", "y": "tok/s", "series": [("on", [1, 2, 4], [100, 190, 350])]},
            {"title": "p95", "x": "clients", "y": "s", "series": [("off", [1, 2, 4], [0.1, 0.5, 2.0])], "log_y": True},
        ],
    )
    import matplotlib.image

    height, width = matplotlib.image.imread(path).shape[:2]
    assert width > 1.8 * height  # two panels side by side


def test_the_speculation_figure_has_a_panel_per_model_and_prompt_kind(tmp_path, monkeypatch):
    import matplotlib.image

    from bench import figures, speculation
    from bench.speculation import Tally

    def kinds(rate: float) -> dict:
        return {
            "prose": Tally(generated=int(rate), seconds=1.0),
            "input-grounded": Tally(generated=int(rate), seconds=1.0),
        }

    results = {
        "ours, plain": kinds(100),
        "mlx-lm generate_step": kinds(110),
        **{f"ours, draft model, k = {k}": kinds(100 + 10 * k) for k in (1, 2, 4)},
        **{f"mlx-lm speculative_generate_step, k = {k}": kinds(105 + 10 * k) for k in (1, 2, 4)},
        "ours, draft model, adaptive (default)": kinds(135),
    }
    monkeypatch.setattr(figures, "FIGURES", tmp_path)
    path = speculation.speed_up_figure({"default pair": results, "SmolLM2-135M": results}, "speculation.png")
    height, width = matplotlib.image.imread(path).shape[:2]
    assert height > 800 and 1.0 < width / height < 1.5  # four panels, two by two: two models x two prompt kinds
