"""Unit tests of the logit channel: slot layout, spec checks, shared-memory arena, the teacher
program's outputs, and the whole API in in-process mode (the same channel as the worker path,
with the inline backend)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.tiny import save_tiny_llama
from tokenbridge.teacher.outputs import TeacherOutputSpec, Workspace
from trainer.config.schema import TeacherConfig
from trainer.teacher.channel import ChannelConfig, TeacherChannel
from trainer.teacher.model_program import TeacherModelProgram, teacher_forward
from trainer.teacher.ring import (
    ALIGN,
    ChannelError,
    ShmArena,
    SlotRing,
    TensorSpec,
    check_shapes,
    plan_layout,
    shm_mappings,
)
from trainer.teacher.worker import TeacherContext

VOCAB = 49_152  # the real SmolLM2 tokenizer's vocabulary


@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, student_dir):
    """A random-init 2-layer Llama with the real SmolLM2 tokenizer's vocabulary width."""
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(student_dir).vocab_size == VOCAB
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-teacher"), VOCAB)


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread: the shared 2-core machines punish spinning OpenMP threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_layout_aligned_disjoint_and_sized():
    ins = {"ids": TensorSpec((3, 5), torch.int64), "mask": TensorSpec((3, 5), torch.bool)}
    outs = {"a": TensorSpec((3, 5, 7), torch.float16), "b": TensorSpec((1,), torch.int32)}
    lay = plan_layout(ins, outs, depth=3)
    spans = []
    for (part, name), off in lay.offsets.items():
        assert off % ALIGN == 0, (part, name, off)
        spans.append((off, off + lay.spec(part)[name].nbytes))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert spans[-1][1] <= lay.slot_nbytes and lay.slot_nbytes % ALIGN == 0
    assert lay.total_nbytes == 3 * lay.slot_nbytes
    with pytest.raises(ValueError, match="output spec is empty"):
        plan_layout(ins, {}, depth=2)
    with pytest.raises(ValueError, match="positive"):
        TensorSpec((0, 3), torch.float32)


def test_check_shapes_names_the_field():
    spec = {"x": TensorSpec((2, 4), torch.float32)}
    assert check_shapes(spec, {"x": torch.zeros(1, 3)}, where="w") == {"x": (1, 3)}
    with pytest.raises(ChannelError, match=r"w: 'x' has dtype torch.float64"):
        check_shapes(spec, {"x": torch.zeros(2, 4, dtype=torch.float64)}, where="w")
    with pytest.raises(ChannelError, match=r"'x' has shape \(3, 4\).*at most \(2, 4\)"):
        check_shapes(spec, {"x": torch.zeros(3, 4)}, where="w")
    with pytest.raises(ChannelError, match=r"'x' has shape \(8,\)"):
        check_shapes(spec, {"x": torch.zeros(8)}, where="w")
    with pytest.raises(ChannelError, match=r"missing \['x'\], unexpected \['y'\]"):
        check_shapes(spec, {"y": torch.zeros(2, 4)}, where="w")


def test_config_validation():
    with pytest.raises(ValueError, match="mode"):
        ChannelConfig(mode="thread")
    with pytest.raises(ValueError, match="depth"):
        ChannelConfig(depth=0)
    with pytest.raises(ValueError, match="timeout_s"):
        ChannelConfig(timeout_s=0)


def test_shm_arena_attach_sees_writes_and_close_unlinks():
    owner = ShmArena(4096)
    path = f"/dev/shm/{owner.name}"
    assert os.path.exists(path)
    other = ShmArena(4096, name=owner.name)  # a second mapping, as the worker makes
    owner.tensor[100:104] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert other.tensor[100:104].tolist() == [1, 2, 3, 4]
    other.close()
    assert os.path.exists(path)  # only the owner unlinks
    owner.close()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError):
        ShmArena(4096, name=owner.name)  # attaching never recreates a released segment


def test_shm_name_goes_once_mapped_views_outlive_close():
    """The lifetime the trainer relies on: unlinking the name (as the student does once the
    worker has mapped the segment) leaves both mappings working and /dev/shm empty; a view kept
    past close() still reads valid memory (it used to read an unmapped page: a segfault)."""
    owner = ShmArena(1 << 16)
    other = ShmArena(1 << 16, name=owner.name)
    owner.unlink()
    assert not os.path.exists(f"/dev/shm/{owner.name}")
    assert shm_mappings()[owner.name] >= 2 << 16  # both mappings, here in one process
    owner.tensor[:4] = torch.tensor([9, 8, 7, 6], dtype=torch.uint8)
    assert other.tensor[:4].tolist() == [9, 8, 7, 6]
    view = owner.tensor[:4]
    owner.close()
    other.close()
    assert view.tolist() == [9, 8, 7, 6] and owner.tensor is None
    view.fill_(1)  # writable too: the mapping is the view's until it goes
    del view
    assert owner.name not in shm_mappings()  # the last view gone, the memory is unmapped
    owner.close()  # idempotent


def test_ring_views_are_contiguous_prefixes():
    lay = plan_layout({}, {"v": TensorSpec((4, 6), torch.float32)}, depth=2)
    ring = SlotRing.create(lay, device=torch.device("cpu"), shared=True)
    try:
        src = torch.arange(12, dtype=torch.float32).view(3, 4)
        shapes = ring.write(1, "out", {"v": src}, where="t")
        v = ring.view(1, "out", "v", shapes["v"])
        assert v.is_contiguous() and torch.equal(v, src)
        assert v.data_ptr() == ring.slot_ptr(1) + lay.offsets[("out", "v")]
        ring.poison(1, "out")
        assert torch.isnan(v).all()
        del v
    finally:
        name = ring.shm_name
        ring.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_teacher_forward_targets_and_columns_match_dense_log_softmax():
    """The program's compute, on a stand-in model with known logits: the lm_head applied three
    positions at a time (the chunked path) and whole (a model without ``.model``) agree with a
    dense log-softmax."""
    g = torch.Generator().manual_seed(1)
    B, T, H, V = 2, 7, 6, 50
    hidden = torch.randn(B, T, H, generator=g)
    head = torch.nn.Linear(H, V, bias=False)
    torch.nn.init.normal_(head.weight, std=3.0, generator=g)
    logits = head(hidden).detach()
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[1, 5:] = 0  # right padding
    cols = torch.tensor([3, 7, 11, 40])
    spec = TeacherOutputSpec(vocab_size=V, topk=4, columns=4, target=True)
    chunked = SimpleNamespace(
        model=lambda **kw: SimpleNamespace(last_hidden_state=hidden),
        lm_head=head,
        config=SimpleNamespace(),
    )
    whole = lambda **kw: SimpleNamespace(logits=logits)  # noqa: E731
    program = TeacherModelProgram(
        TeacherConfig(path="unused"), spec, columns=cols, max_batch=B, max_len=T
    )
    logp = torch.log_softmax(logits.double(), dim=-1)
    want = torch.zeros(B, T, dtype=torch.float64)
    for b in range(B):
        for t in range(int(mask[b].sum()) - 1):  # a next token exists inside the row
            want[b, t] = logp[b, t, ids[b, t + 1]]
    top = torch.topk(logp, 4, dim=-1)
    work = Workspace()  # reused across calls and shapes, as a worker keeps it
    runs = [(chunked, None, 3), (whole, None, 3), (chunked, work, 3), (chunked, work, 2)]
    for model, ws, chunk in runs:
        # grad mode on, a weight that wants grad: the teacher forward never builds a graph
        out = teacher_forward(
            model, ids, mask, spec=spec, columns=cols, chunk=chunk, workspace=ws
        ).tensors()
        assert check_shapes(program.output_spec(), out, where="t")
        torch.testing.assert_close(out["target_logprob"].double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(out["col_logprobs"].double(), logp[..., cols], rtol=0, atol=1e-5)
        torch.testing.assert_close(out["topk_logprobs"].double(), top.values, rtol=0, atol=1e-5)
    # Gemma's cap, applied in place on the reused product: the capped dense reference
    capped = SimpleNamespace(
        **{**vars(chunked), "config": SimpleNamespace(final_logit_softcapping=2.0)}
    )
    out = teacher_forward(capped, ids, mask, spec=spec, columns=cols, chunk=3, workspace=work)
    cap_logp = torch.log_softmax((torch.tanh(logits / 2.0) * 2.0).double(), dim=-1)
    torch.testing.assert_close(out.col_logprobs.double(), cap_logp[..., cols], rtol=0, atol=1e-5)
    # a bf16 teacher (CUDA's default): its product goes to a bf16 buffer of the same workspace
    head16 = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    head16.weight.data.copy_(head.weight.data)
    bf16 = SimpleNamespace(
        model=lambda **kw: SimpleNamespace(last_hidden_state=hidden.bfloat16()),
        lm_head=head16,
        config=SimpleNamespace(),
    )
    out = teacher_forward(bf16, ids, mask, spec=spec, columns=cols, chunk=3, workspace=work)
    # bf16 logits of size ~10 round by ~0.03-0.06; measured max error 0.12 here
    torch.testing.assert_close(out.col_logprobs.double(), logp[..., cols], rtol=0, atol=0.25)
    with pytest.raises(ValueError, match="give that many ids"):
        TeacherModelProgram(
            TeacherConfig(path="unused"), spec, columns=cols[:2], max_batch=B, max_len=T
        )


def program(model_dir: str, spec: TeacherOutputSpec, **kw) -> TeacherModelProgram:
    return TeacherModelProgram(TeacherConfig(path=model_dir), spec, **kw)


def _batch(rows: int, length: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.int64)
    mask[0, length - 2 :] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_inprocess_channel_round_trip_reuse_and_lifetime(tiny_teacher_dir):
    spec = TeacherOutputSpec(vocab_size=VOCAB, topk=4, target=True)
    make = lambda: program(tiny_teacher_dir, spec, max_batch=2, max_len=12)  # noqa: E731
    reference = make()
    reference.setup(TeacherContext(torch.device("cpu")))
    config = ChannelConfig(mode="inprocess", depth=2, poison=True)
    with TeacherChannel(make(), config=config) as ch:
        assert ch.shm_name is None and ch.worker_pid is None
        ptrs: dict[int, set[int]] = {0: set(), 1: set()}
        sizes = [(2, 12), (1, 7), (2, 9), (1, 12)] * 2
        ch.submit(_batch(*sizes[0], seed=0))
        for i, size in enumerate(sizes):
            if i + 1 < len(sizes):
                ch.submit(_batch(*sizes[i + 1], seed=i + 1))  # one microbatch ahead
            with ch.receive() as r:
                assert r.seq == i
                want = reference(_batch(*size, seed=i))
                for name, t in r.outputs.items():
                    assert torch.equal(t, want[name]), (i, name)
                ptrs[r.slot].add(r.outputs["topk_ids"].data_ptr())
                assert r.outputs["tail_logprob"].shape == size
        assert all(len(p) == 1 for p in ptrs.values()) and ptrs[0] != ptrs[1]

        # Lifetime: after release the handle refuses, and a view kept by mistake is poisoned.
        ch.submit(_batch(2, 12, seed=99))
        with ch.receive() as r:
            kept = r.outputs["topk_logprobs"]
            saved = kept.clone()
        with pytest.raises(ChannelError, match="slot was released"):
            _ = r.outputs
        assert torch.isnan(kept).all() and torch.isfinite(saved).all()

        # Flow control: at most `depth` microbatches in flight; errors leave the ring usable.
        ch.submit(_batch(1, 5, seed=1))
        ch.submit(_batch(1, 5, seed=2))
        with pytest.raises(ChannelError, match="no free slot"):
            ch.submit(_batch(1, 5, seed=3))
        ch.receive().release()
        with pytest.raises(ChannelError, match="'attention_mask' has dtype torch.int32"):
            ch.submit(
                {**_batch(1, 5, seed=4), "attention_mask": torch.ones(1, 5, dtype=torch.int32)}
            )
        ch.submit(_batch(1, 5, seed=5))
        assert ch.in_flight == 2
        ch.receive().release()
        ch.receive().release()
        with pytest.raises(ChannelError, match="nothing submitted"):
            ch.receive()
    with pytest.raises(ChannelError, match="closed"):
        ch.submit(_batch(1, 5, seed=6))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inprocess_teacher_on_its_own_cuda_stream_equals_it_called_directly(tiny_teacher_dir):
    """The GPU twin of the round trip above: the teacher runs on a side stream, a microbatch
    ahead, and the student's stream waits on its event: outputs equal the same teacher called
    directly on the default stream, with nothing synchronised by hand."""
    device = torch.device("cuda", torch.cuda.current_device())
    spec = TeacherOutputSpec(vocab_size=VOCAB, topk=4, target=True)
    make = lambda: program(tiny_teacher_dir, spec, max_batch=2, max_len=12)  # noqa: E731
    reference = make()
    reference.setup(TeacherContext(device))
    sizes = [(2, 12), (1, 7), (2, 9), (1, 12)]
    with TeacherChannel(make(), device=device, config=ChannelConfig(mode="inprocess")) as ch:
        assert ch._backend._stream is not None
        ch.submit({k: v.to(device) for k, v in _batch(*sizes[0], seed=0).items()})
        for i, size in enumerate(sizes):
            if i + 1 < len(sizes):
                nxt = _batch(*sizes[i + 1], seed=i + 1)
                ch.submit({k: v.to(device) for k, v in nxt.items()})
            with ch.receive() as r:
                want = reference({k: v.to(device) for k, v in _batch(*size, seed=i).items()})
                for name, t in r.outputs.items():
                    assert t.device == device
                    torch.testing.assert_close(t, want[name], rtol=1e-5, atol=1e-5)


def test_inprocess_teacher_error_propagates_and_breaks_the_channel(tiny_teacher_dir):
    spec = TeacherOutputSpec(vocab_size=VOCAB, topk=2)
    teacher = program(tiny_teacher_dir, spec, max_batch=1, max_len=4)
    with TeacherChannel(teacher, config=ChannelConfig(mode="inprocess")) as ch:
        bad = {
            "input_ids": torch.tensor([[1, VOCAB + 5]]),
            "attention_mask": torch.ones(1, 2).long(),
        }
        with pytest.raises(IndexError):  # the teacher's own exception, with its traceback
            ch.submit(bad)
        with pytest.raises(ChannelError, match="broken: the in-process teacher failed"):
            ch.submit(_batch(1, 4, seed=0))
