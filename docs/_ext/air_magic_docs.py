"""Reference pages written from the tables the code itself uses, so that they cannot drift.

::

    air_magic.options.OPTIONS ------------> .. air-magic-options::   (keyword, flags, default, help)
    DistributedMagics / LintMagics -------> .. air-magic-magic::     (usage, docstring, each flag)
    DistributedMagics' config traits -----> .. air-magic-config::    (%config DistributedMagics.X)
    air_magic.cli._parser() (argparse) ---> .. air-magic-cli::       (each verb, each flag)
    air_magic.settings' docstring --------> .. air-magic-settings::  (every AIR_MAGIC_* variable)
    air_magic.lint.rules.RULES -----------> .. air-magic-rules::     (code, name, fix, message, example)

Each directive writes reStructuredText and parses it in place (the pages that use them are
``.rst``).  ``tests/docs/test_docs_coverage.py`` checks the built pages against the same tables.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import textwrap
from typing import Any, Iterable

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import nested_parse_with_titles


def _esc(text: str) -> str:
    """Plain text for a reStructuredText paragraph (argparse's help, a rule's message)."""
    for char in ("\\", "*", "`", "|", "_"):
        text = text.replace(char, "\\" + char)
    return " ".join(text.split())


def _prose(text: str) -> str:
    """Text whose `backticked` parts are code: escaped prose, inline literals."""
    parts = re.split(r"`([^`]+)`", text)
    # "\\ " around a literal: reStructuredText's escaped space, so that it may touch a letter
    return "".join(f"\\ {_lit(part)}\\ " if i % 2 else _esc(part) for i, part in enumerate(parts)).strip()


def _lit(text: str) -> str:
    """An inline literal, whatever it holds."""
    text = " ".join(str(text).split())
    if "``" in text or text.endswith("`"):
        return ":literal:`" + text.replace("`", "\\`") + "`"
    return f"``{text}``"


def _table(header: list[str], rows: Iterable[list[str]], widths: list[int] | None = None) -> list[str]:
    lines = [".. list-table::", "   :header-rows: 1", "   :class: air-magic-table"]
    if widths:
        lines.append("   :widths: " + " ".join(str(w) for w in widths))
    lines.append("")
    for row in [header, *rows]:
        for i, cell in enumerate(row):
            cell_lines = str(cell).splitlines() or [""]
            lines.append(("   * - " if i == 0 else "     - ") + cell_lines[0])
            lines.extend("       " + line if line.strip() else "" for line in cell_lines[1:])
    lines.append("")
    return lines


class _Generated(SphinxDirective):
    has_content = False

    def rst(self) -> list[str]:  # pragma: no cover - each directive writes its own
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        holder = nodes.section()
        holder.document = self.state.document
        source = self.get_source_info()[0]
        nested_parse_with_titles(self.state, StringList(self.rst(), source=source), holder, self.content_offset)
        return holder.children


def _action_flags(action: argparse.Action) -> str:
    if not action.option_strings:
        return _lit(action.metavar or action.dest)
    metavar = ""
    if action.nargs != 0:
        metavar = " " + str(action.metavar or action.dest.upper())
    return ", ".join(_lit(flag + metavar) for flag in action.option_strings)


def _action_rows(parser: argparse.ArgumentParser) -> list[list[str]]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = (action.help or "") % {"default": action.default, "prog": parser.prog} if action.help else ""
        rows.append([_action_flags(action), _esc(help_text)])
    return rows


class OptionsDirective(_Generated):
    """Every launch option: its ``@distributed`` keyword, its ``%%distributed`` flags, its default."""

    def rst(self) -> list[str]:
        from air_magic.options import OPTIONS

        rows = []
        for option in OPTIONS:
            keyword = _lit(f"{option.keyword}=") if option.keyword else "(the magic only)"
            flags = ", ".join(_lit(flag) for flag in option.flags) or "(the decorator only)"
            default = _lit(repr(option.default)) if option.keyword else ""
            rows.append([keyword, flags, default, _prose(option.help)])
        return _table(["``@distributed``", "``%%distributed``", "default", "what it does"], rows, [18, 22, 12, 48])


class MagicDirective(_Generated):
    """One magic: its usage line, its docstring and each of its flags (IPython's magic_arguments)."""

    required_arguments = 1  # module:Class.method

    def rst(self) -> list[str]:
        target = self.arguments[0]
        module_name, _, attribute = target.partition(":")
        class_name, _, method = attribute.partition(".")
        func = getattr(getattr(importlib.import_module(module_name), class_name), method)
        parser: argparse.ArgumentParser = func.parser
        doc = inspect.cleandoc(func.__doc__ or "")
        # magic_arguments writes "::\n\n  usage\n\n<the docstring>\n\n<positional arguments:|options:>..."
        body = doc.split("\n\n", 2)[2] if doc.startswith("::") else doc
        for header in ("\npositional arguments:", "\noptions:", "\noptional arguments:"):
            if header in body:
                body = body[: body.index(header)]
        # IPython's parser writes its usage as a literal block of its own ("::", then indented)
        usage = textwrap.dedent(parser.format_usage().replace("usage: ", "", 1).removeprefix("::").strip("\n"))
        lines = ["Usage:", "", ".. code-block:: text", "", *textwrap.indent(usage.strip(), "   ").splitlines(), ""]
        lines += body.rstrip().splitlines() + [""]
        rows = _action_rows(parser)
        if rows:
            lines += _table(["argument", "what it does"], rows, [30, 70])
        return lines


class ConfigDirective(_Generated):
    """``%config DistributedMagics.<trait>``: the kernel's defaults (traitlets)."""

    def rst(self) -> list[str]:
        from air_magic.magics import DistributedMagics

        rows = []
        for name, trait in DistributedMagics.class_traits(config=True).items():
            if name in ("config", "parent", "log"):
                continue
            rows.append(
                [
                    _lit(f"%config DistributedMagics.{name}"),
                    _lit(repr(trait.default_value)),
                    _esc(trait.help or ""),
                ]
            )
        return _table(["setting", "default", "what it does"], rows, [35, 15, 50])


class CLIDirective(_Generated):
    """``air-magic`` and each of its verbs, from the argparse parser ``air-magic`` runs."""

    def rst(self) -> list[str]:
        from air_magic.cli import _parser

        parser, _ = _parser(lint=True)
        lines: list[str] = []
        lines += self._parser_lines("air-magic", parser, "-")
        [verbs] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for name, sub in verbs.choices.items():
            lines += self._parser_lines(f"air-magic {name}", sub, "-")
        return lines

    @staticmethod
    def _parser_lines(title: str, parser: argparse.ArgumentParser, underline: str) -> list[str]:
        lines = [f".. _cli-{title.replace(' ', '-')}:", "", title, underline * len(title), ""]
        usage = parser.format_usage().replace("usage: ", "", 1).strip()
        lines += [".. code-block:: text", "", *textwrap.indent(usage, "   ").splitlines(), ""]
        if parser.description:
            lines += _described(parser, parser.description)
        rows = _action_rows(parser)
        for group in parser._action_groups:
            for action in group._group_actions:
                if isinstance(action, argparse._SubParsersAction):
                    for choice in action._choices_actions:
                        rows.append([_lit(choice.dest), _esc(choice.help or "")])
        if rows:
            lines += _table(["argument", "what it does"], rows, [30, 70])
        if parser.epilog:
            lines += _described(parser, parser.epilog)
        return lines


def _described(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """A parser's description or epilog: laid out by hand (kept as it is, lines wrapped where the
    page is narrower), or a paragraph."""
    if issubclass(parser.formatter_class, argparse.RawDescriptionHelpFormatter):
        return [
            ".. code-block:: text",
            "   :class: air-magic-wrap",
            "",
            *textwrap.indent(text.strip(), "   ").splitlines(),
            "",
        ]
    return [_prose(text), ""]


class SettingsDirective(_Generated):
    """Every ``AIR_MAGIC_*`` setting: the table of :mod:`air_magic.settings`' docstring."""

    def rst(self) -> list[str]:
        import air_magic.settings

        doc = inspect.cleandoc(air_magic.settings.__doc__ or "")
        doc = doc.split("Standard library only")[0]
        # the module's own cross-references name internals this site does not document
        doc = re.sub(r":(?:meth|mod|data|class|func):`~?([^`]+)`", r"``\1``", doc)
        return doc.rstrip().splitlines()[1:] + [""]


class RulesDirective(_Generated):
    """The migration linter's rules, from :data:`air_magic.lint.rules.RULES`."""

    def rst(self) -> list[str]:
        from air_magic.lint.rules import RULES

        lines: list[str] = []
        lines += _table(
            ["code", "name", "fix", "what it finds"],
            (
                [f":ref:`{r.code} <rule-{r.code}>`", _lit(r.name), str(r.fix), _prose(_template(r.message))]
                for r in RULES
            ),
            [10, 24, 14, 52],
        )
        for r in RULES:
            title = f"{r.code} {r.name}"
            lines += [f".. _rule-{r.code}:", "", title, "-" * len(title), ""]
            lines += [f"*{r.kind}*; fix: **{r.fix}**. {_prose(_template(r.message))}", ""]
            lines += [f"What to do: {_prose(_template(r.fix_title))}.", ""]
            lines += [
                "Before:",
                "",
                ".. code-block:: python",
                "",
                *textwrap.indent(r.before.rstrip(), "   ").splitlines(),
                "",
            ]
            lines += [
                "After:",
                "",
                ".. code-block:: python",
                "",
                *textwrap.indent(r.after.rstrip(), "   ").splitlines(),
                "",
            ]
        return lines


def _template(text: str) -> str:
    """A rule's message template with its fields shown as placeholders: ``{old}`` -> ``<old>``."""
    return re.sub(r"\{(\w+)[^}]*\}", r"<\1>", text)


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("air-magic-options", OptionsDirective)
    app.add_directive("air-magic-magic", MagicDirective)
    app.add_directive("air-magic-config", ConfigDirective)
    app.add_directive("air-magic-cli", CLIDirective)
    app.add_directive("air-magic-settings", SettingsDirective)
    app.add_directive("air-magic-rules", RulesDirective)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
