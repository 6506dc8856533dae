"""`flowc --help`: every command listed with its whole one-line purpose, and the two inputs
(ONNX models, .flow DSL programs) named; the package layout behind the command."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import click
from conftest import REPO

from flowc.cli import cli


def _help(columns: int) -> str:
    env = {**os.environ, "COLUMNS": str(columns)}
    r = subprocess.run(
        [sys.executable, "-m", "flowc", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_help_lists_every_command_with_its_whole_summary() -> None:
    text = _help(80)
    listing = text.split("\nCommands:\n", 1)[1].splitlines()
    shown = {line.split()[0]: " ".join(line.split()[1:]) for line in listing if line.strip()}
    assert sorted(shown) == sorted(cli.commands), shown
    assert len(shown) >= 10
    for name, command in cli.commands.items():
        # One line each at the usual 80 columns, the summary as written: click cut it with
        # "..." where a command had no short summary of its own.
        assert command.short_help, name
        assert shown[name] == command.short_help, (name, shown[name])
        assert "..." not in shown[name]
    # Past the usage line ("COMMAND [ARGS]..."), nothing is cut.
    assert "..." not in text.split("\n", 1)[1]


def test_help_names_both_inputs() -> None:
    text = " ".join(_help(80).split())
    assert "ONNX models" in text
    assert ".flow DSL programs" in text


def test_narrow_terminal_wraps_summaries_without_cutting_them() -> None:
    words = " ".join(_help(50).split("\nCommands:\n", 1)[1].split())
    for name, command in cli.commands.items():
        assert f"{name} {command.short_help}" in words, name


def test_only_the_command_line_imports_flowc_cli() -> None:
    # The commands are the top layer: no other flowc module may depend on them.
    offenders = []
    for path in sorted((REPO / "flowc").rglob("*.py")):
        rel = path.relative_to(REPO / "flowc")
        if rel.parts[0] == "cli" or rel.name in ("entry.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(n == "flowc.cli" or n.startswith("flowc.cli.") for n in names):
                offenders.append(str(rel))
    assert offenders == []


def test_each_command_has_a_module_of_its_own() -> None:
    package = Path(REPO / "flowc" / "cli")
    for name, command in cli.commands.items():
        module = command.callback.__module__ if command.callback else ""
        assert module == "flowc.cli." + name.replace("-", "_"), (name, module)
        assert (package / (module.rsplit(".", 1)[1] + ".py")).is_file()


def test_compile_and_verify_help_lists_options_by_group_with_examples() -> None:
    groups = ["Input", "Precision", "Parallel", "Schedule", "Memory", "Output"]
    for command in ("compile", "verify"):
        r = subprocess.run(
            [sys.executable, "-m", "flowc", command, "--help"],
            capture_output=True,
            text=True,
            env={**os.environ, "COLUMNS": "100"},
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        headings = [
            line[: -len(" options:")]
            for line in r.stdout.splitlines()
            if line.endswith(" options:")
        ]
        # The six groups in this order (compile adds Training after Input).
        assert [h for h in headings if h in groups] == groups, headings
        # Only --help is left ungrouped; every option the command has is listed once.
        other = r.stdout.split("Other options:\n", 1)[1].split("\n\n", 1)[0]
        assert other.split() == ["-h,", "--help", "Show", "this", "message", "and", "exit."]
        params = [p for p in cli.commands[command].params if isinstance(p, click.Option)]
        listing = r.stdout.split("Input options:\n", 1)[1].split("Examples:\n", 1)[0]
        for p in params:
            assert re.search(rf"(^|[\s,]){re.escape(p.opts[-1])}(\s|$)", listing, re.M), p
        examples = r.stdout.split("Examples:\n", 1)[1].splitlines()
        assert examples and all(line.startswith(f"  flowc {command} ") for line in examples)
