"""From each defining sentence of the source documents to the code and the tests that implement and check it.

The sentences live in docs/traceability/<prefix>.txt, one file per document: a `document:` line naming
the source document's file (its public original is linked in `ORIGINALS` below), a `status:` line (`covered` or
`pending`), then `id | quote | gloss` lines.
The code cites a sentence with a comment `spec` marker in reference/, kernels_numba/ or cacheattn/
(a `#` comment whose text is `spec: <prefix>/<id>`, several ids separated by commas), and a test with
the pytest marker `@pytest.mark.spec("<prefix>/<id>", ...)` (or a module's `pytestmark`).

This module scans the tree for both and builds the table; `coverage` says, per document, how many
sentences have a reference citation and a test citation. For a covered document every sentence needs
both (tests/test_traceability.py fails otherwise); a pending one is counted and not enforced.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "traceability"
SEEDS = ROOT.parent / "shared" / "seeds"
CODE_DIRS = {"reference": "reference", "kernels_numba": "kernel", "cacheattn": "api"}
_MARKER = re.compile(r"#\s*spec:\s*(.+?)\s*$")
_ID = re.compile(r"[a-z0-9-]+/[a-z0-9-]+")


# The public originals of the source documents, by document file name (the quote check reads local copies of
# them when they are present beside the checkout): (short title, address). The FasterTransformer one is an
# article reading FasterTransformer's decoder
# (DecoderCrossAttentionLayer); the project's own docs are https://github.com/NVIDIA/FasterTransformer/blob/main/
# docs/decoder_guide.md.
ORIGINALS = {
    "ppl-key-value-cache.md": (
        "OpenPPL KeyValueCache",
        "https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/KeyValueCache.md"),
    "ppl-multi-head-cache-attention.md": (
        "OpenPPL dynamic_batching.MultiHeadCacheAttention",
        "https://github.com/OpenPPL/ppl.pmx/blob/master/docs/operators/dynamic_batching/MultiHeadCacheAttention.md"),
    "onnx-attention-23-24.zh.md": (
        "ONNX Attention (opsets 23, 24; the seed is a Chinese rendering)",
        "https://github.com/onnx/onnx/blob/main/docs/Operators.md#Attention"),
    "trtllm-gpt-attention.md": (
        "TensorRT-LLM gpt attention",
        "https://github.com/NVIDIA/TensorRT-LLM/blob/main/docs/source/advanced/gpt-attention.md"),
    "fastertransformer-cross-attention.zh.md": (
        "FasterTransformer decoder CrossAttention (源码分析(六))",
        "https://zhuanlan.zhihu.com/p/670739629"),
}


@dataclass
class Sentence:
    id: str                 # "<prefix>/<key>"
    quote: str
    gloss: str


@dataclass
class Document:
    prefix: str
    file: str               # the seed document's file name
    status: str             # "covered" or "pending"
    sentences: list[Sentence] = field(default_factory=list)


def load_documents(data: Path = DATA) -> dict[str, Document]:
    """{prefix: Document} from every data file."""
    documents = {}
    for path in sorted(data.glob("*.txt")):
        header, sentences = {}, []
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            if "|" not in line:
                key, _, value = line.partition(":")
                header[key.strip()] = value.strip()
                continue
            key, quote, gloss = (part.strip() for part in (line + "|").split("|")[:3])
            sentences.append(Sentence(f"{path.stem}/{key}", quote, gloss))
        if header.get("status") not in ("covered", "pending"):
            raise ValueError(f"{path}: expected 'status: covered' or 'status: pending'")
        documents[path.stem] = Document(path.stem, header["document"], header["status"], sentences)
    return documents


def normalise(text: str) -> str:
    return " ".join(text.split())


def misquoted(documents: dict[str, Document], seeds: Path = SEEDS) -> list[str]:
    """Sentences whose quote is not the document's text (fragments joined by ' ... ' must appear in order)."""
    problems = []
    for doc in documents.values():
        text = normalise((seeds / doc.file).read_text())
        for sentence in doc.sentences:
            at = 0
            for fragment in normalise(sentence.quote).split(" ... "):
                found = text.find(fragment, at)
                if found < 0:
                    problems.append(f"{sentence.id}: not in {doc.file}: {fragment!r}")
                    break
                at = found + len(fragment)
    return problems


def _enclosing(tree: ast.AST) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and class, outermost first."""
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                spans.append((child.lineno, child.end_lineno, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def _code_markers(path: Path, where: str, found: dict, root: Path) -> None:
    source = path.read_text()
    spans = _enclosing(ast.parse(source))
    for number, line in enumerate(source.splitlines(), 1):
        match = _MARKER.search(line)
        if not match:
            continue
        inside = [name for first, last, name in spans if first <= number <= last]
        place = f"{path.relative_to(root)}::{inside[-1] if inside else '(module)'}"
        for spec_id in _ID.findall(match.group(1)):
            found.setdefault(spec_id, {}).setdefault(where, []).append(place)


def _spec_ids(decorator) -> list[str]:
    """The string arguments of a pytest.mark.spec(...) expression, else []."""
    if (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "spec" and ast.unparse(decorator.func.value) == "pytest.mark"):
        return [a.value for a in decorator.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    return []


def _test_markers(path: Path, found: dict, root: Path) -> None:
    tree = ast.parse(path.read_text())
    module_ids = []
    for node in tree.body:                          # pytestmark = pytest.mark.spec(...) or a list of marks
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            module_ids += [i for v in values for i in _spec_ids(v)]
    rel = path.relative_to(root)
    for spec_id in module_ids:
        found.setdefault(spec_id, {}).setdefault("test", []).append(f"{rel} (every test)")
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            for spec_id in (i for d in node.decorator_list for i in _spec_ids(d)):
                found.setdefault(spec_id, {}).setdefault("test", []).append(f"{rel}::{node.name}")


def scan_markers(root: Path = ROOT) -> dict[str, dict[str, list[str]]]:
    """{sentence id: {"reference" | "kernel" | "api" | "test": [places]}} for every citation in the tree."""
    found: dict = {}
    for directory, where in CODE_DIRS.items():
        for path in sorted((root / directory).glob("*.py")):
            _code_markers(path, where, found, root)
    for path in sorted((root / "tests").glob("test_*.py")):
        _test_markers(path, found, root)
    return found


@dataclass
class Row:
    sentence: Sentence
    status: str
    reference: list[str]    # reference/ functions, plus cacheattn/ validation for checks the document states
    kernel: list[str]
    tests: list[str]

    @property
    def covered(self) -> bool:
        return bool(self.reference) and bool(self.tests)


def build_table(documents: dict[str, Document], markers: dict) -> list[Row]:
    rows = []
    for doc in documents.values():
        for s in doc.sentences:
            cited = markers.get(s.id, {})
            rows.append(Row(s, doc.status, cited.get("reference", []) + cited.get("api", []),
                            cited.get("kernel", []), cited.get("test", [])))
    return rows


def unknown_ids(documents: dict[str, Document], markers: dict) -> list[str]:
    """Cited ids that name no sentence (a typo, or a sentence removed from a data file)."""
    known = {s.id for d in documents.values() for s in d.sentences}
    return sorted(set(markers) - known)


def coverage(documents: dict[str, Document], rows: list[Row]) -> dict[str, dict]:
    """{prefix: {document, status, sentences, with_reference, with_kernel, with_test, covered, missing}}."""
    out = {}
    for prefix, doc in documents.items():
        mine = [r for r in rows if r.sentence.id.startswith(prefix + "/")]
        out[prefix] = dict(document=doc.file, status=doc.status, sentences=len(mine),
                           with_reference=sum(bool(r.reference) for r in mine),
                           with_kernel=sum(bool(r.kernel) for r in mine),
                           with_test=sum(bool(r.tests) for r in mine),
                           covered=sum(r.covered for r in mine),
                           missing=[r.sentence.id for r in mine if not r.covered])
    return out


def report(documents=None, markers=None) -> str:
    """The counts per document, then every sentence with its quote, gloss and citations, as text."""
    documents = documents or load_documents()
    markers = markers if markers is not None else scan_markers()
    rows = build_table(documents, markers)
    lines = [f"{'document':<40} {'status':<8} {'sentences':>9} {'reference':>9} {'kernel':>6} {'test':>5} "
             f"{'covered':>7}"]
    for c in coverage(documents, rows).values():
        lines.append(f"{c['document']:<40} {c['status']:<8} {c['sentences']:>9} {c['with_reference']:>9} "
                     f"{c['with_kernel']:>6} {c['with_test']:>5} {c['covered']:>7}")
    for prefix, doc in documents.items():
        lines += ["", f"== {doc.file} ({doc.status})"]
        for r in (r for r in rows if r.sentence.id.startswith(prefix + "/")):
            lines.append(f"{r.sentence.id}: \"{r.sentence.quote}\"")
            if r.sentence.gloss:
                lines.append(f"    gloss: {r.sentence.gloss}")
            for label, places in (("reference", r.reference), ("kernel", r.kernel), ("tests", r.tests)):
                lines.append(f"    {label + ':':<10} {', '.join(places) if places else '-'}")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text shown as it is inside one Markdown table cell: one line, Markdown's special characters escaped
    (`cache_indirection[si][bi][ti]` is not a link, `H*Dh` not emphasis)."""
    return re.sub(r"([\\`*_\[\]<>|])", r"\\\1", " ".join(text.split()))


def _places(places: list[str]) -> str:
    return "<br>".join(f"`{p}`" for p in places) if places else "-"


def markdown_report(documents=None, markers=None) -> str:
    """`report` as Markdown tables (the site's traceability page): the counts per document, each document linked
    to its public original, then one table per document with every sentence, its quote and gloss, and where the
    reference, the kernels and the tests cite it."""
    documents = documents or load_documents()
    markers = markers if markers is not None else scan_markers()
    rows = build_table(documents, markers)
    lines = ["| document | status | sentences | reference | kernel | test | covered |", "|---|---|--:|--:|--:|--:|--:|"]
    for c in coverage(documents, rows).values():
        title, url = ORIGINALS.get(c["document"], (c["document"], None))
        name = f"[{title}]({url})" if url else title
        lines.append(f"| {name} | {c['status']} | {c['sentences']} | {c['with_reference']} | {c['with_kernel']} | "
                     f"{c['with_test']} | {c['covered']} |")
    for prefix, doc in documents.items():
        title, _ = ORIGINALS.get(doc.file, (doc.file, None))
        lines += ["", f"#### {title} ({doc.status})", "",
                  "| sentence | the document says | reference | kernel | tests |", "|---|---|---|---|---|"]
        for r in (r for r in rows if r.sentence.id.startswith(prefix + "/")):
            said = f"“{_cell(r.sentence.quote)}”" + (f"<br>*{_cell(r.sentence.gloss)}*" if r.sentence.gloss else "")
            lines.append(f"| `{r.sentence.id}` | {said} | {_places(r.reference)} | {_places(r.kernel)} | "
                         f"{_places(r.tests)} |")
    return "\n".join(lines)
