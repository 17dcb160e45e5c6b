"""What the serving integrations share beyond their settings (integrations/serving.py): a
framework's module patched as it is imported, and its embedding method objects re-classed."""
import sys

from engram_stream.integrations import serving


def test_a_module_is_patched_when_imported_and_once_a_patches_dict(tmp_path, monkeypatch):
    (tmp_path / "es_fake_framework.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    patches = {"es_fake_framework": lambda m: seen.append(m.VALUE)}
    try:
        serving.install_patches(patches)
        serving.install_patches(patches)   # a second register(): still one finder
        assert sum(getattr(f, "patches", None) is patches for f in sys.meta_path) == 1
        assert seen == []                  # not imported by the plugin itself
        import es_fake_framework
        assert seen == [1] and es_fake_framework.VALUE == 1
        serving.install_patches(patches)   # already imported: patched there and then
        assert seen == [1, 1]
    finally:
        serving.remove_patches(patches)
        sys.modules.pop("es_fake_framework", None)
    assert not any(getattr(f, "patches", None) is patches for f in sys.meta_path)
    import es_fake_framework  # noqa: F401,F811  (imported again, not patched)
    sys.modules.pop("es_fake_framework", None)
    assert seen == [1, 1]


def test_stream_method_reclasses_once_a_base_and_keeps_the_rest():
    class Method:
        def embedding(self, layer, input_):
            return "framework"

        def dequantize(self):
            return "framework's"

    class Layer:
        def stream_rows(self, input_):
            return ("ours", input_)

    classes = {}
    a = serving.stream_method(Method(), classes, extra=lambda self: "extra")
    b = serving.stream_method(Method(), classes)
    assert type(a) is type(b) and type(a).__name__ == "StreamMethod" and list(classes) == [Method]
    assert a.embedding(Layer(), 3) == ("ours", 3) and a.dequantize() == "framework's" and a.extra() == "extra"
    assert isinstance(a, Method)
