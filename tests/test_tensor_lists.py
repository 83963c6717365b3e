"""``functional.tensor_lists``: norms of tensor lists in groups, against the norm of the flattened concatenation."""

from __future__ import annotations

import pytest
import torch

from cockpit_like.functional import tensor_lists


def _tensors(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(3, 4), (5,), (), (2, 3, 2), (7, 1), (0,)]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def test_norms_and_the_total_norm_match_a_concatenation():
    tensors = _tensors()
    expected = torch.tensor([float(sum(x * x for x in t.reshape(-1).tolist()) ** 0.5) for t in tensors], dtype=torch.float64)
    torch.testing.assert_close(tensor_lists.norms(tensors), expected, rtol=1e-14, atol=0)
    flat = torch.cat([t.reshape(-1) for t in tensors])
    torch.testing.assert_close(tensor_lists.squared_norm(tensors), flat.pow(2).sum(), rtol=1e-14, atol=0)
    torch.testing.assert_close(tensor_lists.norm(iter(tensors)), flat.pow(2).sum().sqrt(), rtol=1e-14, atol=0)


def test_groups_split_by_dtype_and_size_and_keep_the_order():
    tensors = _tensors()
    tensors[3] = tensors[3].float()  # a dtype change starts a group
    found = list(tensor_lists.groups(tensors, limit=8 * 12))  # 12 float64 entries per group at most
    flat = [t for group in found for t in group]
    assert len(flat) == len(tensors) and all(a is b for a, b in zip(flat, tensors))
    assert [len(group) for group in found] == [1, 2, 1, 2]  # [12] | [5, ()] | float32 | [7, 0-entry]
    for group in found:
        assert len({(t.dtype, t.device) for t in group}) == 1
        assert len(group) == 1 or sum(t.numel() * t.element_size() for t in group) <= 8 * 12
    # the mixed-dtype norms promote as torch.stack does
    assert tensor_lists.norms(tensors).dtype == torch.float64


def test_a_generator_is_consumed_a_group_at_a_time():
    alive = []

    def made():
        for t in _tensors():
            alive.append(t)
            yield t

    total = tensor_lists.squared_norm(made())
    flat = torch.cat([t.reshape(-1) for t in _tensors()])
    torch.testing.assert_close(total, flat.pow(2).sum(), rtol=1e-14, atol=0)
    assert len(alive) == 6


def test_no_tensors():
    assert tensor_lists.norms([]).numel() == 0
    with pytest.raises(ValueError, match="no tensors"):
        tensor_lists.squared_norm([])


def test_differences_are_the_pairs_differences_a_group_at_a_time():
    a, b = _tensors(1), _tensors(2)
    b[3] = b[3].float()  # a pair of mixed dtypes: alone, by torch.sub's promotion
    found = list(tensor_lists.differences(a, b, alpha=0.5, limit=8 * 12))
    assert len(found) == len(a)
    for got, x, y in zip(found, a, b):
        expected = torch.tensor([u - 0.5 * v for u, v in zip(x.reshape(-1).tolist(), y.double().reshape(-1).tolist())],
                                dtype=torch.float64).reshape(x.shape)
        torch.testing.assert_close(got, expected, rtol=1e-15, atol=1e-15)
    with pytest.raises(ValueError):
        list(tensor_lists.differences(a, b[:-1]))  # not one length
