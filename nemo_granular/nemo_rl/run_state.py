"""What a nemo_granular run must carry across a NeMo-RL resume that NeMo-RL's checkpoint does not
hold: ESPO's α when ``loss_fn.granular.espo.alpha: auto`` (set from the first rollout's π_old
entropy, docs/algorithms/espo.md). It lives in ``nemo_granular_state.json`` inside each NeMo-RL
checkpoint directory (``<checkpoint_dir>/step_N/``), written by the driver-side ``GranularPolicy``
when ``grpo_train`` saves the policy — into NeMo-RL's temporary ``tmp_step_N`` directory, so
NeMo-RL's own rename publishes (and its retention deletes) it with the checkpoint — and read back
from the ``weights_path`` NeMo-RL's ``setup`` hands the policy on resume.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import atomic

__all__ = ["STATE_FILE", "checkpoint_dir_of", "save_run_state", "load_run_state", "espo_alpha_for_step"]

STATE_FILE = "nemo_granular_state.json"


def checkpoint_dir_of(weights_path) -> Path:
    """NeMo-RL's checkpoint directory from the policy's ``weights_path`` (``<step>/policy/weights``)."""
    return Path(weights_path).parent.parent


def save_run_state(checkpoint_dir, state: Mapping[str, Any]) -> Path:
    """Write ``state`` as JSON into ``checkpoint_dir`` (a temporary file, then a rename)."""
    text = json.dumps(dict(state), indent=1, sort_keys=True) + "\n"
    return atomic.write_text(Path(checkpoint_dir) / STATE_FILE, text)


def load_run_state(checkpoint_dir) -> dict[str, Any]:
    """The state saved in ``checkpoint_dir`` ({} when there is none); a damaged file is a one-line error."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.is_file():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable nemo_granular state file ({err})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{path}: not a readable nemo_granular state file (a JSON object was expected)")
    return state


def espo_alpha_for_step(loss_fn, data: Mapping, state: dict[str, Any]) -> float | None:
    """Before a train step: ESPO's α under ``espo.alpha: auto`` (None without it). A resumed run
    restores it from ``state``; otherwise it is set from this batch's π_old entropy over its valid
    response tokens (``token_mask · sample_mask``) — the first rollout's — and recorded in ``state``."""
    loss = getattr(loss_fn, "inner", loss_fn)
    if getattr(loss, "espo_alpha_pending", False):
        if "espo_alpha" in state:
            loss.set_espo_alpha(state["espo_alpha"])
        else:
            mask = data["token_mask"] * data["sample_mask"][:, None]
            state["espo_alpha"] = loss.calibrate_espo_alpha(data["prev_entropy"], mask)
            print(f"  ✓ nemo_granular: espo.alpha auto = {state['espo_alpha']:.4g} (first rollout)", flush=True)
    return state.get("espo_alpha")
