"""`--help` of every `v4rl` command read at 120 columns (issue 40): each option's names (and its --no- form) whole on
one line, its help text with most of the width (typer's rich tables gave names, --no- forms and types a column each
and left the help 30-odd columns: `train --help` ran to 163 lines), no word broken at a hyphen, and nothing wider
than the terminal. One child process renders them all (COLUMNS=120 as a shell sets it); a few seconds.

    .venv/bin/python -m pytest tests/test_cli_help.py -q
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import typer
from typer.core import TyperOption

from v4rl.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMMAND = typer.main.get_command(app)
HELP_STARTS_BY = 40
"""An option's help starts within the first 40 of the 120 columns, so it has 80 to wrap in."""
RENDER = """
import contextlib, io, json, sys
import typer
from v4rl.cli import app

command, out = typer.main.get_command(app), {}
for name in ["", *command.commands]:
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        command.main([name, "--help"] if name else ["--help"], prog_name="v4rl", standalone_mode=False)
    out[name] = text.getvalue()
print(json.dumps(out))
"""


@cache
def _helps() -> dict[str, str]:
    """Every command's `--help` as a 120-column terminal gets it (COLUMNS, as a shell sets it; not CliRunner's 80)."""
    env = {k: v for k, v in os.environ.items() if k != "TERMINAL_WIDTH"}
    done = subprocess.run([sys.executable, "-c", RENDER], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**env, "COLUMNS": "120", "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.parametrize("name", sorted(COMMAND.commands))
def test_help_at_120_columns_keeps_every_option_whole_on_one_line_and_readable(name):
    text = _helps()[name]
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 120, text
    broken = [line for line in lines if re.search(r"\w-$", line)]  # `--opsm-` / `delta`: neither half pastes
    assert not broken, broken
    options = [p for p in COMMAND.commands[name].params if isinstance(p, TyperOption)]
    assert options, text
    for option in options:
        first = re.compile(r"^\s{2,}" + re.escape(option.opts[0]) + r"(?=[ ,/]|$)")
        rows = [line for line in lines if first.match(line)]
        assert rows, f"{option.opts[0]} does not start a line of `v4rl {name} --help`:\n{text}"
        assert all(opt in rows[0].split() for opt in option.opts + option.secondary_opts), (rows[0], text)
        if option.help:
            words = " ".join(option.help.split()[:3])
            starts = [line.find(words) for line in lines if words in line]
            assert starts and min(starts) <= HELP_STARTS_BY, f"{option.opts[0]}'s help starts at {starts}:\n{text}"


def test_the_command_list_names_every_command_with_its_whole_summary():
    text = _helps()[""]
    for name in COMMAND.commands:
        assert re.search(rf"^\s{{2,}}{re.escape(name)}\s", text, re.M), text
    commands = text[text.index("Commands:"):]
    assert "..." not in commands, commands  # click cut a summary at the width
