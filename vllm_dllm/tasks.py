"""Generated tasks with checkable answers: the trained model's curriculum and yardstick.

Each task draws unlimited instances from a seeded `random.Random`.  Train and test
splits never overlap: an instance belongs to the test split exactly when a hash of its
content falls in the test bucket, and a generator asked for one split redraws until it
gets an instance of that split.

Formats (prompt -> answer), all plain text so a curl request reads naturally:
  retrieval  "lookup\\n;ab=CD;ef=GH;...;mn=OP\\nvalue of;ef="   -> "GH"
  addition   "add 48213+975="                                   -> "1023188"
  copy       "copy QWERTYUIOPAS"                                -> "QWERTYUIOPAS"
  reverse    "reverse QWERTYUIOPAS"                             -> "SAPOIUYTREWQ"
Keys are two lowercase letters, which the tokenizer makes one token with their
separators (";xy="), so matching the query is matching one token; a 120-pair context
is about 360 tokens.  Values are two capitals, one token each: the symbols copy and
reverse also answer with.  (Values were once lowercase pairs, single tokens too: the
model then had to learn 676 output tokens from about one answer token per row, and
after 2500 retrieval steps it still answered at chance.)
"""

from __future__ import annotations

import hashlib
import random
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
SYMBOLS = string.ascii_uppercase
TEST_BUCKETS = 10  # one bucket in ten is the test split

TRAIN, TEST = "train", "test"


@dataclass(frozen=True)
class Instance:
    task: str
    prompt: str
    answer: str


def _split_of(prompt: str) -> str:
    digest = hashlib.blake2b(prompt.encode(), digest_size=8).digest()
    return TEST if int.from_bytes(digest, "little") % TEST_BUCKETS == 0 else TRAIN


class Task(ABC):
    name: str
    gen_length: int  # canvas length used to train and evaluate this task

    @abstractmethod
    def draw(self, rng: random.Random) -> Instance:
        """One instance, of either split."""

    def sample(self, rng: random.Random, split: str) -> Instance:
        while True:
            instance = self.draw(rng)
            if _split_of(instance.prompt) == split:
                return instance


def _pair(rng: random.Random) -> str:
    return rng.choice(LETTERS) + rng.choice(LETTERS)


class Retrieval(Task):
    name = "retrieval"
    gen_length = 8

    def __init__(self, min_pairs: int = 40, max_pairs: int = 120):
        self.min_pairs, self.max_pairs = min_pairs, max_pairs

    def draw(self, rng: random.Random) -> Instance:
        n = rng.randint(self.min_pairs, self.max_pairs)
        keys: list[str] = []
        seen: set[str] = set()
        while len(keys) < n:
            key = _pair(rng)
            if key not in seen:
                seen.add(key)
                keys.append(key)
        values = [rng.choice(SYMBOLS) + rng.choice(SYMBOLS) for _ in keys]
        query = rng.randrange(n)
        pairs = "".join(f";{k}={v}" for k, v in zip(keys, values))
        return Instance(self.name, f"lookup\n{pairs}\nvalue of;{keys[query]}=", values[query])


class Addition(Task):
    name = "addition"
    gen_length = 8

    def __init__(self, max_digits: int = 6):
        self.max_digits = max_digits

    def draw(self, rng: random.Random) -> Instance:
        a = rng.randrange(10 ** rng.randint(1, self.max_digits))
        b = rng.randrange(10 ** rng.randint(1, self.max_digits))
        return Instance(self.name, f"add {a}+{b}=", str(a + b))


class Copy(Task):
    name = "copy"
    gen_length = 56

    def __init__(self, min_len: int = 16, max_len: int = 48):
        self.min_len, self.max_len = min_len, max_len

    def transform(self, text: str) -> str:
        return text

    def draw(self, rng: random.Random) -> Instance:
        text = "".join(rng.choice(SYMBOLS) for _ in range(rng.randint(self.min_len, self.max_len)))
        return Instance(self.name, f"{self.name} {text}", self.transform(text))


class Reverse(Copy):
    name = "reverse"

    def transform(self, text: str) -> str:
        return text[::-1]


TASKS: dict[str, Task] = {t.name: t for t in (Retrieval(), Addition(), Copy(), Reverse())}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task '{name}'; choose from {', '.join(TASKS)}") from None


def score(instance: Instance, output: str) -> bool:
    """Exact match of the generated text (whitespace-trimmed) with the answer."""
    return output.strip() == instance.answer


def char_score(instance: Instance, output: str) -> float:
    """Fraction of the answer's characters reproduced at their position: partial
    credit that shows a model learning before it gets whole answers right (chance is
    about 1/26 per letter, 1/10 per digit)."""
    answer, text = instance.answer, output.strip()
    return sum(a == b for a, b in zip(answer, text)) / len(answer)
