"""Packaging: the repository's executors/ and tools/ install under the graphlm namespace, every
package folder is listed in pyproject.toml, and `python -m graphlm` / `--version` work."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import graphlm

ROOT = Path(__file__).resolve().parents[1]


def _setuptools_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_folder_is_listed_under_its_graphlm_name():
    cfg = _setuptools_config()
    dirs = cfg["package-dir"]
    found = {".".join((name, *init.parent.relative_to(ROOT / folder).parts))
             for name, folder in dirs.items() for init in (ROOT / folder).rglob("__init__.py")}
    assert set(cfg["packages"]) == found


def test_no_generic_top_level_import_names_are_installed(tmp_path):
    # outside the repository, `executors` and `tools` are not ours (or do not exist at all)
    code = ("import importlib.util, graphlm.executors, graphlm.tools; "
            "print(*(getattr(importlib.util.find_spec(n), 'origin', None) for n in ('executors', 'tools')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         check=True).stdout
    assert str(ROOT) not in out


def test_python_dash_m_graphlm_is_the_command_and_reports_its_version(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "graphlm", "--version"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"graphlm {graphlm.__version__}"
