"""The repository stands alone: no pointer to files outside it, and every math reference resolves.

* No tracked file in the checked folders names a file outside the repository (a design sheet,
  paper texts, a sibling folder) or a path of the development machine: the strings in
  ``FORBIDDEN`` must not occur. The math and its decisions live in ``docs/algorithms/math.md``.
* Every ``math.md §N`` / ``math.md §N.M`` reference (also ranges such as ``§1–§5`` and lists such
  as ``§3, §4``) names a section that exists in ``docs/algorithms/math.md``; every
  ``math.md, Notation`` reference finds its Notation section; every Markdown link to
  ``math.md#anchor`` names a heading of that page and resolves to that very file.

* No third-party code is tracked: no vendored NeMo-RL / Megatron-LM / Megatron-Bridge / Automodel package
  (recognised by files only those packages have), no archive or wheel, no file carrying their copyright
  header. The tests read those sources from the source cache outside the repository (scripts/sources.sh).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "algorithms" / "math.md"
SELF = "tests/test_standalone.py"
EXEMPT = {SELF}

# Every folder a user reads. A path ending in "/" is a folder, any other a single file.
CHECKED = ["docs/", "README.md", "nemo_granular/", "tests/", "examples/", "slurm/", "scripts/", "benchmarks/"]
# Where math.md references are resolved (a reference that exists must resolve everywhere).
REFERENCE_SCOPE = CHECKED

# "spec §" is the old name of math.md's sections; "integration guide" was a design note kept
# outside the repository.
FORBIDDEN = ["../shared", "shared/spec", "shared/papers", "shared/docs", "/work/", "spec §", "integration guide"]

_SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache"}


def _in_scope(path: str, scope: list[str]) -> bool:
    return any(path.startswith(s) if s.endswith("/") else path == s for s in scope)


def _tracked_files() -> list[str]:
    """``git ls-files`` of the checkout; without git (an unpacked source tree), every file under
    the repository except virtual environments, vendored sources and caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60)
        files = [f for f in out.stdout.decode("utf-8", "surrogateescape").split("\0") if f]
        if files:
            return files
    except (OSError, subprocess.SubprocessError):
        pass
    found = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
        for name in filenames:
            found.append(Path(dirpath, name).relative_to(ROOT).as_posix())
    return found


def _text(path: str) -> str | None:
    """The file's text, or None for a binary or vanished file."""
    try:
        data = (ROOT / path).read_bytes()
    except OSError:
        return None
    if b"\0" in data[:8192]:
        return None
    return data.decode("utf-8", "replace")


def _files(scope: list[str]) -> list[str]:
    return sorted(f for f in _tracked_files() if _in_scope(f, scope) and f not in EXEMPT)


# ---------------------------------------------------------------------------------------- scanners
def forbidden_hits(path: str, text: str) -> list[str]:
    """``path:line: 'string'`` for every forbidden string in ``text``."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        hits += [f"{path}:{n}: {s!r}" for s in FORBIDDEN if s in line]
    return hits


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def math_sections(text: str) -> tuple[set[str], set[str], bool]:
    """(section numbers such as '3' and '9.2', heading anchors, has a Notation section)."""
    sections, anchors, notation = set(), set(), False
    for line in text.splitlines():
        m = re.match(r"^(#{1,6})\s+(.*\S)\s*$", line)
        if m:
            anchors.add(slug(m.group(2)))
            notation |= m.group(2).strip().lower() == "notation"
            num = re.match(r"^(\d+(?:\.\d+)?)\.?\s", m.group(2))
            if num and len(m.group(1)) >= 2:
                sections.add(num.group(1))
        sub = re.match(r"^\s*[-*]\s+\*\*(\d+\.\d+)\*\*", line)
        if sub:
            sections.add(sub.group(1))
    return sections, anchors, notation


_NUM = r"\d+(?:\.\d+)?"
_REF = re.compile(r"math\.md(?:#[\w\-]+)?\)?\s*(§" + _NUM + r"(?:\s*(?:–|—|-|,|and)\s*§?" + _NUM + r")*)")
_NOTATION_REF = re.compile(r"math\.md\)?,?\s+Notation")
_LINK = re.compile(r"\]\(([^)\s]*math\.md)(?:#([^)\s]*))?\)")


def _expand(ref: str) -> list[str]:
    """'§1–§5, §8' -> ['1', '2', '3', '4', '5', '8']; '§9.2' -> ['9.2']."""
    out: list[str] = []
    parts = re.split(r"\s*(–|—|-|,|and)\s*", ref)
    nums, seps = parts[0::2], parts[1::2]
    out.append(nums[0].lstrip("§"))
    for sep, num in zip(seps, nums[1:]):
        num = num.lstrip("§")
        prev = out[-1]
        if sep in "–—-" and "." not in prev and "." not in num and int(num) > int(prev):
            out += [str(k) for k in range(int(prev) + 1, int(num) + 1)]
        else:
            out.append(num)
    return out


def reference_problems(
    path: str, text: str, sections: set[str], anchors: set[str], notation: bool, math_path: Path = MATH
) -> list[str]:
    """Every math.md reference in ``text`` that does not resolve, as ``path:line: why``."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in _REF.finditer(line):
            for sec in _expand(m.group(1)):
                if sec not in sections:
                    problems.append(f"{path}:{n}: math.md §{sec} does not exist")
        if _NOTATION_REF.search(line) and not notation:
            problems.append(f"{path}:{n}: math.md has no Notation section")
        if path.endswith(".md"):
            for m in _LINK.finditer(line):
                target, anchor = m.group(1), m.group(2)
                if "://" in target:
                    continue
                if (ROOT / path).parent.joinpath(target).resolve() != math_path.resolve():
                    problems.append(f"{path}:{n}: link {target!r} does not lead to docs/algorithms/math.md")
                if anchor and anchor not in anchors:
                    problems.append(f"{path}:{n}: math.md has no heading with anchor #{anchor}")
    return problems


# ---------------------------------------------------------------------------------------- tests
def test_no_file_points_outside_the_repository():
    files = _files(CHECKED)
    assert any(f.startswith("docs/") for f in files) and "README.md" in files, "found no docs to check"
    hits = [h for f in files if (t := _text(f)) is not None for h in forbidden_hits(f, t)]
    assert not hits, "references to files outside the repository or machine paths:\n" + "\n".join(hits)


def test_math_references_resolve():
    sections, anchors, notation = math_sections(MATH.read_text(encoding="utf-8"))
    # the numbering the code and docs cite: §1..§9, the six identities, and Notation
    assert {str(k) for k in range(1, 10)} <= sections
    assert {f"9.{k}" for k in range(1, 7)} <= sections
    assert notation
    problems, refs = [], 0
    for f in _files(REFERENCE_SCOPE):
        t = _text(f)
        if t is None:
            continue
        refs += len(_REF.findall(t))
        problems += reference_problems(f, t, sections, anchors, notation)
    assert refs > 0, "no math.md § reference found: the scanner is broken"
    assert not problems, "math.md references that do not resolve:\n" + "\n".join(problems)


def test_the_scanners_catch_what_they_must():
    """The checks above can fail: planted violations are found, valid references pass."""
    assert forbidden_hits("x.py", "ok\n# see spec §3\n") == ["x.py:2: 'spec §'"]
    assert forbidden_hits("x.md", "`/work/shared/papers/a.txt`") == ["x.md:1: 'shared/papers'", "x.md:1: '/work/'"]
    sections = {"1", "2", "3", "4", "5", "8", "9", "9.1", "9.2"}
    anchors = {"3-clip-bounds", "notation"}
    ok = (
        "docs/algorithms/math.md §1–§5, §8 and math.md §9.2; (docs/algorithms/math.md, Notation)\n"
        "[math.md §3](math.md#3-clip-bounds)"
    )
    assert reference_problems("docs/algorithms/x.md", ok, sections, anchors, True) == []
    bad = "math.md §7\nmath.md §9.3\nmath.md §4–§6\n[math.md §3](math.md#4-nope)\n[m](../math.md)"
    got = reference_problems("docs/algorithms/x.md", bad, sections, anchors, False)
    assert got == [
        "docs/algorithms/x.md:1: math.md §7 does not exist",
        "docs/algorithms/x.md:2: math.md §9.3 does not exist",
        "docs/algorithms/x.md:3: math.md §6 does not exist",
        "docs/algorithms/x.md:4: math.md has no heading with anchor #4-nope",
        "docs/algorithms/x.md:5: link '../math.md' does not lead to docs/algorithms/math.md",
    ]
    assert reference_problems("x.py", "(docs/algorithms/math.md, Notation)", sections, anchors, False) == [
        "x.py:1: math.md has no Notation section"
    ]
    assert _expand("§1–§3, §8") == ["1", "2", "3", "8"] and _expand("§9.2") == ["9.2"]
    assert slug("9. Identities") == "9-identities" and slug("1. Token groups") == "1-token-groups"


# Files that only the third-party packages have (a vendored copy, under any folder, holds one of these)
VENDORED = [
    re.compile(p)
    for p in (
        r"(^|/)nemo_rl/algorithms/grpo\.py$",
        r"(^|/)nemo_rl/package_info\.py$",
        r"(^|/)megatron/core/",
        r"(^|/)megatron/bridge/",
        r"(^|/)nemo_automodel/",
        r"(^|/)3rdparty/",
    )
]
ARCHIVES = re.compile(r"\.(tar|tgz|gz|bz2|xz|zst|zip|whl|7z|sqsh|squashfs)$")
# (spelled in two parts so that this file does not carry the header it looks for)
THIRD_PARTY_HEADER = re.compile(r"Copyright \(c\) 20\d\d,? NVIDIA " + "CORPORATION")


def _head(f: str) -> str:
    path = ROOT / f
    return path.read_text(errors="replace")[:2000] if path.is_file() and not path.is_symlink() else ""


def vendored_code(files: list[str], read=_head) -> list[str]:
    """The tracked files that look like third-party code: a vendored package's file, an archive, or a
    file with NVIDIA's source header (NeMo-RL, Megatron and Automodel files all carry it)."""
    found = [f for f in files if any(p.search(f) for p in VENDORED) or ARCHIVES.search(f)]
    for f in files:
        if f not in found and f != SELF and THIRD_PARTY_HEADER.search(read(f)[:2000]):
            found.append(f)
    return found


def test_no_third_party_code_is_tracked():
    assert vendored_code(_tracked_files()) == []


def test_vendored_code_check_finds_each_kind():
    """The check above can fail: each kind of vendored file is found (paths and contents made here)."""
    header = "# Copyright (c) 2025, NVIDIA " + "CORPORATION.  All rights reserved.\nimport torch\n"
    files = {
        "vendor/nemo-rl/nemo_rl/algorithms/grpo.py": "",
        "third/megatron/core/parallel_state.py": "",
        "src/megatron/bridge/__init__.py": "",
        "x/nemo_automodel/__init__.py": "",
        "snap/nemo-rl-v0.7.0.tar.gz": "",
        "tests/helpers/copied_loss.py": header,
        "nemo_granular/nemo_rl/compat.py": "# ours\n",
    }
    found = vendored_code(list(files), read=files.__getitem__)
    assert sorted(found) == sorted(f for f in files if f != "nemo_granular/nemo_rl/compat.py")
