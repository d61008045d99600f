"""Where the key comes from: environment, key file, the per-user file, the loopback rule."""

from __future__ import annotations

import os
import stat

import pytest

from sglang_kvxfer import auth
from sglang_kvxfer.engine.config import EngineConfig
from sglang_kvxfer.errors import AuthenticationError
from tests.engine.harness import geometry


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ("KVXFER_AUTH", "KVXFER_AUTH_KEY", "KVXFER_AUTH_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    return tmp_path


def test_the_per_user_key_file_is_created_once_with_mode_0600(clean_env):
    path = auth.default_key_file()
    assert not path.exists()
    key = auth.resolve_key("127.0.0.1")
    assert len(key) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert auth.resolve_key("localhost") == key  # the same file, the same key


def test_a_readable_key_file_is_refused_with_the_fix(clean_env):
    auth.resolve_key()
    path = auth.default_key_file()
    os.chmod(path, 0o644)
    with pytest.raises(AuthenticationError, match=f"mode 644.*chmod 600 {path}"):
        auth.resolve_key()


def test_a_non_loopback_bind_without_an_explicit_key_refuses_to_start(clean_env):
    with pytest.raises(AuthenticationError, match="10.1.2.3 .not loopback. needs an explicit key: set KVXFER_AUTH_KEY"):
        auth.resolve_key("10.1.2.3")
    with pytest.raises(AuthenticationError, match="KVXFER_AUTH=off"):
        EngineConfig("prefill", geometry(), 1, 0, "127.0.0.1:1", host="10.1.2.3")


def test_an_explicit_key_works_anywhere_and_must_be_long_enough(clean_env, monkeypatch):
    monkeypatch.setenv("KVXFER_AUTH_KEY", "a-long-enough-shared-secret")
    key = auth.resolve_key("10.1.2.3")
    assert key == auth.key_from_secret("a-long-enough-shared-secret")
    monkeypatch.setenv("KVXFER_AUTH_KEY", "short")
    with pytest.raises(AuthenticationError, match="5 characters; use at least 16"):
        auth.resolve_key()


def test_a_key_file_is_read_and_checked(clean_env, monkeypatch):
    path = clean_env / "k"
    path.write_text("0123456789abcdef0123\n")
    os.chmod(path, 0o600)
    monkeypatch.setenv("KVXFER_AUTH_KEY_FILE", str(path))
    assert auth.resolve_key("10.0.0.1") == auth.key_from_secret("0123456789abcdef0123")
    monkeypatch.setenv("KVXFER_AUTH_KEY_FILE", str(clean_env / "missing"))
    with pytest.raises(AuthenticationError, match="cannot read key file"):
        auth.resolve_key()


def test_auth_off_is_logged_and_gives_the_empty_key(clean_env, monkeypatch, caplog):
    monkeypatch.setenv("KVXFER_AUTH", "off")
    monkeypatch.setattr(auth, "_warned_off", False)
    with caplog.at_level("WARNING", logger="sglang_kvxfer.auth"):
        assert auth.resolve_key("10.1.2.3") == auth.OFF
    assert "KVXFER_AUTH=off" in caplog.text


def test_engine_config_takes_a_key_but_never_prints_it(clean_env):
    cfg = EngineConfig("prefill", geometry(), 1, 0, "127.0.0.1:1", auth_key="x" * 20)
    assert cfg.auth_key == auth.key_from_secret("x" * 20)
    assert "auth_key" not in repr(cfg)
    assert EngineConfig("prefill", geometry(), 1, 0, "127.0.0.1:1", auth_key="off").auth_key == b""


def test_a_launcher_on_a_non_loopback_address_without_a_key_exits_2_with_one_line(clean_env):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVXFER_AUTH")}
    # Refused before any socket is opened: nothing is sent to that address.
    out = subprocess.run(
        [sys.executable, "-m", "sglang_kvxfer", "prefill", "--host", "10.255.255.1", "--port", "30999"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "10.255.255.1 (not loopback) needs an explicit key" in lines[0] and "KVXFER_AUTH=off" in lines[0]
