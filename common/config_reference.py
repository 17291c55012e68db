"""The configuration reference (docs/configuration.md) written from the pydantic model itself: every key with its
type, default, allowed values and meaning, so that the reference cannot drift from what `load_config` accepts."""

from __future__ import annotations

import types
import typing

from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from blockspec.common.config import BlockspecConfig

HEADER = "| key | type | default | allowed | meaning |\n|---|---|---|---|---|"


def _section(annotation) -> tuple[type[BaseModel], str] | None:
    """(model, key suffix) where a field holds a section: a model (or unset), or a mapping of names to models."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section: `X | None`
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        annotation = models[0] if len(models) == 1 else annotation
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, ""
    if typing.get_origin(annotation) is dict:
        value = typing.get_args(annotation)[1]
        if isinstance(value, type) and issubclass(value, BaseModel):
            return value, ".NAME"
    return None


def _type(annotation) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return "string"
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type(a) for a in args if a is not type(None))
    return {int: "integer", float: "number", bool: "boolean", str: "string"}.get(annotation, str(annotation))


def _allowed(field: FieldInfo) -> str:
    literal = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                    if typing.get_origin(a) is typing.Literal), None)
    if literal is not None:
        return ", ".join(f"`{v}`" for v in typing.get_args(literal))
    signs = {Ge: ("ge", ">="), Gt: ("gt", ">"), Le: ("le", "<="), Lt: ("lt", "<")}
    return ", ".join(f"{signs[type(m)][1]} {getattr(m, signs[type(m)][0])}" for m in field.metadata
                     if type(m) in signs)


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`" if not isinstance(value, (BaseModel, dict)) else ""


def _rows(model: type[BaseModel], prefix: str, sections: list[str]) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        nested = _section(field.annotation)
        if nested is not None:
            sections.append((f"{key}{nested[1]}", field.description or "", nested[0]))
            continue
        rows.append(f"| `{key}` | {_type(field.annotation)} | {_default(field)} | {_allowed(field)} | "
                    f"{field.description or ''} |")
    return rows


def reference() -> str:
    """The reference as markdown: one table per section of config.yaml, in the order of the schema."""
    out, pending = [], [(name, f.description or "", _section(f.annotation)[0])
                        for name, f in BlockspecConfig.model_fields.items()]
    while pending:
        key, about, model = pending.pop(0)
        nested: list = []
        out += [f"### `{key}`", "", f"{about[:1].upper()}{about[1:]}.", "", HEADER, *_rows(model, f"{key}.", nested), ""]
        pending[:0] = nested
    return "\n".join(out)
