"""The bench report from hand-made results: the JSON carries every number the table shows, the
table writes ranges as low–high and failed configurations as FAILED with their reason, the
figure is a real PNG; with one configuration, and with every one failed."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from matplotlib.image import imread

from omni_dp.bench.report import from_json, print_report, render_png, to_json
from omni_dp.bench.scaling import compared_level, premise_text, scaling, scaling_range

from support.bench_results import bench, config, failed, single, two_mps, typical


class Terminal(io.StringIO):
    """A stream that says it is a terminal, as a person's shell is."""

    def isatty(self) -> bool:
        return True


def table_text(result, fmt: str = "table", stream: io.StringIO | None = None) -> str:
    stream = stream if stream is not None else io.StringIO()  # a pipe: not a terminal
    print_report(result, fmt, stream)
    return stream.getvalue()


def test_scaling_is_each_configuration_at_its_own_saturation():
    result = typical()
    # 2mps at its saturation c=64 (72 median) over 1 at its own c=96 (40 median)
    assert result.scaling == {"2mps": pytest.approx(1.8)}
    r = scaling_range(result.configs)["2mps"]
    assert (r.low, r.median, r.high) == pytest.approx((70 / 41, 72 / 40, 74 / 39))
    assert result.premise.startswith("each configuration at its own saturating concurrency: "
                                     "1 at c=96; 2mps at c=64 (32 per replica); no ratio for "
                                     "3mps (failed)")


def test_a_sweep_that_never_saturated_is_taken_at_its_highest_and_said_so():
    climbing = config("2mps", {16: [30.0], 32: [50.0], 64: [70.0]}, replicas=2, mps=True)
    assert compared_level(climbing).concurrency == 64
    assert scaling([single(), climbing]) == {"2mps": pytest.approx(70 / 40)}
    assert "2mps at c=64 (32 per replica), not saturated" in premise_text([single(), climbing])
    # a sweep stopped by a bound at its first level (failures, p99) is not compared at all
    broke = replace(climbing, stop_reason="60% of the requests at concurrency 16 failed")
    assert compared_level(broke) is None and "2mps" not in scaling([single(), broke])


def test_the_json_parses_and_carries_the_numbers_of_the_table():
    result = typical()
    data = json.loads(json.dumps(to_json(result), allow_nan=False))
    assert data["schema"] == 1 and data["workload"] == result.workload
    one, two, three = data["configs"]
    level = next(lv for lv in two["levels"] if lv["concurrency"] == 64)
    assert level["requests_per_s"] == {"low": 70.0, "median": 72.0, "high": 74.0}
    assert level["audio_s_per_s"]["median"] == 144.0
    assert level["failures"] == {"http 503": 5, "timeout": 1} and level["requests"] == 6486
    assert level["latency_p99_s"]["median"] == pytest.approx(64 / 72 * 1.5)
    assert two["compared_at"] == 64 and two["saturated"] and two["saturation"] == 64
    assert two["balance"] == {"0": 0.5, "1": 0.5}
    assert one["compared_at"] == 96 and one["balance"] == {"0": 1.0}
    assert three["status"] == "failed" and three["reason"].startswith("launch failed: GPU")
    assert three["levels"] == [] and three["compared_at"] is None
    assert data["scaling"] == {"2mps": pytest.approx(1.8)}
    assert data["scaling_range"]["2mps"]["low"] == pytest.approx(70 / 41)
    assert data["premise"] == result.premise
    assert data["machine"]["gpu"]["name"] == "NVIDIA H200"


def test_the_json_reads_back_to_the_same_results():
    result = typical()
    assert from_json(json.loads(json.dumps(to_json(result)))) == result


def test_the_table_shows_ranges_failures_and_the_failed_configuration():
    text = table_text(typical())
    assert "72.0 [70.0–74.0]" in text  # req/s of 2mps at c=64: median [low–high]
    assert "144 [140–148]" in text  # its audio-s/s
    assert "6/6486 (http 503: 5, timeout: 1)" in text  # failed of sent, by kind
    assert "0: 50% / 1: 50%" in text and "◀ saturation" in text
    assert "median req/s rose < 5% from c=64" in text  # the stop reason
    assert "host-bound: replica CPU 0.98" in text  # the verdict
    assert "FAILED" in text and "launch failed: GPU memory: 3 ×" in text
    assert "1.80×" in text and "1.71–1.90×" in text  # the ratio and its range
    assert "premise: each configuration at its own saturating concurrency" in text
    assert "NVIDIA H200 141 GiB" in text and "trials 3" in text


def test_to_a_pipe_every_row_is_one_line_however_long():
    """A file or CI log gets fixed-width columns: no cell wrapped over lines (rich squeezed
    every table to 80 columns there, five lines to a cell)."""
    text = table_text(typical())
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("config  c "))
    assert "◀ compared (not saturated)" in text or "◀ saturation" in text
    for cell in ("median req/s rose < 5% from c=64", "6/6486 (http 503: 5, timeout: 1)",
                 "host-bound: replica CPU 0.98"):
        assert any(cell in line for line in lines), cell  # whole, on one line
    assert len(header) > 80 and "│" not in text  # as wide as it is, no box drawing
    level_rows = [line for line in lines if line.startswith("2mps ")]
    assert len(level_rows) == len(typical().configs[1].levels) + 2  # + its config, its ratio


def test_on_a_terminal_rich_folds_at_its_width_and_markdown_is_a_table():
    terminal = table_text(typical(), stream=Terminal())
    assert "┃" in terminal or "│" in terminal  # rich's table, at the terminal's width
    md = table_text(typical(), "markdown")
    assert "| config | replicas | MPS | status |" in md and "|---|" in md
    assert "| 2mps | 64 | 3 | 72.0 [70.0–74.0] |" in md
    assert "**scaling against configuration 1**" in md


def test_text_in_brackets_is_shown_not_read_as_markup():
    odd = failed("2mps", "[bold]launch[/bold] failed: [red]x", replicas=2, mps=True)
    text = table_text(bench(single(), odd))
    assert "[bold]launch[/bold] failed: [red]x" in text


def _image(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 400 and image.shape[1] > 1000
    assert image.std() > 0.01  # something was drawn
    return image


def test_the_png_is_a_real_image(tmp_path):
    path = render_png(typical(), tmp_path / "bench.png")
    _image(path)


def test_one_configuration_only(tmp_path):
    result = bench(single())
    assert result.scaling == {}
    text = table_text(result)
    assert "1 (baseline)" in text and "40.0 [39.0–41.0]" in text
    _image(render_png(result, tmp_path / "one.png"))


def test_every_configuration_failed(tmp_path):
    result = bench(failed("1", "launch failed: no free port"),
                   failed("2mps", "MPS attachment did not verify", replicas=2, mps=True))
    assert result.scaling == {}
    assert "no ratio: configuration 1 (the single replica) has no result" in result.premise
    text = table_text(result)
    assert text.count("FAILED") >= 4  # in the configurations, levels and scaling tables
    assert "MPS attachment did not verify" in text
    data = json.loads(json.dumps(to_json(result)))
    assert [c["status"] for c in data["configs"]] == ["failed", "failed"]
    _image(render_png(result, tmp_path / "failed.png"))


def test_a_baseline_that_failed_leaves_the_others_shown_without_a_ratio(tmp_path):
    result = bench(failed("1", "launch failed"), two_mps())
    assert result.scaling == {}
    text = table_text(result)
    assert "— (no baseline)" in text and "72.0 [70.0–74.0]" in text
    _image(render_png(result, tmp_path / "nobase.png"))
