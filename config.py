"""YAML configs validated into dataclasses, shared by train.py, train_sft.py, evaluate.py and ablate.py.

A config file is nested sections of plain keys. Unknown keys, wrong types, values outside a
`Literal` and values outside a key's range (each section's `validate()`, built from the checks
below) stop the run before any work, with `config error: <key>: <what is allowed>, got <value>`.
`--set section.key=value` overrides any key (the value is parsed as YAML); several config files
merge in order, later files winning.

This module imports nothing heavy, so an entry point can report a bad config quickly.
"""

import dataclasses
import os
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

Config = TypeVar("Config")


class InputError(ValueError):
    """A problem with what the user gave: reported as one line (no traceback) and exit code 2."""

    label = "error"


class ConfigError(InputError):
    label = "config error"


class DataError(InputError):
    label = "data error"


def exit_on_input_error(error: InputError) -> typing.NoReturn:
    """What every entry point does with an InputError: `<label>: <message>` on stderr, exit code 2."""
    print(f"{error.label}: {error}", file=sys.stderr)
    raise SystemExit(2)


# ----------------------------------------------------------------------------- range checks for validate()
# Each takes the section and a field name, so a check is one line next to the fields it guards;
# build() puts the section in front of the key. None (an optional key left unset) always passes.


def check(ok: bool, key: str, allowed: str, value) -> None:
    if not ok:
        raise ConfigError(f"{key}: {allowed}, got {value!r}")


def at_least(section, name: str, minimum: float) -> None:
    value = getattr(section, name)
    check(value is None or value >= minimum, name, f"must be >= {minimum}", value)


def above(section, name: str, bound: float) -> None:
    value = getattr(section, name)
    check(value is None or value > bound, name, f"must be > {bound}", value)


def within(section, name: str, low: float, high: float, closed: str = "[]") -> None:
    """`closed` says which ends are included: "[]", "[)", "(]" or "()"."""
    value = getattr(section, name)
    ok = value is None or ((low <= value) if closed[0] == "[" else (low < value)) and (
        (value <= high) if closed[1] == "]" else (value < high))
    check(ok, name, f"must be in {closed[0]}{low}, {high}{closed[1]}", value)


def betas(section, name: str = "betas") -> None:
    value = getattr(section, name)
    check(all(0 <= beta < 1 for beta in value), name, "each must be in [0, 1)", list(value))


DEVICE = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


def device(section, name: str = "device") -> None:
    check(bool(DEVICE.fullmatch(getattr(section, name))), name, "must be auto, cpu, cuda, cuda:N or mps",
          getattr(section, name))


def plain_name(section, name: str) -> None:
    """A name that becomes one directory level (run_name): no separators, no '..', not empty."""
    value = getattr(section, name)
    check(value is None or (value.strip() and value not in (".", "..") and not re.search(r"[/\\]|\.\.", value)),
          name, "must be a plain name (no '/', '\\' or '..'; it names one directory)", value)


def expand_path(path) -> str:
    return os.path.expandvars(os.path.expanduser(str(path)))


def paths(section, *names: str) -> None:
    """Expand `~` and $VARIABLES in path keys (in place); an empty path is an error."""
    for name in names:
        value = getattr(section, name)
        if value is not None:
            check(bool(value.strip()), name, "must be a non-empty path", value)
            setattr(section, name, expand_path(value))


def common_run_keys(section) -> None:
    """The keys every entry point's top level shares."""
    plain_name(section, "run_name")
    at_least(section, "seed", 0)
    device(section)
    at_least(section, "cpu_threads", 1)


def _describe(kind) -> str:
    if typing.get_origin(kind) is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(kind))
    return getattr(kind, "__name__", str(kind))


def _coerce(value: Any, kind, key: str) -> Any:
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (arg for arg in args if arg is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError as error:
                errors.append(str(error))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: {value!r} is not {kind}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: {value!r} is not allowed; use {_describe(kind)}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if origin is tuple and args[-1] is not Ellipsis:  # fixed length, e.g. betas: tuple[float, float]
            if len(value) != len(args):
                raise ConfigError(f"{key}: expected {len(args)} values, got {value!r}")
            return tuple(_coerce(v, k, key) for v, k in zip(value, args))
        items = [_coerce(v, args[0], key) for v in value]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(kind):
        return build(kind, value, prefix=key)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):
        try:  # PyYAML reads 1e-5 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if kind is Any or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"{key}: expected {_describe(kind)}, got {value!r}")


def build(schema: type[Config], values: dict | None, prefix: str = "") -> Config:
    """Validate a (nested) dict into the dataclass `schema`."""
    values = values or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a section of keys, got {values!r}")
    hints = typing.get_type_hints(schema)
    names = [field.name for field in dataclasses.fields(schema)]
    unknown = [key for key in values if key not in names]
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"unknown key '{_join(prefix, unknown[0])}' in {where}; valid keys: {', '.join(names)}")
    kwargs = {}
    for field in dataclasses.fields(schema):
        key = _join(prefix, field.name)
        if field.name in values:
            kwargs[field.name] = _coerce(values[field.name], hints[field.name], key)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required key '{key}'")
    config = schema(**kwargs)
    if hasattr(config, "validate"):
        try:
            config.validate()
        except ConfigError as error:  # a section names its own keys; the full key adds the section
            message = str(error)
            raise ConfigError(message if not prefix or message.startswith(prefix + ".") else _join(prefix, message)) from None
    return config


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def apply_override(values: dict, assignment: str) -> None:
    """Apply one `section.key=value` to a nested dict in place."""
    if "=" not in assignment:
        raise ConfigError(f"--set expects section.key=value, got {assignment!r}")
    dotted, raw = assignment.split("=", 1)
    *sections, key = dotted.strip().split(".")
    node = values
    for section in sections:
        node = node.setdefault(section, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{section}' is not a section")
    try:
        node[key] = yaml.safe_load(raw)
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {dotted}: the value is not valid YAML ({_yaml_problem(error)})") from None


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge: sections merge, plain keys in `override` win."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def read_yaml(path) -> dict:
    path = Path(expand_path(path))
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a BOM is fine; UTF-16 or binary is not
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        column = error.start - (raw.rfind(b"\n", 0, error.start) + 1) + 1
        raise ConfigError(f"{path}: line {line}, column {column}: not UTF-8 text (save the config as UTF-8)") from None
    if "\0" in text:
        raise ConfigError(f"{path}: line {text[: text.index(chr(0))].count(chr(10)) + 1}: a NUL byte; "
                          f"this is not a YAML text file") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: {_yaml_problem(error)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return values


def load(schema: type[Config], paths=None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read the YAML file(s) in `paths` (one path or a list; later files win, on top of `base`),
    apply --set overrides, validate into `schema`."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    values = base or {}
    for path in paths or []:
        values = merge(values, read_yaml(path))
    for assignment in overrides:
        apply_override(values, assignment)
    return build(schema, values)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def dump(config, path) -> None:
    Path(path).write_text(to_yaml(config))
