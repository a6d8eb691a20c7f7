"""``nemo-granular export``: real tiny Qwen3 / Qwen3-MoE models, real checkpoints on disk, real
torch.distributed (gloo) processes writing a DCP checkpoint, and reload with transformers."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
import torch

from nemo_granular.cli import main as top_main

pytest.importorskip("transformers")

from export_cpu.tiny_hf import PROMPTS, make_tokenizer, tiny_config  # after importorskip


# --------------------------------------------------------------------------------------- fixtures
def make_policy(moe: bool = False, tie: bool = False, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(moe, tie), dtype=torch.float32)
    with torch.no_grad():  # larger weights than the default init so logits are far from zero
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2)
    return model.eval()


def make_embedded_run(root: Path, *, moe: bool = False, critic: bool = False) -> Path:
    """A run dir exactly as the embedded trainer writes it (the contract)."""
    from transformers import AutoModelForSequenceClassification

    step = root / "checkpoints" / "step_000020"
    step.mkdir(parents=True)
    policy = make_policy(moe)
    policy.save_pretrained(str(step / "policy"))
    make_tokenizer(step / "tokenizer")
    algo = "sppo" if critic else "sspo"
    if critic:
        torch.manual_seed(1)
        cfg = tiny_config(num_labels=1)
        crit = AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in crit.parameters():
                if p.dim() > 1:
                    p.normal_(0, 0.2)
        crit.save_pretrained(str(step / "critic"))
    torch.save({"policy": {"w": torch.zeros(2)}}, step / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state()}, step / "rng.pt")
    (step / "trainer_state.json").write_text(json.dumps({"step": 20, "algorithm": algo}))
    (step / "config.yaml").write_text(
        f"algorithm: {algo}\nmodel:\n  name: tiny-qwen3{'-moe' if moe else ''}\n  lr: 1.0e-06\n"
    )
    (root / "checkpoints" / "latest").write_text("step_000020\n")
    return root


def run_cli(argv, capsys):
    capsys.readouterr()  # drop what the test itself printed before
    rc = top_main(["export", *map(str, argv)])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def assert_clean(out: Path):
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.tmp-")]


@torch.no_grad()
def logits(model, tok, prompts=PROMPTS):
    return [model(input_ids=torch.tensor([tok(p)["input_ids"]])).logits[0].float() for p in prompts]


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    return make_embedded_run(tmp_path_factory.mktemp("dense"))


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    return make_embedded_run(tmp_path_factory.mktemp("moe"), moe=True)


@pytest.fixture(scope="module")
def sppo_run(tmp_path_factory):
    return make_embedded_run(tmp_path_factory.mktemp("sppo"), critic=True)


# ---------------------------------------------------------------------------- embedded round trips
def test_embedded_dense_fp32_sharded_round_trip(dense_run, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf"
    rc, stdout, err = run_cli([dense_run, out, "--dtype", "fp32", "--max-shard-size", "20KB"], capsys)
    assert rc == 0, err
    assert "verification: passed" in stdout
    names = sorted(os.listdir(out))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) >= 3 and all("-of-" in n for n in shards)
    for f in (
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "README.md",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert f in names
    assert not [n for n in names if n.startswith(".")]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    total = 0
    for s in shards:
        assert (out / s).stat().st_size <= 20_000 + 4096  # + header; tensors here are all < 20KB
        with safe_open(str(out / s), "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == s
                t = f.get_tensor(k)
                assert t.dtype == torch.float32
                total += t.numel() * 4
    assert index["metadata"]["total_size"] == total

    src = AutoModelForCausalLM.from_pretrained(str(dense_run / "checkpoints/step_000020/policy")).eval()
    exp = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    diff = max(float((a - b).abs().max()) for a, b in zip(logits(src, tok), logits(exp, tok)))
    assert diff <= 1e-5
    card = (out / "README.md").read_text()
    assert "sspo" in card and "lr: 1.0e-06" in card and "verification: passed" in card
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


def test_embedded_moe_bf16_round_trip(moe_run, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "hf_moe"
    rc, stdout, err = run_cli([moe_run, out, "--max-shard-size", "8KB", "--json"], capsys)  # bf16 default
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["source"] == "embedded" and rep["dtype"] == "bf16" and len(rep["files"]) >= 3
    v = rep["verification"]
    assert v["exact_max_abs_diff"] <= 1e-5 and v["drift_max_abs_diff"] <= v["drift_tol"]
    assert v["drift_max_abs_diff"] > 0  # bf16 rounding is real
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in index["weight_map"]  # HF on-disk MoE layout
    with safe_open(str(out / index["weight_map"]["model.embed_tokens.weight"]), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # independent check: exported bf16 weights == source weights rounded to bf16, bit for bit
    src = AutoModelForCausalLM.from_pretrained(str(moe_run / "checkpoints/step_000020/policy")).eval()
    exp = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ssd, esd = src.state_dict(), exp.state_dict()
    assert set(ssd) == set(esd)
    for k in ssd:
        assert torch.equal(ssd[k].to(torch.bfloat16).float(), esd[k]), k
    tok = AutoTokenizer.from_pretrained(str(out))
    drift = max(float((a - b).abs().max()) for a, b in zip(logits(src, tok), logits(exp, tok)))
    assert drift <= v["drift_tol"]


def test_critic_export_value_round_trip(sppo_run, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    step = sppo_run / "checkpoints" / "step_000020"
    out = tmp_path / "critic"
    rc, stdout, err = run_cli(
        [step, out, "--what", "critic", "--dtype", "fp32", "--max-shard-size", "30KB", "--json"], capsys
    )
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["what"] == "critic" and rep["verification"]["value_max_abs_diff"] <= 1e-6
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForSequenceClassification"]
    assert cfg["sppo_value"]["activation"] == "sigmoid" and cfg["sppo_value"]["meaning"] == "P(reward=1 | prompt)"
    assert cfg["sppo_value"]["read_position"] == "last prompt token"
    assert "generation_config.json" not in os.listdir(out)
    card = (out / "README.md").read_text()
    assert "sigmoid" in card and "P(reward=1 | prompt)" in card and "sppo" in card
    crit = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert crit.config.num_labels == 1
    src = AutoModelForSequenceClassification.from_pretrained(str(step / "critic")).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]])
            v_exp = torch.sigmoid(crit(input_ids=ids).logits[0, 0])
            # the trained read-out: head at the LAST PROMPT TOKEN of the prompt-only input
            h = src.model(input_ids=ids).last_hidden_state[0, -1]
            v_src = torch.sigmoid(src.score(h)[0])
            assert abs(float(v_exp - v_src)) <= 1e-6
            assert 0.0 < float(v_exp) < 1.0


def test_what_critic_without_critic_dir(dense_run, tmp_path, capsys):
    out = tmp_path / "c"
    rc, _, err = run_cli([dense_run, out, "--what", "critic"], capsys)
    assert rc == 2 and "no critic/" in err and len(err.strip().splitlines()) == 1
    assert_clean(out)


# ------------------------------------------------------------------ NeMo-RL DCP (2 gloo processes)
def _dcp_worker(rank: int, world: int, port: int, jobs, errfile: str) -> None:
    """One gloo rank: shard each full state dict on dim 0 over a CPU device mesh (FSDP2-style
    DTensors) and write it with ``torch.distributed.checkpoint``, as NeMo-RL's DTensor workers do."""
    import traceback

    code = 0
    try:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from safetensors.torch import load_file
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
        for src, dst, layout in jobs:
            sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in load_file(str(src)).items()}
            if layout == "hf":  # v2 default model_save_format=safetensors: per-rank files + DCP offsets
                dcp.save(sharded, storage_writer=dcp.HuggingFaceStorageWriter(str(dst), save_distributed=True))
            else:  # torch_save (.distcp); v1 nests: dcp.save({"model": ModelState(model)})
                dcp.save({"model": sharded} if layout == "v1" else sharded, checkpoint_id=str(dst))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the worker reports any failure to the test through errfile
        Path(errfile).write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_nemo_rl_step(root: Path, model, *, layout: str) -> Path:
    """NeMo-RL-like ``step_N``: config.yaml, training_info.json, policy/tokenizer, policy/weights (DCP)."""
    from safetensors.torch import save_file

    base = root / "base_model"  # what policy.model_name points to (an HF config dir)
    model.config.save_pretrained(str(base))
    step = root / "results" / "step_7"
    (step / "policy").mkdir(parents=True)
    make_tokenizer(step / "policy" / "tokenizer")
    (step / "config.yaml").write_text(
        f"policy:\n  model_name: {base}\n  tokenizer:\n    name: {base}\n  dtensor_cfg:\n    enabled: true\n"
        f"value:\n  model_name: {base}\n"
        "loss_fn:\n  granular:\n    algorithm: gspo\ngrpo:\n  num_generations_per_prompt: 8\n"
    )
    (step / "training_info.json").write_text(json.dumps({"step": 7}))
    weights = step / "policy" / "weights"
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}  # in-memory layout
    save_file(full, str(root / "full.safetensors"))
    return step, weights if layout == "v1" else weights / "model", root / "full.safetensors"


def run_dcp_save(jobs: list[tuple[Path, Path, str]], tmp: Path):
    """2 real gloo processes (forked: they inherit the imported torch, so start-up is cheap)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    port = _free_port()
    errs = [tmp / f"rank{r}.err" for r in range(2)]
    procs = [ctx.Process(target=_dcp_worker, args=(r, 2, port, jobs, str(errs[r]))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        if p.is_alive():
            p.kill()
    for p, e in zip(procs, errs):
        assert p.exitcode == 0, e.read_text()[-3000:] if e.exists() else f"exit code {p.exitcode}"


@pytest.fixture(scope="module")
def dcp_steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("dcp")
    dense = make_policy(tie=True, seed=3)  # tied embeddings: lm_head must be dropped
    moe = make_policy(moe=True, seed=4)  # in-memory fused experts: must be un-fused
    s1, w1, f1 = make_nemo_rl_step(root / "v1", dense, layout="v1")
    s2, w2, f2 = make_nemo_rl_step(root / "v2", moe, layout="v2")
    # PPO value model (HF sequence classifier, as NeMo-RL's DTensor value worker) in s1/value/weights/model
    from safetensors.torch import save_file
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(5)
    value = AutoModelForSequenceClassification.from_config(tiny_config(tie=True, num_labels=1)).eval()
    f3 = root / "value.safetensors"
    save_file({k: v.detach().clone().contiguous() for k, v in value.state_dict().items()}, str(f3))
    w3 = s1 / "value" / "weights" / "model"
    s4, w4, f4 = make_nemo_rl_step(root / "st", dense, layout="v2")
    run_dcp_save([(f1, w1, "v1"), (f2, w2, "v2"), (f3, w3, "v2"), (f4, w4, "hf")], root)
    return {"v1": (s1, dense), "v2": (s2, moe), "value": (s1, value), "st": (s4, dense)}


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["v1", "v2", "st"])
def test_dcp_round_trip(dcp_steps, layout, tmp_path, capsys):
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    step, model = dcp_steps[layout]
    wdir = step / "policy" / "weights" / ("" if layout == "v1" else "model")
    if layout == "st":
        assert len([f for f in os.listdir(wdir) if f.endswith(".safetensors")]) == 2  # one per rank
    else:
        assert sorted(f for f in os.listdir(wdir) if f.endswith(".distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        keys = set(FileSystemReader(str(wdir)).read_metadata().state_dict_metadata)
        assert ("model.model.embed_tokens.weight" in keys) == (layout == "v1")
    out = tmp_path / f"hf_{layout}"
    rc, stdout, err = run_cli(
        [
            step.parent,
            out,
            "--dtype",
            "fp32",
            "--max-shard-size",
            "16KB",
            "--json",
            *sum((["--prompts", p] for p in PROMPTS), []),
        ],
        capsys,
    )
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["source"] == "dcp" and rep["step_dir"].endswith("step_7")
    assert rep["verification"]["prompts"] == 3 and rep["verification"]["exact_max_abs_diff"] <= 1e-5
    exp = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tok = AutoTokenizer.from_pretrained(str(out))
    diff = max(float((a - b).abs().max()) for a, b in zip(logits(model, tok), logits(exp, tok)))
    assert diff <= 1e-5
    wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    if layout != "v2":
        assert "lm_head.weight" not in wm and exp.config.tie_word_embeddings
    else:
        assert "model.layers.1.mlp.experts.0.gate_proj.weight" in wm
    assert "gspo" in (out / "README.md").read_text()


@pytest.mark.dist
def test_dcp_value_model_as_critic(dcp_steps, tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    step, value = dcp_steps["value"]
    out = tmp_path / "critic"
    rc, stdout, err = run_cli([step, out, "--what", "critic", "--dtype", "fp32", "--json"], capsys)
    assert rc == 0, err
    assert json.loads(stdout)["verification"]["value_max_abs_diff"] <= 1e-6
    crit = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    assert crit.config.sppo_value["activation"] == "sigmoid" and crit.config.num_labels == 1
    tok = AutoTokenizer.from_pretrained(str(out))
    with torch.no_grad():
        for p in PROMPTS:
            ids = torch.tensor([tok(p)["input_ids"]])
            assert torch.allclose(crit(input_ids=ids).logits, value(input_ids=ids).logits, atol=1e-5)


@pytest.mark.dist
def test_dcp_export_applies_training_hf_config_overrides(tmp_path, capsys):
    """A run trained with ``policy.hf_config_overrides`` (YaRN): NeMo-RL's DTensor worker built its
    model from ``AutoConfig.from_pretrained(model_name, **hf_config_overrides)``, so the exported
    model must carry the override and compute what the trained model computed."""
    import yaml
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from export_cpu.tiny_hf import YARN_OVERRIDES

    model = make_policy(seed=8)
    step, weights, full = make_nemo_rl_step(tmp_path / "run", model, layout="v1")
    cfg = yaml.safe_load((step / "config.yaml").read_text())
    cfg["policy"]["hf_config_overrides"] = YARN_OVERRIDES
    (step / "config.yaml").write_text(yaml.safe_dump(cfg))
    run_dcp_save([(full, weights, "v1")], tmp_path)
    out = tmp_path / "hf"
    rc, stdout, err = run_cli([step, out, "--dtype", "fp32", "--json"], capsys)
    assert rc == 0, err

    base = cfg["policy"]["model_name"]
    trained_cfg = AutoConfig.from_pretrained(base, **YARN_OVERRIDES)  # what the worker built
    exported = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert exported.config.rope_parameters == trained_cfg.rope_parameters
    assert json.loads((out / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"
    trained = AutoModelForCausalLM.from_config(trained_cfg, dtype=torch.float32).eval()
    trained.load_state_dict(model.state_dict())
    tok = AutoTokenizer.from_pretrained(str(out))
    same = max(float((a - b).abs().max()) for a, b in zip(logits(trained, tok), logits(exported, tok)))
    without = max(float((a - b).abs().max()) for a, b in zip(logits(model, tok), logits(exported, tok)))
    print(f"max |Δlogit| exported vs trained (YaRN) {same:.3g}, vs the model without the override {without:.3g}")
    assert same <= 1e-5
    assert without > 100 * 1e-5  # the override changes what the model computes (measured 2.6)
    assert any("hf_config_overrides applied" in n for n in json.loads(stdout)["notes"])


def test_dcp_consolidated_layout(tmp_path, capsys):
    """DTensor v2 with ``save_consolidated``: weights/model/consolidated/ is an HF dir."""
    step = tmp_path / "step_3"
    model = make_policy(seed=6)
    model.save_pretrained(str(step / "policy" / "weights" / "model" / "consolidated"))
    make_tokenizer(step / "policy" / "tokenizer")
    (step / "config.yaml").write_text("policy:\n  model_name: Qwen/Qwen3-0.6B\ngrpo: {}\n")
    out = tmp_path / "hf"
    rc, stdout, err = run_cli([step, out, "--dtype", "fp32", "--json"], capsys)
    assert rc == 0, err
    rep = json.loads(stdout)
    assert rep["source"] == "dcp" and rep["files"] == ["model.safetensors"] and rep["verification"]
    assert "grpo" in (out / "README.md").read_text()


@pytest.mark.dist
def test_dcp_corrupt_checkpoints(dcp_steps, tmp_path, capsys):
    import shutil

    for case in ("missing", "truncated", "metadata", "mismatched", "st_missing_rank"):
        step, _ = dcp_steps["st" if case.startswith("st") else "v1"]
        bad = tmp_path / f"bad_{case}" / "step_7"
        shutil.copytree(step, bad)
        w = bad / "policy" / "weights"
        extra = []
        if case == "st_missing_rank":
            sorted((w / "model").glob("*.safetensors"))[0].unlink()  # rank 0's file
            want = "a rank's shard is missing"
        elif case == "missing":
            (w / "__1_0.distcp").unlink()
            want = "missing DCP shard"
        elif case == "truncated":
            data = (w / "__0_0.distcp").read_bytes()
            (w / "__0_0.distcp").write_bytes(data[: len(data) // 2])
            want = "truncated DCP shard"
        elif case == "metadata":
            data = (w / ".metadata").read_bytes()
            (w / ".metadata").write_bytes(data[: len(data) // 3])
            want = "corrupt DCP metadata"
        else:  # config of another size than the saved tensors
            other = tmp_path / "other_cfg"
            tiny_config(tie=True, hidden_size=48).save_pretrained(str(other))
            extra = ["--model-config", other]
            want = "config expects"
        out = tmp_path / f"out_{case}"
        rc, _, err = run_cli([bad, out, *extra], capsys)
        assert rc == 2, case
        assert len(err.strip().splitlines()) == 1 and want in err, (case, err)
        assert err.startswith("nemo-granular export: error:")
        assert_clean(out)


# ------------------------------------------------------------------ corrupt / partial / mismatched
def test_embedded_corrupt_checkpoints(dense_run, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    src_step = dense_run / "checkpoints" / "step_000020"
    cases = {}
    # truncated safetensors
    bad = tmp_path / "trunc"
    shutil.copytree(src_step, bad)
    data = (bad / "policy/model.safetensors").read_bytes()
    (bad / "policy/model.safetensors").write_bytes(data[: len(data) - 1000])
    cases["trunc"] = (bad, "truncated safetensors file")
    # wrong shape
    bad = tmp_path / "shape"
    shutil.copytree(src_step, bad)
    sd = load_file(str(bad / "policy/model.safetensors"))
    sd["model.layers.1.self_attn.q_proj.weight"] = sd["model.layers.1.self_attn.q_proj.weight"][:16].contiguous()
    save_file(sd, str(bad / "policy/model.safetensors"))
    cases["shape"] = (bad, "has shape (16, 32), config expects (32, 32)")
    # missing tensor
    bad = tmp_path / "missing"
    shutil.copytree(src_step, bad)
    sd = load_file(str(bad / "policy/model.safetensors"))
    del sd["model.norm.weight"]
    save_file(sd, str(bad / "policy/model.safetensors"))
    cases["missing"] = (bad, "missing tensor model.norm.weight")
    # missing shard of a sharded policy dir
    bad = tmp_path / "shard"
    shutil.copytree(src_step, bad)
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(bad / "policy"))
    shutil.rmtree(bad / "policy")
    m.save_pretrained(str(bad / "policy"), max_shard_size="20KB")
    shards = sorted((bad / "policy").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    cases["shard"] = (bad, "missing shard")
    # latest names a step that is not there
    bad = tmp_path / "latest_run"
    (bad / "checkpoints").mkdir(parents=True)
    (bad / "checkpoints/latest").write_text("step_000099\n")
    cases["latest"] = (bad, "does not exist")
    for name, (path, want) in cases.items():
        out = tmp_path / f"out_{name}"
        rc, _, err = run_cli([path, out], capsys)
        assert rc == 2, name
        assert len(err.strip().splitlines()) == 1 and want in err, (name, err)
        assert_clean(out)


def test_existing_output_is_refused(dense_run, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc, _, err = run_cli([dense_run, out, "--no-verify"], capsys)
    assert rc == 2 and "already exists" in err
    assert (out / "keep.txt").read_text() == "x"


@pytest.mark.parametrize("exc", [OSError, KeyboardInterrupt])
def test_interrupted_export_leaves_nothing(dense_run, tmp_path, monkeypatch, exc):
    """Fault injection in the file system layer: the 3rd shard write fails mid-export."""
    import safetensors.torch

    from nemo_granular.export import export_checkpoint

    real, calls = safetensors.torch.save_file, []

    def failing(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 3:
            Path(filename).write_bytes(b"partial")
            raise exc("disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", failing)
    out = tmp_path / "interrupted"
    with pytest.raises(exc):
        export_checkpoint(dense_run, out, dtype="fp32", max_shard_size="20KB")
    assert len(calls) == 3
    assert_clean(out)


def test_verification_failure_leaves_nothing(dense_run, tmp_path, capsys):
    """Verification that cannot run (no prompt yields a token) fails the export → no output."""
    out = tmp_path / "o"
    rc, _, err = run_cli([dense_run, out, "--prompts", "", "--dtype", "fp32"], capsys)
    assert rc == 2 and "no verification prompt produced any token" in err
    assert_clean(out)


def test_verify_detects_a_different_model(dense_run, tmp_path):
    """The verifier itself: an exported dir compared against another model must fail."""
    from nemo_granular.export.cli import export_checkpoint
    from nemo_granular.export.embedded import load_embedded
    from nemo_granular.export.verify import verify_export

    out = tmp_path / "hf"
    export_checkpoint(dense_run, out, dtype="fp32", verify=False)
    src = load_embedded(dense_run / "checkpoints" / "step_000020", "policy")
    assert verify_export(src, out, "fp32", PROMPTS)["exact_max_abs_diff"] <= 1e-5
    src.reference = lambda: make_policy(seed=11)
    with pytest.raises(ValueError, match="verification failed"):
        verify_export(src, out, "fp32", PROMPTS)


# ------------------------------------------------------------------------------ Megatron source
def _megatron_step(root: Path, run_config: str, model_name: str) -> Path:
    step = root / "step_5"
    it = step / "policy" / "weights" / "iter_0000005"
    it.mkdir(parents=True)
    (it / "run_config.yaml").write_text(run_config)
    (step / "policy" / "weights" / "latest_checkpointed_iteration.txt").write_text("5")
    (step / "config.yaml").write_text(f"policy:\n  model_name: {model_name}\n  megatron_cfg:\n    enabled: true\n")
    return step


def test_megatron_refusals_and_missing_bridge(tmp_path, capsys):
    """What the Megatron path refuses in one line: a checkpoint format Bridge's loader cannot read,
    and (in a world without Megatron-Bridge) the missing package. Saved EP/TP layouts are NOT refused:
    tests/test_export_megatron.py exports EP1, EP2 and TP2×EP2 Qwen3-MoE checkpoints."""
    import subprocess
    import sys

    from conftest import env_without_nemo_rl

    fsdp = _megatron_step(
        tmp_path / "fsdp",
        "checkpoint:\n  ckpt_format: fsdp_dtensor\nmodel:\n  expert_model_parallel_size: 8\n",
        "Qwen/Qwen3-30B-A3B",
    )
    out = tmp_path / "o1"
    rc, _, err = run_cli([fsdp, out], capsys)
    assert rc == 2 and "ckpt_format='fsdp_dtensor'" in err and "reads only torch_dist" in err
    assert len(err.strip().splitlines()) == 1
    assert_clean(out)

    moe = _megatron_step(
        tmp_path / "moe",
        "model:\n  _target_: megatron.bridge.models.qwen.qwen_provider."
        "Qwen3MoEModelProvider\n  num_moe_experts: 128\n  expert_model_parallel_size: 8\n"
        "  tensor_model_parallel_size: 2\n",
        "Qwen/Qwen3-30B-A3B",
    )
    out = tmp_path / "o2"
    code = "import sys; from nemo_granular.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.run(
        [sys.executable, "-c", code, "export", str(moe), str(out)],
        capture_output=True,
        text=True,
        env=env_without_nemo_rl(),
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "needs Megatron-Bridge (package megatron-bridge" in err[0], err
    assert_clean(out)


# ------------------------------------------------------------------------------------ unit parts
def test_parse_size_and_shard_plan():
    from nemo_granular.export.writer import parse_size, plan_shards

    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("1000") == 1000
    assert parse_size("1.5MB") == 1_500_000
    for bad in ("five", "-1GB", "0", "3XB"):
        with pytest.raises(ValueError, match="max-shard-size"):
            parse_size(bad)
    shapes = {f"layers.{i}.w": (torch.Size([10, 10]), torch.float32) for i in range(12)}
    shapes["big"] = (torch.Size([100, 100]), torch.float32)
    plan = plan_shards(shapes, torch.bfloat16, 450)  # 200 bytes per small tensor in bf16
    flat = [k for s in plan for k in s]
    assert sorted(flat) == sorted(shapes) and len(flat) == len(set(flat))
    assert ["big"] in plan  # oversize tensor alone
    assert flat.index("layers.2.w") < flat.index("layers.10.w")  # natural order
    assert all(sum(200 for k in s) <= 450 for s in plan if s != ["big"])


def test_detects_unknown_layout(tmp_path, capsys):
    (tmp_path / "junk").mkdir()
    rc, _, err = run_cli([tmp_path / "junk", tmp_path / "o"], capsys)
    assert rc == 2 and "cannot detect the checkpoint format" in err
    rc, _, err = run_cli([tmp_path / "absent", tmp_path / "o"], capsys)
    assert rc == 2 and "does not exist" in err
