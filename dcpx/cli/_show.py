"""Showing and comparing non-tensor values with bounded work and output.

A value's pickle is small, but what it builds need not be: a 600-byte
pickle can build a list of two references to a list of two references ...
40 levels deep (memo-shared nesting), which ``repr``, ``json.dumps`` and
``==`` walk as a tree of 2**40 nodes; a 600 KB string referenced a
thousand times is a 600 MB ``repr``.  Here:

* ``text(v, limit)`` is ``repr``-like text of at most ``limit``
  characters (cut with ``...``), nesting shown to ``DEPTH_MAX`` levels
  (deeper: ``[...]``), and a container met again shown once (then
  ``<the list shown above>``), so the work is bounded by ``limit``;
* ``json_value(v, limit)`` says whether ``v`` is JSON as it is (no tuple,
  no NaN, string keys) within ``limit`` characters of JSON text, counting
  every repeat of a shared part;
* ``same(a, b)`` is ``a == b`` element by element, each pair of objects
  compared once (shared parts once), up to ``SAME_MAX`` pairs and
  ``DEPTH_MAX`` levels; beyond, equal pickles (which record sharing once)
  decide.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import pickle
from typing import Any, Optional

#: characters of a value's text in ``inspect --json`` (repr, or JSON value)
SHOW_MAX = 64 << 10
#: nesting levels shown; deeper containers are shown as ``[...]``
DEPTH_MAX = 32
#: levels a JSON value may have (deeper: shown as text)
JSON_DEPTH_MAX = 50
#: pairs of objects ``same`` compares before it compares pickles instead
SAME_MAX = 1_000_000
#: bits of an int shown in full (int -> str is quadratic; Python refuses
#: more than 4300 digits)
_INT_BITS_MAX = 4096


class _Full(Exception):
    """The text reached its limit."""


class _Text:
    def __init__(self, limit: int) -> None:
        self.parts: list[str] = []
        self.n = 0
        self.limit = max(limit, 4)
        self.shown: dict[int, Any] = {}      # id -> container already shown
        self.open: set[int] = set()          # ids of the containers being shown

    def put(self, s: str) -> None:
        self.parts.append(s)
        self.n += len(s)
        if self.n > self.limit:
            raise _Full

    def room(self) -> int:
        return self.limit - self.n + 1


def _name(o: Any) -> str:
    t = type(o)
    return t.__name__ if t.__module__ in ("builtins", "collections") else \
        f"{t.__module__}.{t.__qualname__}"


def _leaf(o: Any, w: _Text) -> Optional[str]:
    """The text of a value that holds no other (None when ``o`` may)."""
    t = type(o)
    if o is None or t in (bool, float, complex):
        return repr(o)
    if t is int:
        return repr(o) if o.bit_length() <= _INT_BITS_MAX else f"<int of {o.bit_length()} bits>"
    if t in (str, bytes, bytearray):
        room = w.room()
        return repr(o if len(o) <= room else o[:room])   # longer: cut by put()
    return None


#: (opening, closing) of the containers shown element by element
_BRACKETS = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"),
             frozenset: ("frozenset({", "})"), collections.deque: ("deque([", "])")}


def _put(o: Any, w: _Text, depth: int) -> None:
    s = _leaf(o, w)
    if s is not None:
        w.put(s)
        return
    t = type(o)
    if isinstance(o, dict):
        if t is dict:
            op, cl = "{", "}"
        elif t is collections.defaultdict:
            op, cl = f"defaultdict({o.default_factory!r}, {{", "})"
        else:
            op, cl = f"{_name(o)}({{", "})"
        items: Any = o.items()
    elif t in _BRACKETS:
        op, cl = _BRACKETS[t]
        if t is set and not o:
            op, cl = "set(", ")"
        elif t is frozenset and not o:
            op, cl = "frozenset(", ")"
        if t is collections.deque and o.maxlen is not None:
            cl = f"], maxlen={o.maxlen})"
        items = o
    elif t is argparse.Namespace:
        op, cl, items = "Namespace(", ")", vars(o).items()
    else:
        _other(o, w, depth)
        return
    size = len(items)
    if id(o) in w.open:                       # a container inside itself
        w.put(op + "..." + cl)
        return
    if size and id(o) in w.shown:
        w.put(f"<the {_name(o)} shown above>")
        return
    if size and depth >= DEPTH_MAX:
        w.put(op + "..." + cl)
        return
    w.shown[id(o)] = o
    w.open.add(id(o))
    w.put(op)
    first = True
    for item in items:
        if not first:
            w.put(", ")
        first = False
        if t is argparse.Namespace:
            w.put(f"{item[0]}=")
            _put(item[1], w, depth + 1)
        elif isinstance(o, dict):
            _put(item[0], w, depth + 1)
            w.put(": ")
            _put(item[1], w, depth + 1)
        else:
            _put(item, w, depth + 1)
    if t is tuple and len(o) == 1:
        w.put(",")
    w.put(cl)
    w.open.discard(id(o))


def _other(o: Any, w: _Text, depth: int) -> None:
    """numpy arrays of objects element by element (their repr would repr
    every element); anything else by its own repr (torch and numpy
    summarise large tensors and arrays), cut to the room left."""
    dtype = getattr(o, "dtype", None)
    if getattr(dtype, "hasobject", False) and hasattr(o, "tolist") and hasattr(o, "shape"):
        w.put("array(")
        _put(o.tolist(), w, depth + 1)
        w.put(f", dtype={dtype!s})")
        return
    try:
        s = repr(o)
    except Exception as e:
        s = f"<repr failed: {type(e).__name__}>"
    w.put(s[:w.room()])


def text(v: Any, limit: int = SHOW_MAX) -> str:
    """``repr``-like text of ``v`` of at most ``limit`` characters (see the
    module docstring)."""
    return text_cut(v, limit)[0]


def text_cut(v: Any, limit: int = SHOW_MAX) -> tuple[str, bool]:
    """(``text(v, limit)``, whether it was cut)."""
    w = _Text(limit)
    try:
        _put(v, w, 0)
    except (_Full, RecursionError):   # RecursionError: a repr of numpy's or torch's own
        return "".join(w.parts)[:w.limit - 3] + "...", True
    return "".join(w.parts), False


def json_value(v: Any, limit: int = SHOW_MAX) -> bool:
    """Whether ``v`` is JSON as it is (None, bool, int, finite float, str,
    lists, dicts with string keys, ``JSON_DEPTH_MAX`` levels at most) and
    its JSON text, every repeat of a shared part counted, is at most
    ``limit`` characters."""
    left = limit
    stack = [(v, 0)]
    while stack:
        o, depth = stack.pop()
        if depth > JSON_DEPTH_MAX:
            return False
        t = type(o)
        if o is None or t is bool:
            cost = 5
        elif t is int:
            if o.bit_length() > _INT_BITS_MAX:
                return False
            cost = len(repr(o))
        elif t is float:
            if not math.isfinite(o):
                return False
            cost = len(repr(o))
        elif t is str:
            if len(o) > left:
                return False
            cost = len(json.dumps(o))
        elif t is list:
            cost = 2 + len(o)
            stack.extend((x, depth + 1) for x in o[:left])
        elif t is dict:
            cost = 2 + 2 * len(o)
            for k, x in o.items():
                if type(k) is not str:
                    return False
                stack.append((k, depth + 1))
                stack.append((x, depth + 1))
                if len(stack) > left:
                    return False
        else:
            return False
        left -= cost
        if left < 0:
            return False
    return True


class _TooMuch(Exception):
    """``same`` reached SAME_MAX pairs or DEPTH_MAX * 16 levels."""


_SEQUENCES = (list, tuple, collections.deque)
_MAPPINGS = (dict, collections.OrderedDict)


def same(a: Any, b: Any, budget: int = SAME_MAX) -> tuple[bool, str]:
    """(equal, how): ``a == b``, compared element by element with each
    pair of objects once; ``how`` is "" or, when the values were too large
    or deep to compare so, what decided ("pickles")."""
    seen: set = set()
    count = 0

    def eq(x: Any, y: Any, depth: int) -> bool:
        nonlocal count
        if x is y:
            return True
        key = (id(x), id(y))
        if key in seen:          # equal, or being compared further up (a cycle)
            return True
        count += 1
        if count > budget or depth > DEPTH_MAX * 16:
            raise _TooMuch
        tx, ty = type(x), type(y)
        if tx in _SEQUENCES and tx is ty:
            if len(x) != len(y):
                return False
            seen.add(key)
            return all(eq(p, q, depth + 1) for p, q in zip(x, y))
        if tx in _MAPPINGS and ty in _MAPPINGS:
            if len(x) != len(y):
                return False
            if tx is ty is collections.OrderedDict and not all(
                    eq(p, q, depth + 1) for p, q in zip(x, y)):     # the same order
                return False
            seen.add(key)
            for k, v in x.items():
                if k not in y or not eq(v, y[k], depth + 1):
                    return False
            return True
        if tx is argparse.Namespace and ty is tx:
            seen.add(key)
            return eq(vars(x), vars(y), depth + 1)
        try:
            r = x == y
            if isinstance(r, bool):
                return r
        except Exception:
            pass
        return _same_pickles(x, y)

    try:
        return eq(a, b, 0), ""
    except (_TooMuch, RecursionError):
        return _same_pickles(a, b), "pickles"


def _same_pickles(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and pickle.dumps(a, protocol=4) == pickle.dumps(b, protocol=4)
    except Exception:
        return False
