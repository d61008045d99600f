"""An engine on CUDA without the native library: logged at ERROR once (with the loader's
reason and the switch), or refused with ``KVXFER_REQUIRE_NATIVE=1`` before any memory is
taken. The CUDA probe is stubbed, so this runs without a GPU."""

from __future__ import annotations

import logging

import pytest

from sglang_kvxfer import _native, ops
from sglang_kvxfer.engine import BootstrapServer, EngineConfig, KVManager
from sglang_kvxfer.errors import KVXferError
from tests.engine.harness import FAST, geometry

PROBE = (
    "libkvxfer_cuda.so cannot use CUDA: cudaGetDeviceCount: CUDA driver version is insufficient "
    "for CUDA runtime version (the driver supports CUDA 12.4, this library's runtime is CUDA 13.0)"
)


@pytest.fixture
def probe_fails(monkeypatch):
    """The CUDA library loads but its probe fails (a driver older than its runtime)."""
    loads = []

    def load(kind):
        loads.append(kind)
        if kind == "cuda":
            raise KVXferError(PROBE)
        return real_load(kind)

    real_load = _native._load
    monkeypatch.setattr(_native, "_loaded", {})
    monkeypatch.setattr(_native, "_load", load)
    monkeypatch.setattr(ops, "_warned_fallback", set())
    monkeypatch.delenv("KVXFER_DISABLE_NATIVE", raising=False)
    monkeypatch.delenv("KVXFER_REQUIRE_NATIVE", raising=False)
    return loads


def test_missing_cuda_library_is_logged_at_error_once_with_its_reason(probe_fails, caplog):
    caplog.set_level(logging.INFO, logger="sglang_kvxfer")
    ops.check_native_backend("cuda:0")
    ops.check_native_backend("cuda:1")
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    text = errors[0].getMessage()
    assert "KV pools on cuda:0 but the native CUDA gather/scatter library is not loaded" in text
    assert "driver supports CUDA 12.4, this library's runtime is CUDA 13.0" in text
    assert "set KVXFER_REQUIRE_NATIVE=1 to refuse to start instead" in text
    assert probe_fails == ["cuda"]  # probed once, the reason kept


def test_require_native_refuses_with_the_reason(probe_fails, monkeypatch):
    monkeypatch.setenv("KVXFER_REQUIRE_NATIVE", "1")
    with pytest.raises(KVXferError) as info:
        ops.check_native_backend("cuda")
    text = str(info.value)
    assert "native CUDA gather/scatter library is not loaded: " + PROBE in text
    assert text.endswith("refusing to start (KVXFER_REQUIRE_NATIVE=1)")


def test_disable_native_is_the_reason_when_both_are_set(monkeypatch):
    monkeypatch.setenv("KVXFER_DISABLE_NATIVE", "1")
    monkeypatch.setenv("KVXFER_REQUIRE_NATIVE", "1")
    with pytest.raises(KVXferError, match=r"not loaded: KVXFER_DISABLE_NATIVE=1\. "):
        ops.check_native_backend("cuda:0")


def test_cpu_pools_and_a_loaded_library_pass_silently(probe_fails, monkeypatch, caplog):
    monkeypatch.setenv("KVXFER_REQUIRE_NATIVE", "1")
    ops.check_native_backend("cpu")
    assert probe_fails == []  # a CPU engine does not even probe CUDA
    monkeypatch.setattr(_native, "_loaded", {"cuda": _native.Library("cuda", _native._PACKAGE_DIR, None)})  # type: ignore[arg-type]
    ops.check_native_backend("cuda:0")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_cuda_engine_refuses_to_start_before_it_takes_memory(probe_fails, monkeypatch):
    monkeypatch.setenv("KVXFER_REQUIRE_NATIVE", "1")
    with BootstrapServer() as boot:
        cfg = EngineConfig("prefill", geometry(), 1, 0, boot.address, "local", device="cuda:0", **FAST)
        with pytest.raises(KVXferError, match=r"KV pools on cuda:0 .*cudaGetDeviceCount.*KVXFER_REQUIRE_NATIVE=1"):
            KVManager(cfg)
