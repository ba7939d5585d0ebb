"""What the extraction tests share: one Ray session per test module, for the tests of the Ray executor and the
cluster checks (its start-up is the slow part; extraction itself runs without Ray by default), and the
comparison of two stores' rows."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from tvrpipe.cluster import ray_init

    ray_init(None, num_cpus=2)
    yield
    ray.shutdown()


def _assert_same_rows(a, b, name: str) -> None:
    """Two stores hold the same rows of ``name``: masks and timestamps exactly; embeddings to one float16
    ulp. An embedding is encoded in a batch of other size and neighbours when a run is resumed or
    repaired, or runs with other workers; the CLIP's float32 matmuls then sum in another order (a few
    ulps), and the float16 rounding of the store can turn that into one float16 ulp (2^-10 relative)."""
    x, y = a.array(name)[:], b.array(name)[:]
    if x.dtype != np.float16:
        np.testing.assert_array_equal(x, y, err_msg=name)
        return
    np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), rtol=2.0 ** -10, atol=2.0 ** -24,
                               err_msg=name)


@pytest.fixture
def same_rows():
    """``same_rows(a, b, name)``: assert that the open stores ``a`` and ``b`` hold the same rows of the array
    ``name`` (masks and timestamps exactly, embeddings to one float16 ulp)."""
    return _assert_same_rows

