"""The variant registry: everything that differs between Engram modules, one `Variant` a variant.

A variant is a subclass of `Variant` (below) with one instance registered here. EngramConfig,
HashPlan, EngramModel and the CLI ask the registry (`get(name)`, `variant_of(cfg)`,
`registered()`), never a variant's name. This module imports nothing of the package at import
time, so the config (below every variant) can ask it too.

Registration has one path, `discover()`, which the first registry lookup runs (get, variant_of,
registered, variants): at first use, not at `import engram_stream`, so a plugin whose module
imports the package at its top finds it whole:
  * built-in variants: every subpackage of engram_stream holding a `variant.py` (a package scan,
    so no shared file lists the variant folders); importing it registers its Variant;
  * third-party variants: the entry points of the group `engram_stream.variants` (ENTRY_POINTS)
    in an installed distribution's metadata, e.g. in its pyproject.toml:
        [project.entry-points."engram_stream.variants"]
        my-variant = "my_package.variant:MyVariant"
    The entry point names a Variant subclass (instantiated and registered), a Variant instance
    (registered), or a module that registers its own on import. register() checks a variant
    (its hooks, its config class, its name) and refuses a malformed one: an entry point's is a
    warning naming it, never a registry that breaks every other variant.
A test registers a variant of its own with `register` and takes it out with `unregister`.

The hooks, grouped as EngramConfig, the model and HashPlan ask them; a method with a body here
is a default (the demo's behaviour: plain history, the demo's multiplier draw, no Hugging Face
config), an abstract one is what every variant must say.
"""
from __future__ import annotations

import abc
import importlib
import os
import pkgutil
import threading
import types
import warnings

import numpy as np

DEFAULT = "demo-v1"   # EngramConfig's default variant: the public demo module
ENTRY_POINTS = "engram_stream.variants"   # the entry-point group of third-party variants
PRIME_1 = 10007   # the layer seed stride of the demo reference's multiplier draw


class Variant(abc.ABC):
    """One Engram variant: its config rule and fields, weights, files, oracle, engine and hash."""

    # ---- identity and config ----------------------------------------------------------------
    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The registry name (EngramConfig.variant)."""

    @property
    @abc.abstractmethod
    def example_config(self) -> dict:
        """A small config of this variant (dict of fields), for help texts and tests."""

    # What the variant is and what its checkpoint holds, in words: the lines help texts,
    # docstrings and errors list for every variant (listing(), below). Empty: the name alone,
    # and a file or a folder as folder_checkpoint says.
    title = ""             # e.g. "DeepSeek-V4.1's Engram"
    checkpoint_form = ""   # e.g. "a Hugging Face folder: config.json, the shards"

    # The EngramConfig subclass (a frozen dataclass) holding this variant's own fields, or None:
    # EngramConfig itself. EngramConfig(variant=name, ...) builds an instance of it. Its fields
    # carry their help (config.described), which `engram-stream init --help` prints.
    config_class = None
    # Config fields that are checks, not semantics (sizes a checkpoint declares): left out of
    # a snapshot's fingerprint, so a model saved and loaded again takes its own snapshots.
    declared_fields: tuple = ()

    # The module of the variant's config rules, or None: validate(cfg, put), and with hf_config
    # reads_hf_config(d), from_hf_config(cls, d, overrides), to_hf_config(cfg) and the key lists
    # HF_KEYS, HF_OWN_KEYS, HF_DEFAULTS. The hooks below read it; a variant may override them
    # instead.
    config_rules = None

    def validate_config(self, cfg, put):
        """The variant's own rules after EngramConfig's common ones; put(name, value) sets a
        field (defaults, normalized values)."""
        if self.config_rules is not None:
            self.config_rules.validate(cfg, put)

    # A Hugging Face config.json describes this variant's models (the three hooks below).
    hf_config = False

    def reads_hf_config(self, d) -> bool:
        """Whether the parsed config.json `d` describes one of this variant's models."""
        return bool(self.hf_config and self.config_rules.reads_hf_config(d))

    def from_hf_config(self, cls, d, overrides):
        """An EngramConfig from such a config.json (cls: the class from_hf_config was called on)."""
        if not self.hf_config:
            raise ValueError(f"{self.name} models have no Hugging Face config.json to read")
        return self.config_rules.from_hf_config(cls, d, overrides)

    def to_hf_config(self, cfg) -> dict:
        """The config.json keys of cfg."""
        if not self.hf_config:
            writers = [v.name for v in variants() if v.hf_config]
            raise ValueError(f"to_hf_config is for the variants {writers}, not {self.name!r}")
        return self.config_rules.to_hf_config(cfg)

    def hf_config_keys(self) -> tuple:
        """(read, own, defaults) of this variant's config.json: every key from_hf_config reads;
        those of them only an Engram module has (an unread key close to one of these is a
        misspelling from_hf_config warns about; the model's other keys are not); {key: value}
        taken when a key is absent. From config_rules' HF_KEYS, HF_OWN_KEYS, HF_DEFAULTS (without
        them: nothing to compare a key with, no warning)."""
        rules = self.config_rules if self.hf_config else None
        return (tuple(getattr(rules, "HF_KEYS", ())), tuple(getattr(rules, "HF_OWN_KEYS", ())),
                dict(getattr(rules, "HF_DEFAULTS", {})))

    # ---- weights and files --------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def layer_class(self) -> type:
        """The class of one layer's weights (what the engine reads)."""

    weight_dtypes: tuple = ("float32",)   # what with_weight_dtype accepts
    table_dtypes: tuple = ()   # what save/save_init take as table_dtype (empty: tables stay as they are)
    folder_checkpoint = False   # a checkpoint is a folder (else one file)
    load_note = ""   # what load does besides mapping the tables, for the CLI's loading line
    gguf_layout = None   # where a llama.cpp GGUF holds its tables (a rows.gguf.Layout; GGUFTier, inspect)
    init_table_dtype = "float32"   # the table dtype save_init writes when given no table_dtype

    # The module of the layer weights' rules: validate_layer(cfg, plan, L, w), init_layers(cfg,
    # plan, seed, graft_zero_init), layer_from_state_dict(cfg, plan, L, state_dict). The three
    # hooks below call it; a variant without one overrides all three (register() checks).
    weights_rules = None
    LAYER_HOOKS = ("validate_layer", "init_layers", "from_state_dict")

    def validate_layer(self, cfg, plan, L, w):
        """Shapes and dtypes of one layer's weights that the engine relies on."""
        self.weights_rules.validate_layer(cfg, plan, L, w)

    def init_layers(self, cfg, plan, seed, graft_zero_init) -> dict:
        """{L: weights}, random."""
        return self.weights_rules.init_layers(cfg, plan, seed, graft_zero_init)

    def from_state_dict(self, cfg, plan, L, state_dict):
        """One layer's weights from the reference module's state_dict (its names)."""
        return self.weights_rules.layer_from_state_dict(cfg, plan, L, state_dict)

    def with_weight_dtype(self, cfg, layers, name) -> dict:
        """The layers with projection weights held as `name` (one of weight_dtypes)."""
        return layers   # one held dtype: nothing to convert

    @abc.abstractmethod
    def load(self, path, mmap=True, compression=None):
        """(cfg, plan, layers) of a checkpoint of this variant's format."""

    @abc.abstractmethod
    def save(self, cfg, plan, layers, path, table_dtype=None, progress=None):
        """Write a checkpoint; returns its path."""

    @abc.abstractmethod
    def save_init(self, cfg, path, seed=0, graft_zero_init=False, compression=None, table_dtype=None,
                  progress=None, before_write=None):
        """Write a checkpoint of random weights, tables in pieces (flat memory)."""

    @abc.abstractmethod
    def is_checkpoint(self, path) -> bool:
        """Whether `path` is a checkpoint of this variant's format."""

    def folder_of(self, path):
        """The checkpoint folder the file `path` is part of, or None."""
        return None

    # ---- computing ----------------------------------------------------------------------------
    @abc.abstractmethod
    def forward(self, cfg, w, rows, dead, hidden, ids):
        """The numpy oracle: float32 delta of one layer for rows [B, T, H], dead bool[B, T]
        (dead_mask), hidden [B, T, G, D] (an input layer's: None, and it returns [B, T, D]),
        ids int64[B, T]: the raw ids the rows were hashed from (an input layer's output reads
        them: its token embedding)."""

    @property
    @abc.abstractmethod
    def engine(self) -> type:
        """The streaming engine class: engine(model, layer, n_streams, rows=None)."""

    @property
    def input_layer(self) -> bool:
        """Whether the variant's layers are input layers (a token in, float32[hidden_size] out, no
        hidden: forward(cfg, w, rows, dead, None) -> [B, T, D]), as its engine class declares
        (EngineBase.input_layer); else residual layers (hidden [.., G, D] in and out)."""
        return bool(getattr(self.engine, "input_layer", False))

    @abc.abstractmethod
    def describe(self, cfg) -> str:
        """The variant's own geometry, for `engram-stream inspect`."""

    @abc.abstractmethod
    def step_weights(self, w):
        """The weight matrix one step reads whole (`engram-stream bench`'s floor)."""

    # Whether token ids below 0 are valid input (DESIGN.md 14: they have no compression entry and
    # hash as themselves). False: plan.hash and the engine refuse them (errors.negative_id), e.g.
    # a variant whose ids index a token embedding.
    negative_ids = True

    def sample_ids(self, cfg, rng, size) -> np.ndarray:
        """Random token ids for demos and benches: uniform in the vocab (a variant with special
        ids sprinkles them in)."""
        return rng.integers(0, cfg.vocab_size, size=size)

    # ---- hashing (HashPlan asks these; the defaults are the demo's) --------------------------
    @property
    def window_class(self) -> type:
        """The hash window class (a HashWindow subclass, cdef nogil hooks): the one owner of the
        variant's history rule and hash, run by its engine per token and by HashPlan.hash on
        whole batches. By default the class the engine names (its _window_class)."""
        return self.engine._window_class

    def draw_multipliers(self, cfg, compressed_vocab) -> dict:
        """{L: int64[max_ngram]}: the demo reference's draw, numpy default_rng(seed + 10007*layer),
        odd values below INT64_MAX // compressed_vocab."""
        half = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
        out = {}
        for L in cfg.layer_ids:
            r = np.random.default_rng(int(cfg.seed + PRIME_1 * L)).integers(
                0, half, size=(cfg.max_ngram_size,), dtype=np.int64)
            out[L] = r * 2 + 1
        return out

    def head_sizes(self, cfg) -> dict:
        """{layer: int64[n_heads]}: the table size (modulus) of each head, orders 2..max_ngram
        with n_head_per_ngram heads each, in that order; a head's rows sit at the sum of the
        sizes before it. By default the prime chain (one seen-set across every layer and head:
        prime_chain, below)."""
        return {L: np.array([p for order in orders for p in order], dtype=np.int64)
                for L, orders in prime_chain(cfg).items()}

    def hash_lines(self, cfg, plan, layer) -> list:
        """What `engram-stream inspect` prints of a layer's hash constants: by default its
        multipliers, each order's prime table sizes and the heads' offsets."""
        return ([f"multipliers {plan.multipliers[layer].tolist()}"]
                + [f"  order {n}: primes {p}" for n, p in enumerate(plan.primes[layer], start=2)]
                + [f"  offsets {plan.offsets[layer].tolist()}"])

    def plan_extras(self, cfg, plan) -> dict:
        """{attribute: {layer: array}} more per-layer hash data the variant's window reads (each
        array held read-only on the plan as that attribute), e.g. per-head multipliers. None by
        default."""
        return {}

    def rows_numpy(self, cfg, plan, layer, ids, x, shifted) -> np.ndarray:
        """The numpy oracle's rows int64[B, T, H] of `layer` for raw ids[B, T] (x: compressed,
        shifted: windows(...)): by default the reference's XOR chain, head j of order n the
        multiplied windows 0..n-1 XORed, mod head_sizes' j."""
        mult, sizes, heads = plan.multipliers[layer], plan.head_primes[layer], []
        k = cfg.n_head_per_ngram
        with np.errstate(over="ignore"):
            for n in range(2, cfg.max_ngram_size + 1):
                mix = shifted[0] * mult[0]
                for d in range(1, n):
                    mix = np.bitwise_xor(mix, shifted[d] * mult[d])
                heads += [mix % np.int64(p) for p in sizes[(n - 2) * k:(n - 1) * k]]
        return np.stack(heads, axis=2) if heads else np.zeros(ids.shape + (0,), np.int64)

    def table_rows(self, cfg, rows: int) -> int:
        """The rows a layer's table holds given the sum of its primes (padding): that sum."""
        return rows

    def dead_id(self, cfg):
        """The raw id whose positions are DEAD (gate 0, history cut), or None."""
        return None

    def dead_mask(self, cfg, ids) -> np.ndarray:
        """bool, same shape as ids: the positions whose gate is 0 (none by default)."""
        return np.zeros(np.shape(ids), bool)

    def windows(self, cfg, pad_id, raw, x) -> list:
        """The numpy oracle's hash windows: for shift s = 0..max_ngram-1, int64[B, T] of the
        (compressed) id s positions back, `pad_id` before the start. raw: the ids as given;
        x: compressed (negative ids passed through)."""
        T = x.shape[1]
        return [np.pad(x, ((0, 0), (s, 0)), constant_values=pad_id)[:, :T] for s in range(cfg.max_ngram_size)]

    def check_plan(self, plan):
        """Refuse a plan that disagrees with what the config declares (nothing by default)."""


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin, exact for every n < 3.3e24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def prime_chain(cfg) -> dict:
    """{layer: [[prime]*n_head for each order 2..max_ngram]}, one seen-set across everything."""
    seen, out = set(), {}
    for layer in cfg.layer_ids:
        orders = []
        for n in range(2, cfg.max_ngram_size + 1):
            start, heads = cfg.engram_vocab_size[n - 2] - 1, []
            for _ in range(cfg.n_head_per_ngram):
                c = start + 1
                while c in seen or not is_prime(c):
                    c += 1
                seen.add(c)
                heads.append(c)
                start = c
            orders.append(heads)
        out[layer] = orders
    return out



_REGISTRY: dict = {}


def register(variant: Variant) -> Variant:
    """Add a variant (its name must be new); returns it."""
    if not isinstance(variant, Variant):
        raise TypeError(f"register takes a Variant instance, got {type(variant).__name__}")
    _check_variant(variant)
    if variant.weights_rules is None:
        missing = [h for h in Variant.LAYER_HOOKS if getattr(type(variant), h) is getattr(Variant, h)]
        if missing:
            raise TypeError(f"{type(variant).__name__} has no weights_rules module: it must define {missing}")
    if variant.name in _REGISTRY and _REGISTRY[variant.name] is not variant:
        raise ValueError(f"a variant named {variant.name!r} is registered already")
    _REGISTRY[variant.name] = variant
    return variant


def _check_variant(variant):
    """Refuse a variant that would break the registry for every other one: an abstract hook left
    None, a name that is not a non-empty str, and what REGISTER_CHECKS refuse (a config class
    that is not a frozen dataclass of EngramConfig's: EngramConfig, from_dict and every config
    read walk all config classes)."""
    what = type(variant).__name__
    hooks = sorted(Variant.__abstractmethods__)
    values = {h: getattr(variant, h, None) for h in hooks}
    unset = [h for h in hooks if values[h] is None]
    if unset:
        raise TypeError(f"{what} leaves the Variant hooks {unset} None: define each")
    if not isinstance(values["name"], str) or not values["name"].strip():
        raise TypeError(f"{what}.name must be a non-empty str, got {values['name']!r}")
    if not isinstance(values["example_config"], dict):
        raise TypeError(f"{what}.example_config must be a dict of config fields, got "
                        f"{type(values['example_config']).__name__}")
    for h in ("layer_class", "engine"):
        if not isinstance(values[h], type):
            raise TypeError(f"{what}.{h} must be a class, got {values[h]!r}")
    for check in REGISTER_CHECKS:
        check(variant)


# The checks of a variant that modules above the registry own, run by register(): the config
# module adds its config class's (that module imports this one, so this one cannot import it).
# Every import of the package imports the config module, so no variant registers before it.
REGISTER_CHECKS: list = []


def unregister(name: str):
    """Take a variant out again (a test's own variant, at its end)."""
    _REGISTRY.pop(name, None)


def registered() -> tuple:
    """The names of every registered variant, in registration order."""
    _discover_once()
    return tuple(_REGISTRY)


def variants() -> tuple:
    """Every registered Variant, in registration order."""
    _discover_once()
    return tuple(_REGISTRY.values())


def describe_checkpoint(variant) -> str:
    """A variant's checkpoint in words: its checkpoint_form, else a file or a folder."""
    return variant.checkpoint_form or ("a folder" if variant.folder_checkpoint else "one file")


def listing(line, indent: int = 0) -> str:
    """One line per registered variant, its name and then line(variant) (e.g. describe_checkpoint):
    what help texts, docstrings and errors show wherever they list the variants, so a variant
    registered later appears in every list by itself."""
    width = max((len(n) for n in registered()), default=0)
    return "\n".join(f"{' ' * indent}{v.name:<{width}}  {line(v)}".rstrip() for v in variants())


def document(obj, line, mark: str = "{variants}"):
    """Put listing(line) in obj's docstring in place of the line that holds `mark`, at that
    line's indentation (a docstring that lists every variant, written when the package is
    imported, after discover())."""
    doc = obj.__doc__
    head, sep, tail = doc.partition(mark)
    if not sep:
        raise ValueError(f"{obj!r}: its docstring has no {mark} line to fill")
    indent = len(head) - len(head.rstrip(" "))
    filled = head[:len(head) - indent] + listing(line, indent) + tail
    try:
        obj.__doc__ = filled
    except AttributeError:   # a method: its function holds the docstring
        obj.__func__.__doc__ = filled


def get(name) -> Variant:
    """The entry of variant `name`; an unknown name raises ValueError naming the known ones."""
    _discover_once()
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"EngramConfig.variant must be one of {registered()}, got {name!r}") from None


def variant_of(cfg) -> Variant:
    """The registry entry of cfg.variant."""
    return get(cfg.variant)


def builtin_modules(package: str = __package__) -> list:
    """The `variant` modules of `package`'s subpackages, by folder name: found from the files
    alone (no subpackage is imported to look)."""
    pkg = importlib.import_module(package)
    found = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.ispkg and os.path.isfile(os.path.join(info.module_finder.path, info.name, "variant.py")):
            found.append(f"{package}.{info.name}.variant")
    return sorted(found)


def _entry_points():
    from importlib.metadata import entry_points
    return entry_points(group=ENTRY_POINTS)


def load_entry_point(ep):
    """Register what one entry point names: a Variant subclass (one instance of it), a Variant
    instance, or a module that registered its own on import."""
    obj = ep.load()
    if isinstance(obj, type) and issubclass(obj, Variant):
        register(obj())
    elif isinstance(obj, Variant):
        register(obj)
    elif not isinstance(obj, types.ModuleType):
        raise TypeError(f"entry point {ep.name} = {ep.value!r} ({ENTRY_POINTS}) names a "
                        f"{type(obj).__name__}: it must name a Variant subclass, instance or module")


# The package's discovery: "pending" until the first lookup runs it, "running" while it runs (a
# plugin that asks the registry during its own import gets what is registered so far, not a
# second discovery), "done" after. A built-in folder's error leaves it "pending": every lookup
# raises it again, never a registry that lacks a built-in variant without a word.
_discovery = "pending"
_DISCOVERY_LOCK = threading.RLock()   # a second thread's first lookup waits for the discovery


_WHEN_DISCOVERED: list = []   # callables run once the package's discovery is done (when_discovered)


def when_discovered(fn):
    """Run fn() once the package's variants are discovered: now if they are, else at the end of
    the first registry lookup (the package's docstrings that list every variant)."""
    if _discovery == "done":
        fn()
    else:
        _WHEN_DISCOVERED.append(fn)


def _discover_once():
    if _discovery == "done":
        return
    with _DISCOVERY_LOCK:
        if _discovery == "pending":   # "running": this thread's own discovery asking (a plugin's import)
            discover()


def discover(package: str = __package__):
    """Register the built-in variants (the package scan) and then the installed distributions'
    (the entry points); the first registry lookup runs it for the package. A third-party variant
    that fails to load (an error, a sys.exit() on import, a malformed Variant) is a warning
    naming its entry point, not a registry lookup that fails."""
    global _discovery
    own = package == __package__
    with _DISCOVERY_LOCK:
        if own:
            _discovery = "running"
        try:
            _discover(package)
        except BaseException:
            if own:
                _discovery = "pending"
            raise
        if own:
            _discovery = "done"
            while _WHEN_DISCOVERED:
                _WHEN_DISCOVERED.pop(0)()


def _discover(package):
    for module in builtin_modules(package):
        importlib.import_module(module)
        if not any(type(v).__module__ == module for v in _REGISTRY.values()):
            # a folder's variant.py that registers nothing would drop the variant without a word
            raise RuntimeError(f"{module} registers no Variant: end it with variants.register(YourVariant())")
    for ep in _entry_points():
        try:
            load_entry_point(ep)
        except (Exception, SystemExit) as e:  # noqa: BLE001  someone else's code: reported, skipped
            # (SystemExit too: a plugin's sys.exit() on import would end the caller's process)
            warnings.warn(f"engram_stream: the variant entry point {ep.name} = {ep.value!r} failed to load "
                          f"({type(e).__name__}: {e}); it is not registered", RuntimeWarning, stacklevel=2)
