"""STAND-INS for SGLang on a CPU without its kernel package: test tree only, never shipped.

SGLang 0.5.23 imports ``sgl_kernel`` (CUDA and AMX ops) and ``torchvision`` (multimodal
configs) at module level even when it serves a text model on a CPU without AMX, and no
package registry has a CPU build of either. This module, found first on ``PYTHONPATH``,
serves both names (and any submodule) with stand-in modules whose attributes are
placeholders: importing and naming them works; *calling* one, or using it as a value,
appends a line to ``$KVXFER_STANDIN_LOG`` and raises ``RuntimeError``. The real-server
tests fail when that log is not empty, so a code path that needs a real kernel can never
pass silently. A module that is really installed is used instead of its stand-in.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types

STANDIN_ROOTS = ("sgl_kernel", "torchvision")


def _record(what: str) -> None:
    line = f"pid {os.getpid()}: stand-in used: {what}\n"
    path = os.environ.get("KVXFER_STANDIN_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line)
    sys.stderr.write("KVXFER " + line)


class Placeholder:
    """A name SGLang imports from a missing package; using it is recorded and raises."""

    def __init__(self, name: str):
        self.__name__ = self.__qualname__ = name.rsplit(".", 1)[-1]
        self._kvxfer_name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self._kvxfer_name}.{attr}")

    def __call__(self, *args, **kwargs):
        _record(f"{self._kvxfer_name}() called")
        raise RuntimeError(f"stand-in {self._kvxfer_name} called: this path needs the real package")

    def __bool__(self):
        _record(f"{self._kvxfer_name} used as a value")
        raise RuntimeError(f"stand-in {self._kvxfer_name} used as a value")

    def __repr__(self) -> str:
        return f"<kvxfer stand-in {self._kvxfer_name}>"


class StandinModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        root = fullname.split(".", 1)[0]
        if root not in STANDIN_ROOTS:
            return None
        if fullname == root:
            sys.meta_path.remove(self)
            try:
                real = importlib.util.find_spec(root)
            finally:
                sys.meta_path.insert(0, self)
            if real is not None:
                return None
        elif not isinstance(sys.modules.get(root), StandinModule):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = StandinModule(spec.name)
        module.__path__ = []
        module.__doc__ = "kvxfer test stand-in (see tests/realserver/standins/sitecustomize.py)"
        return module

    def exec_module(self, module):
        if module.__name__ == "torchvision":
            module.__version__ = "0.0.0+kvxfer-standin"


sys.meta_path.insert(0, _Finder())


# -- the negative control's hook (test tree only) --------------------------------------------
# With KVXFER_TEST_CORRUPT_FILE set, a decode server's kvxfer receiver reads that file each
# time a request's KV has arrived; when it holds "W/P" (a prefill TP rank W of P ranks), the
# KV heads that writer delivered are zeroed in the decode's pool before SGLang decodes, as if
# that writer had sent zeros. Each zeroing appends a line to the file + ".log".
# "landed W/P" zeroes them earlier: once every writer reported done, before the receiver checks
# the KV checksums (--disaggregation-enable-kv-checksum), through its after_kv_landed hook.
# "stage S" zeroes every head of the layers prefill PP stage S delivered (a decode of PP 1).
# "swa" zeroes every row the request's SWA state (KVArgs.state_types 'swa') landed in, in the
# decode's sliding-window pool.
CORRUPT_ENV = "KVXFER_TEST_CORRUPT_FILE"
LANDED = "landed "
STAGE = "stage "
SWA = "swa"


def _zero_swa(receiver) -> str:
    mgr = receiver.kv_mgr
    for pool, engine in mgr.state_engines:
        if pool.kind != "swa":
            continue
        pages = [int(p) for p in receiver._kvxfer_state[pool.index]]
        ps = pool.geometry.page_size
        for buf in engine.pool.buffers:
            for p in pages:
                buf[p * ps : (p + 1) * ps] = 0
        return f"decode rank {mgr.layout.tp_rank}: zeroed the SWA state of {len(pages)} pages"
    return f"decode rank {mgr.layout.tp_rank}: no SWA state pool"


def _zero_stage(receiver, stage: int) -> str:
    mgr = receiver.kv_mgr
    layers = mgr.prefill_info_table[receiver.bootstrap_addr].pp_layers[stage]
    g = mgr.layout.geometry
    index = list(layers) + ([] if g.mla else [g.num_layers + i for i in layers])
    pool = mgr.engine.pool
    for i in index:
        for p in receiver._kvxfer_pages:
            pool.buffers[i][int(p) * g.page_size : (int(p) + 1) * g.page_size] = 0
    return (
        f"decode rank {mgr.layout.tp_rank}: zeroed layers {layers.start}..{layers.stop - 1} (PP stage {stage}) "
        f"of {len(receiver._kvxfer_pages)} pages"
    )


def _zero_writer(receiver, spec: str) -> str:
    writer, prefill_tp = (int(x) for x in spec.split("/"))
    mgr = receiver.kv_mgr
    lay = mgr.layout
    heads = lay.geometry.total_kv_heads
    # the prefill writer's heads, then the part of them this decode rank holds
    w_lo, w_hi = writer * heads // prefill_tp, (writer + 1) * heads // prefill_tp
    d_lo, d_hi = lay.tp_rank * heads // lay.tp_size, (lay.tp_rank + 1) * heads // lay.tp_size
    lo, hi = max(w_lo, d_lo), min(w_hi, d_hi)
    if lo >= hi:
        return f"decode rank {lay.tp_rank}: no heads from writer {writer}/{prefill_tp}"
    page = lay.geometry.page_size
    pool = mgr.engine.pool
    for buf in pool.buffers:
        for p in receiver._kvxfer_pages:
            buf[int(p) * page : (int(p) + 1) * page, lo - d_lo : hi - d_lo] = 0
    return f"decode rank {lay.tp_rank}: zeroed heads {lo}..{hi - 1} of {len(receiver._kvxfer_pages)} pages"


def _corrupt_spec() -> str:
    try:
        return open(os.environ[CORRUPT_ENV]).read().strip()
    except FileNotFoundError:
        return ""


def _zero_and_log(receiver, spec: str) -> None:
    if spec == SWA:
        what = _zero_swa(receiver)
    elif spec.startswith(STAGE):
        what = _zero_stage(receiver, int(spec[len(STAGE) :]))
    else:
        what = _zero_writer(receiver, spec)
    with open(os.environ[CORRUPT_ENV] + ".log", "a") as f:
        f.write(f"room {receiver.bootstrap_room}: {what}\n")


def _patch_receiver(module) -> None:
    cls = module.KVXferKVReceiver
    send_metadata, poll = cls.send_metadata, cls.poll

    def patched_send_metadata(self, kv_indices, *args, **kwargs):
        self._kvxfer_pages = list(kv_indices)
        self._kvxfer_state = args[1] if len(args) > 1 else kwargs.get("state_indices")
        return send_metadata(self, kv_indices, *args, **kwargs)

    def patched_poll(self):
        state = poll(self)
        if state == 4 and not getattr(self, "_kvxfer_corrupted", False):  # KVPoll.Success
            self._kvxfer_corrupted = True
            spec = _corrupt_spec()
            if spec and not spec.startswith(LANDED):
                _zero_and_log(self, spec)
        return state

    def landed(receiver) -> None:
        spec = _corrupt_spec()
        if spec.startswith(LANDED):
            _zero_and_log(receiver, spec[len(LANDED) :])

    cls.send_metadata, cls.poll = patched_send_metadata, patched_poll
    module.after_kv_landed = landed


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    TARGET = "sglang_kvxfer.integrations.sglang"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch_receiver(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


if os.environ.get(CORRUPT_ENV):
    sys.meta_path.insert(0, _PatchAfterImport())
