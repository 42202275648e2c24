"""The decode-regime CUDA GEMM (kernels/decode_gemm.cu): its fragment layout on CPU (the twin, bitwise against
the K order the Triton kernels feed), dispatch and fallbacks; on the GPU, bit equality with the Triton path
for every M and config, batch invariance against M = 16384, and the reference."""
import os
import subprocess
import sys

import pytest
import torch
from minite.kernels import _cuda_decode, _decode_twin, checks, grouped_nvfp4_gemm, nvfp4_gemm, stack_experts
from minite.kernels import gemm as G
from minite.kernels._backend import interpreter_on as _interpreted
from minite.kernels.weights import decode_f16, decode_layout, fragment_order
from test_trainer_kernels import LAYOUTS, _layout_kernel_vs_torch

from minite import nvfp4 as ref


def _q(m, k, seed, scaling="row"):
    return ref.quantize(checks.spread_input(m, k, "cpu", seed=seed), scaling=scaling)


@pytest.mark.parametrize("row0,step", [(0, 0), (16, 1)])
def test_weight_fragments_are_the_triton_k_order(row0, step):
    """Each lane's A fragments (rows g, g + 8; positions 2t.., 2t+8.. of eight k16 pieces), placed by the PTX
    fragment layout, rebuild exactly the fp16 step tile the Triton kernels feed (evens, then odds): zero
    blocks, subnormal E4M3 scales and negative zeros included."""
    w = _q(32, 256, seed=3)
    want = decode_f16(w)[row0:row0 + 16, step * 128:(step + 1) * 128]
    got = _decode_twin.weight_operand(_decode_twin.weight_fragments(w.codes, w.scales, row0, step))
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("row0,step", [(0, 0), (16, 1), (32, 0)])
def test_fragment_order_gives_the_lanes_the_same_fragments(row0, step):
    """Codes in fragment order (``decode_layout``'s copy), read as ``gather_frag`` reads a ring slot and decoded
    as the FRAG kernel decodes them, give every lane the fragments the row-major gather gives it: the same fp16
    bits. Same size, and the same set bits (each element's four bits moved, none made or lost)."""
    w = _q(48, 384, seed=4)
    frag = fragment_order(w.codes)
    want = _decode_twin.weight_fragments(w.codes, w.scales, row0, step)
    got = _decode_twin.weight_fragments(frag, w.scales, row0, step, frag=True)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert frag.shape == w.codes.shape and frag.dtype == torch.uint8

    def ones(b):
        return sum(int(((b >> i) & 1).sum()) for i in range(8))
    assert ones(frag) == ones(w.codes)
    ex = stack_experts([w, w])
    assert decode_layout(ex).frag is None  # CPU: no CUDA decode kernel, no second copy
    with pytest.raises(ValueError, match="fragment_order"):
        fragment_order(w.codes[:40])


def test_fragment_order_pairs_decode_every_word():
    """Every word of code bytes, stored as ``fragment_order``'s docstring says (per 16-bit half h: the evens of
    bytes h / 2 + h at mag << 9 | sign << 15 / mag << 6 | sign << 12, the odds at mag | sign << 14 / mag << 3 |
    sign << 13) and decoded by ``frag_pairs`` (the FRAG kernel's masks and multiplies), gives the fp16x2 bits of
    the row-major decode (``pair01`` / ``pair23`` of ``low_nibbles`` / ``high_nibbles``): all 2^16 values of
    bytes 0, 1, with bytes 2, 3 running through them in reverse."""
    v = torch.arange(2 ** 16, dtype=torch.int64)
    x = v | v.flip(0) << 16
    byte = [(x >> (8 * i)) & 0xFF for i in range(4)]

    def half(h):
        e01, e23, o01, o23 = byte[h] & 15, byte[2 + h] & 15, byte[h] >> 4, byte[2 + h] >> 4
        return ((e01 & 7) << 9 | (e01 >> 3) << 15 | (e23 & 7) << 6 | (e23 >> 3) << 12
                | (o01 & 7) | (o01 >> 3) << 14 | (o23 & 7) << 3 | (o23 >> 3) << 13)
    lo, hi = _decode_twin.low_nibbles(x), _decode_twin.high_nibbles(x)
    want = (_decode_twin.pair01(lo), _decode_twin.pair23(lo), _decode_twin.pair01(hi), _decode_twin.pair23(hi))
    for got, expect in zip(_decode_twin.frag_pairs(half(0) | half(1) << 16), want, strict=True):
        assert torch.equal(got, expect)


def test_sm90_compile_finds_the_main_loop_in_sass():
    """The instruction count per K step that ``sm90_compile`` prints comes from the smallest loop that issues
    HMMA (not an outer loop around it, nor a loop without tensor work), divided by its K steps."""
    from minite.kernels.sm90_compile import main_loop
    sass = """
        /*0100*/                   LDS.U16 R1, [R2] ;
        /*0110*/              @!P0 LOP3.LUT R3, R1, 0x7, RZ, 0xc0, !PT ;
        /*0120*/                   BRA 0x100 ;
        /*0130*/                   IMAD.SHL.U32 R4, R3, 0x2, RZ ;
        /*0140*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0150*/                   HMMA.16816.F32 R8, R4, R6, R8 ;
        /*0160*/                   PRMT R5, R4, 0x5410, R3 ;
        /*0170*/               @P1 BRA 0x130 ;
        /*0180*/                   ISETP.GE.AND P0, PT, R1, R2, PT ;
        /*0190*/                   BRA 0x100 ;
    """
    per_step, ops = main_loop(sass, hmma_per_step=1)
    assert per_step == 2.5 and ops == {"HMMA": 1.0, "IMAD": 0.5, "PRMT": 0.5, "BRA": 0.5}
    assert main_loop(sass.replace("HMMA", "FFMA"), 1) is None


def test_sm90_compile_builds_a_config_with_only_its_named_constants():
    """The offline sm_90 build (no GPU: triton's own ptxas) gives the kernel's other constexprs their defaults;
    as runtime arguments, ``if K_GROUPED:`` compiled the grouped branch and failed on its undefined bounds.
    A subprocess: the tool compiles, so the kernels must be defined with the interpreter off."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "minite.kernels.sm90_compile", "--no-cuda", "--only",
                          "dense f16:128x128w8s4"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok   dense f16:128x128w8s4" in run.stdout and "FAIL" not in run.stdout


@pytest.mark.parametrize("nt,m_end", [(1, 5), (2, 13), (2, 16)])
def test_token_fragments_are_the_triton_k_order(nt, m_end):
    """The token (B) fragments, written by store_tokens into the segment buffer and read back with the warps'
    16-byte loads: the Triton K order for real rows, zeros past the tile's rows."""
    a = _q(16, 256, seed=5)
    want = decode_f16(a)
    for step in range(2):
        got = _decode_twin.token_operand(_decode_twin.token_fragments(a.codes, a.scales, 0, m_end, step, nt))
        assert torch.equal(got[:m_end].view(torch.int16),
                           want[:m_end, step * 128:(step + 1) * 128].view(torch.int16))
        assert not got[m_end:].any()


def test_twin_gemm_matches_reference():
    a, w = _q(11, 256, seed=7), _q(32, 256, seed=8, scaling="tensor")
    assert checks.rel_err(_decode_twin.gemm(a, w, nt=1), ref.nvfp4_matmul_reference(a, w)) < 1e-5


def test_supports_whole_steps_and_aligned_operands():
    w, a = _q(64, 256, seed=1), _q(9, 256, seed=2)
    assert _cuda_decode.supports(256, 64, a, w.codes, w.scales)
    assert _cuda_decode.supports(256, 64, a.rows(3, 9), w.codes, w.scales)  # row slices: still packed rows
    assert not _cuda_decode.supports(1088, 64, a, w.codes, w.scales)  # K tail: the Triton kernels take it
    assert not _cuda_decode.supports(256, 40, a, w.codes, w.scales)   # N not whole 16-row warps
    odd = ref.NVFP4Tensor(a.codes[:, :64], a.scales[:, :8], a.global_scale)  # a column slice: rows not packed
    assert not _cuda_decode.supports(128, 64, odd, w.codes[:, :64], w.scales[:, :8])
    shifted = torch.zeros(64 * 128 + 8, dtype=torch.uint8)[8:].view(64, 128)  # base not 16-byte aligned
    assert not _cuda_decode.supports(256, 64, a, shifted, w.scales)


def test_module_unavailable_warns_and_returns_none(monkeypatch):
    _cuda_decode.module.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="sm_80"):
            assert _cuda_decode.module((7, 5)) is None
        monkeypatch.setenv("MINITE_KERNELS_CUDA", "0")
        assert _cuda_decode.module((9, 0)) is None
        assert G._cuda_module(torch.device("cuda", 0)) is None
    finally:
        _cuda_decode.module.cache_clear()


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="bad CUDA decode GEMM config"):
        _cuda_decode._check(dict(NT=3, W=4, D=8))
    with pytest.raises(ValueError, match="bad CUDA decode GEMM config"):
        _cuda_decode._check(dict(NT=4, W=1, D=8))  # two token units per thread at most
    with pytest.raises(ValueError, match="bad CUDA decode GEMM config"):
        _cuda_decode._check(dict(NT=1, W=4, D=8, C=8))  # chunk lanes must divide the warps
    with pytest.raises(ValueError, match="bad CUDA decode GEMM config"):
        _cuda_decode._check(dict(NT=1, W=4, D=2))  # the ring runs D - 3 steps ahead
    with pytest.raises(ValueError, match="bad CUDA decode GEMM config"):
        _cuda_decode._check(dict(NT=1, W=4, D=8, RG=17))  # row groups per warp: 1 .. 16
    with pytest.raises(ValueError, match="power of two"):
        _cuda_decode.chunk_log2(3)
    with pytest.raises(ValueError, match="no token segment fits"):  # a round of 8 chunks of 4 steps > 8 steps
        _cuda_decode.segment(dict(NT=2, W=4, D=8, C=8), 64, 4, 8)


def test_token_segments_fit_shared_memory():
    """K = 8192 in chunks of 512 over 4 lanes of 8 warps: two 32-step token buffers (and the ring, the chunk
    sums) would need 232 KB, over the H200's 227 KB: 16-step segments fit; nothing fits a 100 KB limit (then
    the dispatcher uses the Triton kernels)."""
    cfg = dict(NT=1, W=8, D=8, SEG=0, C=4)
    limit = 232448
    assert _cuda_decode.smem_bytes(cfg, 64, 32, 4, 4) > limit
    seg = _cuda_decode.segment(cfg, 64, 4, 4, limit)
    assert seg == 16 and _cuda_decode.smem_bytes(cfg, 64, seg, 4, 4) <= limit
    assert _cuda_decode.segment(cfg, 16, 4, 4, limit) == 16  # all of K = 2048 at once
    with pytest.raises(ValueError, match="no token segment fits"):
        _cuda_decode.segment(cfg, 64, 4, 4, 100_000)


def test_fragment_order_slots_fit_three_gate_up_ctas_per_sm():
    """A fragment-order ring slot is the step's 1 KB plus its scales (no row padding): the grouped gate_up
    config of Qwen3-30B-A3B (K = 2048, all of K's token fragments resident, 4 warps, 8-step ring) then fits
    three times in an H200 SM's 228 KB (1 KB of it reserved per CTA), which row-major slots do not."""
    cfg = dict(NT=1, W=4, D=8, SEG=0, RG=4)
    sm_bytes, per_cta = 228 * 1024, 1024
    frag = _cuda_decode.smem_bytes(cfg, 16, 16, 0, 1, 128, frag=True)
    rows = _cuda_decode.smem_bytes(cfg, 16, 16, 0, 1, 128)
    assert frag == 4 * 8 * 1152 + 16 * 2048 + 4 * 129 and rows - frag == 4 * 8 * 256
    assert 3 * (frag + per_cta) <= sm_bytes < 3 * (rows + per_cta)


def _kernel_step_count(nsteps, lanes, chunk_steps, c):
    """J in decode_gemm.cu: my chunks, the last one possibly short (its closed form, mirrored)."""
    lcs = chunk_steps.bit_length() - 1 if chunk_steps else 20
    cs = 1 << lcs
    nchunks = -(-nsteps // cs)
    mine = (nchunks - 1 - c) // lanes + 1 if c < nchunks else 0
    last = c + (mine - 1) * lanes
    return 0 if mine == 0 else min(mine << lcs, (mine - 1) * cs + nsteps - (last << lcs))


@pytest.mark.parametrize("depth", _cuda_decode.DEPTHS)
def test_schedule_runs_every_step_once_in_the_contract_order(depth):
    """The kernel's main loop (mirrored step by step by the twin, for every segment and chunk-lane layout the
    launcher can pick): each warp's mma chain consumes its steps in order with the fragments decoded from
    exactly those steps' weight words and token fragments from the buffer that holds them; every warp passes
    the same segment barriers; the chunk sums cover K once and are added in chunk order (one chain: all of K
    in order)."""
    tried = 0
    for nsteps in (1, 2, 3, 5, 6, 9, 16, 17, 33):
        for chunk_steps, lanes in ((0, 1), (1, 1), (2, 2), (4, 1), (4, 2), (4, 4), (4, 8), (8, 4)):
            for nt, warps, seg_cfg in ((1, 4, 0), (2, 4, 0), (1, 8, 0), (4, 4, 0), (2, 8, 4), (1, 2, 3)):
                cfg = dict(NT=nt, W=warps, D=depth, SEG=seg_cfg, C=lanes)
                if warps % lanes:
                    continue
                eff = _cuda_decode.lanes_for(cfg, nsteps, chunk_steps)
                try:
                    seg = _cuda_decode.segment(cfg, nsteps, chunk_steps, eff)
                except ValueError:
                    continue
                assert seg * 32 * nt <= _cuda_decode.units_per_thread(nt) * 32 * warps  # the launch check
                assert seg >= nsteps or not chunk_steps or seg % (eff * chunk_steps) == 0
                sim = _decode_twin.simulate_row_group(nsteps, eff, chunk_steps, seg, depth)
                covered = []
                for c, lane in enumerate(sim["lanes"]):
                    mine = _decode_twin.my_steps(nsteps, eff, chunk_steps, c)
                    assert len(mine) == _kernel_step_count(nsteps, eff, chunk_steps, c)
                    assert [s for (_, s), _, _ in lane["consumed"]] == mine
                    assert all(s == frag == tok for s, frag, tok in lane["consumed"])
                    assert lane["switches"] == -(-nsteps // seg) - 1
                    covered += mine
                assert sorted(covered) == list(range(nsteps))
                cs = chunk_steps or nsteps
                assert sim["fold"] == [list(range(q * cs, min(q * cs + cs, nsteps))) for q in range(-(-nsteps // cs))]
                tried += 1
    assert tried > 100


@pytest.mark.parametrize("depth", _cuda_decode.DEPTHS)
@pytest.mark.parametrize("nrg", [2, 3, 4])
def test_row_groups_in_sequence_run_each_group_whole(depth, nrg):
    """A warp running row groups one after another (RG): the ring and the register pipeline run on across the
    groups, yet each group's chain consumes exactly its own K steps in order, with its own weight words and
    the resident token fragments, and each group's result sums all of K; no segment barriers."""
    for nsteps in (1, 2, 3, 6, 16, 17):
        for nt, warps in ((1, 2), (1, 4), (2, 4), (1, 8)):
            cfg = dict(NT=nt, W=warps, D=depth, SEG=0, RG=nrg)
            seg = _cuda_decode.segment(cfg, nsteps, 0, 1)
            rg = _cuda_decode.row_groups_for(cfg, nsteps, seg, 0)
            if seg < nsteps:  # the token fragments do not all fit: one row group per tile
                assert rg == 1
                continue
            assert rg == nrg
            lane = _decode_twin.simulate_row_group(nsteps, 1, 0, seg, depth, rg)["lanes"][0]
            want = [(i, s) for i in range(rg) for s in range(nsteps)]
            assert [st for st, _, _ in lane["consumed"]] == want
            assert all(st == frag == tok for st, frag, tok in lane["consumed"])
            assert lane["groups"] == [list(range(nsteps))] * rg and lane["switches"] == 0
    assert _cuda_decode.row_groups_for(dict(RG=4), 16, 16, 4) == 1  # K chunks: one row group per tile


def test_decode_dispatch_prefers_the_proven_cuda_kernel(monkeypatch):
    """M <= CUDA_MAX_M: the CUDA kernel when it is built, takes the operands and is proven bit-equal; else the
    Triton candidates in their order (no GPU here: verdicts stubbed)."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(G, "_proven", lambda c, d: True)
    assert G._pick_config(1, 4096, dev, cuda_ok=True) == G.cuda_config(1)
    assert [G.cuda_config(m)["NT"] for m in (1, 8, 9, 16, 17, 64)] == [1, 1, 1, 1, 2, 2]
    assert G._pick_config(64, 4096, dev, cuda_ok=True) == G.cuda_config(64, 4096)
    # above 16 rows with N: the fewest token tiles whose chains fit one resident wave of 8-warp CTAs, 4 warps
    # where the chains are no more than the schedulers (the measured bests of the q/k/v and o sweeps)
    def picks(n, ms):
        return [(c["NT"], c["W"], c["D"]) for c in (G.cuda_config(m, n) for m in ms)]
    assert picks(5120, (24, 32, 48, 64)) == [(1, 8, 8), (2, 8, 8), (2, 8, 8), (4, 8, 4)]
    assert picks(2048, (24, 32, 40, 64)) == [(1, 4, 8), (1, 4, 8), (1, 8, 8), (1, 8, 8)]
    assert G.cuda_config(64, 5120) == dict(variant="cuda", NT=4, W=8, D=4, SEG=0)
    assert G.cuda_config(64, 16384)["NT"] == 4 and G.cuda_config(16, 5120) == G.cuda_config(16)
    assert G._pick_config(G.CUDA_MAX_M + 1, 4096, dev, cuda_ok=True)["variant"] != "cuda"
    assert G._pick_config(1, 4096, dev, cuda_ok=False)["variant"] == "small"
    monkeypatch.setattr(G, "_proven", lambda c, d: c.get("variant") != "cuda")
    assert G._pick_config(1, 4096, dev, cuda_ok=True) == G.SMALL_CONFIG
    monkeypatch.setattr(G, "_grouped_proven", lambda c, d: True)
    assert G._grouped_config(False, False, 8, 128, dev, cuda_ok=True) == G.grouped_cuda_config(8, 128)
    # row groups in sequence where the tiles still fill the GPU: 64 tokens x top-8, not 1 token
    assert G.grouped_cuda_config(512, 128, 2048, 1536)["RG"] == 8
    assert G.grouped_cuda_config(64, 128, 2048, 1536)["RG"] == 4  # 8 tokens: 64 tiles x 3 blocks < 264
    # down 2048x768 from 16 tokens: 128 tiles x 4 row blocks at RG 8 overflow one wave of 396 CTAs; RG 11 makes
    # it 3 blocks (one wave); gate_up's 3 blocks at RG 8 already fit
    for m in (128, 256, 512):
        assert G.grouped_cuda_config(m, 128, 768, 2048)["RG"] == 11
    assert G.grouped_cuda_config(1024, 128, 768, 2048)["RG"] == 8  # above 4 rows per expert: not measured
    # decode: RG halves from 8 while half of it fits one wave of 396 CTAs; RG 2 below 132 pairs: RG 1
    gate_up, down = (2048, 1536), (768, 2048)
    assert [G.grouped_cuda_config(m, 128, *down).get("RG", 1) for m in (8, 16, 32, 64, 96)] == [1, 2, 4, 8, 8]
    assert [G.grouped_cuda_config(m, 128, *gate_up).get("RG", 1) for m in (8, 16, 32, 64, 96)] == [1, 2, 2, 4, 8]
    assert G.grouped_cuda_config(256, 32, 256, 1024).get("RG", 1) == 1  # 8 rows per expert (small): as before
    assert G.grouped_cuda_config(512, 128, 4096, 1536)["RG"] == 4  # K > 16 steps: from 4
    # up to 16 K steps three CTAs fit per SM: in decode one wave (396) that shares the pairs out evenly, also
    # when the routing makes more tiles than min(M, E); above 4 rows per expert 528 listed; above 16 steps 264
    for m, k, n in ((128, 768, 2048), (512, 768, 2048), (128, 2048, 1536), (512, 2048, 1536)):
        cfg = G.grouped_cuda_config(m, 128, k, n)
        assert cfg["CTAS"] == G.GROUPED_WAVE_CTAS and cfg["BAL"] == 1
    assert G.grouped_cuda_config(1024, 128, 768, 2048)["CTAS"] == G.GROUPED_LISTED_CTAS
    assert "BAL" not in G.grouped_cuda_config(1024, 128, 768, 2048)
    assert G.grouped_cuda_config(512, 128, 4096, 1536)["CTAS"] == G.GROUPED_RESIDENT_CTAS
    assert G.grouped_cuda_config(8, 128, 2048, 1536).get("RG", 1) == 1
    assert G.grouped_cuda_config(8, 128, 768, 2048) == dict(variant="cuda", NT=1, W=2, D=4, SEG=0, CTAS=2112)
    # short K and many rows per expert (small model, 32 experts top-4): NT token tiles share the weight steps
    assert G.grouped_cuda_config(1024, 32, 1024, 512)["NT"] == 4
    assert G.grouped_cuda_config(256, 32, 256, 1024)["NT"] == 2
    assert G.grouped_cuda_config(128, 32, 256, 1024)["NT"] == 1
    assert G.grouped_cuda_config(4096, 128, 2048, 1536)["NT"] == 1  # long K: NT = 1 at any rows per expert
    assert G.grouped_cuda_config(1024, 128, 768, 2048)["NT"] == 1   # RG fills the GPU: NT = 1 (measured faster)
    assert G._grouped_config(False, True, 16384 * 8, 128, dev, cuda_ok=True) == G.GROUPED_F16_CONFIG
    assert G._grouped_config(False, False, 8, 128, dev, cuda_ok=False) == G.GROUPED_FALLBACK


@pytest.mark.parametrize("schedule", [G._tile_schedule_torch, G._tile_schedule])
def test_tile_schedule_counts_valid_tiles(schedule):
    if schedule is G._tile_schedule and not _interpreted():
        pytest.skip("the Triton schedule kernel on CPU needs the interpreter")
    offs = torch.tensor([0, 3, 3, 40, 41], dtype=torch.int32)
    tile_e, tile_r, bound, n_valid = schedule(offs, 41, 16)
    assert int(n_valid) == 1 + 3 + 1 and bound == 3 + 4
    assert tile_e.tolist()[:5] == [0, 2, 2, 2, 3] and (tile_e[5:] == -1).all()
    assert tile_r.tolist()[:5] == [0, 3, 19, 35, 40]


def _schedule_kernel_vs_torch(e, bm, dev):
    g = torch.Generator().manual_seed(e * bm)
    for trial in range(3):
        counts = torch.randint(0, 3 * bm, (e,), generator=g) * (torch.rand(e, generator=g) > 0.3)
        offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).to(dev)
        m = int(offs[-1])
        got, want = G._tile_schedule(offs, m, bm), G._tile_schedule_torch(offs.to(torch.int64), m, bm)
        assert got[2] == want[2]
        for a, b in zip((got[0], got[1], got[3]), (want[0], want[1], want[3]), strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b), (e, bm, trial)


SCHEDULES = [(1, 16), (5, 16), (128, 64), (37, 128)]


@pytest.mark.skipif(not _interpreted(), reason="the Triton schedule kernel on CPU needs the interpreter")
@pytest.mark.parametrize("e, bm", SCHEDULES)
def test_tile_schedule_kernel_equals_its_torch_formula(e, bm):
    _schedule_kernel_vs_torch(e, bm, "cpu")


@pytest.mark.gpu
def test_gpu_schedule_kernels_equal_their_torch_formulas():
    """The grouped GEMM's tile schedule and the wgrad layout, compiled for the GPU, against their formulas."""
    dev = torch.device("cuda")
    for e, bm in SCHEDULES:
        _schedule_kernel_vs_torch(e, bm, dev)
    for align, fill in LAYOUTS:
        _layout_kernel_vs_torch(align, fill, dev)


# ----------------------------------------------------------------------------------------------- GPU
def _gpu_module():
    dev = torch.device("cuda")
    mod = G._cuda_module(dev)
    if mod is None:
        pytest.skip("the CUDA decode kernel is not built here (no nvcc, or disabled)")
    return dev


CONFIGS = [dict(variant="cuda", NT=nt, W=w, D=d, SEG=seg) for nt, w, d, seg in
           ((1, 4, 8, 4), (2, 4, 8, 4), (1, 2, 4, 4), (2, 8, 4, 4), (4, 4, 8, 4), (1, 1, 8, 4), (1, 4, 16, 0),
            (2, 4, 8, 0), (2, 8, 16, 0), (4, 8, 8, 0))]
CONFIGS += [dict(variant="cuda", NT=nt, W=w, D=d, SEG=0, RG=rg) for nt, w, d, rg in
            ((1, 4, 8, 4), (2, 4, 8, 2), (1, 2, 4, 8), (1, 8, 16, 16), (1, 4, 8, 11))]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", CONFIGS, ids=G.config_name)
def test_gpu_decode_configs_bit_equal_to_triton(cfg):
    """Every config, every decode M, fp32 / bf16 / fp16 outputs, with a bias, from row-major and from
    fragment-order codes (``decode_layout``): bitwise the Triton safe config's rows; and the float64
    reference."""
    dev = _gpu_module()
    g = torch.Generator().manual_seed(1)
    from minite.kernels import quantize
    a = quantize(checks.spread_input(64, 2048, dev, seed=2), scaling="row")
    a_mod = quantize(torch.randn(64, 2048, generator=g).to(dev), scaling="row")  # fp16 output must not overflow
    w = quantize((torch.randn(1536, 2048, generator=g) * 0.05).to(dev))
    bias = torch.randn(1536, generator=g).to(dev)
    wf = decode_layout(w)
    assert wf.frag is not None
    for m in (1, 2, 5, 8, 16, 33, 64):
        sub = a.rows(0, m)
        got = nvfp4_gemm(sub, w, out_dtype=torch.float32, config=cfg)
        assert torch.equal(got, nvfp4_gemm(sub, w, out_dtype=torch.float32, config=G.SAFE_CONFIG)), m
        assert torch.equal(nvfp4_gemm(sub, wf, out_dtype=torch.float32, config=cfg), got), m
        assert checks.rel_err(got, ref.nvfp4_matmul_reference(sub, w)) < 1e-5
        sub = a_mod.rows(0, m)
        for dt in (torch.bfloat16, torch.float16):
            want = nvfp4_gemm(sub, w, out_dtype=dt, bias=bias, config=G.SAFE_CONFIG)
            for x in (w, wf):
                assert torch.equal(nvfp4_gemm(sub, x, out_dtype=dt, bias=bias, config=cfg), want), (m, dt)


@pytest.mark.gpu
def test_gpu_decode_default_is_the_cuda_kernel_and_batch_invariant():
    """The default path at M <= 16 is the CUDA kernel (its probe passed), and its rows equal those of
    M = 16384 (the large-M path) bitwise."""
    dev = _gpu_module()
    from minite.kernels import quantize
    a = quantize(torch.randn(16384, 2048, device=dev), scaling="row")
    w = quantize(torch.randn(1024, 2048, device=dev))
    full = nvfp4_gemm(a, w, out_dtype=torch.float32)
    for m in (1, 2, 4, 8, 16, 32, 64):
        assert torch.equal(nvfp4_gemm(a.rows(100, 100 + m), w, out_dtype=torch.float32), full[100:100 + m]), m
    assert G.config_status().get(G.config_name(G.cuda_config(1))) is True


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_grouped_decode_bit_equal(tokens):
    """Realistic routing (random top-8 of 128 experts): the CUDA grouped kernel equals the grouped decode loop
    bitwise, and the reference per expert; per-row expert scales too."""
    dev = _gpu_module()
    from minite.kernels import quantize
    from minite.kernels.bench import moe_offsets
    offs = moe_offsets(tokens, 128, 8, dev, align=1)
    m = int(offs[-1])
    a = quantize(torch.randn(m, 768, device=dev), scaling="row")
    ws = [quantize(torch.randn(256, 768, device=dev), scaling="row" if i % 2 else "tensor") for i in range(128)]
    ws = [ref.NVFP4Tensor(x.codes, x.scales, x.row_global_scale().contiguous()) for x in ws]
    ex = stack_experts(ws)
    exf = decode_layout(ex)
    assert exf.frag is not None and not torch.equal(exf.frag, ex.codes)
    want = grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.float32, config=G.GROUPED_FALLBACK)
    for cfg in (dict(NT=1, W=4, D=8, SEG=4), dict(NT=2, W=4, D=8, SEG=4), dict(NT=1, W=4, D=8, SEG=0, RG=4),
                dict(NT=1, W=2, D=4, SEG=0, RG=16, CTAS=64), dict(NT=2, W=8, D=8, SEG=0, RG=2),
                dict(NT=1, W=4, D=16, SEG=0, RG=4), dict(NT=1, W=4, D=8, SEG=0, RG=11),
                dict(NT=1, W=4, D=4, SEG=0, RG=3, CTAS=100),
                # balanced (fragment-order codes): the plain grid's schedule while the tiles fit its rows of
                # CTAs (CTAS 396, RG 8 / 2: one / two row blocks a tile), else even shares that span tiles
                # (CTAS 7 and 100: more tiles than the CTAs hold at RG 2 / 11)
                dict(NT=1, W=4, D=8, SEG=0, RG=8, BAL=1, CTAS=396), dict(NT=1, W=4, D=8, SEG=0, RG=2, BAL=1, CTAS=396),
                dict(NT=1, W=4, D=8, SEG=0, RG=2, BAL=1, CTAS=7), dict(NT=1, W=4, D=4, SEG=0, RG=11, BAL=1, CTAS=100)):
        cfg = dict(variant="cuda", **cfg)
        for e in (ex, exf):  # row-major codes, fragment order (depths 4 / 8; 16 reads the row-major codes)
            got = grouped_nvfp4_gemm(a, e, offs, out_dtype=torch.float32, config=cfg)
            assert torch.equal(got, want), (G.config_name(cfg), e.frag is not None)
    o = offs.tolist()
    for i in range(128):
        if o[i + 1] > o[i]:
            r = ref.nvfp4_matmul_reference(a.rows(o[i], o[i + 1]), ws[i])
            assert checks.rel_err(want[o[i]:o[i + 1]], r) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_gpu_grouped_decode_rows_in_place(tokens):
    """The routed rows read in place (``rows``: the sampler's tokens quantized once, top-8 of 128 experts):
    every grouped CUDA config equals the gathered operand's result bitwise, int64 and int32 indices, and the
    default dispatch takes the CUDA kernel for it."""
    dev = _gpu_module()
    from minite.kernels import quantize
    from minite.kernels.fused_ops import sort_by_expert
    g = torch.Generator(device=dev).manual_seed(tokens)
    ids = torch.stack([torch.randperm(128, generator=g, device=dev)[:8] for _ in range(tokens)])
    _, rows, offs = sort_by_expert(ids, 128)
    a = quantize(torch.randn(tokens, 768, device=dev), scaling="row")
    ex = decode_layout(stack_experts([quantize(torch.randn(256, 768, device=dev) * 0.05) for _ in range(128)]))
    want = grouped_nvfp4_gemm(a.take(rows), ex, offs, out_dtype=torch.float32, config=G.GROUPED_FALLBACK)
    for cfg in (dict(NT=1, W=4, D=8, SEG=4), dict(NT=2, W=4, D=8, SEG=0, RG=2), dict(NT=1, W=4, D=8, SEG=0, RG=4),
                dict(NT=1, W=4, D=8, SEG=0, RG=4, BAL=1, CTAS=20)):
        cfg = dict(variant="cuda", **cfg)
        for idx in (rows, rows.to(torch.int32)):
            got = grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.float32, config=cfg, rows=idx)
            assert torch.equal(got, want), (G.config_name(cfg), idx.dtype)
    assert torch.equal(grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.float32, rows=rows), want)
    assert G.grouped_config_for(a.take(rows), ex).startswith("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 64, 256])
@pytest.mark.parametrize("n,k", [(512, 1024), (1024, 256)])
def test_gpu_grouped_decode_many_rows_per_expert_bit_equal(tokens, n, k):
    """32 experts, top-4 (the small model's MoE): the default grouped config at 4-32 rows per expert (NT = 1, 2,
    4 token tiles per CTA) equals the grouped decode loop bitwise."""
    dev = _gpu_module()
    from minite.kernels import quantize
    from minite.kernels.bench import moe_offsets
    offs = moe_offsets(tokens, 32, 4, dev, align=1)
    m = int(offs[-1])
    a = quantize(torch.randn(m, k, device=dev), scaling="row")
    ex = stack_experts([quantize(torch.randn(n, k, device=dev) * 0.02, tile=(16, 16)) for _ in range(32)])
    cfg = G.grouped_cuda_config(m, 32, k, n)
    want = grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.bfloat16, config=G.GROUPED_FALLBACK)
    assert torch.equal(grouped_nvfp4_gemm(a, ex, offs, out_dtype=torch.bfloat16, config=cfg), want), \
        G.config_name(cfg)
    assert torch.equal(grouped_nvfp4_gemm(a, decode_layout(ex), offs, out_dtype=torch.bfloat16, config=cfg), want)
    assert G.grouped_config_for(a, ex) == G.config_name(cfg)  # and the dispatch takes it (probe passed)


@pytest.mark.parametrize("nt", [1, 2, 4])
def test_grouped_tiles_cover_every_row_once(nt):
    """The kernel's per-CTA tile list (mirrored by the twin): every row of every expert exactly once, no tile
    wider than 8 NT rows or crossing an expert, empty experts skipped."""
    offs = [0, 0, 1, 9, 9, 26, 26, 27]
    tiles = _decode_twin.grouped_tiles(offs, nt)
    covered = [r for _, lo, hi in tiles for r in range(lo, hi)]
    assert covered == list(range(offs[-1]))
    for e, lo, hi in tiles:
        assert offs[e] <= lo < hi <= offs[e + 1] and hi - lo <= 8 * nt
