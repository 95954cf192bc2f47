"""The host's numpy sampling (the first token after prefill) equals verify.py's torch rule, ties included."""

import numpy as np
import pytest
import torch

from specexport import sampling as host
from specexport import verify

CASES = [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.9), (0.8, 10, 0.95), (1.0, 1, 1.0),
         (1.0, 0, 0.05), (2.0, 200, 0.5)]


@pytest.mark.parametrize("ties", [False, True])
def test_process_logits_matches_torch(ties):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), 1, 97, generator=g) * 3
    if ties:  # a coarse grid: many logits equal the k-th largest or the top-p threshold
        logits = logits.round()
    t = torch.tensor([c[0] for c in CASES])
    k = torch.tensor([c[1] for c in CASES])
    p = torch.tensor([c[2] for c in CASES])
    want = verify.process_logits(logits, t, k, p)[:, 0]
    got = host.process_logits(logits[:, 0].numpy(), t.numpy(), k.numpy(), p.numpy())
    assert got.dtype == np.float32
    assert np.array_equal(got > 0, want.numpy() > 0)  # the same tokens kept
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7)


def test_sample_from_matches_torch():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(64, 50, generator=g) * 2, -1)
    probs[:, 7] = 0  # zero-probability bins are never drawn
    u = torch.rand(64, generator=g)
    u[:4] = torch.tensor([0.0, 0.999999, 0.5, 0.25])
    want = verify.sample_from(probs, u)
    got = host.sample_from(probs.numpy(), u.numpy())
    assert got.dtype == np.int64 and got.tolist() == want.tolist()
    assert 7 not in got.tolist()


def test_row_stream_is_seeded_float32():
    a, b = host.row_stream(5).random(8, dtype=np.float32), host.row_stream(5).random(8, dtype=np.float32)
    assert a.dtype == np.float32 and np.array_equal(a, b) and ((0 <= a) & (a < 1)).all()
    assert not np.array_equal(a, host.row_stream(6).random(8, dtype=np.float32))
