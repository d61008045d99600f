"""Planning: pure functions from geometries and page lists to transfer plans.

``tp`` decides which heads go from which prefill rank to which decode rank; ``byteplan``
turns one (writer, reader) pair and a request's page lists into array-shaped byte plans
(direct page runs, or a staged gather/scatter or fused pool -> pool copy description;
``pathcost`` is ``auto``'s rule between them); ``strided`` is a reader that holds every
n-th token (decode context parallel); ``request_plan`` holds one
request's plan of a pair, built once and cut per chunk into ``KVSlice``s (``kvslice``:
those and ``DataPath``); ``executor`` applies plans to
real byte buffers on the CPU, as the reference the tests and the engine are checked
against. Nothing here does I/O.
"""

from sglang_kvxfer.planning.byteplan import DirectPlan, FusedPlan, PairPlan, StagedPlan, plan_pair  # noqa: F401
from sglang_kvxfer.planning.kvslice import DataPath, KVSlice  # noqa: F401
from sglang_kvxfer.planning.pathcost import PathCost, PoolMapping  # noqa: F401
from sglang_kvxfer.planning.request_plan import RequestPlan  # noqa: F401
from sglang_kvxfer.planning.strided import EVERY_TOKEN, TokenSelection  # noqa: F401
from sglang_kvxfer.planning.tp import (  # noqa: F401
    HeadTransfer,
    TPPlan,
    candidate_decode_ranks,
    candidate_prefill_ranks,
    plan_tp,
)
