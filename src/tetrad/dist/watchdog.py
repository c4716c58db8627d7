"""Turn a collective's timeout into a message naming the op, the group and the ranks that did not arrive.

gloo's own error ("Timed out waiting 3000ms for recv operation") names none of these. When a
collective times out, the rank posts where it is stuck (op, group, the group's call number) in the
job's c10d store, then waits up to one more timeout for the other ranks of the group to post:
a rank that reached the same call is stuck there too; a rank elsewhere names where it is; a rank
that posts nothing is hung in computation or dead. Nothing is written while collectives succeed.
"""

from __future__ import annotations

import json
import time

import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process-group timeout."""


def is_timeout(error: BaseException) -> bool:
    return (isinstance(error, RuntimeError) and not isinstance(error, CollectiveTimeout)
            and "timed out" in str(error).lower())


def explain(op: str, group: str, call: int | None, pg, error: BaseException, wait_s: float) -> CollectiveTimeout:
    """Post this rank's position, gather the group's for up to `wait_s`, and build the error."""
    store = dist.distributed_c10d._get_default_store()
    rank = dist.get_rank()
    ranks = dist.get_process_group_ranks(pg)
    store.set(f"tetrad/stuck/{rank}", json.dumps({"op": op, "group": group, "call": call}))
    keys = {r: f"tetrad/stuck/{r}" for r in ranks if r != rank}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys.values()):
        time.sleep(0.1)
    where = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
    here = {"op": op, "group": group, "call": call}
    missing = [r for r in ranks if r != rank and where.get(r) != here]
    details = [f"rank {r} is in {where[r]['op']} on {where[r]['group']} (call {where[r]['call']})"
               if r in where else f"rank {r} posted nothing: busy outside collectives (hung in compute?) or dead"
               for r in missing]
    return CollectiveTimeout(
        f"{op} on group {group} (ranks {ranks}, call {call} on that group) did not complete: ranks {missing} "
        f"did not arrive" + "".join(f"\n  {d}" for d in details) + f"\n(gloo/nccl said: {error})")
