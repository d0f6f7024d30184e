"""DCP's storage for tokenbridge checkpoints: files hashed as they are written, the index in
JSON, and a reader that runs no code from the files it reads.

Stock DCP pickles its index (``.metadata``) and reads non-tensor items with
``torch.load(weights_only=False)``, so a crafted file would run whatever code it names. Here
`Writer` hashes each file on its way to disk and writes the index as JSON, `read_index` checks
it back field by field (a pickle is refused unread: `UnsafeCheckpointError`), and `SafeReader`
+ `SafePlanner` read tensor records through torch's weights-only unpickler only
(docs/integrity.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import json
import pickle
import pickletools
import re
import threading
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, FileSystem, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from tokenbridge.formats import checksums

INDEX = ".metadata"  # DCP's name, kept: a step directory with it is a whole checkpoint
INDEX_FORMAT, INDEX_VERSION = "tokenbridge-dcp-index", 1
PICKLE_ERA = (
    "unpickling can run code, so it is not read (a checkpoint written before tokenbridge "
    "stored them as tensors and JSON, or a file put there); start from step 0 (move the "
    "checkpoints folder aside, or use another run_dir), or start a new run from the student "
    "that run exported (model.path=<run_dir>/export: its weights, without the optimizer or "
    "data position)"
)
PLANTED = (
    "tokenbridge's checkpointer writes tensors only there, so the file was changed or put "
    "there after it was written, and it is not read: restore the checkpoint from a copy you "
    "trust, or resume from another one (checkpoint.resume=<dir>)"
)


class DamagedCheckpointError(checksums.IntegrityError):
    """The checkpoint to resume from fails its checksums (strict mode, or named by path), or
    cannot be read."""


class UnsafeCheckpointError(checksums.IntegrityError):
    """A checkpoint file that is a pickle, or names code to run: refused, never unpickled."""


class HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file it writes on its way to disk."""

    def __init__(self):
        super().__init__()
        self.entries: dict[str, dict] = {}  # file name -> marker entry
        self._lock = threading.Lock()  # DCP may write files from several threads

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        sink = self.open_sink(path)
        try:
            yield sink
        except BaseException:
            sink.file.close()
            raise
        sink.close()  # flushes and fsyncs
        with self._lock:
            self.entries[Path(path).name] = sink.entry()

    def open_sink(self, path) -> checksums.HashingSink:
        """A new file at `path`, hashed as it is written (an object store's: `checkpoint.remote`)."""
        return checksums.HashingSink(path)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)  # the index is written as .metadata.tmp, then renamed
        with self._lock:
            if (e := self.entries.pop(Path(path).name, None)) is not None:
                self.entries[Path(new_path).name] = e

    def write_json(self, path: Path, doc: Any) -> None:
        """A JSON file of the checkpoint, hashed like DCP's own files."""
        with self.create_stream(path, "wb") as f:
            f.write(json.dumps(doc, separators=(",", ":")).encode())


class Writer(FileSystemWriter):
    """DCP's file system writer with `HashingFileSystem`, writing its index as JSON."""

    def __init__(self, path: str | Path):
        super().__init__(str(path))
        self.fs = HashingFileSystem()

    def finish(self, metadata: Metadata, results) -> None:  # rank 0, after every rank wrote
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        tmp = self.fs.concat_path(self.path, f"{INDEX}.tmp")
        self.fs.write_json(tmp, encode_index(metadata))
        self.fs.rename(tmp, self.fs.concat_path(self.path, INDEX))


def encode_index(md: Metadata) -> dict:
    """DCP's `Metadata` of a checkpoint of tensors as a JSON document."""
    tensors = {}
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):  # `checkpoint_state.split` left none
            raise TypeError(f"checkpoint item {fqn!r}: not a tensor ({type(m).__name__})")
        p = m.properties
        tensors[fqn] = {
            "dtype": str(p.dtype).removeprefix("torch."),
            "size": list(m.size),
            "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks],
            "requires_grad": bool(p.requires_grad),
        }
    storage = []
    for i, s in md.storage_data.items():
        if s.transform_descriptors:  # we register no stream transforms (compression...)
            raise TypeError(f"checkpoint item {i.fqn!r}: transformed by {s.transform_descriptors}")
        storage.append({"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset),
                        "index": i.index, "file": s.relative_path, "start": s.offset,
                        "length": s.length})  # fmt: skip
    meta = md.storage_meta or StorageMeta()
    return {
        "format": INDEX_FORMAT,
        "version": INDEX_VERSION,
        "dcp_version": md.version,
        "tensors": tensors,
        "storage": storage,
        "planner_data": {k: list(v) for k, v in (md.planner_data or {}).items()},
        "save_id": meta.save_id,
    }


def read_json(path: Path) -> Any:
    """A JSON file of a checkpoint; a pickle is refused unread, anything else unparsable is
    damage. Both errors name the file."""
    data = Path(path).read_bytes()
    if data[:1] == b"\x80":  # a pickle of protocol 2 or later (DCP writes 4 or 5)
        raise UnsafeCheckpointError(f"{path} is a pickle, not JSON: {PICKLE_ERA}")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        if _walks_as_pickle(data):  # protocols 0 and 1 have no header: text opcodes
            raise UnsafeCheckpointError(f"{path} is a pickle, not JSON: {PICKLE_ERA}") from None
        raise DamagedCheckpointError(f"{path}: not a JSON document ({e})") from None


def _walks_as_pickle(data: bytes) -> bool:
    """Whether `data` is a whole pickle: its opcodes read up to STOP by `pickletools.genops`,
    which decodes each opcode's argument and builds, imports and calls nothing."""
    try:
        return any(op.name == "STOP" for op, _, _ in pickletools.genops(data))
    except ValueError:  # an unknown opcode, a truncated argument, or no STOP before the end
        return False


def read_index(directory: Path) -> Metadata:
    """The checkpoint's index (`encode_index`'s JSON) as DCP's `Metadata`, checked field by
    field: a pickle is refused unread (a checkpoint written before this format, or a planted
    file), and so is what our writer never writes (a non-tensor item, a file name with a
    directory in it)."""
    path = Path(directory) / INDEX
    doc = read_json(path)
    try:
        return _decode_index(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise DamagedCheckpointError(
            f"{path}: not a tokenbridge checkpoint index ({e!r})"
        ) from None


def _decode_index(doc: dict) -> Metadata:
    if doc.get("format") != INDEX_FORMAT or doc.get("version") != INDEX_VERSION:
        raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
    items = {}
    for fqn, m in doc["tensors"].items():
        dtype = getattr(torch, str(m["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{fqn}: dtype {m['dtype']!r}")
        props = TensorProperties(dtype=dtype, requires_grad=bool(m["requires_grad"]))
        chunks = [ChunkStorageMetadata(_size(o), _size(s)) for o, s in m["chunks"]]
        items[str(fqn)] = TensorStorageMetadata(props, _size(m["size"]), chunks)
    storage = {}
    for s in doc["storage"]:
        name = str(s["file"])
        if not re.fullmatch(r"__\d+_\d+\.distcp", name):  # DCP's names, in this directory
            raise ValueError(f"data file {name!r}")
        offset = None if s["offset"] is None else _size(s["offset"])
        index = MetadataIndex(
            str(s["fqn"]), offset, None if s["index"] is None else int(s["index"])
        )
        storage[index] = _StorageInfo(name, int(s["start"]), int(s["length"]))
    planner_data = {str(k): tuple(v) for k, v in doc["planner_data"].items()}
    return Metadata(
        state_dict_metadata=items,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=StorageMeta(save_id=doc.get("save_id")),
        version=str(doc["dcp_version"]),
    )


def _size(v) -> torch.Size:
    return torch.Size([int(n) for n in v])


class _ReadingFileSystem(FileSystem):
    """DCP's local file system, remembering the file being read (for the error's message)."""

    current: str | None = None

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        self.current = str(path)
        with super().create_stream(path, mode) as stream:
            yield stream


class SafeReader(FileSystemReader):
    """DCP's file system reader, given the index `read_index` decoded: it never unpickles
    ``.metadata``, and a tensor record that torch's weights-only unpickler refuses is an
    `UnsafeCheckpointError` naming its file."""

    def __init__(self, path: str | Path, index: Metadata):
        super().__init__(str(path))
        self.fs = _ReadingFileSystem()
        self.index = index

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then asks for no rank-local index
        self.index.storage_meta.load_id = self.load_id
        return self.index

    def read_data(self, plan, planner):
        try:
            with warnings.catch_warnings():  # torch warns of a pickle protocol it will refuse
                warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
                return super().read_data(plan, planner)
        except pickle.UnpicklingError as e:
            if not str(e).startswith("Weights only load failed"):
                raise  # not a refusal: damage, which the caller reports
            text = " ".join(str(e).split())
            named = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
            detail = re.search(r"WeightsUnpickler error: (.*?) Check the documentation", text)
            what = (
                f"names {named.group(1)}"
                if named
                else f"is not a tensor ({detail.group(1) if detail else 'refused'})"
            )
            raise UnsafeCheckpointError(
                f"{self.fs.current}: a record {what}, which torch's weights-only loader "
                f"refuses; {PLANTED}"
            ) from None


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, which refuses byte items rather than unpickle them
    (`read_index` already refuses an index that lists one)."""

    def load_bytes(self, read_item, value) -> None:
        raise UnsafeCheckpointError(
            f"checkpoint item {read_item.dest_index.fqn!r} is a pickled object, not a tensor; "
            f"{PLANTED}"
        )
