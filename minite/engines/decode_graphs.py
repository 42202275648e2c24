"""The sampler's running batch: static decode state, CUDA graphs per batch size, rows leaving the batch.

A decode step reads and writes only the buffers of ``DecodeState`` (fixed addresses, fixed shapes), so it can
be captured once per batch size and replayed (vLLM's ``CudaGraphManager``, gpt-fast's static decode):

* inputs, per row of the running batch: the token fed, its position, the sequence's cache slot;
* tables per cache slot and position: tokens (the prompt, then what was drawn or teacher-forced), their
  log-probs, the uniform draw that picks the token at that position; per slot the width it may write up to
  and whether it has drawn the stop token;
* sampling parameters as device scalars (temperature, top-p, stop token), set before a run, read at replay.

Rows are padded up to the next captured size with rows on the dummy slot (the cache's last slot, which no
sequence owns: sglang's padding), so padding computes garbage nobody reads. ``DecodeRunner`` keeps the list of
live rows on the host; ``keep`` drops rows that left (finished, or out of tokens to score) and, when the
live rows fit a smaller captured size, moves them to the front of the buffers and switches to that size
(vLLM's ``InputBatch.condense``; with slot indirection the KV cache itself never moves). That host check runs
between steps, never inside one.

Capture (per sampling mode, all sizes largest first into one shared memory pool): each size runs once on a
side stream first (Triton compiles, kernel configs get probed), with every row on the dummy slot. Without
CUDA (or with graphs off) ``step`` runs the same function eagerly at the same padded sizes, so graph and
eager paths compute the same bits. Python's garbage collector is paused while graphs are captured
(``gc_paused``), and the runner holds its engine's step weakly, so a dropped engine frees its graphs at once.
"""
from __future__ import annotations

import contextlib
import gc
import inspect
import weakref

import torch

from minite import kernels

#: captured batch sizes up to 64; beyond it, every 32 (and max_batch itself)
SMALL_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)
#: sampling modes a graph is captured for (what the step does after the logits)
MODES = ("greedy", "sample", "top_p", "score")


def capture_sizes(max_batch: int) -> list[int]:
    sizes = {s for s in SMALL_SIZES if s < max_batch} | set(range(96, max_batch, 32)) | {max_batch}
    return sorted(sizes)


def padded_size(n: int, sizes: list[int]) -> int:
    """The smallest captured size that holds n rows."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows exceed the largest batch size {sizes[-1]}")


@contextlib.contextmanager
def gc_paused():
    """Collect once, then no automatic garbage collection until the block ends (as Transformer Engine's graph
    capture does since its PR #2092). ``torch.cuda.graph`` stopped collecting before a capture in torch 2.9,
    so a collection that fires during one can free an older graph held only by a reference cycle (any object
    of the caller's may hold one); destroying a graph while a stream captures invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``) and leaves the CUDA generator in its capture state."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeState:
    """The static buffers a decode step reads and writes (module docstring). ``dummy`` = the padding slot;
    the tables have one extra column, ``trash``, where writes past a slot's ``end`` go."""

    def __init__(self, max_batch: int, max_seq_len: int, device):
        dev, n_slots, width = torch.device(device), max_batch + 1, max_seq_len + 1
        self.dummy, self.trash, self.max_seq_len = max_batch, max_seq_len, max_seq_len
        self.ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.pos = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slots = torch.full((max_batch,), self.dummy, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(n_slots, width, dtype=torch.long, device=dev)
        self.logprobs = torch.zeros(n_slots, width, dtype=torch.float32, device=dev)
        self.uniform = torch.zeros(n_slots, width, dtype=torch.float32, device=dev)
        self.end = torch.full((n_slots,), max_seq_len, dtype=torch.long, device=dev)
        self.stopped = torch.zeros(n_slots, dtype=torch.bool, device=dev)
        self.temperature = torch.ones((), dtype=torch.float32, device=dev)
        self.top_p = torch.ones((), dtype=torch.float32, device=dev)
        self.stop = torch.full((), -1, dtype=torch.long, device=dev)

    def reset_slots(self, n: int, end: int | None = None) -> None:
        """Fresh tables for slots 0 .. n-1 (a new generate / score call): PAD tokens, zero log-probs and
        draws, writes allowed up to ``end`` (default: the whole width), nothing stopped."""
        self.tokens[:n].zero_()
        self.logprobs[:n].zero_()
        self.uniform[:n].zero_()
        self.end[:n].fill_(self.max_seq_len if end is None else end)
        self.stopped[:n].zero_()

    def emit(self, tok: torch.Tensor, logp: torch.Tensor, slots: torch.Tensor, nxt: torch.Tensor,
             write_tokens: bool, advance: bool = False) -> None:
        """Record the token at position ``nxt`` of each row's slot (positions at or past the slot's end go to
        the trash column), its log-prob (``logp``: the rows' [B, V] log-softmax, or its ``LogSoftmaxRows`` /
        ``LogSoftmaxParts``) and whether it is the stop token; ``advance``: then feed it (ids[:B] = tok,
        pos[:B] = nxt). One launch on CUDA (``minite.kernels.record_tokens``)."""
        b = tok.shape[0]
        kernels.record_tokens(tok, logp, slots, nxt, self.end, self.tokens, self.logprobs, self.stopped, self.stop,
                              self.trash, write_tokens, (self.ids[:b], self.pos[:b]) if advance else None)


class DecodeRunner:
    """Runs ``step_fn(b, mode, capture)`` (one decode step over rows 0 .. b-1 of the state's buffers) for the live
    rows: replays a captured graph of size b, or calls it eagerly. ``rows``: the live rows' slots, in
    buffer order."""

    def __init__(self, step_fn, state: DecodeState, max_batch: int, cuda_graphs: bool):
        # an engine's bound method is held weakly: the engine owns its runner, and a strong reference back would
        # be a cycle that only the garbage collector frees, with the graphs and their memory pool in it
        self._step_ref = weakref.WeakMethod(step_fn) if inspect.ismethod(step_fn) else (lambda: step_fn)
        self.state = state
        self.sizes = capture_sizes(max_batch)
        self.cuda_graphs = cuda_graphs
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.rows: list[int] = []
        self.size = 0

    @property
    def step_fn(self):
        fn = self._step_ref()
        if fn is None:
            raise RuntimeError("the engine this decode runner steps has been freed")
        return fn

    # -------------------------------------------------------------------------------------------- graphs
    def drop_graphs(self) -> None:
        """Forget the captured graphs (the tensors they read are being replaced)."""
        self.graphs, self.pool = {}, None

    def prepare(self, mode: str) -> None:
        """Capture ``mode`` for every size if graphs are on and it is not captured yet. Call before ``start``:
        warm-up and capture run every row on the dummy slot."""
        if mode not in MODES:
            raise ValueError(f"decode mode {mode!r}: expected one of {MODES}")
        if not self.cuda_graphs or (mode, self.sizes[0]) in self.graphs:
            return
        with gc_paused():
            self._capture(mode)

    def _capture(self, mode: str) -> None:
        pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        for b in reversed(self.sizes):  # largest first: smaller graphs reuse its blocks in the shared pool
            self._park(0, b)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: compile, probe kernel configs, fill the allocator
                self.step_fn(b, mode, None)
            torch.cuda.current_stream().wait_stream(side)
            self._park(0, b)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.step_fn(b, mode, None)
            self.graphs[(mode, b)] = graph
            pool = graph.pool()
        self.pool = pool

    # -------------------------------------------------------------------------------------------- rows
    def _park(self, n: int, b: int) -> None:
        """Rows n .. b-1 become padding: the dummy slot, position 0, PAD fed."""
        st = self.state
        st.slots[n:b].fill_(st.dummy)
        st.pos[n:b].zero_()
        st.ids[n:b].zero_()

    def start(self, slots: list[int], ids: torch.Tensor, pos: torch.Tensor) -> None:
        """A new running batch: row i = slot ``slots[i]``, fed ``ids[i]`` at position ``pos[i]``."""
        n = len(slots)
        self.size, self.rows = padded_size(n, self.sizes), list(slots)
        st = self.state
        st.slots[:n].copy_(torch.as_tensor(slots, dtype=torch.long), non_blocking=False)
        st.ids[:n].copy_(ids)
        st.pos[:n].copy_(pos)
        self._park(n, self.size)

    def keep(self, keep: list[int]) -> None:
        """Only rows ``keep`` (indices into ``rows``, in order) go on. Nothing moves unless they fit a smaller
        captured size: then they are packed to the front and the batch runs at that size (the others keep
        running until then, and what they compute is not read)."""
        size = padded_size(max(len(keep), 1), self.sizes)
        if size >= self.size:
            return
        st = self.state
        idx = torch.as_tensor(keep, dtype=torch.long).to(st.ids.device)
        ids, pos = st.ids[idx], st.pos[idx]
        self.start([self.rows[i] for i in keep], ids, pos)

    def step(self, mode: str, capture=None) -> None:
        """One decode step of the running batch: the captured graph of its size, else eagerly (always eager
        with a ``capture`` hook, which sees the step's intermediate tensors)."""
        graph = self.graphs.get((mode, self.size)) if self.cuda_graphs and capture is None else None
        if graph is not None:
            graph.replay()
        else:
            self.step_fn(self.size, mode, capture)
