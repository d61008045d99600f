"""CUDA gather/scatter == the CPU torch reference, bit for bit. Skips itself when torch
sees no CUDA device; on a GPU machine it requires the CUDA library (built at install or on
first use) unless no nvcc and no prebuilt library exist there."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from sglang_kvxfer import _native, ops
from sglang_kvxfer._native import build
from tests.facts import needs_cuda
from tests.ops.ops_cases import cases, clone_all, emulate_cuda, random_pool, same_bytes

pytestmark = [pytest.mark.gpu, needs_cuda]
DEV = "cuda"
HYP = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)


@pytest.fixture(scope="module", autouse=True)
def cuda_library():
    lib = _native.cuda_library()
    if lib is None:
        packaged = (_native._PACKAGE_DIR / build.CUDA_LIBRARY).is_file()
        if build.find_nvcc() is None and not packaged:
            pytest.skip("no nvcc and no prebuilt libkvxfer_cuda.so on this GPU machine")
        pytest.fail(f"CUDA library unavailable on a GPU machine: {_native.status()['cuda']}")
    assert ops.backend_for(DEV) == "native-cuda"
    return lib


def _to(buffers, device):
    return None if buffers is None else [t.to(device) for t in buffers]


@HYP
@given(case=cases(max_tokens=80))
def test_cuda_gather_and_scatter_equal_cpu_reference(case):
    gen = torch.Generator().manual_seed(0)
    k, v = case.make_pools(case.src, gen)
    kw = case.kwargs(case.src)
    expect = ops.gather_kv_heads_reference(k, v, **kw)
    for sentinel in (0xA5, 0x5A):
        out = torch.full((expect.numel() + 16,), sentinel, dtype=torch.uint8, device=DEV)
        got = ops.gather_kv_heads(_to(k, DEV), _to(v, DEV), **kw, out=out)
        torch.cuda.synchronize()
        assert same_bytes(got, expect)
        assert bool((out[expect.numel() :] == sentinel).all())

    dk, dv = case.make_pools(case.dst, gen)
    dkw = case.kwargs(case.dst)
    ref_k, ref_v = clone_all(dk), clone_all(dv)
    ops.scatter_kv_heads_reference(expect, ref_k, ref_v, **dkw)
    gk, gv = _to(dk, DEV), _to(dv, DEV)
    ops.scatter_kv_heads(expect.to(DEV), gk, gv, **dkw)
    torch.cuda.synchronize()
    assert same_bytes(gk, ref_k) and (dv is None or same_bytes(gv, ref_v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("staging_shift", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128, 576, 3])
def test_every_vector_width_and_staging_alignment(dtype, staging_shift, head_dim):
    gen = torch.Generator().manual_seed(1)
    layout = "HND" if head_dim == 64 else "NHD"
    k = random_pool(layout, 9, 16, 4, head_dim, dtype, 2, gen)
    v = random_pool(layout, 9, 16, 4, head_dim, dtype, 2, gen)
    kw = dict(page_size=16, head_start=1, num_heads=2, layout=layout, token_offset=5)
    pages = [8, 2, 5, 0]
    expect = ops.gather_kv_heads_reference(k, v, pages, **kw)
    buf = torch.zeros(expect.numel() + staging_shift, dtype=torch.uint8, device=DEV)
    gk, gv = _to(k, DEV), _to(v, DEV)
    got = ops.gather_kv_heads(gk, gv, pages, out=buf[staging_shift:], **kw)
    torch.cuda.synchronize()
    assert same_bytes(got, expect)
    for t in gk + gv:
        t.zero_()
    ops.scatter_kv_heads(got, gk, gv, pages, **kw)
    assert same_bytes(ops.gather_kv_heads_reference(_to(gk, "cpu"), _to(gv, "cpu"), pages, **kw), expect)


def test_many_layers_and_tiles_in_one_launch():
    """grid.y = 2 x 80 layers; 5000 one-head fp8 tokens of 16 bytes: tiles hit the
    1024-token cap, and the CUDA result matches the host emulation of the same launch."""
    gen = torch.Generator().manual_seed(2)
    k = random_pool("NHD", 320, 16, 2, 16, torch.uint8, 80, gen)
    v = random_pool("NHD", 320, 16, 2, 16, torch.uint8, 80, gen)
    pages = torch.randperm(320, generator=gen)[:313]
    kw = dict(page_size=16, head_start=1, num_heads=1, num_tokens=5000)
    expect = ops.gather_kv_heads_reference(k, v, pages, **kw)
    emulated = torch.empty_like(expect)
    emulate_cuda(dict(kw, page_ids=pages), k, v, emulated, gather=True)
    got = ops.gather_kv_heads(_to(k, DEV), _to(v, DEV), pages.to(DEV), **kw)
    torch.cuda.synchronize()
    assert same_bytes(emulated, expect) and same_bytes(got, expect)


def test_two_writers_into_one_decode_pool_on_gpu():
    gen = torch.Generator().manual_seed(3)
    src = [random_pool("NHD", 4, 16, 2, 128, torch.bfloat16, 2, gen) for _ in range(4)]
    dk = random_pool("HND", 8, 8, 4, 128, torch.bfloat16, 2, gen)
    gk = _to(dk, DEV)
    pages, dst_pages = [3, 0, 2], [7, 1, 4, 0, 6, 2]
    for rank in range(2):
        staging = ops.gather_kv_heads(_to(src[rank], DEV), None, pages, page_size=16, head_start=0, num_heads=2)
        ops.scatter_kv_heads(staging, gk, None, dst_pages, page_size=8, head_start=2 * rank, num_heads=2, layout="HND")
        ref = ops.gather_kv_heads_reference(src[rank], None, pages, page_size=16, head_start=0, num_heads=2)
        ops.scatter_kv_heads_reference(
            ref, dk, None, dst_pages, page_size=8, head_start=2 * rank, num_heads=2, layout="HND"
        )
    torch.cuda.synchronize()
    assert same_bytes(gk, dk)


def test_runs_on_the_current_stream():
    gen = torch.Generator().manual_seed(4)
    k = _to(random_pool("NHD", 64, 16, 8, 128, torch.bfloat16, 4, gen), DEV)
    pages = list(range(63, -1, -1))
    torch.cuda.synchronize()  # the pool's upload is done before the side stream reads it
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        out = ops.gather_kv_heads(k, None, pages, page_size=16, head_start=2, num_heads=4)
    side.synchronize()
    expect = ops.gather_kv_heads_reference(_to(k, "cpu"), None, pages, page_size=16, head_start=2, num_heads=4)
    assert same_bytes(out, expect)


def test_cuda_page_id_errors():
    k = _to(random_pool("NHD", 4, 4, 2, 8, torch.float16, 1, torch.Generator()), DEV)
    before = k[0].clone()
    with pytest.raises(ValueError, match=r"page_ids\[1\]=4 is outside \[0, 4\)"):
        ops.gather_kv_heads(k, None, torch.tensor([0, 4], device=DEV), page_size=4, head_start=0, num_heads=1)
    with pytest.raises(ValueError, match=r"page_ids repeats page 1"):
        ops.scatter_kv_heads(
            torch.zeros(4096, dtype=torch.uint8, device=DEV),
            k,
            None,
            torch.tensor([1, 1], dtype=torch.int32, device=DEV),
            page_size=4,
            head_start=0,
            num_heads=1,
        )
    with pytest.raises(ValueError, match=r"page_ids is on cuda:0 but the KV buffers are on cpu"):
        ops.gather_kv_heads(_to(k, "cpu"), None, torch.tensor([0], device=DEV), page_size=4, head_start=0, num_heads=1)
    with pytest.raises(ValueError, match=r"out is on cpu but the KV buffers are on cuda:0"):
        ops.gather_kv_heads(
            k, None, [0], page_size=4, head_start=0, num_heads=1, out=torch.empty(64, dtype=torch.uint8)
        )
    torch.cuda.synchronize()
    assert same_bytes(k[0], before)  # the rejected scatter wrote nothing


# ~0.2-0.5 s on current GPUs (1-2 GHz): far longer than a launch, so a copy that does not
# wait for the producer reads the pool before the fill lands.
_SLEEP_CYCLES = 400_000_000


@pytest.mark.parametrize("with_ready", [True, False], ids=["ready", "no-ready"])
def test_copy_stream_orders_the_gather_after_the_producers_event(with_ready):
    from sglang_kvxfer.engine.copystream import CopyStream

    k = [torch.zeros(64 * 16, 8, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2)]
    pages = list(range(63, -1, -1))
    kw = dict(page_size=16, head_start=2, num_heads=4)
    out = torch.full((ops.staging_nbytes(2, 64 * 16, 4, 128, 0, 2),), 0xA5, dtype=torch.uint8, device=DEV)
    torch.cuda.synchronize()
    producer = torch.cuda.Stream()  # the model's forward: a long kernel, then the KV write
    with torch.cuda.stream(producer):
        torch.cuda._sleep(_SLEEP_CYCLES)
        for t in k:
            t.fill_(3.0)
        ready = torch.cuda.Event()
        ready.record(producer)
    copies = CopyStream(DEV)
    copies.run(lambda: ops.gather_kv_heads(k, None, pages, out=out, **kw), ready if with_ready else None)
    got = out.clone()  # what the gather wrote by the time run() returned
    producer.synchronize()
    expect = ops.gather_kv_heads_reference([t.cpu() for t in k], None, pages, **kw)
    if with_ready:
        assert same_bytes(got.cpu(), expect)  # every byte of the fill
    else:
        # Not ordered: the gather ran while the producer slept and read the zeros.
        assert not same_bytes(got.cpu(), expect)
        assert bool((got == 0).all())


def test_copy_stream_leaves_the_callers_stream_alone():
    from sglang_kvxfer.engine.copystream import CopyStream

    k = [torch.ones(64 * 16, 8, 128, dtype=torch.bfloat16, device=DEV)]
    out = torch.empty(ops.staging_nbytes(1, 64 * 16, 4, 128, 0, 2), dtype=torch.uint8, device=DEV)
    torch.cuda.synchronize()
    torch.cuda._sleep(_SLEEP_CYCLES)  # the caller's (default) stream is busy
    CopyStream(DEV).run(
        lambda: ops.gather_kv_heads(k, None, list(range(64)), out=out, page_size=16, head_start=0, num_heads=4)
    )
    assert not torch.cuda.current_stream().query()  # returned without waiting for the caller's stream
    torch.cuda.synchronize()
    assert bool((out.view(torch.bfloat16) == 1).all())


def test_kernel_launcher_moves_the_same_bytes_as_the_full_call():
    gen = torch.Generator().manual_seed(5)
    k = _to(random_pool("HND", 32, 16, 8, 128, torch.bfloat16, 2, gen), DEV)
    v = _to(random_pool("HND", 32, 16, 8, 128, torch.bfloat16, 2, gen), DEV)
    pages = torch.randperm(32, generator=gen).tolist()
    kw = dict(page_size=16, head_start=1, num_heads=3, layout="HND")
    expect = ops.gather_kv_heads(k, v, pages, **kw)
    staging = torch.zeros_like(expect)
    launch = ops.cuda_kernel_launcher(staging, k, v, pages, gather=True, **kw)
    launch()
    torch.cuda.synchronize()
    assert same_bytes(staging, expect)
    dk = [torch.zeros_like(t) for t in k]
    dv = [torch.zeros_like(t) for t in v]
    ops.cuda_kernel_launcher(staging, dk, dv, pages, gather=False, **kw)()
    torch.cuda.synchronize()
    assert same_bytes(ops.gather_kv_heads(dk, dv, pages, **kw), expect)
