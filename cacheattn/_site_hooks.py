"""mkdocs hooks (mkdocs.yml `hooks:`): what the site build generates.

- Before every build, the figures the pages embed are drawn into docs/figures/ (git-ignored), before
  mkdocs collects the docs files, so strict mode sees them.
- The generated pages (the conformance and traceability tables) are run again as the site is built: their
  code blocks execute and the outputs shown are this build's, in the built site only (the files in docs/
  keep the outputs of the last `python -m cacheattn docs --update`, which the test suite checks).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from cacheattn import _docs, figures

GENERATED_PAGES = ("conformance.md", "traceability.md")


def on_pre_build(config, **kwargs) -> None:
    figures.write_all(Path(config["docs_dir"]) / "figures")


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri not in GENERATED_PAGES:
        return markdown
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / page.file.src_uri
        copy.write_text(markdown)
        _docs.update(copy)
        return copy.read_text()
