"""MkDocs hook: fills the pages' ``<!-- generated:NAME -->`` markers while the site builds.

The benchmark tables come from ``benchmarks/results/*.json`` and the feature tables from
``fastgen.known_features()`` (see :func:`benchmarks.report.fill_generated`), so the site cannot
drift from the committed measurements or from the code.
"""

from __future__ import annotations

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
