"""The benchmarks page from the recorded runs: docs/benchmarks.md and a history page per benchmark.

    python bench/report.py                       # bench/results/*.jsonl -> docs/benchmarks.md, docs/benchmarks/
    python bench/report.py --results DIR --out PAGE

Runs wherever the docs are built (``make docs`` runs it before ``mkdocs build``); it reads files
only. Every benchmark appends one line per run to ``bench/results/<bench>.jsonl`` (``bench/common.py``
``record_run``); ``bench/goals.py`` says which figures go in the table and their goals. The page has
one row per goal: the newest run that measured the figure, the goal, met or missed, the command,
the run's date, commit and machine, and a link to ``<page dir>/<page name>/<bench>.md``, which lists
every recorded run of that benchmark with the same figures. Lines marked ``"source": "README"``
were copied from the README's benchmark table when recording began, not re-run by the recorder.
The page links ``<page dir>/learned.md`` when it exists: the diagnoses behind the
figures, written by hand (this script never writes or removes it).
The output depends on the recorded lines only (no render time in it), so re-running without new
runs changes nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, RESULTS_DIR  # noqa: E402
from bench.goals import GOALS, Goal  # noqa: E402

DEFAULT_PAGE = REPO / "docs" / "benchmarks.md"
# Written by hand beside the history pages: the diagnoses behind the figures, linked when present.
LEARNED = "learned.md"
Run = dict[str, Any]


class ResultsError(Exception):
    """A results file the report cannot read; the message names the file, the line and the fix."""


def load_runs(results_dir: Path) -> dict[str, list[Run]]:
    """Every recorded run, by benchmark, in the order they were appended (oldest first)."""
    runs: dict[str, list[Run]] = {}
    for path in sorted(results_dir.glob("*.jsonl")):
        bench_runs = runs.setdefault(path.stem, [])
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                run = json.loads(line)
            except ValueError as error:
                raise ResultsError(f"{path}:{number} is not JSON ({error}); remove or repair that line") from None
            if not isinstance(run, dict) or not isinstance(run.get("result"), dict):
                raise ResultsError(
                    f'{path}:{number} has no "result" object (a line per run as bench/common.py writes it); '
                    "remove or repair that line"
                )
            bench_runs.append(run)
    return runs


def lookup(result: dict[str, Any], key: str) -> Any:
    """The value at dotted ``key`` in ``result``; None where any part is missing."""
    value: Any = result
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def is_quick(run: Run) -> bool:
    return "--quick" in str(run.get("command", "")).split()


def latest(goal: Goal, runs: Sequence[Run]) -> tuple[Any, Run] | None:
    """The newest run of ``goal``'s benchmark, as quick as its command, that measured the figure."""
    for run in reversed(runs):
        value = lookup(run["result"], goal.key)
        if value is not None and is_quick(run) == goal.quick:
            return value, run
    return None


def met(goal: Goal, value: Any) -> bool | None:
    """Whether ``value`` meets ``goal``; None when it is not a figure the goal can judge."""
    if goal.unit == "bool":
        return value is goal.goal if isinstance(value, bool) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if goal.op == "<=":
        return value <= goal.goal
    if goal.op == ">=":
        return value >= goal.goal
    return value == goal.goal


def figure(value: Any, unit: str) -> str:
    if isinstance(value, bool) or unit == "bool":
        return "yes" if value else "no"
    if not isinstance(value, (int, float)):
        return cell(str(value))
    if unit == "s":
        return f"{trimmed(value, 2)} s"
    if unit == "x":
        return f"{trimmed(value, 3)}x"
    if unit == "%":
        return f"{trimmed(value * 100, 2)}%"
    return f"{value:g}"


def trimmed(value: float, decimals: int) -> str:
    """``value`` to ``decimals`` places without trailing zeros: 1.001, 1.04, 2 (not 2.000)."""
    return f"{value:.{decimals}f}".rstrip("0").rstrip(".")


def goal_text(goal: Goal) -> str:
    op = {"<=": "≤", ">=": "≥", "==": "="}[goal.op]
    return f"{op} {figure(goal.goal, goal.unit)}" + (f" ({goal.note})" if goal.note else "")


def verdict(judged: bool | None) -> str:
    return {True: "met", False: "**missed**", None: "-"}[judged]


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def code(text: str) -> str:
    return f"`{cell(text)}`"


def provenance(run: Run) -> str:
    """When, at which commit, on what: '2026-11-29, `00f871d`, 2-core CPU (from the README)'."""
    machine = run.get("machine") or {}
    parts = [str(run.get("recorded_at", "?"))[:10], code(str(run.get("commit", "unknown")))]
    parts.append(cell(str(machine.get("description", "unknown machine"))))
    text = ", ".join(parts)
    return text + (" (from the README)" if run.get("source") == "README" else "")


def benches(runs: dict[str, list[Run]]) -> list[str]:
    """Every benchmark with a goal or a recorded run: goals' order first, then the others by name."""
    ordered = list(dict.fromkeys(goal.bench for goal in GOALS))
    return ordered + sorted(set(runs) - set(ordered))


def render_page(runs: dict[str, list[Run]], history_dir: str, *, learned: bool = False) -> str:
    """The table; ``learned``: link the hand-written diagnoses page ``learned.md`` beside it."""
    lines = [
        "# Benchmarks",
        "",
        "Every benchmark in `bench/` measures meshpilot and its reference side by side in one run and",
        "appends the result, with the command, date (UTC), git commit and machine, to",
        "`bench/results/<benchmark>.jsonl` (`--no-record` leaves it out). This page is generated from",
        "those files by `python bench/report.py`: each row is a figure with a goal, its newest",
        "measurement and whether it meets the goal; *history* lists every recorded run. Runs marked",
        '"from the README" were copied from the README\'s table when recording began, not re-run.',
        "`bench/results/latest.json` is apart from these: the figures `meshpilot simulate` reads, which",
        "`bench/recovery.py` also writes.",
        "",
    ]
    if learned:
        lines += [f"Why figures are what they are: [what we learned]({LEARNED}).", ""]
    lines += [
        "| benchmark | figure | latest | goal | met | command | measured | history |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for goal in GOALS:
        found = latest(goal, runs.get(goal.bench, []))
        history = f"[history]({history_dir}/{goal.bench}.md)"
        if found is None:
            lines.append(
                f"| {goal.bench} | {cell(goal.figure)} | not measured yet | {cell(goal_text(goal))} | - "
                f"| {code(goal.command)} | - | {history} |"
            )
            continue
        value, run = found
        lines.append(
            f"| {goal.bench} | {cell(goal.figure)} | {figure(value, goal.unit)} | {cell(goal_text(goal))} "
            f"| {verdict(met(goal, value))} | {code(str(run.get('command', goal.command)))} | {provenance(run)} "
            f"| {history} |"
        )
    others = [bench for bench in benches(runs) if bench not in {goal.bench for goal in GOALS}]
    if others:
        lines += ["", "Recorded, without a goal in `bench/goals.py`:", ""]
        lines += [f"- [{bench}]({history_dir}/{bench}.md): {len(runs[bench])} runs" for bench in others]
    return "\n".join(lines) + "\n"


def render_history(bench: str, runs: Sequence[Run], page_name: str) -> str:
    goals = [goal for goal in GOALS if goal.bench == bench]
    lines = [
        f"# bench/{bench}.py: every recorded run",
        "",
        f"From `bench/results/{bench}.jsonl`, newest first; generated by `python bench/report.py`. "
        f"Back to [the benchmarks]({page_name}).",
        "",
    ]
    if not runs:
        return "\n".join([*lines, "No run recorded yet.", ""])
    header = ["date", "commit", "machine", "command", *(cell(goal.figure) for goal in goals), "note"]
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for run in reversed(runs):
        machine = run.get("machine") or {}
        row = [
            str(run.get("recorded_at", "?"))[:10],
            code(str(run.get("commit", "unknown"))),
            cell(str(machine.get("description", "unknown machine"))),
            code(str(run.get("command", "?"))),
        ]
        for goal in goals:
            value = lookup(run["result"], goal.key)
            row.append("" if value is None else figure(value, goal.unit))
        note = str(run.get("note", ""))
        row.append(cell(("(from the README) " if run.get("source") == "README" else "") + note).strip())
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def write(results_dir: Path, page: Path) -> list[Path]:
    """Render the page and one history page per benchmark; returns the files written."""
    runs = load_runs(results_dir)
    history_dir = page.parent / page.stem
    history_dir.mkdir(parents=True, exist_ok=True)
    written = [page]
    learned = (page.parent / LEARNED).is_file()
    page.write_text(render_page(runs, page.stem, learned=learned), encoding="utf-8")
    for bench in benches(runs):
        path = history_dir / f"{bench}.md"
        path.write_text(render_history(bench, runs.get(bench, []), f"../{page.name}"), encoding="utf-8")
        written.append(path)
    return written


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="the .jsonl files (bench/results)")
    parser.add_argument("--out", type=Path, default=DEFAULT_PAGE, help="the page (docs/benchmarks.md)")
    args = parser.parse_args(None if argv is None else list(argv))
    if not args.results.is_dir():
        print(f"bench/report.py: --results {args.results} is not a directory; pass bench/results", file=sys.stderr)
        return 2
    try:
        written = write(args.results, args.out)
    except ResultsError as error:
        print(f"bench/report.py: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} and {len(written) - 1} history pages in {args.out.parent / args.out.stem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
