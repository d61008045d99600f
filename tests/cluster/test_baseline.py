"""The plain movers ``kvxfer bench`` measures against (``cluster/baseline.py``): every byte
arrives, a lost byte is caught, and every rejected argument is named."""

from __future__ import annotations

import numpy as np
import pytest

from sglang_kvxfer.cluster.baseline import _check, measure_baseline
from tests.facts import needs_cuda


@pytest.mark.parametrize("method", ["copy", "socket"])
def test_baseline_movers_deliver_every_byte(method):
    # uneven items, more items than streams, an empty item, one above the 64 MiB piece size
    items = [3 << 20, 0, 1 << 20, 12345, (64 << 20) + 7, 5 << 20]
    gbps = measure_baseline(method, items, streams=2, timeout_s=60)
    assert gbps > 0  # the movers compare every destination with its source after timing


@pytest.mark.parametrize("method", ["copy", "socket"])
def test_items_that_do_not_tile_the_64_mib_buffer_still_cover_it(method):
    # Two 40 MiB items in one lane: the second reaches the buffer's end, so it must go on at
    # offset 0 instead of leaving 24 MiB of the buffer unwritten (the GPU check's MLA run,
    # 37.7 MB items, failed with "did not deliver its bytes" before the split).
    assert measure_baseline(method, [40 << 20, 40 << 20], streams=1, timeout_s=60) > 0


def test_baseline_check_catches_a_mover_that_lost_bytes():
    with pytest.raises(RuntimeError, match="baseline mover 1 did not deliver its bytes"):
        _check([(np.ones(4, np.uint8), np.ones(4, np.uint8)), (np.ones(4, np.uint8), np.zeros(4, np.uint8))])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"method": "memcpy", "items": [1], "streams": 1}, "baseline method='memcpy' must be one of copy, socket, d2d"),
        ({"method": "copy", "items": [1], "streams": 0}, "baseline streams=0 must be a positive integer"),
        ({"method": "copy", "items": [0, 0], "streams": 1}, "must be non-negative byte counts with a positive total"),
        ({"method": "copy", "items": [4, -1], "streams": 1}, "must be non-negative byte counts with a positive total"),
        ({"method": "d2d", "items": [4], "streams": 1}, "the d2d baseline needs prefill_devices and decode_devices"),
    ],
)
def test_baseline_rejections_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        measure_baseline(**kwargs)


@pytest.mark.gpu
@needs_cuda
def test_device_to_device_baseline_moves_bytes():
    import torch

    last = f"cuda:{torch.cuda.device_count() - 1}"
    assert measure_baseline("d2d", [8 << 20, 3 << 20], 2, prefill_devices=["cuda:0"], decode_devices=[last]) > 0
    assert measure_baseline("d2d", [40 << 20, 40 << 20], 1, prefill_devices=["cuda:0"], decode_devices=[last]) > 0
