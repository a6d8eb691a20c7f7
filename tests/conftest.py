"""Test-suite set-up: the two worlds the suite runs in, and the no-skip rule of CI.

* Without NeMo-RL (the default): the package is tested with torch and its own extras.
* With a real NeMo-RL checkout: set ``NEMO_RL_SRC`` (and optionally ``MEGATRON_LM_SRC``,
  ``MEGATRON_BRIDGE_SRC``, ``AUTOMODEL_SRC``; ``scripts/nemo_rl_env.sh`` sets them from the source
  cache that ``scripts/sources.sh`` fills, and installs the ``nemo-rl-test`` extra). The checkout then goes on ``sys.path`` of this process and, via
  ``PYTHONPATH``, of every subprocess a test starts; tests that need NeMo-RL take the
  ``nemo_rl_src`` fixture. Tests that must see a world WITHOUT NeMo-RL run a subprocess with
  ``env_without_nemo_rl()``.

Under CI (``CI=true``) or ``NEMO_GRANULAR_NO_SKIP=1`` a skipped test fails the run: a test
that silently skips proves nothing (the NeMo-RL tests used to skip in CI).

The one exception is named in the test itself: ``@pytest.mark.needs_nemo_rl("Name")`` on a test of a
NeMo-RL name that ``nemo_granular.nemo_rl.compat.VERSIONED`` lists as absent from one supported version
(e.g. ``MetricNormalizer`` on v0.7.0), or of a ``compat.FEATURES`` entry that version lacks. In that version's world the test is skipped with compat's
one-line reason and listed as such in the summary; docs/nemo-rl.md ("NeMo-RL versions") names every
such test (``tests/test_nemo_rl_compat.py`` checks the list). Any other skip still fails CI, and a
marker naming something compat does not list is a collection error.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "harness"  # the test harness: helpers, stand-ins, drivers (tests/README.md)
SHIMS = HARNESS / "host_shims"

# the embedded trainer at its smallest (a one-layer Qwen3 of width 32, 4 prompts x 4 samples, 12 new
# tokens, no warm start), for the tests that train with it
TINY_TRAIN = [
    "warmstart.enabled=false",
    "model.hidden_size=32",
    "model.num_layers=1",
    "model.intermediate_size=64",
    "rl.prompts_per_step=4",
    "rl.generations_per_prompt=4",
    "rl.minibatches_per_rollout=2",
    "rl.micro_batch_size=4",
    "rl.max_new_tokens=12",
    "rl.eval_every=1000",
    "task.heldout_size=8",
    "logger.progress=false",
    "logger.tensorboard=false",
    "threads=1",
]


def tiny_train(*changes: str) -> list[str]:
    """:data:`TINY_TRAIN` with ``changes`` (``key=value``; a key given here replaces TINY_TRAIN's)."""
    keys = {c.split("=", 1)[0] for c in changes}
    return [o for o in TINY_TRAIN if o.split("=", 1)[0] not in keys] + list(changes)


if str(HARNESS) not in sys.path:
    sys.path.insert(0, str(HARNESS))
SOURCE_VARS = ("NEMO_RL_SRC", "MEGATRON_LM_SRC", "MEGATRON_BRIDGE_SRC", "AUTOMODEL_SRC")


def host_paths() -> list[str]:
    """Import roots of the real host (NeMo-RL and its pinned Megatron/Automodel sources)."""
    if not os.environ.get("NEMO_RL_SRC"):
        return []
    paths = [str(SHIMS / "typing_shim")]
    for var in SOURCE_VARS:
        value = os.environ.get(var)
        if value:
            if not Path(value).is_dir():
                raise pytest.UsageError(f"{var}={value} is not a folder")
            paths.append(str(Path(value).resolve()))
    if not (Path(paths[1]) / "nemo_rl").is_dir():
        raise pytest.UsageError(f"NEMO_RL_SRC={os.environ['NEMO_RL_SRC']} has no nemo_rl/ package")
    return paths


HOST_PATHS = host_paths()
if HOST_PATHS:
    # the typing shim must act before any NeMo-RL module is imported in this process
    exec(compile((SHIMS / "typing_shim" / "sitecustomize.py").read_text(), "sitecustomize", "exec"))
    sys.path[:0] = [p for p in HOST_PATHS if p not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        HOST_PATHS + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    )

STRICT = os.environ.get("CI", "").lower() == "true" or os.environ.get("NEMO_GRANULAR_NO_SKIP") == "1"


def env_without_nemo_rl(**extra: str) -> dict[str, str]:
    """Environment for a subprocess that must run in the world where NeMo-RL is absent."""
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in HOST_PATHS]
    env["PYTHONPATH"] = os.pathsep.join(keep)
    for var in SOURCE_VARS:
        env.pop(var, None)
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def nemo_rl_src() -> Path:
    """The real NeMo-RL checkout; skips (a failure under CI) when there is none. A test that takes it is
    marked ``nemo_rl`` (checked at collection): the marker puts it in the NeMo-RL worlds (tests/README.md)."""
    if not HOST_PATHS:
        pytest.skip("needs a NeMo-RL checkout: fill the source cache (bash scripts/sources.sh) or set NEMO_RL_SRC")
    return Path(os.environ["NEMO_RL_SRC"]).resolve()


@pytest.fixture(scope="session")
def megatron_workers(nemo_rl_src):
    """Make NeMo-RL's worker modules importable on CPU: megatron.core first (so it keeps its
    Transformer-Engine-absent paths), then the test-only Transformer Engine placeholder that
    Megatron-Bridge imports at module level."""
    if not os.environ.get("MEGATRON_LM_SRC") or not os.environ.get("MEGATRON_BRIDGE_SRC"):
        pytest.skip("needs MEGATRON_LM_SRC and MEGATRON_BRIDGE_SRC (NeMo-RL's pinned sources)")
    import megatron.core.models.gpt
    import megatron.core.parallel_state
    import megatron.core.tensor_parallel  # noqa: F401

    stub = str(SHIMS / "te_stub")
    if stub not in sys.path:
        sys.path.append(stub)
    return nemo_rl_src


# Parallel runs (pytest-xdist; scripts/test.sh runs ``-n 2 --dist loadgroup``). Each module is one
# scheduling unit, so its module-scoped set-up (a Ray head, a tiny checkpoint, a Megatron world) is
# built once. The GRPO-side modules that start a Ray head share one unit and the PPO loop has its own:
# at most two Ray loops side by side (each head's ports are free ones, cpu_host.cluster.RayHead). The
# longest units are handed out first (a stable sort; the rest keep file order), so the two workers end
# together.
HOST_RAY_UNITS = {
    "test_loop_actor_class": "host_ray",
    "test_loop_grpo": "host_ray",
    "test_loop_megatron": "host_ray",
    "test_loop_shipped_configs": "host_ray",
    "test_loop_sppo": "host_ray_ppo",
}
LONG_UNITS = (
    "host_ray",
    "test_megatron_worker",
    "host_ray_ppo",
    "test_export_megatron",
    "test_preflight_nemo_rl",
    "test_megatron_worker_configs",
    "test_loop_dtensor_packing",
    # the standalone world's (a CI rehearsal: 6.8, 3.7, 1.9, 1.4 min)
    "test_learning",
    "test_compare",
    "test_wheel_install",
    "test_embedded_reliability",
)


WORLD_MARKERS = {
    "nemo_rl": "needs a real NeMo-RL (the nemo_rl_src fixture): runs in the NeMo-RL main world, not the standalone one",
    "v070": "runs in the NeMo-RL v0.7.0 world too (its nemo_rl tests; the support matrix of docs/nemo-rl.md)",
    "transformers_pin": "runs once more on Automodel's pinned transformers (NeMo-RL's DTensor-v2 worker venv)",
}


def _loadgroup_works() -> bool:
    """Whether pytest-xdist's --dist loadgroup can group: it appends "@group" to ``item._nodeid``, which
    pytest 9.2 no longer reads (Node.nodeid became a view of Node._id). Without grouping every test is its
    own unit, module-scoped Ray heads and Megatron worlds are built on both workers at once, and the run
    thrashes (seen: the main world's Ray loops side by side, a raylet that missed its start-up window)."""
    import inspect

    from _pytest.nodes import Node

    return "_nodeid" in inspect.getsource(Node.nodeid.fget)


def pytest_configure(config):
    if config.getoption("dist", "no") == "loadgroup" and not _loadgroup_works():
        raise pytest.UsageError(
            f"pytest-xdist's --dist loadgroup cannot group tests under pytest "
            f"{pytest.__version__}; install pytest<9.2 (pyproject.toml's test extra)"
        )
    for name, what in WORLD_MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    config.addinivalue_line(
        "markers",
        "needs_nemo_rl(name): tests a NeMo-RL name (compat.VERSIONED) or feature "
        "(compat.FEATURES) one supported version lacks; skipped (documented) there only",
    )
    # scripts/test.sh's pass on NeMo-RL's pinned transformers names the version it installed: a pass
    # that silently imported another transformers would prove nothing about the pin
    expected = os.environ.get("NEMO_GRANULAR_EXPECT_TRANSFORMERS")
    if expected:
        import transformers

        if transformers.__version__ != expected:
            raise pytest.UsageError(
                f"NEMO_GRANULAR_EXPECT_TRANSFORMERS={expected}, but transformers "
                f"{transformers.__version__} is imported (from {transformers.__file__})"
            )


def _version_skips(items) -> None:
    """Skip the ``needs_nemo_rl`` tests whose name the importable NeMo-RL version does not have."""
    marked = [(item, m.args[0]) for item in items for m in item.iter_markers("needs_nemo_rl")]
    if not marked:
        return
    from nemo_granular.nemo_rl import compat

    for item, name in marked:
        if name not in compat.VERSIONED and name not in compat.FEATURES:
            raise pytest.UsageError(
                f"{item.nodeid}: needs_nemo_rl({name!r}) is in neither compat.VERSIONED nor compat.FEATURES"
            )
        if not HOST_PATHS:
            continue  # no NeMo-RL at all: the test's nemo_rl_src fixture decides (a failure under CI)
        try:
            compat.require(name) if name in compat.FEATURES else compat.get(name)
        except (compat.NotInThisVersion, compat.VersionRefusal) as err:
            item.add_marker(pytest.mark.skip(reason=f"{VERSION_SKIP}{err}"))


VERSION_SKIP = "needs_nemo_rl: "  # the reason's prefix that marks a documented version skip


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    _version_skips(items)

    def unit(item) -> str:
        module = Path(str(item.fspath)).stem
        return HOST_RAY_UNITS.get(module, module)

    for item in items:
        # a test that needs NeMo-RL by its fixtures is marked so (the marker selects the world it runs in)
        if "nemo_rl_src" in getattr(item, "fixturenames", ()) and item.get_closest_marker("nemo_rl") is None:
            raise pytest.UsageError(f"{item.nodeid} takes nemo_rl_src but is not marked @pytest.mark.nemo_rl")
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(unit(item)))
    rank = {name: i for i, name in enumerate(LONG_UNITS)}
    items.sort(key=lambda item: rank.get(unit(item), len(LONG_UNITS)))


_skipped: list[str] = []
_version_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if reason.startswith(f"Skipped: {VERSION_SKIP}") or reason.startswith(VERSION_SKIP):
            _version_skipped.append(f"{report.nodeid} ({reason.split(VERSION_SKIP, 1)[1]})")
        else:
            _skipped.append(report.nodeid)


def pytest_collectreport(report):
    # a whole module skipped at collection (a module-level skip or importorskip) counts as a skip too
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append(f"{report.nodeid} (collection: {reason})")


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: its reports reach the controller, which decides
    if STRICT and _skipped and session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter):
    if HOST_PATHS:
        terminalreporter.write_line(f"NeMo-RL world: NEMO_RL_SRC={os.environ['NEMO_RL_SRC']}")
        for line in _version_skipped:
            terminalreporter.write_line(f"  skipped in this NeMo-RL version (documented): {line}")
    else:
        terminalreporter.write_line(
            "no NeMo-RL in this run (the standalone world; scripts/test.sh runs the NeMo-RL worlds "
            "from the source cache: bash scripts/sources.sh)"
        )
    if STRICT and _skipped:
        terminalreporter.write_line(
            f"FAILED: {len(_skipped)} test(s) skipped under CI, where nothing may skip:", red=True
        )
        for nodeid in _skipped:
            terminalreporter.write_line(f"  {nodeid}", red=True)
