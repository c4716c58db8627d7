"""Property-based fuzz of the config: every invalid input is a ConfigError of one line (never
another exception, never a traceback), every numeric key outside its stated range is caught,
and every valid input validates. The bulk calls validation directly; a sample runs `tetrad
train` as a user would (in this process) and must exit 2 with one line before any rank starts."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tetrad.cli import main
from tetrad.config import RANGES, SECTIONS, ConfigError, load_config

BASE = {"model": {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 128, "seq_len": 32},
        "train": {"steps": 5, "global_batch": 8, "micro_batch": 2, "warmup": 2}}

# The ranges the issue asks for, stated here independently of the code: (low, high, low open,
# high open); floats must also be finite. Keys whose validity depends on others are left out.
SPEC = {
    "train.lr": (0, math.inf, True, True), "train.grad_clip": (0, math.inf, False, True),
    "train.weight_decay": (0, math.inf, False, True), "model.norm_eps": (0, math.inf, True, True),
    "model.rope_theta": (0, math.inf, True, True), "train.seed": (0, 2**63, False, True),
    "train.min_lr_ratio": (0, 1, False, False), "model.dropout": (0, 1, False, True),
    "checkpoint.every": (0, 2**31, False, True), "checkpoint.keep": (1, 2**31, False, True),
    "run.log_every": (1, 2**31, False, True), "train.eval_steps": (1, 2**31, False, True),
    "parallel.grad_bucket_mb": (0, math.inf, True, True), "train.steps": (1, 2**31, False, True),
}


def in_spec(key: str, value) -> bool:
    low, high, low_open, high_open = SPEC[key]
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return (value > low if low_open else value >= low) and (value < high if high_open else value <= high)


def _is_int_key(key: str) -> bool:
    section, name = key.split(".")
    return {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}[name] in (int, "int")


def numbers(key: str):
    """Anything numeric, from the edges of the key's range outwards, in the key's type and not."""
    low, high, _, _ = SPEC[key]
    edges = [low, high, -1, 0, 1, 2**63 - 1, 2**63, 2**64, -(2**63)]
    floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                       st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e-300, 1e300]))
    ints = st.one_of(st.integers(), st.sampled_from([int(e) for e in edges if math.isfinite(e)]))
    return ints if _is_int_key(key) else st.one_of(floats, ints)


def junk():
    """Values of the wrong kind for any key."""
    return st.one_of(st.text(max_size=8), st.booleans(), st.lists(st.integers(), max_size=2),
                     st.dictionaries(st.text(max_size=3), st.integers(), max_size=2), st.none())


def overrides(key: str, value) -> dict:
    section, name = key.split(".")
    merged = {s: dict(v) for s, v in BASE.items()}
    merged.setdefault(section, {})[name] = value
    merged.setdefault("run", {})["dir"] = "/tmp/tetrad-fuzz-never-written"
    return merged


def load(over: dict):
    """The config, or the one-line message; anything else (a traceback) fails the test."""
    try:
        return load_config(overrides=over), None
    except ConfigError as e:
        message = str(e)
        assert message and "\n" not in message, repr(message)
        return None, message


TRIED = {"invalid": 0, "caught": 0, "valid": 0}


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_numeric_keys_are_checked_against_their_range(data):
    key = data.draw(st.sampled_from(sorted(SPEC)))
    value = data.draw(numbers(key))
    cfg, message = load(overrides(key, value))
    if in_spec(key, value):
        TRIED["valid"] += 1
        assert cfg is not None, f"{key}={value!r} is valid but refused: {message}"
        stored = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        assert stored == (value if _is_int_key(key) else float(value))
    else:
        TRIED["invalid"] += 1
        assert message is not None, f"{key}={value!r} is out of range but accepted"
        assert key.split(".")[1] in message, message
        TRIED["caught"] += 1


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_any_value_for_any_key_is_a_config_or_one_line(data):
    section = data.draw(st.sampled_from(sorted(SECTIONS)))
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(SECTIONS[section])]))
    value = data.draw(st.one_of(junk(), numbers("train.lr"), numbers("train.seed")))
    load(overrides(f"{section}.{name}", value))  # asserts itself


@settings(max_examples=100, deadline=None)
@given(value=st.one_of(junk(), st.integers(), st.floats()))
def test_a_section_that_is_not_a_table_is_one_line(value, tmp_path_factory):
    path = tmp_path_factory.mktemp("toml") / "bad.toml"
    path.write_text(f"model = {_toml(value)}\n" if _toml(value) is not None else "model = 1\n")
    with pytest.raises(ConfigError, match=r"\[model\] must be a table") as err:
        load_config(path, ["--model.n_layers=2"])
    assert "\n" not in str(err.value)


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value) if abs(value) < 2**63 else None
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return '"' + "".join(c if 32 <= ord(c) < 127 and c not in '"\\' else f"\\U{ord(c):08x}" for c in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value if abs(v) < 2**63) + "]"
    return None  # a table or nothing: fall back to a number


def test_fuzz_figures_are_reported():
    """Runs after the fuzz above (file order): the counts go to the note."""
    print(f"config fuzz: {TRIED['invalid']} invalid numeric inputs tried, {TRIED['caught']} caught before spawn; "
          f"{TRIED['valid']} valid ones validated")
    assert TRIED["invalid"] == TRIED["caught"] > 50 and TRIED["valid"] > 20


# A sample through the command line, in this process (a fresh process's whole stderr for such a
# refusal: tests/test_config.py): exit 2, one line on stderr, no traceback, nothing started.
CLI_SAMPLE = [["--train.lr=nan"], ["--train.seed=9223372036854775808"]]


@pytest.mark.parametrize("args", CLI_SAMPLE, ids=[a[0] for a in CLI_SAMPLE])
def test_tetrad_train_refuses_in_one_line_before_spawn(args, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", *args, f"--run.dir={run_dir}"]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tetrad: config error: "), out.err
    assert args[0].split("=")[0].split(".")[1] in lines[0]
    assert not run_dir.exists() and "training" not in out.out


def test_every_numeric_key_has_a_stated_range():
    """A key added without a range would be accepted unchecked."""
    missing = [f"{s}.{f.name}" for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)
               if f.type in (int, float, "int", "float", "list[int]") and f"{s}.{f.name}" not in RANGES]
    assert missing == []
