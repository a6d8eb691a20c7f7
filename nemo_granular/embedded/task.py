"""A synthetic verifiable task whose worked solutions are blank-line separated steps.

Prompt ``Q:7+5+9+3``; solution ``7+5=12\\n\\n12+9=21\\n\\n21+3=24\\n\\nA:24``. The verifier
reads the final ``A:<int>`` line: reward 1 when it equals the sum, 0 when it does not, and
*verification failed* (ESPO §3.5) when no final answer can be extracted at all. Problems are
a pure function of (seed, index), and the held-out split never overlaps training.
Also loads a user's JSONL file of ``{"prompt": ..., "answer": ...}`` records.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ANSWER_RE = re.compile(r"(?:^|\n)A:\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str = ""


def worked_solution(terms: list[int]) -> str:
    steps, acc = [], terms[0]
    for t in terms[1:]:
        steps.append(f"{acc}+{t}={acc + t}")
        acc += t
    return "\n\n".join(steps + [f"A:{acc}"])


class ArithmeticTask:
    """Sums of ``num_terms`` integers in [1, max_term]; train and held-out splits are disjoint."""

    def __init__(self, num_terms: int = 4, max_term: int = 9, seed: int = 0, heldout_size: int = 128):
        if num_terms < 2 or max_term < 1:
            raise ValueError(f"task: need num_terms >= 2 and max_term >= 1, got {num_terms}, {max_term}")
        self.num_terms, self.max_term, self.seed = num_terms, max_term, seed
        g = torch.Generator().manual_seed(10_007 * seed + 17)
        pool = torch.randint(1, max_term + 1, (heldout_size * 4, num_terms), generator=g)
        uniq = torch.unique(pool, dim=0)
        uniq = uniq[torch.randperm(uniq.shape[0], generator=g)][:heldout_size]
        self._heldout_terms = uniq
        self._heldout_keys = {tuple(r.tolist()) for r in uniq}
        self.heldout = [self.make(r.tolist()) for r in uniq]

    def make(self, terms: list[int]) -> Problem:
        return Problem("Q:" + "+".join(map(str, terms)) + "\n", str(sum(terms)), worked_solution(terms))

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        """n training problems (never in the held-out split), drawn from ``generator``."""
        out: list[Problem] = []
        while len(out) < n:
            terms = torch.randint(1, self.max_term + 1, (2 * n, self.num_terms), generator=generator)
            out += [self.make(t) for t in terms.tolist() if tuple(t) not in self._heldout_keys]
        return out[:n]


class JsonlTask:
    """A user's prompt/answer file: one JSON object per line with ``prompt`` and ``answer``."""

    def __init__(self, path: str, seed: int = 0, heldout_size: int = 128):
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"task.path: no such file {path}")
        rows = []
        for n, line in enumerate(p.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rows.append(Problem(str(obj["prompt"]), str(obj["answer"]).strip(), str(obj.get("solution", ""))))
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise ValueError(f"{path}:{n}: expected a JSON object with 'prompt' and 'answer' ({err})") from None
        if len(rows) < 2:
            raise ValueError(f"{path}: needs at least 2 records, found {len(rows)}")
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(rows), generator=g).tolist()
        k = min(heldout_size, len(rows) // 4 or 1)
        self.heldout = [rows[i] for i in order[:k]]
        self.train = [rows[i] for i in order[k:]]

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        idx = torch.randint(0, len(self.train), (n,), generator=generator).tolist()
        return [self.train[i] for i in idx]


def verify(
    responses: list[str], answers: list[str], pattern: re.Pattern | str = ANSWER_RE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(reward ∈ {0,1}, verification_failed) per response.

    ``pattern``'s first group is the extracted answer (default: a final ``A:<int>`` line; the
    last match counts). Failed ⇒ nothing could be extracted (ESPO's flag), not a wrong answer.
    """
    rx = re.compile(pattern) if isinstance(pattern, str) else pattern
    rewards, failed = [], []
    for text, ans in zip(responses, answers):  # string parsing: per response by nature
        found = rx.findall(text.strip())
        got = found[-1] if found else None
        got = got[0] if isinstance(got, tuple) else got
        failed.append(got is None)
        rewards.append(float(got is not None and got.strip() == ans.strip()))
    return torch.tensor(rewards), torch.tensor(failed)


def build_task(cfg, seed: int):
    if cfg.kind == "arithmetic":
        return ArithmeticTask(cfg.num_terms, cfg.max_term, seed, cfg.heldout_size)
    return JsonlTask(cfg.path, seed, cfg.heldout_size)
