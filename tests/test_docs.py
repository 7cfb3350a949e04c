"""docs/ops.md is the output of tools/opsdoc.py: it lists every registered op and is up to date."""
from __future__ import annotations

from pathlib import Path

from graphlm.registry import REGISTRY
from graphlm.tools import opsdoc

OPS_MD = Path(__file__).resolve().parents[1] / "docs" / "ops.md"


def test_ops_md_is_up_to_date_with_the_registry_and_kernel_tables():
    expected = opsdoc.render()
    actual = OPS_MD.read_text() if OPS_MD.exists() else ""
    assert actual == expected, "docs/ops.md is out of date: run `python -m graphlm.tools.opsdoc > docs/ops.md`"


def test_every_op_has_a_row_with_its_rules_and_executors():
    rows = {line.split("|")[1].strip().strip("`"): line for line in opsdoc.render().splitlines()
            if line.startswith("| `")}
    assert list(rows) == list(REGISTRY)
    for name, op in REGISTRY.items():
        assert op.doc and op.vjp_doc, f"op '{name}' needs a doc (shape rule) and a vjp_doc in graphlm/ops.py"
        assert "reference" in rows[name] or "all (a leaf)" in rows[name], f"the reference executor cannot run '{name}'"
