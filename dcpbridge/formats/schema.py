"""The one validator of YAML documents (configuration and layouts): typed access to a mapping
whose every error names the file and the key path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml


class Doc:
    """One mapping of a YAML document; errors are ``error`` instances naming ``where`` and the
    key path (``label`` stands for the mapping itself when it is the document's root)."""

    def __init__(
        self, doc: Any, where: str, path: str, error: type[Exception], label: str = ""
    ) -> None:
        self.where, self.path, self.error_type, self.label = where, path, error, label
        if doc is None:
            doc = {}
        if not isinstance(doc, Mapping):
            raise self.fail(f"expected a mapping, got {type(doc).__name__}")
        self.doc = doc

    def key(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def fail(self, message: str, path: str | None = None) -> Exception:
        """An error about ``path`` (default: this mapping itself)."""
        at = self.path or self.label if path is None else path
        return self.error_type(
            f"{self.where}: {at}: {message}" if at else f"{self.where}: {message}"
        )

    def error(self, name: str, message: str) -> Exception:
        return self.fail(message, self.key(name))

    def only(self, allowed: set[str]) -> Doc:
        unknown = sorted(str(k) for k in self.doc if k not in allowed)
        if unknown:
            raise self.fail(f"unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}")
        return self

    def get(self, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
        value = self.doc.get(name, default)
        if value is None:
            return default
        kinds = kind if isinstance(kind, tuple) else (kind,)
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            want = " or ".join(t.__name__ for t in kinds)
            raise self.error(name, f"expected {want}, got {type(value).__name__}")
        return value

    def required(self, name: str, kind: type) -> Any:
        if self.doc.get(name) is None:
            raise self.error(name, "is required")
        return self.get(name, kind)

    def integer(self, name: str, default: Any = None, *, minimum: int | None = None) -> Any:
        """An integer (never a bool) of at least ``minimum``; ``default`` when absent."""
        if name not in self.doc:
            return default
        return check_int(self.doc[name], self, self.key(name), minimum)

    def sub(self, name: str, label: str = "") -> Doc:
        return Doc(self.doc.get(name), self.where, self.key(name), self.error_type, label)

    def item(self, value: Any, path: str) -> Doc:
        """A mapping nested in a list (``path`` like ``rules[0]``)."""
        return Doc(value, self.where, path, self.error_type)


def check_int(value: Any, doc: Doc, path: str, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise doc.fail(f"expected an integer, got {type(value).__name__}", path)
    if minimum is not None and value < minimum:
        raise doc.fail(f"must be >= {minimum}, got {value}", path)
    return value


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key twice in one mapping (it kept the last, silently:
    a layout's second ``tp:`` or a config's second ``every:`` replaced the first unseen)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # ``<<:`` keys may be overridden
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    f"found the key {key!r} twice (first on line {first.start_mark.line + 1})",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


def read_yaml(path: str, what: str, error: type[Exception]) -> Any:
    """The document in YAML file ``path``; ``error`` names the file when it cannot be read."""
    try:
        with open(path) as f:
            return yaml.load(f, Loader=_StrictLoader)  # a SafeLoader: no object tags
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise error(f"{path}: not valid YAML: {e}") from None
