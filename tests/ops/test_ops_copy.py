"""``copy_kv_heads``: pool -> pool in one pass (no staging). Every layout pair (NHD, HND,
HND_KV, NHD_KV), different page sizes, TP head slices (2 -> 1 and 1 -> 2), per-side token
offsets, dtypes and thread counts, byte-exact on whole pools against the torch reference
gather into a staging buffer followed by the torch reference scatter of it; the CUDA
kernel's decomposition through its host emulator (no GPU here; on a GPU machine the last
test runs the kernel itself); and every rejection, before a byte moves."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sglang_kvxfer import _native, ops
from sglang_kvxfer.geometry import KVGeometry
from sglang_kvxfer.planning import plan_pair, plan_tp
from tests.facts import needs_cuda
from tests.ops.ops_cases import clone_all, random_pool, require_native_cpu, same_bytes

LAYOUTS = ["NHD", "HND", "HND_KV", "NHD_KV"]


@pytest.fixture(scope="module")
def native_cpu():
    return require_native_cpu()


def make_pool(layout, pages, page_size, heads, k_dim, v_dim, dtype, layers, gen, device="cpu"):
    """(k_buffers, v_buffers) of random bits; HND_KV and NHD_KV: (one tensor per layer, None)."""
    if layout == "NHD_KV":
        itemsize = torch.empty(0, dtype=dtype).element_size()
        shape = (pages, page_size, heads, (k_dim + v_dim) * itemsize)
        k = [torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype) for _ in range(layers)]
        return [t.to(device) for t in k], None
    k = random_pool(layout, pages, page_size, heads, k_dim, dtype, layers, gen, device)
    if layout == "HND_KV" or v_dim == 0:
        return k, None
    return k, random_pool(layout, pages, page_size, heads, v_dim, dtype, layers, gen, device)


def side_kw(prefix, page_size, head_start, layout, token_offset, k_dim=None):
    kw = {
        f"{prefix}_page_size": page_size,
        f"{prefix}_head_start": head_start,
        f"{prefix}_layout": layout,
        f"{prefix}_token_offset": token_offset,
    }
    if layout == "NHD_KV":
        kw[f"{prefix}_k_dim"] = k_dim
    return kw


def emulate_copy(src_k, src_v, src_ids, dst_k, dst_v, dst_ids, ptr_align=None, **kw):
    """kvxfer_emulate_cuda_copy_cpu: the CUDA copy kernel's decomposition on the host."""
    lib = _native.cpu_library()
    args = dict(
        src_k_buffers=src_k, src_v_buffers=src_v, src_page_ids=src_ids,
        dst_k_buffers=dst_k, dst_v_buffers=dst_v, dst_page_ids=dst_ids,
    )  # fmt: skip
    src, dst = ops._copy_calls({**{n: None for n in _ALL}, **args, **kw})
    sp, ss = ops._descs(src)
    dp, ds = ops._descs(dst)
    st = np.array(src.layer_ptrs(), dtype=np.uint64)
    dt = np.array(dst.layer_ptrs(), dtype=np.uint64)
    align = 16
    for p in src.layer_ptrs() + dst.layer_ptrs():
        align = math.gcd(align, p)
    code = lib.handle.kvxfer_emulate_cuda_copy_cpu(
        sp, st.ctypes.data, src.page_ids.ctypes.data, ss, dp, dt.ctypes.data, dst.page_ids.ctypes.data, ds,
        ptr_align or align,
    )  # fmt: skip
    _native.check_status(lib, code, "kvxfer_emulate_cuda_copy_cpu")


_ALL = [
    "src_k_buffers", "src_v_buffers", "src_page_ids", "dst_k_buffers", "dst_v_buffers", "dst_page_ids",
    "num_heads", "num_tokens", "src_page_size", "src_head_start", "src_layout", "src_token_offset", "src_k_dim",
    "dst_page_size", "dst_head_start", "dst_layout", "dst_token_offset", "dst_k_dim",
]  # fmt: skip

# (src pool heads, src head_start, dst pool heads, dst head_start, heads moved)
SLICES = {
    "tp2to1": (4, 0, 8, 4, 4),  # a prefill rank of TP 2 fills half of a TP 1 decode rank
    "tp1to2": (8, 4, 4, 0, 4),  # a TP 2 decode rank takes its half of a TP 1 prefill rank
    "tp4to8": (2, 1, 1, 0, 1),
}


def run_case(src_layout, dst_layout, page_sizes, slice_name, dtype, threads, monkeypatch, dims=(16, 16), layers=2):
    monkeypatch.setenv("KVXFER_CPU_THREADS", str(threads))
    gen = torch.Generator().manual_seed(hash((src_layout, dst_layout, page_sizes, slice_name)) % 1000)
    ps, pd = page_sizes
    sh, s0, dh, d0, n = SLICES[slice_name]
    kd, vd = dims
    tokens, so, do = 3 * max(ps, pd) + 2, 1, 2
    src_pages = list(np.random.default_rng(1).permutation(-(-(tokens + so) // ps) + 2))[: -(-(tokens + so) // ps)]
    dst_pages = list(np.random.default_rng(2).permutation(-(-(tokens + do) // pd) + 3))[: -(-(tokens + do) // pd)]
    sk, sv = make_pool(src_layout, max(src_pages) + 1, ps, sh, kd, vd, dtype, layers, gen)
    dk, dv = make_pool(dst_layout, max(dst_pages) + 2, pd, dh, kd, vd, dtype, layers, gen)
    kw = dict(num_heads=n, num_tokens=tokens)
    kw.update(side_kw("src", ps, s0, src_layout, so, kd))
    kw.update(side_kw("dst", pd, d0, dst_layout, do, kd))
    want_k, want_v = clone_all(dk), clone_all(dv)
    ops.copy_kv_heads_reference(sk, sv, src_pages, want_k, want_v, dst_pages, **kw)
    got_k, got_v = clone_all(dk), clone_all(dv)
    ops.copy_kv_heads(sk, sv, src_pages, got_k, got_v, dst_pages, **kw)
    assert same_bytes(got_k, want_k) and (got_v is None or same_bytes(got_v, want_v))
    assert not same_bytes(got_k, dk)  # something moved
    emu_k, emu_v = clone_all(dk), clone_all(dv)
    emulate_copy(sk, sv, src_pages, emu_k, emu_v, dst_pages, **kw)
    assert same_bytes(emu_k, want_k) and (emu_v is None or same_bytes(emu_v, want_v))
    # The reference itself is gather + scatter: the rows land where a scatter puts them.
    staging = ops.gather_kv_heads_reference(
        sk, sv, src_pages, page_size=ps, head_start=s0, num_heads=n, layout=src_layout, token_offset=so,
        num_tokens=tokens, k_dim=kd if src_layout == "NHD_KV" else None,
    )  # fmt: skip
    back = ops.gather_kv_heads(
        got_k, got_v, dst_pages, page_size=pd, head_start=d0, num_heads=n, layout=dst_layout, token_offset=do,
        num_tokens=tokens, k_dim=kd if dst_layout == "NHD_KV" else None,
    )  # fmt: skip
    assert same_bytes(back, staging)


@pytest.mark.parametrize("dst_layout", LAYOUTS)
@pytest.mark.parametrize("src_layout", LAYOUTS)
@pytest.mark.parametrize("page_sizes", [(4, 4), (16, 2), (1, 8)])
@pytest.mark.parametrize("slice_name", list(SLICES))
def test_every_layout_pair_page_sizes_and_head_slices(
    native_cpu, monkeypatch, src_layout, dst_layout, page_sizes, slice_name
):
    run_case(src_layout, dst_layout, page_sizes, slice_name, torch.bfloat16, 1, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8, torch.float8_e4m3fn, torch.float16])
@pytest.mark.parametrize("threads", [1, 3, 8])
@pytest.mark.parametrize("pair", [("NHD", "NHD"), ("HND", "NHD"), ("NHD_KV", "HND"), ("HND_KV", "NHD_KV")])
def test_dtypes_and_thread_counts(native_cpu, monkeypatch, dtype, threads, pair):
    run_case(*pair, (8, 4), "tp2to1", dtype, threads, monkeypatch)


@pytest.mark.parametrize("pair", [("NHD", "HND"), ("NHD_KV", "NHD"), ("NHD_KV", "NHD_KV")])
def test_different_k_and_v_dims(native_cpu, monkeypatch, pair):
    run_case(*pair, (4, 8), "tp1to2", torch.bfloat16, 2, monkeypatch, dims=(24, 8))


@pytest.mark.parametrize("layouts", [("NHD", "HND"), ("HND", "NHD")])
def test_mla_latent_one_buffer_per_layer(native_cpu, layouts):
    gen = torch.Generator().manual_seed(5)
    src = random_pool(layouts[0], 6, 4, 1, 72, torch.bfloat16, 3, gen)
    dst = random_pool(layouts[1], 5, 2, 1, 72, torch.bfloat16, 3, gen)
    kw = dict(num_heads=1, num_tokens=9, src_page_size=4, src_head_start=0, src_layout=layouts[0],
              dst_page_size=2, dst_head_start=0, dst_layout=layouts[1])  # fmt: skip
    want = clone_all(dst)
    ops.copy_kv_heads_reference(src, None, [5, 0, 3], want, None, [4, 0, 1, 3, 2], **kw)
    ops.copy_kv_heads(src, None, [5, 0, 3], dst, None, [4, 0, 1, 3, 2], **kw)
    assert same_bytes(dst, want)


def test_streaming_stores_copy_the_same_bytes(native_cpu):
    gen = torch.Generator().manual_seed(6)
    sk, sv = make_pool("NHD", 9, 16, 8, 128, 128, torch.bfloat16, 2, gen)
    dk, dv = make_pool("HND", 9, 16, 4, 128, 128, torch.bfloat16, 2, gen)
    kw = dict(num_heads=4, num_tokens=130, src_page_size=16, src_head_start=4, src_layout="NHD",
              dst_page_size=16, dst_head_start=0, dst_layout="HND")  # fmt: skip
    want_k, want_v = clone_all(dk), clone_all(dv)
    ops.copy_kv_heads_reference(sk, sv, list(range(9)), want_k, want_v, [8, 7, 6, 5, 4, 3, 2, 1, 0], **kw)
    src, dst = ops._copy_calls(
        {**{n: None for n in _ALL}, **kw, "src_k_buffers": sk, "src_v_buffers": sv, "src_page_ids": list(range(9)),
         "dst_k_buffers": dk, "dst_v_buffers": dv, "dst_page_ids": [8, 7, 6, 5, 4, 3, 2, 1, 0]}
    )  # fmt: skip
    ops._run_copy_cpu(native_cpu, src, dst, streaming_min_bytes=0)
    assert same_bytes(dk, want_k) and same_bytes(dv, want_v)


@pytest.mark.parametrize("ptr_align", [1, 2, 4, 8, 16])
def test_emulated_kernel_every_vector_width(native_cpu, ptr_align):
    gen = torch.Generator().manual_seed(7)
    sk, _ = make_pool("NHD_KV", 6, 4, 4, 64, 64, torch.bfloat16, 2, gen)
    dk, dv = make_pool("HND", 5, 8, 2, 64, 64, torch.bfloat16, 2, gen)
    kw = dict(num_heads=2, num_tokens=13, **side_kw("src", 4, 1, "NHD_KV", 3, 64), **side_kw("dst", 8, 0, "HND", 0))
    want_k, want_v = clone_all(dk), clone_all(dv)
    ops.copy_kv_heads_reference(sk, None, [5, 0, 3, 1], want_k, want_v, [4, 1], **kw)
    emulate_copy(sk, None, [5, 0, 3, 1], dk, dv, [4, 1], ptr_align=ptr_align, **kw)
    assert same_bytes(dk, want_k) and same_bytes(dv, want_v)


def test_staged_plan_slices_drive_the_copy(native_cpu):
    """What the engine will call: a StagedPlan's gather_slice and scatter_slice as the two
    sides (TP 2 -> 1, NHD page 4 -> HND page 8)."""
    common = dict(num_layers=2, total_kv_heads=8, head_dim=16, dtype="bf16")
    gp = KVGeometry(**common, page_size=4, layout="NHD", num_pages=8)
    gd = KVGeometry(**common, page_size=8, layout="HND", num_pages=6)
    t = plan_tp(8, 2, 1).transfers[1]
    src, dst = gp.placement(2, t.prefill_rank), gd.placement(1, t.decode_rank)
    plan = plan_pair(t, src, dst, [7, 2, 5, 0, 1], [3, 0, 5], num_tokens=19, path="staged")
    gen = torch.Generator().manual_seed(8)
    sk, sv = make_pool("NHD", 8, 4, 4, 16, 16, torch.bfloat16, 2, gen)
    dk, dv = make_pool("HND", 6, 8, 8, 16, 16, torch.bfloat16, 2, gen)
    want_k, want_v = clone_all(dk), clone_all(dv)
    staging = ops.gather_kv_heads_reference(sk, sv, plan.gather_slice())
    ops.scatter_kv_heads_reference(staging, want_k, want_v, plan.scatter_slice())
    ops.copy_kv_heads(sk, sv, plan.gather_slice(), dk, dv, plan.scatter_slice())
    assert same_bytes(dk, want_k) and same_bytes(dv, want_v)


def _pools():
    gen = torch.Generator().manual_seed(9)
    sk, sv = make_pool("NHD", 4, 4, 4, 8, 8, torch.float32, 2, gen)
    dk, dv = make_pool("HND", 4, 4, 4, 8, 8, torch.float32, 2, gen)
    return sk, sv, dk, dv


BASE = dict(num_heads=2, src_page_size=4, src_head_start=0, src_layout="NHD", dst_page_size=4, dst_head_start=0,
            dst_layout="HND")  # fmt: skip


@pytest.mark.parametrize(
    "change,words",
    [
        ({"dst_page_ids": [1, 1]}, "dst: page_ids repeats page 1; a scatter would write it twice"),
        ({"src_page_ids": [0, 9]}, "src: page_ids[1]=9 is outside [0, 4)"),
        ({"dst_page_ids": [0, -1]}, "dst: page_ids[1]=-1 is outside [0, 4)"),
        ({"dst_head_start": 3}, "dst: heads [head_start=3, head_start + num_heads=5) are outside the pool's 4 heads"),
        ({"src_token_offset": 2}, "num_tokens differs: src 6, dst 8; pass num_tokens"),
        ({"num_tokens": 9}, "src: token_offset=0 + num_tokens=9 exceeds the 8 tokens"),
        ({"dst_dtype": torch.int32}, "dtype differs: src torch.float32, dst torch.int32"),
        ({"dst_dim": 4}, "k_dim differs: src 8, dst 4"),
        ({"dst_v": None}, "num_kv (K and V, or MLA's one buffer) differs: src 2, dst 1"),
        ({"dst_layers": 1}, "num_layers differs: src 2, dst 1"),
        ({"dst_layout": "NHD_KV"}, "dst: v_buffers is 2 tensor(s) but layout NHD_KV keeps V in the k_buffers"),
    ],
)
def test_rejections_name_the_field_and_both_values_before_a_byte_moves(change, words):
    sk, sv, dk, dv = _pools()
    if "dst_dtype" in change:
        dk, dv = [t.view(change["dst_dtype"]) for t in dk], [t.view(change["dst_dtype"]) for t in dv]
    if "dst_dim" in change:
        dk, dv = [t[..., :4].contiguous() for t in dk], [t[..., :4].contiguous() for t in dv]
    if "dst_layers" in change:
        dk, dv = dk[:1], dv[:1]
    before = clone_all(dk)
    args = dict(src_page_ids=[0, 1], dst_page_ids=[2, 3])
    args.update({k: v for k, v in change.items() if k in ("src_page_ids", "dst_page_ids")})
    kw = {**BASE, **{k: v for k, v in change.items() if k in BASE or k in ("num_tokens", "src_token_offset")}}
    dv = change.get("dst_v", dv) if "dst_v" in change else dv
    with pytest.raises(ValueError) as exc:
        ops.copy_kv_heads(sk, sv, args["src_page_ids"], dk, dv, args["dst_page_ids"], **kw)
    assert words in str(exc.value)
    assert same_bytes(dk, before)


def test_kvslice_sides_take_no_other_slice_field_and_must_agree():
    common = dict(num_layers=2, total_kv_heads=4, head_dim=8, dtype="float32")
    g = KVGeometry(**common, page_size=4, layout="NHD", num_pages=4)
    gd = KVGeometry(**common, page_size=4, layout="HND", num_pages=4)
    t = plan_tp(4, 1, 2).transfers[0]
    plan = plan_pair(t, g.placement(1, 0), gd.placement(2, t.decode_rank), [0, 1], [2, 3], path="staged")
    sk, sv, dk, dv = _pools()
    with pytest.raises(
        ValueError, match="src_page_ids is a KVSlice, which holds the whole slice; do not also pass src_layout"
    ):
        ops.copy_kv_heads(sk, sv, plan.gather_slice(), dk, dv, [0, 1], src_layout="NHD", num_heads=2,
                          dst_page_size=4, dst_head_start=0, dst_layout="HND")  # fmt: skip
    with pytest.raises(ValueError, match="num_heads=1 but the src KVSlice moves 2"):
        ops.copy_kv_heads(sk, sv, plan.gather_slice(), dk, dv, plan.scatter_slice(), num_heads=1)
    with pytest.raises(TypeError, match="missing required keyword argument\\(s\\): dst_page_size, dst_head_start"):
        ops.copy_kv_heads(sk, sv, plan.gather_slice(), dk, dv, [0, 1], num_heads=2)


def test_native_library_checks_both_sides_itself(native_cpu):
    """The C ABI's own line of defence: a mismatch, a page id out of range on either side, a
    repeated destination page; nothing is written."""
    sk, sv, dk, dv = _pools()
    kw = {n: None for n in _ALL}
    kw.update(BASE, src_k_buffers=sk, src_v_buffers=sv, src_page_ids=[0, 1], dst_k_buffers=dk, dst_v_buffers=dv,
              dst_page_ids=[2, 3])  # fmt: skip
    src, dst = ops._copy_calls(kw)
    before = clone_all(dk)
    sp, ss = ops._descs(src)
    dp, ds = ops._descs(dst)
    st, dt = np.array(src.layer_ptrs(), dtype=np.uint64), np.array(dst.layer_ptrs(), dtype=np.uint64)

    def call(src_ids, dst_ids):
        s_ids, d_ids = np.array(src_ids, dtype=np.int64), np.array(dst_ids, dtype=np.int64)
        args = (sp, st.ctypes.data, s_ids.ctypes.data, ss, dp, dt.ctypes.data, d_ids.ctypes.data, ds, 1, -1)
        code = native_cpu.handle.kvxfer_copy_cpu(*args)
        return code, native_cpu.last_error()

    assert call([0, 7], [2, 3]) == (_native.STATUS_INVALID, "source: page_ids[1]=7 is outside [0, 4)")
    assert call([0, 1], [4, 3]) == (_native.STATUS_INVALID, "destination: page_ids[0]=4 is outside [0, 4)")
    code, text = call([0, 1], [2, 2])
    assert code == _native.STATUS_INVALID and "destination page_ids repeat page 2" in text
    ds.num_heads = 3
    code, text = call([0, 1], [2, 3])
    assert code == _native.STATUS_INVALID and text == "num_heads differs: source 2, destination 3"
    ds.num_heads, dp.v_row_bytes = 2, 16
    code, text = call([0, 1], [2, 3])
    assert code == _native.STATUS_INVALID and text == "v_row_bytes differs: source 32, destination 16"
    assert same_bytes(dk, before)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("pair", [("NHD", "NHD"), ("HND", "NHD"), ("NHD_KV", "HND_KV"), ("HND_KV", "NHD_KV")])
def test_cuda_copy_matches_the_cpu_reference(pair):
    lib = _native.cuda_library()
    if lib is None:
        pytest.fail(f"CUDA library unavailable on a GPU machine: {_native.status()['cuda']}")
    gen = torch.Generator().manual_seed(10)
    sk, sv = make_pool(pair[0], 12, 16, 8, 128, 128, torch.bfloat16, 3, gen)
    dk, dv = make_pool(pair[1], 10, 32, 4, 128, 128, torch.bfloat16, 3, gen)
    kw = dict(
        num_heads=4, num_tokens=150, **side_kw("src", 16, 4, pair[0], 3, 128), **side_kw("dst", 32, 0, pair[1], 5, 128)
    )
    src_ids, dst_ids = [11, 2, 9, 0, 5, 7, 1, 3, 4, 10], [9, 0, 3, 6, 1]
    want_k, want_v = clone_all(dk), clone_all(dv)
    ops.copy_kv_heads_reference(sk, sv, src_ids, want_k, want_v, dst_ids, **kw)
    cuda = lambda b: None if b is None else [t.cuda() for t in b]  # noqa: E731
    gk, gv = cuda(dk), cuda(dv)
    ops.copy_kv_heads(cuda(sk), cuda(sv), torch.tensor(src_ids).cuda(), gk, gv, dst_ids, **kw)
    torch.cuda.synchronize()
    assert same_bytes(gk, want_k) and (gv is None or same_bytes(gv, want_v))
