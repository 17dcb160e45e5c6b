"""Qwen3.8-Flash-Next's PLE table in a llama.cpp GGUF (general.architecture "qwen4exp"): the
merged tensor per_layer_token_embd.weight, ne [head_dim, rows] (every head's rows stacked at
qwen4exp.ple.head_offsets), or the per-head split ple_ngram_embd.{h}.weight (the same bytes);
the constants under qwen4exp.ple.* (rows.gguf.Layout: how the file is checked against the
folder's config)."""
from __future__ import annotations

from ..errors import CheckpointError
from ..rows.gguf import Layout, numbered

ARCH = "qwen4exp"


class QwenLayout(Layout):
    archs = {ARCH: "llama.cpp"}
    keys = ("ple.layers", "ple.ngram_size", "ple.heads_per_ngram", "ple.conv_kernel", "ple.eos_token_id",
            "ple.layer_multipliers", "ple.head_offsets", "ple.head_vocab_sizes", "embedding_length_per_layer_input")

    def tables(self, model):
        if "per_layer_token_embd.weight" in model.tensors:  # the merged table: the heads stacked
            return [("all heads (rows at ple.head_offsets)", "per_layer_token_embd.weight")]
        return numbered(model, "ple_ngram_embd.{}.weight", "head")

    def expected(self, arch, cfg, plan):
        a, L = arch, cfg.layer_ids[0]
        return {f"{a}.ple.layers": list(cfg.layer_ids), f"{a}.ple.ngram_size": cfg.max_ngram_size,
                f"{a}.ple.heads_per_ngram": cfg.n_head_per_ngram, f"{a}.ple.conv_kernel": cfg.kernel_size,
                f"{a}.ple.eos_token_id": cfg.pad_id, f"{a}.embedding_length_per_layer_input": cfg.head_dim,
                f"{a}.ple.layer_multipliers": plan.multipliers[L], f"{a}.ple.head_offsets": plan.offsets[L],
                f"{a}.ple.head_vocab_sizes": plan.head_primes[L]}

    def layers(self, path, cfg, plan, tables):
        if len(cfg.layer_ids) != 1:
            raise CheckpointError(f"{path}: a {ARCH} GGUF holds one PLE table, the folder's config has PLE layers "
                                  f"{list(cfg.layer_ids)}")
        L = cfg.layer_ids[0]
        heads = [t for _, t in tables]
        sizes = [plan.table_rows[L]] if len(heads) == 1 else [int(p) for p in plan.head_primes[L]]
        if len(heads) != len(sizes):
            raise CheckpointError(f"{path}: {len(heads)} per-head tables (ple_ngram_embd.*), the folder's config "
                                  f"has {len(sizes)} heads")
        return {L: list(zip(heads, sizes))}


LAYOUT = QwenLayout()
