"""The student's own sampler: batched, KV-cached, seeded, over a HF causal LM's forward.

Not ``model.generate``: its per-step machinery costs more than a small model's forward on CPU,
finished rows keep being computed, and it draws from the global RNG, which a resumed run cannot
replay. Here every rollout's uniforms are a hash of its seed and step (`draw`), so the same
prompt gets the same completion in any batch, rank or resumed run with no sampler state to
save; on CPU rows that stop leave the batch, on a GPU the step is one CUDA graph over fixed
shapes (`static`) (docs/onpolicy.md, "A step", 2).

Legend: B live rows, P prompt positions, V lm_head width, K recorded top-k, N new tokens.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from trainer.onpolicy.sampling.decode import StaticLlamaDecoder, make_decoder
from trainer.onpolicy.sampling.draw import Uniforms, choose, drawn_logprobs
from trainer.onpolicy.sampling.int8 import Int8Weights
from trainer.onpolicy.sampling.static import StaticLoop


@dataclass(frozen=True)
class SamplingConfig:
    """How the student samples (``temperature: 0`` is greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    n_samples: int = 1  # completions per prompt
    record_topk: int = 0  # K > 0: keep the policy's top-k ids at every sampled position
    # model: decode with the model's own weights; int8: a quantized copy (`decode.make_decoder`),
    # recording each drawn token's log-probability for the ratio-weighted loss
    weights: str = "model"

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1 or self.n_samples < 1 or self.record_topk < 0:
            raise ValueError(f"invalid sampling sizes: {self}")
        if self.weights not in ("model", "int8"):
            raise ValueError(f"sampler weights: expected model or int8, got {self.weights!r}")
        if self.weights == "int8" and self.temperature == 0:
            raise ValueError("int8 sampling weights its loss by likelihood ratios: not greedy")

    @property
    def records_logprobs(self) -> bool:
        return self.weights != "model"


@dataclass
class Rollouts:
    """Completions of a batch of prompts; rollout r answers prompt ``prompt_index[r]``."""

    prompts: list[list[int]]  # per rollout: its prompt's ids
    completions: list[list[int]]  # per rollout: sampled ids, the stop id included when it stopped
    stopped: list[bool]  # per rollout: True = ended on a stop id, False = hit max_new_tokens
    prompt_index: list[int]
    topk_ids: list[np.ndarray] | None = None  # per rollout int32 [len(completion), K]
    # per rollout float32 [len(completion)]: each token's log-probability under the distribution
    # it was drawn from (temperature and top-p applied); only where the sampler's weights are
    # not the model's own (`SamplingConfig.records_logprobs`)
    logprobs: list[np.ndarray] | None = None
    seconds: float = 0.0
    meta: list[dict] = field(default_factory=list)  # per rollout, from the prompt source

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def new_tokens(self) -> int:
        return sum(len(c) for c in self.completions)


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _left_pad(prompts: Sequence[Sequence[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for b, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {b} is empty (a prompt needs at least one token, e.g. BOS)")
        ids[b, width - len(p) :] = p
        mask[b, width - len(p) :] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


# eager even when the student's blocks are compiled (`parallelize.apply_compile`): the KV cache
# cannot be traced into a block's one graph, and every decode step would be a new shape anyway
@torch.compiler.set_stance("force_eager")
@torch.no_grad()
def sample(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    config: SamplingConfig,
    seeds: Sequence[int] | None,
    stop_ids: Sequence[int],
    vocab_size: int,
    tp_group: dist.ProcessGroup | None = None,
    lean: bool = True,
    int8: Int8Weights | None = None,
    on_step: Callable[[], None] | None = None,
    static: bool | None = None,
) -> Rollouts:
    """Sample ``config.n_samples`` completions of every prompt: left-padded into one batch and
    prefilled once (with ``n_samples > 1`` the prefilled cache is repeated per sample), then
    one token per live row per step until it stops. Under tensor parallelism (``tp_group``)
    each step's tokens are broadcast from the group's first rank, so every rank of a TP group
    holds the same tokens whatever the floating-point order of its reductions.

    ``seeds``: one per rollout (prompt-major: prompt i's samples are rollouts
    i * n_samples ...), the key of its uniforms (`draw.Uniforms`); None only when greedy.
    ``vocab_size``: the tokenizer's size; lm_head columns past it are never sampled.
    ``stop_ids``: ids that end a completion (kept as its last token).
    ``lean``: decode Llama-family models with `decode.LlamaDecoder` where it applies (False:
    always the HF forward, the reference the lean path is tested against).
    ``int8``: with ``config.weights == "int8"``, a copy made earlier (`decode.int8_weights`);
    None: one is made from the current weights.
    ``on_step``: called before every decode step (the caller may change torch's threads there:
    `trainer.onpolicy.side.OnPolicy.generate`, `ThreadRelease`).
    ``static``: the fixed-shape loop (`static.StaticLoop`: rows never leave the batch, the
    step a CUDA graph on a GPU, eager on CPU), where the lean path applies with the model's
    own weights; None: on a GPU only. Either loop draws the same tokens.
    """
    t0 = time.perf_counter()
    device = next(model.parameters()).device
    n, k = config.n_samples, config.record_topk
    ids_BP, mask_BP = _left_pad(prompts, device)
    want_static = device.type == "cuda" and config.weights == "model" if static is None else static
    dec = make_decoder(
        model,
        vocab_size=vocab_size,
        max_len=ids_BP.shape[1] + config.max_new_tokens,
        lean=lean,
        tp=_tp_size(tp_group) > 1,
        weights=config.weights,
        int8=int8,
        static=want_static,
    )
    if static and not isinstance(dec, StaticLlamaDecoder):
        raise ValueError("static=True needs the lean decode path (a Llama-family model with "
                         "whole parameters, not under TP, lean=True)")  # fmt: skip
    logits_BV = dec.prefill(ids_BP, mask_BP)
    if n > 1:  # one prefill per prompt, the cache copied per sample
        dec.repeat(n)
        logits_BV = logits_BV.repeat_interleave(n, 0)
    rows = len(prompts) * n
    if config.temperature > 0 and (seeds is None or len(seeds) != rows):
        raise ValueError(f"sampling needs one seed per rollout ({rows}), got {seeds!r:.80}")
    uniforms = Uniforms(seeds, device=device) if config.temperature > 0 else None
    stop = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64, device=device)
    if isinstance(dec, StaticLlamaDecoder):
        loop = StaticLoop(dec, config=config, uniforms=uniforms, stop_S=stop,
                          graph=device.type == "cuda")  # fmt: skip
        loop.run(logits_BV, on_step=on_step)
        tokens_RN, topk_RNK, stopped_R = loop.tokens_RN, loop.topk_RNK, loop.stopped_R
        logp_RN = None
    else:
        tokens_RN, topk_RNK, logp_RN, stopped_R = _dynamic(
            dec, logits_BV, config=config, uniforms=uniforms, stop=stop, tp_group=tp_group,
            on_step=on_step,
        )  # fmt: skip
    tokens = tokens_RN.cpu().numpy()
    lens = (tokens >= 0).sum(1)
    topk = topk_RNK.cpu().numpy() if k else None
    logp = logp_RN.cpu().numpy() if config.records_logprobs else None
    index = [r // n for r in range(rows)]
    return Rollouts(
        prompts=[list(map(int, prompts[i])) for i in index],
        completions=[tokens[r, : lens[r]].tolist() for r in range(rows)],
        stopped=stopped_R.cpu().tolist(),
        prompt_index=index,
        topk_ids=None if topk is None else [topk[r, : lens[r]] for r in range(rows)],
        logprobs=None if logp is None else [logp[r, : lens[r]] for r in range(rows)],
        seconds=time.perf_counter() - t0,
    )


def _dynamic(dec, logits_BV, *, config, uniforms, stop, tp_group, on_step):
    """The token loop where rows that stop leave the batch (a host check per step): tokens
    [R, N] (-1 past a row's end), top-k [R, N, K], log-probs [R, N], stopped [R]."""
    device, rows, k = logits_BV.device, len(logits_BV), config.record_topk
    tokens_RN = torch.full((rows, config.max_new_tokens), -1, dtype=torch.int64, device=device)
    topk_RNK = torch.zeros((rows, config.max_new_tokens, k), dtype=torch.int32, device=device)
    logp_RN = torch.zeros((rows, config.max_new_tokens), dtype=torch.float32, device=device)
    stopped_R = torch.zeros(rows, dtype=torch.bool, device=device)
    live_B = torch.arange(rows, device=device)  # the rollout each live row belongs to
    root = dist.get_global_rank(tp_group, 0) if _tp_size(tp_group) > 1 else None
    for step in range(config.max_new_tokens):
        u_BW = None if uniforms is None else uniforms.at(step)
        if u_BW is not None and len(live_B) < rows:
            u_BW = u_BW[live_B]
        next_B = choose(logits_BV, config=config, u_BW=u_BW)
        if root is not None:  # one rank's draw for the whole TP group
            dist.broadcast(next_B, src=root, group=tp_group)
        tokens_RN[live_B, step] = next_B
        if k:
            topk_RNK[live_B, step] = logits_BV.topk(k, dim=-1).indices.to(torch.int32)
        if config.records_logprobs:
            logp_RN[live_B, step] = drawn_logprobs(logits_BV, next_B, config=config)
        ended_B = torch.isin(next_B, stop)
        stopped_R[live_B] = ended_B
        if step == config.max_new_tokens - 1:
            break
        if bool(ended_B.any()):  # a host sync, once per step: finished rows leave the batch
            keep_B = (~ended_B).nonzero().squeeze(1)
            if keep_B.numel() == 0:
                break
            dec.keep(keep_B)
            live_B, next_B = live_B[keep_B], next_B[keep_B]
        if on_step is not None:
            on_step()
        logits_BV = dec.step(next_B)
    return tokens_RN, topk_RNK, logp_RN, stopped_R


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(model: nn.Module, *, reshard_after_forward: bool) -> Iterator[None]:
    """Keep an FSDP2 model's parameters unsharded for the whole block (one all-gather per layer
    for a rollout phase instead of one per layer per token), then reshard and restore
    ``reshard_after_forward`` (the value the model was wrapped with). A no-op for a plain model."""
    mods = _fsdp_modules(model)
    for m in mods:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in mods:
            m.unshard()
        yield
    finally:
        for m in mods:
            m.reshard()
            # the root never reshards after forward (`parallelize.apply_fsdp`: a chunked
            # lm_head's loss reads its weight in backward)
            m.set_reshard_after_forward(reshard_after_forward and m is not model, recurse=False)


class ThreadRelease:
    """A sampler's ``on_step``: once ``release()`` is true, torch's ``threads`` again (those it
    had before `torch_threads` lowered them: the work beside the sampler is over)."""

    def __init__(self, release: Callable[[], bool], *, threads: int):
        self.release, self.threads = release, threads
        self.t0, self.held_s = time.perf_counter(), None

    def __call__(self) -> None:
        if self.held_s is None and self.release():
            torch.set_num_threads(self.threads)
            self.held_s = time.perf_counter() - self.t0

    def held(self) -> float:
        """Seconds the lowered thread count was held (all along if never released)."""
        return time.perf_counter() - self.t0 if self.held_s is None else self.held_s
