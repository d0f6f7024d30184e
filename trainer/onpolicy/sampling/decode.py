"""The sampler's model side: prefill the prompts once, then one token per live row per step.

A decoder (`make_decoder`) owns the model and its KV cache behind four verbs: ``prefill`` (the
last position's logits of left-padded prompts), ``repeat`` (each row n times, for n samples of
one prefill), ``keep`` (rows that stopped leave the batch) and ``step`` (one token per live row
in, its next logits out). `HFDecoder` takes any HF causal LM; `LlamaDecoder` is a lean loop over
a Llama-family model's own weights, because a decode step at a few rows is bound by reading the
weights (docs/onpolicy.md, "A step", 2).

Legend: B live rows, P prompt positions, T cache positions (P + new tokens), V vocabulary
kept, H hidden size, NH / KV query / key-value heads, G = NH / KV, D head size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from trainer.onpolicy.sampling import orient
from trainer.onpolicy.sampling.int8 import Int8Weights, int8_available

# model_type -> the lean path applies (same blocks as Llama: RMSNorm, RoPE, GQA, gated SiLU MLP)
# the same decoder layer as Llama's (pre-norm RMSNorm, RoPE from the model's rotary module,
# GQA attention with optional biases, SwiGLU): Mistral and Qwen2 (q/k/v biases) differ only by
# a sliding window, which the lean path does not apply (`_full_attention`)
LEAN_TYPES = ("llama", "mistral", "qwen2")


def _full(logits: torch.Tensor) -> torch.Tensor:
    """Whole-vocabulary logits: a vocab-sharded DTensor (TP lm_head) is gathered."""
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


class HFDecoder:
    """Any HF causal LM: its forward with a ``DynamicCache``. The generic path, and the one
    under tensor parallelism (a vocab-sharded logits DTensor is gathered) or while parameters
    are still FSDP-sharded (outside `sampler.gathered`)."""

    def __init__(self, model: nn.Module, *, vocab_size: int):
        self.model, self.vocab = model, vocab_size
        self.cache = DynamicCache()

    def prefill(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor) -> torch.Tensor:
        self.mask_BT = mask_BP
        pos_BP = (mask_BP.cumsum(-1) - 1).clamp(min=0)
        self.pos_B1 = pos_BP[:, -1:]
        out = self.model(
            input_ids=ids_BP,
            attention_mask=mask_BP,
            position_ids=pos_BP,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.past_key_values
        return _full(out.logits)[:, -1, : self.vocab]

    def repeat(self, n: int) -> None:
        self.cache.batch_repeat_interleave(n)
        self.mask_BT = self.mask_BT.repeat_interleave(n, 0)
        self.pos_B1 = self.pos_B1.repeat_interleave(n, 0)

    def keep(self, keep_B: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep_B)
        self.mask_BT, self.pos_B1 = self.mask_BT[keep_B], self.pos_B1[keep_B]

    def step(self, next_B: torch.Tensor) -> torch.Tensor:
        self.mask_BT = torch.cat([self.mask_BT, self.mask_BT.new_ones(len(next_B), 1)], dim=1)
        self.pos_B1 = self.pos_B1 + 1
        out = self.model(
            input_ids=next_B[:, None],
            attention_mask=self.mask_BT,
            position_ids=self.pos_B1,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return _full(out.logits)[:, -1, : self.vocab]


def _rms_norm(x_BH: torch.Tensor, w_H: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm, step for step (float32 inside, back to the input's dtype)."""
    h = x_BH.to(torch.float32)
    h = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    return w_H * h.to(x_BH.dtype)


def _plain(layer: nn.Module) -> nn.Module:
    """A decoder block without its activation-checkpointing wrapper."""
    return getattr(layer, "_checkpoint_wrapped_module", layer)


def _weights(*linears: nn.Linear) -> tuple[list, torch.Tensor | None]:
    """The weights of linears that share an input, and their biases concatenated (or None)."""
    if all(m.bias is None for m in linears):
        return [m.weight for m in linears], None
    biases = [m.weight.new_zeros(len(m.weight)) if m.bias is None else m.bias for m in linears]
    return [m.weight for m in linears], torch.cat(biases)


class _Dense:
    """`orient.project` through the model's own weights (no copy: always the current ones), in
    the form this machine measured faster (`orient.tune`)."""

    def __init__(self, weights: list, bias: torch.Tensor | None):
        self.weights, self.bias, self.shape = weights, bias, orient.shape(weights)

    def __call__(self, x_BK: torch.Tensor) -> torch.Tensor:
        major = x_BK.device.type == "cpu" and orient.weight_major(len(x_BK), self.shape)
        return orient.project(x_BK, self.weights, self.bias, major=major)


def projection_groups(
    model: nn.Module, *, vocab_size: int
) -> list[tuple[list, torch.Tensor | None]]:
    """(weights, bias) of every product a decode step takes, in order: per block q/k/v, o,
    gate/up, down, then the lm_head's tokenizer rows (a contiguous slice of a padded head)."""
    out = []
    for layer in model.model.layers:
        blk = _plain(layer)
        at, mlp = blk.self_attn, blk.mlp
        out += [_weights(at.q_proj, at.k_proj, at.v_proj), _weights(at.o_proj),
                _weights(mlp.gate_proj, mlp.up_proj), _weights(mlp.down_proj)]  # fmt: skip
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    out.append(([head.weight[:vocab_size]], None if bias is None else bias[:vocab_size]))
    return out


def int8_weights(model: nn.Module, *, vocab_size: int, threads: int | None = None) -> Int8Weights:
    """An int8 copy of the model's decode products (`trainer.onpolicy.sampling.int8`), for `LlamaDecoder`."""
    return Int8Weights(projection_groups(model, vocab_size=vocab_size), threads=threads)


class LlamaDecoder:
    """The lean decode path for Llama-family models (`LEAN_TYPES`) with whole parameters. Build
    it with `make_decoder`, which checks that it applies. ``weights``: "model" (its own weights,
    no copy, so nothing to refresh after an optimizer step), "int8" (a copy made here) or an
    `Int8Weights` made earlier from this model.

    The prefill is the HF forward, its cache copied once into a preallocated one; each decode
    step is a loop over the weights, the same math in the same dtype. A step reads every weight
    once (538 MB of fp32 for SmolLM2-135M), so that read is its floor; HF's step spends most of
    its time in skinny products ``x @ W.T`` at a few rows, whose form is measured here
    (`orient`). The static cache also removes the ``torch.cat`` that grows every layer's cache
    every step, and the loop drops HF's per-layer module, mask and cache bookkeeping."""

    def __init__(
        self,
        model: nn.Module,
        *,
        vocab_size: int,
        max_len: int,
        weights: str | Int8Weights = "model",
    ):
        if isinstance(weights, str) and weights not in ("model", "int8"):
            raise ValueError(f"decoder weights: expected model or int8, got {weights!r}")
        cfg, inner = model.config, model.model
        self.model, self.vocab, self.max_len = model, vocab_size, max_len
        self.heads, self.kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        # per kind of product (q/k/v, o, gate/up, down, lm_head) every layer's weights: the form
        # of each is measured at the first step with a new number of rows (`orient.tune`)
        self.kinds = None
        if weights == "model":
            groups = projection_groups(model, vocab_size=vocab_size)
            products = [_Dense(w, b) for w, b in groups]
            self.kinds = [[w for w, _ in groups[j:-1:4]] for j in range(4)] + [[groups[-1][0]]]
        else:
            if weights == "int8":
                weights = int8_weights(model, vocab_size=vocab_size)
            products = weights.linears
        *blocks, self.head = products
        self.blocks = [
            (_plain(layer).input_layernorm.weight, *blocks[4 * i : 4 * i + 2],
             _plain(layer).post_attention_layernorm.weight, *blocks[4 * i + 2 : 4 * i + 4])
            for i, layer in enumerate(inner.layers)
        ]  # fmt: skip
        self.dtype, self.device = self.embed.dtype, self.embed.device
        # attention probabilities in float32 at least, as HF's attention takes them
        self.soft_dtype = torch.promote_types(self.dtype, torch.float32)
        # cos/sin of every position a rollout can reach, from the model's own rotary module
        # (its RoPE type and attention scaling included); rotate_half(x) * sin is taken as
        # roll(x, D/2) * (sin with its first half negated)
        pos_1T = torch.arange(max_len, device=self.device)[None]
        probe = torch.zeros(1, device=self.device, dtype=self.dtype)
        cos, sin = inner.rotary_emb(probe, pos_1T)
        half = self.head_dim // 2
        self.cos_TD = cos[0]
        self.sin_TD = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)

    def prefill(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor) -> torch.Tensor:
        hf = HFDecoder(self.model, vocab_size=self.vocab)
        logits_BV = hf.prefill(ids_BP, mask_BP)
        B, P = ids_BP.shape
        shape = (B, self.kv, self.max_len, self.head_dim)
        self.k, self.v = [], []
        for layer in hf.cache.layers:  # copied once into the preallocated cache
            k = torch.empty(shape, dtype=layer.keys.dtype, device=self.device)
            v = torch.empty(shape, dtype=layer.values.dtype, device=self.device)
            k[:, :, :P], v[:, :, :P] = layer.keys, layer.values
            self.k.append(k)
            self.v.append(v)
        # additive attention bias per cache position: 0 where a row has a token, the dtype's
        # minimum at its left padding (HF's masking value; exp of it is exactly 0)
        bias_BT = torch.zeros((B, self.max_len), dtype=self.dtype, device=self.device)
        bias_BT[:, :P].masked_fill_(mask_BP == 0, torch.finfo(self.dtype).min)
        self.bias_BT, self.t = bias_BT, P
        self.pos_B = mask_BP.sum(-1) - 1  # position of each row's last token
        return logits_BV

    def repeat(self, n: int) -> None:
        self.k = [k.repeat_interleave(n, 0) for k in self.k]
        self.v = [v.repeat_interleave(n, 0) for v in self.v]
        self.bias_BT = self.bias_BT.repeat_interleave(n, 0)
        self.pos_B = self.pos_B.repeat_interleave(n, 0)

    def keep(self, keep_B: torch.Tensor) -> None:
        self.k = [k[keep_B] for k in self.k]
        self.v = [v[keep_B] for v in self.v]
        self.bias_BT, self.pos_B = self.bias_BT[keep_B], self.pos_B[keep_B]

    def step(self, next_B: torch.Tensor) -> torch.Tensor:
        """One token per live row in, its next logits [B, V] out: the same math as HF's
        forward, in few operations per layer (each costs microseconds of dispatch)."""
        t = self.t
        if t >= self.max_len:
            raise ValueError(f"decode step at position {t}: the cache holds {self.max_len}")
        if self.kinds is not None:
            orient.tune(self.kinds, len(next_B))  # once per process, rows and threads
        self.pos_B = self.pos_B + 1
        logits = self._forward(
            next_B,
            self.bias_BT[:, None, None, : t + 1],
            lambda c, x: c.select(2, t).copy_(x),
            t + 1,
        )
        self.t = t + 1
        return logits

    def _forward(self, next_B, bias_B11T, write, width: int) -> torch.Tensor:
        """The step's layers over cache positions ``[:width]`` with the additive ``bias_B11T``;
        ``write(cache_BKTD, x_BKD)`` puts this step's keys or values at its position."""
        B, NH, KV, D = len(next_B), self.heads, self.kv, self.head_dim
        cos_B11, sin_B11 = self.cos_TD[self.pos_B][:, None], self.sin_TD[self.pos_B][:, None]
        x_BH = self.embed[next_B]
        G, scale = NH // KV, D**-0.5
        for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(self.blocks):
            h = _rms_norm(x_BH, ln1, self.eps)
            qkv_BND = qkv(h).view(B, NH + 2 * KV, D)
            qk = qkv_BND[:, : NH + KV]
            qk = qk * cos_B11 + qk.roll(D // 2, -1) * sin_B11  # RoPE on q and k at once
            write(self.k[i], qk[:, NH:])
            write(self.v[i], qkv_BND[:, NH + KV :])
            # attention as HF's eager attention, without repeating the cache for GQA: query
            # head j reads key-value head j // G, as after HF's repeat_kv
            k_BKTD, v_BKTD = self.k[i][:, :, :width], self.v[i][:, :, :width]
            s_BKGT = torch.matmul(qk[:, :NH].view(B, KV, G, D), k_BKTD.transpose(-1, -2))
            p_BKGT = torch.softmax(s_BKGT.mul_(scale).add_(bias_B11T), -1, dtype=self.soft_dtype)
            a_BKGD = torch.matmul(p_BKGT.to(self.dtype), v_BKTD)
            x_BH = x_BH + o(a_BKGD.view(B, NH * D))
            h = _rms_norm(x_BH, ln2, self.eps)
            g_BI, u_BI = gate_up(h).chunk(2, -1)
            x_BH = x_BH + down(F.silu(g_BI) * u_BI)
        logits = self.head(_rms_norm(x_BH, self.norm, self.eps))
        # row-major for the vocabulary work (one column at a time: 4x faster than
        # .contiguous() of the transposed view)
        return torch.stack(logits.unbind(0)) if logits.stride(-1) != 1 else logits


class StaticLlamaDecoder(LlamaDecoder):
    """`LlamaDecoder` at fixed shapes, for a CUDA graph (`trainer.onpolicy.sampling.static`):
    rows never leave (the sampler masks finished ones), attention reads the whole preallocated
    cache with the positions past this step masked by the additive bias, and the position is a
    device tensor the step advances in place, so every step is the same kernels on the same
    buffers. The model's own weights only (int8 quantizes activations over the live rows)."""

    def prefill(self, ids_BP: torch.Tensor, mask_BP: torch.Tensor) -> torch.Tensor:
        logits_BV = super().prefill(ids_BP, mask_BP)
        for k, v in zip(self.k, self.v):  # read under a zero weight: must be finite
            k[:, :, self.t :].zero_()
            v[:, :, self.t :].zero_()
        self.t_1 = torch.tensor([self.t], device=self.device)
        self.cols_1T = torch.arange(self.max_len, device=self.device)[None]
        return logits_BV

    def keep(self, keep_B: torch.Tensor) -> None:
        raise ValueError("a static decoder keeps every row: finished rows are masked, not dropped")

    def step(self, next_B: torch.Tensor) -> torch.Tensor:
        """As `LlamaDecoder.step`, with no host value read or written: the caller keeps the
        steps within the cache (the sampler's ``max_new_tokens``)."""
        if self.kinds is not None:
            orient.tune(self.kinds, len(next_B))  # on CPU, as the dynamic step
        self.pos_B.add_(1)  # in place: a captured graph reads these very tensors
        future_BT = self.cols_1T > self.t_1
        bias_B11T = self.bias_BT.masked_fill(future_BT, torch.finfo(self.dtype).min)[:, None, None]

        def write(cache_BKTD, x_BKD):
            cache_BKTD.index_copy_(2, self.t_1, x_BKD[:, :, None])

        logits = self._forward(next_B, bias_B11T, write, self.max_len)
        self.t_1.add_(1)
        return logits


def _full_attention(cfg, max_len: int) -> bool:
    """Does every layer attend to every earlier position up to `max_len` tokens? Not where a
    sliding window is on and shorter (Mistral's `sliding_window`, Qwen2's `use_sliding_window`
    or `layer_types`)."""
    window = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "model_type", None) == "qwen2" and not getattr(
        cfg, "use_sliding_window", False
    ):
        window = None
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        window = window or 0  # a sliding layer: full only if its window covers max_len
    return window is None or window >= max_len


def lean_applies(model: nn.Module, *, max_len: int | None = None) -> bool:
    """Can `LlamaDecoder` run this model: a Llama-family HF model (`LEAN_TYPES`) attending to
    every position up to `max_len`, whose parameters are whole tensors (not DTensors:
    TP-sharded, or FSDP2-sharded outside `sampler.gathered`)?"""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "model_type", None) not in LEAN_TYPES:
        return False
    if max_len is not None and not _full_attention(cfg, max_len):
        return False
    if getattr(cfg, "hidden_act", "silu") != "silu" or getattr(cfg, "pretraining_tp", 1) != 1:
        return False
    if not hasattr(getattr(model, "model", None), "rotary_emb"):
        return False
    return not any(hasattr(p, "full_tensor") for p in model.parameters())


def make_decoder(
    model: nn.Module,
    *,
    vocab_size: int,
    max_len: int,
    lean: bool = True,
    tp: bool = False,
    weights: str = "model",
    int8: Int8Weights | None = None,
    static: bool = False,
):
    """The decoder for this model: the lean path when it applies (and ``lean``, and not under
    TP), else the HF forward. ``weights="int8"`` (`trainer.onpolicy.sampling.int8`) needs the lean path
    and fbgemm, and says why not in one line; ``int8``: a copy made earlier (else one is made
    here). ``static``: a `StaticLlamaDecoder` where the lean path applies (the model's own
    weights only)."""
    lean_ok = lean and not tp and lean_applies(model, max_len=max_len)
    if weights == "int8":
        why = (
            "this torch build has no fbgemm (x86 CPU builds do)" if not int8_available()
            else "the model is on a GPU" if next(model.parameters()).device.type != "cpu"
            else "it needs the lean decode path: a Llama-family model (llama, mistral, qwen2) "
            "with whole parameters, full attention over the rollout, not under TP"
            if not lean_ok else None
        )  # fmt: skip
        if why:
            raise ValueError(f"onpolicy.sampler_weights=int8: {why}")
    if lean_ok and static:
        if weights != "model":
            raise ValueError(f"a static decode step runs the model's own weights, not {weights}")
        return StaticLlamaDecoder(model, vocab_size=vocab_size, max_len=max_len)
    if lean_ok:
        chosen = int8 if weights == "int8" and int8 is not None else weights
        return LlamaDecoder(model, vocab_size=vocab_size, max_len=max_len, weights=chosen)
    return HFDecoder(model, vocab_size=vocab_size)
