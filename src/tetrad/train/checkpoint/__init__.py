"""Sharded checkpoints through torch.distributed.checkpoint (DCP), stored in the LOGICAL parameter
space, and published so that a kill at any instant leaves a state the next run resumes from.

What is stored. Every key holds a logical tensor: `model.NAME` the unsharded, unpadded parameter
(`ParamSpec.full_shape`), `optim.NAME.KEY` its optimizer state of the same shape (AdamW's moments)
or a scalar (AdamW's step). A rank contributes the boxes of those tensors it holds (logical.py);
DCP writes each box once and on load reads whichever parts the new layout needs, so a checkpoint
written under one dp/tp/pp/cp/zero layout loads under any other, or into one process. Also:
`rng.rankR.KIND` (each rank's RNG state), `extra.NAME.KEY` (replicated `stateful` objects such as
the loss scaler), `local.rankR.NAME.KEY` (state only rank R holds, meaningful in the same layout:
codecs' error feedback; restored when the [parallel] section is the saved one), the resolved
config (config.toml) and the manifest (tetrad.json: step, model shape, layout, what "auto" in
[parallel] resolved to, size and SHA-256 of every file). A resume in the saved layout takes those
choices instead of measuring again (Checkpointer.resolve_auto): the same buckets, so codec state
and sums continue bitwise. The learning rate, the tp-shared dropout masks and the data position
are functions of the step, so nothing more is needed.

On disk (ROOT = checkpoint.dir, default RUN_DIR/checkpoints):

    ROOT/step_00000010/           a published checkpoint: DCP files, config.toml, tetrad.json
    ROOT/step_00000012.partial/   a save in progress, or one that was killed
    ROOT/latest                   the name of the newest published checkpoint (for people and
                                  scripts; tetrad itself never trusts it over the folders)

A save: rank 0 clears and creates `.partial`; every rank writes its shards; every rank hashes
its share of the files; rank 0 writes config.toml and tetrad.json (fsync), renames `.partial` to
`step_N` (replacing a `step_N` already there), fsyncs ROOT, rewrites `latest` atomically and
prunes to `checkpoint.keep`. With `checkpoint.async_save` the shards are written from a thread
(background.py) and the rest runs at the end of a later step, once every rank's write is done:
the same protocol, later. The states a kill can leave, and what `resume = "auto"` does:

1. `.partial` without or with tetrad.json (killed while writing shards, between ranks finishing
   them, or before the rename): ignored, and removed by the next save or prune. The previous
   checkpoint is resumed.
2. `step_N` published, `latest` still naming an older step or absent (killed between the rename
   and the pointer): `step_N` is adopted after its integrity check, said on the console.
3. `step_N` published and `latest` naming it: resumed after its integrity check.
4. A published `step_N` that fails its integrity check (truncated, flipped or missing file,
   missing or garbled manifest or metadata): set aside as `step_N.bad` (`.bad2`, ... beside an
   earlier one), said on the console with the reason, and the next older intact checkpoint resumed; if none is intact, refused.
5. `latest` unreadable or naming something else (a binary file, a person's edit): said on the
   console and ignored; the next save rewrites it.
6. A checkpoint of another model shape: refused, naming every key that differs.

Resuming from step S cuts RUN_DIR/metrics.jsonl to the steps <= S, and nothing else ever shortens
it: a run that starts afresh where metrics.jsonl holds an earlier run's steps is refused. An
explicit `checkpoint.resume = PATH` is verified and refused, never skipped, if damaged. Loading
checks the file list, sizes and hashes, the model shape and every tensor's shape before reading,
and never unpickles anything but DCP's own metadata classes (tensors load weights-only).
"""

from tetrad.train.checkpoint.checkpointer import Checkpointer
from tetrad.train.checkpoint.store import (MANIFEST, SHAPE_KEYS, CheckpointError, SafeReader, check_shapes,
                                           digest_files, publish, resolve, saved_model, shape_keys, step_dir, verify)

__all__ = ["MANIFEST", "SHAPE_KEYS", "Checkpointer", "CheckpointError", "SafeReader", "check_shapes", "digest_files",
           "publish", "resolve", "saved_model", "shape_keys", "step_dir", "verify"]
