"""The serving plugins' settings (integrations.serving.parse_settings, vLLM's and SGLang's): every bad
value is a ValueError naming where it came from, the setting, the value and what it may be.
Needs neither vLLM nor SGLang."""
from __future__ import annotations

import pytest

from engram_stream.integrations.serving import parse_settings
from engram_stream.integrations.vllm import ENV


@pytest.mark.parametrize("text, shown", [('{"row_cache_mb": Infinity}', "inf"), ('{"row_cache_mb": 1e400}', "inf"),
                                         ('{"row_cache_mb": NaN}', "nan"), ('{"row_cache_mb": -Infinity}', "-inf"),
                                         ('{"row_cache_mb": 1e300}', "1e+300"),
                                         ('{"row_cache_mb": 1' + "0" * 400 + '}', "1" + "0" * 39 + "... (401 characters)"),
                                         ('{"row_cache_mb": "64"}', "'64'"), ('{"row_cache_mb": true}', "True")])
def test_row_cache_mb_out_of_range_names_the_variable_value_and_range(text, shown):
    with pytest.raises(ValueError) as e:
        parse_settings(text, ENV)
    msg = str(e.value)
    assert msg.startswith(f'{ENV}: "row_cache_mb" must be a finite number of MiB from 0 (no row cache) to 2**43')
    assert f"got {shown}" in msg and len(msg) < 400


def test_good_row_cache_mb_passes_as_a_float():
    assert parse_settings('{"row_cache_mb": 64}', ENV)["row_cache_mb"] == 64.0
    assert parse_settings({"row_cache_mb": 0.5}, "additional_config")["row_cache_mb"] == 0.5
    assert parse_settings("{}", ENV)["row_cache_mb"] == 0.0


@pytest.mark.parametrize("value, match", [
    ('{"checkpoint": ["/x"]}', r'"checkpoint" must be the path of a V4\.1 checkpoint folder \(a string\), got \[\'/x\'\]'),
    ('{"checkpoint": 7}', r'"checkpoint" must be .* got 7'),
    ('{"checkpoint": "/nonexistent"}', "got '/nonexistent': it is not a folder"),
    ('{"checkpoint": "a\\u0000b"}', r'"checkpoint" must be'),
    ('{"tables": ["direct"]}', r'"tables" must be "mapped", "direct" or \{"gguf": .*got \[\'direct\'\]'),
    ('{"mooncake": {"master": 1, "metadata": "http://x"}}', r'"mooncake" must be .* non-empty string'),
    ('{"mooncake": {"master": "h:1", "metadata": "http://x", "port": 3}}', r'"mooncake" must be'),
    ('{"host_cache": ["vllm"], "row_cache_mb": 64}', r'"host_cache" must be a name'),
])
def test_values_of_the_wrong_type_are_value_errors(value, match):
    with pytest.raises(ValueError, match=f"^{ENV}: .*{match}"):
        parse_settings(value, ENV)


@pytest.mark.parametrize("depth", [10 ** 5, 10 ** 6])
def test_deeply_nested_json_is_a_value_error_naming_the_source(depth):
    for text in ("[" * depth, '{"checkpoint": ' + "[" * depth + "]" * depth + "}"):
        with pytest.raises(ValueError, match=f"^{ENV}: JSON nested too deeply to parse"):
            parse_settings(text, ENV)


def test_a_deeply_nested_object_passed_as_a_dict_is_shown_briefly():
    deep = []
    for _ in range(10 ** 5):
        deep = [deep]
    with pytest.raises(ValueError, match=r'"checkpoint" must be .* got an object nested too deeply to show'):
        parse_settings({"checkpoint": deep}, "additional_config")


def test_sglangs_install_names_its_own_variable(monkeypatch):
    from engram_stream.integrations import sglang
    monkeypatch.setenv(sglang.ENV, '{"row_cache_mb": 1e400}')
    with pytest.raises(ValueError, match=f'^{sglang.ENV}: "row_cache_mb" must be a finite number .* got inf'):
        sglang.install()
    monkeypatch.setenv(sglang.ENV, "[" * 10 ** 5)
    with pytest.raises(ValueError, match=f"^{sglang.ENV}: JSON nested too deeply"):
        sglang.install()
    with pytest.raises(ValueError, match=r'^install\(\): "checkpoint" must be .* got \[\'/x\'\]'):
        sglang.install({"checkpoint": ["/x"]})


def test_the_serving_integrations_share_one_module_not_each_other():
    """SGLang's integration takes its settings, models and record conversion from
    integrations.serving and integrations._records: importing it imports no vLLM module (ours
    or vLLM's)."""
    import subprocess
    import sys
    code = ("import sys, engram_stream.integrations.sglang; "
            "print(sorted(m for m in sys.modules if m.startswith(('vllm', 'engram_stream.integrations.vllm'))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd="/")   # outside the checkout: conftest's PYTHONPATH names the engram_stream under test
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]"


def test_a_framework_of_another_version_is_refused_naming_both():
    import types
    from engram_stream.integrations.serving import check_version
    check_version("vLLM", types.SimpleNamespace(__version__="0.33.0"), "0.33.0")
    check_version("vLLM", types.SimpleNamespace(__version__="0.33.0+cu130"), "0.33.0")   # a local build tag
    for v in ("0.33.1", "0.33.0rc1", "0.330.0", None):
        with pytest.raises(RuntimeError, match=f"serves vLLM 0\\.33\\.0 .* this is vLLM {v}: install vllm==0\\.33\\.0"):
            check_version("vLLM", types.SimpleNamespace(__version__=v), "0.33.0")


@pytest.mark.parametrize("mb", [1e-9, 0.0005, 0.2, 0.999])
def test_a_host_cache_budget_too_small_for_one_row_is_refused_at_parse(mb):
    """host_cache with a row_cache_mb under the floor (HOST_CACHE_MIN_MB) is refused when the
    settings are read, naming the setting, not at the model's build; the floor itself is taken."""
    from engram_stream.integrations.serving import HOST_CACHE_MIN_MB
    with pytest.raises(ValueError, match=f'^{ENV}: "row_cache_mb" of a "host_cache" must be at least '
                                         f'{HOST_CACHE_MIN_MB} \\(MiB\\), got {mb:g}'):
        parse_settings(f'{{"host_cache": "vllm", "row_cache_mb": {mb}}}', ENV)
    assert parse_settings(f'{{"row_cache_mb": {mb}}}', ENV)["row_cache_mb"] == mb   # a process's own cache: any
    s = parse_settings(f'{{"host_cache": "vllm", "row_cache_mb": {HOST_CACHE_MIN_MB}}}', ENV)
    assert (s["host_cache"], s["row_cache_mb"]) == ("vllm", HOST_CACHE_MIN_MB)
