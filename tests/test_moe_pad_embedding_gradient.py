"""Why the CPU loops' tiny Qwen3-MoE reports gradient norms of 50–200 (docs/nemo-rl.md §7, Findings).

Not the loss: with every preset (SSPO, ESPO, GRPO here) Automodel's parameter gradient is the one a
transformers model gives, except for ONE embedding row, that of the pad token.

* transformers' Qwen3-MoE embeds with ``padding_idx = pad_token_id``: that row never receives a
  gradient, and its random initialisation leaves it at exactly zero.
* Automodel's own Qwen3-MoE (the model NeMo-RL's DTensor-v2 worker builds for it) embeds with a
  plain ``nn.Embedding``: the row receives the gradient transformers drops.
* The 32-token random policy samples ``<pad>`` (id 0) inside its responses, where ``token_mask`` is 1.
  At that position the layer's RMSNorm input is the zero row, where d RMSNorm(x)/dx = w/sqrt(eps)
  (eps = 1e-6: a factor 1000; the q/k norms of the zero q and k multiply again). The row's
  gradient is therefore some hundred times the rest of the model's.

Here, on one batch with ``<pad>`` sampled mid-response: Automodel's gradient (its model, our loss)
equals a transformers backward of the independent float64 reference loss (tests/harness/reference.py) on
every parameter, once the embedding gradient includes what ``padding_idx`` drops; that dropped row
is > 20x the rest; with a non-zero pad row (a trained checkpoint's) the excess is gone.
"""

from __future__ import annotations

import math

import pytest
import torch

import reference as R
from cpu_host import models
from nemo_granular.losses import GranularPolicyLoss

pytestmark = pytest.mark.nemo_rl

PAD, DELIM, V = 0, 3, models.VOCAB_PAD  # <pad>, "\n\n" in the tiny tokenizer; 32-token vocabulary
PRESETS = ("sspo", "espo", "grpo")


def _automodel_qwen3_moe(model_dir, hf_state):
    """Automodel's Qwen3-MoE class with the checkpoint's weights, float32, aux loss off (its
    coefficient is 1e-3; transformers computes none without output_router_logits)."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.qwen3_moe.model import Qwen3MoeForCausalLM
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    cfg.router_aux_loss_coef = 0.0
    backend = BackendConfig(
        attn="sdpa", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch", rope_fusion=False
    )  # what Automodel picks without CUDA
    with pytest.MonkeyPatch.context() as mp:
        # the rotary embedding records torch.device(f"cuda:{current_device()}") at construction
        mp.setattr(torch.cuda, "current_device", lambda: 0)
        model = Qwen3MoeForCausalLM(cfg, backend=backend)
    model.model.rotary_emb.device = torch.device("cpu")  # as Automodel's own init_weights(buffer_device) does
    result = model.load_state_dict(model.state_dict_adapter.from_hf(dict(hf_state)), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.float().train()


@pytest.fixture(scope="module")
def world(nemo_rl_src, tmp_path_factory):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = models.write_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", moe=True)
    # Automodel's state-dict adapter loads bfloat16: give both models the same bf16-representable weights
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.bfloat16().float())
    hf.save_pretrained(str(model_dir))
    hf_state = load_file(str(model_dir / "model.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).train()
    return hf, _automodel_qwen3_moe(model_dir, hf_state), hf_state, model_dir


def _batch(hf):
    """4 rows: prompt (mask 0), response (mask 1) with <pad> sampled in rows 0 and 2 and a "\\n\\n"
    (two SSPO segments), right padding (mask 0); on-policy π_old log-probs and entropy."""
    g = torch.Generator().manual_seed(3)
    B, S, prompt = 4, 18, 5
    ids = torch.randint(4, V, (B, S), generator=g)
    lengths = torch.tensor([18, 16, 17, 14])
    ids[0, 9] = ids[2, 7] = PAD  # sampled <pad> tokens, followed by more response tokens
    ids[0, 12] = ids[1, 10] = ids[2, 13] = DELIM
    cols = torch.arange(S)[None, :]
    ids[cols >= lengths[:, None]] = PAD  # right padding
    token_mask = ((cols >= prompt) & (cols < lengths[:, None])).float()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * token_mask
    with torch.no_grad():
        logits = hf(input_ids=ids).logits.float()
    logp_all = torch.log_softmax(logits, -1)
    lp = logp_all[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)[:, :-1]
    zero = torch.zeros(B, 1)
    data = {
        "input_ids": ids,
        "input_lengths": lengths,
        "token_mask": token_mask,
        "sample_mask": torch.ones(B),
        "advantages": adv,
        "prev_logprobs": torch.cat([zero, lp], 1) * token_mask,
        "prev_entropy": torch.cat([zero, ent], 1) * token_mask,
    }
    return data, float(B), float(token_mask[:, 1:].sum())


def _next_token_logprobs(logits, ids):
    return torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)


def _loss(name):
    cfg = {
        "token_level_loss": name == "grpo",
        "reference_policy_kl_penalty": 0.0,
        "granular": {"algorithm": name, "espo": {"alpha": 1.0, "vocab_size": V}},
    }
    return GranularPolicyLoss(cfg, delimiter_table=R.delimiter_table(V, (DELIM,)))


def _reference(name, gvs, gvt):
    spec = {"vocab_size": V, "delimiter_ids": (DELIM,), "gvs": gvs, "gvt": gvt}
    return lambda lp, data: R.preset_loss(name, lp, data, **spec)


def _automodel_grads(am, data, loss_fn, gvs, gvt):
    am.zero_grad()
    ids = data["input_ids"]
    B, S = ids.shape
    logits = am(ids, attention_mask=torch.ones(B, S, dtype=torch.bool), position_ids=torch.arange(S).repeat(B, 1))
    lp = _next_token_logprobs(logits, ids)
    loss, _ = loss_fn(lp, data, gvs, gvt)
    loss.backward()
    return lp.detach(), {n: p.grad.detach().clone() for n, p in am.named_parameters()}


def _transformers_reference_grads(hf, data, name, gvs, gvt):
    """transformers backward of the float64 reference loss; the embedding gradient is taken at the
    embedding OUTPUT and scattered to every row, the pad row included (what padding_idx drops)."""
    hf.zero_grad()
    ids = data["input_ids"]
    emb = hf.model.embed_tokens(ids).detach().requires_grad_(True)
    lp = _next_token_logprobs(hf(inputs_embeds=emb).logits, ids)
    _, ref_grad, _ = R.run_ref(_reference(name, gvs, gvt), lp, data)
    lp.backward(ref_grad.float())
    grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters() if p.grad is not None}
    rows = torch.zeros(V, emb.shape[-1]).index_add_(0, ids.reshape(-1), emb.grad.reshape(-1, emb.shape[-1]))
    grads["model.embed_tokens.weight"] = rows
    return lp.detach(), ref_grad, grads


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().norm()) ** 2 for t in tensors))


@pytest.mark.parametrize("name", PRESETS)
def test_the_large_moe_gradient_is_the_pad_row_automodel_does_not_mask(world, name):
    hf, am, _, _ = world
    data, gvs, gvt = _batch(hf)
    embed = hf.model.embed_tokens
    assert embed.padding_idx == PAD and float(embed.weight.detach()[PAD].abs().max()) == 0  # transformers' init

    lp_am, g_am = _automodel_grads(am, data, _loss(name), gvs, gvt)
    lp_hf, ref_grad, g_ref = _transformers_reference_grads(hf, data, name, gvs, gvt)
    mask = data["token_mask"][:, 1:] > 0
    assert float((lp_am - lp_hf).abs()[mask].max()) < 1e-5  # same model, same log-probs

    # our loss's gradient with respect to the log-probs is the float64 reference's
    _, ours, _ = R.run_loss(_loss(name), lp_hf, data, gvs, gvt)
    R.assert_close(ours, ref_grad, rtol=1e-5, atol=1e-8, what=f"{name} d loss / d logprobs")

    # every parameter: Automodel (our loss) == transformers (reference loss), pad row included
    for n, g in g_am.items():
        if "experts" in n:  # fused layouts differ between the two; compare the norms
            continue
        R.assert_close(g, g_ref[n], rtol=2e-4, atol=1e-7, what=n)
    for layer in range(2):
        ours_e = [g for n, g in g_am.items() if n.startswith(f"model.layers.{layer}.mlp.experts")]
        ref_e = [g for n, g in g_ref.items() if n.startswith(f"model.layers.{layer}.mlp.experts")]
        assert _norm(ours_e) == pytest.approx(_norm(ref_e), rel=2e-4)

    # ... and the pad row is what makes the norm: transformers' own backward leaves it at zero
    pad_row = float(g_am["model.embed_tokens.weight"][PAD].norm())
    rest = _norm(
        [g for n, g in g_am.items() if n != "model.embed_tokens.weight"]
        + [g_am["model.embed_tokens.weight"][PAD + 1 :]]
    )
    assert pad_row > 20 * rest, (pad_row, rest)
    hf.zero_grad()
    loss, _ = _loss(name)(
        _next_token_logprobs(hf(input_ids=data["input_ids"]).logits, data["input_ids"]), data, gvs, gvt
    )
    loss.backward()
    assert float(hf.model.embed_tokens.weight.grad[PAD].abs().max()) == 0
    assert _norm(p.grad for p in hf.parameters() if p.grad is not None) == pytest.approx(rest, rel=2e-4)


def test_a_nonzero_pad_row_has_an_ordinary_gradient(world):
    """The amplifier is the zero row under RMSNorm (slope w/sqrt(eps) at 0): give the pad row the
    scale of the other rows, as in a trained checkpoint, and its gradient is one row among others."""
    hf, _, hf_state, model_dir = world
    state = dict(hf_state)
    emb = state["model.embed_tokens.weight"].clone()
    emb[PAD] = 0.02 * torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(0))
    state["model.embed_tokens.weight"] = emb
    am = _automodel_qwen3_moe(model_dir, state)
    data, gvs, gvt = _batch(hf)
    _, g = _automodel_grads(am, data, _loss("sspo"), gvs, gvt)
    rows = g["model.embed_tokens.weight"].norm(dim=1)
    assert float(rows[PAD]) < 2 * float(rows[PAD + 1 :].max()), rows
