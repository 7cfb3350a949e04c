"""Fixtures shared by every test file.

- ``torch``: the PyTorch module (the test oracle), or the test is skipped where it is missing.
- ``rng``: a seeded NumPy generator, a fresh one per test so tests do not depend on order.
- ``run_graph``: ``run_graph(graph, outputs, feeds, state, executor="reference")``.
- ``native``: the native executor; its tests are skipped where no C compiler works, or fail
  there when GRAPHLM_REQUIRE_NATIVE=1 (CI sets it).
- ``fresh_process_if_jax_runs``: a test that forks runs itself again in a fresh interpreter when
  JAX's threads already run in this one (a fork of a multithreaded JAX process may deadlock,
  JAX warns); the fixture is True when it did, and the test body then returns.
- every test starts on one numpy-executor thread (the CLIs' ``--threads`` default sets the
  process-wide count; a test that runs them must not change what later tests run on).

The gradient checker is public, `graphlm.testing` (check_grads, check_vjps,
assert_executors_agree); PyTorch as the oracle is tests/gradcheck.py (check_torch, torch_hvp).
"""
from __future__ import annotations

import numpy as np
import pytest

from graphlm.testing import run


@pytest.fixture(scope="session")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture(scope="session")
def native():
    import os

    from graphlm import executors
    from graphlm.executors import native as native_module
    try:
        native_module.library()
    except native_module.NativeUnavailable as e:
        if os.environ.get("GRAPHLM_REQUIRE_NATIVE"):
            pytest.fail(f"GRAPHLM_REQUIRE_NATIVE is set but the native executor is unavailable: {e}")
        pytest.skip(f"the native executor is unavailable here: {e}")
    return executors.get("native")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def run_graph():
    return run


@pytest.fixture(autouse=True)
def _one_executor_thread():
    from graphlm.executors import numpy as numpy_executor
    if numpy_executor.get_threads() != 1:
        numpy_executor.set_threads(1)
    yield


def _jax_backends_started() -> bool:
    import sys
    bridge = sys.modules.get("jax._src.xla_bridge")
    return bool(bridge and getattr(bridge, "backends_are_initialized", lambda: False)())


@pytest.fixture
def fresh_process_if_jax_runs(request):
    """True when the test has run (and passed) in a fresh interpreter because JAX's threads run
    in this one: forking here could deadlock the child. The test body then returns."""
    import os
    import subprocess
    import sys
    if os.environ.get("GRAPHLM_FORK_TEST_SUBPROCESS") or not _jax_backends_started():
        return False
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           request.node.nodeid], cwd=request.config.rootpath, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "GRAPHLM_FORK_TEST_SUBPROCESS": "1"})
    assert proc.returncode == 0, (proc.stdout[-4000:], proc.stderr[-2000:])
    return True
