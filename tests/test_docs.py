"""The documentation keeps up with the code: every config key is on docs/configuration.md, and the links
between README.md and the pages under docs/ lead somewhere."""

from __future__ import annotations

import re
from pathlib import Path

from supervisor.config import config_keys

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings: lower case, punctuation dropped, spaces as hyphens."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return found


def test_every_config_key_is_documented():
    page = (DOCS / "configuration.md").read_text()
    missing = [key for key in dict.fromkeys(k.rsplit(".", 1)[-1] for k in config_keys()) if f"`{key}`" not in page]
    assert not missing, f"docs/configuration.md does not document {', '.join(missing)} (write each as `key`)"


def test_links_between_pages_resolve():
    pages = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            if path.startswith("/") or not linked.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "links that lead nowhere (or are not relative): " + "; ".join(broken)
