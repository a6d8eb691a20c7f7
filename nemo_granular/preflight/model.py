"""What preflight knows about the model without downloading it: the Hugging Face config, read from the
local cache (or a local model folder) only, and the layout checks Megatron makes against it.

The architecture checks mirror Megatron-Core (the Megatron-LM NeMo-RL pins), which NeMo-RL's
Megatron worker runs when it builds the model:

* ``megatron/core/transformer/transformer_config.py:TransformerConfig.__post_init__`` — attention
  heads a multiple of TP; query groups (KV heads) a multiple or a divisor of TP; EP > 1 only for MoE;
* ``megatron/core/transformer/transformer_block.py:get_num_layers_to_build`` — layers divisible by
  PP when no first/last stage sizes are given;
* ``megatron/core/transformer/moe/moe_layer.py:BaseMoELayer.__init__`` — experts divisible by EP.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .findings import Finding, error

__all__ = ["ModelFacts", "model_facts", "facts_from_hf_config", "architecture_checks"]

TRANSFORMER_CONFIG = "megatron/core/transformer/transformer_config.py:TransformerConfig.__post_init__"
TRANSFORMER_BLOCK = "megatron/core/transformer/transformer_block.py:get_num_layers_to_build"
MOE_LAYER = "megatron/core/transformer/moe/moe_layer.py:BaseMoELayer.__init__"


@dataclass(frozen=True)
class ModelFacts:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_ffn_size: int = 0
    tied_embeddings: bool = False

    def parameter_count(self, lm_head: bool = True) -> int:
        """Parameters of a Llama/Qwen-style decoder (attention + gated MLP or experts + embeddings);
        norms and biases ignored. ``lm_head=False``: a scalar value head instead of the LM head."""
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2
        mlp = (
            3 * h * self.moe_ffn_size * self.num_experts + h * self.num_experts
            if self.num_experts
            else 3 * h * self.ffn_size
        )
        if not lm_head:
            head = h
        else:
            head = 0 if self.tied_embeddings else self.vocab_size * h
        return self.num_layers * (attn + mlp) + self.vocab_size * h + head


def facts_from_hf_config(hf) -> ModelFacts:
    """:class:`ModelFacts` from a ``transformers`` config object (text config of multimodal models)."""
    hf = getattr(hf, "text_config", None) or hf
    heads = int(hf.num_attention_heads)
    head_dim = int(getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    experts = int(getattr(hf, "num_experts", None) or getattr(hf, "num_local_experts", None) or 0)
    return ModelFacts(
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        num_layers=int(hf.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
        head_dim=head_dim,
        ffn_size=int(getattr(hf, "intermediate_size", 0) or 0),
        num_experts=experts,
        experts_per_token=int(getattr(hf, "num_experts_per_tok", 0) or 0),
        moe_ffn_size=int(getattr(hf, "moe_intermediate_size", 0) or 0),
        tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
    )


def model_facts(model_name: str, overrides: Mapping | None = None) -> tuple[ModelFacts | None, str]:
    """The model's facts from a local folder or the local Hugging Face cache (never the network);
    ``(None, why)`` when it is not available offline."""
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(
            model_name, local_files_only=True, trust_remote_code=False, **dict(overrides or {})
        )
        return facts_from_hf_config(hf), "local"
    except Exception as err:  # noqa: BLE001 - any failure means "not available offline"; say why
        text = str(err).strip().splitlines()
        return None, f"{model_name}: model config not available offline ({text[0] if text else type(err).__name__})"


def architecture_checks(section: str, facts: ModelFacts, par: Mapping, meg: Mapping) -> list[Finding]:
    """Megatron's model-build checks for ``par`` (:func:`~.layout.policy_parallel`) on this model."""
    if par.get("backend") != "megatron":
        return []
    tp, pp, ep = par["tp"], par["pp"], par["ep"]
    out = []
    if facts.num_heads % tp:
        out.append(
            error(
                TRANSFORMER_CONFIG,
                f"{section}: {facts.num_heads} attention heads not a multiple of tensor_model_parallel_size {tp}",
            )
        )
    if facts.num_kv_heads % tp and tp % facts.num_kv_heads:
        out.append(
            error(
                TRANSFORMER_CONFIG,
                f"{section}: {facts.num_kv_heads} KV heads neither a multiple nor a "
                f"divisor of tensor_model_parallel_size {tp}",
            )
        )
    if ep > 1 and not facts.num_experts:
        out.append(error(TRANSFORMER_CONFIG, f"{section}: expert_model_parallel_size {ep} on a model without experts"))
    if facts.num_experts and facts.num_experts % ep:
        out.append(
            error(MOE_LAYER, f"{section}: {facts.num_experts} experts not divisible by expert_model_parallel_size {ep}")
        )
    uneven = (
        meg.get("num_layers_in_first_pipeline_stage") is not None
        or meg.get("num_layers_in_last_pipeline_stage") is not None
    )
    if pp > 1 and not uneven and facts.num_layers % pp:
        out.append(
            error(
                TRANSFORMER_BLOCK,
                f"{section}: {facts.num_layers} layers not divisible by pipeline_model_parallel_size {pp}",
            )
        )
    return out
