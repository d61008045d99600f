"""A minimal prefill/decode proxy for two vLLM OpenAI servers using the kvxfer connector.

``POST /v1/completions`` goes to the producer with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true}``; the ``kv_transfer_params`` of its answer
(bootstrap address, room, block ids) go with the original body to the consumer, whose answer
is returned. With ``--bootstrap HOST:PORT`` (the producer's ``kv_port``) the proxy picks a
random room itself and sends both requests at once, as SGLang's router does: the consumer
registers the room while the producer still computes (``{"do_remote_prefill": true, "room":
R, "bootstrap_addr": ...}`` and ``{"do_remote_decode": true, "room": R}``). ``GET /health``
answers 200 once both servers' ``/health`` do. Standard library only; no streaming::

    python examples/vllm_cpu_pd/proxy.py --producer http://127.0.0.1:8100 \\
        --consumer http://127.0.0.1:8200 --port 8000 [--bootstrap 127.0.0.1:14579]
"""

from __future__ import annotations

import argparse
import json
import secrets
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TIMEOUT_S = 300.0


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}
    except (urllib.error.URLError, OSError) as exc:  # not reachable, or no answer in time
        return 502, {"error": f"{url}: {exc}"}


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def serve(producer: str, consumer: str, host: str, port: int, bootstrap: str = "") -> None:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                return self.reply(404, {"error": f"no GET {self.path}"})
            down = [url for url in (producer, consumer) if not healthy(url)]
            self.reply(503 if down else 200, {"down": down})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            path = self.path
            room = secrets.randbits(63) if bootstrap else None
            decode_params = {"do_remote_prefill": True, "room": room, "bootstrap_addr": bootstrap}
            decoded: list = []
            if room is not None:  # the consumer first: it registers while the producer computes
                consumer_body = dict(body, kv_transfer_params=decode_params)
                thread = threading.Thread(target=lambda: decoded.append(post(consumer + path, consumer_body)))
                thread.start()
            pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
            if room is not None:
                pre["kv_transfer_params"]["room"] = room
            pre.pop("max_completion_tokens", None)
            status, answer = post(producer + path, pre)
            params = answer.get("kv_transfer_params") if status == 200 else None
            if not params or not params.get("do_remote_prefill"):
                # Concurrent mode: the consumer's request fails at its own deadline.
                return self.reply(
                    502, {"error": f"producer answered {status} without a KV hand-over", "answer": answer}
                )
            if room is None:
                status, answer = post(consumer + path, dict(body, kv_transfer_params=params))
            else:
                thread.join()
                status, answer = decoded[0]
            self.reply(status, answer)

        def reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    ThreadingHTTPServer((host, port), Handler).serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--producer", required=True)
    ap.add_argument("--consumer", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--bootstrap", default="", help="the producer's HOST:KV_PORT: pick rooms here, send both at once")
    args = ap.parse_args()
    serve(args.producer.rstrip("/"), args.consumer.rstrip("/"), args.host, args.port, args.bootstrap)


if __name__ == "__main__":
    main()
