"""mkdocs hook (mkdocs.yml `hooks:`): draw the figures the pages embed before every build.

They go to docs/figures/ (git-ignored) before mkdocs collects the docs files, so strict mode sees them.
"""

from __future__ import annotations

from pathlib import Path

from cacheattn import figures


def on_pre_build(config, **kwargs) -> None:
    figures.write_all(Path(config["docs_dir"]) / "figures")
