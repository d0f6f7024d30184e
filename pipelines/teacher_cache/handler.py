"""The teacher inside Beam's RunInference: a model handler running the trainer's teacher forward.

`load_model` builds the frozen teacher as a trainer's teacher worker does (same weights, same
dtype) and `run_inference` calls `tokenbridge.teacher.forward.teacher_forward`, so cached
outputs are the live teacher's. Elements arrive batched by the reader (`RowBatch`), so
RunInference's own batching is off; a batch that fails is retried row by row, and a row that
still fails comes back with its error, for the dead letters (`RowBatchHandler`, which the
served teacher's handler shares: `served_handler`).

Legend: B rows, U teacher positions (the batch's longest row), K top-k, R samples, V vocab.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch
from apache_beam.ml.inference.base import ModelHandler

from pipelines.teacher_cache import devices
from pipelines.teacher_cache.sampled_ids import Sampler, sample_keys
from tokenbridge import models, remote_models, urls
from tokenbridge.model_spec import ModelSpec, check_dtype
from tokenbridge.teacher.forward import teacher_forward
from tokenbridge.teacher.outputs import TeacherOutputSpec

ROWS_PER_HEAD = 256  # rows (B x positions) per lm_head application: bounds the [rows, V] logits


@dataclass
class RowBatch:
    """Rows of one shard file to score in one forward (the reader cuts them to a token budget)."""

    shard_file: str
    rows: np.ndarray  # int32, row numbers in the shard file
    ids: list[np.ndarray]  # the teacher's ids of each row

    def __len__(self) -> int:  # RunInference counts elements per batch with len()
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.ids), np.int64, len(self.ids))


@dataclass
class ScoredBatch:
    """A `RowBatch` with its outputs: per field a numpy array [B, U, ...] (positions past a
    row's length are padding), or an error per row that failed."""

    batch: RowBatch
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    seconds: float = 0.0
    errors: dict[int, str] = field(default_factory=dict)  # index in the batch -> error


class RowBatchHandler(ModelHandler):
    """RunInference over `RowBatch`es (one `ScoredBatch` out per element), whatever scores them:
    a subclass gives ``load_model`` and ``_score(model, batch)`` (per field [B, U, ...]). A batch
    whose scoring raises one of ``ROW_ERRORS`` is retried row by row; any other error fails
    the job."""

    ROW_ERRORS: tuple[type[BaseException], ...] = (Exception,)

    def should_skip_batching(self) -> bool:
        # elements are batches already; and RunInference's `BatchElements` emits a bundle's
        # last batch from ``finish_bundle``, which the DaskRunner drops
        return True

    def get_num_bytes(self, batch: RowBatch) -> int:
        return int(batch.lengths.sum()) * 8  # the ids, without pickling the batch to count

    def get_metrics_namespace(self) -> str:
        return "tokenbridge.teacher_cache"

    def _score(self, model, batch: RowBatch) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def run_inference(self, batch: RowBatch, model, inference_args=None):
        t0 = time.perf_counter()
        try:
            outputs, errors = self._score(model, batch), {}
        except self.ROW_ERRORS:
            # retry alone each row of a failed batch: one bad row must not sink its neighbours
            outputs, errors = self._row_by_row(model, batch)
        return [ScoredBatch(batch, outputs, time.perf_counter() - t0, errors)]

    def _row_by_row(self, model, batch: RowBatch) -> tuple[dict[str, np.ndarray], dict[int, str]]:
        u = int(batch.lengths.max(initial=0))
        merged: dict[str, np.ndarray] = {}
        errors: dict[int, str] = {}
        for i in range(len(batch)):
            one = RowBatch(batch.shard_file, batch.rows[i : i + 1], [batch.ids[i]])
            try:
                got = self._score(model, one)
            except self.ROW_ERRORS as e:
                last = traceback.format_exception_only(type(e), e)[-1].strip()
                errors[i] = last[:500]
                continue
            for k, v in got.items():
                if k not in merged:
                    merged[k] = np.zeros((len(batch), u, *v.shape[2:]), v.dtype)
                merged[k][i, : v.shape[1]] = v[0]
        return merged, errors


class TeacherCacheHandler(RowBatchHandler):
    """RunInference's view of the teacher: `RowBatch` in, `ScoredBatch` out (one per element).

    The model is the frozen teacher; each batch goes through `teacher_forward`, the same
    forward the trainer's teacher workers run, so a cached output is the live teacher's output
    by construction."""

    def __init__(
        self,
        teacher: ModelSpec,
        spec: TeacherOutputSpec,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        threads: int | None = None,
        samples: int = 0,
        sample_seed: int = 0,
    ):
        super().__init__()
        self.teacher, self.spec, self.device, self.threads = teacher, spec, device, threads
        self.dtype = check_dtype(dtype, "--teacher-dtype")
        self.samples, self.sample_seed = samples, sample_seed

    def load_model(self) -> torch.nn.Module:
        """The frozen teacher, on this worker's device (`devices.worker_device`); a teacher at
        a URL from this machine's verified copy (`tokenbridge.remote_models`)."""
        if self.threads:
            torch.set_num_threads(self.threads)
        spec = self.teacher
        if urls.is_url(spec.path):
            local = remote_models.local_copy(spec.path)  # this machine's cache
            spec = dataclasses.replace(spec, path=local)
        device = devices.worker_device(self.device)
        model = models.build_model(spec, dtype=models.torch_dtype(self.dtype), device=device)
        return models.freeze(model)

    def _score(self, model: torch.nn.Module, batch: RowBatch) -> dict[str, np.ndarray]:
        lens = batch.lengths
        b, u = len(lens), int(lens.max(initial=0))
        if u == 0:
            return {}
        ids = np.zeros((b, u), np.int64)
        for i, x in enumerate(batch.ids):
            ids[i, : len(x)] = x
        mask = (np.arange(u)[None, :] < lens[:, None]).astype(np.int64)
        dev = next(model.parameters()).device  # the worker's pick (`load_model`)
        inputs = {
            "input_ids": torch.from_numpy(ids).to(dev),
            "attention_mask": torch.from_numpy(mask).to(dev),
        }
        sampler = None
        if self.samples:
            keys = sample_keys(self.sample_seed, batch.shard_file, batch.rows)
            sampler = Sampler(
                keys,
                u,
                r=self.samples,
                vocab_size=self.spec.vocab_size,
                temperature=self.spec.temperature,
            )
        # the lm_head's chunk bounds the [rows, V] logits of one application whatever the
        # batch size; chunking along positions does not change any value
        with torch.no_grad():
            outs = teacher_forward(
                model,
                inputs["input_ids"],
                inputs["attention_mask"],
                spec=self.spec,
                columns=None,
                chunk=max(1, ROWS_PER_HEAD // b),
                on_logits=sampler,
            )
        result = {k: v.cpu().numpy() for k, v in outs.tensors().items()}
        if sampler is not None:
            result["sample_ids"] = np.sort(sampler.ids, axis=-1)
        return result


def teacher_config(path: str, *, init: str, seed: int, overrides: dict) -> ModelSpec:
    """The teacher the job scores with (checked: init, overrides)."""
    return ModelSpec(path=path, init=init, seed=seed, overrides=dict(overrides))


def teacher_spec(vocab_size: int, *, k: int, temperature: float, target: bool) -> TeacherOutputSpec:
    """What the job stores: the spec of `kd_topk` / `xtoken` at this k and temperature, plus the
    realised token's log-prob (`alm`, xtoken's chain term) when `target`."""
    return TeacherOutputSpec(vocab_size, topk=k, target=target, temperature=temperature)


def lm_head_rows(cfg: ModelSpec) -> int:
    """The teacher's lm_head width from its config.json (no weights loaded)."""
    return int(models.model_config(cfg).vocab_size)
