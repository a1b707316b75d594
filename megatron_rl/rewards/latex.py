"""One canonical spelling for a LaTeX or plain-text answer, so equal answers compare equal as text.

Models write the same answer many ways: ``\\dfrac12`` and ``\\frac{1}{2}``, ``x^2`` and
``x^{2}``, ``\\left( 1, 2 \\right)`` and ``(1,2)``, ``½`` and ``\\frac{1}{2}``.  The canonical form
gives every command argument braces, drops grouping braces, spacing commands, ``$`` and the sizing
commands ``\\left``/``\\right`` (as commands, so ``\\leftarrow`` stays), unwraps ``\\text{}``,
``\\boxed{}`` and friends, and keeps one space only where it separates two words or digits (digit
grouping and mixed numbers are read from it later).  Case is never changed here.

Everything is a single left-to-right pass over a token list; answers longer than
:data:`MAX_ANSWER_CHARS` or nested deeper than :data:`MAX_DEPTH` are not normalised at all (no real
answer is), which keeps the cost of any input bounded.
"""

from __future__ import annotations

import re
from typing import Optional

MAX_ANSWER_CHARS = 10_000
MAX_DEPTH = 100

# One token per match: a command, an escaped character, a whitespace run, or one character.  No
# alternative can backtrack into another, so tokenising is linear.
_TOKEN = re.compile(r"\\[A-Za-z]+|\\.|\s+|.", re.S)

_UNICODE = {
    "\u2212": "-", "\u00d7": r"\times ", "\u00f7": r"\div ", "\u00b7": r"\cdot ", "\u22c5": r"\cdot ",
    "\u03c0": r"\pi ", "\u221e": r"\infty ", "\u2264": r"\leq ", "\u2265": r"\geq ", "\u2260": r"\neq ",
    "\u00b0": r"^{\circ}", "\u221a": r"\usqrt ", "\u00b2": "^{2}", "\u00b3": "^{3}", "\u00b9": "^{1}",
    "\u03b8": r"\theta ", "\u03b1": r"\alpha ", "\u03b2": r"\beta ", "\u00b1": r"\pm ",
    "\u00bd": r"\frac{1}{2}", "\u2153": r"\frac{1}{3}", "\u2154": r"\frac{2}{3}", "\u00bc": r"\frac{1}{4}",
    "\u00be": r"\frac{3}{4}", "\u2155": r"\frac{1}{5}", "\u2159": r"\frac{1}{6}", "\u215b": r"\frac{1}{8}",
    "\u215c": r"\frac{3}{8}", "\u215d": r"\frac{5}{8}", "\u215e": r"\frac{7}{8}",
    "\u00a0": " ", "\u2009": " ", "\u202f": " ", "\u2007": " ", "\u200b": "",
}
_UNICODE_TABLE = str.maketrans(_UNICODE)

SPACE = " "
# Spacing commands become a plain space (``1\,000`` is digit grouping); sizing commands vanish.
_AS_SPACE = {r"\,", r"\;", r"\:", r"\ ", r"\quad", r"\qquad", r"\enspace", r"\thinspace", "~"}
_DROPPED = {r"\left", r"\right", r"\big", r"\Big", r"\bigg", r"\Bigg", r"\bigl", r"\bigr", r"\Bigl",
            r"\Bigr", r"\biggl", r"\biggr", r"\Biggl", r"\Biggr", r"\middle", r"\displaystyle",
            r"\textstyle", r"\scriptstyle", r"\limits", r"\nolimits", r"\!", r"\/", "$", r"\$",
            r"\rm", r"\bf", r"\it"}
_RENAMED = {r"\dfrac": r"\frac", r"\tfrac": r"\frac", r"\cfrac": r"\frac", r"\dbinom": r"\binom",
            r"\tbinom": r"\binom", r"\le": r"\leq", r"\ge": r"\geq", r"\ne": r"\neq", r"\leqslant": r"\leq",
            r"\geqslant": r"\geq", r"\lt": "<", r"\gt": ">", r"\%": "%", r"\lbrace": r"\{", r"\rbrace": r"\}",
            r"\lbrack": "[", r"\rbrack": "]", r"\vert": "|", r"\lvert": "|", r"\rvert": "|", r"\colon": ":",
            r"\varepsilon": r"\epsilon", r"\varphi": r"\phi", r"\to": r"\rightarrow", r"\dots": r"\ldots",
            r"\cdots": r"\ldots", r"\land": r"\wedge", r"\lor": r"\vee", r"\emptyset": r"\varnothing"}
# Wrappers whose argument is the content: formatting, text and boxes.
_UNWRAPPED = {r"\text", r"\textbf", r"\textit", r"\textrm", r"\textnormal", r"\textsf", r"\texttt", r"\mbox",
              r"\mathrm", r"\mathbf", r"\mathit", r"\mathsf", r"\mathtt", r"\boldsymbol", r"\bm", r"\boxed",
              r"\fbox", r"\operatorname", r"\hbox", r"\emph"}
_TEXTUAL = {r"\text", r"\textbf", r"\textit", r"\textrm", r"\textnormal", r"\textsf", r"\texttt", r"\mbox",
            r"\mathrm", r"\operatorname", r"\hbox", r"\emph"}
_ARITY = {r"\frac": 2, r"\binom": 2, r"\sqrt": 1, r"\overline": 1, r"\bar": 1, r"\vec": 1, r"\hat": 1,
          r"\dot": 1, r"\tilde": 1, r"\mathbb": 1, r"\mathcal": 1, r"\mathfrak": 1, r"\underline": 1,
          r"\widehat": 1, r"\overrightarrow": 1, "^": 1, "_": 1}


class _Unreadable(Exception):
    """Unbalanced braces or too deep a nesting: the answer is compared as written."""


def tokens_of(text: str) -> list[str]:
    """The token list of ``text`` after unicode math symbols are spelt as LaTeX."""
    return _TOKEN.findall(text.translate(_UNICODE_TABLE))


def _max_depth(tokens: list[str]) -> int:
    depth = deepest = 0
    for tok in tokens:
        if tok == "{":
            depth += 1
            deepest = max(deepest, depth)
        elif tok == "}":
            depth -= 1
            if depth < 0:
                raise _Unreadable
    if depth:
        raise _Unreadable
    return deepest


class _Writer:
    """Token stream -> canonical token list; ``pos`` walks ``tokens`` once."""

    def __init__(self, tokens: list[str]):
        self.tokens = tokens
        self.pos = 0
        self.textual = False  # any \\text{}-like content seen (its words may be case-folded)

    def group(self, end: Optional[str]) -> list[str]:
        """Canonical tokens up to the closing ``end`` (``"}"``) or the end of input (``None``)."""
        out: list[str] = []
        tokens = self.tokens
        while self.pos < len(tokens):
            tok = tokens[self.pos]
            self.pos += 1
            if tok == end:
                return out
            if tok == "}":
                raise _Unreadable
            out.extend(self.one(tok))
        if end is not None:
            raise _Unreadable
        return out

    def one(self, tok: str) -> list[str]:
        """The canonical tokens of ``tok`` (already consumed) and of the arguments it takes."""
        if tok.isspace() or tok in _AS_SPACE:
            return [SPACE]
        if tok in _DROPPED:
            return []
        if tok == "{":
            return self.group("}")  # a bare group only groups
        if tok in _UNWRAPPED:
            self.textual |= tok in _TEXTUAL
            return [SPACE, *self.argument(), SPACE]
        if tok == r"\usqrt":
            return [r"\sqrt", "{", *self.unicode_radicand(), "}"]
        tok = _RENAMED.get(tok, tok)
        out = [tok]
        if tok == r"\sqrt" and self.peek() == "[":
            out.extend(self.bracket_option())
        for _ in range(_ARITY.get(tok, 0)):
            out.extend(("{", *self.argument(), "}"))
        return out

    def peek(self) -> Optional[str]:
        while self.pos < len(self.tokens) and self.tokens[self.pos].isspace():
            self.pos += 1
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def argument(self) -> list[str]:
        """One TeX argument: a braced group, or else the next single token (``\\frac12``)."""
        tok = self.peek()
        if tok is None or tok == "}":
            raise _Unreadable
        self.pos += 1
        return _trim(self.group("}") if tok == "{" else self.one(tok))

    def bracket_option(self) -> list[str]:
        self.pos += 1  # the "["
        inner: list[str] = []
        while self.pos < len(self.tokens) and self.tokens[self.pos] != "]":
            inner.append(self.tokens[self.pos])
            self.pos += 1
        self.pos += 1
        return ["[", *_trim([t for t in inner if not t.isspace()]), "]"]

    def unicode_radicand(self) -> list[str]:
        """``√`` takes a whole digit run (``√12``), a parenthesised group, or one argument."""
        tok = self.peek()
        if tok is not None and tok.isdigit():
            digits = []
            while self.pos < len(self.tokens) and self.tokens[self.pos].isdigit():
                digits.append(self.tokens[self.pos])
                self.pos += 1
            return digits
        if tok == "(":
            depth, start = 0, self.pos
            for i in range(self.pos, len(self.tokens)):
                depth += {"(": 1, ")": -1}.get(self.tokens[i], 0)
                if depth == 0:
                    inner = self.tokens[start + 1:i]
                    self.pos = i + 1
                    return _Writer(inner).group(None)
            raise _Unreadable
        return self.argument()


def _trim(tokens: list[str]) -> list[str]:
    start, end = 0, len(tokens)
    while start < end and tokens[start] == SPACE:
        start += 1
    while end > start and tokens[end - 1] == SPACE:
        end -= 1
    return tokens[start:end]


def _join(tokens: list[str]) -> str:
    """Tokens -> text, one space kept only between two letters or digits (``72 apples``, ``1 000``)
    or after a command followed by a letter (``\\pi r`` must not become ``\\pir``)."""
    out: list[str] = []
    pending_space = False
    for tok in tokens:
        if tok == SPACE:
            pending_space = bool(out)
            continue
        if pending_space:
            prev = out[-1]
            if (len(prev) == 1 and prev.isalnum() and len(tok) == 1 and tok.isalnum()) or (
                    prev[0] == "\\" and prev[1:].isalpha() and tok[:1].isalpha()):
                out.append(SPACE)
        pending_space = False
        out.append(tok)
    return "".join(out)


class Canonical:
    """A normalised answer: ``text`` (canonical spelling) and whether it used ``\\text{}``-like words."""

    __slots__ = ("text", "textual", "readable")

    def __init__(self, text: str, textual: bool, readable: bool):
        self.text, self.textual, self.readable = text, textual, readable

    def __repr__(self) -> str:
        return f"Canonical({self.text!r}, textual={self.textual}, readable={self.readable})"


def canonical(answer: str) -> Canonical:
    """The canonical form of ``answer`` (see the module docstring); linear in its length."""
    answer = answer.strip()
    if len(answer) > MAX_ANSWER_CHARS:
        return Canonical(answer, False, False)
    tokens = tokens_of(answer)
    try:
        if _max_depth(tokens) > MAX_DEPTH:
            raise _Unreadable
        writer = _Writer(tokens)
        out = writer.group(None)
    except (_Unreadable, RecursionError):
        return Canonical(" ".join(answer.split()), False, False)
    text = _join(_trim(out))
    return Canonical(_strip_sentence_end(text), writer.textual, True)


def _strip_sentence_end(text: str) -> str:
    """A closing period, or an exclamation mark after a word, is punctuation.  ``!`` right after a
    digit, a single letter or a bracket is a factorial: ``5!`` is 120, never 5."""
    text = text.strip()
    while text.endswith((".", "!")) and not text.endswith(r"\ldots"):
        if text.endswith("!") and _factorial_operand(text[:-1]):
            break
        text = text[:-1].rstrip()
    return text


def _factorial_operand(before: str) -> bool:
    """Whether ``!`` after ``before`` is a factorial: ``before`` ends in a digit, a one-letter symbol,
    a closing bracket or another ``!`` (``4!!``), not in a word (``Yes!``)."""
    if not before or before[-1] in ")]}!":
        return bool(before)
    if before[-1].isdigit():
        return True
    return before[-1].isalpha() and not before[-2:-1].isalpha()




def split_top_level(text: str, separator: str = ",") -> list[str]:
    """``text`` split on ``separator`` outside every bracket pair; linear (one pass, a depth counter)."""
    parts, depth, start = [], 0, 0
    tokens = _TOKEN.findall(text)
    pos = 0
    for tok in tokens:
        if tok in ("(", "[", "{", r"\{", r"\langle"):
            depth += 1
        elif tok in (")", "]", "}", r"\}", r"\rangle") and depth > 0:
            depth -= 1
        elif tok == separator and depth == 0:
            parts.append(text[start:pos])
            start = pos + len(tok)
        pos += len(tok)
    parts.append(text[start:])
    return [p.strip() for p in parts]


def enclosure(text: str) -> tuple[str, str, str]:
    """``(opener, inner, closer)`` when one bracket pair wraps all of ``text``, else ``("", text, "")``.

    Interval ends may differ (``(1,2]``); the pair must still enclose everything, which is checked
    with one depth count over the tokens."""
    tokens = _TOKEN.findall(text)
    if len(tokens) < 2:
        return "", text, ""
    first, last = tokens[0], tokens[-1]
    opens, closes = ("(", "[", r"\{", r"\langle"), (")", "]", r"\}", r"\rangle")
    if first not in opens or last not in closes:
        return "", text, ""
    if (first == r"\{") != (last == r"\}") or (first == r"\langle") != (last == r"\rangle"):
        return "", text, ""
    depth = 0
    for i, tok in enumerate(tokens):
        if tok in opens:
            depth += 1
        elif tok in closes:
            depth -= 1
            if depth == 0 and i != len(tokens) - 1:
                return "", text, ""
    if depth != 0:
        return "", text, ""
    return first, text[len(first):len(text) - len(last)].strip(), last
