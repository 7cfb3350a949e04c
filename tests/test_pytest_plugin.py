"""graphlm's pytest plugin, in inner pytest sessions (pytester) so this suite's options stay as
they are; and the README's "Testing your own graphs" snippet, run as a user's test file."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

from graphlm.testing import usable_executors
from graphlm.backends import available_executors

pytest_plugins = ["pytester"]

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_plugin_is_announced_by_the_graphlm_distribution():
    (ep,) = [ep for ep in metadata.entry_points(group="pytest11") if ep.name == "graphlm"]
    assert ep.value == "graphlm.testing.pytest_plugin" and ep.dist.name == "graphlm"


def test_a_test_asking_for_graphlm_executor_runs_once_per_executor(pytester):
    pytester.makepyfile("""
        def test_runs(graphlm_executor, request):
            assert request.config.pluginmanager.hasplugin("graphlm")
            print("RAN", graphlm_executor)
    """)
    result = pytester.runpytest("-v", "-s")
    names = available_executors()
    ran = re.findall(r"RAN (\w+)", result.stdout.str())
    assert sorted(ran) == sorted(usable_executors())
    result.assert_outcomes(passed=len(usable_executors()), skipped=len(names) - len(usable_executors()))
    for name in names:
        assert f"test_runs[{name}]" in result.stdout.str()


def test_the_option_chooses_executors_and_rejects_unknown_names(pytester):
    pytester.makepyfile("""
        def test_runs(graphlm_executor):
            assert graphlm_executor == "numpy"
    """)
    pytester.runpytest("--graphlm-executors=numpy").assert_outcomes(passed=1)
    result = pytester.runpytest("--graphlm-executors=numpy,gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--graphlm-executors=numpy,gpu: no executor named 'gpu'; available: *numpy*"])


def test_an_executor_that_cannot_run_here_is_skipped_or_fails_when_chosen(pytester):
    """A registered executor that is unavailable (as native without a compiler) or fails to
    load: skipped with the reason by default, an error when chosen by name. (A subprocess: the
    conftest registers executors, which must not leak into this session.)"""
    pytester.makeconftest("""
        from graphlm.backends import register_executor

        class Unavailable:
            def available(self):
                return False

        def broken():
            raise ImportError("no module named 'fancy_accelerator'")

        register_executor("unavailable", Unavailable)
        register_executor("broken", broken)
    """)
    pytester.makepyfile("""
        def test_runs(graphlm_executor):
            assert graphlm_executor not in ("unavailable", "broken")
    """)
    result = pytester.runpytest_subprocess("-rs", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(usable_executors()),
                           skipped=2 + len(available_executors()) - len(usable_executors()))
    result.stdout.fnmatch_lines(["*the unavailable executor says it is unavailable here"])
    result.stdout.fnmatch_lines(["*the broken executor does not load here: ImportError: no module named 'fancy_accelerator'"])
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--graphlm-executors=numpy,unavailable")
    result.assert_outcomes(passed=1, errors=1)      # the fixture fails: a setup error
    result.stdout.fnmatch_lines(["*--graphlm-executors chose unavailable, but the unavailable executor says*"])


def test_defaults_are_fixtures_a_conftest_can_override(pytester):
    pytester.makeconftest("""
        import pytest
        @pytest.fixture
        def graphlm_eps():
            return 1e-5
    """)
    pytester.makepyfile("""
        import numpy as np
        from graphlm.testing import ATOL, RTOL
        def test_defaults(graphlm_dtype, graphlm_eps, graphlm_rtol, graphlm_atol):
            assert graphlm_dtype == np.float64 and graphlm_eps == 1e-5
            assert (graphlm_rtol, graphlm_atol) == (RTOL, ATOL) == (1e-6, 1e-7)
    """)
    pytester.runpytest().assert_outcomes(passed=1)


def test_other_projects_tests_are_untouched(pytester):
    """A project with its own `executor` fixture and parametrization: nothing added or changed."""
    pytester.makeconftest("""
        import pytest
        @pytest.fixture(params=["a", "b"])
        def executor(request):
            return request.param
    """)
    pytester.makepyfile("""
        import pytest
        def test_own(executor):
            assert executor in ("a", "b")
        @pytest.mark.parametrize("n", [1, 2, 3])
        def test_plain(n):
            assert n
    """)
    result = pytester.runpytest("-v")
    result.assert_outcomes(passed=5)
    assert "graphlm" not in re.sub(r"plugins: .*", "", result.stdout.str())


# -- the README snippet ---------------------------------------------------------------------------

def readme_snippet() -> str:
    section = README.read_text().split("## Testing your own graphs", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_snippet_passes_as_a_users_test_file(pytester):
    snippet = readme_snippet()
    assert "def test_" in snippet and len(snippet.strip().splitlines()) <= 20
    pytester.makepyfile(test_softplus=snippet)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=len(usable_executors()),
                           skipped=len(available_executors()) - len(usable_executors()))


def test_the_readme_snippet_fails_when_its_vjp_is_wrong(pytester):
    snippet = readme_snippet()
    wrong = snippet.replace("vjp=lambda y, g: [g * gl.sigmoid(y.inputs[0])]",
                            "vjp=lambda y, g: [g * gl.sigmoid(-y.inputs[0])]")
    assert wrong != snippet
    pytester.makepyfile(test_softplus=wrong)
    result = pytester.runpytest_subprocess("-q", "-p", "no:cacheprovider", "--graphlm-executors=reference")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*check_grads: the gradient of f with respect to 't' ([[]4,3[]]) is wrong*"])
