"""The papers' benchmark suites and evaluation protocols.

A *suite* is a protocol (samples per problem, sampling temperature, which checkpoint is reported)
applied to a list of benchmarks:

- ``sspo`` (SSPO §5.4/§6.1, arXiv:2511.04256): MATH500, AMC23, AIME24, Minerva Math, OlympiadBench;
  greedy decoding, avg@1, evaluated every 10 steps, the best checkpoint reported.
- ``sppo`` (SPPO §4.1, arXiv:2604.08865): AIME24, AIME25, AMC23, MATH500, Minerva Math; avg@16 at
  temperature 0.6 (the official scripts' ``val_kwargs``), the last checkpoint reported.
- ``espo`` (ESPO §4.2 Table 1, arXiv:2512.00499): AIME24, AIME25, HMMT25 avg@32, MATH500 accuracy
  (one greedy sample); the paper states no sampling temperature: 0.6 here. Last checkpoint.
- ``all``: the three above, each with its own settings.

On a cluster every benchmark is a NeMo-RL eval config in ``nemo_granular/configs/evals/`` (package data) (NeMo-RL's own
loader where it has one — ``AIME2024``, ``AIME2025``, ``math500`` — else a local JSONL file with
``problem``/``answer`` keys); in the embedded trainer the same protocols run on local JSONL files
(held-out synthetic levels by default, see :mod:`nemo_granular.evals.embedded`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Benchmark:
    key: str
    label: str
    builtin: str | None  # NeMo-RL's dataset_name when NeMo-RL loads it itself
    note: str = ""


BENCHMARKS = {
    b.key: b
    for b in (
        Benchmark("aime24", "AIME24", "AIME2024", "30 problems (HuggingFaceH4/aime_2024 via NeMo-RL)"),
        Benchmark("aime25", "AIME25", "AIME2025", "30 problems (opencompass/AIME2025 I+II via NeMo-RL)"),
        Benchmark("amc23", "AMC23", None, "40 problems (SSPO's 'AMC' has 83: AMC22+23)"),
        Benchmark("math500", "MATH500", "math500", "500 problems (NeMo-RL downloads the simple-evals CSV)"),
        Benchmark("minerva_math", "Minerva Math", None, "272 problems"),
        Benchmark("olympiadbench", "OlympiadBench", None, "675 problems (text-only English math subset)"),
        Benchmark("hmmt25", "HMMT25", None, "30 problems (HMMT February 2025)"),
    )
}


@dataclass(frozen=True)
class Setting:
    samples: int  # samples per problem; the score is their mean accuracy (avg@samples)
    temperature: float  # 0 = greedy
    top_p: float = 1.0

    @property
    def decoding(self) -> str:
        if self.temperature == 0:
            return "greedy" + (f", {self.samples} samples" if self.samples > 1 else "")
        return f"T={self.temperature:g}, top-p {self.top_p:g}"

    @property
    def metric(self) -> str:
        return f"avg@{self.samples}"


@dataclass(frozen=True)
class Protocol:
    name: str
    description: str
    benchmarks: dict  # benchmark key -> Setting
    select: str  # "best" (by suite average) | "last"
    every: int | None = None  # evaluate checkpoints whose step is a multiple of this (None: all)
    max_new_tokens: int = 8192
    select_note: str = ""
    default: Setting = field(default_factory=lambda: Setting(1, 0.0))


GREEDY = Setting(1, 0.0)
PROTOCOLS = {
    p.name: p
    for p in (
        Protocol(
            "sspo",
            "SSPO (arXiv:2511.04256) §6.1: greedy avg@1, every 10 steps, best checkpoint",
            {k: GREEDY for k in ("math500", "amc23", "aime24", "minerva_math", "olympiadbench")},
            select="best",
            every=10,
            max_new_tokens=3072,
            default=GREEDY,
            select_note="SSPO: 'evaluate all approaches in five datasets every 10 steps ... choose the best "
            "score'; selected on the same benchmarks it reports, so optimistic",
        ),
        Protocol(
            "sppo",
            "SPPO (arXiv:2604.08865) §4.1: avg@16 at temperature 0.6, final checkpoint",
            {k: Setting(16, 0.6) for k in ("aime24", "aime25", "amc23", "math500", "minerva_math")},
            select="last",
            max_new_tokens=8192,
            default=Setting(16, 0.6),
            select_note="the checkpoint at the end of training",
        ),
        Protocol(
            "espo",
            "ESPO (arXiv:2512.00499) Table 1: AIME/HMMT avg@32, MATH500 accuracy, final checkpoint",
            {"aime24": Setting(32, 0.6), "aime25": Setting(32, 0.6), "math500": GREEDY, "hmmt25": Setting(32, 0.6)},
            select="last",
            max_new_tokens=8192,
            default=Setting(32, 0.6),
            select_note="the checkpoint at the end of training; temperature not stated in the paper (0.6 here)",
        ),
    )
}
SUITES = (*PROTOCOLS, "all")


def protocols_for(suite: str) -> list[Protocol]:
    if suite == "all":
        return list(PROTOCOLS.values())
    if suite not in PROTOCOLS:
        raise ValueError(f"--suite: unknown {suite!r} (choose from {', '.join(SUITES)})")
    return [PROTOCOLS[suite]]
