"""`python -m cacheattn lab --sanitize` (every kernel family under the recorder, 0 findings) and
`python -m cacheattn lab` (the counters of every rung on a scaled-down decode)."""

import json
import os

import pytest
from test_tables import check_table

from cacheattn.__main__ import main
from cacheattn.lab.recorder import CONFLICTS_LD, DRAM_READ

from strategies import deep_only

pytestmark = pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1",
                                reason="the lab counts in numba's CUDA simulator")
# CACHEATTN_EXAMPLES >= 2: the long pass (the prefill cases on every later rung too).
LONG = int(os.environ.get("CACHEATTN_EXAMPLES", "1")) >= 2


@deep_only   # the deep tier runs `python -m cacheattn lab --sanitize --full` instead, a superset
def test_sanitize_every_kernel_family_finds_nothing(capsys, monkeypatch):
    from cacheattn import _console
    from cacheattn.lab.sanitize import calls, sanitize

    families = {call.family for call in calls(LONG)}
    # Every operator and every rung has a representative.
    for name in ("ppl key_value_cache", "ppl dynamic key_value_cache", "ppl dynamic multi_head_attention",
                 "onnx attention", "trtllm gpt_attention generation multi-block", "trtllm gpt_attention fp8 streaming",
                 "trtllm gpt_attention generation rung 4",
                 "trtllm gpt_attention context unfused", "trtllm gpt_attention cross attention", "ft cross_attention",
                 *(f"ppl multi_head_cache_attention rung {rung}" for rung in range(1, 7))):
        assert name in families
    monkeypatch.delenv("COLUMNS", raising=False)
    with _console.recording() as tables:
        assert sanitize(full=LONG) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1].startswith(f"0 findings in {len(calls(LONG))} calls")
    (table,) = tables                                   # no findings: no second table
    rows = {(row["family"], row["call"]): row for row in _console.as_json(table)["rows"]}
    assert len(rows) == len(calls(LONG)) and all(row["findings"] == 0 for row in rows.values())
    # The multi-block and split-K representatives really split (their combine kernels ran).
    multi_block = rows["trtllm gpt_attention generation multi-block", "1 sequence, past 40, contiguous fp16"]
    assert multi_block["launches"] == 3 and "combine_kernel" in multi_block["kernels"]
    split_k = [row for (family, _), row in rows.items() if family.startswith("ppl") and family.endswith("rung 4")]
    assert len(split_k) == (3 if LONG else 1) and all(     # float16 (the long pass: every cache)
        row["kernels"] == ["combine_kernel", "store_kernel", "vector_attention_kernel"] for row in split_k)
    generation = rows["trtllm gpt_attention generation rung 4", "1 sequence, past 40, paged INT8, 3 splits"]
    assert generation["kernels"] == ["combine_kernel", "preprocess_kernel", "vector_attention_kernel"]
    assert max(len(line) for line in out.splitlines()) <= 80          # piped: the tables fit 80 columns
    check_table(table)


def test_lab_counts_every_rung_and_bounds_the_full_decode(capsys):
    assert main(["lab", "--quick", "--format", "json"]) == 0
    document = json.loads(capsys.readouterr().out)
    (table,) = document["tables"]
    rows = {row["metric"]: row for row in table["rows"]}
    rungs = [f"rung_{rung}" for rung in range(1, 6)]
    # Beside the rungs, the operator's default call: choose_kernel's choice, rung 5's register-fed decode kernel
    # for the B = 64 decode (rung 3's grid, which fills the GPU).
    assert [c["key"] for c in table["columns"]] == ["metric", *rungs, "default"]
    assert table["columns"][-1]["header"] == "default (rung 5)"
    assert all(row["default"] == row["rung_5"] for row in table["rows"])
    assert any("default call: rung 5, 1 split(s), 128 threads (512 blocks fill 132 SMs" in note
               for note in document["notes"])
    # The full launch's lower bounds (derived): rung 1's 32-way column walk makes shared memory its limiter; at
    # head_dim 64 rungs 2-4 issue more instructions than the DRAM time covers, and rung 5 is held by DRAM, whose
    # figure (fitted from 64 and 128 keys to 4097, x 256 blocks) stays within 1% of the bytes the operator must
    # move. Every rung has the terms read from its SASS (the quick run's head_dim-64 variants).
    assert [rows["limited by"][rung] for rung in rungs] == ["shared", "issue", "issue", "issue", "DRAM"]
    for rung in rungs[1:]:
        assert 1.0 <= rows["DRAM / floor (derived)"][rung] <= 1.01
        assert rows["lower bound µs (derived)"][rung] >= rows["DRAM µs (derived)"][rung]
        assert rows["latency µs (derived)"][rung] > 0 and rows["waves µs (derived)"][rung] > 0
    assert rows["lower bound µs (derived)"]["rung_5"] == rows["DRAM µs (derived)"]["rung_5"]
    assert rows["lower bound µs (derived)"]["rung_1"] > rows["lower bound µs (derived)"]["rung_2"]
    assert all(rows["findings (race, uninitialized, out of bounds)"][r] == 0 for r in rungs)
    assert any("Counted in numba's CUDA simulator" in note and "never timed" in note for note in document["notes"])
    # Every rung reads the same K/V, query and tables: the same distinct sectors, so the same DRAM bytes, at least
    # the full cache's K and V (64 requests x 4097 keys x 8 kv heads x 64 float16, twice).
    dram = {rows[f"{DRAM_READ} (full, counted)"][r] for r in rungs}
    assert len(dram) == 1 and dram.pop() >= 2 * 64 * 4097 * 8 * 64 * 2
    # Rung 1's column walk over the K tile conflicts (the teaching baseline); rungs 2-4 keep no shared tile to
    # conflict on, and every K/V load of theirs uses every byte of its sectors, once per block.
    assert rows[f"{CONFLICTS_LD} (full, counted)"]["rung_1"] > 0
    for rung in rungs[1:4]:
        assert rows[f"{CONFLICTS_LD} (full, counted)"][rung] == 0
        assert rows["K/V ld sector efficiency"][rung] == 1.0
        assert rows["K/V reads per block (loaded / must see)"][rung] == 1.0
    # Rung 5's decode computes Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ (16 keys, or 16 of V's dims, fill the mma rows, the group
    # of 4 heads 4 of the 8 columns): 2 x the HMMA its FLOPs need.
    assert rows["HMMA / (FLOPs / 4096)"]["rung_5"] == 2.0


def test_rederive_makes_a_written_files_derivations_again_without_counting(tmp_path, monkeypatch, capsys):
    from cacheattn.lab import counters

    committed = counters.committed()
    stale = json.loads(json.dumps(committed))
    shown = stale["cases"][counters.plans()[0].case.label]["rungs"]["3"]
    shown["derived"]["K/V ld sector efficiency"] = 0.5
    del shown["bounds"]["issue µs (derived)"]
    shown["bounds"]["lower bound µs (derived)"] = 1.0
    path = tmp_path / "counts.json"
    path.write_text(json.dumps(stale))
    monkeypatch.setattr(counters, "_count", lambda job: pytest.fail("--rederive counted a launch"))
    assert main(["lab", "--rederive", str(path)]) == 0
    assert json.loads(path.read_text()) == committed      # the committed file is current (test_lab_counters)
    assert "issue µs (derived)" in capsys.readouterr().out          # and printed the tables


def test_update_puts_recounted_rungs_in_place_of_a_written_files(tmp_path, capsys, monkeypatch):
    from cacheattn.lab import counters

    # What is checked is the splice, not the counting: each launch is counted once, the recounts that follow take
    # the same figures (the simulator's counts of a launch do not vary).
    count, seen = counters._count, {}
    monkeypatch.setattr(counters, "_count", lambda job: seen[job] if job in seen else seen.setdefault(job, count(job)))
    path = tmp_path / "quick.json"
    assert main(["lab", "--quick", "--rung", "3", "--rung", "5", "--write", str(path)]) == 0
    written = json.loads(path.read_text())
    (label,) = written["cases"]
    stale = json.loads(path.read_text())
    stale["cases"][label]["rungs"]["3"]["full"][DRAM_READ] = 1.0      # as a kernel change might leave it
    stale["cases"][label]["rungs"]["3"]["bounds"]["lower bound µs (derived)"] = 1.0
    stale["cases"][label]["rungs"]["5"]["counted"][0]["barriers"] = -1      # a rung the recount leaves alone
    path.write_text(json.dumps(stale))
    assert main(["lab", "--quick", "--rung", "3", "--update", str(path)]) == 0
    updated = json.loads(path.read_text())
    assert updated["cases"][label]["rungs"]["5"]["counted"][0]["barriers"] == -1
    updated["cases"][label]["rungs"]["5"]["counted"][0]["barriers"] = \
        written["cases"][label]["rungs"]["5"]["counted"][0]["barriers"]
    assert updated == written
    # A case the file does not hold yet is added (an operator counted for the first time) ...
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**written, "cases": {}}))
    assert main(["lab", "--quick", "--rung", "3", "--update", str(other)]) == 0
    assert list(json.loads(other.read_text())["cases"]) == [label]
    # ... one counted at another block size is refused, the file left as it was.
    stale = json.loads(path.read_text())
    stale["cases"][label]["threads"] = 256
    path.write_text(json.dumps(stale))
    assert main(["lab", "--quick", "--rung", "3", "--update", str(path)]) == 2
    assert "not in the file to update" in capsys.readouterr().err
    assert json.loads(path.read_text()) == stale


def test_lab_case_choices_are_the_counted_cases():
    from cacheattn.__main__ import LAB_CASES
    from cacheattn.lab.counters import CASE_NAMES
    assert LAB_CASES == tuple(CASE_NAMES)
