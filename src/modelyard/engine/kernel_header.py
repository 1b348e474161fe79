"""The C kernels' ctypes bindings, generated from `csrc/kernels.h`: the one declaration of the
interface, which the compiler also checks every C definition against.

A small, strict reader of the C subset that header keeps to: `typedef struct { ... } name;`
whose fields are scalars, pointers or earlier such structs, and `MY_API type name(params);`
prototypes. Anything else in the header (beyond comments and preprocessor lines) is refused
with `HeaderError`, so an edit the reader does not understand fails the load instead of
binding wrong types. Structs become `ctypes.Structure` classes that refuse unknown field names;
a pointer to one of them is `POINTER(struct)`, any other pointer `c_void_p`.
"""

from __future__ import annotations

import ctypes
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HEADER = Path(__file__).parent / "csrc" / "kernels.h"
PREFIX = "my_"

SCALARS: dict[str, Any] = {
    "int": ctypes.c_int,
    "float": ctypes.c_float,
    "double": ctypes.c_double,
    "int8_t": ctypes.c_int8,
    "uint8_t": ctypes.c_uint8,
    "int32_t": ctypes.c_int32,
    "int64_t": ctypes.c_int64,
}

_COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
_STRUCT = re.compile(r"typedef\s+struct\s*\{([^{}]*)\}\s*(\w+)\s*;")
_FUNCTION = re.compile(r"MY_API\s+([\w\s*]+?)\s*\b(\w+)\s*\(([^()]*)\)\s*;")
_DECLARATOR = re.compile(r"^(\**)\s*(\w+)$")
_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


class HeaderError(ValueError):
    """kernels.h holds something outside the subset this reader binds."""


@dataclass(frozen=True)
class Prototype:
    name: str
    restype: Any  # a ctypes type, or None for void
    argtypes: tuple[Any, ...]
    params: tuple[str, ...]


@dataclass(frozen=True)
class Header:
    structs: dict[str, type[ctypes.Structure]]
    functions: dict[str, Prototype]

    def struct(self, name: str) -> type[ctypes.Structure]:
        return self.structs[name]


def _type(base: list[str], stars: int, structs: dict[str, type[ctypes.Structure]]) -> Any:
    """The ctypes type of `base` (words, `const` dropped) behind `stars` pointers."""
    words = [w for w in base if w != "const"]
    if len(words) != 1 or not _IDENTIFIER.match(words[0]):
        raise HeaderError(f"unsupported type {' '.join(base)!r}")
    word = words[0]
    if word not in SCALARS and word not in structs and word != "void":
        raise HeaderError(f"unknown type {word!r}")
    if stars == 1 and word in structs:
        return ctypes.POINTER(structs[word])
    if stars:
        return ctypes.c_void_p
    if word == "void":
        return None
    return structs[word] if word in structs else SCALARS[word]


def _declaration(text: str) -> tuple[list[str], int, str]:
    """`const float *const *name` -> (base words, pointer count, name)."""
    tokens = re.findall(r"\*|\w+|\S", text)
    if not tokens or any(t != "*" and not _IDENTIFIER.match(t) for t in tokens):
        raise HeaderError(f"unsupported declaration {text.strip()!r}")
    name, first_star = tokens[-1], tokens.index("*") if "*" in tokens else len(tokens) - 1
    base, pointers = tokens[:first_star], tokens[first_star:-1]
    if name == "*" or not base or any(t not in ("*", "const") for t in pointers):
        raise HeaderError(f"unsupported declaration {text.strip()!r}")
    return base, pointers.count("*"), name


def _struct(
    body: str, name: str, structs: dict[str, type[ctypes.Structure]]
) -> type[ctypes.Structure]:
    fields: list[tuple[str, Any]] = []
    for statement in body.split(";"):
        if not statement.strip():
            continue
        first, *more = statement.split(",")
        base, stars, field = _declaration(first)
        fields.append((field, _type(base, stars, structs)))
        for declarator in more:
            match = _DECLARATOR.match(declarator.strip())
            if match is None:
                raise HeaderError(f"unsupported field {declarator.strip()!r} in {name}")
            fields.append((match[2], _type(base, len(match[1]), structs)))
    names = [f for f, _ in fields]
    if len(set(names)) != len(names):
        raise HeaderError(f"a field named twice in {name}")
    # No __dict__: a misspelt field name is an AttributeError, not a silent new attribute.
    return type(name, (ctypes.Structure,), {"__slots__": (), "_fields_": fields})


def _prototype(
    returns: str, name: str, params: str, structs: dict[str, type[ctypes.Structure]]
) -> Prototype:
    if not name.startswith(PREFIX):
        raise HeaderError(f"exported function {name!r} lacks the prefix {PREFIX!r}")
    ret_tokens = re.findall(r"\*|\w+", returns)
    restype = _type([t for t in ret_tokens if t != "*"], ret_tokens.count("*"), structs)
    argtypes, names = [], []
    if params.strip() != "void":
        for param in params.split(","):
            base, stars, pname = _declaration(param)
            argtype = _type(base, stars, structs)
            if argtype is None or argtype in structs.values():
                raise HeaderError(f"{name}: parameter {pname!r} must be a scalar or a pointer")
            argtypes.append(argtype)
            names.append(pname)
    return Prototype(name, restype, tuple(argtypes), tuple(names))


def parse(text: str) -> Header:
    """The structs and prototypes of a header in the subset (see the module docstring)."""
    text = _COMMENT.sub(" ", text)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    structs: dict[str, type[ctypes.Structure]] = {}
    functions: dict[str, Prototype] = {}
    at = 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        if match := _STRUCT.match(text, at):
            name = match[2]
            if not name.startswith(PREFIX) or name in structs:
                raise HeaderError(f"struct {name!r}: unprefixed or declared twice")
            structs[name] = _struct(match[1], name, structs)
        elif match := _FUNCTION.match(text, at):
            if match[2] in functions:
                raise HeaderError(f"function {match[2]!r} declared twice")
            functions[match[2]] = _prototype(match[1], match[2], match[3], structs)
        else:
            raise HeaderError(f"unsupported declaration at {text[at : at + 60]!r}")
        at = match.end()
    if not functions:
        raise HeaderError("no MY_API prototype in the header")
    return Header(structs, functions)


@functools.cache
def read(path: Path = HEADER) -> Header:
    """`kernels.h` (or the header at `path`) parsed, once per process."""
    return parse(path.read_text())


def bind(library: ctypes.CDLL, header: Header) -> dict[str, Any]:
    """Each of the header's functions from `library`, its argument and return types set from
    the header; an AttributeError where the library lacks one."""
    bound = {}
    for proto in header.functions.values():
        function = getattr(library, proto.name)
        function.restype = proto.restype
        function.argtypes = list(proto.argtypes)
        bound[proto.name] = function
    return bound
