"""The docs site's reference pages, generated from the one definition of each thing.

Runs at docs build time, on the machine building the site (no Ray, no ranks): ``mkdocs.yml``
names this file as a hook, and ``on_files`` adds four pages to the build in memory, so they are
never written into ``docs/`` and cannot go stale against the code:

- ``reference/config.md``: every config key, its type and default from the dataclasses in
  ``orchestrator/config.py`` (and the classes they extend), its description from the ``#:``
  comment above the field (Sphinx's attribute-comment form: a reader of config.py sees it next
  to the field; plain ``#`` comments there say why and stay out of the page);
- ``reference/cli.md``: every command and flag from the argparse parsers (``orchestrator.cli``);
- ``reference/metrics.md``: every Prometheus metric from ``orchestrator.observe.metric_names``;
- ``reference/events.md``: every event kind and its fields from ``orchestrator.observe.events``.

It also stands in a one-line ``benchmarks.md`` while ``bench/report.py`` has not written one.
``python -m orchestrator.cli.docs_reference DIR`` writes the pages to DIR, to read them.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Metric and event definitions are plain declarations; the config module imports workers.spec
# (no torch at import) and the CLI parsers import their command modules (a second, no Ray start).
from orchestrator.config import JobConfig, _yaml_key
from orchestrator.observe.events import EVENT_FIELDS, OPTIONAL_FIELDS
from orchestrator.observe.metric_names import METRICS

BENCHMARKS_PAGE = "benchmarks.md"
BENCHMARKS_PLACEHOLDER = (
    "# Benchmarks\n\nNot rendered yet: `make docs` runs `bench/report.py`, which writes this page.\n"
)


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One YAML key of the job config: its dotted path, type, default and description."""

    path: str
    type: str
    default: str
    description: str


# ---------------------------------------------------------------------------- config
def config_keys(cls: type = JobConfig, prefix: str = "") -> list[ConfigKey]:
    """Every key of the job config under ``cls``, sections included, in declaration order."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        path = prefix + _yaml_key(f)
        kind = hints[f.name]
        section = _section_class(kind)
        description = field_description(cls, f.name)
        if section is not None:
            keys.append(ConfigKey(path, "section" if section is kind else "section or null", "", description))
            keys.extend(config_keys(section, path + "."))
            continue
        keys.append(ConfigKey(path, _type_text(kind, f.metadata.get("choices")), _default_text(f), description))
    return keys


def undescribed_keys(cls: type = JobConfig) -> list[str]:
    """Config keys without a ``#:`` description: the reference would show them blank."""
    return [key.path for key in config_keys(cls) if not key.description]


def _section_class(kind: Any) -> type | None:
    members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    sections = [m for m in members if isinstance(m, type) and dataclasses.is_dataclass(m)]
    return sections[0] if sections else None


def field_description(cls: type, name: str) -> str:
    """The ``#:`` comment lines right above ``name``'s declaration in the class (of ``cls``'s
    bases) that declares it, joined; a section's class docstring when its field has none."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return _attribute_comments(klass).get(name, "")
    return ""


@functools.cache
def _attribute_comments(klass: type) -> dict[str, str]:
    lines, first = inspect.getsourcelines(klass)
    source = "".join(lines)
    node = ast.parse(inspect.cleandoc(source) if lines[0][:1].isspace() else source).body[0]
    assert isinstance(node, ast.ClassDef)
    comments = {}
    for statement in node.body:
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        above = []
        index = statement.lineno - 2
        # A block of comments above the field: its ``#:`` lines describe it, plain ``#`` lines say why.
        while index >= 0 and lines[index].lstrip().startswith("#"):
            text = lines[index].strip()
            if text.startswith("#:"):
                above.append(text[2:].strip())
            index -= 1
        comments[statement.target.id] = " ".join(reversed(above))
    return comments


def _type_text(kind: Any, choices: tuple[str, ...] | None) -> str:
    if choices:
        text = " \\| ".join(f"`{choice}`" for choice in choices)
    else:
        members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        text = " or ".join(_member_name(m) for m in members if m is not type(None))
    optional = isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind)
    return text + (" or null" if optional else "")


def _member_name(kind: Any) -> str:
    if typing.get_origin(kind) is dict:
        return "mapping"
    if typing.get_origin(kind) is list:
        return "list of names"
    return {int: "integer", float: "number", str: "string", bool: "bool"}.get(kind, str(kind))


def _default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return ""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, list):
        return "`[" + ", ".join(map(str, value)) + "]`"
    return f"`{value}`" if value != {} else "`{}`"


def config_page() -> str:
    lines = [
        "# Configuration reference",
        "",
        "One YAML file describes a job; every key has a default that trains on a laptop, and every key",
        "can be overridden with `--set dotted.key=value`. Bad values are refused before any worker",
        "starts, all at once, each naming the key, the value and the reason (unknown keys get a",
        '"did you mean"). The resolved config is saved as `RUN_DIR/config.yaml`.',
        "",
        "This page is generated from `orchestrator/config.py` when the site is built.",
        "",
    ]
    sections: dict[str, list[ConfigKey]] = {}
    for key in config_keys():
        sections.setdefault(key.path.split(".")[0] if "." in key.path else "", []).append(key)
    for section, keys in sections.items():
        lines += [f"## `{section}`" if section else "## Top level", ""]
        lines += ["| key | type | default | description |", "| --- | --- | --- | --- |"]
        for key in keys:
            lines.append(f"| `{key.path}` | {key.type} | {key.default} | {_cell(key.description)} |")
        lines.append("")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and ``<name>`` and ``*`` shown as written, not as HTML or emphasis."""
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


# ---------------------------------------------------------------------------- CLI
def cli_commands() -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    """Every command's name (``meshpilot train``, ``meshpilot ckpt ls``, ...), its parser and the
    one-line help its parent lists it with."""
    from orchestrator.cli import build_parser

    yield from _walk(build_parser(), "meshpilot", "")


def _walk(
    parser: argparse.ArgumentParser, name: str, help_text: str
) -> Iterator[tuple[str, argparse.ArgumentParser, str]]:
    if name != "meshpilot":
        yield name, parser, help_text
    for subcommands in arguments(parser):
        if isinstance(subcommands, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in subcommands._choices_actions}
            for sub_name, sub_parser in subcommands.choices.items():
                yield from _walk(sub_parser, f"{name} {sub_name}", helps.get(sub_name, ""))


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments, as ``add_argument`` returned them: argparse keeps them in ``_actions``
    and names no public accessor (sphinx-argparse reads the same list)."""
    return list(parser._actions)


def cli_page() -> str:
    lines = [
        "# Command line reference",
        "",
        "Every `meshpilot` command and flag, generated from the argument parsers in `orchestrator/cli/`",
        "when the site is built. Exit codes: 0 finished, 1 training failed, 2 a mistake in the input",
        "(one line naming the key or flag and the fix), 130 interrupted, 143 terminated.",
        "",
    ]
    for name, parser, help_text in cli_commands():
        lines += [f"## `{name}`", ""]
        summary = parser.description or help_text
        if summary:
            lines += [summary.strip(), ""]
        lines += ["```text", _usage(parser), "```", ""]
        rows = [_flag_row(action) for action in arguments(parser) if _documented(action)]
        if rows:
            lines += ["| argument | default | help |", "| --- | --- | --- |", *rows, ""]
    return "\n".join(lines)


def _usage(parser: argparse.ArgumentParser) -> str:
    """argparse's usage without its ``usage: `` prefix, continuation lines moved left by as much."""
    prefix = "usage: "
    lines = parser.format_usage().strip().splitlines()
    return "\n".join([lines[0].removeprefix(prefix), *(line.removeprefix(" " * len(prefix)) for line in lines[1:])])


def _documented(action: argparse.Action) -> bool:
    """A flag or positional to list: not -h (every command has it) nor the sub-command slot."""
    return (
        action.dest != "help"
        and not isinstance(action, argparse._SubParsersAction)
        and action.help != argparse.SUPPRESS
    )


def _flag_row(action: argparse.Action) -> str:
    names = ", ".join(f"`{option}`" for option in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.option_strings and action.nargs != 0:
        names += f" `{action.metavar or action.dest.upper()}`"
    default = action.default
    shown = "" if default in (None, argparse.SUPPRESS, False, []) or action.nargs == 0 else f"`{default}`"
    help_text = (action.help or "").replace("%(default)s", str(default)).replace("%%", "%")
    if action.choices and not isinstance(action, argparse._SubParsersAction):
        help_text += " (one of: " + ", ".join(f"`{choice}`" for choice in action.choices) + ")"
    return f"| {names} | {shown} | {_cell(' '.join(help_text.split()))} |"


# ---------------------------------------------------------------------------- metrics, events
def metrics_page() -> str:
    lines = [
        "# Metrics reference",
        "",
        "Every Prometheus metric the driver serves on `/metrics`, generated from",
        "`orchestrator/observe/metric_names.py` when the site is built. Counters are exported with",
        "`_total` (and `_created`); histograms with `_bucket`, `_sum` and `_count`.",
        "",
        "| metric | kind | labels | help |",
        "| --- | --- | --- | --- |",
    ]
    for spec in METRICS.values():
        name = f"{spec.name}_total" if spec.kind == "counter" else spec.name
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        lines.append(f"| `{name}` | {spec.kind} | {labels} | {_cell(spec.help)} |")
    return "\n".join(lines) + "\n"


def event_comments() -> dict[str, dict[str, str]]:
    """The comment lines above each entry of ``EVENT_FIELDS`` and ``OPTIONAL_FIELDS``, by table and event."""
    from orchestrator.observe import events

    source = inspect.getsource(events)
    lines = source.splitlines()
    found: dict[str, dict[str, str]] = {}
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if node.target.id not in ("EVENT_FIELDS", "OPTIONAL_FIELDS") or not isinstance(node.value, ast.Dict):
            continue
        table = found.setdefault(node.target.id, {})
        for key in node.value.keys:
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                continue
            above = []
            index = key.lineno - 2
            while index >= 0 and lines[index].lstrip().startswith("#"):
                above.append(lines[index].strip().lstrip("#").strip())
                index -= 1
            table[key.value] = " ".join(reversed(above))
    return found


def events_page() -> str:
    comments = event_comments()
    lines = [
        "# Events reference",
        "",
        "Every event kind the driver writes to `RUN_DIR/events.jsonl` (one JSON object a line) and hands",
        "to the metrics, the console and `meshpilot report`, generated from",
        "`orchestrator/observe/events.py` when the site is built. Every event also has `event` (its",
        "kind) and `time` (unix seconds). Required fields are always there (possibly null); optional",
        "ones may be absent (older runs). Fields are added, never renamed or dropped.",
        "",
    ]
    for name, required in EVENT_FIELDS.items():
        lines += [f"## `{name}`", ""]
        if comments.get("EVENT_FIELDS", {}).get(name):
            lines += [comments["EVENT_FIELDS"][name], ""]
        lines.append("Required: " + ", ".join(f"`{field}`" for field in required) + ".")
        if name in OPTIONAL_FIELDS:
            lines += ["", "Optional: " + ", ".join(f"`{field}`" for field in OPTIONAL_FIELDS[name]) + "."]
            if comments.get("OPTIONAL_FIELDS", {}).get(name):
                lines += ["", comments["OPTIONAL_FIELDS"][name]]
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- the build
def pages() -> dict[str, str]:
    """The generated pages by their path under ``docs/``."""
    return {
        "reference/config.md": config_page(),
        "reference/cli.md": cli_page(),
        "reference/metrics.md": metrics_page(),
        "reference/events.md": events_page(),
    }


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages (and a stand-in benchmarks page) to the build."""
    from mkdocs.structure.files import File

    generated = pages()
    if files.get_file_from_path(BENCHMARKS_PAGE) is None:
        generated[BENCHMARKS_PAGE] = BENCHMARKS_PLACEHOLDER
    for path, content in generated.items():
        files.append(File.generated(config, path, content=content))
    return files


def main(argv: list[str] | None = None) -> int:
    out = Path((argv if argv is not None else sys.argv[1:])[0])
    for path, content in pages().items():
        (out / path).parent.mkdir(parents=True, exist_ok=True)
        (out / path).write_text(content, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
