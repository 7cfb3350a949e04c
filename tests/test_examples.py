"""Every example runs, in seconds, and does what its docstring says."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.mark.skipif(shutil.which("dot") is None, reason="Graphviz dot is not installed")
def test_visualize_decoder_writes_both_pictures(tmp_path):
    out = run_example("visualize_decoder.py", "--out-dir", str(tmp_path))
    assert "1,902,976 parameters" in out
    whole = ET.parse(tmp_path / "tinylm_forward_depth1.svg").getroot()
    block = ET.parse(tmp_path / "tinylm_block1.svg").getroot()
    svg = "{http://www.w3.org/2000/svg}"
    texts = [t.text or "" for t in block.iter(f"{svg}text")]
    assert any(re.fullmatch(r"n\d+ param blocks\.1\.attention\.qkv_weight", t) for t in texts)
    clusters = [next(c.iter(f"{svg}text")).text for c in block.iter(f"{svg}g") if c.get("class") == "cluster"]
    assert clusters[0] == "blocks.1" and all(c.startswith("blocks.1") for c in clusters)
    assert "blocks.1.attention" in clusters
    whole_clusters = [next(c.iter(f"{svg}text")).text for c in whole.iter(f"{svg}g")
                      if c.get("class") == "cluster"]
    assert len(whole_clusters) == 5          # the four identical blocks are drawn once
    assert "blocks.0-3 x4 (one drawn; counts per block)" in whole_clusters


def test_train_steps_lower_the_loss():
    out = run_example("train_steps.py", "--steps", "6")
    before, after = map(float, re.search(r"loss on batch 0: ([\d.]+) -> ([\d.]+)", out).groups())
    assert after < before - 0.5
    assert len(re.findall(r"^step \d+: loss", out, re.M)) == 6


@pytest.mark.parametrize("executor", ["reference", "numpy"])
def test_gradient_check_passes(executor):
    out = run_example("gradient_check.py", "--executor", executor)
    errors = [float(e) for e in re.findall(r"relative error ([\d.e+-]+)$", out, re.M)]
    assert len(errors) == 6 and max(errors) < 1e-6


def test_cross_attention_layer(tmp_path):
    out = run_example("cross_attention_layer.py", "--svg", str(tmp_path / "layer.svg"))
    assert "1,112 parameters" in out
    assert "causal self-attention (earlier positions unchanged by the last): True" in out
    assert "cross-attention (every position reads the encoder output): True" in out
    if shutil.which("dot"):
        ET.parse(tmp_path / "layer.svg")
