"""Built-in synthetic documents: small, regular tasks that a tiny model learns in a few steps.

Each document is computed from ``(seed, index)`` alone, so a stream position is restored in
O(1) and any document can be checked on its own. The vocabulary is kept small on purpose:
the point is a loss curve that visibly falls in a smoke run, not realistic text.
"""

import random
import string

_DETERMINERS = ("the", "a", "one", "every")
# No adjective or noun starts with a vowel, so "a" is always grammatical.
_ADJECTIVES = ("big", "small", "red", "blue", "happy", "quiet", "little", "brave")
_NOUNS = ("cat", "dog", "bird", "fish", "child", "teacher", "farmer", "robot")
_VERBS = ("sees", "likes", "finds", "helps", "follows", "paints")
_PLACES = ("in the park", "near the river", "at home", "on the hill")


def _noun_phrase(rng: random.Random) -> str:
    words = [rng.choice(_DETERMINERS)]
    if rng.random() < 0.5:
        words.append(rng.choice(_ADJECTIVES))
    words.append(rng.choice(_NOUNS))
    return " ".join(words)


def _sentence(rng: random.Random) -> str:
    sentence = f"{_noun_phrase(rng)} {rng.choice(_VERBS)} {_noun_phrase(rng)}"
    if rng.random() < 0.3:
        sentence += f" {rng.choice(_PLACES)}"
    return sentence[0].upper() + sentence[1:] + "."


def _arithmetic(rng: random.Random) -> str:
    op = rng.choice("+-*")
    if op == "*":
        a, b = rng.randint(0, 12), rng.randint(0, 12)
        return f"{a} * {b} = {a * b}"
    a = rng.randint(0, 99)
    if op == "+":
        b = rng.randint(0, 99)
        return f"{a} + {b} = {a + b}"
    b = rng.randint(0, a)  # keeps results non-negative
    return f"{a} - {b} = {a - b}"


def _copy(rng: random.Random) -> str:
    letters = " ".join(rng.choices(string.ascii_lowercase, k=rng.randint(3, 6)))
    return f"copy: {letters} -> {letters}"


def _sort(rng: random.Random) -> str:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(3, 7))]
    return f"sort: {' '.join(map(str, digits))} -> {' '.join(map(str, sorted(digits)))}"


_TASKS = (_arithmetic, _copy, _sort, _sentence)


def synthetic_document(seed: int, index: int) -> str:
    """Document ``index`` of the stream for ``seed``: 3 to 6 lines of mixed tasks."""
    # A string seed goes through SHA-512, so it is stable across processes and Python
    # versions (unlike hash()).
    rng = random.Random(f"temper.synthetic:{seed}:{index}")
    return "\n".join(rng.choice(_TASKS)(rng) for _ in range(rng.randint(3, 6)))
