"""Rollouts in NeMo-RL's batch layout.

``generate`` samples responses with transformers' ``generate`` (left-padded prompts), then
``to_nemo_batch`` repacks them exactly as NeMo-RL's GRPO loop lays out ``train_data``:
prompt+response right-padded in ``input_ids [B, S]``, per-token tensors indexed by token
position (``token_mask``, ``generation_logprobs``; column 0 is a prompt token), per-sample
``sample_mask [B]``. ``old_policy_pass`` fills ``prev_logprobs`` AND ``prev_entropy`` (the
π_old full-vocabulary entropy) from ONE forward pass, in the same shift convention.
"""

from __future__ import annotations

import torch

from ..core.entropy import logprobs_and_entropy_from_logits

# the passes that need no gradient (sampling, pi_old) run in inference mode: the same kernels on the same
# inputs as under no_grad (hence the same numbers, tests/test_embedded_speed.py), without autograd's version
# counters and view tracking on every small op of a token-by-token decode. Their results are copied out (an
# inference tensor can be neither updated in place nor saved for backward outside inference mode).
NO_AUTOGRAD = torch.inference_mode


def generate(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    temperature: float,
    greedy: bool,
    device,
    autocast_dtype=None,
) -> dict:
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        return_dict_in_generate=True,
    )
    if greedy:
        kwargs.update(do_sample=False)
    else:  # transformers' generate applies top_k=50 unless told otherwise
        kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, output_logits=True)
    with NO_AUTOGRAD(), torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model.generate(**enc, **kwargs)
    Lp = enc["input_ids"].shape[1]
    resp = out.sequences[:, Lp:].clone()
    if resp.shape[1] == 0:
        resp = torch.full((resp.shape[0], 1), tokenizer.eos_token_id, device=device)
    eos = resp == tokenizer.eos_token_id
    has_eos = eos.any(-1)
    first_eos = torch.argmax(eos.to(torch.int8), dim=-1)
    resp_len = torch.where(has_eos, first_eos + 1, torch.full_like(first_eos, resp.shape[1]))
    gen_lp = torch.zeros(resp.shape, dtype=torch.float32, device=device)
    if not greedy:  # (outside inference mode: the stacked logits and what follows are ordinary tensors)
        logits = torch.stack(out.logits, dim=1).float() / temperature  # [B, L, V]
        gen_lp = torch.log_softmax(logits, -1).gather(-1, resp[..., None]).squeeze(-1)
    return dict(
        prompt_ids=enc["input_ids"],
        prompt_attention=enc["attention_mask"],
        response_ids=resp,
        response_len=resp_len,
        truncated=~has_eos,
        generation_logprobs=gen_lp,
    )


def to_nemo_batch(gen: dict, pad_id: int) -> dict:
    """Left-padded prompt + response → NeMo-RL's right-padded ``[B, S]`` layout (vectorised)."""
    prompt_ids, attn, resp = gen["prompt_ids"], gen["prompt_attention"], gen["response_ids"]
    B, Lp = prompt_ids.shape
    device = prompt_ids.device
    lp = attn.sum(-1)
    left_pad = Lp - lp
    total = lp + gen["response_len"]
    S = int(total.max())
    full = torch.cat([prompt_ids, resp], dim=1)
    full_lp = torch.cat([torch.zeros(B, Lp, device=device), gen["generation_logprobs"]], dim=1)
    col = torch.arange(S, device=device).expand(B, S)
    src = (col + left_pad[:, None]).clamp(max=full.shape[1] - 1)
    inside = col < total[:, None]
    input_ids = torch.where(inside, full.gather(1, src), torch.full_like(col, pad_id))
    token_mask = inside & (col >= lp[:, None])
    gen_lp = torch.where(token_mask, full_lp.gather(1, src), torch.zeros((), device=device))
    # the prompt, right padded, identifies the prompt group (NeMo-RL passes it to the estimator)
    pcol = torch.arange(Lp, device=device).expand(B, Lp)
    psrc = (pcol + left_pad[:, None]).clamp(max=Lp - 1)
    prompt_right = torch.where(pcol < lp[:, None], prompt_ids.gather(1, psrc), torch.full_like(pcol, pad_id))
    return {
        "input_ids": input_ids,
        "input_lengths": total,
        "token_mask": token_mask.float(),
        "sample_mask": torch.ones(B, device=device),
        "generation_logprobs": gen_lp,
        "prompt_ids": prompt_right,
        "prompt_lengths": lp,
        "truncated": gen["truncated"],
    }


def sequence_logits(model, input_ids, input_lengths, temperature: float, autocast_dtype=None):
    """Temperature-scaled logits ``[B, S-1, V]``: position j predicts token j+1 (NeMo-RL scales too)."""
    S = input_ids.shape[1]
    attention = (torch.arange(S, device=input_ids.device)[None, :] < input_lengths[:, None]).long()
    with torch.autocast(input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        logits = model(input_ids=input_ids, attention_mask=attention).logits
    return logits[:, :-1].float() / temperature


def next_token_logprobs(model, batch: dict, temperature: float, autocast_dtype=None) -> torch.Tensor:
    """The loss input NeMo-RL's LOGPROB path produces: ``[B, S-1]``, column j = log p(token j+1)."""
    logits = sequence_logits(model, batch["input_ids"], batch["input_lengths"], temperature, autocast_dtype)
    return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def old_policy_pass(model, batch: dict, temperature: float, chunk_size: int, autocast_dtype=None) -> None:
    """π_old logprobs and full-vocabulary entropy in one pass; stored as ``[B, S]`` with column 0 = 0."""
    with NO_AUTOGRAD():
        logits = sequence_logits(model, batch["input_ids"], batch["input_lengths"], temperature, autocast_dtype)
        lp, ent = logprobs_and_entropy_from_logits(logits, batch["input_ids"][:, 1:], chunk_size)
    zero = torch.zeros(lp.shape[0], 1, dtype=lp.dtype, device=lp.device)  # the cats below: ordinary tensors
    batch["prev_logprobs"] = torch.cat([zero, lp], dim=1)
    batch["prev_entropy"] = torch.cat([zero, ent], dim=1)
