"""The run's precision by device (`trainer.config.precision`): what ``auto`` resolves to, that a
named dtype is kept, what bfloat16 means under FSDP2 (float32 master shards and AdamW moments,
bfloat16 compute copies), and the teacher cache's dtype check naming how to match.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from tests.tiny import tiny_llama
from tokenbridge import models
from tokenbridge.formats.teacher_cache import CacheMeta
from tokenbridge.formats.teacher_cache_reader import CacheMismatchError
from trainer import optim
from trainer.config.precision import Precision, resolve_precision
from trainer.config.schema import OptimConfig, from_dictconfig
from trainer.parallel import parallelize
from trainer.parallel.mesh import build_mesh
from trainer.teacher.cached_teacher import check_dtype


def _cfg(**top):
    d = {
        "model": {"path": "student"},
        "teachers": [{"path": "a", "name": "a"}, {"path": "b", "name": "b", "dtype": "float32"}],
        "loss": {"mode": "kd_topk"},
        "data": {"shards": "shards"},
        **top,
    }
    return from_dictconfig(d)


def test_auto_is_bfloat16_on_cuda_float32_on_cpu_and_fused_on_both():
    cfg = _cfg()
    assert (cfg.parallel.param_dtype, cfg.teachers[0].dtype, cfg.optim.fused) == ("auto",) * 3
    assert resolve_precision(cfg, device="cuda") == Precision(
        "cuda", "bfloat16", "float32", ("bfloat16", "float32"), True
    )
    assert resolve_precision(cfg, device="cpu") == Precision(
        "cpu", "float32", "float32", ("float32", "float32"), True
    )
    # named values are kept on either device; optim.fused=false forces foreach on a CPU
    named = _cfg(parallel={"param_dtype": "float32"}, optim={"fused": False})
    got = resolve_precision(named, device="cuda")
    assert (
        got.param_dtype == "float32" and not resolve_precision(named, device="cpu").fused_optimizer
    )
    assert got.summary(["a", "b"])["teacher_dtypes"] == {"a": "bfloat16", "b": "float32"}


def test_bfloat16_params_keep_float32_master_shards_and_moments(group):
    """FSDP2 with the policy CUDA's ``auto`` gives (on gloo here): the sharded parameters the
    optimizer holds stay float32, each layer computes with a bfloat16 all-gathered copy, the
    gradients land float32 in the shards, and AdamW's moments are float32."""
    p = resolve_precision(_cfg(), device="cuda")
    model = tiny_llama(64).train()
    mp = MixedPrecisionPolicy(
        param_dtype=models.torch_dtype(p.param_dtype),
        reduce_dtype=models.torch_dtype(p.reduce_dtype),
    )
    mesh = build_mesh(torch.device("cpu"), dp=1)
    parallelize.apply_fsdp(model, mesh.fsdp_mesh, mp_policy=mp)
    assert {type(w).__name__ for w in model.parameters()} == {"DTensor"}
    assert {w.dtype for w in model.parameters()} == {torch.float32}
    computed: list[torch.dtype] = []
    mlp = model.model.layers[0].mlp.down_proj
    hook = mlp.register_forward_hook(lambda m, i, o: computed.extend([m.weight.dtype, o.dtype]))
    logits = model(input_ids=torch.randint(0, 64, (2, 8))).logits
    hook.remove()
    assert computed == [torch.bfloat16, torch.bfloat16] and logits.dtype == torch.bfloat16
    logits.float().logsumexp(-1).mean().backward()
    assert {w.grad.dtype for w in model.parameters()} == {torch.float32}
    opt = optim.build_optimizer(model, OptimConfig(), fused=False)
    opt.step()
    moments = {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"}
    assert moments == {torch.float32} and {w.dtype for w in model.parameters()} == {torch.float32}


def test_a_cache_of_another_dtype_is_refused_naming_how_to_match():
    meta = CacheMeta(teacher={"dtype": "float32"}, shards={}, k=8, temperature=1.0)
    check_dtype(meta, "float32", index=0, named="auto", cache="c")  # the dtype used: read
    with pytest.raises(CacheMismatchError) as e:
        check_dtype(meta, "bfloat16", index=1, named="auto", cache="c")
    msg = str(e.value)
    assert msg.startswith("teachers[1].cache=c: built with teacher dtype float32, the run uses ")
    assert "bfloat16 (teachers[1].dtype=auto on this device)" in msg
    assert "set teachers[1].dtype=float32 to read it" in msg
    assert "CACHE_ARGS='--teacher-dtype bfloat16'" in msg
