"""The user documentation the tests hold to: README.md and every page of the docs site.

Tests that run the documented commands or check a documented table read them through here,
so a section keeps being checked wherever it moves between the README and docs/.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# Where the documented commands send their requests.
DOCUMENTED_URL = "http://localhost:8000"


def page_paths() -> list[Path]:
    """README.md first, then every docs page in a stable order."""
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def pages() -> Iterator[tuple[Path, str]]:
    """(path, text) of README.md and every docs page."""
    for path in page_paths():
        yield path, path.read_text()


def code_blocks(language: str) -> list[str]:
    """Every fenced block of `language` on every page, each once, in page order."""
    blocks: list[str] = []
    for _, text in pages():
        for block in re.findall(rf"```{language}\n(.*?)```", text, flags=re.DOTALL):
            if block not in blocks:
                blocks.append(block)
    return blocks


def command_lines(language: str, program: str) -> list[str]:
    """The lines of `language` blocks that start with `program` (continuations joined),
    each once, in page order."""
    lines: list[str] = []
    for block in code_blocks(language):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(program + " ") and line not in lines:
                lines.append(line)
    return lines


def run_command_line(command: str, url: str, cwd: Path | None = None) -> str:
    """The standard output of a documented command line run by the shell in `cwd` against
    the server at `url` (instead of the docs' `DOCUMENTED_URL`), once it exited 0."""
    live = command.replace(DOCUMENTED_URL, url)
    ran = subprocess.run(live, shell=True, cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0, (command, ran.stderr)
    return ran.stdout


def headings(text: str) -> Iterator[tuple[int, int, str]]:
    """(line index, level, title) of each heading outside fenced code blocks."""
    fenced = False
    for index, line in enumerate(text.splitlines()):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"(#+) (.*)", line)):
            yield index, len(match.group(1)), match.group(2)


def section(heading: str) -> str:
    """The text under the one heading (any level) titled `heading`, on whichever page holds
    it, up to the next heading of the same or a higher level."""
    found = []
    for path, text in pages():
        lines = text.splitlines()
        marks = list(headings(text))
        for i, (index, level, title) in enumerate(marks):
            if title == heading:
                end = next((j for j, lv, _ in marks[i + 1 :] if lv <= level), len(lines))
                found.append((path, "\n".join(lines[index + 1 : end])))
    assert len(found) == 1, f"the heading {heading!r} should be on exactly one page, not {len(found)}"
    return found[0][1]
