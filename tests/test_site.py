"""The docs site builds strictly (broken links, missing nav files, bad API references fail) and holds
the pages and generated figures it should."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site)], cwd=ROOT,
                           capture_output=True, text=True, env=env, timeout=120)
    assert build.returncode == 0, build.stdout + build.stderr
    for page in ("index.html", "paged-kv-cache/index.html", "kernel-ladder/index.html", "conformance/index.html",
                 "traceability/index.html", "api/index.html", "ppl/index.html", "onnx/index.html"):
        assert (site / page).is_file(), page
    # The hook drew the figures the pages embed, and the API page carries the docstrings.
    paged = (site / "paged-kv-cache" / "index.html").read_text()
    assert 'src="../figures/page-table.svg"' in paged
    assert (site / "figures" / "page-table.svg").read_text().startswith("<svg")
    assert 'src="../figures/multi-block-splits.svg"' in (site / "trtllm" / "index.html").read_text()
    assert "multi_head_cache_attention" in (site / "api" / "index.html").read_text()


def test_build_reruns_the_generated_pages():
    from types import SimpleNamespace

    from cacheattn import _site_hooks

    stale = (ROOT / "docs" / "traceability.md").read_text().replace("covered         28", "STALE", 1)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="traceability.md"))
    assert "STALE" in stale
    fresh = _site_hooks.on_page_markdown(stale, page)
    assert fresh == (ROOT / "docs" / "traceability.md").read_text()
    other = SimpleNamespace(file=SimpleNamespace(src_uri="ppl.md"))
    assert _site_hooks.on_page_markdown("```python\nprint(1)\n```\n", other) == "```python\nprint(1)\n```\n"
