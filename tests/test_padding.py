"""Left-padding helpers: per-row shifts and rolls, exact and free of data-dependent control flow."""

import torch

from modeling_dsv41.padding import left_padding_shift, roll_rows


def test_shift_counts_leading_padding_only():
    mask = torch.tensor([[0, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 1]])
    assert left_padding_shift(mask).tolist() == [2, 0, 1]  # trailing padding does not count
    assert left_padding_shift(torch.ones(2, 4, dtype=torch.long)).tolist() == [0, 0]
    assert left_padding_shift(None) is None
    assert left_padding_shift(torch.ones(2, 1, 4, 4)) is None  # a 4-D mask is not a padding mask


def test_roll_by_the_shift_aligns_rows_and_rolls_back_exactly():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    hidden = torch.randn(2, 5, 3)
    shift = left_padding_shift(mask)
    aligned = roll_rows(hidden, -shift)
    assert torch.equal(aligned[0, :3], hidden[0, 2:]) and torch.equal(aligned[1], hidden[1])
    assert torch.equal(roll_rows(aligned, shift), hidden)


def test_align_compiles_without_graph_break():
    def align(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return roll_rows(hidden, -left_padding_shift(mask))

    torch._dynamo.reset()
    compiled = torch.compile(align, backend="eager", fullgraph=True)  # fullgraph: any graph break raises
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    hidden = torch.randn(2, 4, 3)
    assert torch.equal(compiled(hidden, mask), align(hidden, mask))
