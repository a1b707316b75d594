"""Exact algebra for short answers: ``2\\sqrt{3}`` = ``\\sqrt{12}``, ``(x+1)^{2}`` = ``x^{2}+2x+1``.

An answer is read into a quotient of two polynomials with rational coefficients in its variables,
``\\pi`` and square roots.  Square roots of rationals are kept in one canonical form (``\\sqrt{12}``
becomes ``2\\sqrt{3}``, ``\\sqrt{2}\\sqrt{3}`` becomes ``\\sqrt{6}``); any other root, and every
variable, is an independent symbol.  Two answers are equal when ``a/b = c/d`` as polynomials,
checked as ``a*d == c*b``.  Both steps are exact, so equality here is mathematical equality: a
symbol treated as independent can only make equal answers look different, never the reverse.

A factorial of an integer up to :data:`MAX_FACTORIAL` is its value (``5!`` = 120, so ``5!`` is never
5); a factorial of anything else is not read.

Everything is bounded: at most :data:`MAX_TERMS` terms, exponents up to :data:`MAX_POWER`, radicands
up to 10^15 factored by trial division up to 10^5; past a bound the answer is not an expression and is
compared as text.  Functions (``\\sin``, ``\\log``), double factorials, ``\\infty`` and anything else
unknown are not read.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Optional

from megatron_rl.rewards.latex import _TOKEN

MAX_TERMS = 256
MAX_PRODUCTS = 4096
MAX_POWER = 64
MAX_RADICAND = 10**15
MAX_NESTING = 50
MAX_FACTORIAL = 1000

# key: (squarefree radicand, ((symbol, exponent), ...)) -> rational coefficient
Poly = dict

GREEK = frozenset(r"""\alpha \beta \gamma \delta \epsilon \zeta \eta \theta \iota \kappa \lambda \mu \nu \xi \pi
\rho \sigma \tau \upsilon \phi \chi \psi \omega \Gamma \Delta \Theta \Lambda \Xi \Pi \Sigma \Upsilon \Phi \Psi
\Omega""".split())


class NotAnExpression(Exception):
    """The text is not something this module can read exactly."""


def _squarefree(n: int) -> tuple[int, int]:
    """``n = k*k*m`` with ``m`` squarefree: returns ``(k, m)`` for ``0 < n <= MAX_RADICAND``."""
    k, m, p = 1, 1, 2
    while p * p * p <= n and p <= 100_000:
        if n % p == 0:
            count = 0
            while n % p == 0:
                n //= p
                count += 1
            k *= p ** (count // 2)
            if count % 2:
                m *= p
        p += 1 if p == 2 else 2
    # What is left has at most two prime factors, both above the trial bound: 1, p, p*q or p*p.
    root = math.isqrt(n)
    if root * root == n and n > 1:
        return k * root, m
    return k, m * n


def _const(c) -> Poly:
    c = Fraction(c)
    return {(1, ()): c} if c else {}


def _add(a: Poly, b: Poly, sign: int = 1) -> Poly:
    out = dict(a)
    for key, c in b.items():
        v = out.get(key, 0) + sign * c
        if v:
            out[key] = v
        else:
            out.pop(key, None)
    return out


def _mul_keys(ka, kb) -> tuple[int, tuple]:
    (ra, va), (rb, vb) = ka, kb
    exps = dict(va)
    for sym, e in vb:
        exps[sym] = exps.get(sym, 0) + e
        if exps[sym] > MAX_POWER * 4:
            raise NotAnExpression("exponent too large")
    return ra * rb, tuple(sorted((s, e) for s, e in exps.items() if e))


def _mul(a: Poly, b: Poly) -> Poly:
    if len(a) * len(b) > MAX_PRODUCTS:
        raise NotAnExpression("too many terms")
    out: Poly = {}
    for ka, ca in a.items():
        for kb, cb in b.items():
            g = math.gcd(ka[0], kb[0])
            radicand, variables = _mul_keys(ka, kb)
            coeff = ca * cb * g
            key = (radicand // (g * g), variables)
            v = out.get(key, 0) + coeff
            if v:
                out[key] = v
            else:
                out.pop(key, None)
    if len(out) > MAX_TERMS:
        raise NotAnExpression("too many terms")
    return out


class Value:
    """``num / den``, both polynomials (see the module docstring)."""

    __slots__ = ("num", "den")

    def __init__(self, num: Poly, den: Optional[Poly] = None):
        self.num, self.den = num, den if den is not None else _const(1)

    def __add__(self, o: "Value") -> "Value":
        if self.den == o.den:
            return Value(_add(self.num, o.num), self.den)
        return Value(_add(_mul(self.num, o.den), _mul(o.num, self.den)), _mul(self.den, o.den))

    def __neg__(self) -> "Value":
        return Value({k: -c for k, c in self.num.items()}, self.den)

    def __sub__(self, o: "Value") -> "Value":
        return self + (-o)

    def __mul__(self, o: "Value") -> "Value":
        return Value(_mul(self.num, o.num), _mul(self.den, o.den))

    def __truediv__(self, o: "Value") -> "Value":
        if not o.num:
            raise NotAnExpression("division by zero")
        return Value(_mul(self.num, o.den), _mul(self.den, o.num))

    def rational(self) -> Optional[Fraction]:
        """The value as a rational number, if it is one."""
        if not self.num:
            return Fraction(0)
        if set(self.num) == {(1, ())} and set(self.den) == {(1, ())}:
            return self.num[(1, ())] / self.den[(1, ())]
        return None

    def equals(self, o: "Value") -> bool:
        return _mul(self.num, o.den) == _mul(o.num, self.den)

    def constant(self) -> bool:
        """No variables other than ``\\pi`` (square roots allowed)."""
        return all(sym == r"\pi" for poly in (self.num, self.den) for _, vs in poly for sym, _ in vs)

    def approximate(self) -> Optional[float]:
        """A float for a constant value (``\\sqrt{2}`` -> 1.414...), else None."""
        if not self.constant():
            return None

        def evaluate(poly: Poly) -> float:
            return sum(float(c) * math.sqrt(r) * math.prod(math.pi ** e for _, e in vs) for (r, vs), c in poly.items())

        try:
            den = evaluate(self.den)
            return evaluate(self.num) / den if den else None
        except (OverflowError, ValueError):
            return None

    def __pow__(self, n: int) -> "Value":
        if abs(n) > MAX_POWER:
            raise NotAnExpression("power too large")
        base = self if n >= 0 else Value(self.den, self.num)
        if n < 0 and not self.num:
            raise NotAnExpression("division by zero")
        out, n = Value(_const(1)), abs(n)
        while n:
            if n & 1:
                out = out * base
            n >>= 1
            if n:
                base = base * base
        return out


def _symbol(name: str) -> Value:
    return Value({(1, ((name, 1),)): Fraction(1)})


def _describe(v: Value) -> str:
    def poly(p: Poly) -> str:
        return "+".join(f"{c}*{r}*{vs}" for (r, vs), c in sorted(p.items(), key=repr))
    return f"({poly(v.num)})/({poly(v.den)})"


def _sqrt(v: Value, index: int = 2) -> Value:
    q = v.rational()
    if q is not None and q >= 0:
        if q == 0:
            return Value({})
        if index == 2:
            n = q.numerator * q.denominator
            if n <= MAX_RADICAND:
                k, m = _squarefree(n)
                return Value({(m, ()): Fraction(k, q.denominator)})
        else:
            num, den = _integer_root(q.numerator, index), _integer_root(q.denominator, index)
            if num is not None and den is not None:
                return Value(_const(Fraction(num, den)))
    # Any other root is a symbol of its own, named by its (exact) radicand.
    return _symbol(f"\\sqrt[{index}]{{{_describe(v)}}}")


def _factorial(v: Value) -> Value:
    n = v.rational()
    if n is None or n.denominator != 1 or not 0 <= n <= MAX_FACTORIAL:
        raise NotAnExpression("factorial of a non-integer or past the bound")
    return Value(_const(math.factorial(int(n))))


def _integer_root(n: int, k: int) -> Optional[int]:
    if n.bit_length() > 4000:
        return None
    r = round(n ** (1.0 / k)) if n < 2**1000 else None
    if r is None:
        return None
    for c in (r - 1, r, r + 1):
        if c >= 0 and c ** k == n:
            return c
    return None


class _Parser:
    def __init__(self, text: str):
        self.toks = [t for t in _TOKEN.findall(text)]
        self.i = 0

    def peek(self) -> Optional[str]:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def next(self) -> str:
        tok = self.peek()
        if tok is None:
            raise NotAnExpression("unexpected end")
        self.i += 1
        return tok

    def expect(self, tok: str) -> None:
        if self.next() != tok:
            raise NotAnExpression(f"expected {tok}")

    def parse(self) -> Value:
        value = self.expr()
        if self.peek() is not None:
            raise NotAnExpression(f"unexpected {self.peek()!r}")
        return value

    def expr(self) -> Value:
        value = self.term()
        while self.peek() in ("+", "-"):
            op = self.next()
            value = value + self.term() if op == "+" else value - self.term()
        return value

    def term(self) -> Value:
        value, last_integer = self.unary()
        while True:
            tok = self.peek()
            if tok in ("*", r"\cdot", r"\times"):
                self.next()
                rhs, last_integer = self.unary()
                value = value * rhs
            elif tok in ("/", r"\div"):
                self.next()
                rhs, last_integer = self.unary()
                value = value / rhs
            elif tok is not None and self.starts_atom(tok):
                if tok == " ":
                    self.next()
                    if self.peek() is not None and self.peek().isdigit() and last_integer:
                        raise NotAnExpression("digits split by a space")
                if last_integer and self.peek() == r"\frac":
                    raise NotAnExpression("a whole number before a fraction reads as a mixed number")
                rhs, last_integer = self.power()
                value = value * rhs
            else:
                return value

    @staticmethod
    def starts_atom(tok: str) -> bool:
        return tok == " " or tok.isalnum() or tok in ("(", r"\frac", r"\sqrt", "{") or tok in GREEK or tok == "."

    def unary(self) -> tuple[Value, bool]:
        tok = self.peek()
        if tok == "-":
            self.next()
            value, _ = self.unary()
            return -value, False
        if tok == "+":
            self.next()
            return self.unary()
        return self.power()

    def power(self) -> tuple[Value, bool]:
        base, integer = self.atom()
        if self.peek() == "!":
            self.next()
            if self.peek() == "!":
                raise NotAnExpression("double factorial")
            base, integer = _factorial(base), False
        if self.peek() == "^":
            self.next()
            self.expect("{")
            exponent = self.expr()
            self.expect("}")
            e = exponent.rational()
            if e is None:
                raise NotAnExpression("symbolic exponent")
            if e.denominator == 1:
                return base ** int(e), False
            if e.denominator == 2 and abs(e.numerator) <= MAX_POWER:
                return _sqrt(base) ** int(e.numerator), False
            raise NotAnExpression("fractional exponent")
        return base, integer

    def number(self, first: str) -> tuple[Value, bool]:
        digits = [first]
        while self.peek() is not None and (self.peek().isdigit() or self.peek() == "."):
            digits.append(self.next())
        text = "".join(digits)
        if text.count(".") > 1 or text == "." or len(text) > 1000:
            raise NotAnExpression("bad number")
        whole, _, frac = text.partition(".")
        value = Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
        return Value(_const(value)), "." not in text

    def atom(self) -> tuple[Value, bool]:
        tok = self.next()
        if tok.isdigit() or tok == ".":
            return self.number(tok)
        if tok.isalpha() and len(tok) == 1 or tok in GREEK:
            name = tok
            if self.peek() == "_":
                self.next()
                self.expect("{")
                sub = []
                while self.peek() not in ("}", None):
                    sub.append(self.next())
                self.expect("}")
                name += "_{" + "".join(sub) + "}"
            return _symbol(name), False
        if tok == "(":
            value = self.expr()
            self.expect(")")
            return value, False
        if tok == "{":
            value = self.expr()
            self.expect("}")
            return value, False
        if tok == r"\frac":
            self.expect("{")
            num = self.expr()
            self.expect("}")
            self.expect("{")
            den = self.expr()
            self.expect("}")
            return num / den, False
        if tok == r"\sqrt":
            index = 2
            if self.peek() == "[":
                self.next()
                n, _ = self.number(self.next())
                index_value = n.rational()
                self.expect("]")
                if index_value is None or index_value.denominator != 1 or not 2 <= index_value <= 10:
                    raise NotAnExpression("bad root index")
                index = int(index_value)
            self.expect("{")
            inner = self.expr()
            self.expect("}")
            return _sqrt(inner, index), False
        raise NotAnExpression(f"cannot read {tok!r}")


def read_expression(text: str) -> Optional[Value]:
    """The exact value of canonical ``text``, or None when it is not a readable expression."""
    if not text or len(text) > 2000:
        return None
    depth = deepest = 0
    for ch in text:
        depth += (ch in "({[") - (ch in ")}]")
        deepest = max(deepest, depth)
    if deepest > MAX_NESTING:
        return None
    try:
        return _Parser(text).parse()
    except (NotAnExpression, RecursionError, OverflowError, ZeroDivisionError, ValueError):
        return None
