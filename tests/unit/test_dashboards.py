"""The Grafana dashboard and the alert rules ask only for what meshpilot exports.

Every PromQL expression (dashboard panels, variables, annotations, alert rules) is parsed for
metric and label names, which must be among those declared in ``orchestrator/observe/metrics.py``; a
renamed metric fails here instead of leaving an empty panel or an alert that never fires.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from orchestrator.observe.metric_names import exported_labels, exported_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "meshpilot-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "meshpilot-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "tests" / "meshpilot-rules.test.yml"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{?\w+\}?")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "offset",
    "bool",
    "inf",
    "nan",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}


def promql_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, label names) used by a PromQL expression (Grafana variables allowed)."""
    text = _GRAFANA_VARIABLE.sub("1", expr)
    labels: set[str] = set()
    for match in _MATCHERS.finditer(_STRING.sub('""', text)):
        labels.update(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", match.group(1)))
    text = _MATCHERS.sub("", _STRING.sub('""', text))
    text = _RANGE.sub("", text)
    for match in _GROUPING.finditer(text):
        labels.update(name.strip() for name in match.group(2).split(",") if name.strip())
    text = _GROUPING.sub(" ", text)
    metrics = set()
    for match in _IDENTIFIER.finditer(text):
        word, start = match.group(0), match.start()
        if start and (text[start - 1].isdigit() or text[start - 1] == "."):
            continue  # the exponent or unit of a number: 1e9, 5m
        if text[match.end() :].lstrip().startswith("("):
            continue  # a function call
        if word.lower() in _KEYWORDS:
            continue
        metrics.add(word)
    return metrics, labels


def test_the_parser_finds_metrics_and_labels():
    metrics, labels = promql_names(
        "histogram_quantile(0.95, sum by (le, instance) (rate(meshpilot_step_time_seconds_bucket"
        '{job=~"$job", instance=~"a|b"}[$__rate_interval]))) > 1e9 and on(job) '
        'meshpilot_running offset 5m == bool 1 unless label_replace(up, "x", "meshpilot_fake", "", "")'
    )
    assert metrics == {"meshpilot_step_time_seconds_bucket", "meshpilot_running", "up"}
    assert labels == {"le", "instance", "job"}
    assert promql_names("time() - meshpilot_last_step_timestamp_seconds > 600") == (
        {"meshpilot_last_step_timestamp_seconds"},
        set(),
    )


def dashboard_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(where, expression, legend) of every query in the dashboard."""
    queries = []

    def walk(panels):
        for panel in panels:
            for target in panel.get("targets", []):
                queries.append((f"panel {panel['title']!r}", target["expr"], target.get("legendFormat", "")))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            found = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", variable["definition"])
            assert found, f"variable {variable['name']}: expected label_values(METRIC, LABEL)"
            queries.append((f"variable {variable['name']}", found.group(1), "{{" + found.group(2) + "}}"))
    for annotation in dashboard["annotations"]["list"]:
        queries.append((f"annotation {annotation['name']}", annotation["expr"], annotation.get("textFormat", "")))
    return queries


def rule_queries() -> list[tuple[str, str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    queries = []
    for group in rules["groups"]:
        for rule in group["rules"]:
            templates = " ".join(rule.get("annotations", {}).values())
            legend = " ".join("{{" + name + "}}" for name in re.findall(r"\$labels\.(\w+)", templates))
            queries.append((f"alert {rule['alert']}", rule["expr"], legend))
    return queries


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_query_uses_only_exported_metrics_and_labels(source):
    queries = dashboard_queries(json.loads(DASHBOARD.read_text())) if source == "dashboard" else rule_queries()
    assert len(queries) > 5
    known_metrics, known_labels = exported_names(), exported_labels()
    problems = []
    for where, expr, legend in queries:
        metrics, labels = promql_names(expr)
        assert metrics, f"{where}: no metric found in {expr!r}"
        problems += [f"{where}: unknown metric {name}" for name in sorted(metrics - known_metrics)]
        problems += [f"{where}: unknown label {name}" for name in sorted(labels - known_labels)]
        legend_labels = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        problems += [f"{where}: legend uses unknown label {name}" for name in sorted(legend_labels - known_labels)]
    assert problems == []


def test_rule_unit_tests_feed_exported_series():
    tests = yaml.safe_load(RULE_TESTS.read_text())
    names = {
        re.match(r"[A-Za-z_:][A-Za-z0-9_:]*", series["series"]).group(0)
        for test in tests["tests"]
        for series in test["input_series"]
    }
    assert names <= exported_names()
    tested = {case["alertname"] for test in tests["tests"] for case in test["alert_rule_test"]}
    assert tested == {alert.split()[1] for alert, _, _ in rule_queries()}  # every alert has a test


def test_alerts_cover_what_operators_must_hear_about():
    rules = {rule["alert"]: rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert {
        "MeshpilotNoProgress",
        "MeshpilotStraggler",
        "MeshpilotCheckpointFailing",
        "MeshpilotCheckpointTooOld",
        "MeshpilotRepeatedRecoveries",
        "MeshpilotWorldSizeBelowMinimum",
    } <= set(rules)
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in ("critical", "warning", "info"), name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name


def test_dashboard_has_the_panels_and_a_sound_layout():
    dashboard = json.loads(DASHBOARD.read_text())
    panels = dashboard["panels"]
    titles = {panel["title"]: panel for panel in panels}
    for title in (
        "Step",
        "Progress",
        "Throughput",
        "Loss",
        "World size",
        "Mesh degrees",
        "Last committed step",
        "Checkpoint age",
        "Checkpoint stall and upload time",
        "Failures by kind",
        "Recovery time",
        "Effective training time",
        "MFU",
        "Step time per rank",
        "Straggler",
        "Expert load (mixture of experts)",
    ):
        assert title in titles, f"no {title!r} panel"
    assert titles["Step time per rank"]["type"] == "heatmap"
    assert titles["Step time per rank"]["targets"][0]["legendFormat"] == "{{rank}}"
    assert len({panel["id"] for panel in panels}) == len(panels)
    assert dashboard["uid"] == "meshpilot-run" and dashboard["schemaVersion"] >= 36
    cells = set()
    for panel in panels:
        box = panel["gridPos"]
        assert 0 <= box["x"] and box["x"] + box["w"] <= 24, panel["title"]
        for x in range(box["x"], box["x"] + box["w"]):
            for y in range(box["y"], box["y"] + box["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps another panel"
                cells.add((x, y))
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
