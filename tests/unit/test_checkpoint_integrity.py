"""Checkpoint integrity: checksums written with every DCP save, verified on resume; a damaged
newest checkpoint is moved aside and the newest good one resumed, or refused in strict mode.

A one-process gloo group and a tiny model: the real `Checkpointer`, `find_resume` and DCP, in
a second. (The end-to-end fallback of a real 2-rank run is in tests/e2e/test_debug_run.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
import xxhash

from tokenbridge.commands import verify
from trainer.checkpoint import checkpointer
from trainer.config.schema import CheckpointConfig


def _state(step: int) -> dict:
    torch.manual_seed(step)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {
        "app": checkpointer.ModelOptimState(model, opt),
        "step": step,
        "blob": {"x": b"\x01" * 100},
    }


@pytest.fixture
def run(group, tmp_path):
    """A checkpoints folder with steps 4 and 8 (keep=3)."""
    folder = tmp_path / "checkpoints"
    saver = checkpointer.Checkpointer(folder, CheckpointConfig(keep=3), rank=0)
    for step in (4, 8):
        saver.save(step, _state(step))
    return folder


def _resume(folder, **kw):
    return checkpointer.find_resume(folder, CheckpointConfig(**kw), rank=0)


def _loaded_step(path) -> int:
    state = _state(0)
    checkpointer.Checkpointer(path.parent, CheckpointConfig(), rank=0).load(path, state)
    return int(state["step"])


def test_marker_lists_every_file_with_the_checksum_of_its_bytes(run):
    d = checkpointer.step_dir(run, 8)
    marker = json.loads((d / checkpointer.MARKER).read_text())
    assert marker["kind"] == "checkpoint" and marker["step"] == 8 and marker["hash"] == "xxh3_64"
    on_disk = {p.name for p in d.iterdir()} - {checkpointer.MARKER}
    assert set(marker["checksums"]) == on_disk and {".metadata", "__0_0.distcp"} <= on_disk
    for name, e in marker["checksums"].items():  # computed while writing == from disk now
        data = (d / name).read_bytes()
        assert e == {"bytes": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    r = _resume(run)
    assert r.path == d and r.notes == [] and _loaded_step(r.path) == 8


@pytest.mark.parametrize(
    ("damage", "name"),
    [("truncate", "__0_0.distcp"), ("change", "__0_0.distcp"), ("delete", ".metadata")],
)
def test_damaged_newest_falls_back_to_the_newest_good_one(run, damage, name, capsys):
    f = checkpointer.step_dir(run, 8) / name
    data = bytearray(f.read_bytes())
    if damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
    elif damage == "change":
        data[len(data) // 2 : len(data) // 2 + 32] = b"\x00" * 32
        f.write_bytes(bytes(data))
    else:  # DCP's index gone: still listed (by its marker), so the resume says so
        f.unlink()
    assert verify.main([str(run)]) == 2
    assert f"DAMAGED  {name}: {f}: damaged: expected xxh3_64" in capsys.readouterr().out
    with pytest.raises(checkpointer.DamagedCheckpointError, match="strict=true refuses"):
        _resume(run, strict=True)
    assert f.exists() or damage == "delete"  # strict mode moves nothing
    r = _resume(run)
    assert r.path == checkpointer.step_dir(run, 4) and _loaded_step(r.path) == 4
    (note,) = r.notes
    assert note.startswith(f"checkpoint step-00000008 is damaged ({f}: damaged: expected xxh3_64")
    assert note.endswith("moved aside to step-00000008.damaged; resuming from step-00000004")
    aside = run / "step-00000008.damaged"
    assert (aside / checkpointer.MARKER).is_file()  # moved aside, never deleted
    assert [s for s, _ in checkpointer.list_checkpoints(run)] == [4]
    assert verify.main([str(run)]) == 0  # the aside one is named, not counted


def test_named_damaged_checkpoint_is_refused_and_legacy_one_resumed(run):
    d = checkpointer.step_dir(run, 4)
    (d / ".metadata").write_bytes(b"garbage")
    with pytest.raises(
        checkpointer.DamagedCheckpointError, match=r"checkpoint.resume=.*\.metadata: damaged"
    ):
        _resume(run, resume=str(d))
    # written before markers: resumed unverified, and the run says so
    (checkpointer.step_dir(run, 8) / checkpointer.MARKER).unlink()
    r = _resume(run)
    assert r.path == checkpointer.step_dir(run, 8) and "not verified" in r.notes[0]


def test_damaged_checkpoint_without_marker_is_refused_in_one_line(run):
    """Not verifiable (written before markers) and truncated: torch's reader fails; the load
    says so in one line, naming the checkpoint, instead of the raw traceback."""
    d = checkpointer.step_dir(run, 8)
    (d / checkpointer.MARKER).unlink()
    f = d / "__0_0.distcp"
    f.write_bytes(f.read_bytes()[:64])
    with pytest.raises(
        checkpointer.DamagedCheckpointError, match=f"checkpoint {d}: has no COMPLETED"
    ) as e:
        _loaded_step(d)
    assert "cannot be read (EOFError)" in str(e.value) and "\n" not in str(e.value)
    assert _loaded_step(checkpointer.step_dir(run, 4)) == 4


def test_every_checkpoint_damaged_is_refused_then_a_rerun_starts_fresh(run):
    for step in (4, 8):
        (checkpointer.step_dir(run, step) / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(checkpointer.DamagedCheckpointError, match="no checkpoint in .* verifies"):
        _resume(run)
    assert _resume(run).path is None and len(list(run.glob("*.damaged"))) == 2
