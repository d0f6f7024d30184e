"""Every rule of the trainer's config that relates more than one field's section: one place.

Each rule is written once and runs before any model weights load, in three groups by what it
needs: the config alone (`check_config`, run by `TrainConfig.__post_init__`: milliseconds), plus
the number of processes (`check_world`), plus the tokenizers (`check_tokenizers`); the last two
run first in the preflight. A mode's needs are read from the loss-mode registry's flags, never
restated (docs/training.md, "Config keys").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.config.checks import check_choice, fail, registry

if TYPE_CHECKING:
    from tokenbridge.tokenizers import Tokenizer
    from trainer.config.schema import TrainConfig

# on-policy modes whose teachers' outputs can be mixed in probability space (onpolicy.mix)
MIXABLE = ("opd_topk", "opd_pg")


# --- the config alone ---------------------------------------------------------------------


def loss_needs_teachers(cfg: TrainConfig) -> None:
    """A distillation loss needs a teacher to distill from."""
    if cfg.loss.mode != "ce" and not cfg.teachers:
        fail("teachers", f"loss.mode={cfg.loss.mode} needs at least one teacher")


def loss_options_fit_every_mode(cfg: TrainConfig) -> None:
    """``loss.options`` are read by every mode a teacher uses off-policy (its own, else
    ``loss.mode``), so they must fit each of them."""
    if cfg.loss.mode != "ce":
        for mode in dict.fromkeys(cfg.teacher_modes()):
            cfg.loss.mode_options(mode)


def cp_splits_the_padding(cfg: TrainConfig) -> None:
    """The load-balanced CP layout cuts every row into 2 * cp equal pieces."""
    cp, pad = cfg.parallel.cp, cfg.data.pad_to_multiple
    if cp > 1 and pad % (2 * cp):
        fail(
            "data.pad_to_multiple",
            f"parallel.cp={cp} cuts each sequence into 2 * cp = {2 * cp} equal pieces, so "
            f"the padded length must divide by {2 * cp}; pad_to_multiple={pad} does not (use "
            f"a multiple of {2 * cp})",
        )


def offpolicy_modes_read_shards(cfg: TrainConfig) -> None:
    """A mode that reads the student's own samples is an on-policy loss, never an off-policy one."""
    if cfg.loss.mode == "ce":
        return
    for i, mode in enumerate(cfg.teacher_modes()):
        if registry().MODES[mode].onpolicy_only:
            where = f"teachers[{i}].loss" if cfg.teachers[i].loss else "loss.mode"
            fail(where, f"{mode} reads the student's own samples: use it as onpolicy.loss")


def onpolicy_fits_the_teachers(cfg: TrainConfig) -> None:
    """On-policy distillation: its modes against the teachers, their options, the teachers' and
    the student's layouts."""
    op = cfg.onpolicy
    if not op.enabled:
        return
    teachers = cfg.teachers
    if not teachers:
        fail("onpolicy.enabled", "on-policy distillation needs at least one teacher")
    if len(op.teacher_losses) > len(teachers):
        fail("onpolicy.teacher_losses", f"{len(teachers)} teachers, more modes given")
    modes = op.modes(len(teachers))
    for key in op.options:
        if key not in modes:
            fail(f"onpolicy.options.{key}", f"options of a mode no teacher uses ({modes})")
    for i, mode in enumerate(modes):
        check_choice(f"onpolicy.teacher_losses[{i}]", mode, registry().KD_MODES)
        op.mode_options(mode, cfg.loss.temperature)
        if teachers[i].tp != 1:
            fail(f"teachers[{i}].tp", "on-policy scoring runs tp=1 teachers so far")
    if op.mix == "mixture" and (len(set(modes)) != 1 or modes[0] not in MIXABLE):
        want = f"one mode of {list(MIXABLE)} for every teacher"
        fail("onpolicy.mix", f"mixture needs {want}, got {modes}")
    if cfg.parallel.cp > 1:
        # the sampler decodes with a KV cache and the on-policy losses read whole rows
        fail("parallel.cp", "on-policy steps run at cp=1 so far (tp and dp work)")
    if not any(t.weight > 0 for t in teachers):
        fail("teachers", "on-policy distillation needs a teacher with weight > 0")
    if op.sampler_weights == "int8" and (cfg.device == "cuda" or cfg.parallel.tp > 1):
        # fbgemm's CPU kernels, through the lean decode path (never under TP)
        fail("onpolicy.sampler_weights", "int8 sampling runs on CPU at tp=1 "
             f"(device={cfg.device}, parallel.tp={cfg.parallel.tp}): use model")  # fmt: skip


def kd_topk_reads_the_teachers_support(cfg: TrainConfig) -> None:
    """The trainer's teacher runs a microbatch ahead of the student, so kd_topk takes the
    teacher's own top-k (``support='teacher'``); 'columns' scores ids the student picks."""
    given = []
    if cfg.loss.mode != "ce" and "kd_topk" in cfg.teacher_modes():
        given.append(("loss.options", cfg.loss.mode_options("kd_topk")))
    if cfg.onpolicy.enabled and "kd_topk" in cfg.onpolicy.modes(len(cfg.teachers)):
        options = cfg.onpolicy.mode_options("kd_topk", cfg.loss.temperature)
        given.append(("onpolicy.options.kd_topk", options))
    for prefix, options in given:
        if options.support != "teacher":
            fail(f"{prefix}.support", "kd_topk: the trainer takes only 'teacher' (its teacher "
                 "runs a microbatch ahead of the student; 'columns' needs the student's logits "
                 "first)")  # fmt: skip


def caches_serve_their_modes(cfg: TrainConfig) -> None:
    """A teacher cache holds top-k outputs; a mode that reads more cannot use one."""
    if not cfg.kd_enabled:
        return
    for i, (t, mode) in enumerate(zip(cfg.teachers, cfg.teacher_modes())):
        why = registry().MODES[mode].no_cache
        if t.cache and t.weight > 0 and why:
            fail(f"teachers[{i}].cache", f"loss {mode} cannot read a teacher cache: {why}")


# what a served teacher returns: top-k log-probs (normalised, at temperature 1) and the
# realised token's; a mode that reads more (columns: gold; opd_topk's given ids) cannot use one
SERVED_MODES = ("kd_topk", "xtoken", "alm")
SERVED_ONPOLICY_MODES = (*SERVED_MODES, "opd_pg")  # opd_pg: the sampled tokens' log-probs


def _served_temperature(index: int, mode: str, options, *, field: str) -> None:
    temperature = registry().MODES[mode].teacher_spec(options, None, teacher_vocab_size=1)
    if temperature.temperature != 1.0:
        fail(field, f"teachers[{index}].server returns log-probs at temperature 1, the loss "
             f"asks for {temperature.temperature}; use temperature 1 with a served teacher")  # fmt: skip


def served_teachers_serve_their_modes(cfg: TrainConfig) -> None:
    """A served teacher (``teachers[i].server``) gives top-k + target log-probs at temperature
    1, one process per teacher: off-policy (`trainer.teacher.served_teacher`) and on-policy
    (`trainer.onpolicy.rollout_scoring`), for the modes that read no more than that."""
    served = [i for i, t in enumerate(cfg.teachers) if t.server]
    for i in served:
        if cfg.teachers[i].tp != 1:
            fail(f"teachers[{i}].tp", "a served teacher's layout is the server's: leave tp=1")
    op = cfg.onpolicy
    if op.enabled:
        modes = op.modes(len(cfg.teachers))
        for i in served:
            if cfg.teachers[i].weight == 0:
                continue
            own = i < len(op.teacher_losses) and op.teacher_losses[i]
            field = f"onpolicy.teacher_losses[{i}]" if own else "onpolicy.loss"
            if modes[i] == "opd_topk":
                fail(field, f"teachers[{i}].server: opd_topk needs the teacher's log-probs at "
                     "the student's own top-k ids, which no inference engine's API returns; "
                     f"use one of {list(SERVED_ONPOLICY_MODES)}, or the teacher's weights "
                     "(no server)")  # fmt: skip
            if modes[i] not in SERVED_ONPOLICY_MODES:
                fail(field, f"teachers[{i}].server: on-policy {modes[i]} reads more than a "
                     "server returns (its top-k and the realised token's log-probs); use one "
                     f"of {list(SERVED_ONPOLICY_MODES)}")  # fmt: skip
            options = op.mode_options(modes[i], cfg.loss.temperature)
            given = "temperature" in (op.options.get(modes[i]) or {})
            where = f"onpolicy.options.{modes[i]}.temperature" if given else "loss.temperature"
            _served_temperature(i, modes[i], options, field=where)
    if not cfg.kd_enabled:
        return
    modes = cfg.teacher_modes()
    for i in served:
        if modes[i] not in SERVED_MODES:
            fail(f"teachers[{i}].server", f"loss {modes[i]} reads more than a server returns "
                 f"(its top-k and the realised token's log-probs); use one of "
                 f"{list(SERVED_MODES)}")  # fmt: skip
        _served_temperature(i, modes[i], cfg.loss.mode_options(modes[i]), field="loss.temperature")


def stream_reads_a_store(cfg: TrainConfig) -> None:
    """data.stream fetches shard files from an object store as the reader reaches them: not a
    local directory, and not beside a teacher cache (joined to every shard row at start)."""
    if not cfg.data.stream:
        return
    if "://" not in str(cfg.data.shards):
        fail("data.stream", f"data.shards={cfg.data.shards} is local; streaming reads shards "
             "from an object store (s3://...): set data.stream=false")  # fmt: skip
    if any(t.cache for t in cfg.teachers):
        fail("data.stream", "a teacher cache (teachers[i].cache) is joined to every shard row "
             "before the run starts: fetch the shards whole (data.stream=false)")  # fmt: skip


def packing_fits_the_run(cfg: TrainConfig) -> None:
    """Packed rows (data.packing) are built for live teachers at cp = 1: a teacher cache holds
    outputs of unpacked rows, and CP's load-balanced layout would cut across documents.
    On-policy rollouts pack in every mode (`trainer.onpolicy.packed_rollouts`)."""
    if not cfg.data.packing:
        return
    for i, t in enumerate(cfg.teachers):
        if t.cache:
            fail(f"teachers[{i}].cache", "a teacher cache holds unpacked rows' outputs; it "
                 "cannot serve packed rows (data.packing=false, or a live teacher)")  # fmt: skip
    if cfg.parallel.cp > 1:
        fail("data.packing", f"packed rows under context parallelism (parallel.cp="
             f"{cfg.parallel.cp}) are not supported: set data.packing=false or cp=1")  # fmt: skip


def warmup_within_steps(cfg: TrainConfig) -> None:
    if cfg.optim.warmup_steps > cfg.steps:
        fail("optim.warmup_steps", f"{cfg.optim.warmup_steps} > steps={cfg.steps}")


# in the order they run: the first broken rule is the one reported
CONFIG_RULES = (
    loss_needs_teachers,
    offpolicy_modes_read_shards,  # before the options: "opd_pg is on-policy" says more
    loss_options_fit_every_mode,
    cp_splits_the_padding,
    onpolicy_fits_the_teachers,
    kd_topk_reads_the_teachers_support,
    caches_serve_their_modes,
    served_teachers_serve_their_modes,
    stream_reads_a_store,
    packing_fits_the_run,
    warmup_within_steps,
)


def check_config(cfg: TrainConfig) -> None:
    """Every rule that needs the config alone (`TrainConfig.__post_init__` runs this)."""
    for rule in CONFIG_RULES:
        rule(cfg)


# --- the config and the number of processes -------------------------------------------------


def check_world(cfg: TrainConfig, *, world_size: int) -> None:
    """The student's mesh multiplies to the world; each teacher's TP group divides it."""
    cfg.parallel.mesh_shape(world_size)
    for i, t in enumerate(cfg.teachers):
        if t.tp > 1 and world_size % t.tp:
            fail(f"teachers[{i}].tp", f"{t.tp} does not divide the world size {world_size}")


# --- the config and its tokenizers ----------------------------------------------------------


def check_mode_pair(
    mode: str, *, index: int, same: bool, teacher: str, projection: str | None, onpolicy: bool
) -> None:
    """Teacher `index`'s loss `mode` against its tokenizer pair: a same-tokenizer mode needs the
    student's tokenizer (``same``), a projection mode its projection file. ``onpolicy``: the
    mode is the teacher's on-policy one (``onpolicy.loss`` / ``onpolicy.teacher_losses``)."""
    modes = registry().MODES
    record = modes[mode]
    if record.same_tokenizer and not same:
        others = [
            m
            for m, r in modes.items()
            if r.distills and not r.same_tokenizer and (onpolicy or not r.onpolicy_only)
        ]
        where = f"onpolicy.teacher_losses[{index}]" if onpolicy else f"teachers[{index}]"
        what = mode if onpolicy else f"loss {mode}"
        fail(
            where,
            f"{what} needs the student's tokenizer, but teacher {teacher} has another "
            f"vocabulary; use one of {others}",
        )
    if record.projection and not projection:
        what = f"{'on-policy' if onpolicy else 'loss'} {mode}"
        fail(
            f"teachers[{index}].projection",
            f"{what} needs a projection file (make projection TEACHER=... STUDENT=...)",
        )


def check_tokenizers(cfg: TrainConfig, student: Tokenizer, teachers: Sequence[Tokenizer]) -> None:
    """The teachers' modes against their tokenizers (the preflight runs this once they load):
    the on-policy modes and mixture first, then the off-policy modes when KD is on."""
    same = [tok.fingerprint == student.fingerprint for tok in teachers]
    op = cfg.onpolicy
    if op.enabled:
        for i, (mode, tok, t) in enumerate(zip(op.modes(len(teachers)), teachers, cfg.teachers)):
            pair = {"same": same[i], "teacher": tok.name, "projection": t.projection}
            check_mode_pair(mode, index=i, onpolicy=True, **pair)
            if op.mix == "mixture" and not same[i]:
                fail(
                    "onpolicy.mix",
                    "a probability-space mixture needs teachers with the student's tokenizer; "
                    f"teacher {tok.name} has another (use mix=sum)",
                )
    if cfg.kd_enabled:
        for i, (mode, tok, t) in enumerate(zip(cfg.teacher_modes(), teachers, cfg.teachers)):
            pair = {"same": same[i], "teacher": tok.name, "projection": t.projection}
            check_mode_pair(mode, index=i, onpolicy=False, **pair)
