"""No code in checkpoints (issue 28, item 3): a checkpoint holds tensors and JSON, and resuming
unpickles nothing that could name code.

A planted pickle (its ``__reduce__`` would create a marker file) in the index, in a rank's
state file or in a tensor record, with the checksum marker rewritten to match (so integrity
checks pass), is refused by name with `UnsafeCheckpointError` (one line, exit 2 through
`tokenbridge.cli`), and the marker file never appears; a control shows that plain unpickling
of the same bytes does run the payload. A checkpoint written as before (stock DCP: a pickled
index and pickled non-tensor items) is refused the same way, saying how to go on, where stock
DCP's reader runs the payload.

A one-process gloo group and a tiny model, as tests/unit/test_checkpoint_integrity.py.
"""

from __future__ import annotations

import io
import json
import pickle
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

from tests.unit.test_checkpoint_integrity import _state
from tokenbridge import cli
from trainer.checkpoint import checkpointer
from trainer.checkpoint import dcp_io as checkpoint_dcp
from trainer.checkpoint import state_split as checkpoint_state
from trainer.config.schema import CheckpointConfig
from trainer.main import RULES


class Payload:
    """Unpickled, it creates the file `path` (what a crafted checkpoint could do instead)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def saved(group, tmp_path):  # noqa: F811 - the fixture imported above
    folder = tmp_path / "checkpoints"
    saver = checkpointer.Checkpointer(folder, CheckpointConfig(keep=3), rank=0)
    state = _state(4)
    state["rank0"] = {
        "rng": checkpointer.rng_state(),
        "pending": {"topk": [np.arange(6, dtype=np.int32)]},
    }
    return saver.save(4, state)


def rewrite_marker(d):
    """Rewrite the checksum marker to match the files as they are now (what someone who plants
    a file can do: xxh3 detects damage, not tampering)."""
    marker = json.loads((d / checkpointer.MARKER).read_text())
    for name in marker["checksums"]:
        data = (d / name).read_bytes()
        marker["checksums"][name] = {
            "bytes": len(data),
            "xxh3_64": xxhash.xxh3_64(data).hexdigest(),
        }
    (d / checkpointer.MARKER).write_text(json.dumps(marker))


def _resume_and_load(d):
    """What the trainer does: preflight's `find_resume` (auto), then `Checkpointer.load`."""
    r = checkpointer.find_resume(d.parent, CheckpointConfig(), rank=0)
    state = _state(0)
    state["rank0"] = {"rng": checkpointer.rng_state()}
    checkpointer.Checkpointer(d.parent, CheckpointConfig(), rank=0).load(r.path, state)
    return state


def _one_line_exit_2(d, capsys) -> str:
    """The refusal as `trainer/main.py` ends on it: one line on stderr, exit code 2."""
    code = cli.run(lambda _: _resume_and_load(d), [], prog="train", rules=RULES)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1, lines
    return lines[0]


def test_a_checkpoint_holds_tensors_and_json_only(saved):
    names = {p.name for p in saved.iterdir()}
    assert names == {".metadata", "rank0.json", "__0_0.distcp", checkpointer.MARKER}
    index = json.loads((saved / ".metadata").read_text())
    assert index["format"] == "tokenbridge-dcp-index" and index["tensors"]
    state = json.loads((saved / "rank0.json").read_text())["state"]
    assert state["rank0"]["rng"]["torch"]["$tensor"] == "rank0/rng/torch"
    data = (saved / "__0_0.distcp").read_bytes()
    for s in index["storage"]:  # every record: a tensor, by torch's weights-only loader
        record = io.BytesIO(data[s["start"] : s["start"] + s["length"]])
        assert isinstance(torch.load(record, weights_only=True), torch.Tensor), s["fqn"]
    assert {s["fqn"] for s in index["storage"]} == set(index["tensors"])


def test_resume_restores_every_value_exactly(group, tmp_path):  # noqa: F811
    """Model, optimizer, plain values, bytes, numpy arrays and every RNG come back as saved."""
    state = _state(4)
    state["rank0"] = {"rng": checkpointer.rng_state(), "topk": [np.arange(6, dtype=np.int32)]}
    want = (random.random(), float(np.random.rand()), torch.rand(3))  # the draws that follow
    saver = checkpointer.Checkpointer(tmp_path, CheckpointConfig(), rank=0)
    d = saver.save(4, state)
    got = _state(0)
    got["rank0"] = {"rng": checkpointer.rng_state()}
    saver.load(d, got)
    assert got["step"] == 4 and got["blob"] == state["blob"]
    for k, v in _state(4)["app"].model.state_dict().items():
        assert torch.equal(got["app"].model.state_dict()[k], v)
    (topk,) = got["rank0"]["topk"]
    assert topk.dtype == np.int32 and topk.tolist() == list(range(6))
    checkpointer.set_rng_state(got["rank0"]["rng"])
    again = (random.random(), float(np.random.rand()), torch.rand(3))
    assert again[:2] == want[:2] and torch.equal(again[2], want[2])


def test_state_round_trips_through_json_and_tensors():
    state = {
        "t": (1, 2.5, None, "x", b"\x00\xff", True),
        "ints": {3: "three", (1, 2): [np.arange(4, dtype=np.int32)]},
        "$odd": torch.arange(3.0),
        "nested": [{"a": torch.zeros(2, 2, dtype=torch.bfloat16)}],
    }
    doc, tensors = checkpoint_state.split(state)
    assert set(tensors) == {"ints/(1, 2)/0", "$odd", "nested/0/a"}
    back = checkpoint_state.join(json.loads(json.dumps(doc)), tensors)
    assert back["t"] == state["t"] and isinstance(back["t"], tuple)
    assert back["ints"][3] == "three" and back["ints"][(1, 2)][0].dtype == np.int32
    assert torch.equal(back["$odd"], state["$odd"])
    assert back["nested"][0]["a"].dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"checkpoint state s/0: a set is neither"):
        checkpoint_state.split({"s": [{1}]})
    with pytest.raises(ValueError, match="unknown tagged value"):
        checkpoint_state.join({"$code": "os.system"}, {})


@pytest.mark.parametrize(
    ("where", "protocol"),
    [(".metadata", 2), (".metadata", 0), ("rank0.json", 2), ("rank0.json", 1),
     ("record: raw pickle", 2), ("record: raw pickle", 0), ("record: torch.save archive", None)],
)  # fmt: skip
def test_a_planted_pickle_is_refused_by_name_and_never_runs(
    saved, where, protocol, tmp_path, capsys
):
    """Protocols 0 and 1 have no header byte (text opcodes): named a pickle all the same."""
    ran = tmp_path / "payload-ran"
    payload = pickle.dumps(Payload(ran), protocol=protocol)  # 2 or less: torch's loader parses it
    name = where if not where.startswith("record") else "__0_0.distcp"
    f = saved / name
    if where == "record: torch.save archive":  # one whole record: a real torch.save file
        buf = io.BytesIO()
        torch.save({"weight": Payload(ran)}, buf)
        payload = buf.getvalue()
        index = json.loads((saved / ".metadata").read_text())
        first = min(index["storage"], key=lambda s: s["start"])
        data = f.read_bytes()
        f.write_bytes(payload + data[first["length"] :])
        shift = len(payload) - first["length"]
        for s in index["storage"]:
            s["start"] += shift if s is not first else 0
            s["length"] = len(payload) if s is first else s["length"]
        (saved / ".metadata").write_text(json.dumps(index))
    elif where.startswith("record"):  # the first record's bytes begin with the pickle
        data = bytearray(f.read_bytes())
        data[: len(payload)] = payload
        f.write_bytes(bytes(data))
    else:
        f.write_bytes(payload)
    rewrite_marker(saved)  # the checksums pass: only the safe reader stands in the way
    assert checkpointer.verify_checkpoint(saved) is None

    line = _one_line_exit_2(saved, capsys)
    assert line.startswith(f"tokenbridge train: UnsafeCheckpointError: {f}"), line
    if where.startswith("record"):
        assert "names io.open, which torch's weights-only loader refuses" in line
        assert "restore the checkpoint from a copy you trust" in line
    else:
        assert "is a pickle, not JSON: unpickling can run code, so it is not read" in line
    with pytest.raises(checkpointer.UnsafeCheckpointError):  # named by path: the same
        state = _state(0)
        checkpointer.Checkpointer(saved.parent, CheckpointConfig(), rank=0).load(saved, state)
    assert not ran.exists()  # the payload never ran
    # control: the same bytes, unpickled as stock DCP would, do run it
    if where == "record: torch.save archive":
        torch.load(io.BytesIO(payload), weights_only=False)
    else:
        pickle.loads(payload)
    assert ran.exists()


def test_what_our_writer_never_writes_is_refused(saved):
    """An index naming a file outside the checkpoint; a byte item (a pickled object)."""
    index = json.loads((saved / ".metadata").read_text())
    index["storage"][0]["file"] = "../../elsewhere.distcp"
    (saved / ".metadata").write_text(json.dumps(index))
    rewrite_marker(saved)
    with pytest.raises(
        checkpointer.DamagedCheckpointError, match="not a tokenbridge checkpoint index"
    ):
        _resume_and_load(saved)
    item = SimpleNamespace(dest_index=SimpleNamespace(fqn="rank0.blob"))
    with pytest.raises(
        checkpointer.UnsafeCheckpointError, match="is a pickled object, not a tensor"
    ):
        checkpoint_dcp.SafePlanner().load_bytes(item, io.BytesIO(pickle.dumps(1)))


@pytest.mark.parametrize("marker", [True, False])
def test_a_pickle_era_checkpoint_is_refused_and_says_how_to_go_on(
    group,  # noqa: F811 - the fixture imported above
    tmp_path,
    marker,
    capsys,
):
    """Written as tokenbridge wrote them before: stock DCP, a pickled index and pickled
    non-tensor items (with and without a marker); here an item's pickle would create a file."""
    ran = tmp_path / "payload-ran"
    d = tmp_path / "checkpoints" / "step-00000004"
    old = _state(4)
    old["rank0"] = {"rng": Payload(ran)}  # a non-tensor item: DCP pickles it (torch.save)
    dcp.save(old, checkpoint_id=str(d))
    assert not ran.exists()
    if marker:
        sums = {p.name: {} for p in d.iterdir()}
        (d / checkpointer.MARKER).write_text(json.dumps({"kind": "checkpoint", "checksums": sums}))
        rewrite_marker(d)
    line = _one_line_exit_2(d, capsys)
    assert line.startswith(
        f"tokenbridge train: UnsafeCheckpointError: {d / '.metadata'} is a pickle"
    )
    assert "start from step 0" in line and "model.path=<run_dir>/export" in line
    for cfg in (CheckpointConfig(strict=True), CheckpointConfig(resume=str(d))):
        with pytest.raises(checkpointer.UnsafeCheckpointError, match=r"\.metadata is a pickle"):
            checkpointer.find_resume(d.parent, cfg, rank=0)
    assert d.is_dir() and not ran.exists()  # not moved aside, and nothing ran
    state = _state(0)
    state["rank0"] = {"rng": None}
    dcp.load(state, checkpoint_id=str(d))  # control: stock DCP's reader runs the payload
    assert ran.exists()
