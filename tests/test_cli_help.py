"""``omnidit COMMAND --help`` fits on a screen per group: every flag of ``serve`` and ``generate`` sits in a
named argument group, each flag's help is its first clauses and its default, each group is at most a
screen, and every command's epilog points to the docs page with the full text."""

from __future__ import annotations

import argparse
import re

import pytest

from serve.cli import build_parser
from serve.cli_help import brief

SCREEN = 45  # lines of a group's help at 100 columns


def commands():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


def help_text(parser, monkeypatch, columns=100, full=False):
    monkeypatch.setenv("COLUMNS", str(columns))
    monkeypatch.delenv("OMNIDIT_HELP", raising=False)
    if full:
        monkeypatch.setenv("OMNIDIT_HELP", "full")
    return parser.format_help()


@pytest.mark.parametrize("name", ["serve", "generate"])
def test_every_flag_sits_in_a_named_group(name):
    parser = commands()[name]
    options = next(g for g in parser._action_groups if g.title == "options")
    loose = [a.option_strings[0] for a in options._group_actions if a.dest != "help"]
    assert loose == [], f"give these flags a group in serve/cli_help.GROUPS[{name!r}]"
    assert len([g for g in parser._action_groups if g._group_actions]) >= 6


@pytest.mark.parametrize("name", sorted(commands()))
def test_each_group_fits_on_a_screen_and_points_to_the_docs(name, monkeypatch):
    text = help_text(commands()[name], monkeypatch)
    body = text.split("\n\n", 1)[1]  # after the usage block
    for block in body.split("\n\n"):
        assert len(block.splitlines()) <= SCREEN, block[:200]
    assert "docs/reference/cli.md" in text
    for line in re.findall(r"^  (-\S+.*(?:\n {20,}.*)*)", body, re.M):
        assert len(line.splitlines()) <= 4, line


def test_full_help_on_request(monkeypatch):
    serve = commands()["serve"]
    short = help_text(serve, monkeypatch)
    full = help_text(serve, monkeypatch, full=True)
    assert len(full) > len(short) * 1.3
    assert "'queue_full' error frame" in " ".join(full.split())


def test_brief_keeps_the_first_clauses_and_the_default():
    action = argparse.Action(["--x"], "x", default=8)
    assert brief("requests per forward (default 8)", action) == "requests per forward (default 8)"
    assert brief("scheduling: fifo (oldest first) or edf (earliest first); default: edf when a robot is loaded, "
                 "else fifo", argparse.Action(["--p"], "p")) == \
        "scheduling: fifo or edf; default: edf when a robot is loaded, else fifo"
    assert brief("a size, e.g. 32x32. More text that is long enough to be cut away from the first clause here, "
                 "and more and more", action) == "a size, e.g. 32x32 (default 8)"
    assert brief("output file; with several, _0, _1, ... are added. A second sentence that is long enough to be "
                 "cut away from the first clauses of this help, surely", action) == \
        "output file; with several, _0, _1, ... are added (default 8)"
