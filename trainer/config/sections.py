"""The plain sections of the trainer's config: models, data, optimizer, layout, checkpoints, eval,
logging. One dataclass per YAML section; ``__post_init__`` checks what the section alone decides
and names the field it refuses (``config data.micro_batch_size: expected >= 1, got 0``). A rule
that relates two sections is in `trainer.config.rules`, and the loss and on-policy sections in
`trainer.config.loss_sections`. Pure: no file is read, so a bad value fails in milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from tokenbridge import urls
from tokenbridge.formats.checksums import VERIFY_MODES
from tokenbridge.model_spec import DTYPE_CHOICES, DTYPES, check_model_source
from trainer.config.checks import (
    ConfigError,
    check_at_least,
    check_choice,
    check_positive,
    fail,
    registry,
)

TEACHER_PLACEMENTS = ("worker", "inprocess")
# how a CPU rank's cores are shared by the student and its teacher workers (`trainer.parallel.cpus`)
CPU_SPLITS = ("auto", "off")
# activation checkpointing of the student's decoder blocks (`trainer.parallel.parallelize.apply_ac`)
AC_MODES = ("none", "full", "every_n")
EVAL_SPLITS = ("window", "document")
# the object stores the trainer reads its inputs from (`trainer.data.remote_inputs`)
REMOTE_SCHEMES = urls.OBJECT_STORES


def check_location(where: str, value: str | None, *, schemes: tuple[str, ...] = REMOTE_SCHEMES):
    """A path field: local, or a URL of `schemes`; any other ``scheme://`` is refused now (a
    URL handed to pathlib would become a local directory named ``s3:``)."""
    try:
        urls.check(value, where=where, schemes=schemes)
    except urls.UnsupportedURLError as e:
        raise ConfigError(f"config {e}") from None


@dataclass
class ModelConfig:
    """A causal LM from a HF directory (config.json + tokenizer, + weights if pretrained), local
    or at an object-store URL."""

    path: str = MISSING
    # "pretrained": load the weights; "random": build from the dir's config.json with
    # `overrides` applied (tiny test models that keep the real tokenizer) and seed `seed`.
    init: str = "pretrained"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    name: str = ""  # short name for logs; default: the directory name

    def __post_init__(self) -> None:
        self._validate("model")

    def _validate(self, where: str) -> None:
        if self.path == MISSING:
            fail(f"{where}.path", "a model directory is required")
        try:  # the library's rule (tokenbridge.model_spec), named by the config's field
            check_model_source(self, where)
        except ValueError as e:
            raise ConfigError(f"config {e}") from None
        # a URL: a marked directory, fetched verified by `trainer.data.remote_inputs.localize`
        check_location(f"{where}.path", self.path)
        if not self.name:
            self.name = urls.name(self.path)


@dataclass
class TeacherConfig(ModelConfig):
    """One teacher: its model, the projection to the student vocab, its weight and TP size."""

    # sparse vocabulary projection (tokenbridge.projection .safetensors); required by the
    # cross-tokenizer losses (xtoken, gold), unused when teacher and student share a tokenizer
    projection: str | None = None
    weight: float = 1.0
    tp: int = 1
    loss: str | None = None  # per-teacher loss mode; default: loss.mode
    # the frozen teacher's weights and compute (no master copy needed); auto: bfloat16 on CUDA,
    # float32 on CPU (`trainer.config.precision`)
    dtype: str = "auto"
    # an offline teacher cache (`make teacher-cache`): read its outputs instead of running the
    # teacher (no worker, no weights loaded); refused unless built from these shards with this
    # teacher, k and temperature (docs/training.md, "Teacher cache")
    cache: str | None = None
    # a teacher served by vLLM's OpenAI-compatible server (`make teacher-server`), http(s)://
    # host:port: its outputs come from there, no weights load here; `path` then names the local
    # tokenizer directory the shards were aligned with (docs/training.md, "A served teacher")
    server: str | None = None
    served_model: str = ""  # the model name the server serves (default: `name`)
    server_timeout_s: float = 120.0  # requests are retried this long before the run stops
    api_key_env: str = ""  # an environment variable holding the server's API key (Bearer)

    def __post_init__(self) -> None:
        self._validate("teachers[?]")

    def check(self, i: int) -> None:
        """The value checks, naming the teacher by its place in the list (which the section
        does not know when it is built): run by `TrainConfig`."""
        where = f"teachers[{i}]"
        self._validate(where)
        check_location(f"{where}.projection", self.projection)
        check_location(f"{where}.cache", self.cache)
        check_positive(f"{where}.weight", self.weight, allow_zero=True)
        check_at_least(f"{where}.tp", self.tp, 1)
        if self.loss is not None:
            check_choice(f"{where}.loss", self.loss, registry().KD_MODES)
        check_choice(f"{where}.dtype", self.dtype, DTYPE_CHOICES)
        if self.server is not None:
            if not self.server.startswith(("http://", "https://")):
                fail(f"{where}.server", f"expected http(s)://host:port, got {self.server!r}")
            if self.cache:
                fail(f"{where}.server", "a teacher is served or read from its cache, not both")
            check_positive(f"{where}.server_timeout_s", self.server_timeout_s)


@dataclass
class DataConfig:
    """Aligned shards (made by `make align`) and how they are cut into microbatches."""

    shards: str = MISSING
    micro_batch_size: int = 2  # rows per microbatch per data-parallel rank
    grad_accum: int = 1  # microbatches per optimizer step per rank
    max_student_tokens: int = 512  # a longer row is an error (re-align with shorter windows)
    pad_to_multiple: int = 8  # pad each microbatch's length up to a multiple of this
    shuffle_buffer: int = 256  # rows held for the bounded shuffle (0 = file order)
    seed: int = 0
    eval_fraction: float = 0.05  # share held out (by hash) for eval BPB
    # what is held out: window = (doc id, window) pairs; document = whole documents by doc id
    # (no window of a held-out document is trained on: the in-domain score of docs/science.md)
    eval_split: str = "window"
    # a validation set beside the test set (the next val_fraction of the same hash, never
    # trained on either), and which of the two the held-out BPB is computed on: a
    # hyper-parameter is chosen on "val" and reported on "test" (bench/science/experiment.py)
    val_fraction: float = 0.0
    eval_on: str = "test"
    # checksums of the shard files against their COMPLETED marker (docs/integrity.md):
    # first_open (each file when first mapped) | preflight (all before any model) | never
    verify: str = "first_open"
    # inputs at s3:// URLs (shards, teacher caches, projections) are fetched once per node into
    # this local directory (default ~/.cache/tokenbridge), at most cache_limit_gb of them:
    # the least recently used are evicted first (`trainer.data.remote_inputs`)
    cache_dir: str = ""
    cache_limit_gb: float = 50.0
    # s3:// shards read one file at a time, the next fetched in the background, at most
    # stream_files of them on disk (`tokenbridge.formats.streamed_shards`): for datasets larger than
    # the node's disk; else the whole directory is fetched before the run starts
    stream: bool = False
    stream_files: int = 3
    # packed rows (`trainer.data.packing`): several documents per row of packed_tokens student
    # tokens (0 = max_student_tokens), in the same order on every teacher's side, attention and
    # targets within a document; first-fit from a buffer of pack_buffer documents
    packing: bool = False
    packed_tokens: int = 0
    pack_buffer: int = 64

    def __post_init__(self) -> None:
        check_choice("data.verify", self.verify, VERIFY_MODES)
        check_location("data.cache_dir", self.cache_dir or None, schemes=())
        check_positive("data.cache_limit_gb", self.cache_limit_gb)
        check_at_least("data.stream_files", self.stream_files, 2)
        if not self.shards or self.shards == MISSING:
            fail("data.shards", "a shard directory (from `make align`) is required")
        check_location("data.shards", self.shards)
        for name in ("micro_batch_size", "grad_accum", "max_student_tokens", "pad_to_multiple"):
            check_at_least(f"data.{name}", getattr(self, name), 1)
        check_at_least("data.shuffle_buffer", self.shuffle_buffer, 0)
        check_at_least("data.pack_buffer", self.pack_buffer, 1)
        if self.packed_tokens and self.packed_tokens < self.max_student_tokens:
            fail(
                "data.packed_tokens",
                f"{self.packed_tokens} < data.max_student_tokens={self.max_student_tokens}: every "
                "row must fit a packed row alone (raise it, or 0 = max_student_tokens)",
            )
        if self.eval_split not in EVAL_SPLITS:
            fail("data.eval_split", f"expected window or document, got {self.eval_split!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            fail("data.eval_fraction", f"expected in [0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.val_fraction < 1.0 - self.eval_fraction:
            fail(
                "data.val_fraction", f"expected in [0, 1 - eval_fraction), got {self.val_fraction}"
            )
        check_choice("data.eval_on", self.eval_on, ("test", "val"))
        if self.eval_on == "val" and self.val_fraction <= 0:
            fail("data.eval_on", "val needs data.val_fraction > 0")

    @property
    def row_tokens(self) -> int:
        """The student tokens a packed row holds (``packed_tokens``, 0 = max_student_tokens)."""
        return self.packed_tokens or self.max_student_tokens


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay to min_lr_ratio * lr; global-norm clipping."""

    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # 0 = no clipping (the norm is still logged)
    # a non-finite loss term or gradient norm: false = stop the run, naming the step, the term
    # and the last good checkpoint; true = skip that step (no update, gradients zeroed) and go
    # on. Stopping is the default: a NaN mostly means a bug or a diverged run, and silently
    # skipping steps would hide it (docs/training.md)
    skip_nonfinite: bool = False
    # the fused AdamW kernel: auto = on CUDA and CPU (one kernel for every parameter; on CPU
    # 7x the foreach implementation's speed); true / false force it (`trainer.config.precision`)
    fused: bool | str = "auto"

    def __post_init__(self) -> None:
        if self.fused not in (True, False, "auto"):
            fail("optim.fused", f"expected auto, true or false, got {self.fused!r}")
        check_positive("optim.lr", self.lr)
        check_positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        check_positive("optim.eps", self.eps)
        check_positive("optim.grad_clip", self.grad_clip, allow_zero=True)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            fail("optim.betas", f"expected two numbers in [0, 1), got {list(self.betas)}")
        check_at_least("optim.warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("optim.min_lr_ratio", f"expected in [0, 1], got {self.min_lr_ratio}")


@dataclass
class ParallelConfig:
    """The device mesh (dp_replicate x dp_shard x cp x tp) of the student, mixed precision,
    activation checkpointing and compile of the student, teacher placement."""

    # HSDP: the weights sharded over dp_shard ranks (x cp), those shards replicated over
    # dp_replicate groups (nodes, typically: FSDP's per-layer collectives stay within a node,
    # one gradient all-reduce crosses nodes); 1 = plain FSDP over every data-parallel rank
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: world_size / (dp_replicate * cp * tp)
    tp: int = 1  # tensor parallel: heads, MLP and the vocabulary (lm_head, embeddings) split
    cp: int = 1  # context parallel: each sequence split over cp ranks (load-balanced layout)
    # FSDP2 MixedPrecisionPolicy: the compute copies of the parameters (the sharded fp32
    # parameters stay the optimizer's master copy) and the gradient reduction; auto = bfloat16
    # on CUDA, float32 on CPU (`trainer.config.precision`)
    param_dtype: str = "auto"
    reduce_dtype: str = "float32"
    reshard_after_forward: bool = True
    # "worker": each rank's teacher runs in its own process and hands its outputs over the
    # shared-memory (CPU) / CUDA IPC (GPU) channel; "inprocess": in the trainer's process (one
    # torch runtime: less memory, but no overlap of teacher and student; also for debugging)
    teacher_placement: str = "worker"
    channel_slots: int = 2  # ring slots per channel; 2 lets the teacher run one microbatch ahead
    teacher_timeout_s: float = 300.0  # a teacher worker silent this long is declared hung
    # how long a collective waits for a peer rank before the process group gives up: a node
    # that vanished without closing its connections is noticed then (a killed process at
    # once); the surviving ranks then name the one that is gone (trainer/parallel/liveness.py)
    collective_timeout_s: float = 600.0
    threads: int = 0  # torch intra-op threads of the student and each teacher worker; 0 = auto
    # CPU runs with teacher workers, parallel.threads 0: where the workers compute while the
    # student does (off-policy KD: a microbatch ahead; on-policy lag 1: while it samples), auto
    # gives them threads that add up to the rank's cores, and every core to each elsewhere; two
    # teams that each take every core fight for them (lag 1 was slower than lag 0 on 2 cores).
    # off: torch's default (every core) in every process. See trainer/parallel/cpus.py.
    cpu_split: str = "auto"
    # the student's logits are never whole: every loss projects the lm_head's input this many
    # positions at a time (forward and backward), so memory holds O(chunk x V), not O(T x V);
    # 0 = the whole [B, T, V] logits (the path before chunking, kept for comparison)
    logits_chunk: int = 256
    # recompute each decoder block's activations in the backward instead of keeping them:
    # none | full (every block) | every_n (blocks i with i % ac_every == 0); about one more
    # forward per wrapped block for a peak that no longer grows with the layers
    activation_checkpointing: str = "none"
    ac_every: int = 2
    # torch.compile each student decoder block (inductor); the first step pays the compile
    compile: bool = False

    def __post_init__(self) -> None:
        if self.dp_shard == 0 or self.dp_shard < -1:
            fail("parallel.dp_shard", f"expected -1 (auto) or >= 1, got {self.dp_shard}")
        check_at_least("parallel.dp_replicate", self.dp_replicate, 1)
        check_at_least("parallel.tp", self.tp, 1)
        check_at_least("parallel.cp", self.cp, 1)
        check_choice("parallel.param_dtype", self.param_dtype, DTYPE_CHOICES)
        check_choice("parallel.reduce_dtype", self.reduce_dtype, DTYPES)
        check_choice("parallel.teacher_placement", self.teacher_placement, TEACHER_PLACEMENTS)
        check_at_least("parallel.channel_slots", self.channel_slots, 1)
        check_positive("parallel.teacher_timeout_s", self.teacher_timeout_s)
        check_positive("parallel.collective_timeout_s", self.collective_timeout_s)
        check_at_least("parallel.threads", self.threads, 0)
        check_choice("parallel.cpu_split", self.cpu_split, CPU_SPLITS)
        check_at_least("parallel.logits_chunk", self.logits_chunk, 0)
        check_choice("parallel.activation_checkpointing", self.activation_checkpointing, AC_MODES)
        check_at_least("parallel.ac_every", self.ac_every, 1)

    def mesh_shape(self, world_size: int) -> tuple[int, int, int]:
        """(dp_shard, cp, tp) for `world_size` processes (with ``dp_replicate`` replicas of the
        dp_shard x cp x tp ranks), or ConfigError when they do not multiply."""
        rest = self.dp_replicate * self.cp * self.tp
        dp = world_size // rest if self.dp_shard == -1 else self.dp_shard
        if dp < 1 or dp * rest != world_size:
            rep = f"dp_replicate={self.dp_replicate} x " if self.dp_replicate > 1 else ""
            fail(
                "parallel",
                f"{rep}dp_shard={self.dp_shard} x cp={self.cp} x tp={self.tp} must equal the "
                f"world size {world_size} (torchrun --nproc_per_node)",
            )
        return dp, self.cp, self.tp


@dataclass
class CheckpointConfig:
    """DCP checkpoints (model, optimizer, scheduler, data position, RNG) and the HF export."""

    interval: int = 0  # save every N steps (0 = only at the end)
    keep: int = 2  # keep the newest N checkpoints
    resume: str = "auto"  # auto (newest in the run dir, if any) | none | <checkpoint path>
    # where checkpoints go (default <run_dir>/checkpoints): a local path or an s3:// URL
    # (`trainer.checkpoint.remote`; resumed from a verified copy in data.cache_dir)
    dir: str = ""
    # resume=auto and the newest checkpoint fails its checksums: false = move it aside and
    # resume from the newest that verifies; true = refuse (docs/integrity.md)
    strict: bool = False
    save_at_end: bool = True
    export_at_end: bool = True  # student as a plain HF dir (safetensors + tokenizer)

    def __post_init__(self) -> None:
        check_at_least("checkpoint.interval", self.interval, 0)
        check_at_least("checkpoint.keep", self.keep, 1)
        if not self.resume:
            fail("checkpoint.resume", "expected auto, none or a checkpoint path")
        check_location("checkpoint.resume", self.resume)
        check_location("checkpoint.dir", self.dir or None)


@dataclass
class EvalConfig:
    """Held-out bits per byte of the student (before, every N steps, after) and of the teacher."""

    interval: int = 0  # every N steps (0 = only before and after training)
    max_texts: int = 32  # held-out windows evaluated (the first ones, a fixed set)
    batch_size: int = 4
    teacher: bool = True  # the teachers' BPB once, for reference

    def __post_init__(self) -> None:
        check_at_least("eval.interval", self.interval, 0)
        check_at_least("eval.max_texts", self.max_texts, 0)
        check_at_least("eval.batch_size", self.batch_size, 1)


@dataclass
class LoggingConfig:
    """Per-step metrics: JSONL and TensorBoard under the run dir, tqdm progress on rank 0, and
    the run report at the end."""

    interval: int = 1  # write metrics every N steps
    jsonl: bool = True
    tensorboard: bool = True
    progress: bool = True
    # the HTML run report (report/ under the run dir) at the end of a run; `python -m
    # trainer.report RUN_DIR` writes it later from the same files (~1.5 s of plotting per run)
    report: bool = True
    # MFU's denominator, dense TFLOP/s of one device at the student's compute dtype: null =
    # the table of known GPUs (`tokenbridge.flops.PEAK_TFLOPS`, bf16/fp16); a device it does not
    # know gets no MFU (never a guess) unless named here
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        check_at_least("logging.interval", self.interval, 1)
        if self.peak_tflops is not None:
            check_positive("logging.peak_tflops", self.peak_tflops)
