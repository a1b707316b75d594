"""Is a predicted answer the reference answer?  Exact by default, lenient only where it is safe.

A grader that pays for a wrong answer teaches the policy to produce it, so every rule here errs
towards "not equal":

* Numbers are exact rationals (:mod:`megatron_rl.rewards.numbers`).  An exact reference needs an
  exact answer: a rounded decimal (``0.333``, ``3.14``) is another number, at any precision, and
  ``1/3`` is only ``1/3``, ``\\frac{2}{6}`` or ``0.\\overline{3}``.  The reference sets the precision:
  when the *reference* is a decimal of at least two places or three significant digits, a
  non-terminating answer (``\\frac{1}{3}``, ``\\pi``) that rounds or truncates to it is accepted.
* ``%`` means /100 (``50%`` = 0.5), except that two integers also match as written (``25%`` for a
  GSM8K reference of 25).  ``0.5%`` is never 0.5.
* Case is kept, except for words (``Yes`` = ``yes``: four or more letters, a few short words, or
  ``\\text{}`` content) and multiple-choice letters (``b`` = ``B`` when the reference is A-J).
* ``x = 3`` matches ``3`` when only one side is an equation and the left side is one symbol.
* Lists (``1, 2``, or two items joined by ``and``/``or``), sets (``\\{1,2\\}``) and tuples/intervals
  (``(1,2]``): sets and bare lists in any order, tuples and intervals in order with the same
  brackets.  A list never equals a single answer, so ``5 or 6`` is not 5.
* Otherwise both sides are read as exact expressions (:mod:`megatron_rl.rewards.expr`) and
  compared symbolically; failing that, as canonical text.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Optional, Sequence

from megatron_rl.rewards.expr import GREEK, read_expression
from megatron_rl.rewards.latex import Canonical, canonical, enclosure, split_top_level
from megatron_rl.rewards.numbers import Number, read_number

MAX_ITEMS = 64
MAX_NESTING = 8
MAX_ROUNDED_PLACES = 50
MAX_FLOAT_PLACES = 12
SHORT_WORDS = frozenset("no yes odd all one two six ten red the and not any dne is it on off up in of an or".split())
CHOICES = frozenset("ABCDEFGHIJ")
_ORDERED = ("(", "[", r"\langle")


def _non_terminating(value: Fraction) -> bool:
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den != 1


def _rounded_places(dec: Number, max_places: int) -> Optional[int]:
    """The decimal places ``dec`` shows when it can stand for a rounded value, else None: a
    percent, no or too many places, or too few digits (``0.3`` is not a rounded third)."""
    places = dec.decimals
    if places is None or dec.percent or not 1 <= places <= max_places:
        return None
    if places < 2 and dec.significant < 3:
        return None
    return places


def _rounds_to(dec: Number, exact: Fraction) -> bool:
    """``dec`` is ``exact`` (non-terminating) rounded or truncated to the places ``dec`` shows."""
    places = _rounded_places(dec, MAX_ROUNDED_PLACES)
    if places is None or not _non_terminating(exact):
        return False
    scale = 10 ** places
    written = dec.value * scale
    if written.denominator != 1:
        return False
    scaled = exact * scale
    rounded = (scaled + Fraction(1, 2)).__floor__()
    return written in (rounded, scaled.__trunc__())


def _rounds_to_float(dec: Number, approx: float) -> bool:
    """Like :func:`_rounds_to` for an irrational constant known to float precision."""
    places = _rounded_places(dec, MAX_FLOAT_PLACES)
    if places is None:
        return False
    scaled = approx * 10 ** places
    if abs(scaled) > 1e14:
        return False
    written = dec.value * 10 ** places
    if written.denominator != 1:
        return False
    return int(written) in (int(round(scaled)), int(scaled))


def numbers_match(predicted: Number, reference: Number) -> bool:
    """Exact equality, the percent rule and the rounding rule of the module docstring: only a
    decimal reference stands for a rounded value."""
    if predicted.percent != reference.percent:
        pct, plain = (predicted, reference) if predicted.percent else (reference, predicted)
        if pct.value / 100 == plain.value:
            return True
        return pct.integer and plain.integer and pct.value == plain.value
    if predicted.value == reference.value:
        return True
    return _rounds_to(reference, predicted.value)


def _choice(text: str) -> Optional[str]:
    inner = text[1:-1].strip() if text[:1] == "(" and text[-1:] == ")" else text
    return inner if len(inner) == 1 and inner.isalpha() else None


def _words(c: Canonical) -> Optional[str]:
    """The answer as lower-case words when it is only words that may be case-folded, else None."""
    text = c.text
    if not text or not all(ch.isalpha() or ch in " '-" for ch in text):
        return None
    words = text.split()
    foldable = c.textual or all(
        (len(w) >= 4 and any(v in w.lower() for v in "aeiou")) or w.lower() in SHORT_WORDS for w in words)
    return " ".join(words).lower() if foldable else None


def _symbol(text: str) -> bool:
    """One variable: ``x``, ``x_{1}``, ``\\theta``."""
    base, _, sub = text.partition("_")
    if sub and not (sub.startswith("{") and sub.endswith("}")):
        return False
    return (len(base) == 1 and base.isalpha()) or base in GREEK


def _assignment_rhs(text: str) -> Optional[str]:
    parts = split_top_level(text, "=")
    if len(parts) == 2 and _symbol(parts[0]) and parts[1]:
        return parts[1]
    return None


def _items(text: str) -> list[str]:
    """Top-level comma items; a pair joined by ``and``/``or`` (``x=2 or x=3``) is two items."""
    items = split_top_level(text)
    if len(items) == 1:
        for word in (" and ", " or "):
            if text.count(word) == 1:
                return [part.strip() for part in text.split(word)]
    return items


def _lists_match(a: str, b: str, depth: int) -> Optional[bool]:
    """None when neither side is a list; else whether they are the same list, set or tuple."""
    oa, ia, ca = enclosure(a)
    ob, ib, cb = enclosure(b)
    items_a, items_b = _items(ia), _items(ib)
    if len(items_a) < 2 and len(items_b) < 2:
        if (oa, ca) == ("(", ")") and not ob and ia:
            return _match(canonical(ia), canonical(b), depth + 1)  # "(5)" for "5"
        if (ob, cb) == ("(", ")") and not oa and ib:
            return _match(canonical(a), canonical(ib), depth + 1)
        return None
    if len(items_a) != len(items_b) or len(items_a) > MAX_ITEMS or "" in items_a or "" in items_b:
        return False
    ca_items = [canonical(x) for x in items_a]
    cb_items = [canonical(x) for x in items_b]
    if oa in _ORDERED or ob in _ORDERED:
        if (oa, ca) != (ob, cb):
            return False
        return all(_match(x, y, depth + 1) for x, y in zip(ca_items, cb_items))
    return _multiset_match(ca_items, cb_items, depth)


def _multiset_match(xs: Sequence[Canonical], ys: Sequence[Canonical], depth: int) -> bool:
    unused = list(ys)
    for x in xs:
        for i, y in enumerate(unused):
            if _match(x, y, depth + 1):
                del unused[i]
                break
        else:
            return False
    return True


def _match(p: Canonical, r: Canonical, depth: int = 0) -> bool:
    a, b = p.text, r.text
    if not a or not b:
        return False
    if a == b:
        return True
    if depth > MAX_NESTING or not (p.readable and r.readable):
        return False
    ref_choice = _choice(b)
    if ref_choice is not None and ref_choice in CHOICES:
        got = _choice(a)
        return got is not None and got.upper() == ref_choice
    wa, wb = _words(p), _words(r)
    if wa is not None and wb is not None:
        return wa == wb
    if ("=" in a) != ("=" in b):
        rhs_a, rhs_b = _assignment_rhs(a), _assignment_rhs(b)
        if rhs_a is not None:
            return _match(canonical(rhs_a), r, depth + 1)
        if rhs_b is not None:
            return _match(p, canonical(rhs_b), depth + 1)
    na, nb = read_number(a), read_number(b)
    if na is not None and nb is not None:
        return numbers_match(na, nb)
    listed = _lists_match(a, b, depth)
    if listed is not None:
        return listed
    if "=" in a and "=" in b:
        sa, sb = split_top_level(a, "="), split_top_level(b, "=")
        if len(sa) == len(sb) == 2:
            pairs = [(sa[0], sb[0]), (sa[1], sb[1])]
            swapped = [(sa[0], sb[1]), (sa[1], sb[0])]
            return any(all(_match(canonical(x), canonical(y), depth + 1) for x, y in way) for way in (pairs, swapped))
        return False
    ea, eb = read_expression(a), read_expression(b)
    if ea is not None and eb is not None:
        return ea.equals(eb) or _rounded_expression(nb, ea)
    return False


def _rounded_expression(number: Optional[Number], value) -> bool:
    """A decimal reference against an irrational answer such as ``\\frac{\\sqrt{3}}{2}``."""
    if number is None or value.rational() is not None:
        return False
    approx = value.approximate()
    return approx is not None and _rounds_to_float(number, approx)


def answers_match(predicted: Optional[str], reference: Optional[str]) -> bool:
    """Whether the bare answer ``predicted`` equals the bare answer ``reference`` (see the module docstring)."""
    if predicted is None or reference is None:
        return False
    return _match(canonical(predicted), canonical(reference))


def group_matches(parts: Sequence[str], reference: Optional[str]) -> bool:
    """The policy for several boxes in the last group (``\\boxed{2}, \\boxed{3}``).

    Correct when every box holds the reference (repeating it is harmless), or when the reference
    is a list or set with one item per box, in any order.  Boxes that disagree with a single
    reference are hedging and score 0: the policy must commit to one answer."""
    if reference is None or not parts:
        return False
    if len(parts) == 1:
        return answers_match(parts[0], reference)
    ref = canonical(reference)
    distinct = {canonical(p).text: canonical(p) for p in parts}
    if all(_match(p, ref) for p in distinct.values()):
        return True
    opener, inner, closer = enclosure(ref.text)
    if opener in _ORDERED:
        return False
    items = split_top_level(inner)
    if len(items) != len(parts) or len(items) > MAX_ITEMS:
        return False
    return _multiset_match([canonical(p) for p in parts], [canonical(x) for x in items], 0)
