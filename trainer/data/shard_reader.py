"""The rows of a shard directory for one data-parallel rank: the held-out split, random
access to each row (memory-mapped), and the endless, shuffled, resumable stream of row indices.

Rows are numbered globally (files in order, rows in order). Of the rows not held out, dp rank r
reads those whose index is r modulo the dp size, through a seeded bounded shuffle buffer, epoch
after epoch: an endless stream, so every rank yields the microbatches FSDP's collectives need.
The stream's whole position is a small dict saved per dp rank, so a resumed run reads exactly
the rows the uninterrupted run would have read.
"""

from __future__ import annotations

import random
import zlib
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tokenbridge.formats import shard_schema, value_checks

if TYPE_CHECKING:
    from trainer.config.sections import DataConfig


def held_out_set(
    doc_id: str, window: int, fraction: float, *, by: str = "window", val_fraction: float = 0.0
) -> str | None:
    """Deterministic eval split, stable across runs, ranks and machines: ``"test"``, ``"val"``
    or None (trained on), by (doc id, window) or by doc id alone (``by="document"``: a held-out
    document is held out whole, so no window of it is ever trained on; the honest in-domain
    score, docs/science.md).

    One hash, two adjacent ranges: [0, fraction) is the test set, [fraction, fraction +
    val_fraction) the validation set a hyper-parameter is chosen on. The test set does not move
    when a validation set is added, and the two never share a document."""
    key = doc_id if by == "document" else f"{doc_id}\x00{window}"
    h = zlib.crc32(key.encode())
    if h < fraction * 2**32:
        return "test"
    if h < (fraction + val_fraction) * 2**32:
        return "val"
    return None


def is_held_out(doc_id: str, window: int, fraction: float, *, by: str = "window") -> bool:
    """Whether (doc id, window) is in the test set of `held_out_set` (no validation set)."""
    return held_out_set(doc_id, window, fraction, by=by) == "test"


class StreamedTables:
    """``ShardReader.tables`` of streamed shards: file `f` mapped when a row of it is first
    read (`StreamedFiles.path` fetches it, and the next one in the background); at most the
    stream's window of files stays mapped here."""

    def __init__(self, shard_set):
        self.shard_set, self.stream = shard_set, shard_set.stream
        self.mapped: dict[int, pa.Table] = {}  # in order of last use

    def __len__(self) -> int:
        return len(self.shard_set.files)

    def __getitem__(self, f: int) -> pa.Table:
        t = self.mapped.pop(f, None)
        if t is None:
            t = self.shard_set.read_table(self.stream.path(f))
            while len(self.mapped) >= self.stream.keep:
                self.mapped.pop(next(iter(self.mapped)))
        else:  # mapped here: readable even if another rank evicted it; never fetched again
            self.stream.touch(f)
        self.mapped[f] = t
        return t


class ShardReader:
    """Random access to the rows of a `tokenbridge.formats.shards.ShardSet`, memory-mapped, never
    loaded whole (streamed shards, ``data.stream``: a file at a time, as the rows reach it).

    Each file is verified against its checksum when mapped (`ShardSet.read_table`, per
    ``data.verify``), and each record batch's values are checked (`tokenbridge.formats.value_checks`) the first
    time one of its rows is read, before that row reaches a model."""

    def __init__(self, shard_set, *, max_student_tokens: int):
        self.shard_set = shard_set
        self.num_teachers = len(shard_set.meta.teachers)
        self.max_student_tokens = max_student_tokens
        self.stream = shard_set.stream  # data.stream: files mapped as the rows reach them
        self.tables = (
            StreamedTables(shard_set)
            if self.stream
            else [shard_set.read_table(p) for p in shard_set.files]
        )
        # per file: the first row of each record batch (a table's chunks are the file's batches)
        self._batch_starts: dict[int, np.ndarray] = {}
        self.checked: set[tuple[int, int]] = set()  # (file, batch) whose values were checked
        self.starts = np.concatenate([[0], np.cumsum(shard_set.file_rows)]).astype(np.int64)
        self.num_rows = int(self.starts[-1])

    def check_values(self, f: int, i: int) -> None:
        """Check the record batch holding row `i` of file `f`, once (cheap after the first)."""
        t = self.tables[f]
        if f not in self._batch_starts:
            self._batch_starts[f] = np.cumsum([0] + [len(c) for c in t.column(0).chunks])
        starts = self._batch_starts[f]
        b = int(np.searchsorted(starts, i, side="right") - 1)
        if (f, b) not in self.checked:
            first = int(starts[b])
            batch = t.slice(first, int(starts[b + 1]) - first).to_batches()[0]
            value_checks.check_batch(
                batch, self.shard_set.meta, where=str(self.shard_set.files[f]), first_row=first
            )
            self.checked.add((f, b))

    def max_lengths(self) -> tuple[int, list[int]]:
        """(longest student row, longest row of each teacher), without reading the rows."""

        if self.stream:
            return self._window_limits()

        def longest(col: str) -> int:
            m = [pc.max(pc.list_value_length(t.column(col))).as_py() for t in self.tables]
            return max([x for x in m if x is not None], default=0)

        student = longest("student_ids")
        if student > self.max_student_tokens:
            raise ValueError(
                f"{self.shard_set.dir}: rows of up to {student} student tokens > "
                f"data.max_student_tokens={self.max_student_tokens}; re-run the align job with "
                "shorter windows (--max-student-tokens) or raise the limit"
            )
        return student, [
            longest(shard_schema.teacher_ids_column(k)) for k in range(self.num_teachers)
        ]

    def _window_limits(self) -> tuple[int, list[int]]:
        """Streamed shards: the align job's window limits (stats.json) bound every row, since
        the rows themselves are not here yet."""
        cfg = self.shard_set.stats().get("window_config") or {}
        if "max_student_tokens" not in cfg or "max_teacher_tokens" not in cfg:
            raise ValueError(
                f"{self.shard_set.dir}: data.stream needs the align job's window limits in "
                "stats.json (window_config), to size the teachers' buffers before any row is "
                "read; these shards have none: set data.stream=false"
            )
        student = int(cfg["max_student_tokens"])
        if student > self.max_student_tokens:
            raise ValueError(
                f"{self.shard_set.dir}: windows of up to {student} student tokens > "
                f"data.max_student_tokens={self.max_student_tokens}; raise the limit"
            )
        return student, [int(cfg["max_teacher_tokens"])] * self.num_teachers

    def locate(self, row: int) -> tuple[int, int]:
        f = int(np.searchsorted(self.starts, row, side="right") - 1)
        return f, row - int(self.starts[f])

    def where(self, row: int) -> str:
        f, i = self.locate(row)
        return f"{self.shard_set.files[f]} row {i}"

    def split(
        self,
        eval_fraction: float,
        *,
        by: str = "window",
        val_fraction: float = 0.0,
        eval_on: str = "test",
    ) -> tuple[np.ndarray, np.ndarray]:
        """(train rows as sorted global indices, held-out rows ordered by (doc id, window)).

        Neither the test nor the validation set is trained on; the held-out rows returned are
        those of ``eval_on`` ("test" or "val"). Their order is that of the text, not of the
        shard rows: a multi-worker align job may write the same windows in another row order,
        and the eval set (its first rows) must not change with it.
        """
        held = np.zeros(self.num_rows, dtype=bool)
        held_keys: dict[int, tuple[str, int]] = {}
        for f in range(len(self.shard_set.files)):
            # streamed: the file's index (its doc_id and window columns), not the file
            t = self.stream.index(f) if self.stream else self.tables[f]
            docs = t.column("doc_id").to_pylist()
            wins = t.column("window").to_pylist()
            s = int(self.starts[f])
            for i, (d, w) in enumerate(zip(docs, wins)):
                which = held_out_set(d, w, eval_fraction, by=by, val_fraction=val_fraction)
                if which is not None:
                    held[s + i] = True
                if which == eval_on:
                    held_keys[s + i] = (d, w)
        idx = np.arange(self.num_rows, dtype=np.int64)
        held_rows = sorted(held_keys, key=held_keys.__getitem__)
        return idx[~held], np.asarray(held_rows, dtype=np.int64)

    def _list(self, t: pa.Table, col: str, i: int) -> np.ndarray:
        return t.column(col)[i].values.to_numpy(zero_copy_only=False)

    def row(self, row: int) -> dict:
        f, i = self.locate(row)
        self.check_values(f, i)
        t = self.tables[f]
        ids = self._list(t, "student_ids", i)
        if len(ids) > self.max_student_tokens:
            raise ValueError(
                f"{self.where(row)}: {len(ids)} student tokens > data.max_student_tokens="
                f"{self.max_student_tokens}; re-run the align job with shorter windows or raise "
                "the limit"
            )
        out = {"student_ids": ids, "text": t.column("text")[i].as_py(), "teachers": []}
        for k in range(self.num_teachers):
            out["teachers"].append(
                {
                    "ids": self._list(t, shard_schema.teacher_ids_column(k), i),
                    "chunk": self._list(t, shard_schema.teacher_chunk_column(k), i),
                    "student_chunk": self._list(t, shard_schema.teacher_student_chunk_column(k), i),
                    "n_chunks": t.column(shard_schema.teacher_n_chunks_column(k))[i].as_py(),
                }
            )
        if self.is_chat:
            self._chat_columns(out, t, i)
        return out

    @property
    def is_chat(self) -> bool:
        """Conversation shards (train codes, chunk kinds; `tokenbridge.formats.shard_schema`)."""
        return self.shard_set.meta.is_chat

    def _chat_columns(self, out: dict, t: pa.Table, i: int) -> None:
        """A conversation row's train codes and trained bytes, and each teacher's train codes
        and chunk kinds (in `out`, next to the ids they belong to)."""
        out["train"] = self._list(t, shard_schema.STUDENT_TRAIN_COLUMN, i)
        out["trained_bytes"] = int(t.column(shard_schema.TRAINED_BYTES_COLUMN)[i].as_py())
        for k, teacher in enumerate(out["teachers"]):
            teacher["train"] = self._list(t, shard_schema.teacher_train_column(k), i)
            teacher["chunk_kind"] = self._list(t, shard_schema.teacher_chunk_kind_column(k), i)

    def text(self, row: int) -> str:
        f, i = self.locate(row)
        return self.tables[f].column("text")[i].as_py()


class ShardStream:
    """The endless, shuffled, resumable row stream of one data-parallel rank."""

    def __init__(
        self,
        reader: ShardReader,
        *,
        data: DataConfig,
        dp_rank: int,
        dp_size: int,
        seed: int | None = None,
    ):
        """``data``: the held-out split and the shuffle buffer; ``seed``: the shuffle's
        (default ``data.seed``)."""
        self.reader = reader
        seed = data.seed if seed is None else seed
        train, self.eval_rows = reader.split(
            data.eval_fraction,
            by=data.eval_split,
            val_fraction=data.val_fraction,
            eval_on=data.eval_on,
        )
        self.rows = train[dp_rank::dp_size]
        if reader.stream:  # the files this rank reads: the only ones fetched ahead
            reader.stream.order = sorted({reader.locate(int(r))[0] for r in self.rows})
        if len(self.rows) == 0:
            raise ValueError(
                f"{reader.shard_set.dir}: {len(train)} training rows (after holding out "
                f"{len(self.eval_rows)} for eval) cannot feed {dp_size} data-parallel ranks"
            )
        self.layout = {"dp_rank": dp_rank, "dp_size": dp_size, "seed": seed, "rows": len(train)}
        self.buffer_size = data.shuffle_buffer
        self.epoch = 0
        self.cursor = 0
        self.buffer: list[int] = []
        # one RNG per (seed, rank): ranks shuffle independently, runs repeat exactly
        self.rng = random.Random(f"{seed}/{dp_rank}")

    def _advance(self) -> int:
        r = int(self.rows[self.cursor])
        self.cursor += 1
        if self.cursor == len(self.rows):
            self.cursor, self.epoch = 0, self.epoch + 1
        return r

    def next_row(self) -> int:
        if self.buffer_size == 0:
            return self._advance()
        while len(self.buffer) < self.buffer_size:
            self.buffer.append(self._advance())
        j = self.rng.randrange(len(self.buffer))
        self.buffer[j], self.buffer[-1] = self.buffer[-1], self.buffer[j]
        return self.buffer.pop()

    def state_dict(self) -> dict:
        return {
            "layout": dict(self.layout),
            "epoch": self.epoch,
            "cursor": self.cursor,
            "buffer": list(self.buffer),
            "rng": self.rng.getstate(),
        }

    def reshard(self, saved: list[dict]) -> str | None:
        """Continue from the positions every dp rank of another layout saved (a resume on
        another world size). Exact when the rows were read in order (no shuffle buffer) and
        every saved rank stood at the same epoch and cursor: they had read the first
        ``dp_size x cursor`` rows of the epoch between them, and this layout reads on from
        there. Otherwise this stream starts the epoch after theirs; the one-line note says
        so (None when exact)."""
        saved = list({p["layout"]["dp_rank"]: p for p in saved}.values())  # tp, cp ranks alike
        same = {k: v for k, v in self.layout.items() if k in ("seed", "rows")}
        olds = [p["layout"] for p in saved]
        if any({k: o[k] for k in same} != same for o in olds):
            raise ValueError(
                f"data position saved for {olds[0]} cannot resume {self.layout} (other shards "
                "or seed)"
            )
        epochs = {int(p["epoch"]) for p in saved}
        read = sum(int(p["cursor"]) for p in saved)
        exact = (
            self.buffer_size == 0
            and not any(p["buffer"] for p in saved)
            and len(epochs) == 1
            and len({int(p["cursor"]) for p in saved}) == 1
            and read % self.layout["dp_size"] == 0
        )
        if exact:
            self.epoch, self.cursor = epochs.pop(), read // self.layout["dp_size"]
            return None
        self.epoch, self.cursor, self.buffer = max(epochs) + 1, 0, []
        return (
            f"data: the position of {len(saved)} data-parallel ranks cannot be carried over "
            f"exactly to {self.layout['dp_size']} (shuffled, or uneven); starting epoch "
            f"{self.epoch}"
        )

    def load_state_dict(self, state: dict) -> None:
        if state["layout"] != self.layout:
            raise ValueError(
                f"data position saved for {state['layout']} cannot resume {self.layout} "
                "(other shards, seed or data-parallel size)"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.buffer = [int(x) for x in state["buffer"]]
        self.rng.setstate(state["rng"])
