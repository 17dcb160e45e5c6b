"""The Qwen4-Exp half of engram_stream.integrations.transformers.attach: engram_stream as the PLE
(Per-Layer Embedding, the n-gram memory) of a transformers Qwen4-Exp model (Qwen3.8-Flash-Next).
attach() there chooses this module's _attach for a Qwen4-Exp model:

    from engram_stream import EngramModel
    from engram_stream.integrations.transformers import attach

    ple = EngramModel.load(folder)                 # the PLE tensors of the folder (tables mapped)
    with attach(hf_model, ple):                    # a Qwen4ExpForCausalLM, ...ForConditionalGeneration or ...TextModel
        out = hf_model.generate(input_ids, attention_mask=mask, max_new_tokens=64)

transformers computes `hidden + layer.ple(hidden, ple_input_ids, cache, conv_mask)` in each decoder
layer of ple_layer_ids. attach() puts a module of its own in place of each such `layer.ple` (detach(),
or leaving the `with`, puts the original back): it feeds the layer's streaming engine and returns the
engine's output in hidden's dtype. The model's own PLE tables need not be loaded at all.

Batch rows are streams. A forward starts a new sequence when this layer's id state in the cache is
empty (a fresh cache: each generate() starts fresh) or when there is no cache; the module then writes
that state, as transformers' n-gram embedding does, so the next forward continues. Positions the
conv_mask marks as padding (left padding) take no part in any n-gram or conv state and give 0 (what
the module gives for them is never used): a padded row gets what the same row run alone gets, which is
transformers' own result (padding reads EOS, as the history before the start does). Beam search and
other modes that reorder the batch between steps are not supported: the streams would not follow the
reordered rows.
"""
from __future__ import annotations

import numpy as np

from ..engine.args import as_array

try:
    import torch
except ImportError as e:
    raise ImportError(f"engram_stream.integrations.transformers_qwen needs torch and transformers with Qwen4-Exp "
                      f"(5.24 or later) ({e}): pip install '.[transformers]' from the engram_stream checkout") from e

from ..model import EngramModel

__all__ = ["StreamPLE", "Handle"]


class StreamPLE(torch.nn.Module):
    """A stand-in for transformers' Qwen4ExpTextPLELayer of layer L: the same call, served by the
    engine of `engram_model`'s layer L."""

    def __init__(self, engram_model, layer, layer_idx):
        super().__init__()
        self.engram, self.layer, self.layer_idx = engram_model, layer, layer_idx
        self.context_len = engram_model.cfg.max_ngram_size - 1
        self.eng = None

    def forward(self, hidden_states, input_ids, cache=None, conv_mask=None, **kwargs):
        cfg = self.engram.cfg
        B, T, C = hidden_states.shape
        if C != cfg.hc_mult * cfg.hidden_size:
            raise ValueError(f"layer {self.layer}: hidden of {C} values, the PLE has hc_count*hidden_size = "
                             f"{cfg.hc_mult * cfg.hidden_size}")
        new = cache is None or cache.get_conv_state(self.layer_idx, state_idx=2) is None
        if new:
            if self.eng is None or self.eng.n_streams != B:
                self.eng = self.engram.stream(self.layer, n_streams=B)
            else:
                self.eng.reset()
            if cache is not None:  # the id state transformers' embedding would write: the next forward continues
                ids_state = input_ids
                if T < self.context_len:
                    ids_state = torch.nn.functional.pad(ids_state, (self.context_len - T, 0), value=cfg.pad_id)
                cache.update_conv_state(ids_state, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len)
        elif self.eng is None or self.eng.n_streams != B:
            raise RuntimeError(f"layer {self.layer}: a forward continues a cache this PLE did not start "
                               f"(batch {B}); start the sequence from an empty cache")
        else:
            cache.update_conv_state(input_ids, self.layer_idx, state_idx=2, conv_kernel_size=self.context_len)
        ids = input_ids.detach().to("cpu", torch.int64).numpy()
        # the hidden read in place (a bf16 model's too: as_array), the output written in the model's
        # dtype (bf16: the engine's float32 result rounded to nearest even, as .to(bfloat16) rounds)
        hid = as_array(hidden_states.detach().cpu()).reshape(B, T, cfg.hc_mult, cfg.hidden_size)
        G, D = cfg.hc_mult, cfg.hidden_size
        odt = hidden_states.dtype if hidden_states.dtype in (torch.float32, torch.bfloat16) else torch.float32
        out = torch.empty((B, T, G, D), dtype=odt)
        masked = None if conv_mask is None else ~conv_mask.detach().to("cpu").bool().numpy()
        if T == 1 and (masked is None or not masked.any()):
            self.eng.step(ids[:, 0], hid[:, 0], out=out.view(B, G, D))
        else:
            self.eng.step_packed(ids.reshape(-1), hid.reshape(B * T, G, D), streams=np.arange(B),
                                 lengths=np.full(B, T), masked=None if masked is None else masked.reshape(-1),
                                 out=out.view(B * T, G, D))
        return out.view(B, T, C).to(hidden_states.device, hidden_states.dtype)


def _text_model(hf_model):
    """The Qwen4ExpTextModel inside hf_model (itself, .model, or .model.language_model), or None."""
    for m in (hf_model, getattr(hf_model, "model", None), getattr(getattr(hf_model, "model", None), "language_model", None)):
        if m is not None and hasattr(m, "layers") and hasattr(m, "config") and hasattr(m.config, "ple_layer_ids"):
            return m
    return None


class Handle:
    """What attach() changed in a Qwen4-Exp model; detach() (or the end of a `with`) puts the
    model's own PLE layers back."""

    def __init__(self, layers, originals):
        self._layers, self._originals = layers, originals

    def detach(self):
        for i, ple in self._originals.items():
            self._layers[i].ple = ple
        self._originals = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()


def _attach(hf_model, engram_model) -> Handle:
    """integrations.transformers.attach for a Qwen4-Exp model: serve `engram_model`'s PLE layers
    inside `hf_model` (see the module doc). The two must describe the same PLE: ple_layer_ids,
    hidden_size, hc_count and the EOS."""
    if not isinstance(engram_model, EngramModel) or engram_model.cfg.variant != "qwen3.8-flash-next":
        raise TypeError(f"attach takes a qwen3.8-flash-next EngramModel (EngramModel.load of a Qwen folder) for "
                        f"a Qwen4-Exp model, got {_what(engram_model)}")
    text = _text_model(hf_model)
    tc, cfg = text.config, engram_model.cfg
    eos = tc.eos_token_id[0] if isinstance(tc.eos_token_id, list) else tc.eos_token_id
    mine = (sorted(set(tc.ple_layer_ids)), tc.hidden_size, tc.hc_count, eos)
    if mine != (cfg.layer_ids, cfg.hidden_size, cfg.hc_mult, cfg.pad_id):
        raise ValueError(f"the model's (ple_layer_ids, hidden_size, hc_count, eos) {mine} differ from the PLE's "
                         f"{(cfg.layer_ids, cfg.hidden_size, cfg.hc_mult, cfg.pad_id)}")
    originals = {}
    for L in cfg.layer_ids:
        layer = text.layers[L - 1]
        originals[L - 1] = layer.ple
        layer.ple = StreamPLE(engram_model, L, L - 1)
    return Handle(text.layers, originals)


def _what(engram_model):
    """An attach argument in words: an EngramModel's variant, else its type."""
    if isinstance(engram_model, EngramModel):
        return f"a {engram_model.cfg.variant} EngramModel"
    return type(engram_model).__name__
