"""Every public name, magic option, CLI flag, setting, error class and lint rule has an entry in
the built site; every link between its pages leads somewhere.

The site is built as ``scripts/build_docs.sh`` builds it (``conftest.site``): Sphinx with warnings
as errors and nitpicky references, so a docstring that does not parse, a reference to nothing or
a page no table of contents reaches fails that build first.
"""

from __future__ import annotations

import argparse
import ast
import html
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

import air_magic
import air_magic.data
import air_magic.lint
import air_magic.tracking
from air_magic.lint import RULES
from air_magic.options import OPTIONS

ROOT = Path(__file__).resolve().parents[2]

#: The names of ``air_magic.tracking`` a user calls (the rest of its ``__all__`` wires it in).
TRACKING = ("flush", "upload_pending", "pending", "Recovered")

#: Exception classes that never reach a user as themselves, and why.
INTERNAL_ERRORS = {
    "StopError": "air-magic stop / %distributed_ps --stop print its message and exit 1",
    "OptionError": "the linter's parser of a %%distributed line: a finding, or the magic's UsageError",
    "PrivateFolderError": "a folder that is not private: said in one line, the launch goes on elsewhere",
    "UnreadableFile": "air-magic lint: a file it cannot read is reported as a finding",
    "ErrorRecord": "a record of the rank-kernel protocol, not an exception",
    "OutOfStep": "a pool rank's connection out of step: the pool breaks, as a PoolBrokenError that says so",
    "Unreachable": "a tracking store that does not answer: said in one line, the points wait on disk",
    "RankTraceback": "a rank's traceback, shown as the cause of its exception",
    "SyncError": "a rank's refusal of pool.sync: the cell shows it as ValueError: pool.sync: <why>",
}


def page(site: Path, name: str) -> str:
    return (site / name).read_text()


def text_of(markup: str) -> str:
    """A page's words, tags dropped, entities read."""
    return html.unescape(re.sub(r"<[^>]+>", "", markup))


def ids(markup: str) -> set[str]:
    return set(re.findall(r'id="([^"]+)"', markup))


def public_names() -> list[tuple[str, str]]:
    names = [("air_magic", n) for n in air_magic.__all__]
    names += [("air_magic.data", n) for n in air_magic.data.__all__]
    names += [("air_magic.lint", n) for n in air_magic.lint.__all__]
    names += [("air_magic.tracking", n) for n in TRACKING]
    return names


@pytest.mark.parametrize(("module", "name"), public_names(), ids=lambda v: str(v))
def test_every_public_name_has_an_api_entry_and_a_docstring(site: Path, module: str, name: str) -> None:
    assert f"{module}.{name}" in ids(page(site, "reference/api.html")), f"{module}.{name} is not in the API reference"
    value = getattr(__import__(module, fromlist=[name]), name)
    if callable(value):
        assert (value.__doc__ or "").strip(), f"{module}.{name} has no docstring"


def test_every_option_of_every_magic_is_on_the_magics_page(site: Path) -> None:
    from air_magic.lint.magic import LintMagics
    from air_magic.magics import DistributedMagics

    words = text_of(page(site, "reference/magics.html"))
    magics = [
        getattr(DistributedMagics, name) for names in DistributedMagics.magics.values() for name in names.values()
    ]
    magics += [LintMagics.air_lint]
    for magic in magics:
        for action in magic.parser._actions:
            for flag in action.option_strings:
                assert flag in words, f"{flag} of %{magic.__name__} is not on the magics page"
    for option in OPTIONS:
        for flag in option.flags:
            assert flag in words
        if option.keyword:
            assert f"{option.keyword}=" in words, f"@distributed({option.keyword}=) is not on the magics page"


def test_every_verb_and_flag_of_the_cli_is_on_the_cli_page(site: Path) -> None:
    from air_magic.cli import _parser

    markup = page(site, "reference/cli.html")
    words = text_of(markup)
    parser, _ = _parser(lint=True)
    [verbs] = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(verbs.choices) == {"lint", "run", "ps", "stop"}
    for name, sub in [("air-magic", parser), *((f"air-magic {v}", p) for v, p in verbs.choices.items())]:
        assert f"cli-{name.replace(' ', '-')}" in ids(markup), f"{name} has no section"
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in words, f"{name} {flag} is not on the CLI page"


def test_every_setting_is_on_the_settings_page(site: Path) -> None:
    from air_magic.magics import DistributedMagics

    words = text_of(page(site, "reference/settings.html"))
    read = {
        m for path in (ROOT / "air_magic").rglob("*.py") for m in re.findall(r"AIR_MAGIC_[A-Z0-9_]+", path.read_text())
    }
    assert len(read) > 20
    for name in sorted(read):
        assert name in words, f"{name} is read by air_magic but not on the settings page"
    for trait in DistributedMagics.class_traits(config=True):
        if trait not in ("config", "parent", "log"):
            assert f"%config DistributedMagics.{trait}" in words


def _exception_classes() -> dict[str, str]:
    """Every exception or warning class air_magic defines: its name and module."""
    found = {}
    for path in (ROOT / "air_magic").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if any(re.search(r"(Error|Warning|Exception)$", b) for b in bases) or node.name.endswith("Error"):
                module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
                found[node.name] = module
    return found


def test_every_error_class_is_on_the_errors_page(site: Path) -> None:
    words = text_of(page(site, "reference/errors.html"))
    classes = _exception_classes()
    assert {"GPUsBusyError", "ModelBackError", "BreakpointError", "DataError"} <= set(classes)
    for name, module in sorted(classes.items()):
        if name in INTERNAL_ERRORS:
            continue
        assert name in words, f"{module}.{name} is not on the errors page"


def test_every_lint_rule_has_its_entry(site: Path) -> None:
    markup = page(site, "reference/lint-rules.html")
    words = text_of(markup)
    for rule in RULES:
        assert f"rule-{rule.code.lower()}" in ids(markup), rule.code
        assert rule.name in words and str(rule.fix) in words


def test_every_link_between_pages_leads_somewhere(site: Path) -> None:
    checked = 0
    for path in site.rglob("*.html"):
        if "_static" in path.relative_to(site).parts:  # the theme's own templates, copied as they are
            continue
        markup = path.read_text()
        for href in re.findall(r'href="([^"]+)"', markup):
            parts = urlsplit(href)
            if parts.scheme or href.startswith(("#", "mailto:", "//")):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            assert target.exists(), f"{path.relative_to(site)} links to {href}, which is not in the site"
            if parts.fragment and target.suffix == ".html":
                assert parts.fragment in ids(target.read_text()), (
                    f"{path.relative_to(site)}: no #{parts.fragment} in {href}"
                )
            checked += 1
    assert checked > 500


def test_the_site_reads_offline(site: Path) -> None:
    """Nothing a page needs comes from the network: scripts, styles, fonts and images are files."""
    for path in site.rglob("*.html"):
        markup = path.read_text()
        for url in re.findall(r'<(?:script|link|img)[^>]+(?:src|href)="(https?://[^"]+)"', markup):
            pytest.fail(f"{path.relative_to(site)} loads {url}")
