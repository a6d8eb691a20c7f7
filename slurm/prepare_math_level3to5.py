#!/usr/bin/env python3
"""Write the SSPO paper's training data (MATH, levels 3-5) and MATH-500 as ``{problem, answer}`` JSONL.

    python slurm/prepare_math_level3to5.py --out $NG_DATA_DIR      # default ./data

Writes ``math_level3to5_train.jsonl`` and ``math500_test.jsonl``, used by
``examples/configs/{sspo,grpo,gspo}_qwen2.5_math_{1.5b,7b}.yaml`` through NeMo-RL's
``ResponseDataset`` (``input_key: problem``, ``output_key: answer``), and ``math500.jsonl``, the
same MATH-500 rows under the name ``eval-checkpoints --data-dir`` reads (``nemo-granular
stage-benchmarks`` writes the other benchmarks). NeMo-RL's math verifier wraps the ground truth in
``\\boxed{}``, so ``answer`` is the content of the LAST ``\\boxed{...}`` of the reference solution
(braces matched, not a regex). Needs the ``datasets`` package (present in NeMo-RL's environment)
and the Hugging Face Hub (or its cache, or ``--mirror DIR``: local copies ``DIR/<owner>/<name>``).
A file already written is kept (rerun to resume); files are written to a temporary name first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

TRAIN_SOURCE = ("EleutherAI/hendrycks_math", ["algebra", "counting_and_probability", "geometry",
                                               "intermediate_algebra", "number_theory", "prealgebra", "precalculus"])
TRAIN_FILE = "math_level3to5_train.jsonl"
VAL_FILE = "math500_test.jsonl"       # the training configs' validation set (MATH-500)
LEVELS = {"Level 3", "Level 4", "Level 5"}


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, j = 1, i
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[i:j - 1].strip() if depth == 0 else None


def _staging():
    try:
        from nemo_granular.evals import staging
    except ImportError:  # run from a checkout that is not installed: its own package
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from nemo_granular.evals import staging
    return staging


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("NG_DATA_DIR", "data"))
    ap.add_argument("--mirror", default=None, help="read the datasets from local copies DIR/<owner>/<name>")
    args = ap.parse_args(argv)
    try:
        from datasets import load_dataset
    except ImportError:
        print("prepare_math_level3to5: needs the `datasets` package (pip install datasets)", file=sys.stderr)
        return 2
    staging = _staging()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    try:  # MATH-500 once, from the benchmark source eval-checkpoints uses; the training configs' name too
        staging.stage(["math500"], out, mirror=Path(args.mirror) if args.mirror else None)
        val = (out / "math500.jsonl").read_text()
        if (out / VAL_FILE).exists():
            staging.check_staged(out / VAL_FILE)
        else:
            staging.write_new(out / VAL_FILE, val)
    except (ValueError, OSError) as err:
        print(f"prepare_math_level3to5: {str(err).splitlines()[0]}", file=sys.stderr)
        return 2
    if (out / TRAIN_FILE).exists():
        print(f"{out / TRAIN_FILE} exists, kept")
        return 0
    train, skipped = [], 0
    name, subsets = TRAIN_SOURCE
    if args.mirror:
        name = str(Path(args.mirror) / name)
    for subset in subsets:
        for ex in load_dataset(name, subset, split="train"):
            if ex["level"] not in LEVELS:
                continue
            ans = last_boxed(ex["solution"])
            if ans is None:
                skipped += 1
                continue
            train.append({"problem": ex["problem"], "answer": ans, "level": ex["level"], "type": ex["type"]})
    staging.write_new(out / TRAIN_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in train))
    print(f"wrote {len(train)} training problems (levels 3-5; {skipped} without a boxed answer skipped) "
          f"to {out / TRAIN_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
