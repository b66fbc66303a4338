"""A pickle reader that runs no code: it builds only what an explicit allow-list names.

``pickle.load`` calls whatever a pickle names (a ``__reduce__`` payload runs any function),
calls ``__setstate__`` of any class, and sizes buffers and its memo by numbers read from the
stream. This reader interprets the opcodes itself instead:

* ``GLOBAL``/``STACK_GLOBAL`` resolve only through the allow-list (and copyreg's two
  object-making helpers); any other name is refused before anything is imported or called.
* Instances of allowed classes are made with ``object.__new__`` and filled by ``BUILD`` with
  their known fields only: no ``__init__``, ``__setstate__`` or ``__reduce__`` of theirs runs.
* ``REDUCE`` calls only the allow-list's own factories, which check their arguments.
* Every length is checked against the bytes that remain, the memo is a dict (an index
  allocates nothing), and dict keys must be flat (hashing them cannot recurse).

Protocols 2 to 5 are read; persistent ids, extension codes, out-of-band buffers, sets and
the old text opcodes are refused. What comes back is unchecked data of allowed types: the
caller validates its structure before trusting it.
"""

from __future__ import annotations

import gc
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_PROTOCOL = 5
_MAX_LINE = 1024  # a GLOBAL's module or name line


@dataclass(frozen=True)
class Buildable:
    """A class made with ``object.__new__`` and filled with ``fields`` by ``BUILD``.

    ``from_tuple`` turns a tuple state (a ``__getstate__`` of the class's own) into fields;
    ``hashable``: instances may be dict keys (their fields are checked to be flat first).
    """

    cls: type
    fields: frozenset[str]
    from_tuple: Callable[[tuple[Any, ...]], dict[str, Any]] | None = None
    hashable: bool = False


@dataclass(frozen=True)
class Factory:
    """A function ``REDUCE`` may call: it checks its arguments and returns a finished value."""

    make: Callable[..., Any]


@dataclass(frozen=True)
class Constant:
    """A global that stands for a value (a dtype, a layout), never called."""

    value: Any


Entry = Buildable | Factory | Constant


class Refused(Exception):
    """The pickle needs something outside the allow-list (``what`` names it)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


class Malformed(Exception):
    """The pickle is not a well-formed pickle of allowed values."""


class _Copyreg:
    """copyreg's helpers that make an object of a class (``_reconstructor``, ``__newobj__``)."""

    def __init__(self, name: str) -> None:
        self.name = name


_OBJECT = object()  # ``builtins.object``, as the base that ``copyreg._reconstructor`` names
_COPYREG = {
    ("copyreg", "_reconstructor"): _Copyreg("_reconstructor"),
    ("copyreg", "__newobj__"): _Copyreg("__newobj__"),
    ("copyreg", "__newobj_ex__"): _Copyreg("__newobj_ex__"),
    ("builtins", "object"): _OBJECT,
}
# Python 2 module names that protocols 0-2 write for these (pickle's ``fix_imports``)
_PY2_MODULES = {"copy_reg": "copyreg", "__builtin__": "builtins"}
_FLAT = (str, int, float, bool, bytes, type(None))
_REFUSED_OPS = {
    b"P"[0]: "PERSID",
    b"Q"[0]: "BINPERSID",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    b"i"[0]: "INST",
    b"o"[0]: "OBJ",
    0x8F: "EMPTY_SET",
    0x90: "ADDITEMS",
    0x91: "FROZENSET",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
}
_U32 = struct.Struct("<I")
_I32 = struct.Struct("<i")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct(">d")


def _flat(value: Any) -> bool:
    """A value safe to hash: a primitive, or a tuple (or tuple subclass) of primitives."""
    if isinstance(value, tuple):
        return all(type(v) in _FLAT for v in value)
    return type(value) in _FLAT


class _Reader:
    """The machine's state: the bytes, the stack, the marks and the memo."""

    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Entry]) -> None:
        self.data, self.allowed = data, allowed
        self.kinds = {e.cls: e for e in allowed.values() if isinstance(e, Buildable)}
        self.unbuilt: dict[int, Any] = {}  # instances made here and not yet filled, by id
        self.protocol = 0

    # -- reading arguments --------------------------------------------------------------

    def take(self, pos: int, length: int) -> bytes:
        if length < 0 or pos + length > len(self.data):
            raise Malformed(f"a length of {length} at byte {pos} runs past the end")
        return self.data[pos : pos + length]

    def line(self, pos: int) -> tuple[str, int]:
        end = self.data.find(b"\n", pos, pos + _MAX_LINE)
        if end < 0:
            raise Malformed(f"no line end within {_MAX_LINE} bytes at byte {pos}")
        return self.data[pos:end].decode("utf-8"), end + 1

    # -- objects ------------------------------------------------------------------------

    def resolve(self, module: Any, name: Any) -> Any:
        if type(module) is not str or type(name) is not str:
            raise Malformed("a global's module and name must be strings")
        if self.protocol < 3:
            module = _PY2_MODULES.get(module, module)
        entry = self.allowed.get((module, name))
        if entry is None:
            entry = _COPYREG.get((module, name))
        if entry is None:
            raise Refused(f"{module}.{name}")
        return entry.value if isinstance(entry, Constant) else entry

    def new(self, kind: Any, args: Any, kwargs: Any = None) -> Any:
        """An empty instance of allowed class ``kind`` (no constructor arguments allowed)."""
        if not isinstance(kind, Buildable):
            raise Refused(f"making an instance of {_describe(kind)}")
        if args != () or kwargs not in (None, {}):
            raise Refused(f"constructor arguments for {_qualname(kind.cls)}")
        obj = object.__new__(kind.cls)
        self.unbuilt[id(obj)] = obj
        return obj

    def reduce(self, func: Any, args: Any) -> Any:
        if type(args) is not tuple:
            raise Malformed("REDUCE needs an argument tuple")
        if isinstance(func, Factory):
            return func.make(*args)
        if isinstance(func, _Copyreg):
            if func.name == "_reconstructor":
                if len(args) != 3 or args[1] is not _OBJECT or args[2] is not None:
                    raise Refused(
                        "copyreg._reconstructor with a base other than object, or a state"
                    )
                return self.new(args[0], ())
            if func.name == "__newobj__" and args:
                return self.new(args[0], args[1:])
            if func.name == "__newobj_ex__" and len(args) == 3:
                return self.new(args[0], args[1], args[2])
            raise Malformed(f"copyreg.{func.name} with unexpected arguments")
        raise Refused(f"a call of {_describe(func)}")

    def build(self, obj: Any, state: Any) -> None:
        if self.unbuilt.pop(id(obj), None) is not obj:
            raise Malformed(f"BUILD of {_describe(obj)}, not a fresh instance of an allowed class")
        kind = self.kinds[type(obj)]
        if type(state) is tuple and kind.from_tuple is not None:
            fields = kind.from_tuple(state)
        elif type(state) is tuple and len(state) == 2:  # (instance dict, slot values)
            fields = {}
            for part in state:
                if part is not None and type(part) is not dict:
                    raise Malformed(f"state of {_qualname(kind.cls)} is not a dict")
                fields.update(part or {})
        elif type(state) is dict:
            fields = state
        else:
            raise Malformed(f"state of {_qualname(kind.cls)} is a {type(state).__name__}")
        if not kind.fields.issuperset(fields):  # the fields are strings, all known
            for name in fields:
                if type(name) is not str:
                    raise Malformed(f"a field name of {_qualname(kind.cls)} is not a string")
                if name not in kind.fields:
                    raise Refused(f"{_qualname(kind.cls)} with the unknown field {name!r}")
        obj.__dict__.update(fields)

    def key(self, k: Any) -> Any:
        """``k`` if hashing it is safe (flat, or an allowed hashable instance with flat fields)."""
        if _flat(k):
            return k
        kind = self.kinds.get(type(k))
        if (
            kind is not None
            and kind.hashable
            and id(k) not in self.unbuilt
            and all(_flat(v) for v in vars(k).values())
        ):
            return k
        raise Malformed(f"a dict key of type {type(k).__name__} that is not flat")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(obj: Any) -> str:
    if isinstance(obj, Buildable):
        return _qualname(obj.cls)
    if isinstance(obj, _Copyreg):
        return f"copyreg.{obj.name}"
    return f"a {type(obj).__name__}"


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Entry]) -> Any:
    """The value pickled in ``data``, built from ``allowed`` only; raises ``Refused`` for
    anything else and ``Malformed`` for a stream that is not a well-formed pickle."""
    collecting = gc.isenabled()
    gc.disable()  # the objects made here form no cycles worth a collection pass per batch
    try:
        return _run(_Reader(bytes(data), allowed))
    except (Refused, Malformed):
        raise
    except (
        IndexError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        OverflowError,
        struct.error,
    ) as e:
        raise Malformed(f"{type(e).__name__}: {e}") from e
    finally:
        if collecting:
            gc.enable()


def _run(r: _Reader) -> Any:
    """The opcode loop, one branch per opcode, the most frequent first."""
    data = r.data
    end = len(data)
    pos = 0
    stack: list[Any] = []
    marks: list[list[Any]] = []
    memo: dict[int, Any] = {}
    unbuilt = r.unbuilt
    while pos < end:
        op = data[pos]
        pos += 1
        if op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x8C:  # SHORT_BINUNICODE
            n = data[pos]
            raw = data[pos + 1 : pos + 1 + n]
            if len(raw) != n:
                raise Malformed(f"a string of {n} bytes at byte {pos} runs past the end")
            stack.append(raw.decode("utf-8", "surrogatepass"))
            pos += 1 + n
        elif op == 0x68:  # BINGET
            stack.append(memo[data[pos]])
            pos += 1
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[_U32.unpack_from(data, pos)[0]])
            pos += 4
        elif op == 0x4B:  # BININT1
            stack.append(data[pos])
            pos += 1
        elif op == 0x28:  # MARK
            marks.append(stack)
            stack = []
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x75:  # SETITEMS
            items = stack
            stack = marks.pop()
            target = stack[-1]
            if not isinstance(target, dict) or len(items) % 2:
                raise Malformed("SETITEMS needs a dict and key-value pairs")
            for i in range(0, len(items), 2):
                k = items[i]
                target[k if type(k) in _FLAT else r.key(k)] = items[i + 1]
        elif op == 0x73:  # SETITEM
            value, k = stack.pop(), stack.pop()
            if not isinstance(stack[-1], dict):
                raise Malformed("SETITEM needs a dict")
            stack[-1][r.key(k)] = value
        elif op == 0x62:  # BUILD
            state = stack.pop()
            r.build(stack[-1], state)
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            kind = stack[-1]
            if type(kind) is Buildable and args == ():
                obj = object.__new__(kind.cls)
                unbuilt[id(obj)] = obj
                stack[-1] = obj
            else:
                stack[-1] = r.new(kind, args)
        elif op == 0x92:  # NEWOBJ_EX
            kwargs, args = stack.pop(), stack.pop()
            stack[-1] = r.new(stack[-1], args, kwargs)
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            func = stack[-1]
            if type(func) is Factory and type(args) is tuple:
                stack[-1] = func.make(*args)
            else:
                stack[-1] = r.reduce(func, args)
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            stack[-1] = r.resolve(stack[-1], name)
        elif op == 0x63:  # GLOBAL
            module, pos = r.line(pos)
            name, pos = r.line(pos)
            stack.append(r.resolve(module, name))
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == 0x74:  # TUPLE
            items = stack
            stack = marks.pop()
            stack.append(tuple(items))
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x4D:  # BININT2
            stack.append(data[pos] | data[pos + 1] << 8)
            pos += 2
        elif op == 0x4A:  # BININT
            stack.append(_I32.unpack_from(data, pos)[0])
            pos += 4
        elif op == 0x8A:  # LONG1
            n = data[pos]
            stack.append(int.from_bytes(r.take(pos + 1, n), "little", signed=True))
            pos += 1 + n
        elif op == 0x8B:  # LONG4
            n = _I32.unpack_from(data, pos)[0]
            stack.append(int.from_bytes(r.take(pos + 4, n), "little", signed=True))
            pos += 4 + n
        elif op == 0x47:  # BINFLOAT
            stack.append(_F64.unpack_from(data, pos)[0])
            pos += 8
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x61:  # APPEND
            value = stack.pop()
            if type(stack[-1]) is not list:
                raise Malformed("APPEND needs a list")
            stack[-1].append(value)
        elif op == 0x65:  # APPENDS
            items = stack
            stack = marks.pop()
            if type(stack[-1]) is not list:
                raise Malformed("APPENDS needs a list")
            stack[-1].extend(items)
        elif op == 0x6C:  # LIST
            items = stack
            stack = marks.pop()
            stack.append(items)
        elif op == 0x64:  # DICT
            items = stack
            stack = marks.pop()
            if len(items) % 2:
                raise Malformed("DICT needs key-value pairs")
            stack.append({r.key(items[i]): items[i + 1] for i in range(0, len(items), 2)})
        elif op == 0x58:  # BINUNICODE
            n = _U32.unpack_from(data, pos)[0]
            stack.append(r.take(pos + 4, n).decode("utf-8", "surrogatepass"))
            pos += 4 + n
        elif op == 0x8D:  # BINUNICODE8
            n = _U64.unpack_from(data, pos)[0]
            stack.append(r.take(pos + 8, n).decode("utf-8", "surrogatepass"))
            pos += 8 + n
        elif op == 0x43:  # SHORT_BINBYTES
            n = data[pos]
            stack.append(r.take(pos + 1, n))
            pos += 1 + n
        elif op == 0x42:  # BINBYTES
            n = _U32.unpack_from(data, pos)[0]
            stack.append(r.take(pos + 4, n))
            pos += 4 + n
        elif op == 0x8E:  # BINBYTES8
            n = _U64.unpack_from(data, pos)[0]
            stack.append(r.take(pos + 8, n))
            pos += 8 + n
        elif op == 0x96:  # BYTEARRAY8
            n = _U64.unpack_from(data, pos)[0]
            stack.append(bytearray(r.take(pos + 8, n)))
            pos += 8 + n
        elif op == 0x71:  # BINPUT
            memo[data[pos]] = stack[-1]
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            memo[_U32.unpack_from(data, pos)[0]] = stack[-1]
            pos += 4
        elif op == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                stack = marks.pop()
        elif op == 0x31:  # POP_MARK
            stack = marks.pop()
        elif op == 0x32:  # DUP
            stack.append(stack[-1])
        elif op == 0x95:  # FRAME: the whole pickle is in memory; only its length is checked
            r.take(pos + 8, _U64.unpack_from(data, pos)[0])
            pos += 8
        elif op == 0x80:  # PROTO
            if data[pos] > MAX_PROTOCOL:
                raise Malformed(f"pickle protocol {data[pos]} is newer than {MAX_PROTOCOL}")
            r.protocol = data[pos]
            pos += 1
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise Malformed("STOP with an unbalanced stack")
            return stack[0]
        elif op in _REFUSED_OPS:
            raise Refused(f"the pickle opcode {_REFUSED_OPS[op]}")
        else:
            raise Refused(f"the pickle opcode {bytes([op])!r} (protocol 0/1 or unknown)")
    raise Malformed("the pickle ends without STOP")
