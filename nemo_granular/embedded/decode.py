"""A lean token-by-token sampling loop: transformers' ``GenerationMixin._sample`` for the one way the trainer
calls ``model.generate``, without its per-call and per-token machinery.

For models this small, part of ``generate``'s time is Python around the forward passes: building and
validating a ``GenerationConfig``, ``inspect.signature`` look-ups, the logits processor and stopping criteria
lists, ``prepare_inputs_for_generation`` and ``_update_model_kwargs_for_generation`` on every token (the
forward passes themselves, called exactly as ``generate`` calls them, are most of it: this loop saves about
5 % of the default demo's sampling time, 128 rows x 32 tokens on one CPU thread). ``sample`` keeps exactly
what the trainer's call (``do_sample=True, temperature=T, top_k=0, top_p=1.0, output_logits=True``,
left-padded prompts, an attention mask, ``eos_token_id`` and ``pad_token_id`` given) does, in the same
order and on the same tensors, so its results are bit for bit ``generate``'s (tests/test_embedded_speed.py):

* ``position_ids``: ``attention_mask.cumsum(-1) - 1`` with the padding set to 0
  (``_prepare_position_ids_for_generation``); each step appends ``last + 1``
  (``_update_model_kwargs_for_generation``) and the forward gets the last column.
* the cache: an empty ``DynamicCache(config=<the decoder's text config>)`` (``_prepare_cache_for_generation``
  with no ``cache_implementation``), filled by the model.
* the forward: prefill on the whole prompt, then one token a step, always with the 2-D attention mask (one
  column of ones appended a step), ``logits_to_keep=1``, ``use_cache=True`` (``_prefill``,
  ``prepare_inputs_for_generation``: a ``DynamicCache`` is not compileable, so the mask stays 2-D); decode
  steps run inside ``model._optimize_model_for_decode()`` as ``_sample``'s do.
* the sampling: the last position's logits copied to float32 (``logits``, what ``output_logits`` returns),
  divided by the temperature unless it is 1 (``TemperatureLogitsWarper``; ``top_k=0`` and ``top_p=1`` add
  no warper), ``softmax``, ``torch.multinomial(probs, 1)`` on the global generator (the same random
  numbers drawn in the same order).
* finished rows get ``pad_token_id``; a row finishes on EOS (``EosTokenCriteria``) and all stop when every
  row has finished or at ``max_new_tokens`` (``MaxLengthCriteria``); the last sampled token is not forwarded.

``supported`` is the explicit check of which calls this covers (the trainer's models and generation
settings, transformers 5.8); anything else (greedy decoding, another model class or transformers release, a
model whose generation config adds a processor or stopping rule) stays with ``model.generate``.
"""

from __future__ import annotations

import torch

# what this loop was verified against, bit for bit (tests/test_embedded_speed.py): transformers' releases (its
# generate changes between them: 4.x passes cache_position, for one) and model classes
VERIFIED_TRANSFORMERS = ("5.8",)
VERIFIED_MODELS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

# entries of a model's generation config that the trainer's generate call overrides or that change nothing
# here: any other entry (a repetition penalty, min_length, bad words, ...) may add a logits processor or a
# stopping criterion, and such a model is left to model.generate
_OVERRIDDEN_OR_NEUTRAL = {
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "max_length",
    "max_new_tokens",
    "pad_token_id",
    "eos_token_id",
    "bos_token_id",
    "return_dict_in_generate",
    "output_logits",
    "_from_model_config",
    "transformers_version",
}
_MUST_BE = {"use_cache": True, "output_attentions": False, "output_hidden_states": False, "output_scores": False}


def supported(model, *, greedy: bool, max_new_tokens: int) -> bool:
    """Whether ``sample`` reproduces ``model.generate`` for the trainer's call on this model."""
    import transformers

    if greedy or max_new_tokens < 1 or type(model).__name__ not in VERIFIED_MODELS:
        return False
    if ".".join(transformers.__version__.split(".")[:2]) not in VERIFIED_TRANSFORMERS:
        return False
    if model.config.is_encoder_decoder:
        return False
    gen_cfg = model.generation_config.to_diff_dict()
    for key, value in gen_cfg.items():
        if key in _MUST_BE:
            if value != _MUST_BE[key]:
                return False
        elif key not in _OVERRIDDEN_OR_NEUTRAL:
            return False
    return True


def sample(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    pad_token_id: int,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(sequences [B, Lp + L], logits)``: ``generate``'s ``sequences`` and ``logits`` (one float32 ``[B, V]``
    per generated position) for left-padded ``input_ids`` and their ``attention_mask``."""
    from transformers import DynamicCache

    B = input_ids.shape[0]
    max_length = input_ids.shape[1] + max_new_tokens
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids = position_ids.masked_fill(attention_mask == 0, 0)
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    eos = torch.tensor([eos_token_id], device=input_ids.device)
    pad = torch.tensor(pad_token_id, device=input_ids.device)
    unfinished = torch.ones(B, dtype=torch.long, device=input_ids.device)
    logits: list[torch.Tensor] = []
    outputs = model(
        input_ids=input_ids.clone(memory_format=torch.contiguous_format),
        past_key_values=cache,
        position_ids=position_ids,
        attention_mask=attention_mask,
        logits_to_keep=1,
        use_cache=True,
        return_dict=True,
    )
    with model._optimize_model_for_decode():
        while True:
            cache = outputs.past_key_values
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((B, 1))], dim=-1)
            next_logits = outputs.logits[:, -1, :].to(copy=True, dtype=torch.float32, device=input_ids.device)
            del outputs
            logits.append(next_logits)
            scores = next_logits / temperature if temperature != 1.0 else next_logits
            next_tokens = torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if input_ids.shape[1] >= max_length:
                break
            unfinished = unfinished & ~torch.isin(next_tokens, eos)
            if unfinished.max() == 0:
                break
            outputs = model(
                input_ids=input_ids[:, -1:].clone(memory_format=torch.contiguous_format),
                past_key_values=cache,
                position_ids=position_ids[:, -1:].clone(memory_format=torch.contiguous_format),
                attention_mask=attention_mask,
                logits_to_keep=1,
                use_cache=True,
                return_dict=True,
            )
    return input_ids, logits
