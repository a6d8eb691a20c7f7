"""What a preflight check returns: one :class:`Finding` per problem, one line each."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Finding", "error", "warning", "ERROR", "WARNING"]

ERROR = "error"
WARNING = "warning"


@dataclass(frozen=True)
class Finding:
    """``level`` (``error`` fails the preflight, ``warning`` does not unless ``--strict``),
    ``source`` (the NeMo-RL ``file:function`` whose rule this is, or ``nemo-granular``),
    ``message`` (one line, naming the config key)."""

    level: str
    source: str
    message: str

    def line(self) -> str:
        return f"{self.level}: {self.message} [{self.source}]"

    def as_dict(self) -> dict:
        return asdict(self)


def error(source: str, message: str) -> Finding:
    return Finding(ERROR, source, _one_line(message))


def warning(source: str, message: str) -> Finding:
    return Finding(WARNING, source, _one_line(message))


def _one_line(text: str) -> str:
    return " ".join(str(text).split())
