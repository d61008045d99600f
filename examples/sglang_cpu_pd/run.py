"""SGLang's own prefill and decode servers moving real KV through kvxfer, on a CPU.

    python examples/sglang_cpu_pd/run.py [--prefill-tp 2] [--decode-tp 1] [--transport local]

One command, no GPU and no download: it builds the SGLang 0.5.23 CPU environment if missing
(``tests/realserver/make_env.sh``: about 3 minutes and 3 GB the first time), builds a tiny
random-weight Llama with a local tokenizer, starts a prefill server and a decode server
with ``--disaggregation-transfer-backend kvxfer`` plus a plain single server, sends a few
prompts the way SGLang's router does, and prints the decode server's text beside the
single server's, then each rank's transfer record (bytes, transport ops, window).

STAND-INS: SGLang imports two packages no registry has for a CPU (``sgl_kernel``,
``torchvision``). They are served by labelled stand-ins from
``tests/realserver/standins/`` that raise if anything calls them (nothing does on a CPU
without AMX; the output says if one was used). The model is random: its text is word soup,
but the same word soup from both columns means the KV moved exactly.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.realserver import harness as h  # noqa: E402

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode servers exchange the key value cache of every request",
    "one two three four five six seven eight nine ten eleven twelve " * 6,
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill-tp", type=int, default=2, choices=(1, 2))
    ap.add_argument("--decode-tp", type=int, default=1, choices=(1, 2))
    ap.add_argument("--transport", default="local", choices=("local", "tcp"))
    ap.add_argument("--tokens", type=int, default=12, help="new tokens per prompt")
    ap.add_argument("--workdir", type=Path, default=None, help="model, logs and records (default: a temp dir)")
    args = ap.parse_args()

    print("1/4 SGLang CPU environment ...", flush=True)
    subprocess.run(["bash", str(h.MAKE_ENV)], check=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvxfer-sglang-pd-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"2/4 tiny Llama in {work / 'model'} ...", flush=True)
    model = h.build_model(work / "model")
    records = work / "records.jsonl"
    records.unlink(missing_ok=True)
    env = h.base_env(work / "standins-used.log")
    env.update(KVXFER_SGLANG_TRANSPORT=args.transport, KVXFER_RECORDS_FILE=str(records))
    port = h.free_port()
    servers = [
        h.prefill_server("prefill", model, args.prefill_tp, env, work, port),
        h.decode_server("decode", model, args.decode_tp, env, work),
        h.reference_server("single", model, args.prefill_tp, env, work),
    ]
    print(
        f"3/4 starting prefill TP {args.prefill_tp} + decode TP {args.decode_tp} over {args.transport}, "
        f"and a single TP {args.prefill_tp} server (about a minute; logs in {work}) ...",
        flush=True,
    )
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        prefill, decode, single = servers
        print("4/4 generating\n", flush=True)
        same = 0
        tok = _tokenizer(model)
        for i, text in enumerate(PROMPTS):
            ids = tok(text)
            _, dec = h.generate_pd(prefill, decode, port, ids, random.getrandbits(62) + 1, args.tokens)
            ref = h.generate_single(single, ids, args.tokens)
            match = h.output_ids(dec) is not None and h.output_ids(dec) == h.output_ids(ref)
            same += match
            print(f"prompt {i + 1} ({len(ids)} tokens): {text[:60]}{'...' if len(text) > 60 else ''}")
            print(f"  PD pair (kvxfer): {dec.get('text', dec)!s}")
            print(f"  single server   : {ref.get('text', ref)!s}")
            print(f"  {'same tokens' if match else 'DIFFERENT tokens'}\n")
        print("transfer records (one line per request and rank):")
        for line in records.read_text().splitlines() if records.exists() else []:
            r = json.loads(line)
            window = f"{r['transfer_s'] * 1e3:.2f} ms" if r.get("transfer_s") is not None else "-"
            print(
                f"  room {r['room']:>20} {r['side']:>7} rank {r['tp_rank']}: ok={r['ok']} "
                f"{r['bytes']:>9} bytes in {r['ops']:>4} ops, window {window} {r.get('reason', '')}"
            )
        used = work / "standins-used.log"
        if used.exists() and used.read_text().strip():
            print(f"\nA STAND-IN WAS CALLED (this run proves nothing):\n{used.read_text()}")
            return 1
        print(f"\n{same}/{len(PROMPTS)} prompts decoded the single server's tokens")
        return 0 if same == len(PROMPTS) else 1
    finally:
        for s in servers:
            s.stop()


def _tokenizer(model: Path):
    vocab = json.loads((model / "tokenizer.json").read_text())["model"]["vocab"]
    unk = vocab["<unk>"]
    return lambda text: [vocab.get(w, unk) for w in text.split()]


if __name__ == "__main__":
    sys.exit(main())
