"""Output on real file systems that refuse it: a read-only mount and a full one (tmpfs mounts made
for the test, as root), and the file modes a checkpoint is written with.

Each case goes through the real CLI entry point in-process and must end in one line naming what
the user gave (``output_dir``, ``--out``, the export target, the checkpoint), exit 2, with nothing
half-written left behind. Mounting needs root (CI runs as root); elsewhere these tests skip,
which CI does not allow.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import tiny_train

TINY = tiny_train("rl.max_new_tokens=8")


def _can_mount() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "needs mount/umount"
    return None


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(size, read_only=False)`` → a fresh tmpfs mount point under ``tmp_path``; unmounted after."""
    reason = _can_mount()
    if reason:
        pytest.skip(reason)
    mounted = []

    def mount(size: str, read_only: bool = False) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        opts = f"size={size},mode=0755" + (",ro" if read_only else "")
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], capture_output=True, text=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
        mounted.append(point)
        return point

    yield mount
    for point in reversed(mounted):
        subprocess.run(["umount", "-l", str(point)], check=False)


def _main(argv, capsys):
    from nemo_granular.cli import main

    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out, err = capsys.readouterr()
    return rc, out, [line for line in err.splitlines() if line.strip()]


# ---------------------------------------------------------------- read-only file system
def test_train_refuses_a_read_only_output_dir_before_any_work(tmpfs, capsys):
    ro = tmpfs("1m", read_only=True)
    # the packaged config as a new user runs it: warm start first, so a late check costs ~50 s
    rc, out, err = _main(["train", "--config", "grpo", f"output_dir={ro}/run"], capsys)
    assert rc == 2 and out == ""
    assert err == [f"nemo-granular train: error: output_dir {ro}/run: {ro} is on a read-only file system"], err


def test_compare_refuses_a_read_only_out(tmpfs, capsys):
    ro = tmpfs("1m", read_only=True)
    rc, out, err = _main(["compare", "--algorithms", "grpo", "--out", f"{ro}/cmp"], capsys)
    assert rc == 2 and out == ""
    assert err == [f"nemo-granular compare: error: --out {ro}/cmp: {ro} is on a read-only file system"], err


def test_export_to_a_read_only_target_names_the_target(tmpfs, tmp_path, capsys):
    run = tmp_path / "run"
    assert _main(["train", "--config", "grpo", *TINY, "rl.steps=0", f"output_dir={run}"], capsys)[0] == 0
    ro = tmpfs("1m", read_only=True)
    rc, out, err = _main(["export", run, ro / "hf"], capsys)
    assert rc == 2 and out == "" and len(err) == 1, err
    assert err[0].startswith(f"nemo-granular export: error: {ro / 'hf'}: ") and "read-only" in err[0].lower(), err
    assert ".tmp" not in err[0], err  # the user's target, not the temporary folder built next to it


# ---------------------------------------------------------------- full file system
# sizes that run out at different writers of the checkpoint: the safetensors weights, the
# tokenizer / model config JSON, torch.save of optimizer.pt and rng.pt
@pytest.mark.parametrize("size", ["32k", "64k", "80k"])
def test_disk_full_while_checkpointing_is_one_line_and_leaves_no_temp_dir(tmpfs, capsys, size):
    full = tmpfs(size)
    run = full / "run"
    rc, out, err = _main(["train", "--config", "grpo", *TINY, "rl.steps=0", f"output_dir={run}"], capsys)
    errors = [line for line in err if "error" in line]
    assert rc == 2 and len(errors) == 1 and errors[0] == err[-1], err
    assert errors[0].startswith(
        f"nemo-granular train: error: cannot write checkpoint {run}/checkpoints/step_000000: No space left on device"
    ), errors
    assert "Traceback" not in "\n".join(err)
    assert not list((run / "checkpoints").glob(".tmp_*")), sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not (run / "checkpoints" / "step_000000").exists()


# ---------------------------------------------------------------- file modes
@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_current_umask_is_read_without_changing_it(umask):
    from nemo_granular.cli_common import current_umask

    old = os.umask(umask)
    try:
        assert current_umask() == umask
        assert os.umask(umask) == umask  # still set: reading it did not change it
    finally:
        os.umask(old)


@pytest.mark.parametrize("umask", [0o022, 0o002], ids=["umask022", "umask002"])
def test_checkpoint_files_have_the_modes_of_ordinary_files(tmp_path, capsys, umask):
    """Every file of a checkpoint (policy and critic weights included) gets 0666 minus the umask."""
    old = os.umask(umask)
    try:
        rc, _, err = _main(["train", "--config", "sppo", *TINY, "rl.steps=0", f"output_dir={tmp_path}/run"], capsys)
    finally:
        os.umask(old)
    assert rc == 0, err
    step = tmp_path / "run" / "checkpoints" / "step_000000"
    modes = {str(p.relative_to(step)): oct(p.stat().st_mode & 0o777) for p in step.rglob("*") if p.is_file()}
    assert {"policy/model.safetensors", "critic/model.safetensors", "optimizer.pt"} <= set(modes)
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
