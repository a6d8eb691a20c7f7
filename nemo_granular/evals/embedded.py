"""The benchmark suites in the embedded trainer: every checkpoint of a run on local JSONL files.

Benchmark files hold one JSON object per line with the question under ``problem`` (or ``prompt``)
and the reference under ``answer`` (or ``expected_answer``). By default a run is evaluated on
held-out synthetic sets of three difficulty levels, written to ``<run>/benchmarks/`` from the
run's own task and seed (:func:`write_synthetic_benchmarks`):

- ``sum{n-1}``: sums of n−1 terms (shorter than any training prompt: none was trained on),
- ``sum{n}_heldout``: the task's held-out split (the training stream never draws it),
- ``sum{n+1}``: sums of n+1 terms (longer than any training prompt), with more new tokens.

Scores are avg@k: the mean of the 0/1 verifier reward over every sample of every problem,
sampled with the protocol's temperature (greedy at 0). Step 0 is the policy the RL run started
from (``model.init_from``, the warm start in ``nemo-granular compare``).

With a score cache (``--score-cache DIR``; ``compare`` gives one to every run) a score is stored under a
key of everything that determines it (:func:`score_key`: the policy's and tokenizer's files, the
benchmark file, the setting, the generation length, the sampling seed, the answer pattern, the code that
generates and verifies, the thread count and the library versions) and read back instead of being
computed again: in ``compare`` the algorithms of one seed start from the same warm start, so its step 0
is scored once per seed, not once per run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .. import atomic
from .results import check_steps, merge_write
from .suite import Protocol, Setting

SYNTHETIC_SIZE = 64


def read_benchmark(path: Path) -> list[tuple[str, str]]:
    """(question, answer) pairs of a JSONL benchmark; a one-line error names the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {path}: no such file")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            q = obj["problem"] if "problem" in obj else obj["prompt"]
            a = obj["answer"] if "answer" in obj else obj["expected_answer"]
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f"{path}:{n}: expected a JSON object with 'problem' (or 'prompt') and 'answer' (or 'expected_answer')"
            ) from None
        rows.append((str(q), str(a).strip()))
    if not rows:
        raise ValueError(f"{path}: no problems")
    return rows


def write_synthetic_benchmarks(
    out: Path, num_terms: int, max_term: int, seed: int, heldout_size: int = 128, size: int = SYNTHETIC_SIZE
) -> dict[str, Path]:
    """The three held-out difficulty levels for a run of the arithmetic task (deterministic in
    (num_terms, max_term, seed)); returns {benchmark key: file}."""
    from ..embedded.task import ArithmeticTask

    out.mkdir(parents=True, exist_ok=True)
    task = ArithmeticTask(num_terms, max_term, seed, heldout_size)
    files = {}
    levels = [(num_terms - 1, "")] if num_terms > 2 else []
    levels += [(num_terms, "_heldout"), (num_terms + 1, "")]
    for terms, suffix in levels:
        key = f"sum{terms}{suffix}"
        if terms == num_terms:
            problems = task.heldout
        else:
            g = torch.Generator().manual_seed(1_000_003 * seed + 97 * terms + 5)
            # unique problems of this length: the first `size` distinct draws
            pool = torch.unique(torch.randint(1, max_term + 1, (size * 4, terms), generator=g), dim=0)
            pool = pool[torch.randperm(pool.shape[0], generator=g)][:size]
            problems = [task.make(t) for t in pool.tolist()]
        path = out / f"{key}.jsonl"
        atomic.write_text(path, "".join(json.dumps({"problem": p.prompt, "answer": p.answer}) + "\n" for p in problems))
        files[key] = path
    return files


@torch.no_grad()
def score(
    model,
    tokenizer,
    problems: list[tuple[str, str]],
    setting: Setting,
    max_new_tokens: int,
    *,
    seed: int,
    answer_pattern=None,
    device=None,
    batch_size: int = 512,
) -> float:
    """avg@k accuracy: every problem ``setting.samples`` times, greedy when temperature is 0."""
    from ..embedded.rollout import generate
    from ..embedded.task import ANSWER_RE, verify
    from ..embedded.warmstart import decode_responses

    device = device or torch.device("cpu")
    greedy = setting.temperature == 0
    k = 1 if greedy else setting.samples  # greedy samples are identical: one is the avg@k
    prompts = [q for q, _ in problems for _ in range(k)]
    answers = [a for _, a in problems for _ in range(k)]
    torch.manual_seed(seed)
    was_training = model.training
    model.eval()
    correct = 0.0
    for i in range(0, len(prompts), batch_size):
        gen = generate(
            model,
            tokenizer,
            prompts[i : i + batch_size],
            max_new_tokens=max_new_tokens,
            temperature=setting.temperature or 1.0,
            greedy=greedy,
            device=device,
        )
        rewards, _ = verify(decode_responses(tokenizer, gen), answers[i : i + batch_size], answer_pattern or ANSWER_RE)
        correct += rewards.sum().item()
    model.train(was_training)
    return correct / len(prompts)


# source files whose code determines a score (generation, decoding, verification, the model classes)
_SCORE_SOURCES = (
    ("evals", "embedded.py"),
    ("embedded", "rollout.py"),
    ("embedded", "task.py"),
    ("embedded", "warmstart.py"),
    ("embedded", "models.py"),
)


def _hash_files(h, root: Path) -> None:
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + b"\0")
        h.update(f.read_bytes())
        h.update(b"\0")


def score_key(
    policy: Path, tokenizer: Path, benchmark: Path, setting: Setting, max_new_tokens: int, seed: int, answer_pattern
) -> str:
    """The cache key of one :func:`score`: a hash of every input it reads and of the code and versions that
    compute it (the contents of the files, not their paths; results are reproducible at a fixed thread count)."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256()
    for root in (policy, tokenizer):
        _hash_files(h, Path(root))
    h.update(Path(benchmark).read_bytes())
    here = Path(__file__).resolve().parents[1]
    versions = {}
    for pkg in ("torch", "transformers", "tokenizers"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    pattern = getattr(answer_pattern, "pattern", answer_pattern)
    h.update(
        json.dumps(
            {
                "setting": [setting.samples, setting.temperature, setting.top_p],
                "max_new_tokens": max_new_tokens,
                "seed": seed,
                "answer_pattern": pattern,
                "threads": torch.get_num_threads(),
                "versions": versions,
                "code": [hashlib.sha256((here / d / f).read_bytes()).hexdigest() for d, f in _SCORE_SOURCES],
            },
            sort_keys=True,
        ).encode()
    )
    return h.hexdigest()[:32]


def _cached_score(cache: Path | None, key: str | None) -> float | None:
    if cache is None or key is None:
        return None
    try:
        value = json.loads((cache / f"{key}.json").read_text())["score"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) else None


def _policy_dirs(run: Path, cfg: dict) -> dict[int, Path]:
    from ..embedded.checkpoint import STEP_RE, step_dirs

    dirs = {int(STEP_RE.fullmatch(p.name).group(1)): p / "policy" for p in step_dirs(run / "checkpoints")}
    init = (cfg.get("model") or {}).get("init_from")
    if 0 not in dirs and init and Path(init).is_dir():
        dirs[0] = Path(init)
    return dirs


def available_steps(run: Path) -> list[int]:
    """The steps of an embedded run that can be evaluated (its checkpoints, and step 0 from ``model.init_from``)."""
    import yaml

    cfg_path = Path(run) / "config.yaml"
    cfg = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.is_file() else {}
    return sorted(_policy_dirs(Path(run), cfg))


def evaluate_run(
    run: Path,
    protocols: list[Protocol],
    benchmark_files: dict[str, Path] | None = None,
    max_samples: int | None = None,
    log=print,
    steps: list[int] | None = None,
    score_cache: Path | None = None,
) -> dict:
    """Evaluate the checkpoints each protocol asks for (best: every ``every``-th step; last: step 0
    and the last) on the benchmark files; merge the scores into ``<run>/evals.json``. ``max_samples``
    caps the samples per problem (CPU time); the table states the number used. ``steps``: exactly
    these checkpoints for every protocol (each must exist: a one-line error names those that do).
    When the run's final step (``rl.steps``) has no checkpoint, one line says so and which step is
    evaluated as the last, and each protocol's ``select_note`` in evals.json records it. ``score_cache``: a
    directory of scores by :func:`score_key`, read before and written after each score."""
    import yaml

    from ..embedded.models import load_pretrained_policy, load_tokenizer, tokenizer_dir

    run = Path(run)
    cfg_path = run / "config.yaml"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{run}: no config.yaml (not an embedded run directory)")
    cfg = yaml.safe_load(cfg_path.read_text()) or {}
    task, rl = cfg.get("task") or {}, cfg.get("rl") or {}
    seed = int(cfg.get("seed", 0))
    policies = _policy_dirs(run, cfg)
    if not policies:
        raise FileNotFoundError(f"{run}: no checkpoints/step_N and no model.init_from to evaluate")
    have = sorted(policies)
    check_steps(run, steps, have)
    if benchmark_files is None:
        if task.get("kind", "arithmetic") != "arithmetic":
            raise ValueError(f"{run}: a JSONL-task run needs --benchmark NAME=FILE (no synthetic default)")
        benchmark_files = write_synthetic_benchmarks(
            run / "benchmarks",
            int(task.get("num_terms", 4)),
            int(task.get("max_term", 9)),
            seed,
            int(task.get("heldout_size", 128)),
        )
    sets = {k: read_benchmark(Path(p)) for k, p in benchmark_files.items()}
    base_tokens = int(rl.get("max_new_tokens", 32))
    num_terms = int(task.get("num_terms", 4))
    new_tokens = {k: base_tokens + (12 if k == f"sum{num_terms + 1}" else 0) for k in sets}
    final = rl.get("steps")
    missing_final = ""
    if isinstance(final, int) and final > have[-1]:
        missing_final = (
            f"the run's final checkpoint (step {final}, rl.steps) is missing: step {have[-1]} is evaluated as the last"
        )
        log(f"[evals {run.name}] note: {missing_final}")
    cache: dict = {}
    memo: dict = {}
    data = {}
    for proto in protocols:
        if steps is not None:
            chosen = sorted(set(steps))
        elif proto.select == "best":
            chosen = sorted({s for s in have if proto.every is None or s % proto.every == 0} | {have[-1]})
        else:
            chosen = sorted({have[0], have[-1]})
        setting = proto.default
        if max_samples is not None and setting.samples > max_samples:
            setting = Setting(max_samples, setting.temperature, setting.top_p)
        benches = {
            k: {
                "label": k,
                "problems": len(v),
                "samples_per_problem": setting.samples,
                "decoding": setting.decoding + f", ≤{new_tokens[k]} new tokens",
                "metric": setting.metric,
                "max_new_tokens": new_tokens[k],
                "file": str(benchmark_files[k]),
            }
            for k, v in sets.items()
        }
        results = {}
        for step in chosen:
            results[step], reused = {}, 0
            for k, v in sets.items():  # a protocol with the same setting (e.g. capped samples) reuses the score
                memo_key = (step, k, setting)
                if memo_key not in memo:
                    path = policies[step]
                    key = None
                    if score_cache is not None:
                        key = score_key(
                            path,
                            Path(tokenizer_dir(str(path))),
                            Path(benchmark_files[k]),
                            setting,
                            new_tokens[k],
                            seed * 1009 + step,
                            task.get("answer_pattern"),
                        )
                    memo[memo_key] = _cached_score(score_cache, key)
                    if memo[memo_key] is not None:
                        reused += 1
                    else:
                        if step not in cache:  # loaded only for a score that is computed
                            cache.clear()  # one model in memory at a time
                            cache[step] = (load_pretrained_policy(str(path)), load_tokenizer(tokenizer_dir(str(path))))
                        model, tok = cache[step]
                        memo[memo_key] = score(
                            model,
                            tok,
                            v,
                            setting,
                            new_tokens[k],
                            seed=seed * 1009 + step,
                            answer_pattern=task.get("answer_pattern"),
                        )
                        if key is not None:
                            score_cache.mkdir(parents=True, exist_ok=True)
                            atomic.write_text(score_cache / f"{key}.json", json.dumps({"score": memo[memo_key]}))
                results[step][k] = memo[memo_key]
            log(
                f"[evals {run.name}] {proto.name} step {step}: "
                + ", ".join(f"{k} {s:.3f}" for k, s in results[step].items())
                + (f" ({reused} from the score cache)" if reused else "")
            )
        data = merge_write(
            run / "evals.json",
            run.name,
            "embedded",
            proto.name,
            {
                "description": proto.description + " — embedded: on the held-out synthetic levels",
                "select": proto.select,
                "select_note": "; ".join(n for n in (proto.select_note, missing_final) if n),
                "every": proto.every,
            },
            benches,
            results,
        )
    return data
