"""``nemo-granular export`` of a NeMo-RL DTensor-v2 checkpoint written by Automodel's own checkpointer.

Two gloo processes build Automodel's Qwen3-MoE implementation from a tiny HF checkpoint with
``NeMoAutoModelForCausalLM.from_pretrained`` (FSDP2 over the 2 ranks, experts over EP=2, as
NeMo-RL's ``DTensorPolicyWorkerV2`` does) and save it with NeMo-RL's ``AutomodelCheckpointManager``
→ Automodel's ``Checkpointer`` (``tests/harness/export_cpu/automodel_writer.py``), in both
``checkpointing.model_save_format`` values. Each export is reloaded with transformers and compared
with the HF source.

Automodel's Qwen3-MoE keeps bf16 parameters even with ``policy.precision: float32``
(``Checkpointer.initialize_model_weights`` calls ``initialize_weights()``, whose default casts the
model to bf16, before the HF weights are copied in), so the checkpoint holds the source rounded to
bf16; the export must equal that bit for bit, and its logits the rounded source's within 1e-6
(fp32 compute on identical tensors; measured 0.0).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from nemo_granular.cli import main as top_main

pytestmark = [pytest.mark.transformers_pin, pytest.mark.dist, pytest.mark.slow, pytest.mark.nemo_rl]

LOGIT_TOL = 1e-6
STEP = 4
FORMATS = ("safetensors", "torch_save")


@pytest.fixture(scope="module")
def automodel_checkpoints(nemo_rl_src, tmp_path_factory):
    """``<format>/step_4`` for both formats from one 2-rank writer run."""
    if not os.environ.get("AUTOMODEL_SRC"):
        pytest.skip("needs AUTOMODEL_SRC (NeMo-RL's pinned Automodel source)")
    from export_cpu.launch import run_ranks
    from export_cpu.tiny_hf import make_hf_model

    root = tmp_path_factory.mktemp("automodel")
    make_hf_model(root / "hf_moe", moe=True, seed=3)
    run_ranks(
        "automodel_writer",
        [
            {
                "hf_dir": str(root / "hf_moe"),
                "checkpoint_dir": str(root / "ckpt"),
                "step": STEP,
                "ep": 2,
                "formats": list(FORMATS),
            }
        ],
        world=2,
        log_dir=root,
    )
    return root


def run_cli(argv, capsys):
    capsys.readouterr()
    rc = top_main(["export", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _experts_per_rank_file(model_dir) -> list[set[int]]:
    """Layer-0 experts whose gate_proj each rank's safetensors file holds."""
    from safetensors import safe_open

    out = []
    for f in sorted(model_dir.glob("shard-*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.append(
                {
                    int(k.split(".")[5])
                    for k in h.keys()
                    if k.startswith("model.layers.0.mlp.experts.") and k.endswith("gate_proj.weight")
                }
            )
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_automodel_checkpoint_export_equals_hf_source(fmt, automodel_checkpoints, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from export_cpu.tiny_hf import assert_same_weights, max_logit_diff
    from nemo_granular.export.source import read_yaml

    root = automodel_checkpoints
    step = root / "ckpt" / fmt / f"step_{STEP}"
    model_dir = step / "policy" / "weights" / "model"
    assert {"config.yaml", "training_info.json", "policy"} <= set(os.listdir(step))
    assert (step / "policy" / "tokenizer" / "tokenizer_config.json").exists()
    assert read_yaml(step / "config.yaml")["policy"]["model_name"] == str(root / "hf_moe")
    if fmt == "safetensors":  # one file per rank, experts split over the EP ranks
        assert (model_dir / ".hf_metadata" / "config.json").exists()
        assert _experts_per_rank_file(model_dir) == [{0, 1}, {2, 3}]
    else:
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(model_dir))

    out = tmp_path / "hf"
    rc, stdout, err = run_cli([root / "ckpt" / fmt, out, "--dtype", "fp32", "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["source"] == "dcp" and rep["step_dir"] == str(step)
    assert rep["verification"]["exact_max_abs_diff"] <= 1e-5
    wm = (
        json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        if (out / "model.safetensors.index.json").exists()
        else None
    )
    assert wm is None or "model.layers.1.mlp.experts.3.down_proj.weight" in wm

    source = AutoModelForCausalLM.from_pretrained(str(root / "hf_moe"), dtype=torch.float32).eval()
    for p in source.parameters():  # what Automodel's Qwen3-MoE held and saved
        p.data = p.data.to(torch.bfloat16).float()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert_same_weights(source, exported)
    tok = AutoTokenizer.from_pretrained(str(out))
    diff = max_logit_diff(source, exported, tok)
    full = AutoModelForCausalLM.from_pretrained(str(root / "hf_moe"), dtype=torch.float32).eval()
    drift = max_logit_diff(full, exported, tok)  # the cost of Automodel's bf16 parameters, for the docs
    print(f"max |logit diff| vs source, {fmt}: {diff:.3g}; vs the unrounded fp32 source {drift:.3g}")  # with -s
    assert diff <= LOGIT_TOL
