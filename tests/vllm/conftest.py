"""Fixtures of the vLLM tests: the vLLM environment and the tiny model.

Without the vLLM environment (``tests/vllm/make_env.sh``) these tests skip, with the reason;
with ``KVXFER_REALSERVER=required`` (``.ci/run`` sets it) that is a failure.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.vllm import harness as h

TINY_MODEL = h.ROOT / "tests" / "realserver" / "tiny_model.py"


@pytest.fixture(scope="session")
def vllm_env() -> Path:
    problem = h.env_problem()
    if problem is not None:
        if os.environ.get("KVXFER_REALSERVER") == "required":
            pytest.fail(f"KVXFER_REALSERVER=required, but {problem}", pytrace=False)
        pytest.skip(problem)
    return h.venv_dir()


@pytest.fixture(scope="session")
def vllm_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


def _build(out: Path, *flags: str) -> Path:  # flags: tiny_model.py's (--deepseek-v3)
    done = subprocess.run(
        [str(h.venv_python()), str(TINY_MODEL), *flags, str(out)], timeout=300, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny model failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return out


@pytest.fixture(scope="session")
def vllm_model(vllm_env, tmp_path_factory) -> Path:
    """The tiny Llama of tests/realserver (4 KV heads: TP 1 and 2), built with the vLLM
    environment's transformers."""
    return _build(tmp_path_factory.mktemp("tiny-llama-vllm") / "model")


@pytest.fixture(scope="session")
def vllm_mla_model(vllm_env, tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 (MLA, a 576-wide latent: the only width vLLM's CPU MLA decodes)."""
    return _build(tmp_path_factory.mktemp("tiny-deepseek-vllm") / "model", "--deepseek-v3")
