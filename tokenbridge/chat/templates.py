"""Chat templates: where each model's comes from, the ones we ship, and the one rendering call.

Every tokenizer renders with its own template, found next to it (``chat_template.jinja``,
``tokenizer_config.json``, a GGUF's metadata) or named by the user (a jinja file or `SHIPPED`);
there is no fallback guess. Rendering goes through transformers' compiled template, so it equals
``apply_chat_template(..., tokenize=False)`` (tested).
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

SHIPPED = ("chatml", "gemma", "llama3", "plain")
_SHIPPED_DIR = Path(__file__).resolve().parent / "templates"
GGUF_TEMPLATE_KEY = "tokenizer.chat_template"
TEMPLATE_FILE = "chat_template.jinja"


class TemplateNotFoundError(ValueError):
    """No template for a model, or a named template that does not exist."""


@dataclass(frozen=True)
class ChatTemplate:
    name: str  # shipped name, file name, or "<model dir name>"
    source: str  # "shipped" | "file" | "chat_template.jinja" | "tokenizer_config.json" | "gguf"
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def to_json(self) -> dict:
        """What stats.json records per side."""
        return {"name": self.name, "source": self.source, "sha256": self.sha256}


# GGUF value types (the GGUF spec): fixed sizes, 8 = string, 9 = array
_GGUF_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_skip(buf: memoryview, pos: int, vtype: int) -> int:
    """Position after one value of `vtype` at `pos`."""
    if vtype in _GGUF_SIZES:
        return pos + _GGUF_SIZES[vtype]
    if vtype == _GGUF_STRING:
        return pos + 8 + struct.unpack_from("<Q", buf, pos)[0]
    if vtype == _GGUF_ARRAY:
        etype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype in _GGUF_SIZES:
            return pos + count * _GGUF_SIZES[etype]
        for _ in range(count):
            pos = _gguf_skip(buf, pos, etype)
        return pos
    raise ValueError(f"GGUF value type {vtype} unknown")


def gguf_chat_template(path: str | Path) -> str | None:
    """The ``tokenizer.chat_template`` metadata string of a GGUF file, or None.

    Reads the key/value header only (gguf's GGUFReader also parses every array and tensor
    description, ~10 s per vocabulary file here; this takes well under a second), once per
    file version.
    """
    st = os.stat(path)
    return _gguf_template(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=32)
def _gguf_template(path: str, _mtime: int, _size: int) -> str | None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        buf = memoryview(mm)
        try:
            if bytes(buf[:4]) != b"GGUF":
                raise ValueError(f"{path}: not a GGUF file")
            version, _n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
            if version < 2:
                raise ValueError(f"{path}: GGUF version {version} is not supported")
            pos = 24
            for _ in range(n_kv):
                (klen,) = struct.unpack_from("<Q", buf, pos)
                key = bytes(buf[pos + 8 : pos + 8 + klen]).decode("utf-8")
                pos += 8 + klen
                (vtype,) = struct.unpack_from("<I", buf, pos)
                pos += 4
                if key == GGUF_TEMPLATE_KEY:
                    if vtype != _GGUF_STRING:
                        raise ValueError(f"{path}: {key} has GGUF type {vtype}, not a string")
                    (n,) = struct.unpack_from("<Q", buf, pos)
                    return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8")
                pos = _gguf_skip(buf, pos, vtype)
            return None
        finally:
            buf.release()


def copy_gguf_template(gguf: str | Path, model_dir: str | Path) -> Path | None:
    """Give a converted model directory its GGUF's chat template (``chat_template.jinja``).

    Returns the file written (or already there and identical), None if the GGUF has none. A
    different template already in the directory is an error: which one is right is not ours to
    guess.
    """
    text = gguf_chat_template(gguf)
    if text is None:
        return None
    target = Path(model_dir) / TEMPLATE_FILE
    if target.exists():
        if target.read_text(encoding="utf-8") != text:
            raise ValueError(f"{target} differs from the chat template in {gguf}")
        return target
    target.write_text(text, encoding="utf-8")
    return target


def _from_config(config: Path) -> str | None:
    value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise TemplateNotFoundError(
            f"{config}: chat_template lists {sorted(map(str, named))} but no 'default'; name one "
            "with the chat-template option (a .jinja file)"
        )
    raise TemplateNotFoundError(f"{config}: chat_template is {type(value).__name__}")


def model_template(model: str | Path) -> ChatTemplate | None:
    """The template a tokenizer's model ships (directory, tokenizer.json or .gguf), or None."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        text = gguf_chat_template(path)
        return None if text is None else ChatTemplate(path.stem, "gguf", text)
    directory = path if path.is_dir() else path.parent
    if (directory / TEMPLATE_FILE).is_file():
        text = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
        return ChatTemplate(directory.name, TEMPLATE_FILE, text)
    if (directory / "tokenizer_config.json").is_file():
        text = _from_config(directory / "tokenizer_config.json")
        if text is not None:
            return ChatTemplate(directory.name, "tokenizer_config.json", text)
    ggufs = sorted(directory.glob("*.gguf")) if path.is_dir() else []
    if len(ggufs) == 1:
        return model_template(ggufs[0])
    return None


def shipped_template(name: str) -> ChatTemplate:
    if name not in SHIPPED:
        raise TemplateNotFoundError(f"no shipped chat template {name!r}; shipped: {SHIPPED}")
    text = (_SHIPPED_DIR / f"{name}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(name, "shipped", text)


def named_template(name: str | Path) -> ChatTemplate:
    """A template the user names: a shipped name, or a path to a jinja file."""
    if str(name) in SHIPPED:
        return shipped_template(str(name))
    path = Path(name)
    if path.is_file():
        return ChatTemplate(path.name, "file", path.read_text(encoding="utf-8"))
    raise TemplateNotFoundError(
        f"chat template {str(name)!r} is neither a file nor a shipped template {SHIPPED}"
    )


def resolve_template(model: str | Path, *, override: str | Path | None = None) -> ChatTemplate:
    """The template a side renders with: the one the user names, else the model's own."""
    if override is not None:
        return named_template(override)
    found = model_template(model)
    if found is None:
        raise TemplateNotFoundError(
            f"{model}: no chat template (looked for {TEMPLATE_FILE}, tokenizer_config.json "
            f"'chat_template' and GGUF '{GGUF_TEMPLATE_KEY}'). Name one for this model: a .jinja "
            f"file, or one of the shipped templates {', '.join(SHIPPED)}"
        )
    return found


def render(template: ChatTemplate, messages: list[dict], *, bos_token: str, eos_token: str) -> str:
    """One conversation through transformers' compiled chat template, called as its
    `render_jinja_template` / `apply_chat_template` call it (no generation prompt: the
    conversation is complete). Their input sanitising is skipped: our messages are already
    plain dicts of strings. Raises whatever the template raises."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template.text).render(
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=False,
        bos_token=bos_token,
        eos_token=eos_token,
    )


# nodes that capture, filter or re-route output: content written inside them may be transformed
_CAPTURING = ("AssignBlock", "FilterBlock", "Macro", "CallBlock")


@functools.lru_cache(maxsize=64)
def _transparent(text: str) -> bool:
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    tree = _compile_jinja_template(text).environment.parse(text)
    parent: dict[int, nodes.Node] = {}
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in node.iter_child_nodes():
            parent[id(child)] = node
            stack.append(child)
    if any(tree.find_all(tuple(getattr(nodes, n) for n in _CAPTURING))):
        return False
    reads = set()
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        if isinstance(node, nodes.Getattr):
            if node.attr == "content":
                reads.add(id(node))
            continue
        if isinstance(node.arg, nodes.Const):
            if node.arg.value == "content":
                reads.add(id(node))
        elif not (isinstance(node.node, nodes.Name) and node.node.name == "messages"):
            return False  # a dict read by a computed key: it could be the content
    for const in tree.find_all(nodes.Const):
        # 'content' anywhere but as the key of a read (`.get('content')`, attribute='content')
        if const.value == "content" and id(parent.get(id(const))) not in reads:
            return False
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        if id(node) not in reads:
            continue
        up = parent.get(id(node))
        while isinstance(up, nodes.Add | nodes.Concat):
            up = parent.get(id(up))
        if not isinstance(up, nodes.Output):
            return False
    return True


def content_transparent(template: ChatTemplate) -> bool:
    """True when the template can only *write* message contents, never look at them.

    Checked on the template's syntax tree: every read of a message's ``content`` flows through
    ``+`` / ``~`` straight into the output (no filter, test, condition, slice, method, variable
    or captured block); no dict is read by a computed key; the string 'content' appears
    nowhere else. Then the rendering with marked contents, markers removed, *is* the real
    rendering, and one render per conversation is enough (`tokenbridge.chat.render`). Templates
    that look at contents (Gemma's official ``| trim``, ``is string`` tests) are rendered twice
    and compared. Conservative: a False only costs the second render.
    """
    return _transparent(template.text)
