"""NeMo-RL's loss-protocol enums (``LossType``, ``MetricNormalizer``, ``LossInputType``).

NeMo-RL defines them in ``nemo_rl/algorithms/loss/interfaces.py``; importing that module runs
``nemo_rl/algorithms/loss/__init__.py``, which loads NeMo-RL's training stack (Ray,
transformers, mlflow, ... about 12 s and foreign log lines). ``import nemo_granular`` must stay
light, so this module never imports it. Instead:

* If NeMo-RL's interfaces module is ALREADY loaded when this module is imported (the process
  runs NeMo-RL code), its own classes are used: every comparison NeMo-RL makes holds as is.
* Otherwise local enums with the same class names, member names and values stand in. They
  compare equal to (and hash like) NeMo-RL's member of the same class name and value, so
  ``loss_fn.input_type == LossInputType.LOGPROB`` (``nemo_rl/algorithms/loss/utils.py``),
  ``loss_fn.loss_type == LossType.TOKEN_LEVEL`` (the workers) and dict look-ups hold in both
  directions.

NeMo-RL also compares by identity (the Megatron worker's split-step metric rescale:
``kind is MetricNormalizer.NONE``). So the losses never hand out a member fixed at import
time: their ``loss_type``, ``input_type`` and ``metric_normalizations`` resolve each member
when read (:func:`resolve`, :class:`HostMember`) — NeMo-RL's own member whenever its interfaces
module is loaded in this process by then, in whatever order things were imported — and a
local member unpickles as NeMo-RL's own in a process that has it (:func:`host_member`; Ray
ships the loss to its workers by pickle).
"""

from __future__ import annotations

import enum
import sys
from typing import Any

HOST_MODULE = "nemo_rl.algorithms.loss.interfaces"
ENUM_NAMES = ("LossType", "MetricNormalizer", "LossInputType")


def host_member(class_name: str, value: str) -> enum.Enum:
    """The member ``class_name(value)``: NeMo-RL's when its interfaces module is loaded in this
    process, else the local one. Used to unpickle members (see module docstring)."""
    host = sys.modules.get(HOST_MODULE)
    cls = getattr(host, class_name, None) if host is not None else None
    if cls is None:
        cls = _LOCAL[class_name]
    return cls(value)


def resolve(member: enum.Enum) -> enum.Enum:
    """NeMo-RL's own member with ``member``'s class name and value when NeMo-RL's interfaces
    module is loaded now, else ``member`` itself."""
    host = sys.modules.get(HOST_MODULE)
    cls = getattr(host, type(member).__name__, None) if host is not None else None
    return member if cls is None or type(member) is cls else cls(member.value)


class HostMember:
    """Class attribute holding an enum member, read through :func:`resolve` (on the class and
    on instances alike): ``input_type = HostMember(LossInputType.LOGPROB)``."""

    def __init__(self, member: enum.Enum):
        self.member = member

    def __get__(self, obj, owner=None) -> enum.Enum:
        return resolve(self.member)


class _CompatEnum(enum.Enum):
    """Equal to, and hashed like, the host enum member with the same class name and value."""

    def __eq__(self, other: Any) -> bool:
        if self is other:
            return True
        if isinstance(other, enum.Enum) and type(other).__name__ == type(self).__name__:
            return other.value == self.value
        return NotImplemented

    def __ne__(self, other: Any) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash(self._name_)  # enum.Enum.__hash__: NeMo-RL's members hash the same

    def __reduce_ex__(self, protocol: int):
        return host_member, (type(self).__name__, self._value_)


class _LocalLossType(_CompatEnum):
    TOKEN_LEVEL = "token_level"
    SEQUENCE_LEVEL = "sequence_level"


class _LocalMetricNormalizer(_CompatEnum):
    TOKENS = "tokens"
    SEQUENCES = "sequences"
    NONE = "none"


class _LocalLossInputType(_CompatEnum):
    LOGIT = "logit"
    LOGPROB = "logprob"
    DISTILLATION = "distillation"
    DISTILLATION_CROSS_TOKENIZER = "distillation_cross_tokenizer"
    DRAFT = "draft"


for _cls, _name in (
    (_LocalLossType, "LossType"),
    (_LocalMetricNormalizer, "MetricNormalizer"),
    (_LocalLossInputType, "LossInputType"),
):
    _cls.__name__ = _cls.__qualname__ = _name
_LOCAL: dict[str, type[enum.Enum]] = {
    "LossType": _LocalLossType,
    "MetricNormalizer": _LocalMetricNormalizer,
    "LossInputType": _LocalLossInputType,
}

_host = sys.modules.get(HOST_MODULE)
USING_HOST_ENUMS = _host is not None and all(hasattr(_host, n) for n in ENUM_NAMES)
if USING_HOST_ENUMS:
    LossType = _host.LossType
    MetricNormalizer = _host.MetricNormalizer
    LossInputType = _host.LossInputType
else:
    LossType = _LocalLossType
    MetricNormalizer = _LocalMetricNormalizer
    LossInputType = _LocalLossInputType
del _host, _cls, _name

# kept for callers of the previous API: "NeMo-RL's enum classes are in use"
HAVE_NEMO_RL = USING_HOST_ENUMS

__all__ = [
    "LossType",
    "MetricNormalizer",
    "LossInputType",
    "HAVE_NEMO_RL",
    "USING_HOST_ENUMS",
    "host_member",
    "resolve",
    "HostMember",
]
