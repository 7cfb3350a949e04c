"""graphlm's pytest plugin, loaded through the ``pytest11`` entry point wherever graphlm is
installed. It adds fixtures and one option, and touches nothing else: a test that asks for none
of its fixtures runs exactly as without it.

Fixtures
    graphlm_executor  the name of an executor; a test that asks for it runs once per executor
                      (``test_x[reference]``, ``test_x[numpy]``, ``test_x[native]``). Executors
                      that do not work here (native without a C compiler) are skipped, saying
                      why, unless chosen by name (then the test errors, saying why; so does
                      native where GRAPHLM_REQUIRE_NATIVE is set, as in graphlm's CI).
    graphlm_dtype     the dtype gradient checks compute in: float64
    graphlm_eps       the central-difference step: graphlm.testing.EPS (1e-4)
    graphlm_rtol, graphlm_atol
                      the tolerances of gradients against central differences
                      (graphlm.testing.RTOL, ATOL)
    Override any of them in your conftest.py to change a default for your whole suite.

Option
    --graphlm-executors=numpy,native   the executors graphlm_executor runs over (default: every
                                       registered one)
"""
from __future__ import annotations

import os

import pytest

OPTION = "--graphlm-executors"


def pytest_addoption(parser):
    group = parser.getgroup("graphlm", "graphlm graph tests")
    group.addoption(OPTION, dest="graphlm_executors", default=None, metavar="NAMES",
                    help="comma-separated executors that tests using the graphlm_executor fixture "
                         "run on (default: every registered executor; unusable ones are skipped)")


def chosen_executors(config) -> tuple[list[str], bool]:
    """The executor names a session runs over, and whether the user chose them by name."""
    from graphlm.backends import available_executors

    value = config.getoption("graphlm_executors")
    known = available_executors()
    if value is None:
        return known, False
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise pytest.UsageError(f"{OPTION}={value}: no executor named "
                                f"{', '.join(repr(n) for n in unknown) or '(none given)'}; "
                                f"available: {', '.join(known)}")
    return names, True


def pytest_configure(config):
    if config.getoption("graphlm_executors") is not None:
        chosen_executors(config)    # a bad name is a usage error before any test runs


def pytest_generate_tests(metafunc):
    if "graphlm_executor" in metafunc.fixturenames:
        names, _ = chosen_executors(metafunc.config)
        metafunc.parametrize("graphlm_executor", names, indirect=True, ids=names)


@pytest.fixture
def graphlm_executor(request):
    """The executor this run of the test uses (the test is parametrized over them)."""
    from graphlm.testing.agree import executor_problem

    name = request.param
    why = executor_problem(name)
    if why is not None:
        _, by_name = chosen_executors(request.config)
        if by_name:
            pytest.fail(f"{OPTION} chose {name}, but {why}", pytrace=False)
        if name == "native" and os.environ.get("GRAPHLM_REQUIRE_NATIVE"):
            pytest.fail(f"GRAPHLM_REQUIRE_NATIVE is set, but {why}", pytrace=False)
        pytest.skip(why)
    return name


@pytest.fixture
def graphlm_dtype():
    """The dtype gradient checks compute in."""
    import numpy as np
    return np.dtype(np.float64)


@pytest.fixture
def graphlm_eps():
    """The central-difference step of gradient checks."""
    from graphlm.testing import EPS
    return EPS


@pytest.fixture
def graphlm_rtol():
    """The relative tolerance of gradients against central differences."""
    from graphlm.testing import RTOL
    return RTOL


@pytest.fixture
def graphlm_atol():
    """The absolute tolerance (scaled by the expected value's size) of the same check."""
    from graphlm.testing import ATOL
    return ATOL
