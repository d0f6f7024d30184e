"""The sampler's token loop at fixed shapes: every row to the end, the step captured once.

On a GPU a decode step of a small model costs launching its ~1,200 kernels, not reading its
weights; captured as one CUDA graph and replayed, a step is one launch. So this loop keeps
every row (a finished row is masked: its tokens after the stop are written as -1), draws inside
the same graph (`draw.choose` with ``static=True``, uniforms a block of steps at a time), and
reads the host only every `STOP_EVERY` steps, to stop once every row has. On CPU the same loop
runs eagerly; tests hold it to the dynamic loop's tokens (docs/onpolicy.md, "A step", 2).

A graph captured by hand (`torch.cuda.CUDAGraph`), not ``torch.compile(mode="reduce-overhead")``:
the step is already a flat loop over a few kernels per layer (nothing for Inductor to fuse that
would pay for compiling a model's layers on every process start and every new batch size), and
a captured graph has no guards or recompiles to reason about: its only inputs are the buffers
below, updated in place.

Legend: R rollouts (all rows, fixed), N new tokens, K recorded top-k, V vocabulary kept.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from trainer.onpolicy.sampling.decode import StaticLlamaDecoder
from trainer.onpolicy.sampling.draw import BLOCK, Uniforms, choose

STOP_EVERY = 8  # steps between the host's checks that every row has stopped
WARMUP = 2  # real steps on a side stream before the capture (cuBLAS and allocator set up)


class StaticLoop:
    """Samples ``config.max_new_tokens`` tokens of every row into `tokens_RN` (-1 past a row's
    stop), `topk_RNK` and `stopped_R`, with the step captured as a CUDA graph when ``graph``
    (else eagerly: on CPU). ``uniforms``: the rows' `Uniforms`, None when greedy; ``stop_S``:
    the stop ids."""

    def __init__(
        self,
        dec: StaticLlamaDecoder,
        *,
        config,
        uniforms: Uniforms | None,
        stop_S: torch.Tensor,
        graph: bool,
    ):
        rows, device = len(dec.pos_B), dec.device
        N, K = config.max_new_tokens, config.record_topk
        self.dec, self.config, self.uniforms, self.stop_S = dec, config, uniforms, stop_S
        self.graph = graph
        self.tokens_RN = torch.full((rows, N), -1, dtype=torch.int64, device=device)
        self.topk_RNK = torch.zeros((rows, N, K), dtype=torch.int32, device=device)
        self.stopped_R = torch.zeros(rows, dtype=torch.bool, device=device)
        self.next_R = torch.zeros(rows, dtype=torch.int64, device=device)  # the step's input
        self.step_1 = torch.zeros(1, dtype=torch.int64, device=device)

    def _draw(self, logits_RV: torch.Tensor) -> None:
        """Choose and record this step's tokens, all on the device, at fixed shapes."""
        u_RW = None
        if self.uniforms is not None:  # this step's row of the current block
            u_RW = self.uniforms.block_BSW.index_select(1, self.step_1 % BLOCK)[:, 0]
        ids_R = choose(logits_RV, config=self.config, u_BW=u_RW, static=True)
        ids_R = ids_R.masked_fill(self.stopped_R, -1)  # finished rows: nothing more
        self.tokens_RN.index_copy_(1, self.step_1, ids_R[:, None])
        if self.config.record_topk:
            top_RK = logits_RV.topk(self.config.record_topk, dim=-1).indices.to(torch.int32)
            self.topk_RNK.index_copy_(1, self.step_1, top_RK[:, None])
        self.stopped_R.logical_or_((ids_R[:, None] == self.stop_S).any(-1))
        self.next_R.copy_(ids_R.clamp(min=0))  # a finished row goes on reading some token
        self.step_1.add_(1)

    def _step(self) -> None:
        self._draw(self.dec.step(self.next_R))

    def _record(self) -> torch.cuda.CUDAGraph:
        """Record one step as a CUDA graph (recorded, not run: the caller replays it)."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step()
        return graph

    def run(self, logits_RV: torch.Tensor, *, on_step: Callable[[], None] | None) -> None:
        """From the prefill's logits to ``max_new_tokens`` tokens per row (or every row
        stopped); ``on_step`` is called before each decode step, as in the dynamic loop. With
        ``graph``: the first `WARMUP` steps run eagerly on a side stream (as capturing wants:
        cuBLAS and the allocator set up), the next is captured, and it is replayed since."""
        if self.uniforms is not None:
            self.uniforms.fill(0)
        self._draw(logits_RV)
        graph = side = None
        for step in range(1, self.config.max_new_tokens):
            if step % STOP_EVERY == 0 and bool(self.stopped_R.all()):  # the one host sync
                break
            if self.uniforms is not None:  # a new block every BLOCK steps, in place
                self.uniforms.fill(step)
            if on_step is not None:
                on_step()
            if not self.graph:
                self._step()
            elif graph is None and step <= WARMUP:
                if side is None:
                    side = torch.cuda.Stream(device=self.dec.device)
                    side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._step()
            else:
                if graph is None:
                    if side is not None:
                        torch.cuda.current_stream().wait_stream(side)
                    graph = self._captured()
                if graph is False:  # the capture failed: the same steps, eagerly
                    self._step()
                else:
                    graph.replay()

    def _captured(self):
        """The step's graph, or False where capturing fails (a step that syncs with the host
        on some torch build, a kernel that cannot be captured): the loop then runs the same
        step eagerly, the same tokens at the launch-bound speed, with one warning. Nothing of
        the failed capture ran (a capture records, it does not run)."""
        try:
            return self._record()
        except Exception as e:  # noqa: BLE001 - any capture failure has the same remedy
            torch.cuda.synchronize()
            warnings.warn(f"sampler: the decode step was not captured as a CUDA graph "
                          f"({type(e).__name__}: {e}); sampling eagerly", stacklevel=2)  # fmt: skip
            return False
