"""cacheattn.bounds on hand-made metric dicts whose figures are worked out by hand in the comments."""

import pytest

from cacheattn.bounds import H100_SXM, bounds
from cacheattn.lab.cases import LAB_CASES, BenchCase

DECODE_F16, DECODE_I8, DECODE_I4, LONG, PREFILL = LAB_CASES
CLOCKS = 132 * 1.98e9            # SM clocks per second over the whole H100 SXM: 2.6136e11


def test_the_machine_is_the_issues_h100_sxm():
    assert (H100_SXM.sms, H100_SXM.hbm_bytes_per_s, H100_SXM.clock_hz) == (132, 3.35e12, 1.98e9)


def test_bytes_the_decode_cases_must_move():
    # K and V of 64 sequences x 4097 keys (4096 cached + the new token) x 8 kv heads x 128 float16 (256 bytes):
    # 2 x 64 x 4097 x 8 x 256 = 1,074,003,968; Q and O: 64 x 32 heads x 128 x 2 bytes = 524,288 each.
    assert DECODE_F16.must_move == dict(kv=1_074_003_968, q=524_288, o=524_288)
    assert DECODE_F16.floor_bytes == 1_075_052_544
    # int8: 128 bytes of values + 16 float16 scales (quant_group 8) = 160 a row; int4: 64 + 32 = 96.
    assert (DECODE_F16.row_bytes, DECODE_I8.row_bytes, DECODE_I4.row_bytes) == (256, 160, 96)
    assert DECODE_F16.must_move["kv"] / DECODE_I8.must_move["kv"] == pytest.approx(1.6)
    assert DECODE_F16.must_move["kv"] / DECODE_I4.must_move["kv"] == pytest.approx(8 / 3)
    # B = 1, 32768 cached + 1: 2 x 32769 x 8 x 256 = 134,221,824 of K/V; Q and O 32 x 128 x 2 = 8,192 each.
    assert LONG.floor_bytes == 134_221_824 + 2 * 8_192


def test_prefill_flops_and_mma_bound():
    # Causal 4096 x 4096: 4096 x 4097 / 2 = 8,390,656 visible pairs, 4 x 128 FLOPs each per head, 32 heads:
    # 137,472,507,904 FLOPs = 33,562,624 mma.m16n8k16 of 4096 FLOPs, at one per clock per SM 33,562,624 / 2.6136e11.
    assert PREFILL.flops == 137_472_507_904
    mma = PREFILL.flops // 4096
    assert mma == 33_562_624
    b = bounds({}, mma=mma, case=PREFILL)
    assert b.limiter == "tensor"
    assert b.bound_us == pytest.approx(128.4153, rel=1e-6)


def test_a_decode_launch_at_the_floor():
    # Two blocks of rung 3's 512 (B 64 x 8 kv groups) counted: each reads 4097 keys x (K + V) x 256 bytes =
    # 2,097,664 bytes and 4 query rows (1,024 bytes), writes 4 output rows (1,024). Scaled by 256 the grid moves
    # exactly the floor, 1,075,052,544 bytes: 320.911 µs at 3.35 TB/s, 100% of the bandwidth.
    metrics = {"dram__bytes_read.sum": 2 * (2_097_664 + 1_024), "dram__bytes_write.sum": 2 * 1_024}
    b = bounds(metrics, scale=256, case=DECODE_F16)
    assert b.figures["DRAM bytes"].value == 1_075_052_544
    assert b.figures["DRAM / floor"].value == pytest.approx(1.0)
    assert b.limiter == "DRAM"
    assert b.bound_us == pytest.approx(320.9112, rel=1e-6)
    assert b.hbm_share == pytest.approx(1.0)
    assert "cannot run faster than 320.91 µs" in b.summary() and "100% of HBM bandwidth" in b.summary()


def test_every_resource_and_the_largest():
    metrics = {
        # 3,350,000 bytes x 1000 = 3.35e9 bytes: 1000 µs at 3.35 TB/s.
        "dram__bytes_read.sum": 3_000_000, "dram__bytes_write.sum": 350_000,
        # 130,680 wavefronts x 1000 / (1 per clock x 2.6136e11) = 500 µs; 40,000 conflicts x 1000.
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": 100_000,
        "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum": 30_680,
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": 40_000,
        # 261,360 sectors x 1000 / (4 per clock x 2.6136e11) = 250 µs.
        "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 261_000,
        "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum": 360,
        # Half of each loaded sector was asked for: 261,000 x 32 / 2 bytes.
        "smsp__sass_data_bytes_mem_global_op_ld.sum": 4_176_000,
    }
    # 1.04544e8 warp instructions / (4 per clock x 2.6136e11) = 100 µs.
    b = bounds(metrics, scale=1000, warp_instructions=1.04544e8)
    us = {name: fig.value for name, fig in b.resources.items()}
    assert us == pytest.approx({"DRAM": 1000.0, "shared": 500.0, "L1": 250.0, "issue": 100.0})
    assert (b.limiter, b.bound_us) == ("DRAM", pytest.approx(1000.0))
    assert b.hbm_share == pytest.approx(1.0)           # no case: the DRAM bytes counted over the bound
    assert b.figures["bank conflicts"].value == 40_000_000
    assert b.figures["sector efficiency"].value == pytest.approx(0.5)
    assert all(fig.basis == "derived" for fig in b.resources.values())
    assert b.figures["DRAM bytes"].basis == "counted" and b.figures["sector efficiency"].basis == "derived"


def test_a_shared_memory_bound_kernel_uses_part_of_the_bandwidth():
    # 261,360,000 wavefronts (scale 1) take 1000 µs; 335,000,000 DRAM bytes take 100 µs: the kernel cannot run
    # faster than 1000 µs and then pulls 335 MB in 1 ms, 10% of 3.35 TB/s.
    metrics = {"l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": 261_360_000, "dram__bytes_read.sum": 335_000_000}
    b = bounds(metrics)
    assert b.limiter == "shared" and b.bound_us == pytest.approx(1000.0)
    assert b.hbm_share == pytest.approx(0.10)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="scale"):
        bounds({"dram__bytes_read.sum": 1}, scale=0)
    with pytest.raises(ValueError, match="metrics"):
        bounds({"unrelated": 3})
    with pytest.raises(ValueError, match="quant_bit"):
        _ = BenchCase("bad", batch=1, context=1, new_tokens=1, quant_bit=3).row_bytes


def test_few_blocks_leave_sms_idle():
    # 261,360 sectors take 250 µs spread over 132 SMs (test_every_resource_and_the_largest, scale 1000 there). On 8
    # blocks only 8 SMs work: 132 / 8 = 16.5 x longer. 512 blocks put ceil(512 / 132) = 4 on the busiest SM where
    # the average is 3.879: 4 x 132 / 512 = 1.03125 x. DRAM is shared by all SMs: no change.
    metrics = {"l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": 261_360_000, "dram__bytes_read.sum": 3_350_000}
    spread = bounds(metrics)
    assert spread.resources["L1"].value == pytest.approx(250.0)
    few = bounds(metrics, blocks=8)
    assert few.resources["L1"].value == pytest.approx(250.0 * 16.5)
    assert few.resources["DRAM"].value == pytest.approx(spread.resources["DRAM"].value)
    assert bounds(metrics, blocks=512).resources["L1"].value == pytest.approx(250.0 * 1.03125)
    assert bounds(metrics, blocks=264).resources["L1"].value == pytest.approx(250.0)
    with pytest.raises(ValueError, match="blocks"):
        bounds(metrics, blocks=0)


def test_cuda_core_rungs_are_held_to_the_fma_rate():
    # 128 float32 lanes x 2 FLOPs per clock per SM: the 4k prefill's 137,472,507,904 FLOPs / (256 x 2.6136e11) =
    # 2054.6 µs on the CUDA cores, 16x the tensor cores' 128.4 µs (test_prefill_flops_and_mma_bound).
    b = bounds({"dram__bytes_read.sum": PREFILL.floor_bytes}, case=PREFILL, fma_flops=PREFILL.flops)
    assert b.resources["FMA"].value == pytest.approx(PREFILL.flops / (256 * CLOCKS) * 1e6)
    assert b.resources["FMA"].value == pytest.approx(2054.6, rel=1e-4)
    assert b.limiter == "FMA" and b.resources["FMA"].basis == "derived"
