#!/usr/bin/env python3
"""Write the SSPO paper's training data (MATH, levels 3-5) and MATH-500 as ``{problem, answer}`` JSONL.

    python slurm/prepare_math_level3to5.py --out $NG_DATA_DIR      # default ./data

Used by ``examples/configs/{sspo,grpo,gspo}_qwen2.5_math_{1.5b,7b}.yaml`` through NeMo-RL's
``ResponseDataset`` (``input_key: problem``, ``output_key: answer``). NeMo-RL's math verifier
wraps the ground truth in ``\\boxed{}``, so ``answer`` is the content of the LAST ``\\boxed{...}``
of the reference solution (braces matched, not a regex). Needs the ``datasets`` package (present
in NeMo-RL's environment) and access to the Hugging Face Hub (or its cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

TRAIN_SOURCE = ("EleutherAI/hendrycks_math", ["algebra", "counting_and_probability", "geometry",
                                               "intermediate_algebra", "number_theory", "prealgebra", "precalculus"])
VAL_SOURCE = "HuggingFaceH4/MATH-500"
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


def _write_jsonl(rows: list[dict], path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("NG_DATA_DIR", "data"))
    args = ap.parse_args(argv)
    try:
        from datasets import load_dataset
    except ImportError:
        print("prepare_math_level3to5: needs the `datasets` package (pip install datasets)", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    train, skipped = [], 0
    name, subsets = TRAIN_SOURCE
    for subset in subsets:
        for ex in load_dataset(name, subset, split="train"):
            if ex["level"] not in LEVELS:
                continue
            ans = last_boxed(ex["solution"])
            if ans is None:
                skipped += 1
                continue
            train.append({"problem": ex["problem"], "answer": ans, "level": ex["level"], "type": ex["type"]})
    val = [{"problem": ex["problem"], "answer": ex["answer"]} for ex in load_dataset(VAL_SOURCE, split="test")]
    _write_jsonl(train, os.path.join(args.out, "math_level3to5_train.jsonl"))
    _write_jsonl(val, os.path.join(args.out, "math500_test.jsonl"))
    print(f"wrote {len(train)} training problems (levels 3-5; {skipped} without a boxed answer skipped) "
          f"and {len(val)} MATH-500 problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
