"""What a checkpoint holds, as tensors and JSON: nothing in it is a pickle.

DCP stores any non-tensor value by pickling it, and unpickling runs whatever code the file
names, so the state is taken apart before DCP sees it: `split` gives each tensor (and numpy
array) to DCP under the path of keys that leads to it and makes everything else one JSON
document in which a tensor is a reference to its key; `join` puts the loaded tensors back.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

# JSON has no tuples, bytes or non-string keys: they are tagged ({"$tuple": [...]},
# {"$bytes": "<base64>"}, {"$dict": [[key, value], ...]}) so that each value comes back as the
# type it was (`random.setstate` wants its tuples); any other type is refused when written
TENSOR, NDARRAY, TUPLE, BYTES, DICT = "$tensor", "$ndarray", "$tuple", "$bytes", "$dict"
SEP = "/"  # between the keys of a tensor's path (model FQNs hold dots)


def split(state: Any, prefix: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` -> (its JSON document, {key: tensor}); a numpy array travels as a tensor."""
    tensors: dict[str, torch.Tensor] = {}

    def enc(x: Any, path: str) -> Any:
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, (torch.Tensor, np.ndarray)):
            if path in tensors:
                raise ValueError(f"checkpoint state: two tensors under the key {path!r}")
            tag = TENSOR if isinstance(x, torch.Tensor) else NDARRAY
            t = x if tag == TENSOR else torch.from_numpy(np.ascontiguousarray(x))
            tensors[path] = t
            ref = {tag: path, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
            if tag == TENSOR and t.device.type != "cpu":
                ref["device"] = t.device.type
            return ref
        if isinstance(x, (list, tuple)):
            items = [enc(v, _child(path, i)) for i, v in enumerate(x)]
            return {TUPLE: items} if isinstance(x, tuple) else items
        if isinstance(x, bytes):
            return {BYTES: base64.b64encode(x).decode("ascii")}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: enc(v, _child(path, k)) for k, v in x.items()}
            return {DICT: [[enc(k, _child(path, "key")), enc(v, _child(path, k))]
                           for k, v in x.items()]}  # fmt: skip
        raise TypeError(
            f"checkpoint state {path or '<root>'}: a {type(x).__name__} is neither a tensor nor a "
            "JSON value (convert it in the state_dict that returns it)"
        )

    return enc(state, prefix), tensors


def _child(path: str, key: Any) -> str:
    return f"{path}{SEP}{key}" if path else str(key)


def refs(doc: Any) -> dict[str, dict]:
    """Every tensor reference in a document: {key: {"$tensor" or "$ndarray": key, dtype, shape}}."""
    out: dict[str, dict] = {}

    def walk(x: Any) -> None:
        if isinstance(x, dict):
            tag = _tag(x)
            if tag in (TENSOR, NDARRAY):
                out[x[tag]] = x
            elif tag == DICT:
                for pair in x[DICT]:
                    walk(pair)
            elif tag is None:
                for v in x.values():
                    walk(v)
            elif tag == TUPLE:
                walk(x[TUPLE])
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(doc)
    return out


def destinations(doc: Any, live: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Where DCP loads each tensor the document references: the live tensor under the same
    key when it has the saved dtype and shape (the sharded student and optimizer, loaded in
    place), else a new one of the saved dtype and shape (an RNG state, pending rollouts)."""
    out = {}
    for key, ref in refs(doc).items():
        dtype, shape = _dtype(ref), [int(n) for n in ref["shape"]]
        t = live.get(key)
        if t is None or t.dtype != dtype or list(t.shape) != shape:
            t = torch.empty(shape, dtype=dtype)
        out[key] = t
    return out


def join(doc: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The state `split` took apart, with ``tensors`` (loaded) in their places."""

    def dec(x: Any) -> Any:
        if isinstance(x, list):
            return [dec(v) for v in x]
        if not isinstance(x, dict):
            return x
        tag = _tag(x)
        if tag is None:
            return {k: dec(v) for k, v in x.items()}
        if tag == TUPLE:
            return tuple(dec(v) for v in x[TUPLE])
        if tag == BYTES:
            return base64.b64decode(x[BYTES], validate=True)
        if tag == DICT:
            return {dec(k): dec(v) for k, v in x[DICT]}
        t = tensors[x[tag]]
        if tag == NDARRAY:
            return t.numpy()
        if "device" in x and torch.device(x["device"]).type != t.device.type:
            t = t.to(x["device"])
        return t

    return dec(doc)


def _tag(x: dict) -> str | None:
    """The tag of a tagged value (None for a plain dict); a ``$`` key we never write is refused."""
    tags = [k for k in x if k.startswith("$")]
    if not tags:
        return None
    if len(tags) > 1 or tags[0] not in (TENSOR, NDARRAY, TUPLE, BYTES, DICT):
        raise ValueError(f"checkpoint state: unknown tagged value with keys {sorted(x)[:4]}")
    return tags[0]


def _dtype(ref: dict) -> torch.dtype:
    dtype = getattr(torch, str(ref.get("dtype")), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"checkpoint state: tensor {ref.get(TENSOR)!r}: no dtype {ref.get('dtype')!r}"
        )
    return dtype
