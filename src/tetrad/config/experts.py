"""Mixture-of-experts rules (model.n_experts and the keys that shape its layers, parallel.ep),
checked before any process starts, each refusal naming the fix."""

from __future__ import annotations

from tetrad.config.sections import Config, ConfigError, expert_parallel_blocker
from tetrad.config.wording import divisors


def check_experts(cfg: Config) -> None:
    """Top-k within the experts, each expert's (and the shared expert's) hidden width split over
    tp, dense_layers naming layers of the model, the MoE-only keys only with experts."""
    m, tp = cfg.model, cfg.parallel.tp
    if not m.n_experts:
        for key, used in (("shared_expert_ffn_hidden", m.shared_expert_ffn_hidden), ("dense_layers", m.dense_layers),
                          ("shared_expert_gate", m.shared_expert_gate),
                          ("router_bias_update_rate", m.router_bias_update_rate),
                          ("router_score", m.router_score != "softmax"), ("expert_weight_scale", m.expert_weight_scale != 1),
                          ("expert_groups", m.expert_groups != 1),
                          ("expert_groups_per_token", m.expert_groups_per_token != 1),
                          ("expert_group_score_top", m.expert_group_score_top != 2)):
            if used:
                raise ConfigError(f"model.{key} shapes mixture-of-experts layers, and this model has none "
                                  f"(model.n_experts=0); unset it, or set model.n_experts")
    if m.n_experts and m.experts_per_token > m.n_experts:
        raise ConfigError(f"model.experts_per_token={m.experts_per_token} is more than n_experts={m.n_experts}; "
                          f"use experts_per_token in 1..{m.n_experts}")
    _check_expert_groups(m)
    if m.n_experts and m.expert_hidden % tp:
        raise ConfigError(f"tp={tp} does not divide the experts' hidden width {m.expert_hidden} "
                          f"(model.expert_ffn_hidden, or ffn_hidden where 0); use tp in {divisors(m.expert_hidden)}")
    if m.shared_expert_ffn_hidden % tp:
        raise ConfigError(f"tp={tp} does not divide model.shared_expert_ffn_hidden={m.shared_expert_ffn_hidden}; "
                          f"use tp in {divisors(m.shared_expert_ffn_hidden)}")
    if m.shared_expert_gate and not m.shared_expert_ffn_hidden:
        raise ConfigError("model.shared_expert_gate scales the shared expert's output, and there is none "
                          "(model.shared_expert_ffn_hidden=0); set shared_expert_ffn_hidden, or shared_expert_gate=false")
    outside = sorted({i for i in m.dense_layers if not 0 <= i < m.n_layers})
    if outside or len(set(m.dense_layers)) != len(m.dense_layers):
        raise ConfigError(f"model.dense_layers={m.dense_layers} must name distinct layers in 0..{m.n_layers - 1} "
                          f"(n_layers={m.n_layers}), each once")
    if m.n_experts and len(m.dense_layers) == m.n_layers:
        raise ConfigError(f"model.dense_layers names every layer (n_layers={m.n_layers}): no layer has the "
                          f"{m.n_experts} experts; leave one out, or set model.n_experts=0 for a dense model")
    if m.dense_layers and m.ffn_hidden % tp:
        raise ConfigError(f"tp={tp} does not divide ffn_hidden={m.ffn_hidden}, the dense layers' MLP width "
                          f"(model.dense_layers); use tp in {divisors(m.ffn_hidden)}")
    _check_expert_parallel(cfg)


def _check_expert_groups(m) -> None:
    """Group-limited routing (model/routing.py): equal groups of expert_group_score_top experts or
    more (a group's score sums its best that many), each token keeping at most every group and
    enough experts for its k; expert_group_score_top set only where there are groups."""
    e, groups, kept, k, top = m.n_experts, m.expert_groups, m.expert_groups_per_token, m.experts_per_token, \
        m.expert_group_score_top
    if kept > groups:
        raise ConfigError(f"model.expert_groups_per_token={kept} is more than expert_groups={groups}; "
                          f"use expert_groups_per_token in 1..{groups}, or set model.expert_groups "
                          f"(to {kept} or more)")
    if groups == 1 and top != 2 and e:
        raise ConfigError(f"model.expert_group_score_top={top} scores expert groups, and this model has none "
                          f"(model.expert_groups=1); unset it, or set model.expert_groups")
    if groups == 1 or not e:
        return
    if e % groups or e // groups < top:
        raise ConfigError(f"model.expert_groups={groups} must divide n_experts={e} into groups of {top} experts or "
                          f"more (a group's score is the sum of its best {top}: model.expert_group_score_top); use "
                          f"expert_groups in {[g for g in divisors(e) if e // g >= top]}")
    if k > kept * (e // groups):
        raise ConfigError(f"model.experts_per_token={k} is more than the {kept * (e // groups)} experts of "
                          f"expert_groups_per_token={kept} groups of {e // groups}; use expert_groups_per_token >= "
                          f"{-(-k // (e // groups))} or experts_per_token <= {kept * (e // groups)}")


def _check_expert_parallel(cfg: Config) -> None:
    """parallel.ep: whole experts per rank, over blocks of dp ranks; hybrid ZeRO blocks that hold
    whole EP groups (docs/design.md "Expert parallelism")."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    if not m.n_experts:
        raise ConfigError(f"parallel.ep={p.ep} splits mixture-of-experts layers' experts, and this model has none "
                          f"(model.n_experts=0); set parallel.ep=1, or model.n_experts")
    if m.n_experts % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide model.n_experts={m.n_experts} (each rank holds whole "
                          f"experts); use ep in {[e for e in divisors(m.n_experts) if not p.dp % e]}")
    if p.dp % p.ep:
        raise ConfigError(f"parallel.ep={p.ep} must divide dp={p.dp} (the experts split over blocks of dp ranks); "
                          f"use ep in {[e for e in divisors(p.dp) if not m.n_experts % e]}")
    blocker = expert_parallel_blocker(p)
    if blocker:
        raise ConfigError(blocker)
