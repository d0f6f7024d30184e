"""The align job on conversations vs the same contents as raw text, in one run (issue 12).

The conversations are the shipped examples, copied, with bad rows mixed in so the dead-letter
path is timed too; the baseline is a text job over the same contents, one document per
conversation.
"""

from __future__ import annotations

import json
import os
import time

from bench.child import run_child
from bench.provenance import cpu_model
from tokenbridge import paths

# the code these figures depend on (`bench.provenance.measured_paths`): a later change
# to any of it marks the kept section stale
MEASURES = (
    "pipelines/align",
    "pipelines/plumbing",
    "tokenbridge/chat",
    "tokenbridge/alignment",
    "tokenbridge/tokenizers",
    "tokenbridge/formats",
    "bench/align/chat.py",
    "bench/child.py",
)


COPIES = 8
REPEATS = 3
BAD_EVERY = 100  # one bad row per this many, in the file's row format, cycling through BAD
BAD = {  # per row format: unknown role, empty reply, nothing to train, a tool turn Gemma refuses
    "messages": [
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " "}]},
        {"messages": [{"role": "user", "content": "Hi"}]},
        {"messages": [{"role": "user", "content": "A"}, {"role": "tool", "content": "B"},
                      {"role": "assistant", "content": "C"}]},
    ],
    "prompt_completion": [
        {"prompt": [{"role": "robot", "content": "x"}], "completion": "y"},
        {"prompt": "Hi", "completion": " "},
        {"prompt": "Hi", "completion": []},
        {"prompt": [{"role": "user", "content": "A"}, {"role": "tool", "content": "B"}],
         "completion": "C"},
    ],
}  # fmt: skip


def _as_messages(row: dict) -> list[dict]:
    if "messages" in row:
        return row["messages"]
    return [
        *([{"role": "user", "content": row["prompt"]}] if isinstance(row["prompt"], str)
          else row["prompt"]),
        *([{"role": "assistant", "content": row["completion"]}]
          if isinstance(row["completion"], str) else row["completion"]),
    ]  # fmt: skip


def make_data(root) -> dict:
    """Write chat/*.jsonl and text/contents.jsonl under `root`; returns their sizes."""
    from tokenbridge.commands import chat_example

    (root / "chat").mkdir(parents=True, exist_ok=True)
    (root / "text").mkdir(parents=True, exist_ok=True)
    text_lines, n_conv, n_bad = [], 0, 0
    for name in (chat_example.MESSAGES_FILE, chat_example.PROMPT_COMPLETION_FILE):
        rows = [json.loads(x) for x in (chat_example.DATA_DIR / name).read_text().splitlines()]
        out = []
        for k in range(COPIES):
            for r in rows:
                r = json.loads(json.dumps(r))
                # each copy's first user turn numbered: no two rows are equal
                first = r["messages"] if "messages" in r else r["prompt"]
                if isinstance(first, str):
                    r["prompt"] = f"[{k}] {first}"
                else:
                    user = next(m for m in first if m["role"] == "user")
                    user["content"] = f"[{k}] {user['content']}"
                out.append(json.dumps(r, ensure_ascii=False))
                text = "\n".join(m["content"] for m in _as_messages(r))
                text_lines.append(json.dumps({"text": text}, ensure_ascii=False))
                n_conv += 1
                if n_conv % BAD_EVERY == 0:
                    bad = BAD["messages" if "messages" in r else "prompt_completion"]
                    out.append(json.dumps(bad[n_bad % len(bad)]))
                    n_bad += 1
        (root / "chat" / name).write_text("\n".join(out) + "\n", encoding="utf-8")
    (root / "text" / "contents.jsonl").write_text("\n".join(text_lines) + "\n", encoding="utf-8")
    return {
        "conversations": n_conv,
        "bad_rows": n_bad,
        "chat_bytes": sum(p.stat().st_size for p in (root / "chat").iterdir()),
        "text_bytes": (root / "text" / "contents.jsonl").stat().st_size,
    }


def _outside(root: str, t_dir: str, s_dir: str) -> dict:
    """Seconds of the conversation path's pure steps on the messages file, outside Beam."""
    from pipelines.align import align_dofns
    from pipelines.align.chat_read import Row, read_rows
    from tokenbridge.chat import rows
    from tokenbridge.chat.align import align_conversations, prepare_side
    from tokenbridge.chat.templates import resolve_template

    student = prepare_side(align_dofns.cached_tokenizer(s_dir), resolve_template(s_dir))
    teacher = prepare_side(
        align_dofns.cached_tokenizer(t_dir), resolve_template(t_dir, override="gemma")
    )
    path = f"{root}/chat/shakespeare_messages.jsonl"
    convs = [rows.parse_row(r.value, fmt=r.fmt) for r in read_rows(path, "m", row_format=None)
             if isinstance(r, Row)]  # fmt: skip
    convs = [c for c in convs if isinstance(c, rows.Conversation)]
    align_conversations(convs[:8], student=student, teachers=[teacher], train_on="assistant")
    t0 = time.perf_counter()
    for c in convs:
        student.render(c), teacher.render(c)
    t1 = time.perf_counter()
    for i in range(0, len(convs), 512):
        align_conversations(convs[i : i + 512], student=student, teachers=[teacher],
                            train_on="assistant")  # fmt: skip
    t2 = time.perf_counter()
    texts = ["\n".join(m.content for m in c.messages) for c in convs]
    student.tokenizer.encode_batch(texts), teacher.tokenizer.encode_batch(texts)
    t3 = time.perf_counter()
    return {"conversations": len(convs), "render": t1 - t0, "align_conversations": t2 - t1,
            "tokenize_contents": t3 - t2}  # fmt: skip


def _child(kind: str, root: str) -> dict:
    from pipelines.align import align_dofns, job

    t_dir, s_dir = str(paths.teacher_dir()), str(paths.student_dir())
    align_dofns.cached_tokenizer(t_dir), align_dofns.cached_tokenizer(s_dir)
    out = f"{root}/out_{kind}"
    argv = ["--data", f"{root}/{kind}/*.jsonl", "--teacher", t_dir, "--student", s_dir]
    argv += ["--out", out, "--overwrite", "--direct_num_workers", "1"]
    argv += ["--max-student-tokens", "512", "--max-teacher-tokens", "512"]
    if kind == "chat":
        argv += ["--teacher-chat-template", "gemma"]
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0, c0 = time.perf_counter(), cpu()
    stats = job.run(argv)
    return {
        "job_s": time.perf_counter() - t0,
        "cpu_s": cpu() - c0,
        "documents": stats["documents"],
        "windows": stats["windows"],
        "tokens": stats["tokens"],
        "drops_by_reason": stats["drops_by_reason"],
        "chat": {k: stats["chat"][k] for k in ("trained_tokens", "eot_pairs", "loose_tokens")}
        if "chat" in stats
        else None,
        "outside": _outside(root, t_dir, s_dir) if kind == "chat" else None,
    }


def _run(kind: str, root) -> dict:
    return run_child("bench.align.chat", kind, str(root))


def main() -> str:
    root = paths.REPO_ROOT / "outputs" / "bench" / "align_chat"
    sizes = make_data(root)
    runs = []
    for _ in range(REPEATS):
        runs += [("text", _run("text", root)), ("chat", _run("chat", root))]
    best = {k: min(r["job_s"] for kk, r in runs if kk == k) for k in ("text", "chat")}
    best_cpu = {k: min(r["cpu_s"] for kk, r in runs if kk == k) for k in ("text", "chat")}
    chat = next(r for k, r in runs if k == "chat")
    text = next(r for k, r in runs if k == "text")
    lines = [
        "## Align job on conversations vs the same contents as raw text (issue 12)",
        "",
        f"{sizes['conversations']} conversations (the shipped examples x{COPIES}) + "
        f"{sizes['bad_rows']} bad rows: {sizes['chat_bytes'] / 1e6:.2f} MB of jsonl; the raw-text "
        f"baseline is the same contents, one document per conversation "
        f"({sizes['text_bytes'] / 1e6:.2f} MB). Gemma-3-270M (shipped `gemma` template) x "
        "SmolLM2-135M (its own), windows 512, FnApiRunner, 1 worker; tokenizer load not timed. "
        f"CPU: {cpu_model()}, {os.cpu_count()} cores (the load is in the provenance line above); "
        "the runs alternate.",
        "",
        "| run | job s (wall) | job CPU s | rows/s (wall) | student tokens | teacher tokens |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for k, r in runs:
        lines.append(
            f"| {'conversations' if k == 'chat' else 'raw text'} | {r['job_s']:.1f} | "
            f"{r['cpu_s']:.1f} | {r['documents'] / r['job_s']:.0f} | {r['tokens']['student']} | "
            f"{r['tokens']['teachers'][0]} |"
        )
    o = chat["outside"]
    lines += [
        "",
        f"Conversation / raw-text job CPU time (least of {REPEATS} each; the job runs in one "
        f"process): **{best_cpu['chat'] / best_cpu['text']:.2f}x** (goal <= 1.3x); wall time "
        f"(fastest of each, noisier on a shared machine): {best['chat'] / best['text']:.2f}x. Conversations also render each "
        "row with both templates, tokenize the scaffolding and pair the turn markers.",
        "",
        f"- conversations written {chat['documents']} (raw text: {text['documents']} documents, "
        f"{text['windows']} windows); trained student tokens {chat['chat']['trained_tokens']}, "
        f"end-of-turn pairs {chat['chat']['eot_pairs']}, loose content tokens "
        f"{chat['chat']['loose_tokens']}",
        f"- dead letters by reason: {chat['drops_by_reason']} (raw text: "
        f"{text['drops_by_reason'] or 'none'})",
        f"- outside Beam, {o['conversations']} conversations of the messages file: "
        f"`align_conversations` {o['align_conversations']:.2f} s, of which rendering with both "
        f"templates (transformers' jinja call, once per side: the templates are content-"
        f"transparent) {o['render']:.2f} s; tokenizing the contents alone (both tokenizers) "
        f"{o['tokenize_contents']:.2f} s. The renderings also carry the scaffolding (SmolLM2's "
        "injected system text, headers): more tokens per row than the contents (table).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(main())
