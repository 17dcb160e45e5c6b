"""The variant registry: one registration path (the package scan for the built-in variants, the
entry points for third-party ones), the abstract Variant, and each variant's config class (its
own fields, refused on another variant)."""
import contextlib
import dataclasses
import pickle
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest

from engram_stream import EngramConfig, HashPlan, variants
from engram_stream.config import config_class, variant_fields
from engram_stream.engine._window import HashWindow


def test_the_built_in_variants_are_found_by_the_package_scan():
    mods = variants.builtin_modules()
    assert mods == sorted(mods) and len(mods) >= 3
    names = variants.registered()   # a lookup: discover() has run, importing each variant.py
    for mod in mods:
        assert mod.endswith(".variant")
        v = sys.modules[mod].VARIANT   # imported by discover(), registered by importing it
        assert variants.get(v.name) is v
    assert {sys.modules[m].VARIANT.name for m in mods} == set(names)


def test_the_scan_finds_a_variant_folder_it_was_never_told_of(tmp_path, monkeypatch):
    """A package whose subpackage holds a variant.py: found from the files alone; a subpackage
    without one is neither listed nor imported."""
    pkg = tmp_path / "scanpkg"
    (pkg / "mine").mkdir(parents=True)
    (pkg / "other").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "mine" / "__init__.py").write_text("")
    (pkg / "mine" / "variant.py").write_text(
        "from engram_stream import variants\n"
        "class Mine(type(variants.get(variants.DEFAULT))):\n"
        "    name = 'scan-mine'\n"
        "VARIANT = variants.register(Mine())\n"
        "LOADED = True\n")
    (pkg / "other" / "__init__.py").write_text("raise RuntimeError('not a variant folder: never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert variants.builtin_modules("scanpkg") == ["scanpkg.mine.variant"]
        variants.discover("scanpkg")
        assert sys.modules["scanpkg.mine.variant"].LOADED
        assert "scanpkg.other" not in sys.modules
        assert variants.get("scan-mine") is sys.modules["scanpkg.mine.variant"].VARIANT
    finally:
        variants.unregister("scan-mine")
        for m in [m for m in sys.modules if m.startswith("scanpkg")]:
            del sys.modules[m]


@contextlib.contextmanager
def _quiet_package(tmp_path, monkeypatch, name):
    """A package `name` on sys.path whose subpackage `quiet` has a variant.py registering nothing."""
    pkg = tmp_path / name
    (pkg / "quiet").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "quiet" / "__init__.py").write_text("")
    (pkg / "quiet" / "variant.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield f"{name}.quiet.variant"
    finally:
        for m in [m for m in sys.modules if m.startswith(name)]:
            del sys.modules[m]


def test_a_variant_folder_that_registers_nothing_is_an_error(tmp_path, monkeypatch):
    """A folder's variant.py that forgets to register would drop its variant silently."""
    with _quiet_package(tmp_path, monkeypatch, "scanpkg2"):
        with pytest.raises(RuntimeError, match="scanpkg2.quiet.variant registers no Variant"):
            variants.discover("scanpkg2")


class _EP:
    """An entry point as importlib.metadata gives one (name, value, load)."""

    def __init__(self, name, value, obj):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        if isinstance(self._obj, BaseException):
            raise self._obj
        return self._obj


def _plugin_variant(name):
    demo = type(variants.get(variants.DEFAULT))

    class Plugin(demo):   # the demo's behaviour under another name: what the entry point brings
        pass
    Plugin.name = name
    return Plugin


def test_an_entry_point_variant_is_registered(monkeypatch):
    cls = _plugin_variant("plugin-cls")
    inst = _plugin_variant("plugin-inst")()
    module = types.ModuleType("plugin_mod")
    eps = [_EP("a", "pkg.v:Plugin", cls), _EP("b", "pkg.v:INSTANCE", inst), _EP("c", "plugin_mod", module)]
    monkeypatch.setattr(variants, "_entry_points", lambda: eps)
    try:
        variants.discover()   # the built-ins again (registered already: the same objects), then the plugins
        assert isinstance(variants.get("plugin-cls"), cls)
        assert variants.get("plugin-inst") is inst
        assert EngramConfig(variant="plugin-cls").variant == "plugin-cls"
    finally:
        variants.unregister("plugin-cls")
        variants.unregister("plugin-inst")


def test_the_entry_points_group_is_read(monkeypatch):
    """discover() asks importlib.metadata for the group ENTRY_POINTS."""
    import importlib.metadata as md
    asked = []
    monkeypatch.setattr(md, "entry_points", lambda **kw: asked.append(kw) or [])
    variants.discover()
    assert asked == [{"group": "engram_stream.variants"}] == [{"group": variants.ENTRY_POINTS}]


def test_a_broken_entry_point_is_a_warning_naming_it(monkeypatch):
    eps = [_EP("broken", "nope.mod:V", ImportError("no module named nope")), _EP("odd", "x:y", 42)]
    monkeypatch.setattr(variants, "_entry_points", lambda: eps)
    with pytest.warns(RuntimeWarning) as rec:
        variants.discover()
    text = " ".join(str(w.message) for w in rec)
    assert "broken = 'nope.mod:V'" in text and "no module named nope" in text
    assert "odd = 'x:y'" in text and "must name a Variant subclass" in text
    assert "broken" not in variants.registered()


def test_a_plugins_sys_exit_on_import_is_a_warning_not_the_end_of_the_process(monkeypatch):
    """A plugin module calling sys.exit() while it imports: contained like any other error, and
    the plugins after it still register."""
    cls = _plugin_variant("plugin-after-exit")
    eps = [_EP("quits", "quitter.mod:V", SystemExit(3)), _EP("fine", "pkg.v:Plugin", cls)]
    monkeypatch.setattr(variants, "_entry_points", lambda: eps)
    try:
        with pytest.warns(RuntimeWarning, match=r"quits = 'quitter.mod:V' failed to load \(SystemExit: 3\)"):
            variants.discover()
        assert "quits" not in variants.registered() and isinstance(variants.get("plugin-after-exit"), cls)
    finally:
        variants.unregister("plugin-after-exit")


class _ModuleEP(_EP):
    """An entry point naming a module that asks the registry and registers its variant on import."""

    def __init__(self, name, cls, seen):
        super().__init__(name, "plugin_lazy", None)
        self.cls, self.seen = cls, seen

    def load(self):
        self.seen.append(variants.registered())   # during its own import: what is registered so far
        variants.register(self.cls())
        return types.ModuleType("plugin_lazy")


def test_the_first_registry_lookup_discovers_once(monkeypatch):
    """Discovery runs at the first lookup (not at `import engram_stream`), once; a plugin that asks
    the registry while it loads sees the built-ins and starts no second discovery."""
    cls, seen, asked = _plugin_variant("plugin-lazy"), [], []
    monkeypatch.setattr(variants, "_entry_points", lambda: asked.append(1) or [_ModuleEP("lazy", cls, seen)])
    monkeypatch.setattr(variants, "_discovery", "pending")   # as after `import engram_stream`
    try:
        assert isinstance(variants.get("plugin-lazy"), cls)
        assert asked == [1] and len(seen) == 1
        assert {variants.DEFAULT, "deepseek-v4.1", "qwen3.8-flash-next"} <= set(seen[0])
        assert "plugin-lazy" not in seen[0]
        variants.registered(), variants.variants(), variants.variant_of(EngramConfig())
        assert asked == [1]   # not again
    finally:
        variants.unregister("plugin-lazy")


@pytest.mark.parametrize("lookup", [lambda: variants.get(variants.DEFAULT), variants.registered, variants.variants,
                                    lambda: EngramConfig()])
def test_a_built_in_folders_error_raises_from_every_lookup(tmp_path, monkeypatch, lookup):
    """Lazy, a built-in folder's error still raises (from the lookup that discovers), and again
    from the next one: never a registry that lacks a built-in variant without a word."""
    with _quiet_package(tmp_path, monkeypatch, "scanpkg3") as module:
        monkeypatch.setattr(variants, "builtin_modules", lambda package: [module])
        monkeypatch.setattr(variants, "_discovery", "pending")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="scanpkg3.quiet.variant registers no Variant"):
                lookup()


def test_import_engram_stream_discovers_nothing_until_a_lookup():
    """`import engram_stream` imports no variant folder; the first lookup does."""
    code = ("import sys, engram_stream\n"
            "before = sorted(m for m in sys.modules if m.endswith('.variant'))\n"
            "engram_stream.StreamEngine\n"
            "after = sorted(m for m in sys.modules if m.endswith('.variant'))\n"
            "print(before, len(after))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=tempfile.gettempdir())
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["[]", str(len(variants.builtin_modules()))]


class _NotADataclass:
    pass


class _Undecorated(EngramConfig):   # inherits EngramConfig's dataclass fields, declares none of its own
    pass


@dataclasses.dataclass(frozen=True)
class _OtherName(EngramConfig):
    variant: str = "someone-else"


@pytest.mark.parametrize("config_class, needle", [
    (_NotADataclass, "must be None or a subclass of EngramConfig"),
    (_Undecorated, "_Undecorated must be a frozen dataclass"),
    (_OtherName, "_OtherName must declare variant: str = 'plugin-badcfg'"),
])
def test_a_plugin_with_a_broken_config_class_is_refused_and_breaks_nothing(config_class, needle, monkeypatch,
                                                                           tmp_path):
    """Registered, such a variant broke every config read (from_dict, hasattr, a load of a valid
    demo file all walk the config classes): register() refuses it, a warning names its entry
    point, and everything else works."""
    from engram_stream import EngramModel
    cls = _plugin_variant("plugin-badcfg")
    cls.config_class = config_class
    monkeypatch.setattr(variants, "_entry_points", lambda: [_EP("badcfg", "bad.pkg:V", cls)])
    try:
        with pytest.warns(RuntimeWarning, match=r"entry point badcfg = 'bad.pkg:V' failed to load \(TypeError: "
                                                f".*{needle}"):
            variants.discover()
        assert "plugin-badcfg" not in variants.registered()
        cfg = EngramConfig.from_dict({"vocab_size": 64, "hidden_size": 8, "n_embed_per_ngram": 8,
                                      "n_head_per_ngram": 2, "engram_vocab_size": [37, 41], "hc_mult": 1})
        assert not hasattr(cfg, "image_token_id") and not hasattr(cfg, "no_such_name")
        path = EngramModel.init(cfg, seed=0).save(tmp_path / "demo.st")
        assert EngramModel.load(path).cfg == cfg
    finally:
        variants.unregister("plugin-badcfg")


def test_a_plugin_taking_a_built_in_name_is_refused_and_the_built_in_stays(monkeypatch):
    demo = variants.get(variants.DEFAULT)
    monkeypatch.setattr(variants, "_entry_points", lambda: [_EP("usurper", "u.pkg:V", _plugin_variant(demo.name))])
    with pytest.warns(RuntimeWarning, match=r"usurper = 'u.pkg:V' failed to load \(ValueError: a variant named "
                                            r"'demo-v1' is registered already\)"):
        variants.discover()
    assert variants.get(variants.DEFAULT) is demo


@pytest.mark.parametrize("attr, value, needle", [
    ("name", None, r"leaves the Variant hooks \['name'\] None"),
    ("name", "", "name must be a non-empty str"),
    ("name", 7, "name must be a non-empty str, got 7"),
    ("engine", None, r"\['engine'\] None"),
    ("forward", None, r"\['forward'\] None"),
    ("example_config", [1], "example_config must be a dict"),
    ("layer_class", "LayerWeights", "layer_class must be a class"),
])
def test_register_refuses_a_hook_left_unset(attr, value, needle):
    cls = _plugin_variant("plugin-hookless")
    setattr(cls, attr, value)
    try:
        with pytest.raises(TypeError, match=needle):
            variants.register(cls())
        assert "plugin-hookless" not in variants.registered()
    finally:
        variants.unregister("plugin-hookless")


def test_variant_is_abstract_where_a_variant_must_say_something():
    with pytest.raises(TypeError, match="abstract"):
        variants.Variant()

    class Half(variants.Variant):
        name = "half"
        example_config = {}
    with pytest.raises(TypeError, match="forward"):
        Half()
    with pytest.raises(TypeError, match="Variant instance"):
        variants.register(type(variants.get(variants.DEFAULT)))

    class NoLayerRules(type(variants.get(variants.DEFAULT))):   # neither the weights' module nor the hooks
        name = "no-layer-rules"
        weights_rules = None

        def init_layers(self, cfg, plan, seed, graft_zero_init):
            return {}
    with pytest.raises(TypeError, match=r"no weights_rules module: it must define \['validate_layer', "
                                        r"'from_state_dict'\]"):
        variants.register(NoLayerRules())
    assert "no-layer-rules" not in variants.registered()


def test_a_name_is_registered_once():
    demo = variants.get(variants.DEFAULT)
    assert variants.register(demo) is demo   # the same object again: nothing changes
    with pytest.raises(ValueError, match="registered already"):
        variants.register(type(demo)())


def test_the_defaults_are_the_demo_hash():
    demo = variants.get(variants.DEFAULT)
    for name in ("draw_multipliers", "table_rows", "dead_id", "dead_mask", "windows", "window_class",
                 "reads_hf_config", "to_hf_config"):
        assert getattr(type(demo), name) is getattr(variants.Variant, name), name
    cfg = EngramConfig()
    assert demo.dead_id(cfg) is None and not demo.dead_mask(cfg, np.arange(6).reshape(2, 3)).any()
    assert demo.table_rows(cfg, 1234) == 1234 and not demo.reads_hf_config({"model_type": "x"})
    assert demo.window_class is HashWindow and HashPlan(cfg).history == "plain"


# ---- config classes ---------------------------------------------------------------------------------
def _config_variants():
    return [v for v in variants.variants() if v.config_class]


def test_each_variant_config_is_its_own_class():
    assert type(EngramConfig()) is EngramConfig and config_class(variants.DEFAULT) is EngramConfig
    assert _config_variants()
    common = {f.name for f in dataclasses.fields(EngramConfig)}
    for v in _config_variants():
        cfg = EngramConfig(**v.example_config)
        assert type(cfg) is v.config_class and isinstance(cfg, EngramConfig)
        assert set(variant_fields(v)) == {f.name for f in dataclasses.fields(cfg)} - common
        for name in variant_fields(v):
            assert not hasattr(EngramConfig(), name)
        # every constructor path keeps the class and the fields
        assert pickle.loads(pickle.dumps(cfg)) == cfg and type(pickle.loads(pickle.dumps(cfg))) is type(cfg)
        assert dataclasses.replace(cfg, seed=cfg.seed) == cfg
        assert EngramConfig.from_dict(cfg.to_dict()) == cfg
        assert type(v.config_class(**v.example_config)) is type(cfg)


def test_no_variant_field_in_engram_config():
    common = {f.name for f in dataclasses.fields(EngramConfig)}
    for v in _config_variants():
        assert not set(variant_fields(v)) & common
    assert not {"norm_eps", "image_token_id", "num_embeddings", "compressed_vocab_size", "table_rows_multiple",
                "table_parts"} & common


@pytest.mark.parametrize("field", ["image_token_id", "num_embeddings", "table_parts", "table_rows_multiple"])
def test_a_field_on_the_wrong_variant_names_the_variants_that_use_it(field):
    users = [v.name for v in variants.variants() if field in variant_fields(v)]
    assert users
    for v in variants.variants():
        if field in variant_fields(v):
            continue
        with pytest.raises(ValueError, match=f"EngramConfig.{field} is a field of "
                                             f"{' and '.join(repr(u) for u in users)} \\(variant is '{v.name}'\\)"):
            EngramConfig(**{**v.example_config, "variant": v.name, field: 3})


def test_norm_eps_names_both_its_variants_and_replace_across_variants():
    users = [v.name for v in variants.variants() if "norm_eps" in variant_fields(v)]
    assert len(users) >= 2
    with pytest.raises(ValueError, match=" and ".join(repr(u) for u in users)):
        EngramConfig(norm_eps=1e-6)
    v41 = next(v for v in _config_variants() if "image_token_id" in variant_fields(v))
    cfg = EngramConfig(**v41.example_config)
    with pytest.raises(ValueError, match="is a field of .*variant is .demo-v1"):
        dataclasses.replace(cfg, variant=variants.DEFAULT)
    with pytest.raises(ValueError, match="unknown fields"):
        EngramConfig.from_dict({"no_such_field": 1})
    with pytest.raises(TypeError):
        EngramConfig(no_such_field=1)
    with pytest.raises(ValueError, match="must be one of"):
        EngramConfig(variant="no-such-variant")


def test_reading_another_variants_field_names_it():
    """hasattr says False; the read itself is a ValueError (and AttributeError) naming the variants."""
    from engram_stream.errors import ConfigFieldError
    cfg = EngramConfig()
    assert not hasattr(cfg, "image_token_id")
    with pytest.raises(ConfigFieldError, match="image_token_id is a field of 'deepseek-v4.1', not of variant 'demo-v1'"):
        cfg.image_token_id
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'") as e:
        cfg.no_such_name
    assert not isinstance(e.value, ValueError)
