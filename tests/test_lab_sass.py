"""cacheattn.lab.sass: parsing ptxas and nvdisasm, the occupancy rules, the key loop, and the committed figures of
docs/kernel-ladder-sass.json against a fresh compile of one rung."""

import json
from pathlib import Path

import pytest

from cacheattn.lab import sass

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "kernel-ladder-sass.json"

PTXAS = """ptxas info    : 8 bytes gmem
ptxas info    : Compiling entry function '_ZN6kernelE' for 'sm_90'
ptxas info    : Function properties for _ZN6kernelE
    264 bytes stack frame, 60 bytes spill stores, 48 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 8320 bytes smem, 624 bytes cmem[0]
"""

# A listing in nvdisasm's form: a loop at .L_x_1 with two 16-byte loads and an inner loop at .L_x_2 with one 2-byte
# load, a later loop with two loads and a spill store (nvdisasm pads its annotation with hundreds of spaces), a
# forward branch, and the trap loop after EXIT.
SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.64 R2, desc[UR4][R2.64] ;
.L_x_1:
        /*0020*/                   LDG.E.128.CONSTANT R4, desc[UR4][R8.64] ;
        /*0030*/                   LDG.E.128.CONSTANT R12, desc[UR4][R10.64] ;
.L_x_2:
        /*0040*/                   LDG.E.U16 R16, desc[UR4][R18.64] ;
        /*0050*/                   FFMA R20, R4, R5, R20 ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   SHFL.BFLY PT, R21, R20, 0x10, 0x1f ;
        /*0080*/                   MUFU.EX2 R22, R21 ;
        /*0090*/                   MUFU.RCP R23, R22 ;
        /*00a0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*00b0*/                   LDS R24, [R25] ;
        /*00c0*/                   STS [R25], R24 ;
        /*00d0*/                   HFMA2 R26, R24, R24, R26 ;
        /*00e0*/                   HMMA.16816.F32 R28, R4, R12, R28 ;
        /*00f0*/              @!P0 BRA `(.L_x_1) ;
        /*0100*/               @P2 BRA `(.L_x_4) ;
.L_x_3:
        /*0110*/                   LDG.E R30, desc[UR4][R2.64] ;
        /*0120*/                   LDG.E.S8 R31, desc[UR4][R2.64] ;
        /*0128*/                   STL [R1], R20{PAD}(*"SpillRefill"*);
        /*0130*/                   BRA `(.L_x_3) ;
.L_x_4:
        /*0140*/                   EXIT ;
.L_x_5:
        /*0150*/                   BRA `(.L_x_5);
""".replace("{PAD}", " " * 600)


def test_ptxas_report_is_parsed():
    assert sass.parse_ptxas(PTXAS) == dict(registers=255, barriers=1, shared=8320, stack=264, spill_stores=60,
                                           spill_loads=48)
    # CUDA 12.9 puts the call stack between barriers and shared memory.
    spilled = "    56 bytes stack frame, 60 bytes spill stores, 60 bytes spill loads\nptxas info    : Used 255 " \
              "registers, used 1 barriers, 56 bytes cumulative stack size, 4160 bytes smem\n"
    assert sass.parse_ptxas(spilled) == dict(registers=255, barriers=1, shared=4160, stack=56, spill_stores=60,
                                             spill_loads=60)
    assert sass.parse_ptxas("ptxas info    : Used 12 registers\n")["shared"] == 0
    with pytest.raises(ValueError, match="Used N registers"):
        sass.parse_ptxas("ptxas fatal : Unresolved extern function")


def test_loops_the_key_loop_and_its_mix():
    code = sass.parse_sass(SASS)
    assert [address for address, _, _ in code][:3] == [0x0, 0x10, 0x20] and len(code) == 23
    assert code[19][1] == "STL [R1], R20"
    assert sass.opcode(code[6][1]) == "BRA" and code[2][2] == [".L_x_1"]
    # Three loops (the inner one, the outer one, the later one); not the trap's branch to itself.
    spans = sass.loops(code)
    assert sorted((code[a][0], code[b][0]) for a, b in spans) == [(0x20, 0xF0), (0x40, 0x60), (0x110, 0x130)]
    first, last = sass.key_loop(code)                   # three loads beat the inner loop's one and the later two
    assert (code[first][0], code[last][0]) == (0x20, 0xF0)
    # The inner loop loads, the later one stores: neither is a page walk; a loop of integer arithmetic is.
    assert sass.page_walks(code, spans) == []
    walk = sass.parse_sass(".L_x_9:\n  /*0000*/  IADD3 R1, R1, -R2, RZ ;\n  /*0010*/  @P0 BRA `(.L_x_9) ;")
    assert sass.page_walks(walk, sass.loops(walk)) == [(0, 1)]
    mix = sass.instruction_mix(code[first:last + 1])
    assert mix == {"LDG.8": 0, "LDG.16": 1, "LDG.32": 0, "LDG.64": 0, "LDG.128": 2, "STG": 0, "LDS": 1, "STS": 1,
                   "LDL": 0, "STL": 0, "SHFL": 1, "BAR": 1, "FFMA": 1, "HFMA2": 1, "HMMA": 1, "MUFU.EX2": 1,
                   "total": 14}
    assert [sass.mix_class(op) for op in ("LDG.E", "LDG.E.S8", "LDG.E.64", "MUFU.RCP", "IMAD")] == [
        "LDG.32", "LDG.8", "LDG.64", None, None]
    lines = sass.excerpt(code, (first, last))
    assert lines[0].startswith("/*0020*/ LDG.E.128.CONSTANT") and lines[-1] == "/*00f0*/ @!P0 BRA `(.L_x_1)"
    assert len(lines) == 10          # 2 LDG.128, LDG.16, SHFL, MUFU.EX2, BAR, LDS, STS, HMMA, the branch
    with pytest.raises(ValueError, match="no loop"):
        sass.key_loop(sass.parse_sass("        /*0000*/  LDG.E R1, desc[UR4][R2.64] ;\n        /*0010*/  EXIT ;"))


def test_occupancy_by_the_calculators_rules():
    # 126 registers: 4032 a warp, allocated 4096; a sub-partition's 16384 hold 4 warps, the SM 16: four blocks of 4.
    assert sass.occupancy(126, 8320, 0, 128)["blocks_per_sm"] == 4
    # 255: 8160 -> 8192 a warp, 2 a sub-partition, 8 an SM: two blocks, 8 of 64 warps.
    full = sass.occupancy(255, 0, 0, 128)
    assert (full["blocks_per_sm"], full["occupancy"], full["limited_by"]) == (2, 0.125, "registers")
    # 56 registers allow 9 blocks (1792 a warp, 9 a sub-partition); 38448 bytes + 1024 reserved = 39552 after
    # rounding to 128 allow 233472 // 39552 = 5: shared memory limits, 20 warps = 31.25%.
    rung1 = sass.occupancy(56, 38448, 0, 128)
    assert (rung1["limits"]["registers"], rung1["limits"]["shared"], rung1["limited_by"]) == (9, 5, "shared")
    assert rung1["occupancy"] == pytest.approx(20 / 64)
    # One-warp blocks of 32 registers: registers and warps would allow 64, the SM takes 32 blocks: half its warps.
    small = sass.occupancy(32, 0, 0, 32)
    assert (small["limited_by"], small["occupancy"]) == ("blocks", 0.5)


def test_missing_tools_are_named(monkeypatch, tmp_path):
    import nvidia
    monkeypatch.setattr(nvidia, "__path__", [str(tmp_path)])
    monkeypatch.setattr(sass.shutil, "which", lambda name: None)
    with pytest.raises(sass.ToolMissing, match="nvdisasm not found.*nvidia-cuda-nvdisasm"):
        sass._nvidia_binary("nvdisasm")
    with pytest.raises(sass.ToolMissing, match="ptxas"):
        sass.machine_code([sass.Variant(2, "float16")])


def test_variant_keys_round_trip():
    # OpenPPL's 5 rungs x 3 caches in decode, rung 5's prefill x 3 caches, rungs 1-4's and rung 6's float16
    # prefill; TensorRT-LLM's rungs 1, 3 and 5 with its 3 caches; its context step's rungs 1 and 5; ONNX's and
    # FasterTransformer's rungs 1, 3 and 4; the quick run's 5 rungs at head_dim 64. The calls' other launches: 5
    # cache stores, a combine, 4 preprocesses, ONNX's copy, FasterTransformer's query bias.
    assert len(sass.VARIANTS) == 32 + 3 + 3 + 3 + 5 and len(sass.OTHER_VARIANTS) == 5 + 1 + 4 + 1 + 1
    assert all(sass.parse_key(v.key) == v for v in sass.VARIANTS + sass.OTHER_VARIANTS)
    assert sass.parse_key("trtllm-rung3-fp8-decode") == sass.Variant(3, "fp8", operator="trtllm")
    assert sass.parse_key("ft-rung3-float16-decode-d64") == sass.Variant(3, "float16", operator="ft", head_dim=64)
    assert sass.parse_key("rung3-int4-decode+store_kernel") == sass.Variant(3, "int4", part="store_kernel")
    for bad in ("rung3-fp8-decode", "trtllm-rung3-int4-decode", "onnx-rung3-int8-decode"):  # each operator's caches
        with pytest.raises(ValueError, match="variant"):
            sass.parse_key(bad)


def test_the_other_operators_variants_compile_what_their_cases_launch():
    """ONNX's, FasterTransformer's and TensorRT-LLM's context variants record the bench case's own call (no
    compile here): the kernel of the variant's rung, at the case's head_dim, and the call's other launches."""
    for key, kernel in (("onnx-rung3-float16-decode", "vector_attention_kernel"),
                        ("ft-rung1-float16-decode-d64", "attention_kernel"),
                        ("trtllm-rung5-float16-prefill", "mma_attention_kernel"),
                        ("onnx-rung1-float16-decode+copy_kernel", "copy_kernel"),
                        ("ft-rung3-float16-decode-d64+query_bias_kernel", "query_bias_kernel")):
        recorded, _, threads = sass._record_launch(sass.parse_key(key))
        assert (recorded.py_func.__name__, threads) == (kernel, 128), key
    with pytest.raises(ValueError, match="head_dim 64, not 128"):
        sass._record_launch(sass.Variant(3, "float16", operator="ft"))


def test_committed_figures_are_current(tmp_path, monkeypatch):
    """The ladder page's figures (docs/kernel-ladder-sass.json) match a fresh compile of rung 2 with a float16
    cache (one compile, about 10 s; `python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json` rewrites
    the file)."""
    committed = json.loads(COMMITTED.read_text())
    variant = sass.Variant(2, "float16")
    fresh = sass.machine_code([variant], use_cache=False)[variant.key]
    assert fresh == committed["variants"][variant.key], "regenerate docs/kernel-ladder-sass.json"
    assert committed["tools"]["ptxas"] == sass.tool_versions()["ptxas"]
    assert set(committed["variants"]) == {v.key for v in sass.VARIANTS + sass.OTHER_VARIANTS}


def test_no_rung_the_plan_chooses_spills():
    """Rungs 3 to 6 (the plan's and TensorRT-LLM's choices, decode and prefill, every cache) keep every value in
    registers: no spill stores or loads in the committed sm_90 machine code. A kernel change that spills shows
    here once the file is regenerated (`python -m cacheattn.lab.sass --write docs/kernel-ladder-sass.json`)."""
    variants = json.loads(COMMITTED.read_text())["variants"]
    # the attention kernels of rungs 3-6, and every other launch of a call
    chosen = {key: v for key, v in variants.items() if v["rung"] >= 3 or "+" in key}
    # OpenPPL 9 decode + 6 prefill (rung 6's too) + 3 at head_dim 64, TensorRT-LLM 6 + 2 context, ONNX 2,
    # FasterTransformer 2; 12 other launches
    assert len(chosen) == 30 + 12
    spilled = {key: (v["spill_stores"], v["spill_loads"]) for key, v in chosen.items()
               if v["spill_stores"] or v["spill_loads"]}
    assert spilled == {}, spilled


# cp.async in ptxas 12.9's sm_80 code: two 16-byte copies, each followed by its commit (LDGDEPBAR), the wait
# (DEPBAR) and an FFMA that reads the first copy's shared address register.
CP_ASYNC = """
        /*00b0*/                   LDGSTS.E.BYPASS.128 [R13], [R4.64] ;
        /*00c0*/                   LEA.HI R7, P0, R7, R2, RZ, 0x4 ;
        /*00d0*/                   LDGDEPBAR ;
        /*00f0*/                   LDGSTS.E.BYPASS.128 [R11], [R4.64+0x200] ;
        /*0100*/                   LDG.E.64 R20, desc[UR4][R2.64] ;
        /*0120*/                   LDGDEPBAR ;
        /*0190*/                   DEPBAR.LE SB0, 0x1 ;
        /*01a0*/                   FFMA R22, R13, R20, R22 ;
"""


def test_cp_async_loads_are_counted_by_width():
    """LDGSTS (cp.async) reads as many bytes as its width says; its commit LDGDEPBAR and its wait DEPBAR read none;
    a listing with them goes through the in-flight count."""
    assert [sass.load_bytes(op) for op in ("LDGSTS.E.BYPASS.128", "LDGSTS.E.BYPASS.LTC128B.128", "LDGSTS.E.64",
                                          "LDGSTS.E", "LDGDEPBAR", "DEPBAR.LE")] == [16, 16, 8, 4, 0, 0]
    got = sass.loads_in_flight(sass.parse_sass(CP_ASYNC))
    assert got["loads"] == 3
    assert got["peak"] == 32 * (16 + 16 + 8)


# A rotated loop (two conditional back edges whose spans cross, FlashAttention-2's form) and an out-of-line block
# after it whose unconditional branch returns into it (a diverged warp's shuffle): the first two join, the last
# stays apart.
ROTATED = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_1:
        /*0010*/                   LDGSTS.E.BYPASS.LTC128B.128 [R2], desc[UR4][R4.64] ;
.L_x_2:
        /*0020*/                   LDGDEPBAR ;
        /*0030*/              @P0 BRA `(.L_x_1) ;
.L_x_3:
        /*0040*/                   DEPBAR.LE SB0, 0x1 ;
        /*0050*/              @P1 BRA `(.L_x_2) ;
        /*0060*/              @P2 BRA `(.L_x_4) ;
        /*0070*/                   EXIT ;
.L_x_4:
        /*0080*/                   LDG.E R6, desc[UR4][R4.64] ;
        /*0090*/                   BRA `(.L_x_3) ;
"""


def test_rotated_loops_join_and_out_of_line_returns_do_not():
    code = sass.parse_sass(ROTATED)
    assert sorted(sass.loops(code)) == [(1, 3), (2, 5), (4, 9)]
    assert sass.regions(code) == [(1, 5), (4, 9)]
    # both regions load once; the rotated loop, the shorter, is the key loop
    assert sass.key_loop(code) == (1, 5)


def test_cp_async_is_in_flight_until_the_depbar_that_retires_its_group():
    """LDGSTS names no register the warp waits on: its copy is in flight until DEPBAR.LE N leaves N groups."""
    code = sass.parse_sass("""
        /*0000*/                   LDGSTS.E.BYPASS.128 [R13], [R4.64] ;
        /*0010*/                   LDGDEPBAR ;
        /*0020*/                   LDGSTS.E.BYPASS.128 [R11], [R4.64+0x200] ;
        /*0030*/                   LDGDEPBAR ;
        /*0040*/                   DEPBAR.LE SB0, 0x1 ;
        /*0050*/                   LDS R8, [R13] ;
        /*0060*/                   DEPBAR.LE SB0, 0x0 ;
""")
    assert sass.loads_in_flight(code) == dict(first_use=32 * 32, peak=32 * 32, loads=2)
    assert [sass._groups_kept(text) for _, text, _ in code] == [None, None, None, None, 1, None, 0]


def test_a_filtered_write_replaces_only_its_variants(tmp_path, monkeypatch):
    """`--rung 6 --write FILE` keeps every other variant of FILE and puts the new one where a full run would."""
    keys = [v.key for v in sass.VARIANTS + sass.OTHER_VARIANTS]
    old = {key: {"old": key} for key in keys if sass.parse_key(key).rung != 6}
    target = tmp_path / "sass.json"
    target.write_text(json.dumps({"variants": old}))
    monkeypatch.setattr(sass, "machine_code",
                        lambda variants, use_cache=True: {v.key: {"new": v.key} for v in variants})
    monkeypatch.setattr(sass, "table", lambda results: "")
    monkeypatch.setattr(sass, "tool_versions", lambda: {})
    assert sass.main(["--rung", "6", "--write", str(target)]) == 0
    written = json.loads(target.read_text())["variants"]
    assert list(written) == keys
    assert written["rung6-float16-prefill"] == {"new": "rung6-float16-prefill"}
    assert all(written[key] == {"old": key} for key in old)
