"""Where on-policy prompts come from: raw-text shards, or conversations rendered per template.

A prompt is what the student continues: its own token ids (the truth the sampled ids extend),
where it came from, and what a teacher needs to render it in its own form. Both sources sit
behind one interface (`PromptSource`) and are resumable: their whole position is a small dict
saved per rank in checkpoints (docs/onpolicy.md, "A step", 1).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tokenbridge.chat import rows as chat_rows
from tokenbridge.chat.align import ChatSide, prepare_side
from tokenbridge.chat.encode import encode_renderings
from tokenbridge.chat.render import Rendering
from tokenbridge.chat.templates import resolve_template
from tokenbridge.tokenizers import Tokenizer
from trainer.data.shard_reader import ShardReader, ShardStream, held_out_set

if TYPE_CHECKING:
    from trainer.config.sections import DataConfig


@dataclass(frozen=True)
class Prompt:
    """One prompt. ``ids`` are the student's (BOS or template scaffolding included)."""

    ids: tuple[int, ...]
    key: str  # provenance: "<doc id>/<window>" or "<conversation id>#<turn>"
    draw: int = 0  # how many times this prompt was drawn before (its epoch): seeds sampling
    reference: tuple[int, ...] = ()  # the dataset's own continuation (student ids)
    messages: tuple[dict, ...] | None = None  # chat: the conversation before the answer


class PromptSource(Protocol):
    """What the on-policy step draws prompts from (one instance per rank)."""

    def next_prompts(self, n: int) -> list[Prompt]: ...

    def held_out(self, n: int) -> list[Prompt]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class TextPrompts:
    """Prefixes of the training windows of this rank (raw-text shards from `make align`).

    The first ``prompt_tokens`` student ids of a window are the prompt ("continue this text");
    the rest of the window is the dataset's own continuation (``reference``). Rows are split
    exactly like the trainer's windows (`ShardStream`), so the held-out prompts are the
    prefixes of the held-out windows the BPB eval reads."""

    def __init__(
        self,
        reader: ShardReader,
        *,
        data: DataConfig,
        prompt_tokens: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        """``data`` (shuffle buffer, held-out split), the rank and ``seed``: `ShardStream`'s,
        which deals this rank its rows exactly as the trainer's windows."""
        if prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {prompt_tokens}")
        self.reader, self.prompt_tokens = reader, prompt_tokens
        self.stream = ShardStream(reader, data=data, dp_rank=dp_rank, dp_size=dp_size, seed=seed)

    def prompt(self, row: int, *, draw: int = 0) -> Prompt:
        r = self.reader.row(row)
        ids = [int(x) for x in r["student_ids"]]
        # a prompt keeps at least one token, and leaves the window at least one as reference
        p = max(1, min(self.prompt_tokens, len(ids) - 1))
        f, i = self.reader.locate(row)
        table = self.reader.tables[f]
        key = f"{table.column('doc_id')[i].as_py()}/{table.column('window')[i].as_py()}"
        return Prompt(tuple(ids[:p]), key, draw, tuple(ids[p:]))

    def next_prompts(self, n: int) -> list[Prompt]:
        out = []
        for _ in range(n):
            epoch = self.stream.epoch  # the epoch the row is drawn in (before the cursor wraps)
            out.append(self.prompt(self.stream.next_row(), draw=epoch))
        return out

    def held_out(self, n: int) -> list[Prompt]:
        return [self.prompt(int(r)) for r in self.stream.eval_rows[:n]]

    def state_dict(self) -> dict:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.stream.load_state_dict(state)


def render_prompt(side: ChatSide, messages: list[dict]) -> Rendering | None:
    """The conversation rendered by ``side``'s template with its generation prompt (the text
    the model continues), with every content located; None if the template refuses it."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    conv = chat_rows.Conversation(
        tuple(chat_rows.Message(m["role"], m["content"], False) for m in messages)
    )
    closed = side.render(conv)  # content spans, checked as the align job checks them
    if isinstance(closed, chat_rows.DeadLetter):
        return None
    text = _compile_jinja_template(side.template.text).render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=True,
        bos_token=side.bos_token,
        eos_token=side.eos_token,
    )
    # templates write the generation prompt after the conversation: the spans stay valid
    if not text.startswith(closed.text):
        return None
    return Rendering(text, closed.spans)


class ChatPrompts:
    """One prompt per assistant turn of ``messages`` rows (as the chat align job reads them).

    The prompt is the conversation before the turn, rendered with the student's chat template
    and its generation prompt, its control tokens split out as ids; the turn's own content is
    the reference. Each teacher renders the same messages with its own template
    (`trainer.onpolicy.rollouts`). Held-out conversations by a hash of their id."""

    def __init__(
        self,
        path: str | Path,
        tokenizer: Tokenizer,
        *,
        data: DataConfig,
        model_dir: str | Path,
        template: str | None,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ):
        """``data``: the held-out split (by conversation) and ``max_student_tokens``."""
        eval_fraction, val_fraction = data.eval_fraction, data.val_fraction
        self.max_tokens = data.max_student_tokens  # a longer rendered prompt is skipped
        self.side = prepare_side(tokenizer, resolve_template(model_dir, override=template))
        train: list[tuple[str, tuple[dict, ...], str]] = []
        held: list[tuple[str, tuple[dict, ...], str]] = []
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        seen: set[str] = set()
        for n, line in enumerate(lines):
            if not line.strip():
                continue
            row = json.loads(line)
            conv = chat_rows.parse_row(row, fmt=chat_rows.MESSAGES)
            if isinstance(conv, chat_rows.DeadLetter):
                continue  # the align job reports these; a prompt source just skips them
            cid = str(row.get("id", n))
            if cid in seen:  # a repeated id: the line number keeps keys (and seeds) apart
                cid = f"{cid}@{n + 1}"
            seen.add(cid)
            msgs = tuple(m.as_dict() for m in conv.messages)
            for t, m in enumerate(conv.messages):
                if m.role == "assistant" and t > 0:
                    # by conversation, as the shards' document split (no turn of a held-out
                    # conversation is trained on); the other held-out set is simply unused
                    which = held_out_set(
                        cid, 0, eval_fraction, by="document", val_fraction=val_fraction
                    )
                    if which is None or which == data.eval_on:
                        (train if which is None else held).append(
                            (f"{cid}#{t}", msgs[:t], m.content)
                        )
        self.train, self.held = train[dp_rank::dp_size], held
        if not self.train:
            raise ValueError(f"{path}: no assistant turn left for data-parallel rank {dp_rank}")
        self.tokenizer = tokenizer
        self.rng = random.Random(f"{seed}/{dp_rank}")
        self.epoch, self.cursor = 0, 0
        self.order = self._shuffled()

    def _shuffled(self) -> list[int]:
        order = list(range(len(self.train)))
        self.rng.shuffle(order)
        return order

    def prompt(self, item: tuple[str, tuple[dict, ...], str], draw: int = 0) -> Prompt | None:
        key, messages, answer = item
        rendering = render_prompt(self.side, list(messages))
        if rendering is None:
            return None
        enc = encode_renderings(self.tokenizer, self.side.matcher, [rendering])
        if len(enc.ids) > self.max_tokens:
            return None
        ref = self.tokenizer.encode(answer).ids
        return Prompt(tuple(map(int, enc.ids)), key, draw, tuple(map(int, ref)), messages)

    def next_prompts(self, n: int) -> list[Prompt]:
        out: list[Prompt] = []
        misses = 0
        while len(out) < n:
            if self.cursor == len(self.order):
                self.epoch, self.cursor, self.order = self.epoch + 1, 0, self._shuffled()
            p = self.prompt(self.train[self.order[self.cursor]], self.epoch)
            self.cursor += 1
            misses = 0 if p is not None else misses + 1
            if misses > len(self.train):
                raise ValueError("the student's chat template renders none of the prompts")
            if p is not None:
                out.append(p)
        return out

    def held_out(self, n: int) -> list[Prompt]:
        found = (self.prompt(item) for item in self.held)
        return [p for p in found if p is not None][:n]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor, "rng": self.rng.getstate(),
                "order": np.asarray(self.order).tolist()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self.rng.setstate(state["rng"])
        self.order = [int(i) for i in state["order"]]
