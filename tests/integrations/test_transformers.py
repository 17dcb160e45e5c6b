"""engram_stream inside transformers' DeepSeek-V4 decode loop (engram_stream.integrations.transformers).

The oracle is tools/goldens/v41.py: an independent torch re-implementation of DeepSeek-V4.1's
reference Engram (inference/engram.py and model.py), with the reference's decode-time hash state.
It imports nothing from engram_stream. Two checks:

* replay: every Engram call inside generate() (the prefill and each decode step, every Engram
  layer) is recorded with its hidden input and output; the oracle replays them in order from
  the same inputs, its hash state advanced call by call (a fresh state per generate()). float32
  models: the delta within 2e-5 + 2e-4*|x|; bf16 models: the output is one bf16 rounding of
  h + the oracle's float32 delta (within that tolerance), and within the reference's own bf16
  numerics (1e-2) of the oracle run as generate.py runs it (bf16 default dtype);
* teacher forcing: generate()'s logits against one forward over the generated sequence with
  the oracle as the model's Engram; and the Engram changes those logits.

The transformers models are tiny and random; their attention layers are all sliding-window
(transformers' compressed-attention layers neither ignore left padding nor give the same
logits incremental and whole), except in the replay case marked "compressed", which needs
neither property.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

from helpers.numeric import ATOL, RTOL  # noqa: E402
from helpers.repo import ROOT  # noqa: E402
from engram_stream import EngramConfig, EngramModel  # noqa: E402
from engram_stream.integrations.transformers import attach  # noqa: E402

_spec = importlib.util.spec_from_file_location("_gen_goldens_v41", os.path.join(ROOT, "tools", "goldens", "v41.py"))
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

# The Engram (the oracle's spec keys): 2..4-grams, 2 heads x 32 per order, layers 1 and 4 of 5.
SPEC = dict(engram_vocab_size=211, max_ngram_size=4, n_heads=2, head_dim=32, layer_ids=[1, 4], pad_id=2,
            dim=64, hc_mult=2, vocab_size=300, image_token_id=299)
IMG = SPEC["image_token_id"]
HF_PAD, HF_EOS = 1, 1   # DeepSeek-V4's tokenizer pads with its end-of-sentence id; the Engram pad is 2
PROMPTS = [[5, 17, IMG, IMG, IMG, 42, 8, 9, 10, 11],     # an image span
           [7, 8, 9, 13, 14, 15, 16],
           [21, 22, IMG, 23]]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models: torch's thread pool only adds spin-waits (10x slower on a loaded 2-core VM)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_model(dtype=torch.float32, compressed=False, seed=0, **overrides):
    kw = dict(vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
              num_key_value_heads=1, head_dim=32, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
              n_shared_experts=1, hc_mult=2, o_groups=2, o_lora_rank=16, index_n_heads=2, index_head_dim=16,
              index_topk=4, sliding_window=8, max_position_embeddings=512, pad_token_id=HF_PAD, bos_token_id=0,
              eos_token_id=HF_EOS, qk_rope_head_dim=8)
    kw.update(overrides)
    if not compressed:
        kw["layer_types"] = ["sliding_attention"] * kw["num_hidden_layers"]
    config = modeling.DeepseekV4Config(**kw)
    torch.manual_seed(seed)
    model = modeling.DeepseekV4ForCausalLM(config).eval()
    if dtype != torch.float32:   # as from_pretrained builds it: the mHC mixers and norms stay float32
        low = modeling.DeepseekV4ForCausalLM._from_config(config, dtype=dtype).eval()
        low.load_state_dict(model.state_dict())
        model = low
    return model


@pytest.fixture(scope="module")
def engram():
    """(table, {layer: state_dict}, EngramModel): the same weights for the oracle and the package."""
    rng = np.random.default_rng(7)
    V = SPEC["vocab_size"]
    table = rng.permutation(np.concatenate([np.arange(200), rng.integers(0, 200, V - 200)])).astype(np.int64)
    if table[HF_PAD] == table[SPEC["pad_id"]]:   # the padding token must not hash as the Engram's pad
        j = int(np.flatnonzero(table != table[HF_PAD])[0])
        table[[HF_PAD, j]] = table[[j, HF_PAD]]
    _, _, _, primes, _ = gen.geometry(SPEC, table)
    sds = {L: gen.random_state_dict(SPEC, rng, sum(p for order in primes[li] for p in order))
           for li, L in enumerate(SPEC["layer_ids"])}
    model = EngramModel.from_reference(EngramConfig(**gen.config_fields(SPEC)), sds, compression=table)
    return table, sds, model


@pytest.fixture(scope="module")
def oracle(engram):
    table, sds, _ = engram
    return Oracle(table, sds)


def batch(rows):
    """Left-padded input_ids and attention_mask of prompts."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), HF_PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, T - len(r):] = torch.tensor(r)
        mask[b, T - len(r):] = 1
    return ids, mask


def generate(model, ids, mask, n=6):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)


# ---- the oracle ----------------------------------------------------------------------------------
class Oracle:
    """The reference Engram (tools/goldens/v41.py) of every layer, in float32 (the package's
    precision) and bf16 (as the reference's generate.py runs it), and its hash state."""

    def __init__(self, table, sds):
        self.geometry = gen.geometry(SPEC, table)
        self.mods = {dt: {L: gen.engram_module(SPEC, sds[L], dt) for L in SPEC["layer_ids"]}
                     for dt in (torch.float32, torch.bfloat16)}

    def state(self, batch_size):
        return gen.NgramHashState(SPEC, *self.geometry, batch_size)

    def __call__(self, L, x, rows, ids, dtype):
        """(delta float32, the module's output h + delta in x's dtype) of one row's tokens:
        x [T, G, D], rows [T, H] absolute, ids [T]."""
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.no_grad():
                delta, out = self.mods[dtype][L](x.to(dtype)[None], rows[None], (ids != IMG)[None])
        finally:
            torch.set_default_dtype(prev)
        return delta[0], out[0]


class Recorder:
    """Every Engram call of a model's forwards: token ids, real positions, and each Engram layer's
    stream before and after the Engram (hooks around attach()'s own: attach first)."""

    def __init__(self, model):
        inner, self.forwards = model.model, []
        self.hooks = [inner.register_forward_pre_hook(self._forward, with_kwargs=True, prepend=True)]
        for L in SPEC["layer_ids"]:
            self.hooks += [
                inner.layers[L].register_forward_pre_hook(functools.partial(self._keep, L, "in"), with_kwargs=True,
                                                          prepend=True),
                inner.layers[L].register_forward_pre_hook(functools.partial(self._keep, L, "out"), with_kwargs=True)]

    def _forward(self, module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs.get("attention_mask")
        real = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask[:, -ids.shape[1]:] != 0
        self.forwards.append({"ids": ids.clone(), "real": real.clone(), "in": {}, "out": {}})

    def _keep(self, L, which, module, args, kwargs):
        self.forwards[-1][which][L] = args[0].detach().clone()

    def remove(self):
        for h in self.hooks:
            h.remove()


def bf16_excess(got, h, delta):
    """How far a bf16 output got = bf16(h + delta') lies outside the bound that a float32 delta'
    within the project's tolerance of delta, then one bf16 rounding, allows (<= 0: inside)."""
    g = got.float()
    spacing = torch.exp2(torch.floor(torch.log2(g.abs().clamp_min(2.0 ** -126))) - 7)
    return float(((g - (h.float() + delta)).abs() - (ATOL + RTOL * delta.abs() + spacing)).max())


def replay(oracle, forwards, dtype):
    """Replay one generate()'s recorded Engram calls through the oracle, call by call, from a
    fresh hash state. Returns the number of (row, layer) calls checked."""
    B = forwards[0]["ids"].shape[0]
    state, checked, worst, equal, total = oracle.state(B), 0, -1.0, 0, 0
    for f in forwards:
        ids, real = f["ids"], f["real"]
        rows = {b: state.advance(b, ids[b][real[b]]) for b in range(B) if real[b].any()}  # before any layer
        for li, L in enumerate(SPEC["layer_ids"]):
            h_in, h_out = f["in"][L], f["out"][L]
            assert h_out.dtype == h_in.dtype == dtype
            assert torch.equal(h_out[~real], h_in[~real]), "padding must keep h as it is"
            for b, r in rows.items():
                x, got, tok = h_in[b][real[b]], h_out[b][real[b]], ids[b][real[b]]
                delta, _ = oracle(L, x.float(), r[:, li], tok, torch.float32)
                assert not delta[tok == IMG].any()
                if dtype == torch.float32:
                    np.testing.assert_allclose((got - x).numpy(), delta.numpy(), rtol=RTOL, atol=ATOL)
                else:
                    worst = max(worst, bf16_excess(got, x, delta))
                    equal += int((got == (x.float() + delta).to(dtype)).sum())
                    total += got.numel()
                    _, ref = oracle(L, x, r[:, li], tok, torch.bfloat16)   # the reference's own bf16 run
                    np.testing.assert_allclose(got.float().numpy(), ref.float().numpy(), rtol=1e-2, atol=1e-2)
                checked += 1
    assert worst <= 0, f"a bf16 output lies {worst:.3g} outside bf16(h + the oracle's delta +- its tolerance)"
    assert equal >= 0.99 * total   # and almost always the very same bf16 value (one rounding of one sum)
    return checked


@contextlib.contextmanager
def oracle_engram(model, oracle):
    """The oracle as the model's Engram for whole-sequence forwards (teacher forcing): per
    forward a fresh hash state over each row's real tokens; float32 models add its float32
    delta, bf16 models take its bf16 output."""
    inner, dtype, cur = model.model, model.dtype, {}

    def begin(module, args, kwargs):
        ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
        real = mask != 0
        state = oracle.state(ids.shape[0])
        cur.update(ids=ids, real=real, rows={b: state.advance(b, ids[b][real[b]]) for b in range(ids.shape[0])})

    def layer(li, L, module, args, kwargs):
        h = args[0].clone()
        for b, r in cur["rows"].items():
            sel = cur["real"][b]
            delta, out = oracle(L, h[b][sel], r[:, li], cur["ids"][b][sel], dtype)
            h[b, sel] = (h[b][sel] + delta) if dtype == torch.float32 else out
        return (h,) + tuple(args[1:]), kwargs

    hooks = [inner.register_forward_pre_hook(begin, with_kwargs=True)]
    hooks += [inner.layers[L].register_forward_pre_hook(functools.partial(layer, li, L), with_kwargs=True)
              for li, L in enumerate(SPEC["layer_ids"])]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def teacher_forced(model, seqs, prompt_mask):
    """Logits [B, new, V] of one whole forward over generate()'s sequences, at the positions
    whose logits chose the new tokens."""
    P = prompt_mask.shape[1]
    mask = torch.cat([prompt_mask, torch.ones(seqs.shape[0], seqs.shape[1] - P, dtype=prompt_mask.dtype)], 1)
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=mask).logits
    return logits[:, P - 1:-1].float()


# ---- the tests -----------------------------------------------------------------------------------
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("rows, compressed", [([0], False), ([0, 1, 2], False), ([1, 0, 2], True)],
                         ids=["batch1", "batch3-padded", "batch3-padded-compressed"])
def test_every_engram_call_in_generate_matches_the_oracle(engram, oracle, dtype, rows, compressed):
    model = hf_model(dtype, compressed=compressed)
    ids, mask = batch([PROMPTS[r] for r in rows])
    handle = attach(model, engram[2])
    rec = Recorder(model)
    out = generate(model, ids, mask, n=6)
    rec.remove()
    new = out.sequences.shape[1] - ids.shape[1]
    assert len(rec.forwards) == new == 6                         # one prefill, then one forward per token
    counts = handle.counts
    assert (counts["forwards"], counts["prefill_tokens"], counts["decode_steps"]) == (6, int(mask.sum()), 5)
    assert counts["seconds"] > 0
    assert replay(oracle, rec.forwards, dtype) == len(rows) * 2 * 6
    handle.detach()


@DTYPES
def test_generate_logits_match_a_teacher_forced_run_with_the_oracle(engram, oracle, dtype):
    model = hf_model(dtype)
    ids, mask = batch(PROMPTS)
    with attach(model, engram[2]):
        out = generate(model, ids, mask, n=8)
    got = torch.stack(out.logits, 1).float()
    with oracle_engram(model, oracle):
        want = teacher_forced(model, out.sequences, mask)
    plain = teacher_forced(model, out.sequences, mask)               # the same tokens, no Engram
    # float32: the package and the oracle agree to float rounding; bf16: both runs round every
    # layer to bf16 (incremental vs whole-sequence attention sums already differ by ~1e-2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) <= tol * scale
    assert float((plain - want).abs().max()) > 20 * tol * scale    # the Engram changes the logits


@DTYPES
def test_a_left_padded_row_equals_the_row_alone(engram, dtype):
    model = hf_model(dtype)
    ids, mask = batch(PROMPTS)
    with attach(model, engram[2]):
        together = generate(model, ids, mask, n=6)
        for b, p in enumerate(PROMPTS):
            alone = generate(model, torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), n=6)
            assert torch.equal(together.sequences[b, -6:], alone.sequences[0, -6:])
            a, t = torch.stack(alone.logits, 1)[0].float(), torch.stack(together.logits, 1)[b].float()
            assert float((a - t).abs().max()) <= (1e-5 if dtype == torch.float32 else 1e-2) * float(a.abs().max())


def test_two_generates_in_a_row_start_fresh_and_detach_restores_the_model(engram, oracle):
    model = hf_model()
    ids, mask = batch(PROMPTS)
    before = [len(m._forward_pre_hooks) for m in (model.model, *model.model.layers)]
    plain = generate(model, ids, mask)
    handle = attach(model, engram[2])
    rec = Recorder(model)
    first = generate(model, ids, mask)
    n_first = len(rec.forwards)
    second = generate(model, ids, mask)                      # the same result: nothing carried over
    third = generate(model, ids[1:2, -7:], mask[1:2, -7:])   # another batch size: a new sequence
    rec.remove()
    assert torch.equal(first.sequences, second.sequences)
    assert all(torch.equal(a, b) for a, b in zip(first.logits, second.logits))
    assert torch.equal(third.sequences[0], second.sequences[1, -13:])
    assert replay(oracle, rec.forwards[n_first:2 * n_first], torch.float32) == 3 * 2 * 6
    assert replay(oracle, rec.forwards[2 * n_first:], torch.float32) == 2 * 6
    assert not torch.equal(torch.stack(first.logits), torch.stack(plain.logits))
    handle.detach()
    handle.detach()   # a second detach does nothing
    assert [len(m._forward_pre_hooks) for m in (model.model, *model.model.layers)] == before
    again = generate(model, ids, mask)
    assert all(torch.equal(a, b) for a, b in zip(again.logits, plain.logits))
    with attach(model, engram[2]):   # the model takes an Engram again after detach
        assert torch.equal(generate(model, ids, mask).sequences, first.sequences)


def test_generate_without_a_cache_starts_every_forward_fresh(engram):
    """use_cache=False: every forward is the whole sequence from position 0, so it is a new sequence."""
    model = hf_model()
    ids, mask = batch(PROMPTS)
    with attach(model, engram[2]) as handle:
        cached = generate(model, ids, mask, n=4)
        with torch.no_grad():
            whole = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                                   do_sample=False, use_cache=False)
        assert torch.equal(whole, cached.sequences)
        assert handle.counts["decode_steps"] == 3   # the cached run's; the uncached one only prefills


def test_sampling_with_several_sequences_per_prompt(engram, oracle):
    """do_sample with num_return_sequences: generate() repeats each prompt's row before the first
    forward, and every row is a stream of its own."""
    model = hf_model()
    ids, mask = batch(PROMPTS[1:])
    with attach(model, engram[2]):
        rec = Recorder(model)
        torch.manual_seed(3)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=True,
                                 top_k=50, num_return_sequences=2)
        rec.remove()
    assert out.shape[0] == 4 and rec.forwards[0]["ids"].shape[0] == 4
    assert not torch.equal(out[0], out[1])   # two samples of one prompt: the streams went apart
    assert replay(oracle, rec.forwards, torch.float32) == 4 * 2 * 5


def test_a_prompt_fed_in_chunks_continues_each_stream(engram, oracle):
    """Forwards that continue a sequence with several tokens (a prompt in chunks, positions given):
    each row's stream continues from its own history; a row whose first chunk is all padding
    starts with its first real token."""
    model = hf_model()
    ids, mask = batch(PROMPTS)            # 10 columns; row 2 is padding up to column 6
    with attach(model, engram[2]), torch.no_grad():
        rec = Recorder(model)
        out = model(input_ids=ids[:, :4], attention_mask=mask[:, :4], use_cache=True)
        out = model(input_ids=ids[:, 4:], attention_mask=mask, position_ids=torch.arange(4, 10).expand(3, -1),
                    cache=out.cache)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        model(input_ids=nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], 1),
              position_ids=torch.full((3, 1), 10), cache=out.cache)
        rec.remove()
    assert [f["real"].any(1).tolist() for f in rec.forwards][0] == [True, True, False]
    assert replay(oracle, rec.forwards, torch.float32) == 2 * 2 + 3 * 2 + 3 * 2


def test_every_forward_hashes_every_layer_before_layer_0(engram):
    """A forward's rows are hashed when the model's forward begins, one packed batch for every
    Engram layer: each engine has its tokens fed before any decoder layer runs, the prompt's too."""
    model = hf_model()
    ids, mask = batch(PROMPTS)
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda m, a: seen.append([e.pending_compute for e in handle._run.dec.engines.values()]))
    with attach(model, engram[2]) as handle:
        generate(model, ids, mask, n=4)
    hook.remove()
    assert seen == [[True, True]] * 4


def test_demo_variant_engram_follows_its_numpy_oracle():
    """attach() serves the demo variant's Engram too (ShortConv state carried from the prompt into
    the steps): each row's deltas equal model.forward over the row's real tokens so far."""
    cfg = EngramConfig(engram_vocab_size=[101, 103], max_ngram_size=3, n_embed_per_ngram=32, n_head_per_ngram=2,
                       layer_ids=[1, 4], kernel_size=3, hidden_size=64, hc_mult=2, vocab_size=300, pad_id=2)
    demo = EngramModel.init(cfg, seed=3)
    model = hf_model()
    ids, mask = batch(PROMPTS)
    handle = attach(model, demo)
    rec = Recorder(model)
    generate(model, ids, mask, n=4)
    rec.remove()
    handle.detach()
    for b in range(3):
        for L in cfg.layer_ids:
            toks = torch.cat([f["ids"][b][f["real"][b]] for f in rec.forwards]).numpy()
            h_in = torch.cat([f["in"][L][b][f["real"][b]] for f in rec.forwards]).numpy()
            h_out = torch.cat([f["out"][L][b][f["real"][b]] for f in rec.forwards]).numpy()
            want = demo.forward(L, toks[None], h_in[None])[0]
            np.testing.assert_allclose(h_out - h_in, want, rtol=RTOL, atol=ATOL)


# ---- refused: errors that name the mismatch --------------------------------------------------------
def v41(**overrides):
    spec = {**SPEC, **overrides}
    return EngramModel.init(EngramConfig(**gen.config_fields(spec)), seed=1)


@pytest.mark.parametrize("bad, match", [
    (dict(dim=32), "hidden_size is 32 but the model's is 64"),
    (dict(hc_mult=4), "hc_mult is 4 but the model's is 2"),
    (dict(layer_ids=[1, 5]), r"layer ids \[5\] are outside the model's 5 layers"),
    (dict(vocab_size=200, image_token_id=199), "vocab_size 300 exceeds the Engram's 200"),
])
def test_attach_refuses_a_mismatched_engram(bad, match):
    model = hf_model()
    with pytest.raises(ValueError, match=match):
        attach(model, v41(**bad))
    assert not model.model._forward_pre_hooks and not any(m._forward_pre_hooks for m in model.model.layers)


def test_attach_refuses_other_models_and_a_second_engram(engram):
    with pytest.raises(TypeError, match="DeepSeek-V4 model.*Qwen4-Exp model.* got Linear"):   # the kinds it serves
        attach(torch.nn.Linear(2, 2), engram[2])
    model = hf_model()
    with pytest.raises(TypeError, match="EngramModel, got dict"):
        attach(model, {})
    with attach(model, engram[2]):
        with pytest.raises(RuntimeError, match="already has an Engram attached"):
            attach(model, engram[2])
    attach(model.model, engram[2]).detach()   # the inner DeepseekV4Model itself is accepted


def test_mid_sequence_errors_name_the_problem_and_change_nothing(engram):
    model = hf_model()
    ids, mask = batch(PROMPTS[:2])
    handle = attach(model, engram[2])
    with torch.no_grad():
        with pytest.raises(ValueError, match="not seen since attach"):   # a continuation without its start
            model(input_ids=ids[:, :1], position_ids=torch.full((2, 1), 5))
        with pytest.raises(ValueError, match="needs input_ids"):
            model(inputs_embeds=torch.zeros(2, 3, 64))
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        pos = torch.full((2, 1), ids.shape[1])   # the positions the prompt's forward took: 0..T-1, pads too
        with pytest.raises(ValueError, match="batch size changed mid-sequence: 3 rows, the sequence began with 2"):
            model(input_ids=torch.cat([nxt, nxt[:1]]), position_ids=torch.cat([pos, pos[:1]]))
        # refused without a change: the sequence continues as if the bad call never came
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        step = model(input_ids=nxt, attention_mask=mask2, position_ids=pos, cache=out.cache).logits
    handle.detach()
    with attach(model, engram[2]), torch.no_grad():
        want = model(input_ids=torch.cat([ids, nxt], 1), attention_mask=mask2).logits[:, -1:]
    np.testing.assert_allclose(step.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


# ---- one folder for both sides -------------------------------------------------------------------
def test_one_folder_feeds_transformers_and_engram_stream(tmp_path):
    """A DeepSeek-V4.1-style folder: transformers' shards and the Engram's layers.{L}.engram.*
    tensors under one index, one config.json (the text model's keys, spelled as the release's
    transformers-style config: hidden_size, rms_norm_eps, engram_pad_token_id) and tokenizer.json.
    from_pretrained skips exactly the Engram tensors; from_deepseek_v41 reads only them."""
    pytest.importorskip("tokenizers")
    import json

    from engram_stream import build_compression
    from engram_stream.io import safetensors
    from engram_stream.v41 import hf as hf_v41
    model = hf_model(torch.bfloat16, rms_norm_eps=1e-20)   # V4.1's text model: one eps, the Engram's too
    model.save_pretrained(tmp_path, max_shard_size="200KB")
    cfg = EngramConfig(**gen.config_fields(SPEC))
    tok = hf_v41.make_tokenizer(cfg.vocab_size, cfg.pad_id, cfg.image_token_id)
    source = EngramModel.init(cfg, seed=5, compression=build_compression(tok, decode="backend"))
    tensors = [safetensors.Tensor.of(f"layers.{L}.engram.{short}", a, code=hf_v41.RAW_CODE.get(short, "F32"))
               for L in cfg.layer_ids for short, a in source.layer(L).arrays().items()]
    safetensors.write(str(tmp_path / "engram-00001.safetensors"), tensors, {"format": "pt"})
    index = json.loads((tmp_path / hf_v41.INDEX).read_text())
    index["weight_map"].update({t.name: "engram-00001.safetensors" for t in tensors})
    (tmp_path / hf_v41.INDEX).write_text(json.dumps(index))
    keys = hf_v41.declared(cfg, source.plan).to_hf_config()
    del keys["dim"], keys["norm_eps"]
    keys["engram_pad_token_id"] = keys.pop("engram_pad_id")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **keys}))
    from tokenizers import pre_tokenizers
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>", "unk_token": "<pad>"}))

    loaded, info = modeling.DeepseekV4ForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and all(".engram." in k for k in info["unexpected_keys"])
    assert len(info["unexpected_keys"]) == len(tensors)
    engram = EngramModel.from_deepseek_v41(tmp_path)
    assert engram.cfg == hf_v41.declared(cfg, source.plan)
    assert np.array_equal(engram.plan.lookup, source.plan.lookup)
    ids, mask = batch(PROMPTS)
    with attach(model, source):
        want = generate(model, ids, mask, n=4)
    with attach(loaded, engram):
        got = generate(loaded, ids, mask, n=4)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(got.logits, want.logits))

    # the README's snippet, on this folder
    readme = open(os.path.join(ROOT, "README.md")).read()
    block = readme.split("## DeepSeek-V4.1 in transformers", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope = {"folder": str(tmp_path)}
    exec(block.replace("max_new_tokens=32", "max_new_tokens=3"), scope)
    assert scope["out"].shape == (2, scope["batch"]["input_ids"].shape[1] + 3)
    assert scope["batch"]["attention_mask"][1, 0] == 0   # the shorter prompt is left-padded


def test_example_runs():
    """examples/transformers_generate.py: both prompts' tokens with and without the Engram, which
    differ, and the time per token."""
    import re
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "transformers_generate.py"], cwd=os.path.join(ROOT, "examples"),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    without = re.findall(r"without Engram: (\[.*\])", r.stdout)
    with_ = re.findall(r"with Engram: +(\[.*\])", r.stdout)
    assert len(without) == len(with_) == 2 and all(a != b for a, b in zip(without, with_))
    assert "<img> <img> <img>" in r.stdout and "11 multi-stream decode steps" in r.stdout
    assert re.search(r"time per token .*: [\d.]+ ms without Engram, [\d.]+ ms with", r.stdout)


def test_a_reused_prompt_cache_is_refused_not_continued(engram):
    """A system prompt's cache copied for each question: the first question continues the
    prompt's history (the streams saw exactly the cache's positions); the second copy's length
    no longer matches the streams (they hold the first question): refused, naming both."""
    import copy
    model = hf_model()
    system = torch.tensor([[5, 17, 33, 8, 91, 4]])
    q1, q2 = torch.tensor([[12, 40, 7]]), torch.tensor([[66, 3, 21, 9]])
    with attach(model, engram[2]), torch.no_grad():
        cache = model(input_ids=system, use_cache=True).cache
        first = model.generate(input_ids=torch.cat([system, q1], 1), cache=copy.deepcopy(cache),
                               max_new_tokens=3, min_new_tokens=3, do_sample=False)
        with pytest.raises(ValueError, match="cache holds 6 positions but the Engram's streams have seen 11"):
            model.generate(input_ids=torch.cat([system, q2], 1), cache=copy.deepcopy(cache),
                           max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad(), attach(model, engram[2]):   # the same question from position 0: what it should be
        whole = model.generate(input_ids=torch.cat([system, q1], 1), max_new_tokens=3, min_new_tokens=3,
                               do_sample=False)
    assert torch.equal(first, whole)


def test_beam_search_is_refused(engram):
    model = hf_model()
    ids, mask = batch(PROMPTS[:1])
    with attach(model, engram[2]), torch.no_grad():
        with pytest.raises(ValueError, match="num_beams=3"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, num_beams=3)
        model.generation_config.num_beams = 2
        try:
            with pytest.raises(ValueError, match="num_beams=2"):
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
        finally:
            model.generation_config.num_beams = 1
        assert generate(model, ids, mask, n=2).sequences.shape == (1, ids.shape[1] + 2)
    assert "generate" not in model.__dict__   # detach gave the model its own generate back
