"""The sampler's fast decode path: capture sizes, a step that reads nothing back to the host, rows leaving the
running batch without changing any sequence, trainer == sampler bit for bit in the aligned arm, large
vocabularies, in-place weight updates; on the GPU, graph == eager bit for bit for every arm."""
import functools
import gc
import weakref

import pytest
import torch
from test_sampler import PROMPTS, make_sampler, tiny_hf_model

from minite.engines import sampler_ops as ops
from minite.engines.arms import load_arm
from minite.engines.decode_graphs import DecodeRunner, DecodeState, capture_sizes, gc_paused, padded_size
from minite.engines.models import load_model_config
from minite.engines.sampler import Sampler
from minite.engines.sampler_weights import build_sampler_weights
from minite.engines.sync import payload_from_hf_model

ARMS = ("bf16", "naive_te_nvfp4", "minite_nvfp4")
# six prompts: padded to 8 rows; once 4 or fewer are left the batch runs at size 4
SIX = PROMPTS + [[1, 11, 12, 13], [1, 4, 4], [1, 20, 21, 22, 23, 24]]


@pytest.fixture(scope="module")
def tiny():
    return tiny_hf_model()


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(256)[-7:] == [64, 96, 128, 160, 192, 224, 256]
    assert capture_sizes(3) == [1, 2, 3] and capture_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100]
    assert [padded_size(n, capture_sizes(64)) for n in (1, 3, 5, 17, 33, 64)] == [1, 4, 8, 24, 48, 64]
    with pytest.raises(ValueError, match="exceed"):
        padded_size(65, capture_sizes(64))


class _Cycle:
    def __init__(self, payload=None):
        self.payload, self.me = payload, self


@pytest.fixture
def collector_off():
    """Python's automatic garbage collection off for the test (cyclic garbage stays until collected), then
    restored as it was."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    (gc.enable if enabled else gc.disable)()


def test_gc_paused_collects_first_and_restores_the_collector(collector_off):
    for start in (True, False):
        (gc.enable if start else gc.disable)()
        dead = weakref.ref(_Cycle())  # garbage only a collection frees
        with gc_paused():
            assert dead() is None and not gc.isenabled()
        assert gc.isenabled() == start
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError
        assert gc.isenabled() == start


def test_dropped_sampler_is_freed_without_the_collector(tiny, collector_off):
    """The runner holds its engine's step weakly: dropping a sampler frees it (and, on a GPU, its graphs and
    their memory pool) at once, not at some later collection; a runner whose engine is gone says so."""
    cfg, model = tiny
    s = make_sampler(load_arm("minite_nvfp4"), cfg, model)
    s.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    runner, dead = s._runner, weakref.ref(s)
    del s
    assert dead() is None
    with pytest.raises(RuntimeError, match="freed"):
        runner.step("greedy")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_survives_dropped_graphs_in_a_reference_cycle(collector_off):
    """A dropped runner's graphs wait in a reference cycle while new ones are captured; a collection during
    that capture would destroy them and invalidate it. Here one is forced inside the capture, where the
    automatic collector must also be off."""
    st = DecodeState(4, 8, "cuda")
    seen = []

    def step(b, mode, capture):
        if torch.cuda.is_current_stream_capturing():
            seen.append(gc.isenabled())
            gc.collect()
        st.logprobs[:b, 0] += 1.0

    old = DecodeRunner(step, st, 4, cuda_graphs=True)
    old.prepare("greedy")
    dropped = weakref.ref(_Cycle(old))
    del old
    assert dropped() is not None
    new = DecodeRunner(step, st, 4, cuda_graphs=True)
    new.prepare("greedy")
    assert dropped() is None and seen and not any(seen)
    st.logprobs.zero_()
    new.start([0, 1, 2], torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long))
    new.step("greedy")
    assert new.graphs and st.logprobs[:4, 0].tolist() == [1.0] * 4
    torch.randn(8, device="cuda")  # the generator is out of capture mode


def _run_step_fake(s):
    """One decode step of a live batch on fake tensors: any read of a computed value back to the host (item,
    bool, int, tolist, nonzero) raises DataDependentOutputException."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    st, runner = s._decode_ready()
    runner.start([0, 1, 2], torch.tensor([5, 6, 7]), torch.tensor([5, 3, 8]))
    before = st.pos.clone()
    with FakeTensorMode(allow_non_fake_inputs=True):
        s._decode_step(runner.size, "sample")
    assert torch.equal(st.pos, before)  # the real buffers were not touched


@pytest.mark.parametrize("arm_name", ["bf16", "naive_te_nvfp4"])
def test_decode_step_reads_nothing_back(tiny, arm_name):
    """(The aligned arm's CPU GEMM path reads expert offsets on the host by design; the GPU test covers it.)"""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    cfg, model = tiny
    s = make_sampler(load_arm(arm_name), cfg, model)
    s.generate(PROMPTS, 2, generator=torch.Generator().manual_seed(0))
    _run_step_fake(s)
    real = s._decode_step
    s._decode_step = lambda b, mode, cap=None: (int(s._state.pos[:b].max()), real(b, mode, cap))
    with pytest.raises(DataDependentOutputException):  # the check sees a host read
        _run_step_fake(s)


def _stop_token_that_compacts(out_free, n_prompts):
    """A token that >= 2 rows draw within their first 8 tokens (so at the first check the batch of 8 padded
    rows shrinks to 4) while >= 1 row goes on to >= 12 tokens."""
    resp = [out_free.tokens[i, len(p):][out_free.response_mask[i, len(p):].bool()].tolist()
            for i, p in enumerate(SIX[:n_prompts])]
    for c in range(3, 32):
        first = [r.index(c) if c in r else len(r) for r in resp]
        if sum(f < 8 for f in first) >= 2 and max(first) >= 12:
            return c
    raise AssertionError("no stop token makes the batch shrink; change the seed")


def _truncate_at(out, i, stop):
    """Row i's response tokens and log-probs up to and including its first ``stop``."""
    m = out.response_mask[i].bool()
    toks, lps = out.tokens[i][m].tolist(), out.logprobs[i][m]
    n = toks.index(stop) + 1 if stop in toks else len(toks)
    return toks[:n], lps[:n]


def test_rows_leaving_the_batch_change_no_sequence(tiny):
    """Aligned arm (batch-invariant kernels): with a stop token, finished rows leave and the rest run at a
    smaller batch size; every sequence's tokens and log-probs equal those of the run where all rows go on."""
    cfg, model = tiny
    s = make_sampler(load_arm("minite_nvfp4"), cfg, model)
    free = s.generate(SIX, 16, generator=torch.Generator().manual_seed(5), stop_token=None)
    stop = _stop_token_that_compacts(free, len(SIX))
    out = s.generate(SIX, 16, generator=torch.Generator().manual_seed(5), stop_token=stop)
    assert s._runner.size <= 4  # the batch did shrink (from 8)
    for i in range(len(SIX)):
        t_free, lp_free = _truncate_at(free, i, stop)
        t_out, lp_out = _truncate_at(out, i, stop)
        assert t_out == t_free and torch.equal(lp_out, lp_free), i
    # score: rows leave as they run out of tokens; the eager every-row-every-step replay agrees bit for bit
    seen = []
    replay = s.score(out.tokens, out.prompt_lens, capture=lambda *a: seen.append(a[1]))
    assert seen and torch.equal(s.score(out.tokens, out.prompt_lens), replay)
    m = out.response_mask.bool()
    assert torch.equal(replay[m], out.logprobs[m])


@pytest.mark.slow
def test_aligned_trainer_equals_sampler_with_rows_leaving():
    """miniTE: trainer log-probs == sampler log-probs bit for bit (k3 exactly 0) on rollouts whose batch
    shrank as sequences stopped."""
    from minite.diagnostics.metrics import align_trainer_logprobs, mismatch_metrics

    tr, s = _aligned_trainer_and_sampler("tiny", "cpu")
    free = s.generate(SIX, 16, generator=torch.Generator().manual_seed(5), stop_token=None)
    out = s.generate(SIX, 16, generator=torch.Generator().manual_seed(5),
                     stop_token=_stop_token_that_compacts(free, len(SIX)))
    assert s._runner.size <= 4
    m = out.response_mask.bool()[:, 1:]
    logp_t = tr.logprobs(out.tokens)
    assert torch.equal(logp_t[m], out.logprobs[:, 1:][m])
    k3 = mismatch_metrics(out.logprobs, align_trainer_logprobs(logp_t), out.response_mask)["k3"]
    assert k3 == 0.0


def test_large_vocabulary_generates(tiny):
    """A 151,936-id model with the char tokenizer named (as the random-init qwen3_30b_a3b config): no text,
    no crash; the char tokenizer renders ids it does not know as U+FFFD."""
    from minite.engines.models import build_hf_config, build_hf_model
    from minite.tokenizer import UNKNOWN, CharTokenizer

    cfg = dict(load_model_config("tiny"), vocab_size=151936)
    model = build_hf_model(cfg, build_hf_config(cfg), seed=0)
    s = Sampler(load_arm("bf16"), cfg, max_seq_len=16)
    s.load_weights(payload_from_hf_model(model, load_arm("bf16")))
    out = s.generate([[1, 150000, 7], [1, 99999]], 4, generator=torch.Generator().manual_seed(0))
    assert out.texts is None and out.tokens.shape[0] == 2 and int(out.tokens.max()) < 151936
    assert CharTokenizer().decode([1, 5, 151935, 6]) == f"2{UNKNOWN}3"


def test_weights_update_in_place(tiny):
    """A re-sync with the same layout copies into the tensors captured graphs read (same addresses)."""
    cfg, model = tiny
    arm = load_arm("minite_nvfp4")
    s = make_sampler(arm, cfg, model, calibrate=False)
    w = s.weights
    other = build_sampler_weights(payload_from_hf_model(tiny_hf_model(seed=2)[1], arm), arm.sampler, s.config)
    other.prepare(arm.sampler)
    ptrs = [t.data_ptr() for t in w.tensors()]
    assert not all(torch.equal(a, b) for a, b in zip(w.tensors(), other.tensors(), strict=True))
    assert w.copy_(other)
    assert [t.data_ptr() for t in w.tensors()] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(w.tensors(), other.tensors(), strict=True))
    ex = w.layers[0].experts
    assert ex.gate_up[3].codes.data_ptr() == ex.stacked["gate_up"].codes[3].data_ptr()  # lists are views
    bf16 = build_sampler_weights(payload_from_hf_model(model, load_arm("bf16")), load_arm("bf16").sampler,
                                 s.config)
    assert not w.copy_(bf16)  # another layout: refused, nothing copied


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("model", ["tiny", "qwen3_30b_a3b"])
def test_rotary_table_rows_are_transformers_values(device, model):
    """The "hf" sampler gathers its cos / sin rows from tables transformers' module made once; every row
    equals the module's own output for those positions in a batch of any shape."""
    from minite.engines.sampler import hf_config_of

    rot = ops.Rotary(hf_config_of(load_model_config(model, 1)), "hf", 300, device)
    g = torch.Generator().manual_seed(0)
    for shape in ((64, 1), (3, 17), (1, 300)):
        pos = torch.randint(0, 300, shape, generator=g).to(device)
        for dtype in (torch.bfloat16, torch.float32):
            got = rot.tables(pos, dtype)
            want = rot.hf(torch.empty(0, dtype=dtype, device=device), pos)
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)


def test_route_keeps_the_activation_dtype_for_fp32_logits():
    logits = torch.randn(5, 16).to(torch.bfloat16)
    w, idx = ops.route(logits, 4, True, "hf")
    w32, idx32 = ops.route(logits.float(), 4, True, "hf", dtype=torch.bfloat16)
    assert w.dtype == w32.dtype == torch.bfloat16 and torch.equal(w, w32) and torch.equal(idx, idx32)


@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_codes_are_each_linears_own_cast(monkeypatch, with_residual):
    """miniTE's sampler (kernel GEMMs, per-row scales): a norm's last pass writes its output's codes (the
    fused cast, under the interpreter), and the linears and experts after it give the same bits with those
    codes as with their own cast; with an emulated GEMM or during calibration the norm makes no codes."""
    from minite.kernels import fused_ops
    from minite.kernels.checks import same_nvfp4, spread_input

    from minite import kernels, nvfp4
    from minite.engines.sampler_weights import Lin

    recipe = load_arm("minite_nvfp4").sampler
    monkeypatch.setenv("MINITE_KERNELS_BACKEND", "triton")  # the Triton casts, interpreted on CPU
    for name in ("nvfp4_gemm", "grouped_nvfp4_gemm"):  # the W4A4 GEMMs: their exact CPU path
        monkeypatch.setattr(kernels, name, functools.partial(getattr(kernels, name), backend="torch"))
    x = spread_input(6, 64, "cpu", torch.bfloat16, seed=1).reshape(2, 3, 64)
    res = spread_input(6, 64, "cpu", torch.bfloat16, seed=2).reshape(2, 3, 64) if with_residual else None
    w = spread_input(1, 64, "cpu", torch.bfloat16, seed=3)[0].abs() + 0.5
    y, new_res, codes = ops.rms_norm_for_linears(x, w, 1e-6, recipe, res)
    want = fused_ops.rms_norm(x, w, 1e-6, recipe.non_gemm, residual=res)
    want_y = want[0] if with_residual else want
    assert torch.equal(y, want_y) and (new_res is None) == (res is None)
    assert res is None or torch.equal(new_res, want[1])
    own = ops.quantize_activation(want_y.reshape(-1, 64), recipe.activations)
    assert codes is not None and same_nvfp4(codes, own)
    lin = Lin("q", q=nvfp4.quantize(spread_input(32, 64, "cpu", torch.float32, seed=4), tile=(16, 16)))
    assert torch.equal(ops.linear(y, lin, recipe, codes=codes), ops.linear(y, lin, recipe))
    ex = kernels.stack_experts([nvfp4.quantize(spread_input(32, 64, "cpu", torch.float32, seed=5 + e),
                                               tile=(16, 16)) for e in range(3)])
    rows, offsets = torch.tensor([0, 4, 1, 5, 2]), torch.tensor([0, 2, 2, 5])
    args = (y.reshape(-1, 64), ex, offsets, recipe, None, "experts.gate_up")
    assert torch.equal(ops.grouped_linear(*args, rows=rows, codes=codes), ops.grouped_linear(*args, rows=rows))
    assert ops.rms_norm_for_linears(x, w, 1e-6, recipe, res, calib=ops.Calibrator())[2] is None
    assert ops.rms_norm_for_linears(x, w, 1e-6, load_arm("naive_te_nvfp4").sampler, res)[2] is None


def test_sample_tokens_inverse_cdf():
    logits = torch.tensor([[0.0, float("-inf"), 0.0, float("-inf")], [2.0, 1.0, 0.0, -1.0]])
    probs = torch.softmax(logits, -1)
    for u in (0.0, 0.25, 0.4999, 0.5, 0.75, 1.0 - 2 ** -24):
        tok, row_max = ops.sample_tokens_with_max(logits, 1.0, None, torch.full((2,), u))
        assert torch.equal(row_max, logits.amax(-1))
        assert tok[0] in (0, 2) and tok[0] == (0 if u < 0.5 else 2)  # never a zero-probability token
        assert tok[1] == int((probs[1].cumsum(0) <= u).sum())
    # top_p: only the most likely token survives a tiny top_p, whatever the draw
    assert ops.sample_tokens_with_max(logits, 1.0, 1e-6, torch.full((2,), 0.999))[0].tolist() == [0, 0]
    g = torch.Generator().manual_seed(0)
    draws = ops.sample_tokens_with_max(logits[1:].expand(20000, 4), 1.0, None, torch.rand(20000, generator=g))[0]
    freq = torch.bincount(draws, minlength=4).float() / 20000
    assert (freq - probs[1]).abs().max() < 0.015


# ------------------------------------------------------------------------------------------------- GPU
def _gpu_sampler(arm_name, **kw):
    cfg, model = tiny_hf_model()
    arm = load_arm(arm_name)
    s = Sampler(arm, cfg, device="cuda", max_seq_len=48, **kw)
    s.load_weights(payload_from_hf_model(model, arm))
    s.calibrate(SIX)
    return s


@pytest.mark.gpu
@pytest.mark.parametrize("arm_name", ARMS)
def test_graph_equals_eager(arm_name):
    """Same batches (the same stop token, the same rows leaving): CUDA graphs and eager steps give the same
    tokens and log-probs, bit for bit; score too."""
    s = _gpu_sampler(arm_name)
    free = s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5), stop_token=None)
    stop = _stop_token_that_compacts(free, len(SIX))
    runs = {}
    for graphs in (True, False):
        s.cuda_graphs = graphs
        out = s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5), stop_token=stop)
        assert s._runner.size <= 4
        runs[graphs] = (out, s.score(out.tokens, out.prompt_lens))
    assert s._runner.graphs  # captured, and used in the graphs run
    (a, sa), (b, sb) = runs[True], runs[False]
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs) and torch.equal(sa, sb)


@pytest.mark.gpu
@pytest.mark.parametrize("arm_name", ARMS)
def test_step_does_not_synchronise(arm_name):
    s = _gpu_sampler(arm_name, cuda_graphs=False)
    s.generate(SIX, 3, generator=torch.Generator(device="cuda").manual_seed(0))  # compile, probe configs
    _, runner = s._decode_ready()
    runner.start([0, 1, 2], torch.tensor([5, 6, 7], device="cuda"), torch.tensor([5, 3, 8], device="cuda"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.step("sample")
        runner.step("score")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _aligned_trainer_and_sampler(model: str, device: str):
    """A miniTE trainer (rotary inverse frequencies in fp32, as from_pretrained keeps them) and a sampler of
    max_seq_len 32 holding its weights."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    from minite.engines.sync import sync_weights
    from minite.engines.trainer import Trainer

    cfg = load_model_config(model)
    arm = load_arm("minite_nvfp4")
    tr = Trainer(arm, cfg, device=device, seed=0)
    if tr.model.model.rotary_emb.inv_freq.dtype != torch.float32:
        tr.model.model.rotary_emb = Qwen3MoeRotaryEmbedding(tr.model.config).to(device)
    s = Sampler(arm, cfg, device=device, max_seq_len=32)
    sync_weights(tr, s)
    return tr, s


@pytest.mark.gpu
def test_gpu_aligned_trainer_equals_sampler_graphs():
    tr, s = _aligned_trainer_and_sampler("tiny", "cuda")
    free = s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5), stop_token=None)
    out = s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5),
                     stop_token=_stop_token_that_compacts(free, len(SIX)))
    assert s._runner.graphs and s._runner.size <= 4
    m = out.response_mask.bool()[:, 1:]
    assert torch.equal(tr.logprobs(out.tokens)[m], out.logprobs[:, 1:][m])


@pytest.mark.gpu
def test_gpu_aligned_trainer_equals_sampler_small_batches_of_a_wide_model():
    """The ``small`` model (1024 wide) at batches of 8 and 2 rows, end to end: every norm of the sampler's
    step has fewer than 16 rows, the trainer's have B x T. (Not a detector of the norms' row count by itself:
    a mean's last bit seldom reaches a BF16 output, and this run passed without the padding; the fused-ops
    tests check that.)"""
    tr, s = _aligned_trainer_and_sampler("small", "cuda")
    for prompts in (SIX, SIX[:2]):
        out = s.generate(prompts, 12, generator=torch.Generator(device="cuda").manual_seed(3), stop_token=None)
        assert s._runner.graphs and s._runner.size < 16
        m = out.response_mask.bool()[:, 1:]
        assert torch.equal(tr.logprobs(out.tokens)[m], out.logprobs[:, 1:][m])


@pytest.mark.gpu
@pytest.mark.parametrize("arm_name", ARMS)
def test_gpu_resync_keeps_graphs(arm_name):
    """A re-sync copies the new weights into the tensors the captured graphs read: the same graphs, and
    their tokens equal an eager run and a fresh sampler holding those weights."""
    s = _gpu_sampler(arm_name)
    s.generate(SIX, 4, generator=torch.Generator(device="cuda").manual_seed(0))
    graphs = dict(s._runner.graphs)
    arm = load_arm(arm_name)
    payload = payload_from_hf_model(tiny_hf_model(seed=2)[1], arm)
    s.load_weights(payload)
    assert s._runner.graphs == graphs
    runs = []
    for graphs_on in (True, False):
        s.cuda_graphs = graphs_on
        runs.append(s.generate(SIX, 6, generator=torch.Generator(device="cuda").manual_seed(1)))
    fresh = Sampler(arm, load_model_config("tiny"), device="cuda", max_seq_len=48, cuda_graphs=False)
    fresh.load_weights(payload)
    if s.weights.amax_dict():
        fresh.weights.copy_amax_from(s.weights)
        fresh.weights.prepare(arm.sampler)
    runs.append(fresh.generate(SIX, 6, generator=torch.Generator(device="cuda").manual_seed(1)))
    for r in runs[1:]:
        assert torch.equal(r.tokens, runs[0].tokens) and torch.equal(r.logprobs, runs[0].logprobs)


@pytest.mark.gpu
@pytest.mark.parametrize("arm_name", ARMS)
def test_pdl_launches_give_the_plain_launches_bits(monkeypatch, arm_name):
    """Kernels launched with programmatic dependent launch (the default on sm_90+) wait for the kernel before
    them: the same tokens and log-probs as plain launches, bit for bit, through CUDA graphs."""
    from minite.kernels import _backend

    runs = []
    for pdl in ("1", "0"):
        monkeypatch.setenv("MINITE_KERNELS_PDL", pdl)
        assert _backend.pdl_on(torch.device("cuda")) == (pdl == "1" and torch.cuda.get_device_capability() >= (9, 0))
        s = _gpu_sampler(arm_name)
        s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5), stop_token=None)  # capture
        out = s.generate(SIX, 16, generator=torch.Generator(device="cuda").manual_seed(5), stop_token=None)
        assert s._runner.graphs
        runs.append((out, s.score(out.tokens, out.prompt_lens)))
    (a, sa), (b, sb) = runs
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs) and torch.equal(sa, sb)
