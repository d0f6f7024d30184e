"""A model's random init, recorded while it is built on the meta device and replayed shard by shard.

`tokenbridge.models.build_model` draws a random init under a forked RNG seeded by the model's
seed, the constructors' default inits interleaved with transformers' ``_init_weights`` (the base
model's ``post_init`` runs before the lm_head is even built). A sharded build must give each rank
its part of those very numbers without holding the whole model: `record_build` records every op
that writes a parameter, and `InitLog.replay` runs them again in order, under the same RNG, each
rank keeping only its box (docs/parallelism.md, "Built on the meta device, loaded by shards").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from tokenbridge.weight_slices import ShardTarget

aten = torch.ops.aten

# whole writes that read nothing of the tensor they write (besides the random draws)
_OVERWRITES = {aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default, aten.copy_.default}
# draws known to give the same numbers in row blocks on the CPU: torch's CPU kernels draw element
# by element (normal_ transforms blocks of 16 and redraws the last 16 of an uneven tail), so
# blocks of a multiple of 16 elements, the last at least 16, give one whole draw's numbers (a test
# checks it) and no rank ever holds a whole large weight. On a GPU a draw covers its whole tensor,
# on the device: its RNG's offsets depend on the tensor's size.
_BLOCK_DRAWS = {aten.normal_.default, aten.uniform_.default}
# ops a block of rows may run on its own after its draw (elementwise, scalar arguments)
_ELEMENTWISE = {
    aten.fill_.Scalar,
    aten.zero_.default,
    aten.mul_.Scalar,
    aten.add_.Scalar,
    aten.sub_.Scalar,
    aten.div_.Scalar,
    aten.clamp_.default,
    aten.erfinv_.default,
}
BLOCK_ELEMS = 1 << 22  # elements per block of rows (16 MiB of float32)


class NotReplayableError(RuntimeError):
    """A model whose init cannot be recorded and replayed (named in the message)."""


class _Target:
    """Stands for the tensor an op writes, in a recorded op's arguments."""


TARGET = _Target()


@dataclass
class InitOp:
    """One recorded write of a parameter: ``func(view_of_param, *args[1:], **kwargs)``."""

    func: Any
    key: int  # the parameter, by its place in `InitLog.shapes`
    view: tuple | None  # (size, stride, storage offset) of the view written; None = all of it
    args: tuple
    kwargs: dict
    random: bool  # draws from the RNG: replayed in order, always

    @property
    def whole_write(self) -> bool:
        return self.view is None and (self.random or self.func in _OVERWRITES)


@dataclass
class InitLog:
    """What `record_build` saw: each parameter's shape and dtype, its value at creation when
    nothing overwrote it whole, the ops in order, and the model's names for each parameter."""

    seed: int
    device: torch.device
    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[torch.dtype] = field(default_factory=list)
    initial: dict[int, torch.Tensor] = field(default_factory=dict)
    ops: list[InitOp] = field(default_factory=list)
    names: dict[str, int] = field(default_factory=dict)

    def replay(self, targets: dict[str, ShardTarget]) -> None:
        """Fill every target (by parameter name) with its box of the recorded init: only a
        parameter's last whole write and what follows it are computed; every earlier draw still
        draws, into scratch (`_Replay._draw_away`), so the RNG stream stays the same."""
        keyed = {}
        for name, t in targets.items():
            if name not in self.names:
                raise KeyError(f"{name}: not a parameter of the recorded model")
            keyed[self.names[name]] = t
        _Replay(self, keyed).run()


class _Replay:
    def __init__(self, log: InitLog, targets: dict[int, ShardTarget]):
        self.log, self.targets = log, targets
        self.last_whole: dict[int, int] = {}
        self.last_op: dict[int, int] = {}
        for i, op in enumerate(log.ops):
            self.last_op[op.key] = i
            if op.whole_write:
                self.last_whole[op.key] = i
        self.cpu = log.device.type == "cpu"
        self.scratch: torch.Tensor | None = None

    @torch.no_grad()
    def run(self) -> None:
        dev = self.log.device
        forked = []
        if dev.type == "cuda":
            forked = [dev.index if dev.index is not None else torch.cuda.current_device()]
        temps: dict[int, torch.Tensor] = {}
        done: set[int] = set()
        with torch.random.fork_rng(devices=forked):
            torch.manual_seed(self.log.seed)
            for k in self.targets:
                if k not in self.last_whole:  # its value at creation, then its ops
                    temps[k] = self.log.initial[k].to(dev, copy=True)
            for i, op in enumerate(self.log.ops):
                k = op.key
                if k not in self.targets or i < self.last_whole.get(k, -1):
                    if op.random:
                        self._draw_away(op)
                    continue
                if k in done:
                    continue
                if i == self.last_whole.get(k) and self._in_blocks(k, i):
                    self._blocks(k, i)
                    done.add(k)
                    continue
                if i == self.last_whole.get(k):
                    temps[k] = torch.empty(self.log.shapes[k], dtype=self.log.dtypes[k], device=dev)
                _apply(op, temps[k])
                if i == self.last_op[k]:
                    self.targets[k].take_rows(temps.pop(k), 0)
                    done.add(k)
            for k, t in temps.items():  # never written after creation
                self.targets[k].take_rows(t, 0)
                done.add(k)
        if missing := set(self.targets) - done:
            raise NotReplayableError(f"parameters {sorted(missing)} were never initialised")

    def _later_ops(self, k: int, i: int) -> list[InitOp]:
        return [op for op in self.log.ops[i + 1 : self.last_op[k] + 1] if op.key == k]

    def _in_blocks(self, k: int, i: int) -> bool:
        """Can parameter k's last whole write (op i) and what follows run a block of rows at a
        time? A CPU draw known to be exact in blocks (or a fill), then elementwise ops or fills
        of small views."""
        op = self.log.ops[i]
        shape = self.log.shapes[k]
        if not self.cpu or not shape or op.func not in _BLOCK_DRAWS | {aten.fill_.Scalar}:
            return False
        for later in self._later_ops(k, i):
            if later.random or later.func not in _ELEMENTWISE:
                return False
            if later.view is not None and _numel(later.view[0]) > BLOCK_ELEMS:
                return False
        return True

    def _row_blocks(self, shape: tuple[int, ...]) -> list[tuple[int, int]]:
        """Rows [a, b) of each block: a multiple of 16 elements each, the last at least 16."""
        rows, row = shape[0], _numel(shape[1:])
        step = 16 // _gcd(row, 16)  # rows whose elements make a multiple of 16
        per = max(step, (BLOCK_ELEMS // max(row, 1)) // step * step)
        bounds = list(range(0, rows, per)) + [rows]
        if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * row < 16:
            bounds.pop(-2)
        return list(zip(bounds, bounds[1:]))

    def _scratch(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        if self.scratch is None or self.scratch.numel() < nbytes:
            self.scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.log.device)
        return self.scratch[:nbytes].view(dtype)

    def _blocks(self, k: int, i: int) -> None:
        shape, dtype = self.log.shapes[k], self.log.dtypes[k]
        later = self._later_ops(k, i)
        row = _numel(shape[1:])
        for a, b in self._row_blocks(shape):
            block = self._scratch((b - a) * row, dtype).view(b - a, *shape[1:])
            _apply(self.log.ops[i], block)
            for op in later:
                if op.view is None:
                    _apply(op, block)
                else:  # a small view (a padding row): the part of it in this block
                    flat = _flat_index(op.view) - a * row
                    inside = flat[(flat >= 0) & (flat < (b - a) * row)]
                    value = 0 if op.func is aten.zero_.default else op.args[1]
                    block.view(-1)[inside] = value
            self.targets[k].take_rows(block, a)

    def _draw_away(self, op: InitOp) -> None:
        """Draw what `op` drew, into scratch: its numbers are overwritten later (or belong to a
        parameter the model dropped), but the RNG stream must advance the same."""
        shape, dtype = self.log.shapes[op.key], self.log.dtypes[op.key]
        if self.cpu and op.view is None and op.func in _BLOCK_DRAWS and shape:
            row = _numel(shape[1:])
            for a, b in self._row_blocks(shape):
                _apply(op, self._scratch((b - a) * row, dtype))
            return
        _apply(op, self._scratch(_numel(shape), dtype).view(shape))


def _apply(op: InitOp, tensor: torch.Tensor) -> None:
    """Run `op` on `tensor` (the whole parameter, or a block of its rows for a whole write)."""
    if op.view is not None:
        size, stride, offset = op.view
        tensor = tensor.as_strided(size, stride, offset)
    args = tuple(tensor if a is TARGET else a for a in op.args)
    op.func(*args, **op.kwargs)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def _flat_index(view: tuple) -> torch.Tensor:
    size, stride, offset = view
    idx = torch.tensor([offset], dtype=torch.int64)
    for n, s in zip(size, stride):
        idx = (idx.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * s).reshape(-1)
    return idx


class _Recorder(TorchDispatchMode):
    """Records every op that writes a meta parameter (or a view of one)."""

    def __init__(self, log: InitLog, keys: dict[int, int]):
        super().__init__()
        self.log, self.keys = log, keys

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if not schema.is_mutable:
            return out
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(t, torch.Tensor) and t.is_meta:
                self._record(func, t, i, args, kwargs)
        return out

    def _record(self, func, t: torch.Tensor, i: int, args: tuple, kwargs: dict) -> None:
        root = t if t._base is None else t._base
        key = self.keys.get(id(root))
        if key is None:
            raise NotReplayableError(f"{func}: writes a meta tensor that is no parameter")
        rest = [a for j, a in enumerate(tree_flatten((args, kwargs))[0]) if a is not t]
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in rest):
            raise NotReplayableError(f"{func}: reads another meta tensor (a parameter's value)")
        view = None
        if t is not root and not (
            t.shape == root.shape and t.stride() == root.stride() and t.storage_offset() == 0
        ):
            view = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
        random = any("Generator" in str(a.type) for a in func._schema.arguments)
        kept = tree_map(lambda a: a.detach().clone() if isinstance(a, torch.Tensor) else a, args)
        op = InitOp(
            func=func,
            key=key,
            view=view,
            args=tuple(TARGET if j == i else a for j, a in enumerate(kept)),
            kwargs={k: v for k, v in kwargs.items() if k != "generator"},
            random=random,
        )
        if kwargs.get("generator") is not None:
            raise NotReplayableError(f"{func}: draws from its own generator, not the seeded one")
        self.log.ops.append(op)
        if op.whole_write:  # its value at creation is no longer needed
            self.log.initial.pop(key, None)


@contextlib.contextmanager
def _meta_parameters(log: InitLog, keys: dict[int, int]):
    """Every parameter registered in the block lives on the meta device (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            meta = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            keys[id(meta)] = len(log.shapes)
            log.shapes.append(tuple(param.shape))
            log.dtypes.append(param.dtype)
            log.initial[keys[id(meta)]] = param.detach()
            param = meta
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def record_build(build, *, seed: int, device: torch.device) -> tuple[nn.Module, InitLog]:
    """``build()`` (a model constructor) with its parameters on the meta device (buffers stay
    real: rotary frequencies are computed as usual), and the log of its init, to be replayed on
    `device` from `seed`: which parameter each op wrote, which view of it, the op and its
    arguments. Meta tensors draw nothing, so the RNG is untouched here."""
    log = InitLog(seed=seed, device=torch.device(device))
    keys: dict[int, int] = {}
    with _meta_parameters(log, keys), _Recorder(log, keys):
        model = build()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in keys:
            raise NotReplayableError(f"{name}: a parameter created outside the recorded build")
        log.names[name] = keys[id(p)]
    # initial values of parameters the model dropped (a tied lm_head's own) are not needed
    kept = set(log.names.values())
    log.initial = {k: v for k, v in log.initial.items() if k in kept}
    return model, log
