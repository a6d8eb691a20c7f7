"""Write one benchmark's section of docs/benchmarks.md, leaving the other sections alone.

Each benchmark owns the text between ``<!-- BEGIN name -->`` and ``<!-- END name -->``;
the file is rewritten atomically (temp file + rename).
"""

from __future__ import annotations

import os
import platform
import re
import tempfile
from pathlib import Path

import torch

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = "# Benchmarks\n\nEvery number here was written by the script named in its section, on the machine it names.\n"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {gpu}, {torch.get_num_threads()} threads"


def update_section(name: str, markdown: str, doc: Path = DOC) -> None:
    doc.parent.mkdir(parents=True, exist_ok=True)
    text = doc.read_text() if doc.exists() else HEADER
    block = f"<!-- BEGIN {name} -->\n{markdown.rstrip()}\n<!-- END {name} -->"
    pattern = re.compile(rf"<!-- BEGIN {re.escape(name)} -->.*?<!-- END {re.escape(name)} -->", re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    fd, tmp = tempfile.mkstemp(dir=doc.parent, prefix=".benchmarks.")
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, doc)
