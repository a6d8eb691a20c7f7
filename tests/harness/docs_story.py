"""The launch stories of docs/slurm.md as the Slurm tests run them: the page's own shell lines,
with only the cluster's names substituted (issue 33: the docs are the test).

A story is a ```bash block of the page: its shared lines (those before the first ``# (a)``-style
label) and one labelled command, continuation lines kept. :func:`substitute` replaces each given
text and fails when one is not on the page any more, so that a changed command fails the test
instead of silently running something else.
"""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "slurm.md"
LABEL = re.compile(r"^# \((\w)\) ")


def bash_blocks(after: str, doc: Path = DOC) -> list[str]:
    """The ```bash blocks of the section that starts with the heading line ``after``, up to the next
    heading of the same or a higher level (outside code blocks: a shell comment is not a heading)."""
    lines = doc.read_text().splitlines()
    start = lines.index(after)
    level = len(after) - len(after.lstrip("#"))
    blocks, block, fenced = [], None, False
    for line in lines[start + 1 :]:
        if line.startswith("```"):
            fenced = not fenced
            if fenced and line == "```bash":
                block = []
            elif not fenced and block is not None:
                blocks.append("\n".join(block) + "\n")
                block = None
        elif block is not None:
            block.append(line)
        elif not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
    return blocks


def bash_block(after: str, containing: str, doc: Path = DOC) -> str:
    """The one ```bash block of that section that contains ``containing``."""
    found = [b for b in bash_blocks(after, doc) if containing in b]
    if len(found) != 1:
        raise AssertionError(f"docs/slurm.md, {after!r}: {len(found)} bash blocks contain {containing!r}")
    return found[0]


def story(block: str, label: str | None = None, skip: tuple[str, ...] = ()) -> str:
    """The block's shared lines and, with ``label``, the command labelled ``# (label)`` (with its
    comment lines), as one script. Lines starting with one of ``skip`` are left out (a set-up step
    the test has made already, e.g. ``git clone``)."""
    shared, parts, current = [], {}, None
    for line in block.splitlines():
        m = LABEL.match(line)
        if m:
            current = m.group(1)
            parts[current] = []
        if current is None:
            shared.append(line)
        elif line.strip():
            parts[current].append(line)
    if label is not None and label not in parts:
        raise KeyError(f"docs/slurm.md: no command labelled ({label}) in the block; labels: {sorted(parts)}")
    lines = shared + (parts[label] if label else [])
    return "\n".join(line for line in lines if not line.startswith(skip)) + "\n"


def substitute(script: str, pairs: list[tuple[str, str]], *, each: bool = True) -> str:
    """Each ``(text, replacement)`` in order; with ``each``, every text must occur in the script
    (without: the texts that occur, e.g. a list of cluster names of which a story uses some)."""
    for old, new in pairs:
        if each and old not in script:
            raise AssertionError(f"docs/slurm.md's story no longer has {old!r}:\n{script}")
        script = script.replace(old, new)
    return script
