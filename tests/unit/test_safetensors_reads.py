"""Boxes of safetensors tensors read with plain file reads (`tokenbridge.safetensors_reads`) are
bit for bit what the safetensors library's ``get_slice`` gives, converted with ``.to`` (the read
it replaces): every dtype the models use, 0-d to 3-d, boxes of rows (in place) and of columns
(through blocks, cut small here so a box spans several), another destination dtype; a file
whose header does not match its size is refused naming the file and the tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenbridge import safetensors_reads
from tokenbridge.safetensors_reads import SafetensorsFileError, read_box, read_header
from tokenbridge.weight_slices import ShardTarget


@pytest.fixture(scope="module")
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    t = {
        "f32": torch.randn(37, 24, generator=g),
        "bf16": torch.randn(29, 16, generator=g).bfloat16(),
        "f16": torch.randn(11, 5, 6, generator=g).half(),
        "i64": torch.randint(-(2**40), 2**40, (13,), generator=g),
        "bool": torch.rand(7, 3, generator=g) > 0.5,
        "f8": torch.randn(9, 8, generator=g).to(torch.float8_e4m3fn),
        "scalar": torch.tensor(3.25),
    }
    return t


@pytest.fixture(scope="module")
def path(tensors, tmp_path_factory):
    p = tmp_path_factory.mktemp("st") / "w.safetensors"
    save_file(tensors, p, metadata={"format": "pt"})
    return p


def boxes(shape: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """Whole, an uneven box of rows, none of the rows, and (2-d and up) some columns too."""
    whole = tuple(slice(0, n) for n in shape)
    if not shape:
        return [()]
    out = [whole, (slice(3, shape[0] - 2), *whole[1:]), (slice(4, 4), *whole[1:])]
    if len(shape) > 1:
        out.append((slice(1, shape[0]), slice(1, shape[1] - 1), *whole[2:]))
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("block_bytes", [16 * 2**20, 40])
@pytest.mark.parametrize("key", ["f32", "bf16", "f16", "i64", "bool", "f8", "scalar"])
def test_read_box_equals_get_slice(path, tensors, monkeypatch, key, block_bytes):
    monkeypatch.setattr(safetensors_reads, "BLOCK_BYTES", block_bytes)
    entry = read_header(path)[key]
    assert (entry.dtype, entry.shape) == (tensors[key].dtype, tuple(tensors[key].shape))
    floating = tensors[key].is_floating_point()
    dtypes = [entry.dtype, torch.float32, torch.bfloat16] if floating else [entry.dtype]
    with safe_open(path, framework="pt") as h, open(path, "rb", buffering=0) as f:
        for box in boxes(entry.shape):
            part = h.get_slice(key)[box] if box else h.get_tensor(key)
            for dtype in dtypes:
                want = part.to(dtype=dtype)
                out = torch.full(want.shape, 7, dtype=dtype)  # not what any read gives
                read_box(f, entry, ShardTarget(out, box, entry.shape), what=key)
                assert torch.equal(bits(out), bits(want)), (box, dtype)


def test_a_header_that_does_not_match_the_file_is_refused(path, tmp_path):
    data = path.read_bytes()
    short = tmp_path / "short.safetensors"
    short.write_bytes(data[:-4])  # the last tensor's bytes cut
    with pytest.raises(SafetensorsFileError, match=r"short\.safetensors: \w+: data_offsets"):
        read_header(short)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header["f32"]["dtype"] = "Q7"
    text = json.dumps(header).encode()
    odd = tmp_path / "odd.safetensors"
    odd.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    with pytest.raises(SafetensorsFileError, match=r"odd\.safetensors: f32: unknown dtype 'Q7'"):
        read_header(odd)
    text_file = tmp_path / "config.safetensors"
    text_file.write_text('{"not": "weights"}')
    with pytest.raises(SafetensorsFileError, match="not a safetensors file"):
        read_header(text_file)
