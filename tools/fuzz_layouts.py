"""Seeded random-layout fuzzer: draws configs over the parallel dimensions and the features that
combine with them, trains each for a few steps and compares it with one process.

Each draw is a pure function of its seed. A draw that validation refuses is recorded with its
message; one that runs is compared with the one-process run of the same model and train config
(fp32 without a codec: assert_parity; codecs and bf16/fp16: loosely). Results go as JSON lines
to --out. Run from the repository root:

    PYTHONPATH=$PWD/src:$PWD/tests OMP_NUM_THREADS=1 python tools/fuzz_layouts.py --seed 0 --count 20
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import assert_parity, grad_norms, tiny_config, train_layout  # noqa: E402
from tetrad.config import ConfigError  # noqa: E402
from tetrad.parallel.pipeline.registry import check_config as check_pipeline  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")
# Loss tolerance of a lossy codec against the uncompressed run (tests/test_codecs.py).
CODEC_ATOL = {"bf16": 0.02, "int8": 0.05, "powersgd": 0.3}
# Low precision against one process in the same dtype: rounding order only, but rounding to 8
# (bf16) or 11 (fp16) bits. Loose bounds of this script's own (the first seen misses were 1.5e-2
# and 4.4e-3 on a step-3 loss); later losses get three times as much.
DTYPE_ATOL = {"bf16": 2e-2, "fp16": 1e-2}
DTYPE_NORM_RTOL = {"bf16": 4e-3, "fp16": 4e-4}


def factor(world: int, rng: random.Random) -> dict:
    """dp, tp, pp, cp with product `world`, drawn by splitting its factors of 2 at random."""
    sizes = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
    while world > 1:
        sizes[rng.choice(list(sizes))] *= 2
        world //= 2
    return sizes


def draw(seed: int) -> dict:
    """Config overrides (model, parallel, train) for one draw."""
    rng = random.Random(seed)
    world = rng.choices([2, 4, 8], weights=[4, 5, 1])[0]
    par = factor(world, rng)
    schedule = rng.choice(SCHEDULES if par["pp"] > 1 else ("1f1b",))
    par["schedule"] = schedule
    par["vpp"] = rng.choice([2, 2, 3]) if schedule == "interleaved" else 1
    par["zero"] = rng.randint(0, 3)
    if par["tp"] > 1 and rng.random() < 0.6:
        par["sequence_parallel"] = True
        par["sp_regather"] = rng.random() < 0.4
    if par["cp"] > 1:
        par["cp_algo"] = rng.choice(["ring", "alltoall"])
    if rng.random() < 0.2:
        par["grad_codec"] = rng.choice(["bf16", "int8", "powersgd"])
        par["zero"] = rng.choice([0, 1, 1, 2])  # 2: refused
    if rng.random() < 0.3:
        par["grad_bucket_mb"] = rng.choice([0.002, 0.01, 0.05, "auto"])  # several buckets, or measured
    if par["dp"] * par["cp"] >= 2 and rng.random() < 0.15:
        par["hierarchical"] = rng.choice([True, True, "auto"])
        if par["hierarchical"] is True:
            par["zero"] = rng.choice([0, 1, 1, 3])  # 3: refused
            par.pop("grad_codec", None)
        par["ranks_per_node"] = par["tp"] * rng.choice([1, 2])
    stages = par["pp"] * par["vpp"]
    split = par["tp"] * (par["cp"] if par.get("cp_algo") == "alltoall" else 1)
    d_model = rng.choice([64, 64, 96])
    heads = [h for h in ((4, 8) if d_model == 64 else (4, 6, 12)) if h % split == 0] or [split]
    model = {"n_layers": max(2, rng.choice([stages, stages, stages + 1, 2 * stages])), "d_model": d_model,
             "n_heads": rng.choice(heads), "ffn_hidden": rng.choice([128, 128, 96, 192]),
             "tie_embeddings": rng.random() < 0.35, "vocab_size": rng.choice([251, 256, 257, 258]),
             "seq_len": rng.choice([32, 32, 48, 64])}
    kv = [h for h in range(1, model["n_heads"] + 1) if model["n_heads"] % h == 0]
    model["n_kv_heads"] = rng.choice([h for h in kv if h % split == 0] if rng.random() < 0.9 else kv)
    if rng.random() < 0.2:
        model.update(norm="layernorm", mlp="gelu", pos="learned")
    if stages > 1 and rng.random() < 0.15 and model["n_layers"] > stages:
        cuts = sorted(rng.sample(range(1, model["n_layers"]), stages - 1))
        par["stage_layers"] = [b - a for a, b in zip([0] + cuts, cuts + [model["n_layers"]])]
    micro = rng.choice([1, 1, 2, 4])
    need = par["pp"] * (2 if schedule == "interleaved" else 1)
    m = rng.choice([1, 2, 3, 4]) if par["pp"] == 1 else rng.choice([need, need, need + 1, 2 * need])
    train = {"steps": 3, "warmup": 1, "lr": 5e-3, "micro_batch": micro, "global_batch": micro * par["dp"] * m,
             "grad_clip": rng.choice([1.0, 1.0, 0.0, 0.05]),
             "dtype": rng.choices(["fp32", "bf16", "fp16"], weights=[7, 2, 1])[0],
             "recompute": rng.choice(["none", "none", "selective", "selective-op", "full"])}
    if rng.random() < 0.1:
        train["offload_optimizer"] = True
    if rng.random() < 0.1:
        train["global_batch"] += rng.choice([1, micro])  # sometimes invalid
    data = {}
    if rng.random() < 0.25:  # validation in the training layout, at step 2 and the last
        data["val_fraction"] = 0.05
        train.update(eval_every=2, eval_steps=2)
    return {"model": model, "parallel": par, "train": train, "data": data}


def reference_of(overrides: dict) -> dict:
    """The one-process config of the same model and train settings (no offload: same arithmetic)."""
    train = {k: v for k, v in overrides["train"].items() if k != "offload_optimizer"}
    return {"model": overrides["model"], "train": train, "data": overrides.get("data", {})}


def alternative_micro_batch(overrides: dict) -> int | None:
    """Another micro_batch for the one-process run (None: global_batch 1 has no other)."""
    t = overrides["train"]
    return 1 if t["micro_batch"] > 1 else next((m for m in (2, 4, t["global_batch"]) if t["global_batch"] % m == 0
                                                 and m > 1), None)


def max_param_diff(a, b) -> float:
    return max((a[1][k] - b[1][k]).abs().max().item() for k in b[1])


def share_beyond(got, ref, atol: float) -> float:
    """The share of parameter elements outside assert_parity's bound (rtol 1e-4, `atol`)."""
    beyond = sum(int(((got[1][k] - v).abs() > atol + 1e-4 * v.abs()).sum()) for k, v in ref[1].items())
    return beyond / sum(v.numel() for v in ref[1].values())


def check(got, ref, overrides: dict, other_order) -> str:
    """'ok', or why `got` is within what summation order alone moves one process; AssertionError
    otherwise. `other_order()` trains the one-process run again with another micro_batch."""
    par, dtype = overrides["parallel"], overrides["train"]["dtype"]
    losses, _, history = got
    assert all(math.isfinite(x) for x in losses), f"non-finite losses {losses}"
    codec = par.get("grad_codec", "none")
    ref_losses, ref_state, ref_history = ref
    val, ref_val = ([r.get("val_loss", math.nan) for r in h] for h in (history, ref_history))
    if codec == "none":  # validation of (nearly) the same weights
        torch.testing.assert_close(torch.tensor(val), torch.tensor(ref_val), rtol=2e-5, equal_nan=True,
                                   atol=DTYPE_ATOL.get(dtype, 0), msg=lambda m: f"val_loss: {m}")
    if dtype == "fp32" and codec == "none":
        # tests/test_cp.py's and tests/test_tp.py's bounds, for the same reasons.
        atol = 2e-4 if par["cp"] > 1 else 1e-4 if par["tp"] > 1 else 1e-5
        try:
            assert_parity(got, ref, atol=atol)
        except AssertionError as e:
            if not str(e) and not ref_losses[-1] < ref_losses[0]:
                return "vacuous: the one-process run did not learn"
            if str(e) not in ref_state:
                raise
            # Adam turns a near-zero gradient's rounding into a visible step, element by element:
            # compare the drift with one process's own between two micro_batch sizes, and count
            # the elements it reaches (a wrong shard or factor moves whole tensors).
            other = other_order()  # None for global_batch 1
            own = math.nan if other is None else max_param_diff(other, ref)
            drift, share = max_param_diff(got, ref), share_beyond(got, ref, atol)
            why = f"parameters drift {drift:.2e}, one process {own:.2e}; {share:.1e} of the elements beyond"
            assert drift <= 4 * own + atol or share <= 1e-3, f"{e}: {why}"
            return f"summation order: {why}"
        return "ok"
    first_atol = 1e-5 if dtype == "fp32" else DTYPE_ATOL[dtype]
    assert abs(losses[0] - ref_losses[0]) <= first_atol, f"first loss {losses[0]} vs {ref_losses[0]}"
    rtol = {"none": 0, "bf16": 1e-2, "int8": 2e-2}.get(codec)
    if rtol is not None:  # powersgd's first step is a rank-4 approximation
        rtol += DTYPE_NORM_RTOL.get(dtype, 1e-5)
        torch.testing.assert_close(grad_norms(history)[0], grad_norms(ref_history)[0], rtol=rtol, atol=0,
                                   msg=lambda m: f"first grad_norm: {m}")
    if codec == "none":  # later steps of a lossy codec follow their own curve (tests/test_codecs.py)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=3 * first_atol)
    if dtype != "fp16":
        assert not any(r["skipped"] for r in history), "skipped steps"
    return "ok"


def resume_pair(seed: int) -> dict | None:
    """Layout A trains 4 steps, saving at step 2; layout B, another draw over the same model and
    train config (its own micro_batch), resumes from step 2. fp32 without codecs, for parity."""
    a = draw(seed)
    a["train"].update(steps=4, dtype="fp32")
    a["parallel"].pop("grad_codec", None)
    for k in range(1, 40):
        b = draw(seed * 1000 + k)
        b["parallel"].pop("grad_codec", None)
        b_train = {**a["train"], "micro_batch": b["train"]["micro_batch"]}
        try:
            check_pipeline(tiny_config(model=a["model"], parallel=b["parallel"], train=b_train, data=a["data"]))
        except ConfigError:
            continue
        return {"a": a, "b": {"model": a["model"], "parallel": b["parallel"], "train": b_train, "data": a["data"]}}
    return None


def trainer_of(refs: dict, timeout_s: float):
    """`trained(overrides)`: train_layout of a config, cached by its overrides."""
    def trained(overrides: dict, cache: bool = True):
        key = json.dumps(overrides, sort_keys=True)
        if not cache or key not in refs:
            refs[key] = train_layout(tiny_config(**overrides), timeout_s=timeout_s)
        return refs[key]
    return trained


def layout_run(overrides: dict, trained):
    """Train `overrides` (one layout, or a resume pair) and return (result, its config for the
    comparison)."""
    if "a" not in overrides:
        return trained(overrides, cache=False), overrides
    a, b = overrides["a"], overrides["b"]
    first = tiny_config(**a, checkpoint={"every": 2})
    losses, _, history = train_layout(first)
    step2 = str(Path(first.run.dir) / "checkpoints" / "step_00000002")
    b_losses, state, b_history = trained({**b, "checkpoint": {"resume": step2}}, cache=False)
    par = {d: max(a["parallel"][d], b["parallel"][d]) for d in ("dp", "tp", "pp", "cp")}
    return (losses[:2] + b_losses, state, history[:2] + b_history), {**a, "parallel": par}


def dropout_pair(seed: int) -> dict:
    """A draw with residual dropout and a recompute mode; compared with the same layout without
    recompute, which must give the same numbers exactly (the recompute replays the masks)."""
    overrides = draw(seed)
    overrides["model"]["dropout"] = 0.1
    if overrides["train"]["recompute"] == "none":
        overrides["train"]["recompute"] = random.Random(seed).choice(["selective", "selective-op", "full"])
    return overrides


def check_same(got, ref) -> str:
    assert got[0] == ref[0], f"losses {got[0]} vs {ref[0]} without recompute"
    assert [r["grad_norm"] for r in got[2]] == [r["grad_norm"] for r in ref[2]], "grad norms differ"
    differ = [k for k in ref[1] if not torch.equal(got[1][k], ref[1][k])]
    assert not differ, f"parameters differ without recompute: {differ[:4]}"
    return "ok"


def run_one(seed: int, refs: dict, timeout_s: float, resume: bool, dropout: bool = False) -> dict:
    overrides = resume_pair(seed) if resume else dropout_pair(seed) if dropout else draw(seed)
    record = {"seed": seed, "config": overrides}
    if overrides is None:
        return {**record, "result": "refused", "message": "no second layout validates"}
    try:
        for part in (overrides["a"], overrides["b"]) if resume else (overrides,):
            check_pipeline(tiny_config(**part))  # as `tetrad train` does before it starts
    except ConfigError as e:
        return {**record, "result": "refused", "message": str(e)}
    except Exception as e:  # not a ConfigError: a bug in validation
        return {**record, "result": "validation-crash", "message": repr(e)}
    trained = trainer_of(refs, timeout_s)
    start = time.perf_counter()
    elapsed = lambda: round(time.perf_counter() - start, 1)  # noqa: E731
    try:
        got, compared = layout_run(overrides, trained)
        ref = trained({**compared, "train": {**compared["train"], "recompute": "none"}} if dropout
                      else reference_of(compared))
    except Exception as e:
        tail = "".join(traceback.format_exception_only(type(e), e))[-1500:]
        return {**record, "result": "crash", "message": tail, "s": elapsed()}

    def other_order():
        micro = alternative_micro_batch(compared)
        alt = reference_of(compared)
        return None if micro is None else trained({**alt, "train": {**alt["train"], "micro_batch": micro}})

    try:
        note = check_same(got, ref) if dropout else check(got, ref, compared, other_order)
    except AssertionError as e:
        return {**record, "result": "mismatch", "message": str(e)[-1500:], "s": elapsed()}
    return {**record, "result": "ok", "note": note, "s": elapsed()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0, help="first seed")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=150.0, help="seconds per train_layout (a hang fails)")
    ap.add_argument("--out", default="fuzz_layouts.jsonl")
    ap.add_argument("--budget", type=float, default=math.inf, help="stop starting draws after this many seconds")
    ap.add_argument("--resume", action="store_true", help="save in one layout, resume in another")
    ap.add_argument("--dropout", action="store_true", help="dropout: recompute against none, same layout")
    args = ap.parse_args()
    refs: dict = {}
    start = time.perf_counter()
    with open(args.out, "a") as out:
        for seed in range(args.seed, args.seed + args.count):
            if time.perf_counter() - start > args.budget:
                print(f"budget spent; next seed {seed}", flush=True)
                break
            record = run_one(seed, refs, args.timeout, args.resume, args.dropout)
            out.write(json.dumps(record) + "\n")
            out.flush()
            why = (record.get("message") or record.get("note", ""))[:300].replace("\n", " | ")
            print(seed, record["result"], record.get("s", ""), why, flush=True)


if __name__ == "__main__":
    main()
