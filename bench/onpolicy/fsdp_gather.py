"""Part 2 of `bench.onpolicy.section`: FSDP2 generation with and without
`trainer.onpolicy.sampling.sampler.gathered`, counting FSDP's parameter all-gathers (2 ranks).

    torchrun --nproc_per_node=2 bench/onpolicy/fsdp_gather.py OUT
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard import _fsdp_param_group as fsdp_group

from tokenbridge import paths

ROWS, NEW = 4, 16
_GATHERS = [0]  # FSDP2's parameter all-gathers all go through foreach_all_gather: counted there
_original = fsdp_group.foreach_all_gather


def _counting(*args, **kwargs):
    _GATHERS[0] += 1
    return _original(*args, **kwargs)


fsdp_group.foreach_all_gather = _counting


def main(out: str) -> None:
    from bench.onpolicy.prompt_texts import prompts_from_kjv
    from tokenbridge import models
    from tokenbridge.tokenizers import load_tokenizer
    from trainer.config.schema import ModelConfig
    from trainer.onpolicy.sampling.sampler import SamplingConfig, gathered, sample
    from trainer.parallel import parallelize
    from trainer.parallel.mesh import build_mesh

    torch.set_num_threads(1)
    device = torch.device("cpu")
    parallelize.init_distributed(device)
    mesh = build_mesh(device, dp=2)
    model = models.build_model(ModelConfig(str(paths.student_dir())))
    # as the trainer wraps it: one unit per decoder layer, and the root
    parallelize.apply_fsdp(model, mesh.fsdp_mesh, mp_policy=MixedPrecisionPolicy())
    tok = load_tokenizer(paths.student_dir())
    prompts = prompts_from_kjv(tok, ROWS, 16)
    cfg = SamplingConfig(temperature=1.0, max_new_tokens=NEW)

    def run(gather: bool) -> tuple[int, float]:
        _GATHERS[0] = 0
        t0 = time.perf_counter()
        ctx = gathered(model, reshard_after_forward=True) if gather else contextlib.nullcontext()
        with ctx:
            sample(model, prompts, config=cfg, seeds=list(range(ROWS)), stop_ids=[],
                   vocab_size=tok.vocab_size)  # fmt: skip
        return _GATHERS[0], time.perf_counter() - t0

    model.eval()
    res = {}
    for gather in (False, True):
        run(gather)  # warm-up
        got = [run(gather) for _ in range(2)]
        key = "gathered" if gather else "plain"
        res[f"{key}_gathers"] = got[0][0]
        res[f"{key}_s"] = statistics.median(s for _, s in got)
    res.update(model="SmolLM2-135M", rows=ROWS, new=NEW)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(res, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
