"""The vLLM plugin in vLLM 0.33.0's CUDA graph modes (issue 39), on CPU.

vLLM's own pieces drive the plugin: the forward context (vllm.forward_context.ForwardContext and
override_forward_context, the cudagraph_runtime_mode vLLM sets per batch), vLLM's
eager_break_during_capture decorating Engram._start_prefetch / _finish_prefetch, and vLLM's
BreakableCUDAGraphCapture context, whose two CUDA calls (_begin_segment / _end_segment:
torch.cuda.CUDAGraph capture_begin / capture_end) are replaced by flags, and the weak refs of an
eager break's arguments (vLLM's C op) by the tensors, since there is no CUDA here; everything
else of it is vLLM's. In FULL mode vLLM runs the prefetch inside the capture
(no eager break): the plugin must take the stream-ordered lookup (ids copy, host node, staging
copy), which on CPU tensors runs the host function between the copies; in PIECEWISE mode the
prefetch is an eager break and the plugin's lanes serve it. Both give vLLM's own bytes. The
streams are test_vllm.FakeStreams (on CPU nothing is asynchronous). What a real capture and its
replays do is tests/gpu's (CUDA only)."""
from __future__ import annotations

import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm", reason="vLLM is not installed (tools/ci_vllm.sh installs vllm==0.33.0)")

from test_vllm import (E, FakeStreams, configure, engram_layer, expected, hash_ids, layout_of, lookup,  # noqa: E402,F401
                       vllms_own_projected_rows,
                       plugin_embeddings, vllm_env, SOURCES)

from engram_stream.integrations import serving, vllm_graph  # noqa: E402
from engram_stream.rows import RecordSource  # noqa: E402


def forward(mode):
    """vLLM's forward context of a batch run in `mode` ("FULL", "PIECEWISE", "NONE")."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context
    fc = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={},
                        cudagraph_runtime_mode=getattr(CUDAGraphMode, mode))
    return override_forward_context(fc)


def capture(monkeypatch):
    """vLLM's BreakableCUDAGraphCapture, its CUDA graph's begin/end replaced by a flag."""
    import vllm.compilation.breakable_cudagraph as B
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture as C
    # an eager break's arguments are weak refs made by vLLM's C op (vllm._C: not built here): the
    # tensors themselves, which the test keeps alive anyway
    monkeypatch.setattr(B, "_weak_ref_capture_arg", lambda a: a)
    monkeypatch.setattr(C, "_begin_segment", lambda self: setattr(self, "_capturing", True))
    monkeypatch.setattr(C, "_end_segment", lambda self: setattr(self, "_capturing", False))
    return C()


def test_graph_mode_is_read_from_vllms_forward_context():
    assert vllm_graph.graph_mode() == "none" and vllm_graph.lookup_path() == "lanes"
    for mode, want, path in (("FULL", "full", "stream"), ("PIECEWISE", "piecewise", "lanes"), ("NONE", "none", "lanes")):
        with forward(mode):
            assert vllm_graph.graph_mode() == want and vllm_graph.lookup_path() == path


@pytest.mark.parametrize("source", list(SOURCES))
def test_full_mode_lookup_is_stream_ordered_and_gives_vllms_bytes(E, vllm_env, plugin_checkpoints, expected,
                                                                  monkeypatch, source):
    """Every call of test_vllm's table (vLLM's stock lookup's bytes), made as vLLM's FULL-mode
    prefetch makes it (lookup(background=True) inside a FULL forward): the stream-ordered path
    (a host-function context per token count, no lanes), vLLM's bytes, cold and warm."""
    path = plugin_checkpoints["rows" if "packed" in source else "plain"]
    layout, _, calls = expected[path]
    configure(vllm_env, monkeypatch, path, "env", SOURCES[source])
    mine = plugin_embeddings(E, layout)
    with forward("FULL"):
        for L, ids, dtype, want in calls:
            m = mine[L]
            for _ in ("cold", "warm"):
                got = torch.full((ids.shape[0], m.part_n_hash_cols, 264 if dtype == torch.uint8 else 256), 3,
                                 dtype=dtype)
                m.lookup(ids, got, background=True)
                if want is None:
                    assert not got.view(torch.int16).any()
                else:
                    assert torch.equal(want.view(torch.uint8), got.view(torch.uint8)), (source, L, ids.shape, dtype)
    for m in mine.values():
        assert m._lanes is None and not m._pending and m._pending_copy is None
        assert {key[0] for key in m._graph_contexts} == {1, 16, 300, 4}
        assert all(ctx.calls > 0 for _, _, ctx, _ in m._graph_contexts.values())


@pytest.mark.parametrize("mode", ["FULL", "PIECEWISE"])
def test_vllms_capture_takes_the_path_of_its_mode(E, vllm_env, plugin_checkpoints, monkeypatch, mode):
    """vLLM's Engram layers with cpu_offload under vLLM's breakable capture: in FULL mode the
    prefetch runs inside the capture (no eager break) and the plugin's lookup is the stream-
    ordered one; in PIECEWISE mode _start_prefetch and _finish_prefetch are eager breaks and the
    lanes serve them. embed() gives vLLM's own rows (after wkv) either way."""
    path = plugin_checkpoints["plain"]
    layout, hashes, want = vllms_own_projected_rows(E, path)
    FakeStreams(monkeypatch)
    vllm_env.offload = True
    configure(vllm_env, monkeypatch, path, "env", {"tables": "direct", "row_cache_mb": 0.2})
    layers = [engram_layer(E, path, layout, i) for i in range(len(layout.layer_ids))]
    cap = capture(monkeypatch)
    got = []
    with forward(mode), cap:
        for layer, h in zip(layers, hashes):
            layer.prepare_embeddings(h)
        for layer, h in zip(layers, hashes):
            got.append(layer.wkv(layer.embed(h).flatten(-2)))
    for g, w in zip(got, want):
        assert torch.equal(w.view(torch.int16), g.view(torch.int16))
    for layer in layers:
        emb = layer.embed_tokens
        if mode == "FULL":
            assert emb._lanes is None and len(emb._graph_contexts) == 1
        else:
            assert emb._lanes is not None and not getattr(emb, "_graph_contexts", None)
    assert cap.num_eager_breaks == (0 if mode == "FULL" else 2 * len(layers))


class Toy(RecordSource):
    """A source whose rows come from Python (as Mooncake's RemoteRows)."""

    def start(self, rows):
        self.n = len(rows)

    def finish(self):
        return np.zeros((self.n, self.rowbytes + self.scalebytes), np.uint8)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL", "FULL_DECODE_ONLY", "PIECEWISE", "NONE"])
def test_full_graphs_refuse_rows_that_need_the_gil_at_startup(E, vllm_env, plugin_checkpoints, monkeypatch, mode):
    """vLLM's CompilationConfig with a FULL mode and a source that needs the GIL (Mooncake's,
    here a toy RecordSource): the model's build (Engram._create_embedding) fails naming vLLM's
    flags; PIECEWISE and NONE build."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    path = plugin_checkpoints["plain"]
    layout = layout_of(E, path)
    configure(vllm_env, monkeypatch, path, "env", {"tables": "mapped"})
    cc = CompilationConfig(cudagraph_mode=getattr(CUDAGraphMode, mode))
    base = E.get_current_vllm_config
    monkeypatch.setattr(E, "get_current_vllm_config",
                        lambda: types.SimpleNamespace(**vars(base()), compilation_config=cc))
    real_open = serving.open_model

    def open_model(s, ckpt, where, **kw):
        model = real_open(s, ckpt, where, **kw)
        rows = model.row_source(layout.layer_ids[0])
        return types.SimpleNamespace(plan=model.plan, cfg=model.cfg, source=model.source,
                                     row_source=lambda L: Toy(rows.nrows, rows.rowbytes, rows.scalebytes))

    monkeypatch.setattr(serving, "open_model", open_model)
    if "FULL" in mode:
        with pytest.raises(ValueError, match=r"FULL CUDA graphs.*GIL.*-cc\.cudagraph_mode=PIECEWISE.*--enforce-eager"):
            E.Engram._create_embedding(None, layout, 0)
    else:
        assert isinstance(E.Engram._create_embedding(None, layout, 0).source, Toy)


def test_a_host_node_error_is_raised_at_the_next_replay(E, vllm_env, plugin_checkpoints, monkeypatch):
    """An error a host node recorded (here: the context run directly, as a replay's host node
    would) is raised by vLLM's next breakable replay (BreakableCUDAGraphWrapper._replay,
    patched), before the graph runs; and by the layer's next eager lookup."""
    import vllm.compilation.breakable_cudagraph as B
    assert B.BreakableCUDAGraphWrapper._replay._engram_stream
    path = plugin_checkpoints["plain"]
    layout = layout_of(E, path)
    configure(vllm_env, monkeypatch, path, "env", {"tables": "mapped"})
    m = plugin_embeddings(E, layout)[layout.layer_ids[0]]
    ids = hash_ids(layout, 0, 4, np.random.default_rng(3))
    with forward("FULL"):
        lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)
    assert len(m._graph_contexts) == 1
    # an id past the table in the rank's range: a context whose range is wider than the table
    from engram_stream.integrations._vllm_graph import HostLookup
    bad_ids = np.array([[m.source.nrows + 1]], np.int32)
    bad = HostLookup(m.source, bad_ids, np.zeros((1, 1, 256), np.uint16), 0, m.source.nrows + 10)
    bad.run()
    monkeypatch.setattr(vllm_graph, "_contexts", [bad])
    ran = []
    entry = types.SimpleNamespace(capture=types.SimpleNamespace(replay=lambda: ran.append(1)), output="out",
                                  input_addresses=None, batch_descriptor=None)
    wrapper = types.SimpleNamespace(is_debugging_mode=False)
    with pytest.raises(IndexError, match="past the table"):
        B.BreakableCUDAGraphWrapper._replay(wrapper, entry, (), {})
    assert not ran
    assert B.BreakableCUDAGraphWrapper._replay(wrapper, entry, (), {}) == "out" and ran == [1]
    # the layer's own contexts: checked at its next eager lookup
    m._graph_contexts[("bad",)] = (None, None, bad, None)
    bad.run()
    with pytest.raises(IndexError, match="past the table"):
        lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)
    lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)   # cleared


def test_a_capture_takes_the_stream_path_in_any_mode(E, vllm_env, plugin_checkpoints, monkeypatch):
    """Inside a capture (torch.cuda.is_current_stream_capturing(), stubbed: no CUDA here) the
    lookup is the stream-ordered one whatever the forward's mode (a lanes lookup there would be
    host work done once); a capture that begins with the layer's lanes still in flight is
    refused, not served."""
    path = plugin_checkpoints["plain"]
    layout = layout_of(E, path)
    configure(vllm_env, monkeypatch, path, "env", {"tables": "mapped"})
    m = plugin_embeddings(E, layout)[layout.layer_ids[0]]
    ids = hash_ids(layout, 0, 5, np.random.default_rng(4))
    want = lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)      # the lanes' (inline) bytes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    for mode in ("PIECEWISE", "NONE"):
        with forward(mode):
            assert vllm_graph.lookup_path() == "stream"
            got = lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)
        assert torch.equal(want.view(torch.int16), got.view(torch.int16))
    assert len(m._graph_contexts) == 1 and m._lanes is None
    m._pending_copy = (got, got)
    with pytest.raises(RuntimeError, match="capture began with this layer's rows in flight"):
        lookup(m, ids, m.part_n_hash_cols, torch.bfloat16)
    m._pending_copy = None
