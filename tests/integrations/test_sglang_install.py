"""The backend install against SGLang's real code: its CLI parser, its TransferBackend /
KVClassType / get_kv_class definitions (loaded from its own utils.py source), its plugin
loader; and ``kvxfer sglang-serve``."""

from __future__ import annotations

import logging
import subprocess
import sys
import types

import pytest

from sglang_kvxfer.integrations import sglang_install
from tests.facts import needs_sglang_installed
from tests.integrations.sglang_env import import_sglang_base, load_utils_defs

base, _reason = import_sglang_base()
needs_sglang = pytest.mark.skipif(base is None, reason=_reason)


@pytest.fixture
def choices():
    """SGLang's real choices module, restored afterwards."""
    from sglang.srt.arg_groups import choices

    saved = list(choices.DISAGG_TRANSFER_BACKEND_CHOICES)
    yield choices
    choices.DISAGG_TRANSFER_BACKEND_CHOICES[:] = saved


@needs_sglang
def test_sglangs_cli_accepts_kvxfer_only_after_install(choices, capsys):
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "m", "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "kvxfer"]
    handlers = list(logging.root.handlers)
    try:
        with pytest.raises(SystemExit):
            prepare_server_args(argv)
        assert "invalid choice: 'kvxfer'" in capsys.readouterr().err
        sglang_install.install(load_utils_defs(), choices)
        assert prepare_server_args(argv).disaggregation_transfer_backend == "kvxfer"
    finally:  # SGLang configures a root handler on this test's captured stderr
        logging.root.handlers[:] = handlers


@needs_sglang
def test_get_kv_class_resolves_kvxfer_and_leaves_other_backends_alone(choices):
    from sglang_kvxfer.integrations import sglang as ours

    utils = load_utils_defs()
    original = utils.get_kv_class
    member = sglang_install.install(utils, choices)
    backend = utils.TransferBackend("kvxfer")
    assert backend is member and utils.TransferBackend.KVXFER is member and member in list(utils.TransferBackend)
    kinds = utils.KVClassType
    assert utils.get_kv_class(backend, kinds.MANAGER) is ours.KVXferKVManager
    assert utils.get_kv_class(backend, kinds.SENDER) is ours.KVXferKVSender
    assert utils.get_kv_class(backend, kinds.RECEIVER) is ours.KVXferKVReceiver
    assert utils.get_kv_class(backend, kinds.BOOTSTRAP_SERVER) is ours.KVXferKVBootstrapServer
    assert utils.get_kv_class(backend, kinds.KVARGS) is base.KVArgs
    assert utils.get_kv_class(utils.TransferBackend.MOONCAKE, kinds.KVARGS) is base.KVArgs
    with pytest.raises(ValueError, match="Unsupported transfer backend"):  # SGLang's own code path
        utils.get_kv_class(types.SimpleNamespace(), kinds.MANAGER)
    assert utils.get_kv_class.__kvxfer_original__ is original


@needs_sglang
def test_install_is_idempotent_and_rebinds_earlier_imports(choices):
    utils = load_utils_defs()
    original = utils.get_kv_class
    early = types.ModuleType("imported_get_kv_class_before_install")
    early.get_kv_class = original  # as prefill.py's `from ...utils import get_kv_class`
    sys.modules[early.__name__] = early
    try:
        first = sglang_install.install(utils, choices)
        wrapper = utils.get_kv_class
        assert sglang_install.install(utils, choices) is first
        assert utils.get_kv_class is wrapper and early.get_kv_class is wrapper
        assert choices.DISAGG_TRANSFER_BACKEND_CHOICES.count("kvxfer") == 1
        assert len(utils.TransferBackend) == len(utils.TransferBackend._member_names_)
    finally:
        del sys.modules[early.__name__]


@needs_sglang
def test_sglangs_prefill_complete_check_lets_kvxfer_through_as_mooncake_and_keeps_its_other_rules(choices):
    from sglang.srt.arg_groups import pd_disaggregation_hook as hook
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", "m", "--disaggregation-mode", "prefill", "--device", "cpu"]
    argv += ["--disaggregation-decode-allocation-policy", "prefill_complete"]

    def resolve(*extra):  # SGLang's resolution pass over PD flags (run at server launch)
        args = prepare_server_args([*argv, *extra])
        hook.handle_pd_disaggregation(args)
        return resolving_view(args)

    handlers = list(logging.root.handlers)
    check = hook._validate_prefill_complete
    original = getattr(check, "__kvxfer_original__", check)  # (an earlier test may have installed it)
    try:
        sglang_install.install(load_utils_defs(), choices)
        with pytest.raises(ValueError, match="does not yet support transfer backends other than Mooncake"):
            original(prepare_server_args([*argv, "--disaggregation-transfer-backend", "kvxfer"]))  # SGLang's own
        cfg = resolve("--disaggregation-transfer-backend", "kvxfer")
        assert cfg.disaggregation_decode_allocation_policy == "prefill_complete"
        assert cfg.disaggregation_transfer_backend == "kvxfer"
        assert cfg.optimistic_prefill_attempts == 1  # SGLang's resolution for the policy, as for mooncake
        with pytest.raises(ValueError, match="does not yet support attention tensor parallelism greater than one"):
            resolve("--disaggregation-transfer-backend", "kvxfer", "--tp-size", "2")
        with pytest.raises(ValueError, match="does not yet support transfer backends other than Mooncake"):
            resolve("--disaggregation-transfer-backend", "nixl")
    finally:
        logging.root.handlers[:] = handlers


def test_enum_member_name_clash_is_refused():
    import enum

    class Backend(enum.Enum):
        KVXFER = "something-else"

    with pytest.raises(ValueError, match="Backend.KVXFER already exists with value 'something-else', not 'kvxfer'"):
        sglang_install.add_enum_member(Backend, "KVXFER", "kvxfer")


@needs_sglang
def test_sglangs_plugin_loader_finds_our_plugin():
    from sglang.srt.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("sglang.srt.plugins")
    assert "kvxfer" in plugins, f"entry point not installed (pip install -e .): {sorted(plugins)}"
    func, dist = plugins["kvxfer"]
    assert func is sglang_install.plugin and dist == "sglang_kvxfer"


def _server_modules_import() -> bool:
    code = "import sglang.srt.disaggregation.utils"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_sglang_serve_without_arguments_prints_usage():
    out = subprocess.run(
        [sys.executable, "-m", "sglang_kvxfer", "sglang-serve"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.startswith("usage: kvxfer sglang-serve"), out


@needs_sglang_installed
def test_sglang_serve_says_what_is_missing_when_sglangs_server_cannot_import():
    if _server_modules_import():
        pytest.skip("SGLang's server modules import here: sglang-serve would start a real server")
    out = subprocess.run(
        [sys.executable, "-m", "sglang_kvxfer", "sglang-serve", "--model-path", "m"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out
    assert out.stderr.startswith("kvxfer sglang-serve: error: SGLang's server modules do not import here (")
    assert "pip install 'sglang==0.5.23'" in out.stderr


def test_importing_the_package_never_imports_sglang():
    code = (
        "import sys, sglang_kvxfer, sglang_kvxfer.integrations, sglang_kvxfer.integrations.sglang_args, "
        "sglang_kvxfer.integrations.sglang_install, sglang_kvxfer.cli.sglang_serve; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_backend_module_without_sglang_says_what_to_install():
    code = "import sys; sys.modules['sglang'] = None; import sglang_kvxfer.integrations.sglang"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "sglang_kvxfer.errors.TransportUnavailableError: sglang_kvxfer.integrations.sglang "
        "needs SGLang's disaggregation base classes"
    ), last
    assert "pip install 'sglang==0.5.23' (or pip install 'sglang_kvxfer[sglang]')" in last
