"""Final answers of math completions and references, compared numerically (the `math_accuracy` reward).

A completion's answer is, in order of precedence: the last `\\boxed{...}`, the text after the last `####`
(GSM8K's marker), the number after the last "answer is" / "Answer:", else the last number in the text.
A reference answer is the text after its last `####` (a GSM8K solution), its last `\\boxed{}`, or itself.
Both are compared as numbers when both parse (`1,234`, `$18.00`, `72%`, `3/4`, `\\frac{3}{4}`, `-5`),
otherwise as text with spaces, `$` and trailing periods dropped.
"""
from __future__ import annotations

import re

NUMBER = r"[-+−]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
ANSWER_CUE = re.compile(rf"answer\s*(?:is|:|=)\s*:?\s*\\?\$?\s*({NUMBER}(?:\s*/\s*\d+)?)", re.IGNORECASE)
ANY_NUMBER = re.compile(NUMBER)
FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{([^{}]*)\}")
SPACING = re.compile(r"\\[,;:! ]|\\quad|\\qquad|\\left|\\right")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...}, braces matched (so \\boxed{\\frac{1}{2}} works)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for i in range(brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[brace + 1:i]
    return None  # unbalanced: the completion was cut inside the box


def after_hashes(text: str) -> str | None:
    """GSM8K's `#### 72` marker: the first line after the last ####."""
    if "####" not in text:
        return None
    tail = text.rsplit("####", 1)[1].strip()
    return tail.splitlines()[0].strip() if tail else None


def completion_answer(text: str) -> str | None:
    """The answer a completion gives, or None when it gives none."""
    for found in (last_boxed(text), after_hashes(text)):
        if found:
            return found
    cues = ANSWER_CUE.findall(text)
    if cues:
        return cues[-1]
    numbers = ANY_NUMBER.findall(text)
    return numbers[-1] if numbers else None


def reference_answer(text: str) -> str:
    return after_hashes(text) or last_boxed(text) or text.strip()


def normalize(text: str) -> str:
    text = SPACING.sub("", TEXT_WRAP.sub(r"\1", text))
    text = text.replace("\\$", "").replace("$", "").replace("−", "-").replace("\\%", "%")
    return re.sub(r"\s+", "", text).rstrip(".")


def to_number(text: str) -> float | None:
    """A number from an answer string, or None when it is not one (an expression, a word)."""
    text = FRAC.sub(r"(\1)/(\2)", normalize(text))
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text).rstrip("%")
    if text.startswith("(") and text.endswith(")") and text.count("(") == 1:
        text = text[1:-1]
    m = re.fullmatch(r"\(?([-+]?[\d.]+)\)?/\(?([-+]?[\d.]+)\)?", text)
    try:
        if m:
            return float(m.group(1)) / float(m.group(2))
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(predicted: str | None, reference: str) -> bool:
    if predicted is None:
        return False
    a, b = to_number(predicted), to_number(reference)
    if a is not None and b is not None:
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))
    return normalize(predicted) == normalize(reference)

