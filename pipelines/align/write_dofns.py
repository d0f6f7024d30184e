"""The align job's writers: rolling shard parts, and the finalize step that publishes them.

`WriteShardsDoFn` streams `Windows` to rolling part files and emits one small record per batch;
`FinalizeDoFn` gets the one summary of all records, moves the parts into place, writes
stats.json and then COMPLETED (docs/pipelines.md, "Rolling writers and finalize").
"""

from __future__ import annotations

import dataclasses

import apache_beam as beam
import pyarrow as pa

from pipelines.align import job_stats
from pipelines.align.align_dofns import Windows, cached_tokenizer
from pipelines.plumbing import rolling, storage
from pipelines.plumbing.tagged import MAX_DEAD_FRACTION, StageTimer, count, dead_verdict
from pipelines.plumbing.writers import RollingPartsDoFn
from tokenbridge.formats import checksums, shard_schema, shards


class WriteShardsDoFn(RollingPartsDoFn):
    """`Windows` -> rows appended to this bundle's rolling Arrow parts; -> a record per batch."""

    KIND, FMT = "shard", "arrow"

    def process(self, item: Windows):
        batch = item.batch
        if not batch.num_rows:
            yield ("stats", item.stats)
            return
        with StageTimer("write"):
            name = self.parts.write(batch)
        count("rows_written", batch.num_rows)
        key = (batch.column(0)[0].as_py(), batch.column(1)[0].as_py())  # (doc_id, window)
        yield ("part", name, batch.num_rows, key, item.stats)


class FinalizeDoFn(beam.DoFn):
    """The single last step: parts renamed into place, the dead letters joined, stats.json, then
    COMPLETED (with each file's rows, size and checksum), then the temporary directory goes.
    A run whose dead letters exceed ``max_dead_fraction`` gets stats.json (saying why) and no
    COMPLETED."""

    def __init__(
        self,
        out_dir: str,
        tmp_dir: str,
        *,
        header: dict,
        student: str,
        teachers: list[str],
        max_dead_fraction: float = MAX_DEAD_FRACTION,
    ):
        self.out_dir, self.tmp_dir, self.header = out_dir, tmp_dir, header
        self.student_path, self.teacher_paths = student, list(teachers)
        self.max_dead_fraction = max_dead_fraction

    def _infos(self, out: storage.Location, index: dict) -> dict:
        """The tokenizers, from a written shard's metadata; loaded only for a run without rows
        (this worker may never have loaded them: no need to, for a header)."""
        if index:
            first = next(iter(index))
            with storage.open_read(storage.join(out, first)) as src:
                meta = shard_schema.read_meta(pa.ipc.open_file(src).schema, where=first)
            student, teachers = meta.student, meta.teachers
        else:
            student = cached_tokenizer(self.student_path).info()
            teachers = [cached_tokenizer(p).info() for p in self.teacher_paths]
        out = {"student": student.to_json(), "teachers": [t.to_json() for t in teachers]}
        if index and meta.chat is not None:  # conversations: templates and markers per side
            out["chat_meta"] = meta.chat
        return out

    def process(self, summary):
        out, tmp = storage.location(self.out_dir), storage.location(self.tmp_dir)
        index = rolling.finalize_parts(out, tmp, summary["parts"], name_for=shards.shard_name)
        infos = self._infos(out, index)
        files = {name: int(info["rows"]) for name, info in index.items()}
        dead_info = rolling.join_dead_letters(out, tmp, dict(summary["dead_parts"]))
        header = {"schema_version": shard_schema.SCHEMA_VERSION, **infos, **self.header}
        lost = dict(summary["lost"])  # not the letters of long documents that gave windows
        stats = job_stats.final_stats(
            header, summary["stats"], dict(summary["dead"]), files, lost=sum(lost.values())
        )
        why = dead_verdict(
            stats["documents"], lost, max_fraction=self.max_dead_fraction, unit="documents"
        )
        if why is not None:
            rolling.write_refused(out, stats, why)
        else:
            file_sums = {name: checksums.manifest_entry(info) for name, info in index.items()}
            file_sums[shard_schema.DEAD_LETTER_FILE] = checksums.manifest_entry(dead_info)
            rolling.write_completed(out, stats, files=files, checksums=file_sums)
        rolling.remove_tmp(tmp)
        yield stats


def header_for(cfg, *, input_files: int, input_bytes: int) -> dict:
    """The part of stats.json that describes the run (the tokenizers are added by Finalize)."""
    return {
        "data": list(cfg.data),
        "input_files": input_files,
        "input_bytes": int(input_bytes),
        "roll_bytes": int(cfg.roll_bytes),
        "window_config": dataclasses.asdict(cfg.window),
        "piece_config": dataclasses.asdict(cfg.pieces),
        "reader_config": dataclasses.asdict(cfg.reader),
        **({"chat": cfg.chat.header()} if cfg.chat is not None else {}),
    }
