"""Numbers read exactly, as the writer meant them: ``1,234.50``, ``3 4/5``, ``\\frac{3}{4}``, ``50%``.

Floats would make ``1234568`` equal ``1234567`` under a relative tolerance and ``1e400`` equal
``2e400`` after overflow, so every value is a :class:`fractions.Fraction`.  How a number was written
is kept too (decimal places, significant digits, a percent sign): the comparison needs it to tell a
rounded reference (``0.33``, which ``\\frac{1}{3}`` may answer) from a coarse one (``0.3``).

The reader works on the canonical text of :mod:`megatron_rl.rewards.latex` and is a hand-written
scanner: each character is looked at a bounded number of times, and digit runs longer than
:data:`MAX_DIGITS` are not read as numbers (``int()`` of 100k digits is slow and refused by
Python's limit on integer string length).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Optional

MAX_DIGITS = 1000
MAX_EXPONENT = 1000

MULTIPLIERS = {"hundred": 100, "thousand": 1000, "million": 10**6, "billion": 10**9, "trillion": 10**12,
               "dozen": 12}
# Words after a number that change its value, hedge it or retract it: such a tail is never a unit.
VALUE_WORDS = frozenset("""and or plus minus times over divided point to than less more not half halves third
thirds quarter quarters fourth fourths fifth fifths sixth sixths eighth eighths tenth tenths hundredth hundredths
thousandth thousandths squared cubed percent percentage fraction power powers root roots sqrt factorial hundreds
thousands millions billions pi negative positive mod modulo log ln sin cos tan exp i x e equals plusminus
wrong incorrect mistake error not
""".split())
# Single letters accepted as units, and units that may follow the digits without a space.
SHORT_UNITS = frozenset("m g s h L K".split())
GLUED_UNITS = frozenset("cm mm km kg mg ml cl dl ft yd mi mph kmh hr hrs min sec lb lbs oz".split())
DEGREE = r"^{\circ}"


@dataclass(frozen=True)
class Number:
    """A number as written: exact ``value`` and the facts about its spelling that comparison uses."""

    value: Fraction
    percent: bool = False          # written with % (``value`` is then the number before the sign)
    decimals: Optional[int] = None  # digits after the point of a finite decimal (``None``: not one)
    significant: int = 0            # significant digits of a finite decimal
    integer: bool = False           # written as an integer: no point, no fraction

    @property
    def meaning(self) -> Fraction:
        """The value the writer meant: ``50%`` means 1/2."""
        return self.value / 100 if self.percent else self.value


class _Scan:
    __slots__ = ("s", "pos")

    def __init__(self, s: str):
        self.s, self.pos = s, 0

    def at(self, prefix: str) -> bool:
        return self.s.startswith(prefix, self.pos)

    def take(self, prefix: str) -> bool:
        if self.s.startswith(prefix, self.pos):
            self.pos += len(prefix)
            return True
        return False

    def digits(self) -> str:
        start, s = self.pos, self.s
        while self.pos < len(s) and "0" <= s[self.pos] <= "9":
            self.pos += 1
        return s[start:self.pos]

    def done(self) -> bool:
        return self.pos >= len(self.s)


@dataclass
class _Decimal:
    value: Fraction
    decimals: Optional[int]
    significant: int
    integer: bool


def _grouped_integer(scan: _Scan) -> Optional[str]:
    """Digits, allowing thousands groups split by ``,`` or one space (``1,234``, ``12 345``)."""
    head = scan.digits()
    if not head or len(head) > MAX_DIGITS:
        return None
    if len(head) > 3:
        return head
    for sep in (",", " "):
        if not scan.at(sep):
            continue
        parts, save = [head], scan.pos
        while scan.at(sep) and (group := scan.s[scan.pos + 1:scan.pos + 4]).isdigit() and len(group) == 3:
            end = scan.pos + 4
            if end < len(scan.s) and scan.s[end].isdigit():
                break
            parts.append(scan.s[scan.pos + 1:end])
            scan.pos = end
        if len(parts) > 1 and sum(map(len, parts)) <= MAX_DIGITS:
            return "".join(parts)
        scan.pos = save
    return head


def _int(digits: str) -> int:
    return int(digits) if digits else 0


def _decimal(scan: _Scan, signed: bool = False) -> Optional[_Decimal]:
    """A plain decimal: ``[-]1,234.50``, ``.5``, ``0.1\\overline{6}``, ``1.5e-3``, ``2\\times10^{5}``."""
    start = scan.pos
    negative = signed and scan.take("-")
    if signed and not negative:
        scan.take("+")
    whole = _grouped_integer(scan) if scan.s[scan.pos:scan.pos + 1].isdigit() else ""
    if whole is None:
        scan.pos = start
        return None
    frac, repeat, point = "", "", False
    if scan.at(".") and (scan.s[scan.pos + 1:scan.pos + 2].isdigit() or scan.s.startswith(r"\overline{", scan.pos + 1)):
        scan.pos += 1
        point = True
        frac = scan.digits()
        if len(frac) > MAX_DIGITS:
            scan.pos = start
            return None
        if scan.take(r"\overline{"):
            repeat = scan.digits()
            if not repeat or len(repeat) > MAX_DIGITS or not scan.take("}"):
                scan.pos = start
                return None
    if not whole and not point:
        scan.pos = start
        return None
    value = Fraction(_int(whole + frac), 10 ** len(frac))
    if repeat:
        value += Fraction(_int(repeat), (10 ** len(repeat) - 1) * 10 ** len(frac))
    exponent = _exponent(scan)
    if exponent is None:
        scan.pos = start
        return None
    value *= Fraction(10) ** exponent
    digits = (whole + frac).lstrip("0")
    decimals = None if repeat else max(0, len(frac) - exponent)
    integer = not point and not repeat and exponent == 0
    if integer and whole == "10" and scan.at("^{"):
        power = _power_of_ten(scan)
        if power is not None:
            return _Decimal(Fraction(10) ** power * (-1 if negative else 1), None, 0, power >= 0)
    return _Decimal(-value if negative else value, decimals, len(digits), integer)


def _exponent(scan: _Scan) -> Optional[int]:
    """``e-3`` right after the digits, or ``\\times10^{5}`` / ``\\cdot10^{5}``; 0 when absent."""
    save = scan.pos
    if scan.take("e") or scan.take("E"):
        negative = scan.take("-")
        if not negative:
            scan.take("+")
        digits = scan.digits()
        if digits and len(digits) <= 4 and int(digits) <= MAX_EXPONENT:
            return -int(digits) if negative else int(digits)
        if digits:
            return None
        scan.pos = save
        return 0
    for times in (r"\times", r"\cdot", "*"):
        if scan.take(times):
            if scan.take("10") and scan.at("^{"):
                power = _power_of_ten(scan)
                if power is not None:
                    return power
            scan.pos = save
            return 0
    return 0


def _power_of_ten(scan: _Scan) -> Optional[int]:
    save = scan.pos
    if scan.take("^{"):
        negative = scan.take("-")
        digits = scan.digits()
        if digits and len(digits) <= 4 and int(digits) <= MAX_EXPONENT and scan.take("}"):
            return -int(digits) if negative else int(digits)
    scan.pos = save
    return None


def _fraction(scan: _Scan) -> Optional[Fraction]:
    """``\\frac{a}{b}`` of two plain decimals (signs allowed); None otherwise (position restored)."""
    save = scan.pos
    if not scan.take(r"\frac{"):
        return None
    num = _decimal(scan, signed=True)
    if num is not None and scan.take("}{"):
        den = _decimal(scan, signed=True)
        if den is not None and scan.take("}") and den.value != 0:
            return num.value / den.value
    scan.pos = save
    return None


def _core(scan: _Scan) -> Optional[tuple[Fraction, Optional[int], int, bool]]:
    """``(value, decimals, significant, integer)`` of the number at the scan position."""
    value = _fraction(scan)
    if value is not None:
        return value, None, 0, False
    dec = _decimal(scan)
    if dec is None:
        return None
    if not dec.integer:
        return dec.value, dec.decimals, dec.significant, False
    save = scan.pos
    # a/b of plain integers or decimals
    if scan.take("/"):
        den = _decimal(scan)
        if den is not None and den.value != 0:
            return dec.value / den.value, None, 0, False
        scan.pos = save
        return None
    # Mixed numbers: ``3 4/5``, ``3\frac{4}{5}``, ``3 \frac{4}{5}`` -- a whole number and a proper fraction.
    scan.take(" ")
    proper = _fraction(scan)
    if proper is None and scan.s[scan.pos:scan.pos + 1].isdigit() and scan.pos != save:
        num = _decimal(scan)
        if num is not None and num.integer and scan.take("/"):
            den = _decimal(scan)
            if den is not None and den.integer and den.value != 0:
                proper = num.value / den.value
        if proper is None:
            scan.pos = save
            return None
    if proper is not None:
        if not 0 < proper < 1:
            scan.pos = save
            return None
        return dec.value + proper, None, 0, False
    scan.pos = save
    return dec.value, dec.decimals, dec.significant, True


def _tail_is_unit(tail: str) -> bool:
    """Whether the text after a number only names a unit (``apples``, ``cm^{2}``, ``^{\\circ}``, ``m/s``)."""
    if not tail:
        return True
    if tail.startswith(DEGREE):
        rest = tail[len(DEGREE):].strip()
        return rest in ("", "C", "F", "K") or _tail_is_unit(" " + rest)
    if tail.lstrip().startswith("(") and tail.endswith(")"):
        tail = " " + tail.lstrip()[1:-1]  # ``72 (apples)``
    spaced = tail.startswith(" ")
    words = tail.replace("/", " / ").replace("^{2}", " ").replace("^{3}", " ").split()
    if not words:
        return True
    if not spaced and words[0] not in GLUED_UNITS:
        return False
    for word in words:
        if word == "/":
            continue
        bare = word.rstrip(".").replace("'", "").replace("-", "")
        if not bare.isalpha() or bare.lower() in VALUE_WORDS:
            return False
        if len(bare) == 1 and bare not in SHORT_UNITS:
            return False
    return True


def read_number(text: str) -> Optional[Number]:
    """The number ``text`` (canonical, see :mod:`megatron_rl.rewards.latex`) spells, else None.

    A unit after the number is ignored (``72 apples``, ``10 cm``, ``90^{\\circ}``), a multiplier word
    is applied (``2.5 million``), and anything else after it (``2x``, ``5 or 6``) means it is not a
    number."""
    scan = _Scan(text.strip())
    negative = scan.take("-")
    if not negative:
        scan.take("+")
    core = _core(scan)
    if core is None:
        return None
    value, decimals, significant, integer = core
    percent = False
    if scan.take("%") or scan.take(" %") or scan.take(" percent") or scan.take(" per cent"):
        percent = True
    rest = scan.s[scan.pos:]
    word = rest.split(maxsplit=1)[0] if rest.startswith(" ") and rest.strip() else ""
    if word in MULTIPLIERS and not percent:
        value *= MULTIPLIERS[word]
        decimals, integer = None, value.denominator == 1
        rest = rest.strip()[len(word):]
    if not _tail_is_unit(rest):
        return None
    return Number(-value if negative else value, percent, decimals, significant, integer)


def parse_number(text: str) -> Optional[Fraction]:
    """The exact value ``text`` means (``50%`` -> 1/2, ``3 4/5`` -> 19/5), or None if it is not a number."""
    from megatron_rl.rewards.latex import canonical

    number = read_number(canonical(text).text)
    return None if number is None else number.meaning
