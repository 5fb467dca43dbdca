"""Benchmark results as a user reads them: every run appended to bench/results/<bench>.jsonl (old
lines kept, nothing written with --no-record), and bench/report.py's page: the newest figure per
goal, met or missed, and history links that resolve."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench import report
from bench.common import RESULTS_DIR, record_run
from bench.goals import GOALS
from tests.jobs import REPO

# A benchmark's start as its script sees it: argv as given, then `from bench.common import emit`,
# then its figures emitted last.
FAKE_BENCH = """
import sys
sys.argv = [{script!r}, *{arguments!r}]
from bench.common import emit
print("argv seen by the script's parser:", sys.argv[1:])
emit({{"benchmark": "release", "stuck_ranks": {{"ours": 3}}}})
"""


def run_fake_bench(results: Path, *arguments: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if not key.startswith("MESHPILOT_BENCH_")}
    env.update(MESHPILOT_BENCH_RESULTS=str(results), PYTHONPATH=str(REPO))
    code = FAKE_BENCH.format(script=str(REPO / "bench" / "release.py"), arguments=list(arguments))
    process = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert process.returncode == 0, process.stderr
    return process


def test_a_bench_run_is_appended_with_its_command_and_no_record_writes_nothing(tmp_path):
    skipped = run_fake_bench(tmp_path, "--no-record", "--seed", "1")
    assert "argv seen by the script's parser: ['--seed', '1']" in skipped.stdout
    assert json.loads(skipped.stdout.splitlines()[-1])["stuck_ranks"] == {"ours": 3}
    assert list(tmp_path.iterdir()) == []

    run_fake_bench(tmp_path, "--seed", "1")
    (line,) = (tmp_path / "release.jsonl").read_text().splitlines()
    recorded = json.loads(line)
    assert recorded["command"] == "python bench/release.py --seed 1"
    assert recorded["result"]["stuck_ranks"] == {"ours": 3}
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", recorded["recorded_at"])
    assert re.fullmatch(r"[0-9a-f]{7,}(\+dirty)?|unknown", recorded["commit"])
    assert recorded["machine"]["cores"] == os.cpu_count()
    assert "description" in recorded["machine"] and "hostname" not in json.dumps(recorded["machine"])


def test_appending_keeps_every_earlier_line_byte_for_byte(tmp_path):
    path = tmp_path / "recovery.jsonl"
    path.write_text('{"hand": "edited", "result": {}}\n')
    before = path.read_bytes()
    for value in (1.5, 0.9):
        record_run({"kill": {"ours_s": value}}, bench="recovery", argv=["bench/recovery.py"], results_dir=tmp_path)
    assert path.read_bytes().startswith(before)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["result"] for line in lines[1:]] == [{"kill": {"ours_s": 1.5}}, {"kill": {"ours_s": 0.9}}]


def page_rows(page: str) -> dict[str, list[str]]:
    """The table's rows by figure: [benchmark, figure, latest, goal, met, command, measured, history]."""
    rows = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in page.splitlines()]
    return {row[1]: row for row in rows if len(row) == 8 and row[0] != "benchmark" and row[0] != "---"}


def test_the_page_shows_the_newest_figure_per_goal_met_or_missed_with_history_links(tmp_path):
    results = tmp_path / "results"
    argv = ["bench/recovery.py"]
    record_run({"kill": {"ours_s": 4.2}, "node": {"ours_s": 7.0}}, bench="recovery", argv=argv, results_dir=results)
    record_run({"kill": {"ours_s": 0.9}}, bench="recovery", argv=argv, results_dir=results)
    # A smoke run afterwards does not replace a full run's figure.
    record_run({"kill": {"ours_s": 9.9}}, bench="recovery", argv=[*argv, "--quick"], results_dir=results)
    (results / "adoption.jsonl").write_text(json.dumps({"command": "python bench/adoption.py", "result": {}}) + "\n")
    page = tmp_path / "docs" / "benchmarks.md"
    (page.parent / "benchmarks").mkdir(parents=True)
    (page.parent / "learned.md").write_text("# What we learned\n")
    assert report.main(["--results", str(results), "--out", str(page)]) == 0

    rows = page_rows(page.read_text())
    kill = rows["SIGKILL of a rank: fault to first step"]
    assert kill[2:5] == ["0.9 s", "≤ 3 s", "met"] and kill[5] == "`python bench/recovery.py`"
    assert rows["node removed: fault to first step"][2:5] == ["7 s", "≤ 5 s", "**missed**"]
    assert rows["drain notice: pause, step to step"][2] == "not measured yet"
    assert len(rows) == len(GOALS)
    links = re.findall(r"\]\(([^)]+)\)", page.read_text())
    assert "benchmarks/adoption.md" in links  # recorded without a goal: listed with its history
    assert "learned.md" in links  # the hand-written diagnoses, kept and linked
    for link in links:
        assert (page.parent / link).is_file(), link
    history = (page.parent / "benchmarks" / "recovery.md").read_text()
    assert [line.count("`python bench/recovery.py") for line in history.splitlines() if "9.9 s" in line] == [1]
    figures = [cell for line in history.splitlines() for cell in ("9.9 s", "0.9 s", "4.2 s") if cell in line]
    assert figures == ["9.9 s", "0.9 s", "4.2 s"]  # newest first
    assert "](../benchmarks.md)" in history


def test_a_broken_results_line_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text('{"result": {}}\nnot json\n')
    assert report.main(["--results", str(tmp_path), "--out", str(tmp_path / "page.md")]) == 2
    (message,) = capsys.readouterr().err.splitlines()
    assert message.startswith(f"bench/report.py: {tmp_path / 'data.jsonl'}:2 is not JSON")


def test_the_recorded_results_give_every_goal_a_figure():
    page = report.render_page(report.load_runs(RESULTS_DIR), "benchmarks")
    missing = [row[1] for row in page_rows(page).values() if row[2] == "not measured yet"]
    assert missing == []
