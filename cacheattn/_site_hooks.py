"""mkdocs hooks (mkdocs.yml `hooks:`): what the site build generates.

- Before every build, the figures the pages embed are drawn into docs/figures/ (git-ignored), before
  mkdocs collects the docs files, so strict mode sees them.
- The generated pages (the conformance and traceability tables) are run again as the site is built: their
  code blocks execute and the outputs shown are this build's, in the built site only (the files in docs/
  keep the outputs of the last `python -m cacheattn docs --update`, which the test suite checks).
- An output block that is a Markdown table (a block's code printed one) is shown as that table, not as
  preformatted text: the page file keeps it in a ```text block, where the docs checker compares it.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from cacheattn import _docs, figures

GENERATED_PAGES = ("conformance.md", "traceability.md")


def on_pre_build(config, **kwargs) -> None:
    figures.write_all(Path(config["docs_dir"]) / "figures")


# A ```text block whose body starts with a Markdown table's header and separator rows.
_TABLE_OUTPUT = re.compile(r"^```text\n(\|[^\n]*\|\n\|[-:| ]+\|\n.*?)^```\n", re.S | re.M)


def tables_as_markdown(markdown: str) -> str:
    """The page with every output block that holds a Markdown table unwrapped into Markdown."""
    return _TABLE_OUTPUT.sub(lambda m: m.group(1), markdown)


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri in GENERATED_PAGES:
        with tempfile.TemporaryDirectory() as scratch:
            copy = Path(scratch) / page.file.src_uri
            copy.write_text(markdown)
            _docs.update(copy)
            markdown = copy.read_text()
    return tables_as_markdown(markdown)
