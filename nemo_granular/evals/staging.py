"""``nemo-granular stage-benchmarks --suite espo|sspo|sppo|all --data-dir DIR``: every benchmark of
the papers' suites as ``DIR/<key>.jsonl``, for nodes without internet.

Each file holds one ``{"problem": ..., "answer": ...}`` object per line, the name
``eval-checkpoints --data-dir DIR`` reads for every benchmark (:func:`.nemo_rl.benchmark_data`:
a staged file replaces NeMo-RL's own loader, so AIME24, AIME25 and MATH500 need no Hugging Face
cache either; NeMo-RL's MATH500 loader downloads a CSV from a URL, which no cache pre-stages).
Sources (:data:`SOURCES`) are read with ``datasets.load_dataset`` from the Hub (or its cache), or
from a local copy of each dataset repository with ``--mirror DIR`` (``DIR/<owner>/<name>``, as
``huggingface-cli download --repo-type dataset <owner>/<name> --local-dir DIR/<owner>/<name>``
writes it).

Never loses work: a file is written to a temporary name and linked into place only if no file of
that name exists (never replaced); a benchmark already staged is checked (one problem per line,
``problem``/``answer``) and kept, so an interrupted staging resumes where it stopped.
``DIR/benchmarks.json`` records each file's source, problem count and SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

from .. import atomic
from .suite import BENCHMARKS, SUITES, protocols_for

MANIFEST = "benchmarks.json"


@dataclass(frozen=True)
class Source:
    repo: str  # Hugging Face dataset id
    split: str
    problem: str  # column holding the question
    answer: str  # column holding the final answer (what the verifier compares)
    configs: tuple = (None,)  # dataset configs, concatenated in this order
    problems: int | None = None  # the benchmark's size (a different count is reported)


SOURCES: dict[str, Source] = {
    "aime24": Source("HuggingFaceH4/aime_2024", "train", "problem", "answer", problems=30),  # NeMo-RL's AIME2024
    "aime25": Source(
        "opencompass/AIME2025", "test", "question", "answer", ("AIME2025-I", "AIME2025-II"), problems=30
    ),  # NeMo-RL's AIME2025
    "amc23": Source("math-ai/amc23", "test", "question", "answer", problems=40),
    "math500": Source("HuggingFaceH4/MATH-500", "test", "problem", "answer", problems=500),
    "minerva_math": Source("math-ai/minervamath", "test", "question", "answer", problems=272),
    "olympiadbench": Source("math-ai/olympiadbench", "test", "question", "answer", problems=675),
    "hmmt25": Source("MathArena/hmmt_feb_2025", "train", "problem", "answer", problems=30),
}
assert set(SOURCES) == set(BENCHMARKS)


def suite_benchmarks(suite: str) -> list[str]:
    """The benchmark keys of a suite (``all``: the union), in suite order."""
    keys: list[str] = []
    for proto in protocols_for(suite):
        keys += [k for k in proto.benchmarks if k not in keys]
    return keys


def staged_path(data_dir: Path, key: str) -> Path:
    """The file ``eval-checkpoints --data-dir`` reads for ``key``."""
    return Path(data_dir) / f"{key}.jsonl"


def answer_text(value) -> str:
    """A final answer as the verifier's string: numbers as text, a one-element list unwrapped, an
    answer in ``$...$`` unwrapped."""
    if isinstance(value, (list, tuple)):
        value = value[0] if len(value) == 1 else ", ".join(answer_text(v) for v in value)
    text = str(value).strip()
    if len(text) > 1 and text.startswith("$") and text.endswith("$"):
        text = text.strip("$").strip()
    return text


def check_staged(path: Path) -> int:
    """Problems in a staged file; a one-line ``ValueError`` naming the file and line otherwise."""
    n = 0
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ok = isinstance(row, dict) and isinstance(row.get("problem"), str) and "answer" in row
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"{path}:{i}: not a staged benchmark line (a JSON object with 'problem' and 'answer')")
            n += 1
    if n == 0:
        raise ValueError(f"{path}: no problems")
    return n


def load_rows(key: str, mirror: Path | None = None, load_dataset: Callable | None = None) -> list[dict]:
    """``{"problem", "answer"}`` rows of benchmark ``key`` from its source (or the mirror's copy)."""
    if load_dataset is None:
        from datasets import load_dataset
    src = SOURCES[key]
    where = src.repo
    if mirror is not None:
        where = str(Path(mirror) / src.repo)
        if not Path(where).is_dir():
            raise FileNotFoundError(f"--mirror: no {where} (a local copy of the dataset {src.repo})")
    rows = []
    for config in src.configs:
        try:
            ds = load_dataset(where, config, split=src.split)
        except Exception as err:  # noqa: BLE001 - offline without a cache, unknown split, bad files: one line
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(
                f"{key}: cannot load {src.repo}{f' ({config})' if config else ''} split {src.split!r}: {text}"
            ) from None
        missing = [c for c in (src.problem, src.answer) if c not in ds.column_names]
        if missing:
            raise ValueError(f"{key}: {src.repo} has no column {missing[0]!r} (columns: {', '.join(ds.column_names)})")
        rows += [{"problem": str(ex[src.problem]), "answer": answer_text(ex[src.answer])} for ex in ds]
    if not rows:
        raise ValueError(f"{key}: {src.repo} split {src.split!r} is empty")
    return rows


def write_new(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, never replacing a file (``FileExistsError``)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if path exists: no silent overwrite, even in a race
    finally:
        tmp.unlink(missing_ok=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write_manifest(data_dir: Path, entries: Mapping[str, dict]) -> None:
    path = data_dir / MANIFEST
    data = {}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            raise ValueError(f"{path}: not valid JSON (remove it; the staged files are kept)") from None
    data.update(entries)
    # our own index, merged: no staged data is replaced
    atomic.write_text(path, json.dumps(dict(sorted(data.items())), indent=1) + "\n")


def stage(
    keys: list[str], data_dir: Path, *, mirror: Path | None = None, load_dataset: Callable | None = None, log=print
) -> dict[str, Path]:
    """Stage each benchmark of ``keys`` into ``data_dir``; returns {key: file}."""
    data_dir = Path(data_dir)
    if load_dataset is None and any(not staged_path(data_dir, k).exists() for k in keys):
        require_datasets()  # before anything is created: no empty --data-dir left behind
    data_dir.mkdir(parents=True, exist_ok=True)
    done: dict[str, Path] = {}
    manifest: dict[str, dict] = {}
    try:
        for key in keys:
            path = staged_path(data_dir, key)
            src = SOURCES[key]
            if path.exists():
                n = check_staged(path)
                log(f"{key}: {path} ({n} problems) already staged, kept")
                done[key] = path
                continue
            rows = load_rows(key, mirror, load_dataset)
            write_new(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
            note = "" if src.problems in (None, len(rows)) else f" (expected {src.problems}: check the source)"
            log(f"{key}: {path} ({len(rows)} problems from {src.repo}){note}")
            manifest[key] = {
                "file": path.name,
                "problems": len(rows),
                "sha256": _sha256(path),
                **{k: v for k, v in asdict(src).items() if k != "problems"},
                "configs": [c for c in src.configs if c],
            }
            done[key] = path
    finally:
        if manifest:
            _write_manifest(data_dir, manifest)
    return done


OFFLINE_VARS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
DATASETS_REQUIREMENT = "datasets>=4.0.0"  # what stage-benchmarks reads the sources with (NeMo-RL's own pin)


def offline_vars(env: Mapping[str, str] = os.environ) -> list[str]:
    """Those of Hugging Face's offline switches that are set in ``env``."""
    return [v for v in OFFLINE_VARS if str(env.get(v, "")).strip().lower() in ("1", "true", "yes", "on")]


def offline(env: Mapping[str, str] = os.environ) -> bool:
    """Hugging Face's offline switches (``HF_HUB_OFFLINE`` / ``HF_DATASETS_OFFLINE``)."""
    return bool(offline_vars(env))


def require_datasets() -> None:
    """The ``datasets`` library that reads the sources, or one line naming it and the command that installs it
    into this interpreter."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ImportError(
            f"stage-benchmarks needs the Python package 'datasets' (not installed for {sys.executable}): "
            f"{shlex.join([sys.executable, '-m', 'pip', 'install', DATASETS_REQUIREMENT])}"
        ) from None


def staging_problems(
    suite: str, data_dir: Path | None, env: Mapping[str, str] = os.environ, keys=None, assume_offline: bool = False
) -> list[str]:
    """One line per benchmark of ``suite`` (those in ``keys`` only, when given) that an eval job
    could not load: no staged file where NeMo-RL has no loader, or none while offline (NeMo-RL's
    loaders download), or a bad file. ``assume_offline``: judge as for a node without internet
    (``--check``), whatever ``env`` says; each line says which of the two it is."""
    out = []
    set_vars = offline_vars(env)
    if set_vars:
        why_offline = f"{'/'.join(set_vars)} {'is' if len(set_vars) == 1 else 'are'} set"
    else:
        why_offline = "an eval node without internet (as --check assumes)"
    hint = f"nemo-granular stage-benchmarks --suite {suite} --data-dir {data_dir or 'DIR'}"
    for key in suite_benchmarks(suite):
        if keys is not None and key not in keys:
            continue
        path = staged_path(data_dir, key) if data_dir is not None else None
        if path is not None and path.exists():
            try:
                check_staged(path)
            except (OSError, ValueError) as err:
                out.append(str(err).splitlines()[0])
            continue
        where = f"no {path}" if path is not None else "no --data-dir"
        if BENCHMARKS[key].builtin is None:
            out.append(f"{key}: {where} and NeMo-RL has no loader for it; stage it: {hint}")
        elif set_vars or assume_offline:
            out.append(
                f"{key}: {where} and {why_offline}, where NeMo-RL's "
                f"{BENCHMARKS[key].builtin} loader downloads; stage it: {hint}"
            )
    return out


def staging_refusal(suite: str, data_dir: Path | None, env: Mapping[str, str] = os.environ) -> str | None:
    """:func:`staging_problems` as ONE line (``slurm/submit_comparison.sh`` refuses to submit eval
    jobs with it): the benchmarks missing and the command that stages them; None when none is."""
    missing, bad = [], []
    for key in suite_benchmarks(suite):
        path = staged_path(data_dir, key) if data_dir is not None else None
        if path is not None and path.exists():
            try:
                check_staged(path)
            except (OSError, ValueError) as err:
                bad.append(str(err).splitlines()[0])
        elif BENCHMARKS[key].builtin is None or offline(env):
            missing.append(key)
    if bad:
        return bad[0]
    if not missing:
        return None
    where = f"not staged in {data_dir}" if data_dir is not None else "no --data-dir"
    why = "HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set" if offline(env) else "NeMo-RL has no loader"
    fix = f"nemo-granular stage-benchmarks --suite {suite} --data-dir {data_dir or 'DIR'}"
    if data_dir is None:
        fix += ' and --eval-args "--data-dir DIR"'
    return f"--eval-suite {suite}: {', '.join(missing)}: {where} ({why}); run {fix}"


def build_parser():
    from ..cli_common import ArgumentParser

    ap = ArgumentParser(
        prog="nemo-granular stage-benchmarks",
        description="Write every benchmark of the papers' suites as DIR/<key>.jsonl "
        "(problem/answer), the files `eval-checkpoints --data-dir DIR` reads offline.",
    )
    ap.add_argument("--suite", default="all", choices=SUITES, help="which suite's benchmarks (default: all)")
    ap.add_argument("--data-dir", required=True, help="where to write <key>.jsonl (created if missing)")
    ap.add_argument(
        "--mirror", default=None, help="read each dataset from a local copy DIR/<owner>/<name> instead of the Hub"
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if an eval job of --suite could not load a benchmark offline",
    )
    return ap


def main(argv: list[str]) -> int:
    from ..cli_common import check_writable_dir

    args = build_parser().parse_args(argv)
    data_dir = Path(args.data_dir)
    if data_dir.exists() and not data_dir.is_dir():
        raise NotADirectoryError(f"--data-dir {data_dir}: is a file, not a directory")
    if args.check:
        problems = staging_problems(args.suite, data_dir, assume_offline=True)
        for p in problems:
            print(f"stage-benchmarks: {p}", file=sys.stderr)
        if not problems:
            print(f"{args.suite}: every benchmark staged in {data_dir}")
        return 1 if problems else 0
    check_writable_dir(data_dir, "--data-dir")
    stage(
        suite_benchmarks(args.suite),
        data_dir,
        mirror=Path(args.mirror) if args.mirror else None,
        log=lambda m: print(m, flush=True),
    )
    return 0
