"""Reader for the embedded trainer's checkpoints (the contract, one step directory)::

step_000020/
  policy/             HF model dir (save_pretrained): config.json, model.safetensors, generation_config.json
  tokenizer/          tokenizer.save_pretrained output
  critic/             SPPO only: *ForSequenceClassification(num_labels=1), pad_token_id set
  trainer_state.json  {"step": 20, "algorithm": "sspo", ...}
  config.yaml         resolved training config
  optimizer.pt, rng.pt  (ignored: never unpickled)
"""

from __future__ import annotations

from pathlib import Path

import torch

from .critic import check_critic_config
from .hf import load_config, read_hf_weights, to_disk_layout
from .source import ExportSource, algorithm_of, read_json, read_yaml

__all__ = ["load_embedded", "load_hf_dir"]


def load_hf_dir(model_dir: Path, *, critic: bool, origin: str):
    """(config, validated on-disk state dict, reference-model builder) of an HF model directory."""
    if not (model_dir / "config.json").exists():
        raise FileNotFoundError(f"{model_dir}/config.json not found")
    config = load_config(model_dir)
    if critic:
        check_critic_config(config, origin)
    sd = to_disk_layout(read_hf_weights(model_dir), config, critic=critic, origin=origin)

    def reference() -> torch.nn.Module:
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        cls = AutoModelForSequenceClassification if critic else AutoModelForCausalLM
        return cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    return config, sd, reference


def load_embedded(step_dir: Path, what: str) -> ExportSource:
    critic = what == "critic"
    model_dir = step_dir / ("critic" if critic else "policy")
    if critic and not model_dir.is_dir():
        raise FileNotFoundError(f"{step_dir} has no critic/ (only SPPO runs save a critic)")
    config, sd, reference = load_hf_dir(model_dir, critic=critic, origin=str(model_dir))
    state = read_json(step_dir / "trainer_state.json") if (step_dir / "trainer_state.json").exists() else {}
    train_cfg = read_yaml(step_dir / "config.yaml") if (step_dir / "config.yaml").exists() else None
    tok = step_dir / "tokenizer"
    gen = model_dir if (model_dir / "generation_config.json").exists() else None
    step = state.get("step")
    return ExportSource(
        kind="embedded",
        what=what,
        path=step_dir,
        config=config,
        state_dict=sd,
        reference=reference,
        tokenizer_dir=tok if tok.is_dir() else None,
        generation_config_dir=None if critic else gen,
        train_config=train_cfg,
        algorithm=state.get("algorithm") or algorithm_of(train_cfg),
        step=int(step) if isinstance(step, (int, float)) else None,
    )
