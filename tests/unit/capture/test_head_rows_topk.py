"""The detail queries' mass count (keys needed, largest first, for ``mass_gamma`` of a row's
mass) taken from a partial top-k equals a full sort's, whether a row settles within 64 keys,
within 512, or needs all of them (diffuse rows, ties, gamma 1)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from attnprof.capture import head_rows


def _sorted_count(p: torch.Tensor, gamma: float) -> Any:
    srt = torch.sort(p.double(), -1, descending=True).values.cumsum(-1)
    need = gamma * p.double().sum(-1, keepdim=True)
    return np.minimum((srt < need).sum(-1).numpy() + 1, p.shape[1])


@pytest.mark.parametrize("gamma", [0.5, 0.9, 0.99, 1.0])
def test_partial_top_k_counts_what_a_full_sort_counts(gamma: float) -> None:
    g = torch.Generator().manual_seed(1)
    n = 3000
    rows = [torch.softmax(torch.randn(n, generator=g) * t, -1) for t in (12.0, 4.0, 2.0, 0.3)]
    rows.append(torch.full((n,), 1.0 / n))  # all tied
    rows.append(torch.cat([torch.full((100,), 5e-3), torch.zeros(n - 100)]))  # ties and zeros
    p = torch.stack(rows).float()
    got = head_rows._mass_count(p, gamma)
    want = _sorted_count(p, gamma)
    np.testing.assert_array_equal(got, want)
    if gamma == 0.9:  # the rows really take each path: within 64, within 512, a full sort
        assert got.min() <= 64 and any(64 < x <= 512 for x in got) and got.max() > 512
