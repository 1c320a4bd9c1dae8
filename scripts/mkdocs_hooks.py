"""MkDocs hook: fills the pages' ``<!-- generated:NAME -->`` markers while the site builds.

The benchmark tables and charts come from ``benchmarks/results/*.json``, the supported versions from the
package metadata, and the feature tables from ``fastgen.known_features()`` (see
``benchmarks.report.fill_generated``), so the site cannot drift from the committed measurements or from the
code. The API reference's docstrings may use Sphinx roles (``:func:`status```); they are shown as code.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def on_page_markdown(markdown: str, page, config, files) -> str:  # MkDocs' hook signature
    if "<!-- generated:" not in markdown:
        return markdown
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.report import fill_generated

    return fill_generated(markdown)


# A Sphinx role as mkdocstrings renders it: ":func:<code>status</code>" (or with the backticks left as text).
_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|obj|exc|const):(<code>[^<]*</code>|`[^`]*`)")


def _code(match: re.Match) -> str:
    inner = match.group(1)
    if inner.startswith("`"):
        inner = f"<code>{inner.strip('`')}</code>"
    return inner.replace("<code>~", "<code>")


def on_page_content(html: str, page, config, files) -> str:  # MkDocs' hook signature
    return _ROLE.sub(_code, html) if ":" in html else html
