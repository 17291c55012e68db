"""config.yaml validation: the operators' file works; every error names key, value and what is allowed."""

from __future__ import annotations

import pytest

from blockspec.common.config import load_config, parse_config
from blockspec.common.errors import InvalidArgument
from tests.helpers import SEED


def test_the_operators_config_loads_with_our_defaults(tmp_path):
    f = tmp_path / "config.yaml"
    f.write_text(SEED)
    cfg = load_config(f)
    assert cfg.server.port == 8000 and cfg.server.grpc_port == 8001 and cfg.server.replicas == 1
    assert cfg.model.spec_decode.num_speculative_tokens == 5 and cfg.model.spec_decode.draft_model_dtype == "float16"
    assert cfg.model.draft_model_path == "/data/models/draft_model"
    assert cfg.model.spec_decode.prompt_lookup is False and cfg.model.spec_decode.adaptive_k is False


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"server": {"port": 70000}}, "server.port: 70000 is not allowed: Input should be less than or equal to 65535"),
        ({"server": {"prot": 1}}, "server.prot: unknown key"),
        ({"server": {"grpc_port": 8000}}, "server.grpc_port: 8000 is not allowed: must differ from the HTTP port (8000)"),
        ({"server": {"port": 8001}}, "server.grpc_port: 8001 is not allowed: must differ from the HTTP port (8001)"),
        ({"model": {"tensor_parallel_size": 9}}, "model.tensor_parallel_size: 9 is not allowed: Input should be less than or equal to 8"),
        ({"model": {"tensor_parallel_size": 2, "device": "cuda:1"}}, "with tensor_parallel_size 2: the ranks take cuda:0 to cuda:N-1"),
        ({"model": {"version": "a b"}}, "model.version: 'a b' is not allowed: String should match pattern"),
        ({"model": {"gpu_memory_utilization": 1.5}}, "model.gpu_memory_utilization: 1.5 is not allowed"),
        ({"model": {"spec_decode": {"num_speculative_tokens": 0}}}, "model.spec_decode.num_speculative_tokens: 0 is not allowed: Input should be greater than or equal to 1"),
        ({"model": {"spec_decode": {"num_speculative_tokens": "5"}}}, "model.spec_decode.num_speculative_tokens: '5' is not allowed: Input should be a valid integer"),
        ({"model": {"spec_decode": {"draft_model_dtype": "int4"}}}, "model.spec_decode.draft_model_dtype: 'int4' is not allowed: Input should be 'float32', 'float16' or 'bfloat16'"),
        ({"model": {"target_model_path": None}}, "model.target_model_path: None is not allowed"),
        ({"model": {"device": "gpu0"}}, "model.device: 'gpu0' is not allowed: 'gpu0' is not a device; use cpu, cuda or cuda:N"),
        ({"model": {"dtype": "int8"}}, "model.dtype: 'int8' is not allowed: Input should be 'float32', 'bfloat16' or 'float16'"),
        ({"model": {"spec_decode": {"prompt_lookup": "yes"}}}, "model.spec_decode.prompt_lookup: 'yes' is not allowed: Input should be a valid boolean"),
    ],
)
def test_errors_name_key_value_and_allowed(patch, message):
    import yaml

    raw = yaml.safe_load(SEED)
    for section, values in patch.items():
        for key, value in values.items():
            if isinstance(value, dict):
                raw[section][key].update(value)
            else:
                raw[section][key] = value
    with pytest.raises(InvalidArgument) as e:
        parse_config(raw)
    assert message in str(e.value)


def test_missing_file_bad_yaml_and_missing_required_key(tmp_path):
    with pytest.raises(InvalidArgument, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(InvalidArgument, match="is a directory: give the config file"):
        load_config(tmp_path)
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing but a comment\n")
    with pytest.raises(InvalidArgument, match="empty: expected a mapping at the top level"):
        load_config(empty)
    bad = tmp_path / "bad.yaml"
    bad.write_text("server: [1, 2\n")
    with pytest.raises(InvalidArgument, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(InvalidArgument, match="model: required key is missing"):
        parse_config({"server": {"port": 8000}})


@pytest.mark.parametrize(("content", "message"), [
    (b"server:\n  port: 8000\n  port: 9000\nmodel:\n  target_model_path: /m\n",
     "not valid YAML: key 'port' appears twice in one mapping (line 3, column 3)"),
    (b"model:\n  target_model_path: /a\nmodel:\n  target_model_path: /b\n", "key 'model' appears twice"),
    (b"model:\n  target_model_path: \"\xff\xfe\"\n", "not UTF-8 text (byte 29)"),
    (b"model: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nested too deeply"),
    (b"server: [1, 2\n", "not valid YAML: expected ',' or ']', but got '<stream end>' (line 2, column 1)"),
    (b"? [a, b]\n: 1\n", "not valid YAML: found unhashable key (line 1, column 3)"),
    (b"server: {<<: {port: 1, port: 2}}\n", "key 'port' appears twice"),  # inside a merge source
    (b"a: &a {port: 1}\nb: &b {host: h}\nserver:\n  <<: *a\n  <<: *b\n", "key << appears twice"),  # one dropped
])
def test_a_config_file_that_cannot_be_read_as_yaml_is_one_line_naming_the_file(tmp_path, content, message):
    """Before: a repeated key kept its last value silently; bytes that are not UTF-8 or deep nesting a traceback."""
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument) as e:
        load_config(path)
    assert str(e.value).startswith(str(path)) and message in str(e.value) and "\n" not in str(e.value)


def test_a_merge_key_may_be_overridden_without_counting_as_twice(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("server:\n  <<: {port: 9000, host: 0.0.0.0}\n  port: 8000\nmodel:\n  target_model_path: /m\n")
    cfg = load_config(path)
    assert (cfg.server.port, cfg.server.host) == (8000, "0.0.0.0")
    # an anchored mapping with a merge, aliased again after PyYAML flattened it in place: no false duplicate
    path.write_text("model:\n  target_model_path: /m\n  spec_decode: &s {<<: {num_speculative_tokens: 3}, "
                    "num_speculative_tokens: 4}\nx: *s\n")
    with pytest.raises(InvalidArgument, match="x: unknown key"):  # parsed: only the config's own check refuses it
        load_config(path)


def test_a_value_built_of_yaml_aliases_is_named_in_one_short_line(tmp_path):
    """A 500-byte file of nested aliases is a value of 10^8 strings: its error once took minutes and a 72 MB line."""
    path = tmp_path / "config.yaml"
    levels = [f'  l{i}: &l{i} [{", ".join([f"*l{i - 1}"] * 10)}]' for i in range(1, 9)]
    path.write_text("anchors:\n  l0: &l0 [" + ", ".join(['"lol"'] * 10) + "]\n" + "\n".join(levels)
                    + "\nmodel:\n  target_model_path: *l8\n")
    with pytest.raises(InvalidArgument) as e:
        load_config(path)
    assert "model.target_model_path: [[[...], " in str(e.value) and len(str(e.value)) < 1000
