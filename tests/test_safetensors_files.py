"""modeling_dsv41.safetensors_files: rows of a stored tensor read without mapping the file equal safetensors' own
reading of them, for every dtype the release stores; bad rows and unknown dtypes are refused."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from modeling_dsv41.safetensors_files import mapped_tensor, read_rows, safetensors_header


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(7, 5, generator=generator).to(torch.bfloat16),
        "fp8": torch.randn(9, 3, 4, generator=generator).to(torch.float8_e4m3fn),
        "e8m0": torch.randint(100, 140, (6, 2), dtype=torch.uint8, generator=generator).view(torch.float8_e8m0fnu),
        "fp4_packed": torch.randint(-128, 128, (4, 8), dtype=torch.int8, generator=generator),
        "scalar": torch.tensor(3.5),
        "i64": torch.arange(11),
    }
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    save_file(tensors, path)
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.mark.parametrize("key", ["bf16", "fp8", "e8m0", "fp4_packed", "i64"])
def test_rows_equal_safetensors_reading(stored, key):
    expected = load_file(stored)[key]
    data_start, header = safetensors_header(stored)
    n = expected.shape[0]
    for start, stop in [(0, n), (1, n - 2), (n - 1, n), (2, 2)]:
        rows = read_rows(stored, data_start, header[key], start, stop)
        assert rows.dtype == expected.dtype and rows.shape == expected[start:stop].shape
        assert torch.equal(_bits(rows), _bits(expected[start:stop])), (key, start, stop)
    assert torch.equal(_bits(mapped_tensor(stored, data_start, header[key])), _bits(expected))


def test_a_scalar_is_read_whole(stored):
    data_start, header = safetensors_header(stored)
    value = read_rows(stored, data_start, header["scalar"], 0, 0)
    assert value.shape == () and value.item() == 3.5


def test_bad_rows_and_dtypes_are_refused(stored):
    data_start, header = safetensors_header(stored)
    with pytest.raises(ValueError, match=r"rows \[5, 8\) of a tensor of 7 rows"):
        read_rows(stored, data_start, header["bf16"], 5, 8)
    with pytest.raises(ValueError, match="safetensors dtype C64 is not supported"):
        read_rows(stored, data_start, {**header["bf16"], "dtype": "C64"}, 0, 1)


def test_a_truncated_file_is_refused(stored, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(stored.read_bytes()[:-8])
    data_start, header = safetensors_header(cut)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with pytest.raises(OSError, match="ends before the bytes"):
        read_rows(cut, data_start, header[last], 0, header[last]["shape"][0] if header[last]["shape"] else 0)


def test_rows_are_read_into_a_given_tensor_of_their_size(stored):
    expected = load_file(stored)["fp8"]
    data_start, header = safetensors_header(stored)
    out = torch.empty(4, 3, 4, dtype=torch.int8)  # the bytes as stored, whatever the dtype
    assert read_rows(stored, data_start, header["fp8"], 2, 6, out=out) is out
    assert torch.equal(out.view(torch.uint8), expected[2:6].view(torch.uint8))
    with pytest.raises(ValueError, match="reading 48 bytes into a cpu tensor of 36 bytes"):
        read_rows(stored, data_start, header["fp8"], 2, 6, out=torch.empty(3, 3, 4, dtype=torch.int8))
    with pytest.raises(ValueError, match="into a non-contiguous"):
        read_rows(stored, data_start, header["fp8"], 2, 6, out=torch.empty(4, 4, 3, dtype=torch.int8).transpose(1, 2))
