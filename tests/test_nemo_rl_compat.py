"""``nemo_granular.nemo_rl.compat``: every NeMo-RL name the plugin imports goes through it, each resolves
against the importable NeMo-RL (v0.7.0 or main 7ea279ab), every version difference of its tables is
true of that NeMo-RL, docs/nemo-rl.md shows the tables, and the NeMo-RL 0.8 locations are found when
the old ones are gone.

World: NeMo-RL (``nemo_rl_src``; ``megatron_workers`` for the Megatron worker modules), both versions;
the version detection and the source scans also run without NeMo-RL.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

import pytest
import torch
import typing_extensions

from conftest import env_without_nemo_rl
from nemo_granular.nemo_rl import compat

pytestmark = pytest.mark.v070

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nemo_granular"


def _nemo_rl_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "nemo_rl":
            out.append(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "nemo_rl" and a.name != "nemo_rl"]
    return out


def test_the_package_imports_nemo_rl_only_through_compat():
    offenders = {
        str(p.relative_to(PACKAGE)): found
        for p in PACKAGE.rglob("*.py")
        if p.name != "compat.py" and (found := _nemo_rl_imports(p))
    }
    assert offenders == {}


def test_tests_import_version_dependent_names_only_through_compat():
    """A test that imports a name of compat.VERSIONED (or from a module one of them moved to) straight
    from nemo_rl works in one NeMo-RL world only: both worlds run these tests."""
    moved_modules = {compat._place(spec)[0] for places in compat.VERSIONED.values() for spec in places.values() if spec}
    offenders = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for line in _nemo_rl_imports(path):
            if line.startswith("from "):
                mod, names = line[5:].split(" import ")
                bad = [
                    n
                    for n in names.split(", ")
                    if n in compat.VERSIONED
                    or (mod in moved_modules and n.lstrip("_") in {k.lstrip("_") for k in compat.VERSIONED})
                ]
                if bad:
                    offenders.setdefault(str(path.relative_to(ROOT)), []).append(line)
    assert offenders == {}


def _fake_nemo_rl(tmp_path: Path, ver: tuple[int, int, int], main_marker: bool) -> Path:
    root = tmp_path / f"nemo_rl_{'.'.join(map(str, ver))}_{main_marker}"
    (root / "algorithms").mkdir(parents=True)
    (root / "package_info.py").write_text(
        f"MAJOR = {ver[0]}\nMINOR = {ver[1]}\nPATCH = {ver[2]}\n"
        f"PRE_RELEASE = ''\nVERSION = (MAJOR, MINOR, PATCH, PRE_RELEASE)\n"
    )
    if main_marker:
        (root / compat.MAIN_MARKER).write_text("")
    return root


def test_version_detection_from_the_package_folder(tmp_path):
    """v0.7.0 by its package version; main at 7ea279ab still says 0.6.0 and is told apart from the 0.6.0
    release by a file only main has; anything older is refused in one line naming both supported ones."""
    assert compat.classify(_fake_nemo_rl(tmp_path, (0, 7, 0), False)).key == compat.V0_7
    assert compat.classify(_fake_nemo_rl(tmp_path, (0, 7, 1), False)).key == compat.V0_7
    assert compat.classify(_fake_nemo_rl(tmp_path, (0, 6, 0), True)).key == compat.MAIN
    assert compat.classify(_fake_nemo_rl(tmp_path, (0, 8, 0), False)).key == compat.MAIN
    with pytest.raises(
        compat.UnsupportedNemoRL,
        match=r"^NeMo-RL 0\.6\.0 at .* is not supported: nemo-granular "
        r"runs on NeMo-RL v0\.7\.0 and NeMo-RL main \(7ea279ab\)$",
    ):
        compat.classify(_fake_nemo_rl(tmp_path, (0, 6, 0), False))


def test_conf_reads_dicts_and_pydantic_models_alike():
    """NeMo-RL's config sections: pydantic models on main (fields and extras), dicts on v0.7.0."""
    from pydantic import BaseModel

    class Section(BaseModel, extra="allow"):
        enabled: bool = False

    class Master(BaseModel, extra="allow"):
        grpo: Section
        ppo: dict

    m = Master(grpo=Section(enabled=True, max_age=3), ppo={"x": {"x": 1}, "none": None}, plugin={"k": 2})
    assert compat.conf(m, "grpo.enabled") is True and compat.conf(m, "grpo.max_age") == 3
    assert compat.conf(m, "ppo.x.x") == 1 and compat.conf(m, "plugin.k") == 2
    assert compat.conf(m, "ppo.none") is None and compat.conf(m, "ppo.none.deeper", "d") == "d"
    assert compat.conf(m, "grpo.async_grpo.enabled", False) is False
    with pytest.raises(KeyError, match="ppo.async_ppo.enabled"):
        compat.conf(m, "ppo.async_ppo.enabled")


def test_docs_version_table_is_rendered_from_compat():
    """docs/nemo-rl.md's version table is compat's three tables exactly (each row is checked against the
    real NeMo-RL of this world below): neither can drift."""
    doc = (ROOT / "docs" / "nemo-rl.md").read_text()
    block = re.search(r"<!-- nemo-rl-versions:begin[^\n]*-->\n(.*?)\n<!-- nemo-rl-versions:end -->", doc, re.S)
    assert block is not None
    assert block.group(1) == compat.render_version_table()


def _version_marked_tests() -> list[tuple[str, str]]:
    """``(tests/file.py::test_name, name)`` for every ``@pytest.mark.needs_nemo_rl("name")``."""
    out = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for dec in node.decorator_list:
                    if (
                        isinstance(dec, ast.Call)
                        and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr == "needs_nemo_rl"
                    ):
                        out.append((f"tests/{path.name}::{node.name}", dec.args[0].value))
    return out


def test_every_version_skip_is_documented():
    """The tests a version skips (conftest.py: ``needs_nemo_rl``) are named in docs/nemo-rl.md with the
    compat entry that decides it; every name they give is one compat knows."""
    doc = (ROOT / "docs" / "nemo-rl.md").read_text()
    marked = _version_marked_tests()
    assert marked, "no needs_nemo_rl test found: the scan is broken"
    for test, name in marked:
        assert name in compat.VERSIONED or name in compat.FEATURES, (test, name)
        assert f"`{test}` (`{name}`)" in doc, f"docs/nemo-rl.md does not name {test} ({name})"


@pytest.mark.nemo_rl
def test_the_detected_version_is_this_world(nemo_rl_src):
    ver = compat.version()
    assert Path(ver.root).resolve() == (nemo_rl_src / "nemo_rl").resolve()
    assert ver == compat.classify(nemo_rl_src / "nemo_rl")
    expected = os.environ.get("NEMO_GRANULAR_EXPECT_NEMO_RL")  # scripts/test.sh names the world it built
    if expected:
        assert ver.key == expected


@pytest.mark.nemo_rl
def test_every_versioned_name_is_where_the_table_says_and_absent_elsewhere(nemo_rl_src):
    """For the detected version: each VERSIONED name resolves from its listed place (or is absent and
    refused in one line); the other version's place does not hold it here (it really moved)."""
    import importlib

    ver = compat.version().key
    for name, places in compat.VERSIONED.items():
        spec = places[ver]
        if spec is None:
            with pytest.raises(compat.NotInThisVersion, match=rf"^{re.escape(compat.TITLES[ver])} has no {name} \("):
                compat.get(name)
        else:
            mod, attr = compat._place(spec)
            assert compat.get(name) is getattr(importlib.import_module(mod), attr or name)
        for other, other_spec in places.items():
            if other == ver or other_spec is None or other_spec == spec:
                continue
            mod, attr = compat._place(other_spec)
            try:
                m = importlib.import_module(mod)
            except ImportError:
                continue  # the module itself is missing here
            found = getattr(m, attr or name, None)  # a re-export of the moved name is no counter-example
            assert found is None or getattr(found, "__module__", mod) != mod, (
                f"{name}: {other_spec} is defined in {compat.TITLES[ver]} too"
            )


def _declares(master_cls, dotted: str) -> bool:
    """Whether NeMo-RL's MasterConfig (through its typed dicts / models) declares ``dotted``."""
    from pydantic import BaseModel

    tp: typing.Any = master_cls
    for part in dotted.split("."):
        fields: dict = {}
        stack = [tp]
        while stack:
            t = stack.pop()
            origin = typing.get_origin(t)
            if (
                origin is typing.Annotated
                or getattr(origin, "_name", None) in ("NotRequired", "Required")
                or origin in (typing.Union, types.UnionType)
            ):
                stack += list(typing.get_args(t))
            elif typing_extensions.is_typeddict(t):
                fields.update(typing.get_type_hints(t, include_extras=True))
            elif isinstance(t, type) and issubclass(t, BaseModel):
                fields.update({k: f.annotation for k, f in t.model_fields.items()})
        if part not in fields:
            return False
        tp = fields[part]
    return True


@pytest.mark.nemo_rl
def test_every_config_key_difference_is_true_of_this_nemo_rl(nemo_rl_src):
    ver = compat.version().key
    for dotted, key in compat.CONFIG_KEYS.items():
        master_cls = compat.module("ppo" if dotted.startswith("ppo.") else "grpo").MasterConfig
        assert _declares(master_cls, dotted) == (ver in key.versions), dotted


@pytest.mark.nemo_rl
def test_adapt_config_drops_what_changes_nothing_and_refuses_the_rest(nemo_rl_src):
    ver = compat.version()
    cfg = {
        "policy": {
            "generation": {
                "temperature": 0.6,
                "top_p": 1.0,
                "top_k": None,
                "val_temperature": 0.6,
                "val_top_p": 1.0,
                "val_top_k": None,
            }
        },
        "ppo": {"async_ppo": {"enabled": False}},
        "grpo": {"adv_estimator": {"reward_weights": None}},
    }
    notes = compat.adapt_config(cfg)
    if ver.key == compat.MAIN:
        assert notes == [] and cfg["policy"]["generation"]["val_temperature"] == 0.6
        return
    assert len(notes) == 5 and "val_temperature" not in cfg["policy"]["generation"] and "async_ppo" not in cfg["ppo"]
    assert notes[0] == (
        "policy.generation.val_temperature: removed (NeMo-RL v0.7.0 does not have it; validation "
        "samples at policy.generation.temperature, which is what 0.6 asks for)"
    )
    for dotted, value, where in (
        ("policy.generation.val_temperature", 1.0, ("policy", "generation")),
        ("ppo.async_ppo", {"enabled": True}, ("ppo",)),
        ("grpo.adv_estimator.reward_weights", [1.0, 2.0], ("grpo", "adv_estimator")),
    ):
        bad = {"policy": {"generation": {"temperature": 0.6}}, "ppo": {}, "grpo": {"adv_estimator": {}}}
        node = bad
        for part in where:
            node = node[part]
        node[dotted.rsplit(".", 1)[1]] = value
        with pytest.raises(
            compat.VersionRefusal,
            match=rf"^{re.escape(dotted)}: .* needs NeMo-RL main \(7ea279ab\); "
            r"NeMo-RL v0\.7\.0 does not have this key \(",
        ):
            compat.adapt_config(bad)


@pytest.mark.nemo_rl
def test_every_behaviour_difference_is_true_of_this_nemo_rl(megatron_workers):
    """Each BEHAVIOURS row, checked on the real NeMo-RL of this world, and the compat function for it."""
    from pydantic import BaseModel

    ver = compat.version().key
    grpo, ppo = compat.module("grpo"), compat.module("ppo")
    assert {b.handled_by for b in compat.BEHAVIOURS} <= {*compat.__all__, "nemo_granular.protocol"}
    # config sections: pydantic models on main, TypedDicts on v0.7.0; conf reads both
    section = grpo.MasterConfig.model_fields["grpo"].annotation
    assert (isinstance(section, type) and issubclass(section, BaseModel)) == (ver == compat.MAIN)
    assert typing_extensions.is_typeddict(ppo.MasterConfig.model_fields["ppo"].annotation) == (ver == compat.V0_7)
    # the checkpointer: a context manager on main only
    from nemo_rl.utils.checkpoint import CheckpointManager

    assert hasattr(CheckpointManager, "__enter__") == (ver == compat.MAIN)
    plain = types.SimpleNamespace()
    with compat.checkpoint_flush(plain) as got:
        assert got is plain
    # async rollouts: NeMo-RL's own function, whatever it takes
    params = list(inspect.signature(compat.get("should_use_async_rollouts")).parameters)
    assert params == (["master_config"] if ver == compat.V0_7 else ["generation_config"])
    for engine in (True, False):
        master = types.SimpleNamespace(policy={"generation": {"backend": "vllm", "vllm_cfg": {"async_engine": engine}}})
        assert compat.should_use_async_rollouts(master) is engine
    # Megatron's fused-kernel flag: the post-processor's attribute and the config key, per version
    mtrain = compat.module("megatron_train")
    init = inspect.getsource(mtrain.LogprobsPostProcessor.__init__)
    assert f"self.{compat.FUSED_LOGPROBS_ATTR[ver]} =" in init
    assert all(f"self.{a} =" not in init for v, a in compat.FUSED_LOGPROBS_ATTR.items() if v != ver)
    assert _declares(grpo.MasterConfig, compat.FUSED_LOGPROBS_KEY[ver])
    assert compat.fused_linear_logprobs(types.SimpleNamespace(**{compat.FUSED_LOGPROBS_ATTR[ver]: True}))
    # async PPO: refused on v0.7.0 in one line
    assert hasattr(ppo, "async_ppo_train") == (ver == compat.MAIN)
    if ver == compat.V0_7:
        with pytest.raises(
            compat.VersionRefusal,
            match=r"^ppo\.async_ppo\.enabled: true: NeMo-RL v0\.7\.0 has no "
            r"async PPO .*; it needs NeMo-RL main \(7ea279ab\)$",
        ):
            compat.require("async_ppo", "ppo.async_ppo.enabled: true")
    else:
        compat.require("async_ppo")
    # environments after training: nothing to call on v0.7.0
    compat.shutdown_environments({}, {})
    # the math verifier (ESPO's environment): an answer extraction that fails after scoring ("no answer")
    # adds a second score on v0.7.0, so the scores come from a call without answers there
    verifier = compat.get("HFVerifyWorker").__ray_metadata__.modified_class()
    responses, truths = ["so \\boxed{4}", "no answer at all", "\\boxed{5}"], ["4", "4", "4"]
    scores, answers = verifier.verify(responses, truths, True, math_verify_impl="hf_math_verify")
    assert len(answers) == 3 and answers[1] is None, answers
    assert (len(scores) > 3) == compat.verify_scores_need_own_call(), scores
    assert verifier.verify(responses, truths, False, math_verify_impl="hf_math_verify") == [1.0, 0.0, 0.0]


@pytest.mark.nemo_rl
def test_estimator_config_matches_nemo_rl_s_own_estimator(nemo_rl_src):
    """What NeMo-RL's GRPO estimator does with a partial / missing ``grpo.adv_estimator`` is what
    ``compat.estimator_config`` hands our estimators (KeyError on v0.7.0, defaults on main)."""
    ver = compat.version().key
    GRPOAdvantageEstimator = compat.get("GRPOAdvantageEstimator")
    partial = {"name": "grpo"}
    master = {"grpo": {"adv_estimator": partial}, "loss_fn": {}}
    if ver == compat.V0_7:
        with pytest.raises(KeyError):
            GRPOAdvantageEstimator(partial, {})
        with pytest.raises(KeyError, match="grpo.adv_estimator.normalize_rewards"):
            compat.estimator_config(master)
        no_section = compat.estimator_config({"grpo": {}})
        assert no_section["use_leave_one_out_baseline"] is False and no_section["normalize_rewards"] is True
    else:
        theirs = compat.get("AdvEstimatorConfig")(**partial)
        assert compat.estimator_config({"grpo": {"adv_estimator": theirs}}) == theirs.model_dump()
        ours = GRPOAdvantageEstimator(theirs, {})
        assert ours.normalize_rewards is True and ours.use_leave_one_out_baseline is True


@pytest.mark.nemo_rl
def test_every_name_and_module_resolves_against_the_pinned_nemo_rl(megatron_workers):
    import nemo_automodel.shared.import_utils as iu

    mp = pytest.MonkeyPatch()
    mp.setattr(iu, "safe_import_te", lambda: (False, None))  # TE-absent path (test only), as test_host_workers
    try:
        for short, full in compat.MODULES.items():
            if short == "grpo_sync":
                continue  # needs the data-plane extras; the estimators skip it the same way
            assert compat.module(short).__name__ == full
        for name, places in compat.LOCATIONS.items():
            obj = compat.get(name)
            assert obj is getattr(
                sys.modules[next(p for p in places if p in sys.modules and hasattr(sys.modules[p], name))], name
            )
    finally:
        mp.undo()


@pytest.mark.nemo_rl
def test_a_rebound_attribute_is_seen(nemo_rl_src, monkeypatch):
    import nemo_rl.data.utils as data_utils

    sentinel = object()
    monkeypatch.setattr(data_utils, "setup_response_data", sentinel)
    assert compat.get("setup_response_data") is sentinel  # looked up per call (tests rebind NeMo-RL's names)


@pytest.mark.nemo_rl
def test_prepare_loss_input_found_where_nemo_rl_0_8_puts_it(nemo_rl_src, monkeypatch):
    import nemo_rl.algorithms.loss.utils as old

    def moved(*a, **k):
        return "0.8"

    monkeypatch.delattr(old, "prepare_loss_input")  # a NeMo-RL where it moved
    monkeypatch.setitem(
        sys.modules, "nemo_rl.algorithms.loss.loss_input", types.SimpleNamespace(prepare_loss_input=moved)
    )
    assert compat.get("prepare_loss_input") is moved
    monkeypatch.delitem(sys.modules, "nemo_rl.algorithms.loss.loss_input")
    with pytest.raises(
        ImportError,
        match="NeMo-RL has no 'prepare_loss_input' in nemo_rl.algorithms.loss.utils, "
        "nemo_rl.algorithms.loss.loss_input",
    ):
        compat.get("prepare_loss_input")


@pytest.mark.nemo_rl
def test_get_logprobs_keeps_the_0_8_token_mask(nemo_rl_src):
    """NeMo-RL 0.8's workers return ``token_mask`` next to the log-probs under top-k / top-p; the driver
    must write it back into the train batch, so ``GranularPolicy.get_logprobs`` hands it on."""
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from nemo_granular.nemo_rl.policy import granular_policy_class

    cls = granular_policy_class()
    B, S = 3, 5
    worker_out = {"logprobs": torch.randn(B, S), "entropy": torch.rand(B, S), "token_mask": torch.ones(B, S).tril()}

    class Group:
        def run_all_workers_sharded_data(self, method, **kw):
            assert method == "get_logprobs_with_entropy"
            return ["future"]

        def get_all_worker_results(self, futures):
            return [BatchedDataDict(dict(worker_out))]

        def shutdown(self, *a, **k):  # Policy.__del__ shuts its worker group down
            return True

    pol = cls.__new__(cls)
    pol.worker_group, pol._shard_for_logprob = Group(), lambda data: (data, None)
    data = BatchedDataDict(input_ids=torch.zeros(B, S, dtype=torch.long))
    out = pol.get_logprobs(data)
    assert sorted(out) == ["logprobs", "token_mask"] and torch.equal(out["token_mask"], worker_out["token_mask"])
    del worker_out["token_mask"]  # 7ea279ab: logprobs only, as before
    assert sorted(pol.get_logprobs(data)) == ["logprobs"]
    # Policy.__init__'s newer keywords (0.8: is_refit_destination, reserved_http_server_ports) pass through
    params = inspect.signature(cls.__init__).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@pytest.mark.nemo_rl
def test_run_grpo_refuses_minimal_loss_metrics_that_grpo_train_would_index(nemo_rl_src):
    """Why: the real ``grpo_train`` of this NeMo-RL indexes ``metrics["token_mult_prob_error"]`` after
    every step, and the loss at ``metrics_level: minimal`` does not return it (NeMo-RL's next loss
    drops it); so run_grpo (and preflight, through check_config) refuses the key in one line naming
    the version, before any GPU work."""
    from nemo_granular.losses import GranularPolicyLoss
    from nemo_granular.run_grpo import check_config

    assert 'metrics["token_mult_prob_error"]' in inspect.getsource(compat.module("grpo").grpo_train)
    minimal = GranularPolicyLoss({"algorithm": "sspo", "metrics_level": "minimal"})
    assert "token_mult_prob_error" not in minimal.metric_normalizations
    with pytest.raises(ValueError) as err:
        check_config({"loss_fn": {"algorithm": "sspo", "metrics_level": "minimal"}})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("loss_fn.metrics_level: minimal") and compat.version().title in msg


def _marks(node) -> set[str]:
    """The ``pytest.mark.X`` names in a decorator list or a ``pytestmark = ...`` value."""
    return {
        n.attr
        for n in ast.walk(node)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute) and n.value.attr == "mark"
    }


def marked_tests(*wanted: str) -> dict[str, set[str]]:
    """module file name -> the test functions that carry every marker in ``wanted`` (on the module's
    ``pytestmark`` or on the function): read from the test modules' source, as pytest reads them."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module = set().union(
            *[
                _marks(n.value)
                for n in tree.body
                if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
            ]
        )
        tests = {
            n.name
            for n in tree.body
            if isinstance(n, ast.FunctionDef)
            and n.name.startswith("test_")
            and set(wanted) <= module | set().union(*map(_marks, n.decorator_list))
        }
        if tests:
            out[path.name] = tests
    return out


def _v070_tests() -> dict[str, set[str]]:
    """What scripts/test.sh runs in the NeMo-RL v0.7.0 world: the tests marked ``v070`` and ``nemo_rl``."""
    return marked_tests("v070", "nemo_rl")


def _support_matrix() -> list[list[str]]:
    """The rows of docs/nemo-rl.md's support matrix: feature, v0.7.0, main, tests."""
    doc = (ROOT / "docs" / "nemo-rl.md").read_text()
    section = doc.split("### Support matrix", 1)[1].split("\n#", 1)[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split(" | ")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| feature |")
    ]
    assert rows and all(len(r) == 4 for r in rows), rows
    return rows


def test_support_matrix_v070_cells_are_what_ci_runs_there():
    """A v0.7.0 cell that says "tested" names only tests that run in the v0.7.0 world (a module: some of
    its tests do; a test id: that test does), and every test of that world is named by such a row (by its
    module or its id): the matrix cannot claim more, or less, than CI runs."""
    v070 = _v070_tests()
    named: set[str] = set()
    for feature, cell, _main, tests in _support_matrix():
        if not cell.startswith("tested"):
            continue
        for test in re.findall(r"`(test_[\w*]+\.py(?:::\w+)?)`", tests):
            named.add(test)
            module, _, name = test.partition("::")
            assert module in v070 and (not name or name in v070[module]), (
                f"support matrix: {feature[:60]}... says v0.7.0 tested, but {test} is not marked v070 and nemo_rl"
            )
    documented_skips = marked_tests("v070", "nemo_rl", "needs_nemo_rl")  # listed under the matrix instead
    for module, names in v070.items():
        for name in names - documented_skips.get(module, set()):
            assert module in named or f"{module}::{name}" in named, (
                f"{module}::{name} runs in the v0.7.0 world, but no 'tested' v0.7.0 row of the support matrix names it"
            )


def test_marked_tests_reads_the_markers_pytest_applies():
    """The static reading above agrees with pytest's own (a planted marker it missed would let the matrix
    drift): collect the v0.7.0 world's selection and compare."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "v070 and nemo_rl",
            str(ROOT / "tests"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=env_without_nemo_rl(),
    )
    ids = {line.split("[")[0] for line in done.stdout.splitlines() if line.startswith("tests/")}
    got = {f"tests/{m}::{t}" for m, ts in _v070_tests().items() for t in ts}
    assert ids and ids == got, (sorted(ids ^ got), done.stderr[-2000:])
