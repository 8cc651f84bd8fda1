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
                 "traceability/index.html", "api/index.html", "api-operators/index.html", "ppl/index.html",
                 "onnx/index.html", "first-kernel/index.html", "exercises/index.html", "rung-3/index.html"):
        assert (site / page).is_file(), page
    # The hook drew the figures the pages embed, and the API page carries the docstrings.
    paged = (site / "paged-kv-cache" / "index.html").read_text()
    assert 'src="../figures/page-table.svg"' in paged
    assert (site / "figures" / "page-table.svg").read_text().startswith("<svg")
    assert 'src="../figures/multi-block-splits.svg"' in (site / "trtllm-audit" / "index.html").read_text()
    api = (site / "api-operators" / "index.html").read_text()
    assert "multi_head_cache_attention" in api
    # NumPy docstrings render as parameter tables with shapes, for every operator.
    for name in ("key_value_cache", "dynamic_key_value_cache", "dynamic_multi_head_attention",
                 "multi_head_cache_attention", "onnx_attention", "cross_attention"):
        start = api.index(f'id="cacheattn.{name}"')
        section = api[start:api.index("<h2 ", start)]
        assert "<table" in section and "Default" in section and "Raises" in section, name
    assert "(seqstarts[B], num_kv_heads, head_dim)" in api and "(MaxT, L, 2, num_kv_heads, Dh)" in api
    # The generated pages show real tables, never their Markdown as preformatted text; sources link out.
    for page, name in (("conformance", "test_attention_4d"), ("traceability", "ppl-mhca/paged-mode")):
        html = (site / page / "index.html").read_text()
        assert f"<td><code>{name}</code></td>" in html and f"| `{name}` |" not in html, page
    assert "https://github.com/OpenPPL/ppl.pmx/" in (site / "traceability" / "index.html").read_text()
    assert (site / "stylesheets" / "extra.css").is_file()


def test_build_reruns_the_generated_pages():
    from types import SimpleNamespace

    from cacheattn import _site_hooks

    stale = (ROOT / "docs" / "traceability.md").read_text().replace("| covered | 28 |", "| STALE |", 1)
    page = SimpleNamespace(file=SimpleNamespace(src_uri="traceability.md"))
    assert "STALE" in stale
    fresh = _site_hooks.on_page_markdown(stale, page)
    assert fresh == _site_hooks.tables_as_markdown((ROOT / "docs" / "traceability.md").read_text())
    other = SimpleNamespace(file=SimpleNamespace(src_uri="ppl.md"))
    assert _site_hooks.on_page_markdown("```python\nprint(1)\n```\n", other) == "```python\nprint(1)\n```\n"


def test_an_output_block_holding_a_markdown_table_becomes_that_table():
    from cacheattn import _site_hooks

    page = ("```python\nprint(table)\n```\n\n```text\n| a | b |\n|---|--:|\n| x | 1 |\n\ntotal: 1\n```\n\n"
            "```text\nplain | output\n```\n")
    shown = _site_hooks.tables_as_markdown(page)
    assert "\n| a | b |\n|---|--:|\n| x | 1 |\n\ntotal: 1\n" in shown and "```text\n| a" not in shown
    assert "```text\nplain | output\n```" in shown           # other output stays preformatted
