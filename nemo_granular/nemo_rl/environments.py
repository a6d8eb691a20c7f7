"""ESPO's verification-failure flag: from the verifier to ``repeated_batch["verification_failed"]``.

Path through NeMo-RL (7ea279ab), without modifying it:

1. ``ESPOMathEnvironment`` (registered as env name ``espo_math``) verifies like NeMo-RL's
   math environment — the same ``HFVerifyWorker`` family, called with
   ``return_extracted_answer=True`` — and marks a response whose answer could not be
   extracted or judged (the worker returns no extracted answer on an error, a timeout or
   no parsable answer) with the observation text :data:`VERIFICATION_FAILED_CONTENT`
   instead of ``"Environment: incorrect"``. Rewards are unchanged (0 for such responses).
2. The rollout appends every observation to the sample's ``message_log`` as an
   ``environment`` message (``run_multi_turn_rollout``), and ``grpo_train`` passes the
   rollout batch as ``repeated_batch=`` to ``compute_advantage``.
3. The ESPO estimator built by :mod:`nemo_granular.nemo_rl.estimators` calls
   :func:`attach_verification_flags`, which sets ``repeated_batch["verification_failed"]``
   (bool ``[B]``) from the LAST environment message of every sample, unless an environment
   already put that key there.

Observation messages follow the assistant's response, so their tokens are never trained on
(``token_mask`` is 0) and cannot change the response's log-probabilities (causal attention).

Only the pure functions are importable without NeMo-RL; ``ESPOMathEnvironment`` is built on
first attribute access, inside NeMo-RL's environment.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch

__all__ = [
    "CORRECT_CONTENT",
    "INCORRECT_CONTENT",
    "VERIFICATION_FAILED_CONTENT",
    "ESPO_ENV_NAME",
    "ESPO_ENV_FQN",
    "espo_observations",
    "verification_failed_from_message_logs",
    "attach_verification_flags",
    "register_espo_environment",
]

CORRECT_CONTENT = "Environment: correct"
INCORRECT_CONTENT = "Environment: incorrect"
VERIFICATION_FAILED_CONTENT = "Environment: incorrect (verification failed)"
ESPO_ENV_NAME = "espo_math"
ESPO_ENV_FQN = "nemo_granular.nemo_rl.environments.ESPOMathEnvironment"
_KNOWN = {CORRECT_CONTENT, INCORRECT_CONTENT, VERIFICATION_FAILED_CONTENT}
_warned_no_flags = False


def espo_observations(scores: Sequence[float], answers: Sequence[str | None]) -> list[dict[str, str]]:
    """One ``environment`` observation per response: correct / incorrect / verification failed.

    A response is a verification failure when the verifier returned no extracted answer
    (``None`` or empty): no parsable answer, an exception or a timeout.
    """
    if len(scores) != len(answers):
        raise ValueError(f"verifier returned {len(scores)} scores but {len(answers)} answers")
    out = []
    for score, answer in zip(scores, answers):
        if answer is None or (isinstance(answer, str) and answer.strip() == ""):
            content = VERIFICATION_FAILED_CONTENT
        else:
            content = CORRECT_CONTENT if score else INCORRECT_CONTENT
        out.append({"role": "environment", "content": content})
    return out


def _last_environment_content(message_log: Sequence[Any]) -> str | None:
    for message in reversed(message_log):
        if message.get("role") == "environment":
            return str(message.get("content", ""))
    return None


def verification_failed_from_message_logs(message_logs: Sequence[Sequence[Any]]) -> torch.Tensor:
    """bool ``[B]``: the last environment message of sample i is :data:`VERIFICATION_FAILED_CONTENT`."""
    return torch.tensor(
        [_last_environment_content(log) == VERIFICATION_FAILED_CONTENT for log in message_logs], dtype=torch.bool
    )


def attach_verification_flags(repeated_batch, key: str = "verification_failed") -> torch.Tensor:
    """Set ``repeated_batch[key]`` from ``repeated_batch["message_log"]`` unless already present.

    Warns once when no sample carries one of our environment's observations (the rollout did
    not come from ``espo_math``): every response then counts as verified (ESPO = GRPO).
    """
    global _warned_no_flags
    if key in repeated_batch:
        return torch.as_tensor(repeated_batch[key]).bool()
    if "message_log" not in repeated_batch:
        raise KeyError(f"repeated_batch has neither '{key}' nor 'message_log' (ESPO verification flags)")
    logs = repeated_batch["message_log"]
    flags = verification_failed_from_message_logs(logs)
    if not _warned_no_flags and not any(_last_environment_content(log) in _KNOWN for log in logs):
        _warned_no_flags = True
        warnings.warn(
            f"ESPO: no '{ESPO_ENV_NAME}' observations in the rollout; every response is treated as "
            f"verified. Set data.env_name: {ESPO_ENV_NAME} (see docs/nemo-rl.md).",
            stacklevel=2,
        )
    repeated_batch[key] = flags
    return flags


def _build_espo_math_environment():  # pragma: no cover - needs NeMo-RL and Ray
    import ray

    from . import compat

    EnvironmentReturn, BaseMathEnvironment = compat.get("EnvironmentReturn"), compat.get("BaseMathEnvironment")
    EnglishMultichoiceVerifyWorker, HFVerifyWorker = (
        compat.get("EnglishMultichoiceVerifyWorker"),
        compat.get("HFVerifyWorker"),
    )
    MultilingualMultichoiceVerifyWorker = compat.get("MultilingualMultichoiceVerifyWorker")
    chunk_list_to_workers = compat.get("chunk_list_to_workers")

    class ESPOMathEnvironmentImpl(BaseMathEnvironment):
        """NeMo-RL's math verification with ESPO's verification-failure observation."""

        WORKER_CLASS_DICT = {
            "math": HFVerifyWorker,
            "english_multichoice": EnglishMultichoiceVerifyWorker,
            "multilingual_multichoice": MultilingualMultichoiceVerifyWorker,
        }

        def step(self, message_log_batch, metadata, return_extracted_answer: bool = False):
            responses = [
                "".join(str(m["content"]) for m in log if m["role"] == "assistant") for log in message_log_batch
            ]
            truths = [m["ground_truth"] for m in metadata]
            impl = self.cfg.get("math_verify_impl", "hf_math_verify")
            work = zip(
                self.workers,
                chunk_list_to_workers(responses, self.num_workers),
                chunk_list_to_workers(truths, self.num_workers),
            )
            work = list(work)
            futures = [w.verify.remote(r, t, True, math_verify_impl=impl) for w, r, t in work]
            # v0.7.0's verifier adds a second score when the answer extraction fails after scoring:
            # its answers stay one per response, its scores come from a call without answers
            score_futures = (
                [w.verify.remote(r, t, False, math_verify_impl=impl) for w, r, t in work]
                if compat.verify_scores_need_own_call()
                else None
            )
            scores: list[float] = []
            answers: list[str | None] = []
            for s, a in ray.get(futures):
                scores.extend(s)
                answers.extend(a)
            if score_futures is not None:
                scores = [score for s in ray.get(score_futures) for score in s]
            n = len(scores)
            rewards = torch.tensor(scores, dtype=torch.float32)
            return EnvironmentReturn(
                observations=espo_observations(scores, answers),
                metadata=metadata,
                next_stop_strings=[None] * n,
                rewards=rewards,
                terminateds=torch.ones(n),
                answers=answers if return_extracted_answer else None,
            )

    ESPOMathEnvironmentImpl.__module__ = __name__
    ESPOMathEnvironmentImpl.__qualname__ = "ESPOMathEnvironmentImpl"
    return ray.remote(max_restarts=-1, max_task_retries=-1, max_concurrency=1000)(ESPOMathEnvironmentImpl)


_LAZY: dict[str, Any] = {}


def __getattr__(name: str):
    """``ESPOMathEnvironment`` is created on first access (NeMo-RL's ``create_env`` resolves it
    by fully qualified name with ``hydra.utils.get_object``)."""
    if name == "ESPOMathEnvironment":
        if name not in _LAZY:
            _LAZY[name] = _build_espo_math_environment()
        return _LAZY[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_espo_environment(env_name: str = ESPO_ENV_NAME) -> None:  # pragma: no cover - needs NeMo-RL
    """Register ``espo_math`` in NeMo-RL's env registry and the actor's Python environment
    (the system executable, like NeMo-RL's math environment). Call in the driver before
    ``setup_response_data``."""
    from . import compat

    ACTOR_ENVIRONMENT_REGISTRY, PY_EXECUTABLES = compat.get("ACTOR_ENVIRONMENT_REGISTRY"), compat.get("PY_EXECUTABLES")
    ENV_REGISTRY, register_env = compat.get("ENV_REGISTRY"), compat.get("register_env")

    ACTOR_ENVIRONMENT_REGISTRY.setdefault(ESPO_ENV_FQN, PY_EXECUTABLES.SYSTEM)
    if env_name not in ENV_REGISTRY:
        register_env(env_name, ESPO_ENV_FQN)
