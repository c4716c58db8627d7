"""Seeded fuzzer of resharded resumes: train layout A 4 steps saving at step 2, resume step 2
under layout B to step 4, and check what tetrad promises (any layout resumes any other's
checkpoint exactly):

- load-resave: B loads A's step 2 and saves it again; every logical tensor (model, optimizer,
  loss scale, data position) is bitwise the one A saved (per-rank state too if B is A's layout);
- fp32 without a lossy codec: A follows a one-process run, and B follows one process resuming
  the same checkpoint with B's train section, to the tolerances of tests/test_checkpoint.py;
- B == A (same parallel and train sections, timeouts aside): B's steps 3-4 are bitwise A's;
- otherwise (bf16/fp16, lossy codecs): B's losses within a loose band of that one process;
- every `--export-every`th pair: a fresh run under B from A's weights (checkpoint.init_from)
  follows one process doing the same, and `tetrad convert --to-hf` of A's checkpoint holds its
  logical tensors bitwise (where a transformers architecture computes the model).

A fifth of the pairs train on fine-tuning data (tests/conftest.py sft_shards: packs of whole
examples under a loss mask), both layouts and the one-process runs alike; about one in seven
has a mixture of experts in every layer (tests/layout_draws.py moe_model).

A FAIL is a lead, not a verdict: fp32 runs that near-cancel amplify the order of sums (see
tests/conftest.py assert_parity); rerun the case with other micro-batch sizes before blaming.
Run: PYTHONPATH=src OMP_NUM_THREADS=1 python tools/fuzz_resume.py --seed 0 --count 20
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import grad_norms, run_ranks, sft_shards, tiny_config, train_layout  # noqa: E402
from layout_draws import moe_model  # noqa: E402
from test_checkpoint import read_logical  # noqa: E402
from tetrad.config import ConfigError  # noqa: E402
from tetrad.parallel.pipeline import registry  # noqa: E402
from tetrad.train.checkpoint import Checkpointer  # noqa: E402
from tetrad.train.trainer import Trainer  # noqa: E402

STEPS, SAVED = 4, 2


def draw_layout(rng: random.Random, model: dict, dtype: str) -> dict:
    """A random [parallel] + [train] pair within world size 4 (may still be refused by validation)."""
    while True:
        dims = {"dp": 1, "tp": 1, "pp": 1, "cp": 1}
        for _ in range(rng.choice([0, 1, 1, 2, 2])):
            d = rng.choice(list(dims))
            if 2 * dims["dp"] * dims["tp"] * dims["pp"] * dims["cp"] <= 4:
                dims[d] *= 2
        if model["n_kv_heads"] % dims["tp"]:
            continue
        break
    p = {k: v for k, v in dims.items() if v > 1}
    p["zero"] = rng.choice([0, 1, 2, 3])
    if dims["pp"] > 1:
        p["schedule"] = rng.choice(list(registry.SCHEDULES))
        if registry.SCHEDULES[p["schedule"]].interleaved:
            p["vpp"] = 2
        stages = dims["pp"] * p.get("vpp", 1)
        if rng.random() < 0.2 and stages <= model["n_layers"]:
            cuts = sorted(rng.sample(range(1, model["n_layers"]), stages - 1))
            p["stage_layers"] = [b - a for a, b in zip([0, *cuts], [*cuts, model["n_layers"]])]
    if dims["tp"] > 1 and rng.random() < 0.5:
        p["sequence_parallel"] = True
    if dims["cp"] > 1 and rng.random() < 0.3:
        p["cp_algo"] = "alltoall"
    if p["zero"] <= 1 and rng.random() < 0.4:
        p["grad_codec"] = rng.choice(["bf16", "int8", "powersgd"] if dtype != "fp16" else ["bf16"])
    if rng.random() < 0.3:
        p["grad_bucket_mb"] = rng.choice([0.01, 0.05, "auto"])  # "auto": measured, or reused by a same-layout resume
    micro = rng.choice([1, 1, 2])
    need = registry.min_microbatches(p.get("schedule", "1f1b"), dims["pp"], p.get("vpp", 1))
    global_batch = rng.choice([b for b in (4, 8, 16) if b % (micro * dims["dp"]) == 0
                               and b // (micro * dims["dp"]) >= need] or [micro * dims["dp"] * need])
    saving = {"async_save": True} if rng.random() < 0.3 else {}  # written from a thread (background.py)
    return {"parallel": p, "train": {"micro_batch": micro, "global_batch": global_batch, "dtype": dtype},
            "checkpoint": saving}


def draw_pair(rng: random.Random) -> tuple[dict, dict, dict]:
    model = {"n_layers": rng.choice([2, 3, 4, 4]), "vocab_size": rng.choice([251, 256]),
             "tie_embeddings": rng.random() < 0.4, "n_kv_heads": rng.choice([1, 2, 2, 4]),
             "pos": rng.choice(["rope"] * 4 + ["learned"]), "norm": rng.choice(["rmsnorm"] * 4 + ["layernorm"]),
             "mlp": rng.choice(["swiglu"] * 4 + ["gelu"])}
    attention = rng.random()  # Qwen2's q, k and v biases, or Qwen3's qk-norm over heads of their own width
    if attention < 0.15:
        model["qkv_bias"] = True
    elif attention < 0.3:
        model.update(qk_norm=True, head_dim=rng.choice([8, 24]))
    dtype_a = rng.choices(["fp32", "bf16", "fp16"], [6, 1, 1])[0]
    dtype_b = dtype_a if rng.random() < 0.8 else rng.choice(["fp32", "bf16", "fp16"])
    a = draw_layout(rng, model, dtype_a)
    draw = rng.random()
    if draw < 0.15:  # the same layout: bitwise
        b = a
    elif draw < 0.2:  # the same layout with other timeouts: bitwise too
        b = {**a, "parallel": {**a["parallel"], "collective_timeout_s": 90.0, "startup_timeout_s": 300.0}}
    else:
        b = draw_layout(rng, model, dtype_b)
    if rng.random() < 0.2:  # fine-tuning data: packs of whole examples, a loss mask (the same for both)
        model["vocab_size"] = 256
        a, b = ({**layout, "data": {"source": sft_shards()}} for layout in (a, b))
    if rng.random() < 0.15:  # a mixture of experts (drawn last: the cases before it draw as they did)
        model.update(moe_model(rng))
    return model, a, b


def config(model: dict, layout: dict, run_dir: Path, **checkpoint):
    train = {**layout["train"], "steps": STEPS}
    return tiny_config(model=model, parallel=layout["parallel"], train=train, run={"dir": str(run_dir)},
                       checkpoint={**layout.get("checkpoint", {}), **checkpoint}, data=layout.get("data", {}))


def _load_and_save(cfg, path: Path, root: Path):
    trainer = Trainer(cfg, torch.device("cpu"))
    ckpt = Checkpointer(cfg, trainer.topo, root)
    params, stateful = dict(trainer.model.named_parameters()), trainer.job_state()
    local = {"grads": trainer.grads}
    ckpt.save(ckpt.load(path, params, trainer.optimizer, stateful, local), params, trainer.optimizer, stateful, local)


def check_resave(model, a, b, saved: Path, tmp: Path) -> list[str]:
    cfg = config(model, b, tmp / "resave-run", resume="never")
    run_ranks(_load_and_save, cfg.parallel.world_size, cfg, saved, tmp / "resaved")
    before, after = read_logical(saved), read_logical(tmp / "resaved" / saved.name)
    same_layout = same_run({**a, "train": {}}, {**b, "train": {}})
    # Per-rank state only in the same layout; the loss scale only where both scale the loss (fp16).
    same_scaling = (a["train"]["dtype"] == "fp16") == (b["train"]["dtype"] == "fp16")

    def keep(k: str) -> bool:
        return (same_layout or not k.startswith("local.")) and (same_scaling or not k.startswith("extra.scaler."))
    problems = []
    if {k for k in before if keep(k)} != {k for k in after if keep(k)}:
        problems.append(f"resave keys differ: only saved {sorted(set(before) - set(after))[:6]}, "
                        f"only resaved {sorted(set(after) - set(before))[:6]}")
    differ = [k for k in before if keep(k) and k in after and not torch.equal(before[k], after[k])]
    if differ:
        k = differ[0]
        problems.append(f"resave not bitwise: {len(differ)} tensors, e.g. {k}: max diff "
                        f"{(before[k].double() - after[k].double()).abs().max().item():.3g}")
    return problems


def close(name, got, ref, rtol, atol) -> list[str]:
    try:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    except AssertionError as e:
        return [f"{name}: {' '.join(str(e).split())[:300]}"]
    return []


def compare(got, ref, wide: bool, exact: bool = False, param_atol: float | None = None,
            norm_rtol: float = 5e-4) -> list[str]:
    """`got`, `ref`: (losses, state, history) of the same steps."""
    losses, state, history = got
    ref_losses, ref_state, ref_history = ref
    if exact:
        return (close("loss", torch.tensor(losses), torch.tensor(ref_losses), 0, 0)
                + [f"param {k} not bitwise" for k in ref_state if not torch.equal(state[k], ref_state[k])][:3])
    problems = close("loss", torch.tensor(losses), torch.tensor(ref_losses), 1e-5, 2e-6 if wide else 1e-6)
    problems += close("grad_norm", grad_norms(history), grad_norms(ref_history), norm_rtol, 0)
    atol = param_atol or (2e-4 if wide else 5e-5)  # tests/test_zero.py's 5e-5: ZeRO-2/3 sum per micro-batch
    for k in ref_state:
        problems += close(f"param {k}", state[k], ref_state[k], 1e-4, atol)
    return problems[:6]


def same_run(a: dict, b: dict) -> bool:
    """The same layout and train section, but for keys no state depends on (the timeouts)."""
    def key(x):
        return x["train"], {k: v for k, v in x["parallel"].items() if not k.endswith("timeout_s")}
    return key(a) == key(b)


def exact_math(layout: dict) -> bool:
    """fp32 without a lossy codec: parity with one process to summation order."""
    return layout["train"]["dtype"] == "fp32" and layout["parallel"].get("grad_codec", "none") == "none"


def one_process(layout: dict, dtype: str = "fp32") -> dict:
    return {"parallel": {}, "train": {**layout["train"], "dtype": dtype}, "data": layout.get("data", {})}


def slice_steps(run, first: int):
    losses, state, history = run
    return losses[first:], state, history[first:]


def check_export(model: dict, saved: Path, tmp: Path) -> list[str]:
    """`tetrad convert --to-hf` of A's checkpoint holds its logical model tensors bitwise, by the
    names of the architecture it exports as (a mixture of experts': one tensor per expert)."""
    from safetensors.torch import load_file
    from tetrad.cli import main
    from tetrad.train.hf_architectures import exported_type, hf_name
    from tetrad.train.hf_moe import split_experts
    out = tmp / "hf"
    if main(["convert", str(saved), "--to-hf", str(out)]) != 0:
        return ["convert --to-hf failed"]
    exported = load_file(out / "model.safetensors")
    m = tiny_config(model=model).model
    kind = exported_type(m)
    state = split_experts({k[len("model."):]: v for k, v in read_logical(saved).items() if k.startswith("model.")})
    logical = {hf_name(k, kind, m.n_layers): v for k, v in state.items()}
    if exported.keys() != logical.keys():
        return [f"export keys differ: {sorted(set(exported) ^ set(logical))[:6]}"]
    return [f"export of {k} differs" for k in logical if not torch.equal(exported[k], logical[k].to(exported[k].dtype))
            or exported[k].dtype != logical[k].dtype][:3]


def run_pair(model: dict, a: dict, b: dict, tmp: Path, export: bool) -> list[str]:
    cfg_a = config(model, a, tmp / "a", every=SAVED)
    run_a = train_layout(cfg_a, timeout_s=180)
    saved = tmp / "a" / "checkpoints" / f"step_{SAVED:08d}"
    cfg_b = config(model, b, tmp / "b", resume=str(saved))
    run_b = train_layout(cfg_b, timeout_s=180)
    problems = [f"resumed history starts at step {run_b[2][0]['step']}"] if run_b[2][0]["step"] != SAVED + 1 else []
    problems += check_resave(model, a, b, saved, tmp)
    if same_run(a, b):
        problems += [f"same layout: {p}" for p in compare(run_b, slice_steps(run_a, SAVED), False, exact=True)]
    wide = any(x["parallel"].get("tp", 1) > 1 or x["parallel"].get("cp", 1) > 1 for x in (a, b))
    if exact_math(a):
        ref = train_layout(config(model, one_process(a), tmp / "ref", every=SAVED))
        problems += [f"A vs one process: {p}" for p in compare(run_a, ref, wide)]
    # The same checkpoint resumed in one process (B's train section and dtype): what B must do.
    ref_b = train_layout(config(model, one_process(b, b["train"]["dtype"]), tmp / "ref-b", resume=str(saved)))
    if exact_math(b):
        problems += [f"B vs one process: {p}" for p in compare(run_b, ref_b, wide)]
    else:  # low precision or a lossy codec: the same run, roughly (rank-4 PowerSGD drops the most)
        band = 0.2 if b["parallel"].get("grad_codec") == "powersgd" else 5e-2
        problems += close("B loss vs one process (loose)", torch.tensor(run_b[0]), torch.tensor(ref_b[0]), band, 0)
        skipped = [[r["skipped"] for r in run[2]] for run in (run_b, ref_b)]
        problems += [f"skipped steps differ: B {skipped[0]}, one process {skipped[1]}"] if skipped[0] != skipped[1] else []
    if export:
        problems += check_init_from(model, b, saved, tmp)
        if exportable(model):
            problems += check_export(model, saved, tmp)
    return problems


def check_init_from(model: dict, b: dict, saved: Path, tmp: Path) -> list[str]:
    """A fresh run under B from A's weights (checkpoint.init_from) follows one process doing the same."""
    run = train_layout(config(model, b, tmp / "init", init_from=str(saved)))
    ref = train_layout(config(model, one_process(b, b["train"]["dtype"]), tmp / "init-ref", init_from=str(saved)))
    if exact_math(b):
        wide = b["parallel"].get("tp", 1) > 1 or b["parallel"].get("cp", 1) > 1
        # A fresh AdamW on trained weights moves near-zero-gradient elements by +-lr whatever the
        # sign noise: one process alone moves them by 1.8e-4 between micro_batch 1 and 4 (case
        # 30057), and its step-4 grad norm from 1.91 to 2.08 (case 60015).
        return [f"init_from: {p}" for p in compare(run, ref, wide, param_atol=2e-3, norm_rtol=0.1)]
    return close("init_from first loss (loose)", torch.tensor(run[0][:1]), torch.tensor(ref[0][:1]), 1e-2, 0)


def exportable(model: dict) -> bool:
    """Whether `--to-hf` takes the model: some transformers architecture computes it."""
    from tetrad.train.hf_architectures import check_exportable
    try:
        check_exportable(tiny_config(model=model).model)
    except ConfigError:
        return False
    return True


def refusal(model: dict, layout: dict) -> str | None:
    try:
        config(model, layout, Path(tempfile.gettempdir()) / "unused")
    except ConfigError as e:
        return str(e)
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--count", type=int, default=10)
    ap.add_argument("--export-every", type=int, default=4, help="export every Nth pair to HF")
    ap.add_argument("--log", type=Path, default=None, help="append one JSON line per pair")
    args = ap.parse_args(argv)
    failures = 0
    for i in range(args.count):
        case = args.seed * 10_000 + i
        model, a, b = draw_pair(random.Random(case))
        record = {"case": case, "model": model, "a": a, "b": b}
        refused = refusal(model, a) or refusal(model, b)
        t0 = time.time()
        if refused:
            record.update(status="refused", message=refused)
        else:
            with tempfile.TemporaryDirectory(prefix="fuzz-resume-") as tmp:
                try:
                    problems = run_pair(model, a, b, Path(tmp), export=i % args.export_every == 0)
                except Exception as e:  # a crash is a finding too
                    problems = [f"{type(e).__name__}: {' | '.join(traceback.format_exception_only(e))[-1500:]}"]
            record.update(status="FAIL" if problems else "ok", problems=problems)
            failures += bool(problems)
        record["seconds"] = round(time.time() - t0, 1)
        line = json.dumps(record)
        print(line, flush=True)
        if args.log:
            with open(args.log, "a") as f:
                f.write(line + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
