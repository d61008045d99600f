"""Command-line options of the test suite (they must live in the top-level conftest), and
the guard that ends a test run which created a NIXL UCX backend in this process, and an
opt-in collection after every test (``KVXFER_TEST_GC_EACH=1``) that makes a corrupted heap
crash in the test that corrupted it instead of in a later one."""

import gc
import os
import sys

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--transport",
        action="store",
        default=None,
        help="comma-separated transports the transport contract suite runs (default: every available one)",
    )


@pytest.fixture(autouse=True)
def _gc_after_each_test():
    yield
    if os.environ.get("KVXFER_TEST_GC_EACH") == "1":
        gc.collect()


def pytest_sessionstart(session):
    session.config._kvxfer_session = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A process that created a UCX backend may crash in its exit handlers on hosts with
    rdma-core's ibverbs providers (``transports.nixl.exit_process``): once pytest has
    written its report, leave with the session's exit status instead of a crash."""
    nixl = sys.modules.get("sglang_kvxfer.transports.nixl")
    session = getattr(config, "_kvxfer_session", None)
    if nixl is not None and nixl.ucx_backend_created() and session is not None:
        nixl.exit_process(int(session.exitstatus))
