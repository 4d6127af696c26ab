"""`--help` of every `v4rl` command in click's plain layout, wrapped without breaking a word at its hyphens: click's
own wrap splits `--opsm-delta` or `dsv4-flash-mi355x-1node` at a line's end into two pieces that no longer paste or
search whole. Each option's names and type stay on one line; its help wraps beside or below them.

    plain_help(app)   # in v4rl/cli.py, once every command is registered
"""

from __future__ import annotations

import textwrap

import typer
import typer.core

_WHOLE = {"break_on_hyphens": False, "break_long_words": False}


class WholeWordFormatter(typer.Context.formatter_class):
    """Click's help formatter (`typer.Context.formatter_class`) with its two wrapping writers rewritten."""

    def write_text(self, text: str) -> None:
        indent = " " * self.current_indent
        paragraphs = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
        self.write("\n\n".join(textwrap.fill(p, max(self.width, 11), initial_indent=indent, subsequent_indent=indent,
                                             **_WHOLE) for p in paragraphs) + "\n")

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first = min(max((len(term) for term, _ in rows), default=0), col_max) + col_spacing
        indent = " " * self.current_indent
        hanging = " " * (first + self.current_indent)
        for term, text in rows:
            lines = textwrap.wrap(text, max(self.width - first - 2, 10), **_WHOLE)
            if not lines:
                self.write(f"{indent}{term}\n")
                continue
            gap = " " * (first - len(term)) if len(term) <= first - col_spacing else "\n" + hanging
            self.write(f"{indent}{term}{gap}{lines[0]}\n" + "".join(f"{hanging}{line}\n" for line in lines[1:]))


class _Context(typer.Context):
    formatter_class = WholeWordFormatter


class _Command(typer.core.TyperCommand):
    context_class = _Context

    def get_short_help_str(self, limit: int = 45) -> str:
        """The whole first sentence in `v4rl --help`'s list (click cuts it at the width with "...")."""
        return super().get_short_help_str(limit=1000)


def plain_help(app: typer.Typer) -> None:
    """Every command of `app` registered so far (without a class of its own) lays out its help this way."""
    for info in app.registered_commands:
        if info.cls in (None, typer.core.TyperCommand):
            info.cls = _Command
