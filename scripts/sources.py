"""The source cache: NeMo-RL and the Megatron / Automodel sources it pins, at the supported commits.

    python3 scripts/sources.py [--from DIR]... [--cache DIR] [--world main|v0.7.0]   fill the cache
    python3 scripts/sources.py env WORLD      shell `export` lines for that world's trees (exit 3: absent)
    python3 scripts/sources.py status         one line per world: present, or what is missing

(``bash scripts/sources.sh`` is the same command.) The pins are in ``scripts/sources.pins``. Each tree is
``git archive``d at its commit into ``<cache>/<name>-<commit[:12]>`` (default cache:
``${XDG_CACHE_HOME:-$HOME/.cache}/nemo-granular/sources``, or ``NEMO_GRANULAR_SOURCES``), from a ``git clone``
of its public repository, or, with ``--from DIR``, from the git directories (bare mirrors or checkouts) found
in DIR. A tree is written to a temporary folder and renamed into place, so a half-written tree is never used;
it records the commit it holds and the submodule commits it pins (``.nemo-granular-source.json``); a rerun
leaves present trees alone, and a tree whose recorded commit is not its pin is refused in one line.
Standard library only: it runs before any virtual environment exists.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PINS = Path(__file__).resolve().with_name("sources.pins")
RECORD = ".nemo-granular-source.json"
SOURCE_VARS = ("NEMO_RL_SRC", "MEGATRON_BRIDGE_SRC", "MEGATRON_LM_SRC", "AUTOMODEL_SRC")
# the folder each variable names inside its tree (Megatron-Bridge's package lives under src/)
SUBDIR = {"MEGATRON_BRIDGE_SRC": "src"}
COMMIT = re.compile(r"[0-9a-f]{40}")


class SourceError(Exception):
    """A one-line refusal (exit 2)."""


@dataclass(frozen=True)
class Pin:
    name: str
    repository: str  # owner/name on GitHub
    revision: str  # a commit, tag=commit, or gitlink:TREE:PATH
    paths: tuple[str, ...]


def read_pins(path: Path = PINS) -> tuple[dict[str, Pin], dict[str, list[list[str]]]]:
    """The pins (name -> Pin, in file order) and the worlds (name -> per variable, its alternatives)."""
    pins: dict[str, Pin] = {}
    worlds: dict[str, list[list[str]]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if fields[0] == "world":
            if len(fields) != 2 + len(SOURCE_VARS):
                raise SourceError(f"{path}:{number}: a world line names {len(SOURCE_VARS)} trees")
            worlds[fields[1]] = [alt.split("|") for alt in fields[2:]]
        else:
            if len(fields) < 4:
                raise SourceError(f"{path}:{number}: expected NAME REPOSITORY REVISION PATH...")
            pins[fields[0]] = Pin(fields[0], fields[1], fields[2], tuple(fields[3:]))
    for world, trees in worlds.items():
        for name in (n for alts in trees for n in alts):
            if name not in pins:
                raise SourceError(f"{path}: world {world} names {name}, which has no pin")
    return pins, worlds


def default_cache() -> Path:
    if os.environ.get("NEMO_GRANULAR_SOURCES"):
        return Path(os.environ["NEMO_GRANULAR_SOURCES"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nemo-granular" / "sources"


def _git(git_dir: Path, *args: str, binary: bool = False) -> subprocess.CompletedProcess:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], capture_output=True, text=not binary)


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def find_git_dirs(roots: list[Path], depth: int = 3) -> list[Path]:
    """Git directories (bare mirrors, or a checkout's .git) at most ``depth`` levels below each root."""
    found: list[Path] = []
    for root in roots:
        if not root.is_dir():
            raise SourceError(f"--from {root}: not a folder")
        level = [root]
        for _ in range(depth + 1):
            below = []
            for folder in level:
                if _is_git_dir(folder):
                    found.append(folder)
                elif _is_git_dir(folder / ".git"):
                    found.append(folder / ".git")
                else:
                    below += sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            level = below
    return found


class Cache:
    def __init__(self, root: Path, pins: dict[str, Pin], git_dirs: list[Path] | None, clone_dir: Path):
        self.root, self.pins, self.git_dirs, self.clone_dir = root, pins, git_dirs, clone_dir
        self._commits: dict[str, str | None] = {}

    # -- where a tree is, and which commit it must hold --------------------------------------------
    def tree(self, name: str, commit: str) -> Path:
        return self.root / f"{name}-{commit[:12]}"

    def record(self, tree: Path) -> dict:
        return json.loads((tree / RECORD).read_text())

    def commit(self, name: str) -> str | None:
        """The commit ``name`` is pinned at; None when its gitlink's tree cannot be had."""
        if name not in self._commits:
            revision = self.pins[name].revision
            if revision.startswith("gitlink:"):
                _, parent, path = revision.split(":", 2)
                parent_tree = self.present(parent)
                self._commits[name] = self.record(parent_tree)["gitlinks"].get(path) if parent_tree else None
            else:
                commit = revision.split("=")[-1]
                if not COMMIT.fullmatch(commit):
                    raise SourceError(f"{PINS}: {name}: revision {revision} is not a 40-digit commit")
                self._commits[name] = commit
        return self._commits[name]

    def present(self, name: str) -> Path | None:
        """The cached tree of ``name`` at its pin, or None; a tree recording another commit is refused."""
        commit = self.commit(name)
        if commit is None:
            return None
        tree = self.tree(name, commit)
        if not tree.is_dir():
            return None
        try:
            held = self.record(tree)["commit"]
        except (OSError, ValueError, KeyError):
            raise SourceError(f"{tree}: no readable {RECORD}: not a tree this command wrote; remove it") from None
        if held != commit:
            raise SourceError(f"{tree}: holds {held}, but {name} is pinned at {commit}; remove it and fill again")
        if tree.stat().st_mode & 0o755 != 0o755:  # a tree written before fill() made it readable by all
            tree.chmod(0o755)
        return tree

    # -- filling ----------------------------------------------------------------------------------
    def _source_of(self, pin: Pin, commit: str) -> Path | None:
        """A git directory that has ``commit``: one of --from's, or a clone of the public repository."""

        def has(git_dir: Path) -> bool:
            return _git(git_dir, "cat-file", "-e", f"{commit}^{{commit}}").returncode == 0

        if self.git_dirs is not None:
            return next((d for d in self.git_dirs if has(d)), None)
        clone = self.clone_dir / (pin.repository.replace("/", "+") + ".git")
        if not clone.is_dir():
            url = f"https://github.com/{pin.repository}.git"
            print(f"sources: cloning {url} (bare, blobs on demand) into {clone}", file=sys.stderr)
            tmp = clone.with_name(clone.name + f".partial-{os.getpid()}")
            shutil.rmtree(tmp, ignore_errors=True)
            done = subprocess.run(["git", "clone", "--quiet", "--bare", "--filter=blob:none", url, str(tmp)])
            if done.returncode != 0:
                shutil.rmtree(tmp, ignore_errors=True)
                raise SourceError(f"cannot clone {url} (offline? give the local git directories with --from DIR)")
            tmp.rename(clone)
        if not has(clone):
            _git(clone, "fetch", "--quiet", "origin", commit)
        return clone if has(clone) else None

    def fill(self, name: str) -> tuple[Path | None, str]:
        """Check ``name`` out at its pin into the cache (once); returns (tree or None, a one-line account)."""
        pin = self.pins[name]
        commit = self.commit(name)
        if commit is None:
            parent = pin.revision.split(":")[1]
            return None, f"{name}: not filled: its pin is a gitlink of {parent}, which is not in the cache"
        tree = self.present(name)
        if tree is not None:
            return tree, f"{name} {commit[:12]}: present at {tree}"
        source = self._source_of(pin, commit)
        if source is None:
            where = "the --from git directories" if self.git_dirs is not None else f"{pin.repository}'s clone"
            return None, f"{name}: commit {commit} ({pin.repository}, {pin.revision}) is not in {where}"
        gitlinks = {}
        for line in _git(source, "ls-tree", "-r", commit).stdout.splitlines():
            mode, kind, sha, path = line.split(None, 3)
            if kind == "commit":
                gitlinks[path] = sha
        tree = self.tree(name, commit)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{tree.name}.partial-", dir=self.root))
        try:
            archive = _git(source, "archive", "--format=tar", commit, *pin.paths, binary=True)
            if archive.returncode != 0:
                raise SourceError(
                    f"{name}: git archive {commit[:12]} {' '.join(pin.paths)} failed in {source}: "
                    f"{archive.stderr.decode(errors='replace').strip().splitlines()[-1:]}"
                )
            subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
            (tmp / RECORD).write_text(
                json.dumps(
                    {
                        "name": name,
                        "repository": pin.repository,
                        "commit": commit,
                        "revision": pin.revision,
                        "paths": list(pin.paths),
                        "gitlinks": gitlinks,
                    },
                    indent=1,
                )
                + "\n"
            )
            # readable by every user, as a checkout is (mkdtemp makes it 0700): the local Slurm cluster's
            # container steps read it from the image as a non-root user (slurm/local_cluster/pyxis)
            tmp.chmod(0o755)
            tmp.rename(tree)  # atomic: the tree appears whole or not at all
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return tree, f"{name} {commit[:12]}: filled {tree} from {source}"

    # -- worlds -----------------------------------------------------------------------------------
    def world(self, trees: list[list[str]]) -> tuple[dict[str, Path], list[str], list[str]]:
        """(variable -> folder, notes on substitutions, what is missing) for one world's trees."""
        env: dict[str, Path] = {}
        notes: list[str] = []
        missing: list[str] = []
        for var, alternatives in zip(SOURCE_VARS, trees):
            for i, name in enumerate(alternatives):
                tree = self.present(name)
                if tree is not None:
                    env[var] = tree / SUBDIR.get(var, "")
                    if i:
                        first = alternatives[0]
                        commit = self.commit(first)
                        notes.append(
                            f"{var}: {first} ({commit[:12] if commit else 'its pin'}) is not in the cache; "
                            f"using {name} ({self.commit(name)[:12]}) in its place"
                        )
                    break
            else:
                commit = self.commit(alternatives[0])
                missing.append(f"{alternatives[0]}" + (f" {commit[:12]}" if commit else ""))
        return env, notes, missing


def _cache(args, git_dirs=None) -> Cache:
    pins, _ = read_pins(Path(args.pins))
    root = Path(args.cache) if args.cache else default_cache()
    return Cache(root, pins, git_dirs, root / ".git-clones")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scripts/sources.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", nargs="?", default="fill", choices=("fill", "env", "status"))
    ap.add_argument("world", nargs="?", help="env: the world (main or v0.7.0)")
    ap.add_argument(
        "--from",
        dest="sources",
        action="append",
        default=None,
        metavar="DIR",
        help="local git directories or mirrors (searched 3 levels deep); default: clone from GitHub",
    )
    ap.add_argument(
        "--cache",
        help="the source cache (default: $NEMO_GRANULAR_SOURCES, or "
        "${XDG_CACHE_HOME:-$HOME/.cache}/nemo-granular/sources)",
    )
    ap.add_argument("--world", dest="only", action="append", help="fill only this world's trees (repeatable)")
    ap.add_argument("--pins", default=str(PINS), help=argparse.SUPPRESS)  # tests: a pins file of their own
    args = ap.parse_args(argv)
    try:
        _, worlds = read_pins(Path(args.pins))
        if args.command == "env":
            if args.world not in worlds:
                raise SourceError(f"env: world {args.world!r} is not one of {', '.join(worlds)}")
            env, notes, missing = _cache(args).world(worlds[args.world])
            if missing:
                print(
                    f"NeMo-RL world {args.world}: not in the source cache {_cache(args).root}: {', '.join(missing)} "
                    f"(fill it: bash scripts/sources.sh, or --from DIR offline)",
                    file=sys.stderr,
                )
                return 3
            if notes:
                print(f"NeMo-RL world {args.world}: {'; '.join(notes)}", file=sys.stderr)
            for var, folder in env.items():
                print(f"export {var}={folder}")
            return 0
        if args.command == "status":
            cache = _cache(args)
            for world, trees in worlds.items():
                _, notes, missing = cache.world(trees)
                state = f"missing {', '.join(missing)}" if missing else "present" + "".join(f"; {n}" for n in notes)
                print(f"{world}: {state}")
            return 0
        git_dirs = find_git_dirs([Path(d) for d in args.sources]) if args.sources else None
        cache = _cache(args, git_dirs)
        names = list(cache.pins)
        if args.only:
            unknown = [w for w in args.only if w not in worlds]
            if unknown:
                raise SourceError(f"--world {unknown[0]!r} is not one of {', '.join(worlds)}")
            wanted = {n for w in args.only for alts in worlds[w] for n in alts}
            names = [n for n in names if n in wanted]
        for name in names:
            _, line = cache.fill(name)
            print(f"sources: {line}")
        for world, trees in worlds.items():
            _, notes, missing = cache.world(trees)
            print(
                f"sources: world {world}: "
                + (
                    f"incomplete, missing {', '.join(missing)}"
                    if missing
                    else "complete" + "".join(f"; {n}" for n in notes)
                )
            )
        return 0
    except SourceError as err:
        print(f"sources: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
