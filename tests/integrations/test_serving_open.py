"""integrations/serving.open_model: every framework integration opens its checkpoint folder
through EngramModel.load (the registry finds the folder's variant), and an integration that
serves one variant refuses a folder of another, naming both."""
import pytest

from engram_stream.integrations import serving

from helpers.models import make_qwen_model, make_v41_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("serving-open")
    out = {"deepseek-v4.1": str(d / "v41"), "qwen3.8-flash-next": str(d / "qwen")}
    make_v41_model(seed=3).save(out["deepseek-v4.1"])
    make_qwen_model(seed=4).save(out["qwen3.8-flash-next"])
    return out


def test_any_variants_folder_opens_through_load_and_is_shared(folders, monkeypatch):
    monkeypatch.setattr(serving, "_models", {})
    for variant, folder in folders.items():
        s = serving.parse_settings({"checkpoint": folder}, "ENV")
        m = serving.open_model(s, None, "ENV")
        assert m.cfg.variant == variant and m.source == folder
        assert serving.open_model(s, None, "ENV", variant=variant) is m   # one model per settings
        s2 = serving.parse_settings({}, "ENV")
        assert serving.open_model(s2, folder, "ENV", variant=variant) is m   # the framework's folder


def test_a_folder_of_another_variant_is_refused_naming_both(folders, monkeypatch):
    monkeypatch.setattr(serving, "_models", {})
    s = serving.parse_settings({"checkpoint": folders["qwen3.8-flash-next"]}, "ENGRAM_STREAM_VLLM")
    with pytest.raises(ValueError, match=r"ENGRAM_STREAM_VLLM: \"checkpoint\" .*qwen.* is a qwen3\.8-flash-next "
                                         r"checkpoint; this integration serves deepseek-v4\.1"):
        serving.open_model(s, None, "ENGRAM_STREAM_VLLM", variant="deepseek-v4.1")
