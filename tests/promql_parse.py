"""PromQL, parsed: the subset Grafana dashboards of LLM servers use (Ray Serve LLM's, specserve's), as an AST for
tests/promql.py to evaluate.

Covered: numbers; vector selectors with `=`, `!=`, `=~`, `!~` matchers; range selectors `x[5m]` and subqueries
`expr[24h:1m]`; function calls; aggregations (`sum`, `avg`, `max`, `min`, `count`) with `by` / `without` before
or after their argument; unary minus; binary operators at Prometheus' precedence (`^`; `* / %`; `+ -`;
comparisons; `and unless`; `or`) with `bool`, `on` / `ignoring` and `group_left` / `group_right`. Not covered
(a ParseError says so): offsets, `@`, string results, `topk` / `quantile` parameters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

AGGREGATIONS = {"sum", "avg", "max", "min", "count"}
_PRECEDENCE = [{"or"}, {"and", "unless"}, {"==", "!=", "<=", "<", ">=", ">"}, {"+", "-"}, {"*", "/", "%"}, {"^"}]
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800, "y": 31_536_000}
_TOKEN = re.compile(
    r"\s*(?:"
    r"(?P<duration>(?:\d+(?:ms|[smhdwy]))+)(?![\w.])"
    r"|(?P<number>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?|Inf|NaN)(?![\w:])"
    r'|(?P<string>"(?:[^"\\]|\\.)*")'
    r"|(?P<ident>[a-zA-Z_][a-zA-Z0-9_:]*)"
    r"|(?P<op>=~|!~|==|!=|<=|>=|[-+*/%^<>=(){}\[\],:])"
    r")"
)


class ParseError(ValueError):
    pass


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Selector:
    name: str | None
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


@dataclass(frozen=True)
class Range:
    """A range selector (`inner` a Selector) or a subquery (`step` set)."""

    inner: object
    seconds: float
    step: float | None = None


@dataclass(frozen=True)
class Call:
    func: str
    args: tuple[object, ...]


@dataclass(frozen=True)
class Aggregate:
    op: str
    expr: object
    labels: tuple[str, ...] | None = None  # None: no grouping clause
    without: bool = False


@dataclass(frozen=True)
class Binary:
    op: str
    lhs: object
    rhs: object
    bool_: bool = False
    on: tuple[str, ...] | None = None  # the matching labels of on(...) ...
    ignoring: tuple[str, ...] | None = None  # ... or of ignoring(...)
    group: str | None = None  # "left" | "right": many-to-one matching
    include: tuple[str, ...] = field(default_factory=tuple)  # the labels group_left(...) copies over


@dataclass(frozen=True)
class Neg:
    expr: object


def seconds(duration: str) -> float:
    """`1h30m` -> 5400.0."""
    return sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+)(ms|[smhdwy])", duration))


def tokens(text: str) -> list[tuple[str, str]]:
    """(kind, text) pairs; kind: duration, number, string, ident, op."""
    out, at = [], 0
    while at < len(text.rstrip()):
        m = _TOKEN.match(text, at)
        if m is None or m.lastgroup is None:
            raise ParseError(f"cannot read {text[at : at + 20]!r}")
        out.append((m.lastgroup, m[m.lastgroup]))
        at = m.end()
    return out


def parse(text: str) -> object:
    parser = _Parser(tokens(text))
    node = parser.expr(0)
    if parser.at < len(parser.toks):
        raise ParseError(f"unexpected {parser.peek()!r} in {text!r}")
    return node


class _Parser:
    def __init__(self, toks: list[tuple[str, str]]) -> None:
        self.toks, self.at = toks, 0

    def peek(self, ahead: int = 0) -> str:
        i = self.at + ahead
        return self.toks[i][1] if i < len(self.toks) else ""

    def take(self, expected: str | None = None) -> tuple[str, str]:
        if self.at >= len(self.toks) or (expected is not None and self.peek() != expected):
            raise ParseError(f"expected {expected!r}, found {self.peek()!r}")
        self.at += 1
        return self.toks[self.at - 1]

    def expr(self, level: int) -> object:
        """Binary operators from precedence `level` up (`^` is right-associative)."""
        if level == len(_PRECEDENCE):
            return self.unary()
        lhs = self.expr(level + 1)
        while self.peek() in _PRECEDENCE[level]:
            op = self.take()[1]
            modifiers = self.modifiers()
            rhs = self.expr(level if op == "^" else level + 1)
            lhs = Binary(op, lhs, rhs, **modifiers)
        return lhs

    def modifiers(self) -> dict[str, object]:
        found: dict[str, object] = {}
        if self.peek() == "bool":
            self.take()
            found["bool_"] = True
        if self.peek() in ("on", "ignoring"):
            kind = self.take()[1]
            found[kind] = self.labels()
        if self.peek() in ("group_left", "group_right"):
            found["group"] = self.take()[1].removeprefix("group_")
            found["include"] = self.labels() if self.peek() == "(" else ()
        return found

    def labels(self) -> tuple[str, ...]:
        self.take("(")
        names = []
        while self.peek() != ")":
            names.append(self.take()[1])
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(names)

    def unary(self) -> object:
        if self.peek() in ("-", "+"):
            sign = self.take()[1]
            inner = self.unary()
            return Neg(inner) if sign == "-" else inner
        return self.postfix(self.primary())

    def postfix(self, node: object) -> object:
        """`[5m]` after a selector, `[24h:1m]` after any expression."""
        if self.peek() != "[":
            return node
        self.take("[")
        span = seconds(self.take()[1])
        step = None
        if self.peek() == ":":
            self.take()
            step = seconds(self.take()[1])
        self.take("]")
        return Range(node, span, step)

    def primary(self) -> object:
        kind, text = self.take()
        if kind == "number":
            return Num(float(text.replace("Inf", "inf")))
        if text == "(":
            inner = self.expr(0)
            self.take(")")
            return inner
        if text == "{":
            return Selector(None, self.matchers())
        if kind != "ident":
            raise ParseError(f"unexpected {text!r}")
        if text in AGGREGATIONS and self.peek() in ("(", "by", "without"):
            return self.aggregate(text)
        if self.peek() == "(":
            return Call(text, self.arguments())
        matchers: tuple[tuple[str, str, str], ...] = ()
        if self.peek() == "{":
            self.take("{")
            matchers = self.matchers()
        return Selector(text, matchers)

    def aggregate(self, op: str) -> Aggregate:
        labels, without = None, False
        if self.peek() in ("by", "without"):
            without, labels = self.take()[1] == "without", self.labels()
        (arg,) = self.arguments()
        if self.peek() in ("by", "without"):
            without, labels = self.take()[1] == "without", self.labels()
        return Aggregate(op, arg, labels, without)

    def arguments(self) -> tuple[object, ...]:
        self.take("(")
        args = []
        while self.peek() != ")":
            args.append(self.expr(0))
            if self.peek() == ",":
                self.take()
        self.take(")")
        return tuple(args)

    def matchers(self) -> tuple[tuple[str, str, str], ...]:
        """After `{`: matchers up to `}` (a trailing comma allowed, as Prometheus allows it)."""
        found = []
        while self.peek() != "}":
            label = self.take()[1]
            op = self.take()[1]
            if op not in ("=", "!=", "=~", "!~"):
                raise ParseError(f"matcher operator {op!r}")
            kind, value = self.take()
            if kind != "string":
                raise ParseError(f"matcher value {value!r}")
            found.append((label, op, _unquote(value)))
            if self.peek() == ",":
                self.take()
        self.take("}")
        return tuple(found)


def _unquote(literal: str) -> str:
    """A double-quoted PromQL string's value (`\\\\` -> `\\`, `\\"` -> `"`)."""
    return re.sub(r"\\(.)", lambda m: {"n": "\n", "t": "\t"}.get(m[1], m[1]), literal[1:-1])
