"""cacheattn.convert's documentation says what the code takes: each format module's export and import_ document
exactly their parameters, the per-format tables of `convert.export` / `convert.import_` (what help() and the API
page show) list exactly each format's arguments with the right required / optional mark, `convert.convert`'s
tables each format's required ones, and the Examples sections run."""

from __future__ import annotations

import doctest
import importlib
import inspect
import re

import pytest

from cacheattn import convert

FORMATS = convert.FORMATS
_SECTION = re.compile(r"^(\w[\w ]*)\n-+\n", re.M)


def documented_parameters(function) -> list:
    """The names of a numpy-style docstring's Parameters section, in order ("a, b : type" gives a and b)."""
    doc = inspect.getdoc(function) or ""
    sections = {m.group(1): m.end() for m in _SECTION.finditer(doc)}
    assert "Parameters" in sections, f"{function.__module__}.{function.__name__}: no Parameters section"
    start = sections["Parameters"]
    ends = [e for e in (m.start() for m in _SECTION.finditer(doc)) if e > start]
    body = doc[start:min(ends) if ends else len(doc)]
    names = []
    for line in body.splitlines():
        if line and not line[0].isspace():
            names += [n.strip().lstrip("*") for n in line.split(" : ")[0].split(",")]
    return names


def real_parameters(function) -> list:
    return [n for n, p in inspect.signature(function).parameters.items() if p.kind != p.VAR_KEYWORD]


def format_tables(function) -> dict:
    """{format: {argument: required?}} from the `**`format`**` tables of a docstring."""
    tables, current = {}, None
    for line in (inspect.getdoc(function) or "").splitlines():
        heading = re.match(r"^\*\*`(\w+)`\*\*", line)
        if heading:
            current = tables.setdefault(heading.group(1), {})
            continue
        row = re.match(r"^\| `(\w+)` \| (required|optional) \|", line)
        if row and current is not None:
            assert row.group(1) not in current, f"{row.group(1)} listed twice"
            current[row.group(1)] = row.group(2) == "required"
    return tables


def needs_tables(function) -> dict:
    """{heading: {format: [argument names]}} from the two-column tables of convert's docstring."""
    out, heading = {}, None
    for line in (inspect.getdoc(function) or "").splitlines():
        top = re.match(r"^\| format \| (.+) \|$", line)
        if top:
            heading = top.group(1)
            out[heading] = {}
            continue
        row = re.match(r"^\| `(\w+)` \| (.+) \|$", line)
        if row and heading is not None:
            out[heading][row.group(1)] = re.findall(r"`(\w+)`", row.group(2))
    return out


def _signature(fmt, direction, skip):
    fn = getattr(importlib.import_module(f"cacheattn.convert.{fmt}"), direction)
    return {n: p.default is p.empty for n, p in inspect.signature(fn).parameters.items() if n not in skip}


@pytest.mark.parametrize("direction", ["export", "import_"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_module_documents_exactly_its_parameters(fmt, direction):
    function = getattr(importlib.import_module(f"cacheattn.convert.{fmt}"), direction)
    assert documented_parameters(function) == real_parameters(function)


@pytest.mark.parametrize("direction, skip", [("export", ("sequence",)), ("import_", ("kv", "sequence"))])
def test_the_public_tables_list_each_formats_arguments(direction, skip):
    tables = format_tables(getattr(convert, direction))
    assert list(tables) == list(FORMATS)
    for fmt in FORMATS:
        assert tables[fmt] == _signature(fmt, direction, skip), fmt


def test_convert_lists_what_a_source_and_a_destination_need():
    tables = needs_tables(convert.convert)
    assert len(tables) == 2
    for (heading, table), (direction, skip) in zip(tables.items(), [("export", ("sequence",)),
                                                                     ("import_", ("kv", "sequence"))]):
        assert direction in heading
        assert list(table) == list(FORMATS)
        for fmt in FORMATS:
            required = [n for n, needed in _signature(fmt, direction, skip).items() if needed]
            assert table[fmt] == required, (direction, fmt)


def _examples():
    objects = [convert.export, convert.import_, convert.convert, convert.Cache, convert.KV, convert.match_rope,
               convert.error_bound]
    parser = doctest.DocTestParser()
    return [parser.get_doctest(inspect.getdoc(o), {}, o.__qualname__, None, 0) for o in objects
            if ">>>" in (inspect.getdoc(o) or "")]


@pytest.mark.parametrize("example", _examples(), ids=lambda t: t.name)
def test_the_docstring_examples_run(example):
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    out = []
    runner.run(example, out=out.append)
    assert runner.failures == 0, "".join(out)
