"""sample_tokens: the Triton inverse-CDF kernel (the interpreter here, CUDA on a GPU) draws, for every row,
the token whose float64 cumulative-probability interval holds draw x total; it equals the PyTorch reference
wherever the draw is not within rounding of a boundary; top_p and CPU tensors take the reference."""
import pytest
import torch
from minite.kernels import sampling as S

from minite.engines.decode_graphs import gc_paused


def _f64_interval(logits, temperature, tok):
    """(lower, upper) cumulative probability of ``tok`` in float64, per row."""
    p = torch.softmax(logits.double() / float(temperature), dim=-1)
    cdf = p.cumsum(-1)
    hi = cdf.gather(-1, tok[:, None]).squeeze(-1)
    return hi - p.gather(-1, tok[:, None]).squeeze(-1), hi


def _check_valid(logits, temperature, u, tok, slack=1e-5):
    lo, hi = _f64_interval(logits, temperature, tok)
    ud = u.double()
    assert bool(((lo - slack <= ud) & (ud <= hi + slack)).all()), (lo, ud, hi)
    p = torch.softmax(logits.double() / float(temperature), dim=-1)
    assert bool((p.gather(-1, tok[:, None]) > 0).all())


def _case(b, v, seed, device="cpu", spread=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * spread).to(device)
    u = torch.rand(b, generator=g).to(device)
    return logits, u


@pytest.mark.parametrize("b,v", [(5, 1000), (3, S.BLOCK * 2 + 17), (2, S.BLOCK)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_kernel_draws_the_inverse_cdf_token(b, v, temperature):
    logits, u = _case(b, v, seed=b + v)
    tok = S.sample_tokens(logits, temperature, u, backend="triton")
    assert tok.dtype == torch.int64 and tok.shape == (b,)
    _check_valid(logits, temperature, u, tok)
    ref = S.sample_tokens_reference(logits, temperature, u)
    lo, hi = _f64_interval(logits, temperature, ref)
    clear = ((u.double() - lo) > 1e-5) & ((hi - u.double()) > 1e-5)   # draws away from a boundary
    assert torch.equal(tok[clear], ref[clear])


def test_kernel_edges_first_and_last_tokens_and_zero_mass():
    v = S.BLOCK + 100
    logits = torch.full((4, v), -1e4)
    logits[:, 0] = 0.0                      # all the mass on token 0 ...
    logits[1, v - 1] = 0.0                  # ... and on the last token in row 1
    logits[2] = 0.0                         # uniform row
    u = torch.tensor([0.0, 0.9999999, 0.5, 0.9999999])
    tok = S.sample_tokens(logits, torch.tensor(1.0), u, backend="triton")
    assert tok.tolist()[0] == 0 and tok.tolist()[1] == v - 1 and tok.tolist()[3] == 0
    assert abs(tok.tolist()[2] - v // 2) <= 1


def test_kernel_blocks_without_mass_and_far_apart_maxima():
    """Blocks of -inf logits (a masked vocabulary) have no mass, and block sums taken at their own maxima are
    rescaled to the row's: a block whose max is 60 below the row's keeps its tiny share, nothing is NaN."""
    v = 3 * S.BLOCK
    logits = torch.full((3, v), float("-inf"))
    logits[0, S.BLOCK + 5] = 0.0                        # one token, in the middle block
    logits[1, :S.BLOCK] = -60.0                         # block 0 far below block 2
    logits[1, 2 * S.BLOCK:] = torch.linspace(-1, 1, S.BLOCK)
    logits[2, 2 * S.BLOCK + 7] = 3.0                    # mass only in the last block, all else -inf
    logits[2, 2 * S.BLOCK + 9] = 3.0
    u = torch.tensor([0.3, 0.5, 0.75])
    tok = S.sample_tokens(logits, 1.0, u, backend="triton")
    assert tok.tolist()[0] == S.BLOCK + 5 and tok.tolist()[2] == 2 * S.BLOCK + 9
    _check_valid(logits, 1.0, u, tok)
    assert 2 * S.BLOCK <= tok.tolist()[1] < 3 * S.BLOCK


def test_kernel_rows_do_not_depend_on_the_batch():
    logits, u = _case(6, 3000, seed=3)
    full = S.sample_tokens(logits, 1.0, u, backend="triton")
    for r in range(6):
        assert S.sample_tokens(logits[r:r + 1], 1.0, u[r:r + 1], backend="triton").item() == full[r].item()


def test_top_p_and_cpu_auto_take_the_reference():
    logits, u = _case(4, 500, seed=9)
    ref = S.sample_tokens_reference(logits, 1.0, u, top_p=0.5)
    assert torch.equal(S.sample_tokens(logits, 1.0, u, top_p=0.5, backend="triton"), ref)
    assert torch.equal(S.sample_tokens(logits, 1.0, u), S.sample_tokens_reference(logits, 1.0, u))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        S.sample_tokens(logits, 1.0, u[:2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_draws_valid_tokens_on_a_real_vocabulary_and_replays_in_a_graph():
    logits, u = _case(64, 151936, seed=11, device="cuda", spread=4.0)
    t = torch.tensor(0.9, device="cuda")
    tok = S.sample_tokens(logits, t, u)
    _check_valid(logits.cpu(), 0.9, u.cpu(), tok.cpu(), slack=1e-4)
    ref = S.sample_tokens_reference(logits, t, u)
    assert (tok == ref).float().mean().item() > 0.95
    out = torch.empty_like(tok)
    graph = torch.cuda.CUDAGraph()
    with gc_paused(), torch.cuda.graph(graph):
        out.copy_(S.sample_tokens(logits, t, u))
    u.copy_(torch.rand(64, device="cuda"))
    graph.replay()
    assert torch.equal(out, S.sample_tokens(logits, t, u))


def _state(device, seed):
    g = torch.Generator().manual_seed(seed)
    slots_n, width, b, v = 9, 12, 6, 50
    st = dict(end=torch.randint(4, width, (slots_n,), generator=g),
              tokens=torch.randint(0, v, (slots_n, width + 1), generator=g),
              logprobs=torch.randn(slots_n, width + 1, generator=g),
              stopped=torch.rand(slots_n, generator=g) < 0.3, stop=torch.tensor(7))
    step = dict(tok=torch.randint(0, v, (b,), generator=g), logp=torch.randn(b, v, generator=g).log_softmax(-1),
                slots=torch.randperm(slots_n - 1, generator=g)[:b], nxt=torch.randint(0, width, (b,), generator=g))
    step["tok"][:2] = 7  # two rows draw the stop token
    ids, pos = torch.full((b + 2,), -1), torch.full((b + 2,), -1)
    move = lambda d: {k: t.to(device) for k, t in d.items()}  # noqa: E731
    return move(st), move(step), ids.to(device), pos.to(device), width


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("write_tokens", [True, False])
@pytest.mark.parametrize("advance", [True, False])
def test_record_tokens_kernel_equals_the_reference(device, write_tokens, advance):
    """Positions past a slot's end go to the trash column; only the rows' own cells, stop flags and (advance)
    ids / pos change, and the kernel writes what the PyTorch ops write."""
    outs = []
    for backend in ("torch", "triton"):
        st, step, ids, pos, trash = _state(device, 3)
        b = step["tok"].shape[0]
        S.record_tokens(step["tok"], step["logp"], step["slots"], step["nxt"], st["end"], st["tokens"],
                        st["logprobs"], st["stopped"], st["stop"], trash, write_tokens,
                        (ids[:b], pos[:b]) if advance else None, backend=backend)
        outs.append((st["tokens"], st["logprobs"], st["stopped"], ids, pos))
    for a, b_ in zip(*outs, strict=True):
        assert torch.equal(a, b_)
    st0, step, ids0, pos0, trash = _state(device, 3)
    tokens, logprobs, stopped, ids, pos = outs[1]
    changed = (logprobs != st0["logprobs"]).nonzero().tolist()
    assert changed and all(r in step["slots"].tolist() for r, _ in changed)
    assert stopped[step["slots"][:2]].all() and (tokens != st0["tokens"]).any() == write_tokens
    assert torch.equal(ids[:6], step["tok"] if advance else ids0[:6]) and (ids[6:] == -1).all()
    assert torch.equal(pos[:6], step["nxt"] if advance else pos0[:6])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("b", [1, 6, 300])
def test_step_inputs_kernel_equals_the_reference(device, b):
    """The step's int32 slot ids and lengths, its next position (clamped at the last column) and the tables'
    cells there: the kernel writes what the PyTorch ops compute, across blocks of rows, dtypes included."""
    g = torch.Generator().manual_seed(b)
    slots_n, width = 301, 40
    tokens = torch.randint(0, 1000, (slots_n, width + 1), generator=g).to(device)
    uniform = torch.rand(slots_n, width + 1, generator=g).to(device)
    slots = torch.randint(0, slots_n, (b,), generator=g).to(device)
    pos = torch.randint(0, width, (b,), generator=g)
    pos[0] = width - 1  # nxt clamps to width - 1
    pos = pos.to(device)
    ref = S.step_inputs_reference(pos, slots, tokens, uniform, width - 1)
    out = S.step_inputs(pos, slots, tokens, uniform, width - 1, backend="triton")
    assert out.hidden is None and out.rows is None
    for r, o in zip(ref[:5], out[:5], strict=True):
        assert o.dtype == r.dtype and torch.equal(o, r)
    assert int(out.nxt[0]) == width - 1 and int(out.seq_lens[0]) == width
    # with the step's gathers: its embedding rows (a width that is no power of two) and its rotary rows
    embed = torch.randn(1000, 96, generator=g).to(device, torch.bfloat16)
    ids = torch.randint(0, 1000, (b,), generator=g).to(device)
    table = torch.randn(width, 2, 8, generator=g).to(device, torch.bfloat16)
    ref = S.step_inputs_reference(pos, slots, tokens, uniform, width - 1, embed, ids, table)
    out = S.step_inputs(pos, slots, tokens, uniform, width - 1, backend="triton", embed=embed, ids=ids, table=table)
    for r, o in zip(ref, out, strict=True):
        assert o.dtype == r.dtype and torch.equal(o, r)
    assert torch.equal(out.hidden, torch.nn.functional.embedding(ids, embed)) and out.rows.shape == (b, 2, 8)
    with pytest.raises(ValueError, match="embed and ids"):
        S.step_inputs(pos, slots, tokens, uniform, width - 1, embed=embed)
    assert S.step_inputs(pos, slots, tokens, uniform, width - 1, backend="torch").draw.dtype == torch.float32
