"""The read-and-run pages: every code block runs, and every output the page shows is what it prints."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cacheattn import _docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = _docs.pages(ROOT)


def test_there_are_pages():
    assert [p.name for p in PAGES] and all(p.suffix == ".md" for p in PAGES)


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_page_runs_and_shows_what_it_prints(page):
    if page.name in ("hf.md", "convert.md"):     # transformers models and caches: the hf extra (CI installs it)
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


def test_check_accepts_last_digit_noise_and_array_padding(tmp_path):
    """The same value printed by another CPU's BLAS kernels: last digits differ and NumPy pads the array."""
    page = tmp_path / "noise.md"
    page.write_text("```python\nprint('got', [1.0, 0.9999999999], -0.30234986147246473, 'at', (0, 2))\n```\n\n"
                    "```text\ngot [1.0, 0.9999999999999] -0.3023498614724648 at (0,   2)\n```\n")
    assert _docs.check(page) == []
    assert _docs.update(page) == 0          # nothing to rewrite: the shown digits stay


@pytest.mark.parametrize("printed, why", [
    ("print('got', [1.0, 0.99999], -0.30234986147246473, 'at', (0, 2))", "a float off by 1e-5"),
    ("print('got', [1.0, 0.9999999999], -0.30234986147246473, 'at', (0, 3))", "an integer off by one"),
    ("print('got', [1.0, 0.9999999999], -0.30234986147246473, 'in', (0, 2))", "a word changed"),
    ("print('got', [1.0], -0.30234986147246473, 'at', (0, 2))", "a number missing"),
    ("print('got', [1.0, 0.9999999999], -0.30234986147246473, 'at', (0, 2), 7)", "a number added"),
    ("print('got', [1.0, 0.9999999999]); print(-0.30234986147246473, 'at', (0, 2))", "a line break added"),
])
def test_check_rejects_a_real_change(tmp_path, printed, why):
    page = tmp_path / "changed.md"
    page.write_text(f"```python\n{printed}\n```\n\n"
                    "```text\ngot [1.0, 0.9999999999999] -0.3023498614724648 at (0, 2)\n```\n")
    assert len(_docs.check(page)) == 1, why


def test_numbers_inside_names_are_text():
    """float16 vs float32 or sm_80 vs sm_90 are different words, not numbers within a tolerance."""
    assert not _docs.same_output("float16 sm_80", "float32 sm_80")
    assert not _docs.same_output("sm_80", "sm_90")
    assert _docs.same_output("1e-06 and 2.5E+3", "1.0000001e-06 and 2500.0")


@pytest.mark.parametrize("code, shown", [
    ("x = 1  # prints nothing", ""),                                    # an empty output block
    ("print('\\n'.join(line for line in ['a', 'b'] if 'slot' in line))", "\n"),   # a filter that found no line
    ("print(end='')", "a line the code once printed\n"),              # the output vanished
])
def test_check_fails_an_empty_or_vanished_output_naming_page_and_block(tmp_path, code, shown):
    page = tmp_path / "empty.md"
    page.write_text("```python\nprint('first')\n```\n\n```text\nfirst\n```\n\n"
                    f"```python\n{code}\n```\n\n```text\n{shown}```\n")
    (problem,) = _docs.check(page)
    assert problem.startswith(f"{page}:9: block 2 ")
    assert "empty output block" in problem or "prints nothing" in problem
    _docs.update(page)                       # nothing printed: the page keeps what it shows, and still fails
    assert len(_docs.check(page)) == 1


# ------------------------------------------------------------------------------------------- the README


README = ROOT / "README.md"


def readme_blocks():
    return _docs.parse(README.read_text())


def test_the_readme_has_a_first_block_that_calls_both_backends():
    first = readme_blocks()[0]
    assert 'os.environ["NUMBA_ENABLE_CUDASIM"] = "1"' in first.code.splitlines()[1]
    assert 'backend in ("reference", "numba")' in first.code and first.output


@pytest.mark.parametrize("number", range(len(readme_blocks())), ids=lambda n: f"block{n + 1}")
def test_readme_block_runs_as_pasted_into_a_fresh_file(number, tmp_path):
    """Each python block of the README, alone in a new file and a new interpreter, as a reader would run it: the
    environment has no NUMBA_ENABLE_CUDASIM (the test suite's conftest sets it), so the block's own line must, and it
    prints what the README shows."""
    block = readme_blocks()[number]
    script = tmp_path / "readme_block.py"
    script.write_text(block.code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_")}
    env["PYTHONPATH"] = str(ROOT)         # this checkout's cacheattn, as `pip install -e .` would give
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    where = f"README.md:{block.code_line}"
    assert run.returncode == 0, f"{where} fails as pasted:\n{run.stderr[-3000:]}"
    if block.output is not None:
        assert _docs.same_output(block.output, run.stdout), f"{where} prints\n{run.stdout}\nbut shows\n{block.output}"
    else:
        assert not run.stdout.strip(), f"{where} prints output the README does not show"
