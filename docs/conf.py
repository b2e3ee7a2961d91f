"""Sphinx configuration of air_magic's documentation (see docs/README.md).

Build: ``bash scripts/build_docs.sh`` (warnings are errors), then open
``docs/_build/html/index.html``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

import air_magic  # noqa: E402

project = "air_magic"
author = "the air_magic authors"
copyright = "the air_magic authors, Apache License 2.0"
release = air_magic.__version__
version = release

extensions = [
    "myst_nb",  # Markdown pages (MyST) and the example notebooks, with their saved outputs
    "sphinx.ext.autodoc",  # the API reference, from the docstrings
    "sphinx.ext.napoleon",  # "Examples" / "Returns" sections in docstrings
    "air_magic_docs",  # the magics, the CLI, the settings and the lint rules, from their tables
]

# The pages: MyST Markdown; the notebooks are shown as they were last run, never executed here.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
nb_execution_mode = "off"
nb_output_stderr = "show"
# No widget JavaScript from a CDN: a page reads offline (a widget output shows its text form).
nb_ipywidgets_js: dict[str, dict[str, str]] = {}
# A launch's summary is also saved as application/vnd.air-magic.summary+json for the JupyterLab
# extension; its HTML form is what a page shows.
suppress_warnings = ["mystnb.unknown_mime_type"]
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist", "attrs_inline", "substitution"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "README.md", "package.md", "**/.ipynb_checkpoints"]
root_doc = "index"

# Every reference is checked: a name in a signature that is not documented here and is not
# one of the libraries' below is a warning, and warnings fail the build.
nitpicky = True
nitpick_ignore_regex = [
    # names of other projects (torch, IPython, MLflow, the standard library's internals...)
    (
        r"py:.*",
        r"(torch|IPython|ipywidgets|traitlets|mlflow|ray|numpy|fsspec|torchdata|concurrent|_?io|types|typing|collections|pathlib|os|argparse|threading|multiprocessing|enum|datetime)(\..*)?",
    ),
    (
        r"py:class",
        r"(Any|Path|Callable|Iterable|Iterator|Mapping|Sequence|Enum|TextIO|BinaryIO|Tensor|Module|Future|Thread|object|str|int|float|bool|bytes|dict|list|tuple|set|None|type)",
    ),
    (r"py:.*", r"(air_magic\.)?(kernel|backends|rank|protocol|panel|capture|spec|options|plugins|lint)\..*"),
    # numpydoc's words in a parameter's type, quoted names and literals, internal types of signatures
    (r"py:.*", r"(optional|callable|'.*'|\".*\"|R|air_magic\.decorator\.R)"),
    (r"py:class", r"(LaunchSpec|LaunchOwner|Placement|Payload|PoolEngine|AcceleratorArg|HangReport|Backend)"),
]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Types in the description for the parameters a docstring describes (a constructor users never
# call keeps its internals out of the page).
autodoc_typehints_description_target = "documented"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options: dict[str, bool] = {}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
add_module_names = False

html_theme = "pydata_sphinx_theme"
html_title = f"air_magic {release}"
# The JupyterLab extension's icon: four joined chips.
html_favicon = "_static/air_magic.svg"
html_logo = "_static/air_magic.svg"
html_static_path = ["_static"]
html_search_scorer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_static", "scorer.js")  # guides first
html_css_files = ["air_magic.css"]
html_theme_options = {
    "navbar_align": "left",
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "footer_start": ["copyright"],
    "footer_end": ["sphinx-version"],
    "secondary_sidebar_items": ["page-toc"],
    "use_edit_page_button": False,
    # offline: no analytics, no external icon links, no version switcher fetched from the net
    "icon_links": [],
}
html_show_sourcelink = False
html_last_updated_fmt = None
# Light unless the reader switches (a page opened from a file starts from this, not from "").
html_context = {"default_mode": "light"}
# The pages of wide tables (every bad input, every rule) and the drawing give the navigation's column to them:
# the header and the breadcrumbs still lead everywhere.
html_sidebars = {"reference/errors": [], "reference/lint-rules": [], "how-it-works/architecture": []}
