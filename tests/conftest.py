"""Fixtures shared by every test file.

- ``torch``: the PyTorch module (the test oracle), or the test is skipped where it is missing.
- ``rng``: a seeded NumPy generator, a fresh one per test so tests do not depend on order.
- ``run_graph``: ``run_graph(graph, outputs, feeds, state, executor="reference")``.
- every test starts on one numpy-executor thread (the CLIs' ``--threads`` default sets the
  process-wide count; a test that runs them must not change what later tests run on).

The gradient and torch checkers themselves live in tests/gradcheck.py
(``from tests.gradcheck import check_grads, check_torch, check_second_order``).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.gradcheck import run


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def run_graph():
    return run


@pytest.fixture(autouse=True)
def _one_executor_thread():
    from executors import numpy_executor
    if numpy_executor.get_threads() != 1:
        numpy_executor.set_threads(1)
    yield
