"""SGLang's KV transfer backend interface, implemented on this engine.

The public module of the backend: SGLang's backend lookup (``sglang_install``) imports
``KVXferKVManager``, ``KVXferKVSender``, ``KVXferKVReceiver`` and ``KVXferKVBootstrapServer``
from here. They subclass SGLang's real base classes
(``sglang.srt.disaggregation.base.conn``), which SGLang's prefill and decode event loops drive
exactly as they drive mooncake or mori. Each SGLang rank's manager wraps one engine
``PrefillManager``/``DecodeManager`` over SGLang's own KV pool memory (no copy); senders and
receivers wrap the engine's ``KVSender``/``KVReceiver``. Importing this module imports
SGLang's base module.

Where things live: the manager and the bootstrap server in ``sglang_manager``, the sender,
the receiver and the engine requests a request is made of in ``sglang_requests``, pipeline
parallelism's pieces in ``sglang_pp``, shared helpers in ``sglang_common``, KVArgs/ServerArgs
translation in ``sglang_args``, KV checksums in ``sglang_checksum``.

Attention DP (``--enable-dp-attention``): every prefill DP group registers with the one
bootstrap under its DP rank; a decode rank learns the groups with the parallel info, and a
receiver routed to DP group N (SGLang's rule: the router's ``data_parallel_rank``, else
``bootstrap_room % dp_size``) plans against that group only, known to the engine as a prefill
group of its own (``bootstrap.group_address``).

Pipeline parallelism (``--pp-size``): every prefill PP stage registers under its stage with
its first layer; stage 0 reports a request bootstrapped only once every stage has the decode's
request (``poll_pp_consensus``). A decode of the same PP size receives each stage from the
prefill stage of its own rank; a decode of PP 1 receives every stage, each into a layer-slice
view of its pool by an engine manager of its own, and one request is one engine request per
stage. Any other PP size is refused with SGLang's rule.

Attention CP on the prefill (``--attn-cp-size``): CP rank 0 of each attention-TP rank sends
every page, as SGLang's backends do by default (CP materializes the KV on every CP rank);
the other CP ranks build no engine manager, register nothing, and their senders
(``CPReplicaSender``) only join the poll consensus. Sharded CP is refused by name.

Speculative decoding: a draft model's KV (``KVArgs.num_draft_entries`` trailing entries,
same page ids as the model's pool) has a geometry of its own and a second engine manager per
rank (``kv_pool="draft"``, registered and looked up separately, geometry checked at
registration like the model's pool). Each request is then two engine requests over the same
pages; it succeeds only when both did, and fails with the first failure (the other is
aborted). Whether the prefill has a draft pool, and its geometry, comes with the parallel
info; a difference fails the decode's requests naming both sides. With PP the draft pool is
the last stage's (SGLang runs the draft model there): registered at that stage, looked up there.

Extra per-request state (``KVArgs.state_types``: mamba, swa, dsa, dsa_tail, MXFP8 block
scales, MiniMax and QSA indexer state; ``sglang_state``): each pool of it has a geometry of
its own and an engine manager per rank (``kv_pool="state:<kind>[.<n>]"``, announced with the
model pool's registration, geometry checked at registration). A request's last chunk hands each
pool its own indices (``state_indices``), the decode's ``send_metadata`` its own; the request
succeeds only when its KV and every state pool's rows are in place. A server pair whose state
pools differ, or a pool that needs one attention TP size meeting two, fails the requests
naming both sides; any other state type is refused at manager construction, naming it.

``--disaggregation-enable-kv-checksum`` on CPU pools: each prefill rank digests the heads it
owns over the pages it sent (``sglang_checksum``) and sends the digests with its
``TransferDone``; the decode digests the heads it owns once every writer is done and compares
each writer's share before it reports Success (per PP stage).

The test seams (replaced here by tests, read by the other modules at call time):
``after_kv_landed``, ``_model_total_kv_heads``, ``_model_swa_kv_heads``, ``_model_dsa_index_head_dim``,
``_draft_model_kv``,
``_pp_exchange``, ``_model_swa_stage_layers``.
"""

from __future__ import annotations

from collections.abc import Callable

from sglang_kvxfer.integrations.sglang_common import (  # noqa: F401  (the underscored names: test seams)
    KVXferTransferError,
    PrefillInfo,
)
from sglang_kvxfer.integrations.sglang_common import defer_sglang_cpu_checksum as _defer_sglang_cpu_checksum  # noqa: F401
from sglang_kvxfer.integrations.sglang_common import draft_model_kv as _draft_model_kv  # noqa: F401
from sglang_kvxfer.integrations.sglang_common import (  # noqa: F401
    model_dsa_index_head_dim as _model_dsa_index_head_dim,
)
from sglang_kvxfer.integrations.sglang_common import model_swa_kv_heads as _model_swa_kv_heads  # noqa: F401
from sglang_kvxfer.integrations.sglang_common import (  # noqa: F401
    model_swa_stage_layers as _model_swa_stage_layers,
)
from sglang_kvxfer.integrations.sglang_common import model_total_kv_heads as _model_total_kv_heads  # noqa: F401
from sglang_kvxfer.integrations.sglang_common import pp_exchange as _pp_exchange  # noqa: F401
from sglang_kvxfer.integrations.sglang_manager import KVXferKVBootstrapServer, KVXferKVManager
from sglang_kvxfer.integrations.sglang_requests import KVXferKVReceiver, KVXferKVSender

__all__ = [
    "KVXferKVManager",
    "KVXferKVSender",
    "KVXferKVReceiver",
    "KVXferKVBootstrapServer",
    "KVXferTransferError",
    "PrefillInfo",
]

# For tests: called with a decode receiver once every writer of every part reported done,
# before the KV checksum is verified (a test corrupts a landed byte here). None otherwise.
after_kv_landed: Callable[[KVXferKVReceiver], None] | None = None
