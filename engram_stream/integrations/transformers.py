"""engram_stream as the Engram of a transformers model: one attach() for every model kind it
serves, chosen by the model it is given:

* a DeepSeek-V4 model (DeepseekV4ForCausalLM or DeepseekV4Model) with DeepSeek-V4.1's Engram
  (EngramModel.from_deepseek_v41): this module, below;
* a Qwen4-Exp model (Qwen4ExpForCausalLM, ...ForConditionalGeneration or ...TextModel) with
  Qwen3.8-Flash-Next's PLE (EngramModel.load of its folder): served by transformers_qwen.py.

    from engram_stream import EngramModel
    from engram_stream.integrations.transformers import attach

    engram = EngramModel.from_deepseek_v41(ckpt_dir)       # the layers.{L}.engram.* tensors, tokenizer.json
    handle = attach(hf_model, engram)                       # a DeepseekV4ForCausalLM (or DeepseekV4Model)
    out = hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=64)
    handle.detach()                                         # the model is as it was

DeepSeek-V4.1 is DeepSeek-V4 with an Engram on the full hyper-connection stream before some
layers (1 and 14 in Flash): `h = bf16(h + gate * value)`. transformers ships the V4 model and
no Engram; attach() adds it with forward pre-hooks:

* on the inner model's forward (hf_model.model): reads input_ids, the 2-D attention_mask and
  the positions (position_ids, else the cache's length), so every Engram layer's rows are
  hashed before layer 0 runs;
* on hf_model.model.layers[L] for each Engram layer L: replaces the stream [B, S, hc_mult,
  hidden] with h + delta in the model's dtype (bf16 models: bf16(float32(h) + delta), the
  reference's rounding).

Batch rows are streams. A forward whose tokens start at position 0 begins a new sequence (every
stream is reset, so each generate() starts fresh); a prompt (S > 1) goes through the engines'
prefill, a decode step (S == 1, every row a real token) through one multi-stream step.
Positions where attention_mask is 0 (left padding) take no part in any n-gram and keep h as it
is: a padded row gets exactly what the same row run alone gets. Image tokens
(engram_model.cfg.image_token_id) are DEAD, as in the reference. Beam search and other
generation modes that reorder the batch between steps are not supported (the streams would not
follow the reordered rows): generate(num_beams > 1) is refused; greedy and sampled decoding are.
A forward that continues a sequence must continue the one the streams hold: its cache's length
must equal the positions the streams have seen, so a prompt cache reused for a second question
(a copy of the system prompt's cache) is refused rather than continuing the first question's
history; start such a sequence from position 0 (or run the shared prefix again).

Loading the released DeepSeek-V4.1 weights for both sides: see attach().
"""
from __future__ import annotations

import functools
import time

import numpy as np

try:
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Model
except ImportError as e:  # torch or transformers missing, or transformers older than DeepSeek-V4
    raise ImportError(f"engram_stream.integrations.transformers needs torch and transformers with DeepSeek-V4 "
                      f"and Qwen4-Exp (5.24 or later) ({e}): pip install '.[transformers]' from the engram_stream "
                      f"checkout") from e

from ..engine.args import as_array
from ..model import EngramModel
from . import transformers_qwen

__all__ = ["attach", "EngramHandle"]



def attach(hf_model, engram_model):
    """Serve `engram_model`'s layers inside `hf_model`, by the kind of model it is (_KINDS):

    * a DeepSeek-V4 model (DeepseekV4ForCausalLM or DeepseekV4Model) with a deepseek-v4.1
      EngramModel: forward pre-hooks (the module doc); returns an EngramHandle;
    * a Qwen4-Exp model (Qwen4ExpForCausalLM, ...ForConditionalGeneration or ...TextModel) with a
      qwen3.8-flash-next EngramModel: each PLE layer's module replaced by one its engine serves
      (transformers_qwen.py); returns a handle whose detach() puts the model's own back.

    Either handle's detach() (or the end of a `with`) leaves the model as it was. Any other model
    is refused with a TypeError naming the kinds served.

    DeepSeek-V4: the model must match the Engram: hidden_size, hc_mult, every Engram layer id
    below num_hidden_layers, and a vocab no larger than the Engram's (every id it emits has a
    compression entry). One Engram per model. Qwen4-Exp: the two must describe the same PLE:
    ple_layer_ids, hidden_size, hc_count and the EOS.

    With the released DeepSeek-V4.1 weights (one folder: config.json, the index and shards,
    tokenizer.json):
      * engram_stream reads `EngramModel.from_deepseek_v41(folder)`: the Engram keys of
        config.json (engram_*, hc_mult, dim or hidden_size, vocab_size, image_token_id; nested in
        a text_config or not), only the `layers.{L}.engram.*` tensors of the shards (the tables
        stay in the files, mapped), and tokenizer.json for the compression (built once, then
        read from the user's cache);
      * transformers reads the rest of the same shards into a DeepseekV4ForCausalLM
        (`from_pretrained`, with a DeepseekV4Config of the text model's keys) and the same
        tokenizer.json through AutoTokenizer; the V4 model has no Engram module, so it skips the
        `layers.{L}.engram.*` tensors as unexpected keys (a load report lists them);
      * then `attach(hf_model, engram)`.
    transformers 5.24 has no DeepSeek-V4.1 class: whatever of V4.1's text model differs from V4
    is transformers' to load, not this module's.
    """
    for what, find, serve in _KINDS:
        if find(hf_model) is not None:
            return serve(hf_model, engram_model)
    raise TypeError(f"attach needs a transformers model of a kind it serves ({'; '.join(k[0] for k in _KINDS)}), "
                    f"got {type(hf_model).__name__}")


def _inner(hf_model):
    """The DeepseekV4Model of hf_model (itself, or its .model), or None."""
    inner = hf_model if isinstance(hf_model, DeepseekV4Model) else getattr(hf_model, "model", None)
    return inner if isinstance(inner, DeepseekV4Model) else None


def _check(inner, engram_model):
    if not isinstance(engram_model, EngramModel):
        raise TypeError(f"attach needs an engram_stream.EngramModel, got {type(engram_model).__name__}")
    cfg, hf = engram_model.cfg, inner.config
    for name in ("hidden_size", "hc_mult"):
        if getattr(cfg, name) != getattr(hf, name):
            raise ValueError(f"the Engram's {name} is {getattr(cfg, name)} but the model's is {getattr(hf, name)}: "
                             f"they must match")
    n = len(inner.layers)
    bad = [L for L in cfg.layer_ids if not 0 <= L < n]
    if bad:
        raise ValueError(f"Engram layer ids {bad} are outside the model's {n} layers (0..{n - 1})")
    if hf.vocab_size > cfg.vocab_size:
        raise ValueError(f"the model's vocab_size {hf.vocab_size} exceeds the Engram's {cfg.vocab_size}: "
                         f"ids past it have no compression entry")
    if getattr(inner, "_engram_stream_handle", None) is not None:
        raise RuntimeError("this model already has an Engram attached: detach() that handle first")


def _arg(args, kwargs, name, pos):
    """A forward argument given by name or by position (None when absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else None


def _as_numpy(h):
    """A stream tensor on the CPU as a numpy array without a copy: float32 as it is, bf16 as an
    ml_dtypes bfloat16 view (engine.args.as_array; the engines read it in place)."""
    h = h.detach()
    return as_array(h.cpu() if h.device.type != "cpu" else h)


class _Runner:
    """The one place a forward's tokens [B, S] become engine calls and come back as deltas.

    begin(ids, real, new) once per forward hashes every Engram layer's rows before layer 0 runs:
    one packed segment per row (Decoder.begin_packed), holding that row's real tokens only, so
    padding takes no part in any n-gram. layer(L, hidden[B, S, G, D]) then gathers, projects and
    gates all of the forward's real tokens in one call per layer (delta 0 at padding)."""

    def __init__(self, engram):
        self.engram = engram
        self.dec = None           # Decoder with n_streams = the batch of the current sequence
        self.live = False         # the engines hold the current sequence's history
        self.todo = set()         # Engram layers still to run in this forward
        self.sel = None           # flat indices of the real tokens (None: all of them)
        self.shape = None         # (B, S) of this forward
        self.pos = 0              # positions of the current sequence the streams have seen (padding too)
        self.counts = {"forwards": 0, "prefill_tokens": 0, "decode_steps": 0, "seconds": 0.0}

    def reset(self):
        if self.dec is not None:
            self.dec.reset()
        self.live, self.todo, self.pos = False, set(), 0

    def begin(self, ids, real, new, past=None):
        """past: the cache's length before this forward (None: no cache to compare)."""
        if self.todo:  # the last forward stopped between Engram layers: they disagree now
            self.reset()
        B, S = ids.shape
        if not new and not self.live:
            raise ValueError("the tokens continue a sequence (their positions do not start at 0) that the Engram "
                             "has not seen since attach(), reset() or an interrupted forward: start it again "
                             "from position 0")
        if not new and B != self.dec.n_streams:
            raise ValueError(f"batch size changed mid-sequence: {B} rows, the sequence began with "
                             f"{self.dec.n_streams} (a new sequence starts at position 0)")
        if not new and past is not None and past != self.pos:
            raise ValueError(f"the cache holds {past} positions but the Engram's streams have seen {self.pos} of "
                             f"their sequence: a cache reused or copied from another point (a shared prompt's "
                             f"cache given to a second question) would continue another history; start the "
                             f"sequence from position 0, or run the shared prefix again")
        flat = real.reshape(-1)
        per_row = real.sum(1)
        streams = np.flatnonzero(per_row)
        if new:
            self.live = False
            if self.dec is None or self.dec.n_streams != B:
                self.dec = self.engram.decoder(n_streams=B)
            else:
                self.dec.reset()
        self.sel = None if flat.all() else np.flatnonzero(flat)
        if streams.size:   # all or nothing: a refused batch leaves every stream as it was
            self.dec.begin_packed(ids.reshape(-1) if self.sel is None else ids.reshape(-1)[self.sel],
                                  streams, per_row[streams])
        self.live = True
        self.pos = (0 if new else self.pos) + S
        self.shape, self.todo = (B, S), set(self.dec.layers)
        self.counts["forwards"] += 1
        step = S == 1 and self.sel is None
        self.counts["decode_steps" if step else "prefill_tokens"] += 1 if step else int(flat.sum())

    def layer(self, L, hidden):
        """float32[B, S, G, D]: layer L's delta (0 at padding), float32 whatever hidden's dtype
        (a bf16 hidden is read as it is: the float32 delta is added to it, then rounded once)."""
        B, S = self.shape
        if L not in self.todo:
            raise RuntimeError(f"Engram layer {L} ran outside the model's forward, or twice in one: the Engram "
                               f"reads the token ids when hf_model.model is called")
        self.todo.discard(L)
        if self.sel is not None and not self.sel.size:   # a forward of padding only
            return np.zeros(hidden.shape, np.float32)
        flat = hidden.reshape((B * S,) + hidden.shape[2:])
        if self.sel is None:
            return self.dec.layer(L, flat, out=np.empty(flat.shape, np.float32)).reshape(hidden.shape)
        out = np.zeros(flat.shape, np.float32)
        out[self.sel] = self.dec.layer(L, flat[self.sel], out=np.empty((self.sel.size,) + flat.shape[1:], np.float32))
        return out.reshape(hidden.shape)


class EngramHandle:
    """What attach() returns: detach() removes the hooks; reset() forgets every stream.
    Usable as a context manager (detach on exit). counts: forwards, prompt tokens prefilled,
    multi-stream decode steps, and seconds spent in the hooks (the Engram's whole cost)."""

    def __init__(self, hf_model, engram_model):
        inner = _inner(hf_model)
        if inner is None:
            raise TypeError(f"EngramHandle needs a transformers DeepSeek-V4 model, got {type(hf_model).__name__}")
        _check(inner, engram_model)
        self.model, self.engram = hf_model, engram_model
        self._inner, self._run = inner, _Runner(engram_model)
        self._shape = (engram_model.cfg.hc_mult, engram_model.cfg.hidden_size)
        self._hooks = [inner.register_forward_pre_hook(self._begin, with_kwargs=True)]
        for L in engram_model.cfg.layer_ids:
            self._hooks.append(inner.layers[L].register_forward_pre_hook(functools.partial(self._layer, L),
                                                                         with_kwargs=True))
        inner._engram_stream_handle = self
        self._generate = None
        if callable(getattr(hf_model, "generate", None)):  # refuses what the streams cannot follow
            self._generate = hf_model.generate
            hf_model.generate = self._checked_generate

    def _checked_generate(self, *args, **kwargs):
        gc = kwargs.get("generation_config") or getattr(self.model, "generation_config", None)
        beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
        if beams > 1:
            raise ValueError(f"generate(num_beams={beams}): beam search reorders the batch between steps and the "
                             f"Engram's streams would not follow it; use greedy or sampled decoding (num_beams=1), "
                             f"or detach() the Engram")
        return self._generate(*args, **kwargs)

    def __repr__(self):
        state = "attached" if self.attached else "detached"
        return f"EngramHandle({type(self.model).__name__}, layers={list(self.engram.cfg.layer_ids)}, {state})"

    @property
    def attached(self) -> bool:
        return bool(self._hooks)

    @property
    def counts(self) -> dict:
        return dict(self._run.counts)

    def reset(self):
        """Forget every stream: the next forward must start a sequence (position 0)."""
        self._run.reset()

    def detach(self):
        """Remove the hooks (the model computes as it did before attach); a second call does nothing."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._generate is not None:
            self.model.__dict__.pop("generate", None)  # the class's generate again
            self._generate = None
        if getattr(self._inner, "_engram_stream_handle", None) is self:
            self._inner._engram_stream_handle = None
        self._run.reset()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    # ---- the hooks -----------------------------------------------------------------------------
    def _begin(self, module, args, kwargs):
        t0 = time.perf_counter()
        self._start(args, kwargs)
        self._run.counts["seconds"] += time.perf_counter() - t0

    def _layer(self, L, module, args, kwargs):
        t0 = time.perf_counter()
        try:
            return self._apply(L, args, kwargs)
        finally:
            self._run.counts["seconds"] += time.perf_counter() - t0

    def _start(self, args, kwargs):
        ids = _arg(args, kwargs, "input_ids", 0)
        if ids is None:
            raise ValueError("the Engram needs input_ids: it hashes token ids, and inputs_embeds carry none")
        B, S = ids.shape
        mask = _arg(args, kwargs, "attention_mask", 1)
        if mask is None:
            real = np.ones((B, S), bool)
        elif isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] == B and mask.shape[1] >= S:
            real = mask[:, -S:].detach().cpu().numpy() != 0   # the last S columns are this forward's tokens
        else:
            raise ValueError(f"the Engram reads padding from a 2-D attention_mask [batch, length] of 0/1, got "
                             f"{type(mask).__name__} {tuple(getattr(mask, 'shape', ()))} for input_ids {(B, S)}")
        pos = _arg(args, kwargs, "position_ids", 2)
        cache = kwargs.get("cache", kwargs.get("past_key_values", args[3] if len(args) > 3 else None))
        past = int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else None
        if pos is None:
            new = cache is None or past == 0
        else:
            p = np.broadcast_to(pos.detach().cpu().numpy(), (B, S))
            new = bool(real.any()) and int(p[real].min()) == 0
        self._run.begin(ids.detach().cpu().numpy().astype(np.int64, copy=False), real, new, past)

    def _apply(self, L, args, kwargs):
        h = args[0] if args else kwargs["hidden_states"]
        want = tuple(self._run.shape) + self._shape if self._run.shape is not None else None
        if tuple(h.shape) != want:
            raise ValueError(f"layer {L}: the hidden stream has shape {tuple(h.shape)}, expected {want} "
                             f"[batch, tokens, hc_mult, hidden]")
        delta = torch.from_numpy(self._run.layer(L, _as_numpy(h))).to(h.device)
        out = (h.float() + delta).to(h.dtype)   # bf16 models: bf16(h + delta), as the reference rounds
        if args:
            return (out,) + tuple(args[1:]), kwargs
        return args, {**kwargs, "hidden_states": out}


# The kinds of model attach() serves, tried in order: (what it is, for the error; the part of the
# model that says it is one, or None; what attaches the Engram to it).
_KINDS = (("a DeepSeek-V4 model: DeepseekV4ForCausalLM or DeepseekV4Model, with DeepSeek-V4.1's Engram",
           _inner, EngramHandle),
          ("a Qwen4-Exp model: Qwen4ExpForCausalLM, ...ForConditionalGeneration or ...TextModel, with "
           "Qwen3.8-Flash-Next's PLE", transformers_qwen._text_model, transformers_qwen._attach))
