"""Where the final answer of a response is: the GSM8K ``#### x`` line or the last ``\\boxed{x}``.

Contract: a response states its final answer after ``####`` (to the end of that line) or in
``\\boxed{...}``/``\\fbox{...}``; whichever comes last wins.  Two refinements make the contract
hold for chat models without letting a policy game it:

* A markdown heading (``#### Summary`` followed by more text) is not an answer marker, so a
  heading written after the answer does not hide it.  A ``####`` line counts as a heading when its
  text starts with a letter and either more text follows it or it ends with ``:``; when no other
  answer exists, the last such line is still taken.
* A final answer the text then takes back (``\\boxed{12} is incorrect``, ``... that's wrong``) is no
  answer (:mod:`megatron_rl.rewards.retraction`); references are never checked for that.
* Several boxes: only the last *group* counts, where a group is boxes separated by nothing but
  spaces, ``$``, commas, semicolons, ``and``/``or`` (``\\boxed{2} and \\boxed{3}``).  Boxes earlier
  in the text (intermediate results) are ignored; a group of more than :data:`MAX_GROUP` boxes is
  no answer at all.  How a group is graded is up to the comparison:
  see :func:`megatron_rl.rewards.compare.group_matches`.

Every scan is linear: ``####`` lines are found with ``str.rfind`` from the end, each line visited
once; boxes are matched in one left-to-right pass that only walks braces while a box is open.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from megatron_rl.rewards.compare import group_matches
from megatron_rl.rewards.retraction import retracted

MAX_GROUP = 32  # more adjacent boxes than this is not an answer, whatever they hold
MAX_BOX_TOKENS = 50_000
UNREADABLE = "unreadable"
_MAX_GAP = 64

_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)[ \t]*\{")
# Inside a box: a double backslash (a line break, so ``\\{`` is not an escaped brace), an
# escaped brace, a plain brace, or a nested box.  Alternatives start differently: no backtracking.
_BRACE = re.compile(r"\\\\|\\[{}]|\{+|\}+|\\(?:boxed|fbox)[ \t]*\{")
_GAP_WORDS = frozenset({"and", "or", r"\text{and}", r"\text{or}", r"\quad", r"\qquad", r"\text{", "}"})
_ANSWER_TITLES = frozenset({"answer", "final answer", "the answer", "the final answer", "solution"})
_ANSWER_PREFIXES = ("the final answer is", "final answer is", "the answer is", "final answer", "answer is",
                    "answer")


@dataclass(frozen=True)
class FinalAnswer:
    """The final answer: one part for ``####``, one per box of the last group of boxes."""

    parts: tuple[str, ...]
    source: str  # "hashes", "boxed", or UNREADABLE (braces past the step budget: no answer)
    position: int
    end: int = -1  # where the text after the answer starts (-1: not known, UNREADABLE)

    @property
    def text(self) -> str:
        return ", ".join(self.parts)


def boxes(text: str, start: int = 0) -> Optional[list[tuple[int, int, int]]]:
    """``(start, content_start, content_end)`` of every closed box not inside another closed box.

    None when the braces inside boxes take more than :data:`MAX_BOX_TOKENS` steps to match: no
    answer is written like that, and grading such a response as having no answer is the safe
    choice.  Runs of plain braces count as one step (``{{{{`` pushes a count, not four entries)."""
    closed: list[tuple[int, int, int]] = []
    stack: list[list] = []  # [None, count] for a run of plain braces, [start, content_start] for a box
    open_boxes, pos, steps = 0, start, 0
    while True:
        if open_boxes == 0:
            match = _BOX_OPEN.search(text, pos)
            if match is None:
                break
            stack = [[match.start(), match.end()]]
            open_boxes, pos = 1, match.end()
            continue
        match = _BRACE.search(text, pos)
        if match is None:
            break
        steps += 1
        if steps > MAX_BOX_TOKENS:
            return None
        pos = match.end()
        tok = match.group()
        if tok[0] == "{":
            if stack[-1][0] is None:
                stack[-1][1] += len(tok)
            else:
                stack.append([None, len(tok)])
        elif tok[0] == "}":
            at = match.start()
            while at < pos and open_boxes:
                top = stack[-1]
                if top[0] is None:
                    used = min(top[1], pos - at)
                    top[1] -= used
                    at += used
                    if not top[1]:
                        stack.pop()
                else:
                    stack.pop()
                    open_boxes -= 1
                    closed.append((top[0], top[1], at))
                    at += 1
            if not open_boxes:
                pos = at  # braces left in the run are outside every box
        elif tok[-1] == "{" and len(tok) > 2:
            stack.append([match.start(), match.end()])
            open_boxes += 1
    # Boxes nest properly, so walking them by decreasing end keeps exactly the outermost ones.
    outer, kept_start = [], len(text) + 1
    for box in reversed(closed):
        if box[0] < kept_start:
            outer.append(box)
            kept_start = box[0]
    outer.reverse()
    return outer


def _separator_only(gap: str) -> bool:
    if len(gap) > _MAX_GAP:
        return False
    words = gap.replace("$", " ").replace(",", " ").replace(";", " ").replace(r"\,", " ").replace("~", " ").split()
    return all(word in _GAP_WORDS for word in words)


def last_group(text: str, start: int = 0) -> Optional[FinalAnswer]:
    """The last group of adjacent boxes at or after ``start`` (see the module docstring)."""
    found = boxes(text, start)
    if found is None:
        return FinalAnswer(("",), UNREADABLE, start)
    if not found:
        return None
    group = [found[-1]]
    for box in reversed(found[:-1]):
        if not _separator_only(text[box[2] + 1:group[-1][0]]):
            break
        group.append(box)
        if len(group) > MAX_GROUP:
            return FinalAnswer(("",), UNREADABLE, group[-1][0])
    group.reverse()
    parts = tuple(text[b[1]:b[2]].strip() for b in group)
    return FinalAnswer(parts, "boxed", group[0][0], group[-1][2] + 1)


def _clean_hashes(content: str) -> str:
    """Markdown emphasis, an ``Answer:`` prefix or a ``The total is`` phrase, and a closing period
    removed from a ``####`` line."""
    text = content.strip().strip("*_").strip()
    lowered = text.lower()
    for prefix in _ANSWER_PREFIXES:
        if lowered.startswith(prefix):
            rest = text[len(prefix):].lstrip()
            if rest.startswith(":") or prefix.endswith(" is"):
                text = rest.lstrip(":").strip().strip("*_").strip()
                break
    else:
        head, sep, rest = text.partition(" is ")
        if sep and head.replace(" ", "").isalpha() and rest.strip():
            text = rest.strip()  # ``The total is 72 apples``
    return text.rstrip(".").strip()


def _is_heading(content: str, followed_by_text: bool) -> bool:
    text = content.strip().strip("*_").strip()
    if not text or not text[0].isalpha():
        return False
    lowered = text.lower()
    for prefix in _ANSWER_PREFIXES:
        if lowered.startswith(prefix) and (text[len(prefix):].lstrip().startswith(":") or prefix.endswith(" is")):
            return not _clean_hashes(text)
    return followed_by_text or text.endswith(":")


def _scan_hashes(text: str) -> tuple[Optional[FinalAnswer], Optional[FinalAnswer]]:
    """``(last answer line, last heading-like line)``; lines are visited once, from the end."""
    end, last_text = len(text), len(text.rstrip())
    fallback = None
    while True:
        pos = text.rfind("####", 0, end)
        if pos < 0:
            return None, fallback
        line_start = text.rfind("\n", 0, pos) + 1
        line_end = text.find("\n", pos)
        line_end = len(text) if line_end < 0 else line_end
        end = line_start
        if pos > line_start and text[pos - 1] == "#":
            continue  # five or more hashes: a markdown heading, never the GSM8K marker
        content = text[pos + 4:line_end]
        if not content.strip():
            continue
        if _is_heading(content, line_end < last_text):
            title = content.strip().strip("*_:").strip()
            if title.lower() in _ANSWER_TITLES:
                following, following_end = _next_line(text, line_end)
                if following:
                    return FinalAnswer((following,), "hashes", pos, following_end), fallback
            fallback = fallback or FinalAnswer((title,), "hashes", pos, line_end)
            continue
        cleaned = _clean_hashes(content)
        if cleaned:
            return FinalAnswer((cleaned,), "hashes", pos, line_end), fallback


def _next_line(text: str, pos: int) -> tuple[str, int]:
    """The first non-blank line after ``pos``, cleaned like a ``####`` line, and where it ends."""
    while pos < len(text):
        end = text.find("\n", pos + 1)
        end = len(text) if end < 0 else end
        line = text[pos:end].strip()
        if line:
            return _clean_hashes(line), end
        pos = end
    return "", pos


def final_answer(text: str, check_retraction: bool = True) -> Optional[FinalAnswer]:
    """The final answer of ``text`` by the contract in the module docstring, or None (also when the
    text takes it back, unless ``check_retraction`` is False)."""
    if not isinstance(text, str):
        raise TypeError(f"a response must be a str, got {type(text).__name__}")
    hashes, heading = _scan_hashes(text)
    boxed = last_group(text, hashes.position if hashes is not None else 0)
    if boxed is not None and boxed.source == UNREADABLE:
        return None
    answer = boxed if boxed is not None and boxed.parts != ("",) else hashes or heading
    if answer is not None and check_retraction and _taken_back(text, answer):
        return None
    return answer


def _taken_back(text: str, answer: FinalAnswer) -> bool:
    return retracted(text, answer.position, answer.end, lambda other: group_matches(answer.parts, other))


def extract_answer(text: str, check_retraction: bool = True) -> Optional[str]:
    """The final answer of ``text`` as one string (a group of boxes joined by ``", "``), or None."""
    answer = final_answer(text, check_retraction)
    return answer.text if answer is not None and answer.text.strip() else None


def reference_answer(answer) -> Optional[str]:
    """The reference as a bare answer: GSM8K solutions (``...#### 72``) and boxed solutions reduced."""
    if answer is None:
        return None
    text = str(answer)
    if "####" in text or _BOX_OPEN.search(text):
        return extract_answer(text, check_retraction=False)
    return text.strip() or None
