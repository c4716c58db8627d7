"""Turn a collective's timeout into a message naming the op, the group, the step and the ranks that
did not arrive, and give every group the configured timeout.

gloo's own error ("Timed out waiting 3000ms for recv operation") names none of these. When a
collective times out, the rank posts where it is stuck (op, group, the group's call number) in the
job's c10d store, then waits a while for every rank of the job to post: a rank that posts nothing
is hung outside collectives (in compute, stopped) or dead, and is the one named as not arriving,
even when this rank's group waits on a rank that is itself waiting in another collective for it.
Nothing is written while collectives succeed.

Timeouts (torchtitan separates them too): the process groups start with the start-up timeout
(rendezvous, group creation, the first step's compilation and warm-up); after the first step the
training groups get the shorter collective timeout. The world group keeps the longer one: it
carries checkpoint I/O (DCP's gathers and the barriers around a save), which can take minutes.
"""

from __future__ import annotations

import datetime
import json
import time

import torch.distributed as dist

# How long a rank that timed out waits for the others to post their positions: they time out
# within about one timeout of each other, and a stalled rank never posts.
MAX_WAIT_S = 60.0


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the process-group timeout."""


def is_timeout(error: BaseException) -> bool:
    return (isinstance(error, RuntimeError) and not isinstance(error, CollectiveTimeout)
            and "timed out" in str(error).lower())


def set_timeouts(seconds: float, world_too: bool = True) -> None:
    """Give every process group of this rank (the mesh's, the flattened and per-node ones,
    pipeline links: all that torch.distributed knows) a timeout of `seconds`."""
    timeout = datetime.timedelta(seconds=seconds)
    world = dist.group.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if world_too or pg is not world:
            dist.distributed_c10d._set_pg_timeout(timeout, pg)


def explain(op: str, group: str, call: int | None, pg, error: BaseException, wait_s: float) -> CollectiveTimeout:
    """Post this rank's position, gather the job's for a while, and build the error."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    ranks = dist.get_process_group_ranks(pg)
    here = {"op": op, "group": group, "call": call}
    store.set(f"tetrad/stuck/{rank}", json.dumps(here))
    keys = {r: f"tetrad/stuck/{r}" for r in range(world) if r != rank}
    deadline = time.monotonic() + min(wait_s, MAX_WAIT_S)
    while time.monotonic() < deadline and not all(store.check([k]) for k in keys.values()):
        time.sleep(0.1)
    where = {r: json.loads(store.get(k)) for r, k in keys.items() if store.check([k])}
    silent = [r for r in keys if r not in where]
    elsewhere = [r for r in ranks if r != rank and r in where and where[r] != here]
    details = [f"rank {r} posted nothing: hung outside collectives (in compute, or stopped) or dead"
               for r in silent]
    details += [f"rank {r} waits in {where[r]['op']} on {where[r]['group']} (call {where[r]['call']})"
                for r in elsewhere]
    return CollectiveTimeout(
        f"{op} on group {group} (ranks {ranks}, call {call} on that group) did not complete: ranks "
        f"{silent or elsewhere} did not arrive" + "".join(f"\n  {d}" for d in details)
        + f"\n(gloo/nccl said: {str(error).splitlines()[0] if str(error) else error!r})")
