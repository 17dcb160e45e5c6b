"""longcat-flash-lite: the hash by hand, the engine against the numpy oracle's full-sequence
forward token by token (EOS at the start, in the middle, twice in a row and last), every call
shape (step, step_packed, prefill, feed/compute, the Decoder, lookup_packed), snapshots, drafts,
masked positions, the Hugging Face folder (sharded and single-file), the config's refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from engram_stream import EngramConfig, EngramModel, HashPlan, variants
from engram_stream.errors import CheckpointError, HFCheckpointError
from engram_stream.io.files import mapping_of
from engram_stream.longcat import hf, reference
from engram_stream.longcat.config import EXAMPLE, LONGCAT
from helpers.numeric import close

pytestmark = pytest.mark.native
EOS = 2
# EOS at the start, in the middle, twice in a row and last
SEQS = [[EOS, 7, 11, 39, EOS, 5, EOS, EOS, 13, 0, 31, 8, 22, 9, EOS],
        [17, 3, 3, 3, 9, 38, EOS, 21, 14, EOS, 6, 1, EOS, EOS, EOS]]


def _cfg(**kw):
    return EngramConfig(**{**EXAMPLE, **kw})


def _model(seed=0, **kw):
    return EngramModel.init(_cfg(**kw), seed=seed)


def _oracle(model, ids):
    return reference.forward(model.cfg, model.layer(0), np.atleast_2d(ids))


def test_rows_by_hand():
    """vocab 10, ratio 2 (m = 20), orders 2 and 3, one split: tables of 21 and 23 rows,
    multipliers (1, 10) mod 21 and (1, 10, 100 mod 23 = 8) mod 23; ids [5, EOS, 7, 8, 9]."""
    cfg = EngramConfig(variant=LONGCAT, vocab_size=10, ngram_vocab_size_ratio=2, engram_vocab_size=[20, 20],
                       max_ngram_size=3, n_head_per_ngram=1, n_embed_per_ngram=4, hidden_size=8, hc_mult=1,
                       layer_ids=[0], pad_id=2)
    plan = HashPlan(cfg)
    assert plan.head_primes[0].tolist() == [21, 23] and plan.offsets[0].tolist() == [0, 21]
    want = [[5, 5],                  # the start: the token alone
            [52 % 21, 52 % 23],      # an EOS hashes with its look-back: 2 + 5*10
            [7, 7],                  # after an EOS: the walk stops at it
            [78 % 21, 78 % 23],      # 8 + 7*10
            [89 % 21, 145 % 23]]     # 9 + 8*10; 9 + 8*10 + 7*8
    np.testing.assert_array_equal(reference.rows(cfg, [[5, 2, 7, 8, 9]])[0], want)
    np.testing.assert_array_equal(plan.hash([[5, 2, 7, 8, 9]])[0][0], want)
    model = EngramModel.init(cfg, seed=1)
    eng = model.stream(0)
    for t, tok in enumerate([5, 2, 7, 8, 9]):
        eng.step(tok)
        np.testing.assert_array_equal(eng.rows[0], np.array(want[t]) + plan.offsets[0])


@pytest.mark.usefixtures("each_isa")
def test_token_by_token_against_the_full_sequence():
    model = _model(3)
    ids = np.array(SEQS)
    want = _oracle(model, ids)
    eng = model.stream(0, n_streams=2)
    got = np.stack([eng.step(ids[:, t]) for t in range(ids.shape[1])], 1)
    assert got.shape == (2, ids.shape[1], model.cfg.hidden_size)
    close(got, want)
    one = model.stream(0)
    for t, tok in enumerate(SEQS[1]):
        out = one.step(int(tok))
        assert out.shape == (model.cfg.hidden_size,)
        close(out, want[1, t])


@pytest.mark.usefixtures("each_isa")
def test_prefill_and_packed_segments():
    model = _model(4)
    ids = np.array(SEQS)
    want = _oracle(model, ids)
    eng = model.stream(0)
    close(np.concatenate([eng.prefill(ids[0, :6]), eng.prefill(ids[0, 6:])]), want[0])
    # two streams, segments of unequal length, then decode steps of both
    eng = model.stream(0, n_streams=3)
    out = eng.step_packed(np.concatenate([ids[0, :5], ids[1, :9]]), None, streams=[2, 0], lengths=[5, 9])
    close(out, np.concatenate([want[0, :5], want[1, :9]]))
    for t in range(9, 15):
        a = t - 4
        out = eng.step_packed(np.array([ids[1, t], ids[0, a]]), None, streams=[0, 2], lengths=[1, 1])
        close(out, np.stack([want[1, t], want[0, a]]))


@pytest.mark.usefixtures("each_isa")
def test_bfloat16_table_and_projections():
    """The released dtypes, bf16 table and projections: on the bf16 path the GEMM runs on
    vdpbf16ps (products exact, sums in pairs); 16 streams' steps and a prefill against the oracle."""
    import ml_dtypes
    f32 = _model(6)
    cfg = f32.cfg
    w = f32.layer(0)
    model = EngramModel(cfg, f32.plan, {0: type(w)(cfg, w.offsets, w.table.astype(ml_dtypes.bfloat16), w.embed,
                                                   w.proj_w)}).with_weight_dtype("bfloat16")
    assert model.layer(0).table.dtype.name == model.weight_dtype == "bfloat16"
    ids = np.array([SEQS[i % 2][i:] + SEQS[(i + 1) % 2][:i] for i in range(16)])
    want = _oracle(model, ids)
    eng = model.stream(0, n_streams=16)
    close(np.stack([eng.step(ids[:, t]) for t in range(ids.shape[1])], 1), want)
    close(model.stream(0).prefill(ids[3]), want[3])


@pytest.mark.usefixtures("each_isa")
def test_threads_give_the_same_bits_on_the_released_dtypes():
    """bf16 table and projections, hidden 308 (19 full panels and a part: the one-row GEMM's runs
    of 8 panels, then tiles): one stream's steps, 16 streams' steps and a prefill split over 2 and 3
    threads give one thread's bits (a column's sums never split), the oracle's values."""
    import ml_dtypes
    f32 = _model(8, hidden_size=308, n_embed_per_ngram=154)
    cfg, w = f32.cfg, f32.layer(0)
    model = EngramModel(cfg, f32.plan, {0: type(w)(cfg, w.offsets, w.table.astype(ml_dtypes.bfloat16), w.embed,
                                                   w.proj_w)}).with_weight_dtype("bfloat16")
    ids = np.array([SEQS[i % 2][i:] + SEQS[(i + 1) % 2][:i] for i in range(16)])
    want = _oracle(model, ids)
    for S in (1, 16):
        engs = [model.stream(0, n_streams=S) for _ in range(3)]
        for th, e in enumerate(engs, 1):
            e.step_threads = th
        for t in range(ids.shape[1]):
            got = [e.step(int(ids[0, t]) if S == 1 else ids[:, t]) for e in engs]
            close(got[0], want[0, t] if S == 1 else want[:, t])
            for g in got[1:]:
                assert np.array_equal(g, got[0])
    pre = []
    for th in (1, 2, 3):
        e = model.stream(0)
        e.prefill_threads = th
        pre.append(e.prefill(np.concatenate([ids[5]] * 3)))  # 45 tokens: 5 row tiles and a part
    close(pre[0][:15], want[5])
    for g in pre[1:]:
        assert np.array_equal(g, pre[0])


def test_feed_compute_and_the_decoder():
    model = _model(5)
    want = _oracle(model, SEQS[0])[0]
    eng = model.stream(0)
    for t, tok in enumerate(SEQS[0]):
        eng.feed(int(tok))
        close(eng.compute(), want[t])
    dec = model.decoder()
    assert list(dec.layers) == [0]
    for t, tok in enumerate(SEQS[0]):
        dec.begin(int(tok))
        close(dec.layer(0), want[t])


def test_snapshot_restore_and_drafts():
    model = _model(6)
    ids = np.array(SEQS[1])
    want = _oracle(model, ids)[0]
    eng = model.stream(0)
    eng.prefill(ids[:5])
    snap = eng.snapshot()
    eng.prefill(ids[5:9])
    eng.restore(snap)
    close(eng.prefill(ids[5:]), want[5:])
    # a draft of 6 tokens, 2 accepted: the slot stands after ids[:7]; the next tokens follow it
    eng = model.stream(0)
    eng.prefill(ids[:5])
    draft = np.array([ids[5], ids[6], 4, 4, EOS, 9])
    eng.step_packed(draft, None, streams=[0], lengths=[6], draft=True)
    eng.commit([2])
    close(eng.prefill(ids[7:]), want[7:])


def test_masked_positions_are_no_tokens():
    model = _model(7)
    ids = np.array(SEQS[0])
    want = _oracle(model, ids)[0]
    padded = np.insert(ids, [3, 3, 8], [1, 1, 1])
    masked = np.zeros(padded.shape, bool)
    masked[[3, 4, 10]] = True
    eng = model.stream(0)
    out = eng.step_packed(padded, None, streams=[0], lengths=[len(padded)], masked=masked)
    assert (out[masked] == 0).all()
    close(out[~masked], want)


def test_lookup_packed_gives_the_rows():
    model = _model(8)
    cfg, w = model.cfg, model.layer(0)
    ids = np.array(SEQS[0])
    rows = reference.rows(cfg, ids[None])[0] + w.offsets
    got = model.stream(0).lookup_packed(ids, streams=[0], lengths=[len(ids)])
    np.testing.assert_array_equal(got, w.table_f32(rows.reshape(-1)).reshape(len(ids), cfg.engram_dim))


def test_negative_and_large_ids_are_refused():
    eng = _model().stream(0)
    with pytest.raises(ValueError, match="-1"):
        eng.step(-1)
    with pytest.raises(ValueError):
        eng.step(EXAMPLE["vocab_size"])
    assert eng.tokens_seen.tolist() == [0]


@pytest.mark.parametrize("table_dtype", [None, "bfloat16"])
def test_folder_round_trip_maps_the_table(tmp_path, table_dtype):
    model = _model(9)
    path = str(tmp_path / "lc")
    model.save(path, table_dtype=table_dtype)
    assert variants.get(LONGCAT).is_checkpoint(path) and json.load(open(os.path.join(path, "config.json")))["model_type"] == \
        "longcat_flash_ngram"
    back = EngramModel.load(path)
    w = back.layer(0)
    assert mapping_of(w.table) is not None and w.table_in_ram is None   # one view of the shard
    assert mapping_of(w.embed) is not None
    assert w.table.dtype.name == (table_dtype or "float32")
    want = _oracle(back, SEQS[0])[0]
    if table_dtype is None:
        close(want, _oracle(model, SEQS[0])[0])
    eng = back.stream(0)
    close(np.stack([eng.step(int(t)) for t in SEQS[0]]), want)
    with pytest.raises(CheckpointError, match="pass the folder"):
        EngramModel.load(os.path.join(path, "config.json"))


def _released_like_file(folder, model, interleave):
    """One model.safetensors as the released folder names it (written by the safetensors
    package, bfloat16, with a decoder layer's tensors beside), and a config.json with the
    released model's other keys."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file
    cfg, w = model.cfg, model.layer(0)
    sd = w.state_dict(cfg)
    bf = lambda a: torch.from_numpy(np.array(a, np.float32)).to(torch.bfloat16)  # noqa: E731
    tensors = {"model.layers.0.mlp.experts.0.up_proj.weight": bf(np.ones((4, 4), np.float32)),
               hf.EMBED: bf(sd["word_embeddings.weight"])}
    for c in range(cfg.n_heads):
        tensors[hf.embedder(c)] = bf(sd[f"embedders.{c}.weight"])
        if interleave:
            tensors[hf.post_proj(c)] = bf(sd[f"post_projs.{c}.weight"])
    for c in range(cfg.n_heads):
        tensors[hf.post_proj(c)] = bf(sd[f"post_projs.{c}.weight"])
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    config = {"architectures": ["LongcatFlashNgramForCausalLM"], "model_type": "longcat_flash_ngram",
              "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "emb_neighbor_num": cfg.max_ngram_size,
              "emb_split_num": cfg.n_head_per_ngram, "ngram_vocab_size_ratio": cfg.ngram_vocab_size_ratio,
              "eos_token_id": cfg.pad_id, "bos_token_id": 1, "num_layers": 14, "n_routed_experts": 256}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def test_a_released_like_single_file_folder(tmp_path):
    model = _model(10)
    path = _released_like_file(str(tmp_path / "lc"), model, interleave=False)
    back = EngramModel.load(path)
    assert mapping_of(back.layer(0).table) is not None   # the embedders back to back: one view
    assert back.layer(0).table.dtype.name == "bfloat16" and back.layer(0).embed.dtype.name == "bfloat16"
    want = _oracle(back, SEQS[1])[0]
    np.testing.assert_allclose(want, _oracle(model, SEQS[1])[0], rtol=3e-2, atol=3e-2)   # bfloat16 weights
    eng = back.stream(0)
    close(np.stack([eng.step(int(t)) for t in SEQS[1]]), want)


def test_embedders_apart_in_the_file_are_joined_in_ram(tmp_path):
    """safetensors' writer orders tensors by name, so the embedders stay apart only when another
    tensor's name sorts between them: a table that cannot be one view is copied, and says so."""
    model = _model(11, n_head_per_ngram=8, n_embed_per_ngram=16, hidden_size=32)   # E = 16: embedders.1, .10, ...
    path = _released_like_file(str(tmp_path / "lc"), model, interleave=True)
    back = EngramModel.load(path)
    w = back.layer(0)
    assert mapping_of(w.table) is None and "concatenated them in RAM" in w.table_in_ram
    np.testing.assert_array_equal(w.table_f32(slice(None)).astype(np.float32),
                                  model.layer(0).table.astype("bfloat16").astype(np.float32))
    eng = back.stream(0)
    close(np.stack([eng.step(int(t)) for t in SEQS[0]]), _oracle(back, SEQS[0])[0])


def test_missing_tensors_are_named(tmp_path):
    model = _model(12)
    path = str(tmp_path / "lc")
    model.save(path)
    index = json.load(open(os.path.join(path, hf.INDEX)))
    del index["weight_map"][hf.post_proj(3)]
    with open(os.path.join(path, hf.INDEX), "w") as f:
        json.dump(index, f)
    with pytest.raises(HFCheckpointError, match=r"post_projs\.3"):
        EngramModel.load(path)


def test_from_hf_config_of_the_released_model():
    cfg = EngramConfig.from_hf_config({"model_type": "longcat_flash_ngram", "vocab_size": 131072, "hidden_size": 3072,
                                       "emb_neighbor_num": 4, "emb_split_num": 4, "ngram_vocab_size_ratio": 78,
                                       "eos_token_id": 2})
    assert cfg.variant == LONGCAT and cfg.layer_ids == [0] and cfg.hc_mult == 1
    assert (cfg.max_ngram_size, cfg.n_head_per_ngram, cfg.head_dim, cfg.pad_id) == (4, 4, 256, 2)
    assert EngramConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize("change, match", [
    (dict(hc_mult=2), "hc_mult must be 1"),
    (dict(layer_ids=[1]), r"layer_ids must be \[0\]"),
    (dict(engram_vocab_size=[151, 150]), r"engram_vocab_size must be \[m\]"),
    (dict(hidden_size=40), "must equal hidden_size"),
    (dict(ngram_vocab_size_ratio=None, engram_vocab_size=[151, 151]), "pass the ratio"),
    (dict(vocab_size=1 << 30, engram_vocab_size=[3 << 30] * 2), "past int64"),
])
def test_config_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**change)


def test_hf_config_refusals():
    with pytest.raises(ValueError, match="divisible"):
        EngramConfig.from_hf_config({"model_type": "longcat_flash_ngram", "hidden_size": 100, "emb_neighbor_num": 4,
                                     "emb_split_num": 4})


def test_the_variants_forward_is_the_oracle_given_the_ids():
    from engram_stream import variants
    model = _model(14)
    v, ids = variants.get(LONGCAT), np.array(SEQS)
    assert v.input_layer
    close(model.forward(0, ids), _oracle(model, ids))
    rows = model.plan.hash_numpy(ids)[0]
    assert type(rows) is np.ndarray   # plain rows: EngramModel.forward hands the variant the ids itself
    close(v.forward(model.cfg, model.layer(0), rows, None, None, ids), _oracle(model, ids))


_PROP_MODEL = {}


def _prop_model():
    if not _PROP_MODEL:
        _PROP_MODEL["m"] = _model(15, max_ngram_size=4, engram_vocab_size=[150] * 3, n_head_per_ngram=2,
                                  n_embed_per_ngram=8, hidden_size=24)
    return _PROP_MODEL["m"]


def test_random_sequences_and_cuts_match_the_oracle():
    """Sequences dense in EOS (runs, start, end), fed in random segment cuts over 3 slots
    interleaved: every output is the oracle's for its own sequence, every row the plan's."""
    from hypothesis import given
    from hypothesis import strategies as st
    from helpers.numeric import hypothesis_settings

    @hypothesis_settings(40)
    @given(seed=st.integers(0, 2 ** 31), T=st.integers(1, 40))
    def run(seed, T):
        model = _prop_model()
        rng = np.random.default_rng(seed)
        seqs = rng.choice([EOS, 0, 1, 7, 49, 13, 31], size=(3, T), p=[.3, .1, .1, .1, .2, .1, .1])
        want = _oracle(model, seqs)
        rows = model.plan.hash(seqs)[0] + model.plan.offsets[0]
        eng = model.stream(0, n_streams=3)
        pos = [0, 0, 0]
        while min(pos) < T:
            live = [s for s in range(3) if pos[s] < T]
            take = {s: int(rng.integers(1, T - pos[s] + 1)) for s in live}
            ids = np.concatenate([seqs[s, pos[s]:pos[s] + take[s]] for s in live])
            out = eng.step_packed(ids, None, streams=live, lengths=[take[s] for s in live])
            got = eng.pending_rows
            i = 0
            for s in live:
                close(out[i:i + take[s]], want[s, pos[s]:pos[s] + take[s]])
                np.testing.assert_array_equal(eng.rows[s], rows[s, pos[s] + take[s] - 1])
                i += take[s]
                pos[s] += take[s]
            assert got.shape[0] == 0

    run()


def test_the_plans_fast_hash_is_the_windows_and_refuses_negative_ids():
    model = _model(16)
    ids = np.array(SEQS)
    np.testing.assert_array_equal(model.plan.hash(ids)[0], reference.rows(model.cfg, ids))
    for hash_ in (model.plan.hash, model.plan.hash_numpy):
        with pytest.raises(ValueError, match=r"token id -1 is negative: longcat-flash-lite takes ids in \[0, "
                                             r"vocab_size=\d+\) only"):
            hash_([[3, -1, 4]])


def test_inspect_names_the_table_sizes_and_each_embedders_multipliers(tmp_path, capsys):
    """inspect prints LongCat's hash constants as they are: sizes m + 2c + 1 (not primes) and
    vocab_size^delta mod mod_c per embedder (not one multiplier set for the layer)."""
    from engram_stream.cli import main
    model = _model(3)
    model.save(str(tmp_path / "lc"))
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "lc")]) == 0
    out = capsys.readouterr().out
    m, V = 3 * 50, 50   # ngram_vocab_size_ratio * vocab_size
    assert "primes" not in out
    assert f"order 2: sizes [{m + 1}, {m + 3}], multipliers [[1, {V}], [1, {V}]]" in out
    assert (f"order 3: sizes [{m + 5}, {m + 7}], multipliers [[1, {V}, {V * V % (m + 5)}], "
            f"[1, {V}, {V * V % (m + 7)}]]") in out
    assert f"offsets [0, {m + 1}, {2 * m + 4}, {3 * m + 9}]" in out
