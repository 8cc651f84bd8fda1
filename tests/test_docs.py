"""The read-and-run pages: every code block runs, and every output the page shows is what it prints."""

from pathlib import Path

import pytest

from cacheattn import _docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = _docs.pages(ROOT)


def test_there_are_pages():
    assert [p.name for p in PAGES] and all(p.suffix == ".md" for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs_and_shows_what_it_prints(page):
    if page.name == "hf.md":                     # serves transformers models: the hf extra (CI installs it)
        pytest.importorskip("torch")
        pytest.importorskip("transformers")
    problems = _docs.check(page)
    assert not problems, "\n\n".join(problems) + "\n(python -m cacheattn docs --update rewrites the outputs)"


def test_check_catches_a_stale_output(tmp_path):
    page = tmp_path / "stale.md"
    page.write_text("```python\nprint(6 * 7)\n```\n\n```text\n41\n```\n")
    assert len(_docs.check(page)) == 1
    assert _docs.update(page) == 1 and _docs.check(page) == []
    assert "```text\n42\n```" in page.read_text()
