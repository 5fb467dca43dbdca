"""The docs site's generated reference pages: every config key, command, flag, metric and event
is on its page, and a config key without a ``#:`` description fails here, naming the key.

python -m pytest tests/unit/test_docs_reference.py -q
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from orchestrator.cli import docs_reference
from orchestrator.observe.events import EVENT_FIELDS, OPTIONAL_FIELDS
from orchestrator.observe.metric_names import METRICS
from tests.jobs import REPO


def test_every_config_key_has_a_description() -> None:
    missing = docs_reference.undescribed_keys()
    assert missing == [], (
        f"config keys without a description: {', '.join(missing)}; "
        "add a '#: what it does' comment line right above each field (orchestrator/config.py)"
    )


@dataclasses.dataclass
class _Section:
    #: Described.
    described: int = 1
    # A plain comment says why; it is not a description.
    undescribed: str = "x"


@dataclasses.dataclass
class _Job:
    #: A section.
    section: _Section = dataclasses.field(default_factory=_Section)


def test_a_key_without_a_description_is_named() -> None:
    assert docs_reference.undescribed_keys(_Job) == ["section.undescribed"]


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs_reference.pages()


def test_config_page_lists_every_key_with_its_type_and_default(pages) -> None:
    page = pages["reference/config.md"]
    keys = docs_reference.config_keys()
    for key in keys:
        assert f"| `{key.path}` |" in page, key.path
    # YAML names (async, not async_), choices, and defaults as YAML writes them.
    assert "| `checkpoint.async` | bool | `true` |" in page
    assert "| `parallelism.pp_schedule` | `gpipe` \\| `1f1b`" in page
    assert "| `model.lora.target_modules` | list of names | `[q_proj, k_proj, v_proj, o_proj]` |" in page
    assert "| `elastic.straggler.factor` | number | `2.0` |" in page
    # Inherited from OptimizerSpec / EvalSpec, described where they are declared.
    assert re.search(r"\| `training.grad_clip` \| number \| `1.0` \| Clip the global gradient norm", page)
    assert re.search(r"\| `eval.at_start` \| bool \| `false` \| Also evaluate", page)
    # A plain comment above a field (its why) stays out of the page.
    assert "a hang declared there failed a run" not in page


def test_cli_page_lists_every_command_and_flag(pages) -> None:
    page = pages["reference/cli.md"]
    commands = {name: parser for name, parser, _ in docs_reference.cli_commands()}
    assert {"meshpilot train", "meshpilot ckpt export", "meshpilot data prepare", "meshpilot simulate"} <= set(commands)
    sections = dict(re.findall(r"## `(meshpilot [\w ]+)`\n\n(.*?)(?=\n## |\Z)", page, flags=re.S))
    assert set(sections) == set(commands)
    for name, parser in commands.items():
        for action in docs_reference.arguments(parser):
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in sections[name], f"{name} {option}"
    # A sub-command without a description of its own is listed with its parent's help line.
    assert sections["meshpilot jobs stop"].split("\n")[0].strip()


def test_metrics_page_lists_every_metric(pages) -> None:
    page = pages["reference/metrics.md"]
    for spec in METRICS.values():
        exported = f"{spec.name}_total" if spec.kind == "counter" else spec.name
        assert f"| `{exported}` | {spec.kind} |" in page
    assert "| `meshpilot_failures_total` | counter | `kind` | Failures detected, by kind. |" in page


def test_events_page_lists_every_event_and_field(pages) -> None:
    page = pages["reference/events.md"]
    sections = dict(re.findall(r"## `(\w+)`\n\n(.*?)(?=\n## |\Z)", page, flags=re.S))
    assert set(sections) == set(EVENT_FIELDS)
    for name, fields in EVENT_FIELDS.items():
        for field in (*fields, *OPTIONAL_FIELDS.get(name, ())):
            assert f"`{field}`" in sections[name], f"{name}.{field}"
    # The comment above a declaration is the event's description.
    assert "the mean token loss over" in sections["eval"]


def test_the_build_gets_the_generated_pages_and_a_benchmarks_page_until_one_is_rendered() -> None:
    from mkdocs.config import load_config
    from mkdocs.structure.files import Files

    config = load_config(str(REPO / "mkdocs.yml"))
    # As the build calls it: mkdocs.yml's hooks: entry runs as a plugin of the build.
    files = config.plugins.on_files(Files([]), config=config)
    for path in docs_reference.pages():
        assert files.get_file_from_path(path) is not None, path
    # Without docs/benchmarks.md (bench/report.py writes it), a stand-in keeps the nav whole.
    benchmarks = files.get_file_from_path("benchmarks.md")
    assert benchmarks is not None and benchmarks.content_string.startswith("# Benchmarks")
