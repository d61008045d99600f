"""The HND_KV index math of csrc/kvxfer_index.h, compiled and run on the host: the K row of
(page, slot, head) sits at ``((page * pool_heads + head) * 2 * page_size + slot) * row_bytes``
from a layer's base, its V row ``page_size * row_bytes`` further (the V "layer pointer"),
and the head stride is a whole tile; the header's constants agree with the Python mirror."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sglang_kvxfer import _native
from sglang_kvxfer._native import build
from sglang_kvxfer.geometry import Layout
from tests.facts import needs_cxx

CSRC = Path(__file__).resolve().parents[2] / "csrc"

PROGRAM = r"""
#include <stdio.h>
#include "kvxfer_index.h"
int main() {
  const int layouts[3] = {KVXFER_LAYOUT_NHD, KVXFER_LAYOUT_HND, KVXFER_LAYOUT_HND_KV};
  for (int l = 0; l < 3; ++l)
    for (long long page = 0; page < 3; ++page)
      for (long long slot = 0; slot < 3; ++slot)
        for (long long head = 0; head < 2; ++head)
          printf("%d %lld %lld %lld %lld %lld\n", layouts[l], page, slot, head,
                 (long long)kvxfer::pool_row_offset(layouts[l], page, slot, head, 3, 2, 10),
                 (long long)kvxfer::pool_head_stride(layouts[l], 3, 10));
  return 0;
}
"""


def test_header_constants_match_the_python_mirror():
    header = (CSRC / "kvxfer.h").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"#define KVXFER_LAYOUT_(\w+) (\d+)", header)}
    assert codes == _native.LAYOUT_CODES
    assert set(codes) == {layout.value for layout in Layout}
    assert int(re.search(r"#define KVXFER_ABI_VERSION (\d+)", header)[1]) == _native.ABI_VERSION


@needs_cxx
def test_pool_row_offsets_of_every_layout(tmp_path):
    source = tmp_path / "index.cpp"
    source.write_text(PROGRAM)
    exe = tmp_path / "index"
    cmd = [build.find_cxx(), "-std=c++17", "-Wall", "-Werror", f"-I{CSRC}", str(source), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout
    size, heads, row = 3, 2, 10
    rows = [tuple(map(int, line.split())) for line in out.splitlines()]
    assert len(rows) == 3 * 3 * 3 * 2
    for layout, page, slot, head, offset, stride in rows:
        if layout == _native.LAYOUT_CODES["NHD"]:
            assert (offset, stride) == (((page * size + slot) * heads + head) * row, row)
        elif layout == _native.LAYOUT_CODES["HND"]:
            assert (offset, stride) == (((page * heads + head) * size + slot) * row, size * row)
        else:  # HND_KV: [page][head][K|V][slot][row], K from the layer base
            assert (offset, stride) == (((page * heads + head) * 2 * size + slot) * row, 2 * size * row)
            v_offset = offset + size * row  # what the V layer pointer adds
            assert v_offset == (((page * heads + head) * 2 + 1) * size + slot) * row
