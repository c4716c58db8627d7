"""Loading: a TOML file, then `--section.key=value` overrides, then the preset, type-checked key
by key and validated; every error is a ConfigError of one line naming the fix."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

from tetrad.config.aliases import FLAG_ALIASES, places_of, suggest_key, suggest_section
from tetrad.config.sections import SECTIONS, Config, ConfigError, ModelConfig
from tetrad.config.wording import did_you_mean
from tetrad.config.validation import validate
from tetrad.presets import PRESETS


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None,
                world_size: int | None = None, runtime: bool = True,
                model_from_inputs: Callable[[dict], dict] | None = None) -> Config:
    """Read a TOML file (optional), apply overrides, resolve the preset, type-check and validate.

    `overrides` is a list of `section.key=value` strings (values parsed as TOML literals, falling
    back to plain strings; a string key takes the text as typed; `section.table.key=value` sets
    one key of a table, as TOML's dotted keys do) or a nested dict. `world_size`, when known
    (under torchrun), must equal dp*tp*pp*cp. `runtime=False` (estimate/plan) also admits what
    only the cost model knows (fp8).
    `model_from_inputs(raw)` gives [model] keys that the run's inputs decide (the data's vocabulary,
    the shape of the weights it starts from): above the preset, below the user's own keys.
    """
    raw = read_toml(Path(path)) if path is not None else {}
    _check_tables(raw)
    if isinstance(overrides, dict):
        for section, values in overrides.items():
            raw.setdefault(section, {}).update(values)
    else:
        for item in overrides or []:
            section, keys, value = _parse_override(item)
            _set(raw.setdefault(section, {}), keys, value)
    cfg = _build(raw, model_from_inputs(raw) if model_from_inputs else {})
    validate(cfg, world_size, runtime)
    return cfg


def read_toml(path: Path) -> dict:
    """A TOML file as a dict (tomli before Python 3.11); a ConfigError of one line naming the problem."""
    if path.is_dir():
        inside = sorted(str(p) for p in path.glob("*.toml"))[:4]
        such = f" such as {', '.join(inside)}" if inside else ""
        raise ConfigError(f"config file {path} is a folder; give a TOML file{such}")
    if not path.is_file():
        toml = path.with_name(path.name + ".toml")
        meant = f" (did you mean {toml}?)" if toml.is_file() else ""
        raise ConfigError(f"config file {path} does not exist{meant}")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8-sig"))  # -sig: a BOM some editors write
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a text file (not UTF-8); give a TOML config") from None
    except tomllib.TOMLDecodeError as e:
        other = {".yaml": "YAML", ".yml": "YAML", ".json": "JSON"}.get(path.suffix.lower())
        hint = f"; tetrad's config is TOML, not {other}: see configs/demo.toml for the form" if other else ""
        raise ConfigError(f"{path} is not valid TOML: {e}{hint}") from None


def _check_tables(raw: dict) -> None:
    for section, values in raw.items():
        places = places_of(section) if not isinstance(values, dict) else []
        if section not in SECTIONS and places:
            key = places[0].partition(".")[2]
            tables = " or ".join(f"[{p.partition('.')[0]}]" for p in places)
            raise ConfigError(f"{section} = {_short(values)} is outside any table; put it under {tables}"
                              + (f" as {key}" if key != section else ""))
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]{suggest_section(section)}; "
                              f"sections are {', '.join(SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table of keys (a [{section}] header and key = value lines), "
                              f"got {_short(values)}")


# Flags other launchers take the config file by (torchtitan's --job.config_file).
CONFIG_FLAGS = ("c", "cfg", "config", "config_file", "config-file", "config_path")


def _fix_for(name: str, value: str) -> str:
    """The override a mistyped `name=value` meant: its own section.key, or the key a bare name is."""
    places = [name] if "." in name else places_of(name)
    return f"write --{places[0]}={value}" if places else "e.g. --parallel.tp=2"


def check_override(arg: str, following: str | None = None) -> None:
    """Refuse a command-line argument that is not `--section.key=value`, naming the form meant;
    `following` is the argument after it (the value of `--section.key value`, or a config path)."""
    body = arg.lstrip("-")
    name, eq, text = body.partition("=")
    value = text or (following if following and not following.startswith("-") else "VALUE")
    if name.rsplit(".", 1)[-1] in CONFIG_FLAGS:
        raise ConfigError(f"give CONFIG as a plain argument, without {arg.split('=')[0]}: "
                          f"e.g. tetrad train {value} --train.steps=100")
    if "." not in name:
        switch = FLAG_ALIASES.get(name.replace("-", "_"))
        fix = f"write --{switch}" if switch and text in ("", "true") else _fix_for(name, value)
        raise ConfigError(f"override {arg!r} must look like --section.key=value; {fix}")
    if not eq:
        value = "true" if _hint(*name.split(".", 1)) is bool else value  # Megatron's --sequence-parallel
        raise ConfigError(f"override {arg} needs '=' before its value: write --{name}={value}")
    if arg.startswith("-") and not arg.startswith("--"):
        raise ConfigError(f"overrides start with two dashes: write --{body}")
    if text[:1] in ("[", "{") and following and not following.startswith("-") and not _is_toml(text):
        raise ConfigError(f"the shell cut {arg} {following} at a space; quote the whole override: "
                          f"'{arg} {following}'")


def split_config_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """CONFIG is the one argument that is not a --section.key=value override."""
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            check_override(arg, argv[i + 1] if i + 1 < len(argv) else None)
    paths = [a for a in argv if not a.startswith("-")]
    for arg in paths:
        if "=" in arg and not Path(arg).exists():  # `tetrad train train.steps=10`
            name, _, value = arg.partition("=")
            raise ConfigError(f"{arg!r} is neither a config file nor an override (overrides start with two "
                              f"dashes); {_fix_for(name, value)}")
    if len(paths) > 1:
        raise ConfigError(f"expected at most one CONFIG file, got {paths}")
    return (paths[0] if paths else None), [a for a in argv if a.startswith("-")]


def _is_toml(text: str) -> bool:
    try:
        tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return False
    return True


def _parse_override(item: str) -> tuple[str, list[str], Any]:
    """(section, the key's path in it, value) of `--section.key=value`."""
    check_override(item)
    dotted, text = item.lstrip("-").split("=", 1)
    section, *keys = dotted.split(".")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text  # a bare word such as 1f1b or runs/x
    if len(keys) == 1 and _hint(section, keys[0]) is str and not isinstance(value, (str, list, dict)):
        value = text  # train.profile=4, run.dir=2024-01-01: the text typed
    return section, keys, value


def _hint(section: str, key: str) -> Any:
    """The type of section.key; None for an unknown one (loading names it later)."""
    return typing.get_type_hints(SECTIONS[section]).get(key) if section in SECTIONS else None


def _set(table: dict, keys: list[str], value: Any) -> None:
    """table[k0][k1]...[kn] = value, creating (or replacing non-table) levels on the way."""
    for key in keys[:-1]:
        if not isinstance(table.get(key), dict):
            table[key] = {}
        table = table[key]
    table[keys[-1]] = value


def _build(raw: dict, from_inputs: dict) -> Config:
    _check_tables(raw)
    model_raw = dict(raw.get("model", {}))
    preset = model_raw.get("preset", ModelConfig.preset)
    if not isinstance(preset, str) or preset not in PRESETS:
        weights = ("; to start from a Hugging Face model's weights (its shape follows them), download it and set "
                   "checkpoint.init_from=FOLDER" if "/" in str(preset) else "")
        raise ConfigError(f"unknown model.preset {preset!r}{did_you_mean(str(preset), PRESETS)}; "
                          f"presets are {', '.join(PRESETS)}{weights}")
    model_raw = {**PRESETS[preset], **from_inputs, **model_raw, "preset": preset}
    sections = {}
    for name, cls in SECTIONS.items():
        values = model_raw if name == "model" else dict(raw.get(name, {}))
        sections[name] = _build_section(name, cls, values)
    return Config(**sections)


def _build_section(section: str, cls: type, values: dict):
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"unknown key {section}.{key}{suggest_key(section, key)}; "
                              f"[{section}] keys are {', '.join(known)}")
        values[key] = _check_type(f"{section}.{key}", value, hints[key])
    return cls(**values)


def _check_type(name: str, value: Any, hint: Any) -> Any:
    """Return value (ints widened to float where a float is wanted) or raise a ConfigError."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (Union, types.UnionType) else (hint,)
    for option in options:
        if typing.get_origin(option) is Literal:
            if any(value == v and type(value) is type(v) for v in typing.get_args(option)):
                return value
        elif option is bool:
            if isinstance(value, bool):
                return value
        elif option is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return _as_float(name, value)
        elif option in (int, str):
            if isinstance(value, option) and not isinstance(value, bool):
                return value
        elif typing.get_origin(option) is list:
            item = typing.get_args(option)[0]
            if isinstance(value, list):
                return [_check_type(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
        elif typing.get_origin(option) is dict:
            item = typing.get_args(option)[1]
            if isinstance(value, dict):
                return {k: _check_type(f"{name}.{k}", v, item) for k, v in value.items()}
    raise ConfigError(f"{name} must be {_describe(options)}, got {_short(value)} ({type(value).__name__})"
                      + _as_choice_hint(value, options) + _as_list_hint(value, options) + _as_number_hint(value, options))


def _as_choice_hint(value: Any, options: tuple) -> str:
    """' (did you mean ...?)' for a word close to one of the allowed ones (BF16 for bf16)."""
    words = [w for o in options if typing.get_origin(o) is Literal for w in typing.get_args(o) if isinstance(w, str)]
    return did_you_mean(value, words) if isinstance(value, str) and words else ""


def _as_number_hint(value: Any, options: tuple) -> str:
    """'; write it as 0.0003' for a number TOML does not read (.0003, 3.) where a number is wanted."""
    if not isinstance(value, str) or float not in options:
        return ""
    try:
        number = float(value)
    except ValueError:
        return ""
    return f"; write it as {number!r} (TOML wants a digit on each side of '.')" if math.isfinite(number) else ""


def _as_list_hint(value: Any, options: tuple) -> str:
    """'; write it as [2,2]' when a list was wanted and the text, bracketed, is one."""
    if not isinstance(value, str) or not any(typing.get_origin(o) is list for o in options):
        return ""
    return f"; write it as [{value}]" if _is_toml(f"[{value}]") else ""


def _short(value: Any) -> str:
    """repr(value), cut to fit on the error's one line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _as_float(name: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(f"{name} = {_short(value)} is too large for a number; see its range in "
                          "tetrad.config.validation.RANGES") from None


def _describe(options: tuple) -> str:
    words = []
    for option in options:
        if typing.get_origin(option) is Literal:
            words.append("one of " + ", ".join(repr(v) for v in typing.get_args(option)))
        elif typing.get_origin(option) is list:
            words.append("a list of " + {int: "integers", float: "numbers", str: "strings"}[typing.get_args(option)[0]])
        elif typing.get_origin(option) is dict:
            words.append("a table")
        else:
            words.append({bool: "true or false", int: "an integer", float: "a number",
                          str: "a string"}[option])
    return " or ".join(words)
