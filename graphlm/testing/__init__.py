"""Testing graphs and ops in your own pytest suite (as ``jax.test_util.check_grads`` and
``torch.autograd.gradcheck``).

- `check_grads(f, args, order=1|2, executor=...)`: f's derivatives against float64 central
  differences along random directions, the output tangent, and the VJP inner-product identity;
  a float32 f is checked on the float64 copy of its graph. A failure names the argument, the
  worst index, both values and their relative error.
- `check_vjps(outputs, feeds, state)`: every node's VJP rule of a built graph checked on its
  own; a failure names the first wrong node by op, name and module scope.
- `assert_executors_agree(graph, outputs, feeds, state)`: every usable executor against the
  reference, within each executor's own tolerance (``program.tolerance(dtype)``).
- `check_op(name, args, attrs)`: one op's gradients (to second order), its kernels against its
  decomposition, and its executors against the reference.
- helpers: `build`, `run`, `feeds_of`, `assert_close`, `usable_executors`.

The pytest plugin (`graphlm.testing.pytest_plugin`, loaded through the ``pytest11`` entry point
where graphlm is installed) adds the ``graphlm_executor`` fixture and ``--graphlm-executors``.
"""
from .agree import assert_executors_agree, usable_executors
from .gradcheck import ATOL, EPS, IDENTITY_RTOL, RTOL, GradCheckResult, check_grads
from .graphs import assert_close, build, feeds_of, run, run_reading
from .opcheck import check_op
from .vjpcheck import VJPReport, check_vjps

__all__ = ["check_grads", "check_vjps", "assert_executors_agree", "check_op", "usable_executors",
           "GradCheckResult", "VJPReport", "build", "run", "run_reading", "feeds_of",
           "assert_close", "EPS", "RTOL", "ATOL", "IDENTITY_RTOL"]
