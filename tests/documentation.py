"""The pages a user reads, README.md and docs/*.md, and the code blocks in them: the tests run every snippet and
command they print (tests/test_readme.py and, for the longer commands, the tests of what they run)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"


def pages() -> list[Path]:
    """README first, then every docs page by name."""
    return [README, *sorted(DOCS.glob("*.md"))]


def code_blocks(page: Path, language: str) -> list[str]:
    """The fenced blocks of ``page`` written in ``language`` (```python, ```bash ...), in order."""
    return [code for lang, code in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), re.DOTALL) if lang == language]


def command_lines(prefix: str) -> list[str]:
    """Every line of a bash block on any page that starts with ``prefix``, comments cut off."""
    return [
        line.split(" #")[0].strip()
        for page in pages()
        for block in code_blocks(page, "bash")
        for line in block.splitlines()
        if line.startswith(prefix)
    ]
