"""The curvature engine's start vectors: unbiased probes that are never exactly orthogonal to a sign pattern.

Two Rademacher starts are exactly orthogonal to an eigenvector ``(e_i - e_j) / sqrt(2)`` with probability 1/2
each, and a whole end of the spectrum was then stored as converged (outside trial 10). The rows are random
signs times magnitudes uniform on ``[0.5, 1.5]``, rescaled to norm ``sqrt(D)``.
"""

import math

import pytest
import torch

from cockpit_like.backends.curvature_engine import MAGNITUDE_SPREAD, start_vectors, step_generator
from cockpit_like.backends.randomness import generator


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rows_have_norm_sqrt_d_and_bounded_entries(dtype):
    rows = start_vectors(3, 500, dtype, "cpu", step_generator(4, "lanczos probes"))
    assert rows.shape == (3, 500) and rows.dtype == dtype
    torch.testing.assert_close(rows.double().norm(dim=1), torch.full((3,), math.sqrt(500), dtype=torch.float64),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)
    # entries of both signs, magnitudes within the spread (up to the rescaling, which is near 1)
    magnitudes = rows.double().abs()
    assert bool((rows > 0).any()) and bool((rows < 0).any())
    assert float(magnitudes.min()) > 0.8 * (1 - MAGNITUDE_SPREAD) and float(magnitudes.max()) < 1.2 * (1 + MAGNITUDE_SPREAD)
    # the same draw for the same step and purpose, another for another step
    assert torch.equal(rows, start_vectors(3, 500, dtype, "cpu", step_generator(4, "lanczos probes")))
    assert not torch.equal(rows, start_vectors(3, 500, dtype, "cpu", step_generator(5, "lanczos probes")))


def test_unit_probes_are_isotropic_so_traces_are_unbiased():
    """``E[u u^T] = I / D`` for ``u = row / sqrt(D)``: the mean of 20,000 draws within 5 standard errors of it."""
    D, draws = 5, 20000
    rows = start_vectors(draws, D, torch.float64, "cpu", generator(0, "isotropy test"))
    units = rows / math.sqrt(D)
    outer = torch.einsum("ki,kj->kij", units, units)
    mean, error = outer.mean(0), outer.std(0) / math.sqrt(draws)
    deviation = ((mean - torch.eye(D, dtype=torch.float64) / D).abs() / error).max()
    assert float(deviation) < 5, float(deviation)
    # and so D u^T A u averages to tr(A) for a fixed symmetric A (here with a negative eigenvalue)
    a = torch.randn(D, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    a = a + a.T
    samples = D * torch.einsum("ki,ij,kj->k", units, a, units)
    assert abs(float(samples.mean() - a.trace())) < 5 * float(samples.std()) / math.sqrt(draws)


def test_never_exactly_orthogonal_to_a_difference_of_two_coordinates():
    """Over 2,000 rows of 12 entries no two entries are equal or opposite (a +-1 row: half of all pairs)."""
    rows = start_vectors(2000, 12, torch.float64, "cpu", generator(0, "pairs test"))
    differences = (rows.unsqueeze(2).abs() - rows.unsqueeze(1).abs()).abs()
    off_diagonal = ~torch.eye(12, dtype=torch.bool)
    assert float(differences[:, off_diagonal].min()) > 0
    # with plain signs the same check fails at once
    signs = rows.sign()
    assert float((signs.unsqueeze(2).abs() - signs.unsqueeze(1).abs()).abs()[:, off_diagonal].min()) == 0
