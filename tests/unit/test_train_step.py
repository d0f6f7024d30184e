"""The one training step (`trainer.step.TrainStep`) fed by its two sources of microbatches, the
real `ShardSource` (shard batches, through a stand-in teacher feed) and `RolloutSource`
(on-policy rollouts), on a tiny language model in one process:

- both advance the same counters and give their records through the same `TrainStep.run`;
  each step's loss and update equal those of the whole step's batch computed at once (every
  term normalised by its global count: `tokenbridge.losses.base.normalize`);
- a KD term that counts otherwise than its pre-count stops either with the one message
  (`count_mismatch`), before any update; a non-finite term is skipped alike;
- no other module of the trainer steps the optimizer or the scheduler or moves the counters.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tokenbridge.losses.base import LossOutput, as_count
from tokenbridge.losses.ce import ce
from trainer.config.schema import LossConfig, OptimConfig
from trainer.data.microbatches import Microbatch
from trainer.data.shard_source import ShardSource
from trainer.loop import Trainer
from trainer.loss_terms import kd_weights
from trainer.onpolicy.rollout_source import RolloutSource
from trainer.onpolicy.sampling.sampler import SamplingConfig
from trainer.parallel.mesh import SINGLE
from trainer.step import TrainStep, count_mismatch
from trainer.teacher.dispatch import Queued
from trainer.throughput import Throughput

V, T, LR = 11, 5, 0.1
REPO = Path(__file__).resolve().parents[2]


class TinyLM(torch.nn.Module):
    """Embedding + head, with the FSDP2 method the step calls (recorded)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, 8)
        self.head = torch.nn.Linear(8, V)
        self.syncs: list[bool] = []

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        return SimpleNamespace(logits=self.head(self.emb(input_ids)))

    def get_output_embeddings(self):
        return self.head

    def set_requires_gradient_sync(self, flag: bool) -> None:
        self.syncs.append(flag)


@dataclass
class FakeTerm:
    """A KD term: -log q(token 0) at the positions of its preparation (a mask). ``off``: its
    pre-count says that many terms more; ``nan``: its sum is NaN."""

    name: str
    weight: float = 1.0
    mode: str = "fake"
    off: int = 0
    nan: bool = False

    def count(self, prep, cp=None) -> int:
        return int(prep.sum()) + self.off

    def loss(self, logits, outs, prep, *, tp_group=None, cp=None) -> LossOutput:
        terms = -torch.log_softmax(logits, -1)[..., 0] * prep
        total = terms.sum() * (float("nan") if self.nan else 1.0)
        return LossOutput(total, as_count(int(prep.sum()), logits.device))


def _ids(b: int, seed: int) -> torch.Tensor:
    return torch.randint(0, V, (b, T), generator=torch.Generator().manual_seed(seed))


def _mask(b: int, seed: int) -> torch.Tensor:
    return (torch.rand(b, T, generator=torch.Generator().manual_seed(seed)) > 0.4).float()


# two microbatches of different sizes: a per-microbatch mean would weigh them alike
SIZES = (1, 3)


@pytest.fixture
def step(tmp_path):
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    said: list[str] = []
    s = TrainStep(model=model, optimizer=opt, scheduler=torch.optim.lr_scheduler.LambdaLR(
        opt, lambda _: 1.0), mesh=SINGLE, replicated_grads=[], optim=OptimConfig(grad_clip=0.0),
        checkpoints=tmp_path, device=torch.device("cpu"), say=said.append)  # fmt: skip
    s.said = said
    return s


def _shards(step: TrainStep, terms, feed) -> ShardSource:
    loss = LossConfig(mode="xtoken", ce_weight=1.0, kd_weight=0.5, combine="fixed")
    return ShardSource(
        model=step.model, terms=terms, feed=feed, loader=SimpleNamespace(epoch=0), mesh=SINGLE,
        data=SimpleNamespace(grad_accum=len(SIZES)), loss=loss,
        parallel=SimpleNamespace(logits_chunk=0), vocab_size=V, throughput=Throughput(world=1),
        device=torch.device("cpu"),
    )  # fmt: skip


class FakeFeed:
    """The teacher feed's two calls (`Feed.peek`, `Feed.next`), teachers already done."""

    def __init__(self, queued: list[Queued]) -> None:
        self.queue = list(queued)
        self.released = 0

    def peek(self, n: int) -> list[Queued]:
        return self.queue[:n]

    def next(self):
        received = SimpleNamespace(outputs={}, teacher_s=0.25, release=self._release)
        return self.queue.pop(0), [received]

    def _release(self) -> None:
        self.released += 1


def shard_source(step: TrainStep, term: FakeTerm):
    queued = []
    for i, b in enumerate(SIZES):
        ids = _ids(b, i)
        targets = torch.where(_mask(b, 10 + i) > 0, _ids(b, 20 + i), -1)
        mb = Microbatch(ids, torch.ones(b, T, dtype=torch.long), targets,
                        rows=[f"row{i}.{r}" for r in range(b)])  # fmt: skip
        queued.append(Queued({}, mb, [_mask(b, 30 + i)]))
    feed = FakeFeed(queued)
    return _shards(step, [term], feed), queued, feed


@dataclass
class FakeRollouts:
    meta: list[dict]
    new_tokens: int
    stopped: list[bool] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.meta)


def rollout_source(step: TrainStep, terms: list[FakeTerm]):
    batches = []
    for i, b in enumerate(SIZES):
        rb = SimpleNamespace(input_ids_BT=_ids(b, 40 + i), attention_mask_BT=torch.ones(b, T),
                             drops=[Counter() for _ in terms], behaviour_BT=None, packed=None,
                             chunk_drops=[Counter(boundary=0, invalid_utf8=i) for _ in terms])  # fmt: skip
        batches.append((rb, [_mask(b, 50 + i + 7 * j) for j in range(len(terms))]))
    n = sum(SIZES)
    r = FakeRollouts(
        [{"key": f"prompt{k}"} for k in range(n)], new_tokens=4 * n, stopped=[True] * n
    )
    source = RolloutSource(
        r, batches, [[{}, {}] for _ in batches], model=step.model, terms=terms, mixture=False,
        weights=kd_weights(terms), sampling=SamplingConfig(), ratio_clip=2.0, logits_chunk=0,
        tp_group=None, vocab_size=V, loader=SimpleNamespace(epoch=0), device=torch.device("cpu"),
    )  # fmt: skip
    return source, batches


def _whole(term: FakeTerm, logits, prep) -> torch.Tensor:
    out = term.loss(logits, None, prep)
    return out.sum / out.count


def _updated(model: TinyLM, loss: torch.Tensor) -> list[torch.Tensor]:
    """The parameters after one SGD step on `loss`, without touching `model`."""
    grads = torch.autograd.grad(loss, list(model.parameters()))
    return [(p - LR * g).detach() for p, g in zip(model.parameters(), grads)]


def test_shard_batches_and_rollouts_are_two_sources_of_one_step(step):
    model, term = step.model, FakeTerm("t")
    # shard batches: CE + 0.5 * KD, each over its count of the whole step
    source, queued, feed = shard_source(step, term)
    ids = torch.cat([q.mb.input_ids_BT for q in queued])
    logits = model(ids).logits
    targets = torch.cat([q.mb.targets_BT for q in queued])
    ce_out = ce(logits, targets, vocab_size=V)
    want = ce_out.sum / ce_out.count + 0.5 * _whole(
        term, logits, torch.cat([q.prep[0] for q in queued])
    )
    want_params = _updated(model, want)
    m = step.run(source, log=True)
    assert m["loss"] == pytest.approx(float(want.detach()), rel=1e-6)
    assert m["ce"] == pytest.approx(float((ce_out.sum / ce_out.count).detach()), rel=1e-6)
    assert {"kd/t", "coverage/t", "tokens_per_s", "shm_segments", "lr", "teacher_s"} <= set(m)
    # one device: its share is the whole rate; no HF config, so no FLOPs and no MFU
    assert m["tokens_per_s_per_device"] == m["tokens_per_s"] and "mfu" not in m
    assert m["teacher_s"] == 0.5 and feed.released == 2
    # every position of these rows holds a token; the trained ones are CE's targets
    assert m["padding_fraction"] == 0.0 and m["trained_tokens"] == int(ce_out.count)
    for p, w in zip(model.parameters(), want_params):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    assert (step.step, step.tokens_seen) == (1, sum(SIZES) * T)
    assert model.syncs == [False, True]  # the gradients reduce-scattered after the last only

    # rollouts: two teachers' terms weighted 3:1, no CE, through the same step
    terms = [FakeTerm("a", weight=3.0), FakeTerm("b", weight=1.0)]
    source, batches = rollout_source(step, terms)
    logits = model(torch.cat([b.input_ids_BT for b, _ in batches])).logits
    kd = [_whole(t, logits, torch.cat([p[j] for _, p in batches])) for j, t in enumerate(terms)]
    want = 0.75 * kd[0] + 0.25 * kd[1]
    want_params = _updated(model, want)
    m = step.run(source, log=True)
    assert m["loss"] == pytest.approx(float(want.detach()), rel=1e-6) and m["kd"] == m["loss"]
    assert m["kd/a"] == pytest.approx(float(kd[0].detach()), rel=1e-6) and "ce" not in m
    assert m["rollout/count"] == 4 and m["rollout/len_mean"] == 4.0
    assert m["chunks_invalid/a"] == 1 and m["rollout/stopped_frac"] == 1.0
    assert m["padding_fraction"] == 0.0  # every position of these rows holds a token
    for p, w in zip(model.parameters(), want_params):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-6)
    assert (step.step, step.tokens_seen) == (2, 2 * sum(SIZES) * T)
    assert model.syncs == [False, True, False, True]
    assert step.run(rollout_source(step, terms)[0], log=False) is None and step.step == 3


@pytest.mark.parametrize("kind", ["shards", "rollouts"])
def test_a_count_mismatch_stops_either_source_with_the_one_message(step, kind):
    before = [p.detach().clone() for p in step.model.parameters()]
    if kind == "shards":  # the pre-count says one term more per microbatch
        source, queued, _ = shard_source(step, FakeTerm("t", off=1))
        rows = [r for q in queued for r in q.mb.rows]
        name, pre = "t", sum(int(q.prep[0].sum()) + 1 for q in queued)
    else:
        source, batches = rollout_source(step, [FakeTerm("a"), FakeTerm("b", off=1)])
        rows = [f"prompt{k}" for k in range(sum(SIZES))]
        name, pre = "b", sum(int(p[1].sum()) + 1 for _, p in batches)
    with pytest.raises(RuntimeError) as err:
        step.run(source, log=True)
    msg = str(err.value)
    assert msg.startswith(f"step 1: KD term {name} (fake) counted 2 terms more or fewer")
    assert msg == count_mismatch(name=name, mode="fake", missed=2, count=pre, step=1, rows=rows)
    assert step.step == 0 and step.tokens_seen == 0  # nothing applied
    assert all(torch.equal(p, b) for p, b in zip(step.model.parameters(), before))


@pytest.mark.filterwarnings("ignore:Detected call of:UserWarning")  # the skip is on purpose
def test_a_non_finite_rollout_term_is_skipped_by_the_same_guard(step):
    step.optim = OptimConfig(grad_clip=0.0, skip_nonfinite=True)
    before = [p.detach().clone() for p in step.model.parameters()]
    m = step.run(rollout_source(step, [FakeTerm("a"), FakeTerm("b", nan=True)])[0], log=True)
    assert m["loss"] != m["loss"] and step.skipped_steps == 1 and step.step == 1
    assert step.said and "non-finite KD of teacher b (nan)" in step.said[0]
    assert all(torch.equal(p, b) for p, b in zip(step.model.parameters(), before))


def test_only_the_step_moves_the_optimizer_and_the_counters():
    assert Trainer.step.fset is None and Trainer.tokens_seen.fset is None
    moves = re.compile(r"optimizer\.step\(|scheduler\.step\(|\.step \+=|tokens_seen \+=")
    found = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "trainer").rglob("*.py"))
        if moves.search(path.read_text(encoding="utf-8"))
    ]
    assert found == ["trainer/step.py"]
