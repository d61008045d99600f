"""``--disaggregation-enable-kv-checksum`` with SGLang 0.5.23's own servers on a CPU (tiny Llama).

A prefill server of TP 2 and a decode server of TP 1, both with the flag (the decode rank
gathers its heads from two writers, each with a checksum over its share): the decoded tokens
equal those of a single TP 2 server. Zeroing what one writer delivered after it landed and
before the decode checks it (``landed W/P`` in the negative control's file) fails that
request with the checksum mismatch in the decode's answer; the next request decodes again.
SGLang's own digest is CUDA only and would kill a CPU prefill scheduler (see docs/sglang.md):
this backend verifies CPU pools itself.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.realserver import harness as h
from tests.realserver.conftest import running_pair

pytestmark = pytest.mark.timeout(900)

FLAG = "--disaggregation-enable-kv-checksum"
_rooms = random.Random(20261202)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1024) for _ in range(n)]


@pytest.fixture(scope="module")
def pair(server_env, tiny_model, logs: Path):
    env = dict(server_env, KVXFER_SGLANG_TRANSPORT="local")
    with running_pair("checksum-tp2-tp1", tiny_model, env, logs, 2, 1, [FLAG], [FLAG]) as servers:
        yield servers


def run(pair, ids: list[int]) -> tuple[dict, dict]:
    prefill, decode, port = pair
    return h.generate_pd(prefill, decode, port, ids, _rooms.getrandbits(62) + 1)


def test_both_servers_with_the_flag_decode_the_reference_tokens(pair, reference_tokens):
    for ids in (prompt(20, 1), prompt(150, 2)):  # one chunk; three chunks of --chunked-prefill-size
        pre, dec = run(pair, ids)
        got = h.output_ids(dec)
        assert got == reference_tokens(2, ids), f"decode answered {dec} (prefill: {pre})\n{pair[1].log_tail()}"


def test_a_writer_changed_after_landing_fails_the_request_naming_the_checksums(pair, server_env, reference_tokens):
    corrupt = Path(server_env["KVXFER_TEST_CORRUPT_FILE"])
    ids = prompt(40, 3)
    corrupt.write_text("landed 1/2")  # prefill rank 1 of 2: KV heads 2 and 3
    try:
        _, dec = run(pair, ids)
    finally:
        corrupt.unlink()
    assert h.output_ids(dec) is None, dec
    text = str(dec)
    assert "KV checksum mismatch (--disaggregation-enable-kv-checksum): KV head 2 written by prefill rank 1" in text, (
        text
    )
    assert "prefill crc32=0x" in text and "decode crc32=0x" in text, text
    assert "zeroed heads 2..3" in Path(str(corrupt) + ".log").read_text()
    _, dec = run(pair, ids)  # the pair serves the next request
    assert h.output_ids(dec) == reference_tokens(2, ids), dec
