"""The configuration and command-line references, generated from the code at docs build time.

``engine_config_markdown()`` reads every ``EngineConfig`` field (type, default, the values its registry
allows) and its description from the class docstring; ``cli_markdown()`` walks the ``omnidit`` argparse
parser (every sub-command, every group, every flag). ``missing_descriptions()`` lists what has none:
tests/test_docs.py fails on it, so a new field or flag cannot land undocumented.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

ENTRY = re.compile(r"^([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (.*)$")


def cell(text) -> str:
    """``text`` as one markdown table cell: one line, pipes escaped, and brackets outside code spans
    escaped (``T[,fn=N]`` in a flag's help is not a link)."""
    parts = re.split(r"(`+[^`]*`+)", " ".join(str(text).split()))
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("[", "\\[").replace("]", "\\]").replace("|", "\\|")
    return "".join(parts)


def code(text) -> str:
    return f"`{text}`" if text not in ("", None) else ""


# ---- EngineConfig ----

def field_docs(cls) -> dict[str, str]:
    """Field name -> its description in ``cls``'s docstring, written as ``name: text`` (or
    ``a, b: text`` for several) with indented continuation lines."""
    docs: dict[str, str] = {}
    names: list[str] = []
    for line in (inspect.getdoc(cls) or "").splitlines()[1:]:
        match = ENTRY.match(line)
        if match:
            names = match.group(1).split(", ")
            for name in names:
                docs[name] = match.group(2)
        elif names and line.startswith(" "):
            for name in names:
                docs[name] += " " + line.strip()
        else:
            names = []
    return docs


def allowed_values() -> dict[str, str]:
    """What each registry-backed field accepts, read from the registries themselves."""
    from ar_adapters.select import THINKERS
    from ar_adapters.supervised import ON_FAILURE
    from attention.registry import BACKENDS
    from dit_core import cpu_linear
    from dit_core.cache.config import KINDS
    from dit_core.config import DTYPES
    from dit_core.policies import POLICIES
    from offload import reuse
    from quant.registry import METHODS

    def one_of(values) -> str:
        return ", ".join(f"`{v}`" for v in values)

    quant = [f"{name}:TYPE ({', '.join(m.qtypes)})" if m.qtypes else name for name, m in sorted(METHODS.items())]
    return {
        "dtype": one_of([*DTYPES, "auto"]),
        "policy": one_of(sorted(POLICIES)),
        "thinker": one_of(THINKERS) + ", a `Thinker`",
        "thinker_on_failure": one_of(ON_FAILURE),
        "cache": one_of(KINDS) + " (with `:THRESHOLD[,options]`)",
        "cpu_allocator": one_of(reuse.CHOICES),
        "cpu_linear": one_of(cpu_linear.CHOICES),
        "attention": one_of(["auto", *sorted(BACKENDS)]) + " (with `,ROLE=NAME` overrides)",
        "attention_per_role": "`ROLE=NAME,...`, roles `self`, `cross`, `joint`",
        "quant": one_of(["None", *quant]),
        "offload": "`none`, `components`, `blocks:N`, `disk:N`, `blocks:all`, `disk:all`, `components,disk:N`",
        "malloc_mmap_threshold": "`auto`, `0`, a number of bytes",
        "warmup": "`off`, `auto`, sizes `WxH,...`, a list",
    }


def engine_config_rows() -> list[dict]:
    from dit_core.config import EngineConfig

    docs = field_docs(EngineConfig)
    allowed = allowed_values()
    rows = []
    for f in dataclasses.fields(EngineConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "(required)"
        kind = str(f.type)
        if not allowed.get(f.name) and kind == "bool":
            allowed[f.name] = "`True`, `False`"
        rows.append({"name": f.name, "type": kind, "default": default, "allowed": allowed.get(f.name, ""),
                     "description": docs.get(f.name, "")})
    return rows


def engine_config_markdown() -> str:
    lines = ["| field | type | default | allowed values | description |", "|---|---|---|---|---|"]
    for r in engine_config_rows():
        lines.append(f"| `{r['name']}` | {code(cell(r['type']))} | {code(cell(r['default']))} | "
                     f"{cell(r['allowed'])} | {cell(r['description'])} |")
    return "\n".join(lines) + "\n"


# ---- the omnidit command line ----

def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of every sub-command, in the parser's order."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            out += [(name, helps.get(name) or "", sub) for name, sub in action.choices.items()]
    return out


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, list[dict]]]:
    """(group title, rows) per argument group with arguments, help excluded."""
    formatter = argparse.HelpFormatter(parser.prog)  # the full help text (--help shows a brief form)
    groups = []
    for group in parser._action_groups:
        rows = []
        for a in group._group_actions:
            if isinstance(a, argparse._HelpAction):
                continue
            flag = ", ".join(a.option_strings) if a.option_strings else (a.metavar or a.dest).upper()
            if isinstance(a, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
                kind = "flag"
            elif a.type is not None:
                kind = getattr(a.type, "__name__", str(a.type)).lstrip("_")
            else:
                kind = "str"
            if a.nargs in ("+", "*"):
                kind += " ..."
            if isinstance(a, argparse._AppendAction):
                kind += " (repeatable)"
            default = a.default if a.default is not argparse.SUPPRESS else None
            if isinstance(a, argparse._StoreTrueAction) and default is False:
                default = "off"
            elif isinstance(a, argparse._StoreFalseAction) and default is True:
                default = "on"
            help_text = formatter._expand_help(a) if a.help else ""
            rows.append({"flag": flag, "type": kind, "default": default, "choices": list(a.choices or []),
                         "metavar": a.metavar if isinstance(a.metavar, str) else None, "help": help_text,
                         "required": a.required})
        if rows:
            groups.append((group.title, rows))
    return groups


def cli_markdown() -> str:
    from serve.cli import build_parser

    out = []
    for name, summary, sub in subcommands(build_parser()):
        out += [f"## `omnidit {name}`", "", cell(summary) + ".", "",
                "```text", sub.format_usage().strip(), "```", ""]
        for title, rows in flag_rows(sub):
            out += [f"**{title}**", "", "| flag | type | default | choices | description |", "|---|---|---|---|---|"]
            for r in rows:
                default = "(required)" if r["required"] else ("" if r["default"] is None else code(cell(r["default"])))
                choices = ", ".join(f"`{c}`" for c in r["choices"])
                if not choices and r["metavar"] and "|" in r["metavar"]:
                    choices = code(r["metavar"])
                out.append(f"| `{r['flag']}` | {cell(r['type'])} | {default} | {choices} | {cell(r['help'])} |")
            out.append("")
    return "\n".join(out)


def missing_descriptions() -> list[str]:
    """Every EngineConfig field and omnidit flag without a description (the docs test's list)."""
    from serve.cli import build_parser

    missing = [f"EngineConfig.{r['name']}" for r in engine_config_rows() if not r["description"].strip()]
    for name, summary, sub in subcommands(build_parser()):
        if not summary.strip():
            missing.append(f"omnidit {name} (its one-line help)")
        for _, rows in flag_rows(sub):
            missing += [f"omnidit {name} {r['flag']}" for r in rows if not r["help"].strip()]
    return missing
