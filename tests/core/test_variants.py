"""The variant registry: one registration path (the package scan for the built-in variants, the
entry points for third-party ones), the abstract Variant, and each variant's config class (its
own fields, refused on another variant)."""
import dataclasses
import pickle
import sys
import types

import numpy as np
import pytest

from engram_stream import EngramConfig, HashPlan, variants
from engram_stream.config import config_class, variant_fields
from engram_stream.engine._window import HashWindow


def test_the_built_in_variants_are_found_by_the_package_scan():
    mods = variants.builtin_modules()
    assert mods == sorted(mods) and len(mods) >= 3
    for mod in mods:
        assert mod.endswith(".variant")
        v = sys.modules[mod].VARIANT   # imported by discover(), registered by importing it
        assert variants.get(v.name) is v
    assert {sys.modules[m].VARIANT.name for m in mods} == set(variants.registered())


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


def test_a_variant_folder_that_registers_nothing_is_an_error(tmp_path, monkeypatch):
    """A folder's variant.py that forgets to register would drop its variant silently."""
    pkg = tmp_path / "scanpkg2"
    (pkg / "quiet").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "quiet" / "__init__.py").write_text("")
    (pkg / "quiet" / "variant.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(RuntimeError, match="scanpkg2.quiet.variant registers no Variant"):
            variants.discover("scanpkg2")
    finally:
        for m in [m for m in sys.modules if m.startswith("scanpkg2")]:
            del sys.modules[m]


class _EP:
    """An entry point as importlib.metadata gives one (name, value, load)."""

    def __init__(self, name, value, obj):
        self.name, self.value, self._obj = name, value, obj

    def load(self):
        if isinstance(self._obj, Exception):
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
