"""log_softmax_rows: the statistics kernel (the interpreter here, CUDA on a GPU) is bitwise its PyTorch
emulation of torch's cunn_SoftMaxForward order; a token's log-prob from them is torch's epilogue; on the GPU
whole rows equal torch.log_softmax bitwise, and the decode step's record kernel takes either form."""
import pytest
import torch
from minite.kernels import log_softmax as L
from minite.kernels import sampling as S


def _logits(b, v, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, v, generator=g) * torch.exp2(torch.randint(-2, 5, (b, 1), generator=g).float())
    return x.to(device)


@pytest.mark.parametrize("v", [L.SMEM_MIN, L.SMEM_MIN + 400, 4 * 4096 + 8])  # whole chunks, a tail, both
def test_kernel_is_its_emulation(v):
    x = _logits(3, v, v)
    a, b = L.log_softmax_stats_emulated(x), L.log_softmax_stats(x)
    assert torch.equal(a.mx, b.mx) and torch.equal(a.logsum, b.logsum)
    assert torch.allclose(a.full(), torch.log_softmax(x, -1), rtol=0, atol=1e-5)
    tok = torch.tensor([0, v - 1, 7])
    assert torch.equal(a.at(tok), a.full().gather(-1, tok[:, None]).squeeze(-1))


@pytest.mark.parametrize("chunks", [1, 3, 5, 6])
def test_rows_below_zero_and_any_number_of_chunks(chunks):
    """Rows of 1 .. 6 whole chunks (and a tail) whose logits are all negative: the emulation's max and sums,
    never a padding value's (a masked load's 0 would win the max)."""
    v = chunks * L.ILP * L.THREADS + 8
    x = -(_logits(2, v, chunks).abs() + 5.0)
    a, b = L.log_softmax_stats_emulated(x), L.log_softmax_stats(x, parts=4)
    assert torch.equal(a.mx, b.mx) and torch.equal(a.logsum, b.logsum) and bool((b.mx < 0).all())


@pytest.mark.parametrize("parts", [1, 2, 8, 32])
def test_kernel_bits_do_not_depend_on_the_parts_per_row(parts):
    """A row's threads spread over 1 .. 32 programs: the same per-thread sums and trees, the same bits."""
    x = _logits(2, L.SMEM_MIN + 400, parts)
    a, b = L.log_softmax_stats_emulated(x), L.log_softmax_stats(x, parts=parts)
    assert torch.equal(a.mx, b.mx) and torch.equal(a.logsum, b.logsum)


@pytest.mark.parametrize("parts,temperature", [(1, 0.7), (4, 0.7), (1, 1.0)])
def test_a_row_max_from_the_sampler_skips_the_max_pass(parts, temperature):
    """The sampler's blocks' maxima give each row's max exactly (at temperature 1 it is the max the draw's
    first pass takes for itself); the statistics from it are the same bits."""
    v = L.SMEM_MIN + 400
    x = _logits(3, v, 5)
    x[1, 7] = 1e3  # an outlier in a block of its own
    u = torch.tensor([0.1, 0.5, 0.9])
    tok, mx = S.sample_tokens_with_max(x, temperature, u, backend="triton")
    assert torch.equal(tok, S.sample_tokens(x, temperature, u, backend="triton"))
    assert torch.equal(mx, x.amax(-1))
    a, b = L.log_softmax_stats_emulated(x), L.log_softmax_stats(x, parts=parts, row_max=mx)
    assert torch.equal(a.mx, b.mx) and torch.equal(a.logsum, b.logsum)
    _, ref_mx = S.sample_tokens_with_max(x, temperature, u, top_p=0.9)  # the reference path
    assert torch.equal(ref_mx, mx)
    with pytest.raises(ValueError, match="row_max"):
        L.log_softmax_stats(x, row_max=mx[:2])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_dtype_logits_are_read_as_their_fp32_values(dtype):
    """The sampler keeps its logits in the model's dtype: the kernels widen them as they load, so the
    statistics, the row max from the draw and a recorded log-prob are those of the fp32 copy, bit for bit."""
    v = L.SMEM_MIN + 400
    x = _logits(3, v, 8).to(dtype)
    wide = x.float()
    want = L.log_softmax_stats_emulated(wide)
    for parts in (1, 4):
        got = L.log_softmax_stats(x, parts=parts)
        assert torch.equal(got.mx, want.mx) and torch.equal(got.logsum, want.logsum)
    u = torch.tensor([0.1, 0.5, 0.9])
    tok, mx = S.sample_tokens_with_max(x, 0.7, u, backend="triton")
    tok32, mx32 = S.sample_tokens_with_max(wide, 0.7, u, backend="triton")
    assert torch.equal(tok, tok32) and torch.equal(mx, mx32)
    got = L.log_softmax_stats(x, row_max=mx)
    assert got.logits.dtype == dtype and torch.equal(got.full(), want.full())
    assert torch.equal(got.at(tok), want.at(tok)) and got.at(tok).dtype == torch.float32
    assert L.covered(x) and L.covered(x[:, :L.SMEM_MIN]) and not L.covered(x[:, :L.SMEM_MIN + 2])
    assert torch.equal(L.log_softmax_rows(x), torch.log_softmax(wide, -1))  # CPU: torch's, on the fp32 copy
    with pytest.raises(ValueError, match="unit stride"):
        L.log_softmax_stats(x.double())


def test_parts_per_row_fill_the_gpu():
    cpu = torch.device("cpu")
    assert L.parts_per_row(64, cpu) == 1 and L.parts_per_row(1, cpu) == 8 and L.parts_per_row(3, cpu) == 4
    with pytest.raises(ValueError, match="power of two"):
        L.log_softmax_stats(_logits(1, L.SMEM_MIN, 0), parts=3)


def test_one_logit_rows_and_what_is_covered():
    """A row whose mass is one logit: max 0, a sum of exactly 1, logsum 0. Rows outside torch's regular
    kernel (short, or not a whole number of float4s) are not covered; the CPU takes torch's log-softmax."""
    v = L.SMEM_MIN
    x = torch.full((1, v), -1e4)
    x[0, 0] = 0.0
    got = L.log_softmax_stats_emulated(x)
    assert got.mx.item() == 0.0 and got.logsum.item() == 0.0  # exp(-1e4 - 0) = 0: a sum of exactly 1
    assert not L.covered(torch.zeros(2, 1000)) and not L.covered(torch.zeros(2, L.SMEM_MIN + 2))
    assert isinstance(L.log_softmax_rows(x), torch.Tensor)  # CPU: torch's full log-softmax


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_record_kernel_takes_the_statistics(dtype):
    b, v = 4, L.SMEM_MIN
    x = _logits(b, v, 1).to(dtype)
    stats = L.log_softmax_stats_emulated(x)
    tok = torch.tensor([3, 9, 0, v - 1])
    slots, nxt = torch.tensor([0, 1, 2, 3]), torch.tensor([1, 2, 3, 4])
    outs = []
    for backend in ("triton", "torch"):
        tokens = torch.zeros(5, 8, dtype=torch.int64)
        logprobs = torch.zeros(5, 8)
        stopped = torch.zeros(5, dtype=torch.bool)
        S.record_tokens(tok, stats, slots, nxt, torch.full((5,), 8), tokens, logprobs, stopped,
                        torch.tensor(2), 7, True, backend=backend)
        outs.append((tokens, logprobs, stopped))
    for a, c in zip(*outs, strict=True):
        assert torch.equal(a, c)
    assert torch.equal(outs[0][1][slots, nxt], stats.at(tok))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_statistics_are_torchs_log_softmax():
    from minite.kernels import _probe

    for v in (151936, L.SMEM_MIN + 400):
        for rows, seed in ((64, 0), (1, 1), (200, 2)):
            for dtype in (torch.float32, torch.bfloat16):
                x = _logits(rows, v, seed, "cuda").to(dtype)
                got = L.log_softmax_rows(x)
                assert isinstance(got, L.LogSoftmaxRows), _probe.verdicts("('log_softmax_rows'")
                assert torch.equal(got.full(), torch.log_softmax(x.float(), -1))
                assert torch.equal(L.log_softmax_stats_emulated(x).logsum, got.logsum)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,temperature", [(torch.float32, 0.7), (torch.bfloat16, 1.0)])
def test_pick_and_sums_in_one_launch_give_both_calls_values(device, dtype, temperature):
    """``sample_tokens_with_log_softmax``: the token of ``sample_tokens`` and the statistics of
    ``log_softmax_stats`` (the sums' max taken from the first pass's block maxima), bit for bit; where the
    statistics do not run (torch's backend) the same calls' results."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows, v = (3, L.SMEM_MIN + 400) if device == "cpu" else (64, 151936)
    x = _logits(rows, v, 11, device).to(dtype)
    x[1, 7] = 1e3  # an outlier in a block of its own
    u = torch.rand(rows, generator=torch.Generator().manual_seed(3)).to(device)
    tok, logp = S.sample_tokens_with_log_softmax(x, temperature, u, backend="triton")
    assert torch.equal(tok, S.sample_tokens(x, temperature, u, backend="triton"))
    want = L.log_softmax_stats_emulated(x) if device == "cpu" else L.log_softmax_rows(x)
    assert isinstance(logp, L.LogSoftmaxParts) and logp.logits is x
    got = logp.rows()
    assert torch.equal(got.mx, want.mx) and torch.equal(got.logsum, want.logsum)
    tok_t, logp_t = S.sample_tokens_with_log_softmax(x.cpu(), temperature, u.cpu(), backend="torch")
    assert torch.equal(tok_t, S.sample_tokens(x.cpu(), temperature, u.cpu(), backend="torch"))
    assert torch.equal(logp_t, torch.log_softmax(x.cpu().float(), -1))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_record_kernel_finishes_the_parts(device):
    """``record_tokens`` given ``LogSoftmaxParts`` (the fused pick's statistics before their last pass) writes
    the log-probs of the finished ``LogSoftmaxRows``, bit for bit, in its own launch."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rows, v = (3, L.SMEM_MIN + 400) if device == "cpu" else (64, 151936)
    x = _logits(rows, v, 5, device).to(torch.bfloat16)
    u = torch.rand(rows, generator=torch.Generator().manual_seed(4)).to(device)
    tok, parts = S.sample_tokens_with_log_softmax(x, 1.0, u, backend="triton")
    assert isinstance(parts, L.LogSoftmaxParts)
    finished = parts.rows()
    slots, nxt = torch.arange(rows, device=device), torch.full((rows,), 2, device=device)
    outs = []
    for logp in (parts, finished):
        tokens = torch.zeros(rows + 1, 8, dtype=torch.int64, device=device)
        logprobs = torch.zeros(rows + 1, 8, device=device)
        stopped = torch.zeros(rows + 1, dtype=torch.bool, device=device)
        S.record_tokens(tok, logp, slots, nxt, torch.full((rows + 1,), 8, device=device), tokens, logprobs, stopped,
                        torch.tensor(2, device=device), 7, True, backend="triton")
        outs.append((tokens, logprobs, stopped))
    for a, c in zip(*outs, strict=True):
        assert torch.equal(a, c)
    assert torch.equal(outs[0][1][slots, nxt], finished.at(tok))
