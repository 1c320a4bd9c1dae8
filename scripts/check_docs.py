"""Checks the built documentation site offline: internal links and anchors, and words about how it was made.

python scripts/check_docs.py site            # the site `mkdocs build` wrote; exit status 1 on any problem
python scripts/check_docs.py site README.md  # markdown files are checked for process words too

Links: every ``href``/``src`` of every page that stays inside the site must name a file that exists and,
with a ``#fragment``, an ``id`` on that page. External links (``http:``, ``mailto:``) are not fetched.

Process words: the pages describe the product (what was measured, how, on what hardware), so phrases
that only make sense to the people who wrote them (``issue 27``, a ``-dirty`` commit, a device budget)
fail the check. The list is short on purpose; extend :data:`PROCESS_WORDS` when a new one slips in.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: Phrase -> why it does not belong on a product page. Matched case-insensitively on the page's text.
PROCESS_WORDS: dict[str, str] = {
    r"\bissues? #?\d": "an issue number of the project's tracker",
    r"\bsessions?\b": "how the work was organised",
    r"\bhanded out\b": "how a machine was obtained",
    r"(?<!memory )\bbudgets?\b(?!-gib)": "device-time budgets (a memory cap is fine: 'memory budget')",
    r"\blease\b|\blent\b": "how a machine was obtained",
    r"-dirty\b": "an uncommitted tree's commit name",
    r"\bmain at [0-9a-f]{7}": "the branch at a commit",
    r"\bwhere this was written\b": "the author's machine",
    r"\bmet\b": "met/not-met goals",
    r"\bthe issue's\b": "the project's tracker",
}
_PROCESS = [(re.compile(pattern, re.IGNORECASE), why) for pattern, why in PROCESS_WORDS.items()]


class _Page(HTMLParser):
    """Collects a page's ids, its links, and its visible text (scripts and styles left out)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.text: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        for key in ("id", "name"):
            if values.get(key) and (key == "id" or tag == "a"):
                self.ids.add(str(values[key]))
        for key in ("href", "src"):
            if values.get(key) and tag != "link":  # <link> rel=... are the theme's own assets
                self.links.append(str(values[key]))
        if tag in ("script", "style"):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.text.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8", errors="replace"))
    return page


def process_words(text: str, where: str) -> list[str]:
    """One line per process word found in ``text`` (with a little context)."""
    problems = []
    for pattern, why in _PROCESS:
        for match in pattern.finditer(text):
            start, end = max(0, match.start() - 40), min(len(text), match.end() + 40)
            context = " ".join(text[start:end].split())
            problems.append(f"{where}: process word {match.group(0)!r} ({why}): …{context}…")
    return problems


def _target(site: Path, page: Path, link: str) -> tuple[Path, str] | None:
    """The file and fragment an internal link points at; ``None`` for links that leave the site."""
    parts = urlsplit(link)
    if parts.scheme or parts.netloc or link.startswith(("mailto:", "javascript:", "data:")):
        return None
    path = unquote(parts.path)
    if not path:
        target = page
    elif path.startswith("/"):
        target = site / path.lstrip("/")
    else:
        target = (page.parent / path).resolve()
    if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
    return target, unquote(parts.fragment)


def check_site(site: Path) -> list[str]:
    """Every broken internal link or anchor and every process word of a built site."""
    site = site.resolve()
    pages = {p.resolve(): _parse(p) for p in sorted(site.rglob("*.html"))}
    if not pages:
        return [f"{site}: no HTML pages (build the site first)"]
    problems = []
    for path, page in pages.items():
        name = str(path.relative_to(site))
        if name != "404.html":
            problems += process_words(html.unescape(" ".join(page.text)), name)
        for link in page.links:
            target = _target(site, path, link)
            if target is None:
                continue
            file, fragment = target
            if not file.exists():
                missing = file.relative_to(site) if site in file.parents else file
                problems.append(f"{name}: broken link {link!r} (no {missing})")
            elif fragment and file.suffix == ".html":
                ids = pages[file].ids if file in pages else _parse(file).ids
                if fragment not in ids:
                    problems.append(f"{name}: link {link!r}: no anchor #{fragment} on that page")
    return problems


def check_markdown(path: Path) -> list[str]:
    """Process words in a markdown file shown outside the site (the README on the package index)."""
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)  # generator markers
    return process_words(text, str(path))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the directory mkdocs build wrote")
    parser.add_argument("markdown", type=Path, nargs="*", help="markdown files to check for process words")
    args = parser.parse_args(argv)
    problems = check_site(args.site)
    for path in args.markdown:
        problems += check_markdown(path)
    for line in problems:
        print(line, file=sys.stderr)
    pages = len(list(args.site.rglob("*.html")))
    print(f"check_docs: {pages} pages, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
