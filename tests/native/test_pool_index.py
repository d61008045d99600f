"""The index math of csrc/kvxfer_index.h, compiled and run on the host, against the layouts
written out by hand; the header's constants agree with the Python mirror.

- NHD, HND and HND_KV: the K row of (page, slot, head) in HND_KV sits at ``((page *
  pool_heads + head) * 2 * page_size + slot) * row_bytes`` from a layer's base, its V row
  ``page_size * row_bytes`` further (the V "layer pointer"), and the head stride is a whole
  tile.
- NHD_KV: a layer is one buffer ``[pages][page_size][heads][k_row | v_row]``; the K row of
  (page, slot, head) sits at ``((page * page_size + slot) * heads + head) * (k_row + v_row)``
  from the layer base, its V row ``k_row`` further, rows of both kinds step ``k_row + v_row``
  (``pool_row_pitch``), and so does the head stride."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from sglang_kvxfer import _native
from sglang_kvxfer._native import build
from sglang_kvxfer.geometry import Layout
from tests.facts import needs_cxx

CSRC = Path(__file__).resolve().parents[2] / "csrc"

LAYOUTS_PROGRAM = r"""
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

NHD_KV_PROGRAM = r"""
#include <stdio.h>
#include "kvxfer_index.h"
int main() {
  kvxfer_pool_t p = {};
  p.num_layers = 1; p.num_kv = 2; p.num_pages = 3; p.page_size = 3; p.pool_heads = 2;
  p.itemsize = 2; p.k_row_bytes = 10; p.v_row_bytes = 6; p.layout = KVXFER_LAYOUT_NHD_KV;
  for (int kv = 0; kv < 2; ++kv) {
    const long long row = kv == 0 ? p.k_row_bytes : p.v_row_bytes;
    const long long pitch = kvxfer::pool_row_pitch(p, row);
    for (long long page = 0; page < 3; ++page)
      for (long long slot = 0; slot < 3; ++slot)
        for (long long head = 0; head < 2; ++head)
          printf("%d %lld %lld %lld %lld %lld %lld\n", kv, page, slot, head, pitch,
                 (long long)kvxfer::pool_row_offset(p.layout, page, slot, head, 3, 2, pitch),
                 (long long)kvxfer::pool_head_stride(p.layout, 3, pitch));
  }
  kvxfer_pool_t q = p;
  q.layout = KVXFER_LAYOUT_NHD;
  printf("nhd_pitch %lld %d %d\n", (long long)kvxfer::pool_row_pitch(q, 10),
         (int)kvxfer::token_major(KVXFER_LAYOUT_NHD_KV), (int)kvxfer::token_major(KVXFER_LAYOUT_HND_KV));
  return 0;
}
"""


def run_program(tmp_path, program: str) -> list[str]:
    """Compiles ``program`` against csrc/ (warnings are errors) and returns its stdout lines."""
    source = tmp_path / "index.cpp"
    source.write_text(program)
    exe = tmp_path / "index"
    cmd = [build.find_cxx(), "-std=c++17", "-Wall", "-Werror", f"-I{CSRC}", str(source), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True, timeout=30).stdout.splitlines()


def test_header_constants_match_the_python_mirror():
    header = (CSRC / "kvxfer.h").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"#define KVXFER_LAYOUT_(\w+) (\d+)", header)}
    assert codes == _native.LAYOUT_CODES
    assert set(codes) == {layout.value for layout in Layout}
    assert int(re.search(r"#define KVXFER_ABI_VERSION (\d+)", header)[1]) == _native.ABI_VERSION


@needs_cxx
def test_pool_row_offsets_of_every_layout(tmp_path):
    size, heads, row = 3, 2, 10
    rows = [tuple(map(int, line.split())) for line in run_program(tmp_path, LAYOUTS_PROGRAM)]
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


@needs_cxx
def test_nhd_kv_row_offsets_pitch_and_head_stride(tmp_path):
    lines = run_program(tmp_path, NHD_KV_PROGRAM)
    assert lines[-1] == "nhd_pitch 10 1 0"  # other layouts keep their row as the pitch
    size, heads, k_row, v_row = 3, 2, 10, 6
    rows = [tuple(map(int, line.split())) for line in lines[:-1]]
    assert len(rows) == 2 * 3 * 3 * 2
    for kv, page, slot, head, pitch, offset, stride in rows:
        assert pitch == stride == k_row + v_row
        assert offset == ((page * size + slot) * heads + head) * (k_row + v_row)
        # The V layer pointer is K + k_row: V of (page, slot, head) right after its K row.
        if kv == 1:
            assert offset + k_row == ((page * size + slot) * heads + head) * 16 + 10
    assert _native.LAYOUT_CODES["NHD_KV"] == 3
