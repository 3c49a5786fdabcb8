"""YAML configs validated into dataclasses, shared by train.py, train_sft.py, evaluate.py and ablate.py.

A config file is nested sections of plain keys. Unknown keys, wrong types and values outside a
`Literal` stop the run before any work, with a message naming the key and what is allowed.
`--set section.key=value` overrides any key (the value is parsed as YAML).
"""

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

Config = TypeVar("Config")


class ConfigError(ValueError):
    pass


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
        config.validate()
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
    node[key] = yaml.safe_load(raw)


def merge(base: dict, override: dict) -> dict:
    """Recursive dict merge: sections merge, plain keys in `override` win."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def read_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    values = yaml.safe_load(path.read_text()) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    return values


def load(schema: type[Config], path=None, overrides: list[str] = (), base: dict | None = None) -> Config:
    """Read YAML (optionally on top of `base`), apply --set overrides, validate into `schema`."""
    values = merge(base or {}, read_yaml(path) if path else {})
    for assignment in overrides:
        apply_override(values, assignment)
    return build(schema, values)


def to_dict(config) -> dict:
    return dataclasses.asdict(config)


def to_yaml(config) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)


def dump(config, path) -> None:
    Path(path).write_text(to_yaml(config))
