import pytest
import torch

from tensorfold.family.forward_pass import ForwardPass, PageOverrun, StreamRows
from tensorfold.ops.attention import paged_attention
from tensorfold.ops.linear import linear


def test_rows_map_through_page_tables():
    fp = ForwardPass(
        [StreamRows(0, 3, [7, 8], [5, 2], "all"), StreamRows(1, 0, [9], [1], "last")], page_rows=4
    )
    assert fp.tokens.tolist() == [7, 8, 9]
    assert fp.positions.tolist() == [3, 4, 0]
    # position 3 -> page 5 offset 3; position 4 -> page 2 offset 0
    assert fp.write_index.tolist() == [23, 8, 4]
    assert fp.read_index(0).tolist() == [20, 21, 22, 23, 8]
    assert fp.logit_rows.tolist() == [0, 1, 2]
    parts = fp.split_logits(torch.arange(3.0)[:, None])
    assert [p.shape[0] for p in parts] == [2, 1]


def test_rows_past_a_streams_pages_are_refused():
    with pytest.raises(PageOverrun, match="holds 1"):
        ForwardPass([StreamRows(0, 3, [1, 2], [0])], page_rows=4)


def test_linear_gives_a_row_the_same_bits_whatever_else_is_in_the_pass():
    torch.manual_seed(0)
    w = torch.randn(96, 64)
    x = torch.randn(70, 64)
    full = linear(x, w)
    for m in (1, 2, 15, 16, 17, 33):
        assert torch.equal(linear(x[:m], w), full[:m])
    assert torch.equal(linear(x[40:41], w), full[40:41])


def _reference(q, k, v, positions, scale, window=None):
    keys = torch.arange(k.shape[0])
    visible = keys[None] <= positions[:, None]
    if window:
        visible &= keys[None] > positions[:, None] - window
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("nhd,khd->hnk", q, kk) * scale
    return torch.einsum("hnk,khd->nhd", s.masked_fill(~visible, float("-inf")).softmax(-1), vv)


@pytest.mark.parametrize("window", [None, 70])
def test_paged_attention_matches_softmax_and_is_invariant_to_the_cut(window):
    torch.manual_seed(1)
    page_rows, pages = 8, list(range(39, -1, -1))  # a reversed page table
    k, v = torch.randn(320, 2, 16), torch.randn(320, 2, 16)
    q = torch.randn(50, 4, 16)
    whole = ForwardPass([StreamRows(0, 100, list(range(50)), pages, "all")], page_rows)
    out = paged_attention(q, k, v, whole, scale=0.25, window=window)
    idx = whole.read_index(0)
    ref = _reference(q, k[idx], v[idx], torch.arange(100, 150), 0.25, window)
    assert (out - ref).abs().max() < 1e-5
    cut = ForwardPass(
        [StreamRows(0, 100, list(range(7)), pages, "all"), StreamRows(1, 107, [0] * 43, pages)],
        page_rows,
    )
    assert torch.equal(paged_attention(q, k, v, cut, scale=0.25, window=window), out)
