"""Every defining sentence of a covered document is cited by the reference (or the API's validation) and
by a test; every citation names a real sentence; every quote is the document's text."""

import pytest

from cacheattn import traceability

DOCUMENTS = traceability.load_documents()
MARKERS = traceability.scan_markers()
ROWS = traceability.build_table(DOCUMENTS, MARKERS)
COVERAGE = traceability.coverage(DOCUMENTS, ROWS)


def test_counts_per_document(capsys):
    with capsys.disabled():
        print("\ntraceability: document / status / defining sentences / covered (reference + test)")
        for c in COVERAGE.values():
            print(f"  {c['document']:<42} {c['status']:<8} {c['sentences']:>3} {c['covered']:>3}")
    assert {c["document"] for c in COVERAGE.values()} == {
        "ppl-key-value-cache.md", "ppl-multi-head-cache-attention.md", "onnx-attention-23-24.zh.md",
        "trtllm-gpt-attention.md", "fastertransformer-cross-attention.zh.md"}
    assert all(c["sentences"] > 0 for c in COVERAGE.values())


@pytest.mark.parametrize("prefix", [p for p, c in COVERAGE.items() if c["status"] == "covered"])
def test_covered_document_has_reference_and_test_for_every_sentence(prefix):
    missing = COVERAGE[prefix]["missing"]
    assert not missing, f"{prefix}: sentences without a reference or a test citation: {missing}"


def test_every_citation_names_a_sentence():
    assert traceability.unknown_ids(DOCUMENTS, MARKERS) == []


def test_every_quote_is_the_documents_text():
    if not traceability.SEEDS.is_dir():
        pytest.skip(f"no source documents at {traceability.SEEDS}")
    assert traceability.misquoted(DOCUMENTS) == []


def test_scanner_finds_code_and_test_markers(tmp_path):
    for directory in ("reference", "kernels_numba", "cacheattn", "tests"):
        (tmp_path / directory).mkdir()
    (tmp_path / "reference" / "op.py").write_text("def op():\n    # spec: d/a, d/b\n    return 1\n")
    (tmp_path / "tests" / "test_op.py").write_text(
        "import pytest\npytestmark = pytest.mark.spec('d/c')\n\n"
        "@pytest.mark.spec('d/a')\ndef test_op():\n    assert True\n")
    found = traceability.scan_markers(tmp_path)
    assert found["d/a"] == {"reference": ["reference/op.py::op"], "test": ["tests/test_op.py::test_op"]}
    assert found["d/b"] == {"reference": ["reference/op.py::op"]}
    assert found["d/c"] == {"test": ["tests/test_op.py (every test)"]}
