"""The fault-injection suite (issue 34 item 4): a curated list of faults, each with the smallest tests that catch it.

A fault is one small text replacement in one file of ``nemo_granular/``. Each case copies the package into
a temporary folder, applies its fault there, and runs the fault's tests against the copy in a process of its
own (forked from a server that imported torch and pytest once; the run checks that ``nemo_granular`` comes
from the copy before pytest starts). The tests must FAIL: pytest's exit 1 with at least one failed test. An
import or collection error (exit 2, 3, 4, 5) is not a catch, nor is a run where only a fixture errs. A fault
whose ``old`` text does not occur exactly once fails its case: when the code moves, the table moves with it.
``test_catching_tests_pass_without_a_fault`` runs every catching test on an unmutated copy the same way: they
must pass, so a harness that fails every run cannot pass as "fault caught". The table, with what each case
cost: docs/testing.md ("The fault-injection suite"), checked against this list by
``test_docs_table_names_every_fault``.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import ROOT, env_without_nemo_rl


@dataclass(frozen=True)
class Fault:
    name: str
    file: str  # relative to nemo_granular/
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids relative to the repository root, each one test item


FAULTS = (
    # 1. the loss's backward drops the upstream gradient: d(c·loss) = d(loss) for every c
    Fault(
        "backward_ignores_upstream_gradient",
        "core/linearized_loss.py",
        "return (grad * scale).to(ctx.logp_dtype), None, None, None",
        "return (grad * ctx.grad_sign).to(ctx.logp_dtype), None, None, None",
        ("tests/test_loss_presets.py::test_backward_honours_upstream_gradient[sspo-plain]",),
    ),
    # 2. NeMo-RL worker path: the π_old entropy of position j lands in column j + 2 instead of j + 1
    Fault(
        "pi_old_entropy_one_column_late",
        "nemo_rl/workers.py",
        "out[:, 1 : n + 1] = per_position[:, :n]",
        "out[:, 2 : n + 1] = per_position[:, : n - 1]",
        ("tests/test_nemo_rl_glue.py::test_megatron_unpacked_and_dtensor_packed_entropy_match_dense",),
    ),
    # 2b. the embedded trainer's π_old pass, the same fault
    Fault(
        "embedded_pi_old_entropy_one_column_late",
        "embedded/rollout.py",
        'batch["prev_entropy"] = torch.cat([zero, ent], dim=1)',
        'batch["prev_entropy"] = torch.cat([zero, zero, ent[:, :-1]], dim=1)',
        ("tests/test_embedded.py::test_old_policy_pass_puts_token_js_logprob_and_entropy_in_column_j",),
    ),
    # 3. the driver ranks the entropy in the loss's shifted columns ([:, 1:]) and stores the ids unshifted
    Fault(
        "espo_driver_group_ids_one_token_early",
        "nemo_rl/policy.py",
        "return entropy_group_ids(ent, mask & torch.isfinite(ent), granular.entropy_cut_points, GROUP_IDS_DTYPE)",
        "return torch.nn.functional.pad(entropy_group_ids(ent[:, 1:], (mask & torch.isfinite(ent))[:, 1:], "
        "granular.entropy_cut_points, GROUP_IDS_DTYPE), (0, 1), value=-1)",
        ("tests/test_nemo_rl_loss_equivalence.py::test_groups_cross_no_response_and_depend_on_driver_keys",),
    ),
    # 4. SSPO's upper bound shrinks with the group entropy instead of growing: 1 + α − H̄
    Fault(
        "sspo_upper_bound_entropy_sign",
        "core/clipping.py",
        "hi = torch.clamp(1.0 + alpha + h, max=gamma)",
        "hi = torch.clamp(1.0 + alpha - h, max=gamma)",
        ("tests/test_core_clipping.py::test_sspo_bounds_eq_13_15[0.0-0.8-1.75]",),
    ),
    # 5. SSPO's γ default (the paper's 1.75)
    Fault(
        "sspo_gamma_default",
        "config.py",
        "gamma: Annotated[float, Field(ge=1.0)] = 1.75",
        "gamma: Annotated[float, Field(ge=1.0)] = 2.0",
        ("tests/test_loss_presets.py::test_preset_matches_reference[0-sspo]",),
    ),
    # 6. Megatron's packed π_old entropy unpacked at the logits' positions, not the tokens' columns
    Fault(
        "packed_entropy_offset",
        "nemo_rl/workers.py",
        "return unpack_sequences(full.float(), cu_seqlens_padded, input_lengths, seq_len, shift=1)",
        "return unpack_sequences(full.float(), cu_seqlens_padded, input_lengths, seq_len, shift=0)",
        ("tests/test_nemo_rl_glue.py::test_megatron_packed_entropy_matches_dense",),
    ),
    # 7. the token mean divided by this microbatch's token count instead of global_valid_toks
    Fault(
        "token_mean_over_the_microbatch_count",
        "losses.py",
        "inv_gvt, inv_gvs = _inverse_counts(global_valid_toks, global_valid_seqs, L)",
        "inv_gvt, inv_gvs = _inverse_counts((mask_f * sm[:, None]).sum(), global_valid_seqs, L)",
        ("tests/test_loss_identities.py::test_invariant_to_microbatch_split[grpo]",),
    ),
    # 8. a packed sequence read from the end of its padded slot minus its length (the unpadded layout's start)
    Fault(
        "unpack_from_the_slot_end",
        "distributed/packing.py",
        "src = cu[:B, None] + cols[None, :] - shift",
        "src = cu[1:B + 1, None] - lengths[:, None] + cols[None, :] - shift",
        ("tests/test_distributed_pure.py::test_pack_unpack_roundtrip_and_shift",),
    ),
    # 9. the driver writes the group ids under a key the loss does not read
    Fault(
        "driver_group_ids_key",
        "nemo_rl/policy.py",
        'data["granular_group_ids"] = ids',
        'data["group_ids"] = ids',
        ("tests/test_nemo_rl_glue.py::test_driver_group_ids_sspo_and_shape_checks",),
    ),
    # 9b. the loss no longer reads the driver's key: without a tokenizer SSPO cannot group at all
    Fault(
        "loss_ignores_driver_group_ids",
        "losses.py",
        'if "granular_group_ids" in data:',
        'if "group_ids" in data:',
        ("tests/test_loss_presets.py::test_precomputed_group_ids_are_used",),
    ),
    # 10. SPPO's critic regresses V(prompt) on 1 − R instead of the binary reward R
    Fault(
        "sppo_critic_target",
        "losses.py",
        "bce = sppo_critic_bce(v, rewards)",
        "bce = sppo_critic_bce(v, 1 - rewards)",
        ("tests/test_loss_dtype.py::test_value_loss_float64",),
    ),
    # more, cheap: the loss reads NeMo-RL's [B, S] keys one column early ([:, :-1] for [:, 1:])
    Fault(
        "loss_reads_keys_one_column_early",
        "losses.py",
        "x = x[:, 1:] if shift else x",
        "x = x[:, :-1] if shift else x",
        ("tests/test_loss_presets.py::test_preset_matches_reference[0-grpo]",),
    ),
    # the delimiter token opens the next segment instead of closing its own (inclusive cumulative sum)
    Fault(
        "segment_delimiter_opens_next_segment",
        "core/groups.py",
        "seg = torch.cumsum(is_delimiter, dim=-1) - is_delimiter",
        "seg = torch.cumsum(is_delimiter, dim=-1)",
        ("tests/test_core_groups.py::test_segment_delimiter_closes_its_segment_and_tail_segment",),
    ),
    # GRPO's advantage divided by the biased standard deviation (NeMo-RL's is unbiased)
    Fault(
        "grpo_advantage_biased_std",
        "core/advantages.py",
        "var = (s2_i - n_i * mean * mean) / (n_i - 1).clamp(min=1)",
        "var = (s2_i - n_i * mean * mean) / n_i.clamp(min=1)",
        ("tests/test_core_advantages.py::test_grpo_unbiased_std_and_edge_groups",),
    ),
)

# The runs fork from one server process that imported torch and pytest once: the module took 91 s of CPU with a
# fresh `python -m pytest` per case, 39 s this way. A run: its own fork, in the copy's folder with the copy first
# on sys.path, proves that it imports the copy, then runs pytest in-process; the server answers each request
# with the run's exit code.
SERVER = r"""
import json, os, sys
# what every run imports, never nemo_granular (each run's pytest then warns that the plugin hypothesis was
# imported before it could rewrite its asserts: harmless)
import hypothesis, numpy, omegaconf, pydantic, pytest, torch
assert "nemo_granular" not in sys.modules
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        rc = 98
        try:
            out = os.open(req["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            copy = os.path.realpath(req["copy"])
            os.chdir(copy)
            sys.path.insert(0, copy)
            rest = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            os.environ["PYTHONPATH"] = os.pathsep.join([copy, *rest])  # the copy for the tests' own subprocesses
            import nemo_granular
            where = os.path.realpath(nemo_granular.__file__)
            if where.startswith(copy + os.sep):
                rc = int(pytest.main(req["args"]))
            else:
                print(f"fault harness: nemo_granular was imported from {where}, not from the copy in {copy}")
                rc = 97
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""
NOT_THE_COPY = 97
RUN_TIMEOUT_S = 300


def _copy_package(dest: Path) -> Path:
    shutil.copytree(ROOT / "nemo_granular", dest / "nemo_granular", ignore=shutil.ignore_patterns("__pycache__"))
    return dest


@pytest.fixture(scope="module")
def run_tests(tmp_path_factory):
    """``run_tests(copy, tests, *options)`` → (pytest's exit code, its output): ``tests`` run on the package
    copy in ``copy`` (the standalone world: no NeMo-RL on the path)."""
    where = tmp_path_factory.mktemp("fault_server")
    env = env_without_nemo_rl()
    for var in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS"):
        env.pop(var, None)
    with open(where / "server.err", "w") as err:
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER],
            cwd=where,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )

    def run(copy: Path, tests, *options: str) -> tuple[int, str]:
        out = copy / "pytest.out"
        args = [
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            "--rootdir",
            str(ROOT),
            "-c",
            str(ROOT / "pyproject.toml"),
            *options,
            *(str(ROOT / t) for t in tests),
        ]
        server.stdin.write(json.dumps({"copy": str(copy), "out": str(out), "args": args}) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], RUN_TIMEOUT_S)
        if not ready:
            os.killpg(server.pid, signal.SIGKILL)
        answer = server.stdout.readline() if ready else ""
        assert answer, (
            f"the fault server gave no answer ({'timed out' if not ready else 'it ended'}): "
            f"{(where / 'server.err').read_text()[-2000:]}"
        )
        return json.loads(answer)["rc"], out.read_text() if out.exists() else ""

    yield run
    server.stdin.close()
    server.wait(timeout=60)


def _summary(output: str) -> str:
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|errors?|skipped)", line)]
    return lines[-1] if lines else "(no pytest summary line)"


@pytest.mark.parametrize("fault", FAULTS, ids=[f.name for f in FAULTS])
def test_fault_is_caught(fault, tmp_path, run_tests):
    copy = _copy_package(tmp_path)
    path = copy / "nemo_granular" / fault.file
    text = path.read_text()
    found = text.count(fault.old)
    assert found == 1, (
        f"{fault.name}: nemo_granular/{fault.file} holds the fault's text {found} times, not once "
        f"(the code moved: update FAULTS and docs/testing.md)"
    )
    path.write_text(text.replace(fault.old, fault.new))
    rc, out = run_tests(copy, fault.tests, "-x")
    tail = "\n".join(out.splitlines()[-40:])
    assert rc != NOT_THE_COPY, out
    assert rc != 0, f"fault {fault.name} SURVIVED: {', '.join(fault.tests)} passed with it\n{tail}"
    assert rc == 1 and re.search(r"\b\d+ failed\b", _summary(out)), (
        f"fault {fault.name}: exit {rc} without a failed test (an import, collection or fixture error is not a "
        f"catch)\n{tail}"
    )


def test_catching_tests_pass_without_a_fault(tmp_path, run_tests):
    tests = sorted({t for f in FAULTS for t in f.tests})
    rc, out = run_tests(_copy_package(tmp_path), tests)
    summary = _summary(out)
    assert rc == 0, f"the catching tests fail WITHOUT a fault (exit {rc}): {summary}\n{out[-4000:]}"
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary)}
    assert counts == {"passed": len(tests)}, f"{len(tests)} tests named, the run says: {summary}"


def test_docs_table_names_every_fault():
    """docs/testing.md's table is this one: a row per fault, naming its file and the tests that catch it."""
    text = (ROOT / "docs" / "testing.md").read_text()
    section = text.split("## The fault-injection suite", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): line for line in section.splitlines() if (m := re.match(r"\| `([a-z0-9_]+)` \|", line))}
    assert set(rows) == {f.name for f in FAULTS}, "docs/testing.md's fault table and FAULTS name different faults"
    for f in FAULTS:
        assert f"`{f.file}`" in rows[f.name], f"{f.name}: the docs row does not name {f.file}"
        for test in f.tests:
            module, _, name = test.partition("::")
            assert Path(module).name in rows[f.name] and name.split("[")[0] in rows[f.name], (f.name, test)
