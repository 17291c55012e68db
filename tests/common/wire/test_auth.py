"""API keys: the key file's format and its errors, the lookup, and the config naming the key at fault."""

from __future__ import annotations

import pytest

from blockspec.common.config import parse_config
from blockspec.common.errors import InvalidArgument
from blockspec.common.wire.auth import ApiKeys

KEY_A, KEY_B = "a" * 16 + "-team-a-secret", "b" * 20


def test_keys_load_with_their_tenants_and_are_found_only_as_bearer_values(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# tenant key\nteam-a {KEY_A}\n\n{KEY_B}   # a key alone: tenant 'default'\n")
    keys = ApiKeys.load(path)
    assert len(keys) == 2
    assert keys.tenant(f"Bearer {KEY_A}") == "team-a" and keys.tenant(f"bearer  {KEY_B}") == "default"
    for wrong in (None, "", KEY_A, f"Basic {KEY_A}", f"Bearer {KEY_A}x", f"Bearer {KEY_A[:-1]}", "Bearer "):
        assert keys.tenant(wrong) is None, wrong


@pytest.mark.parametrize(("text", "message"), [
    ("", "holds no key"),
    ("# only a comment\n", "holds no key"),
    ("short-key\n", ":1: a key must have at least 16 characters"),
    (f"t {KEY_A} extra\n", ":1: expected KEY or TENANT KEY, got 3 fields"),
    (f"{KEY_A}\nother {KEY_A}\n", ":2: the key is listed twice"),
])
def test_a_bad_key_file_is_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        ApiKeys.load(path)


def test_the_config_names_server_api_keys_file(tmp_path):
    def config(keys_file) -> object:
        return parse_config({"server": {"api_keys_file": str(keys_file)}, "model": {"target_model_path": "/models/t"}})

    path = tmp_path / "keys"
    path.write_text(f"{KEY_A}\n")
    assert config(path).server.api_keys_file == str(path)
    with pytest.raises(InvalidArgument, match="server.api_keys_file.*cannot read .*missing"):
        config(tmp_path / "missing")
    path.write_text("short\n")
    with pytest.raises(InvalidArgument, match="server.api_keys_file.*at least 16 characters"):
        config(path)
