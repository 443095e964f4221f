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

`TASKS` holds those four: the shipped LLaDA-format model was trained on them and is
measured on them (`--task all`).  `HARD_TASKS` holds four whose answers take several
dependent steps, so that committing many tokens at once goes wrong unless the model is
sure (tasks that rank decoding rules):
  sort       "sort 52 7 913 40"                                  -> "7 40 52 913"
  multiply   "mul 4821*97="                                      -> "033747+433890=467637"
  chain      "chain\\n;ab=C;cd=E;ef=C\\n;C=XY;E=GH\\nfollow;ab=" -> "C=XY"
  brackets   "close ([]{<>}(<"                                   -> ">))"
Sort: where each number lands depends on every other one, and on the widths of the
numbers before it.  Multiply: every digit of the product depends on the carries of the
digits right of it; under a two-digit multiplier the answer writes its working first, the
two partial products (a by the units digit, a by the tens digit times ten) and then their
sum, so the sum's digits depend on answer tokens decoded before them.  (Written alone,
the product was not learned: an 8-layer model did not learn to sum two partial products
inside one digit's computation, whatever its training, lab/training-log.md;
`Multiply(working=False)` still draws that format, and `score` still takes the
product written alone as right: `accepted_answers`.  The working's three
numbers are padded to six digits, so a sum digit stands a fixed distance after the two it
adds; the unpadded working still scores right.)  Chain (two-hop retrieval): a link's value names a hub, whose
value is two capitals; the answer is the hub then its value, so the value depends on
the hub decoded before it.  Both hops match a token with itself, and every answer
token is one other tasks answer with too.  Two earlier formats named the hub by its
lowercase-pair key: written bare ("cd") in the link it is another token than the key
(";cd="), and written as the key the answer must output one of 676 key tokens.  Either
way the model had 676 pairings (of tokens, or of output rows) to learn from about one
row each, and did not (lab/training-log.md).
Brackets: the closers of the brackets left open, innermost first.  Answers use digits,
capitals, spaces, "=", "+" and bracket characters, one token each under the task tokenizer.

`AUX_TASKS` holds training aids, in no group:
  lookup     "find\n;ab=C;ef=G;...\nvalue of;ef="                  -> "G"
  recall     "find\n;ab=C;ef=G;ij=K;...\nvalues of;ef=;ab="        -> "GC"
  working_sum "sum the working"                                  -> "33747+433890=467637"
  padded_sum "sum the working"                                   -> "0033747+0433890=0467637"
(working_sum's and padded_sum's working is shown to training as given: `Task.working_given`)
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

LETTERS = string.ascii_lowercase
SYMBOLS = string.ascii_uppercase
TEST_BUCKETS = 10  # one bucket in ten is the test split
MAX_HUBS = 20  # chain's hubs: 60 pairs stay under 200 tokens

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
    # A training aid whose answer's working is not in its prompt: training shows that
    # working as given, and generation cannot be scored on it.
    working_given = False

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


class Sort(Task):
    """Sort `min_count`-`max_count` numbers below `max_value` (repeats allowed), ascending."""

    name = "sort"
    gen_length = 48

    def __init__(self, min_count: int = 4, max_count: int = 10, max_value: int = 1000):
        self.min_count, self.max_count, self.max_value = min_count, max_count, max_value

    def draw(self, rng: random.Random) -> Instance:
        numbers = [rng.randrange(self.max_value) for _ in range(rng.randint(self.min_count, self.max_count))]
        return Instance(self.name, "sort " + " ".join(map(str, numbers)),
                        " ".join(map(str, sorted(numbers))))


class Multiply(Task):
    """a * b with a of 1-`max_digits_a` digits and b of 1-`max_digits_b`; with
    `min_digits` above 1 (training's focus on the hard part) each factor has at least
    `min_digits` digits, or its maximum where that is fewer.  With `working` (the
    default) a two-digit multiplier's answer writes its two partial products before the
    product (`multiply_answer`); without it every answer is the product alone."""

    name = "multiply"

    def __init__(self, max_digits_a: int = 4, max_digits_b: int = 2, min_digits: int = 1, working: bool = True,
                 width: int | None = None):
        if min_digits < 1:
            raise ValueError(f"min_digits must be at least 1, not {min_digits}")
        if working and max_digits_b > 2:
            raise ValueError(f"the written working covers multipliers of up to two digits, not {max_digits_b}")
        if width is not None and width < max_digits_a + max_digits_b:
            raise ValueError(f"a padded working of width {width} cannot hold products of up to "
                             f"{max_digits_a + max_digits_b} digits")
        self.max_digits_a, self.max_digits_b, self.min_digits = max_digits_a, max_digits_b, min_digits
        self.working, self.width = working, width

    @property
    def gen_length(self) -> int:
        # The product has at most max_digits_a + max_digits_b digits; the working adds
        # two partial products of at most max_digits_a + 1 and + 2 digits, "+" and "=";
        # padded, all three numbers are `width` digits.
        product = self.max_digits_a + self.max_digits_b
        if self.working and self.max_digits_b == 2:
            written = 3 * self.width + 2 if self.width else product + 2 * self.max_digits_a + 5
        else:
            written = product
        return 8 * -(-written // 8)

    @property
    def max_digits(self) -> int:  # what eval's description and canvas fitting read
        return max(self.max_digits_a, self.max_digits_b)

    def _factor(self, rng: random.Random, max_digits: int) -> int:
        least = min(self.min_digits, max_digits)
        digits = rng.randint(least, max_digits)
        # randrange(0, n) draws as randrange(n) does: the default range's instances are unchanged.
        return rng.randrange(10 ** (least - 1) if least > 1 else 0, 10**digits)

    def draw(self, rng: random.Random) -> Instance:
        a = self._factor(rng, self.max_digits_a)
        b = self._factor(rng, self.max_digits_b)
        return Instance(self.name, f"mul {a}*{b}=", multiply_answer(a, b, self.working, self.width))


def multiply_answer(a: int, b: int, working: bool = True, width: int | None = None) -> str:
    """The product; with `working` and a two-digit multiplier, its partial products
    first, as written by hand: 4821*97 -> "33747+433890=467637" (4821*7, 4821*90, the
    sum).  The product's digit sums two partial products and a carry, a sum this model
    size did not find from the product's digits alone (lab/training-log.md, sessions
    30-37); written out, each step is a product by one digit and then an addition, both
    learned, and the answer's later tokens depend on its earlier ones.  With `width`, the
    working's three numbers are written at that width, leading zeros in front
    ("0033747+0433890=0467637" at 7), so each digit of the sum stands a fixed distance
    after the two it adds (tasks' padded_sum)."""
    if working and 10 <= b <= 99:
        return written_sum(a * (b % 10), a * (b // 10) * 10, width)
    return str(a * b)


def written_sum(x: int, y: int, width: int | None = None) -> str:
    """"x+y=sum", each number at `width` digits (leading zeros) when given: the working's
    layout, shared by multiply, working_sum/padded_sum and altered working."""
    w = width or 0
    return f"{x:0{w}d}+{y:0{w}d}={x + y:0{w}d}"


def multiply_layouts(a: int, b: int) -> tuple[str, ...]:
    """Every written form of a * b that is right: the working plain and padded at the
    registered task's width (under a two-digit multiplier), and the product alone."""
    full = ALL_TASKS["multiply"]
    padded = full.width or full.max_digits_a + full.max_digits_b
    return tuple(dict.fromkeys((multiply_answer(a, b), multiply_answer(a, b, width=padded), str(a * b))))


def multiply_product(answer: str) -> str:
    """The product a multiply answer ends with, its working (if any) and a padded
    working's leading zeros left off."""
    if "=" not in answer:
        return answer
    product = answer.rsplit("=", 1)[-1]
    return product.lstrip("0") or product[-1:]


def working_length(instance: Instance) -> int:
    """How many of the answer's leading characters are working that the rest is
    computed from: a multiply's partial products up to their sum ("33747+433890=" of
    "33747+433890=467637"); 0 where the answer writes no working."""
    if instance.task in ("multiply", "working_sum", "padded_sum") and "=" in instance.answer:
        return instance.answer.rindex("=") + 1
    return 0


def multiply_factors(prompt: str) -> tuple[int, int] | None:
    """(a, b) of a multiply prompt ("mul a*b="), None for any other prompt."""
    match = re.fullmatch(r"mul (\d+)\*(\d+)=", prompt.strip())
    return None if match is None else (int(match[1]), int(match[2]))


class Chain(Task):
    """Two-hop retrieval over `min_pairs`-`max_pairs` pairs in two tables.  Links map a
    key (two lowercase letters) to a hub, named by one capital; hubs map their capital
    to two capitals.  About half the pairs are hubs, at most MAX_HUBS.  The query is a
    link; the answer is its hub, "=", and the hub's value."""

    name = "chain"
    gen_length = 8

    def __init__(self, min_pairs: int = 20, max_pairs: int = 60):
        self.min_pairs, self.max_pairs = max(2, min_pairs), max(2, max_pairs)

    def draw(self, rng: random.Random) -> Instance:
        n = rng.randint(self.min_pairs, self.max_pairs)
        hubs = rng.sample(SYMBOLS, min(MAX_HUBS, max(1, n // 2)))
        links = rng.sample([a + b for a in LETTERS for b in LETTERS], n - len(hubs))
        hub_of = {k: rng.choice(hubs) for k in links}
        value = {h: rng.choice(SYMBOLS) + rng.choice(SYMBOLS) for h in hubs}
        query = rng.choice(links)
        link_table = "".join(f";{k}={hub_of[k]}" for k in links)
        hub_table = "".join(f";{h}={value[h]}" for h in hubs)
        hub = hub_of[query]
        return Instance(self.name, f"chain\n{link_table}\n{hub_table}\nfollow;{query}=", f"{hub}={value[hub]}")


class Lookup(Task):
    """Retrieval's mechanism alone: find the queried key, read the one capital after it.

    An auxiliary training task, in no evaluation group: the LLaDA2-format model never
    formed retrieval's lookup (lab/training-log.md), and a one-token value gives that
    mechanism its whole signal at every answer, where retrieval's two capitals can be
    half right."""

    name = "lookup"
    gen_length = 4

    def __init__(self, min_pairs: int = 8, max_pairs: int = 40):
        self.min_pairs, self.max_pairs = max(2, min_pairs), max(2, max_pairs)

    def draw(self, rng: random.Random) -> Instance:
        n = rng.randint(self.min_pairs, self.max_pairs)
        keys = rng.sample([a + b for a in LETTERS for b in LETTERS], n)
        values = [rng.choice(SYMBOLS) for _ in keys]
        query = rng.randrange(n)
        pairs = "".join(f";{k}={v}" for k, v in zip(keys, values))
        return Instance(self.name, f"find\n{pairs}\nvalue of;{keys[query]}=", values[query])


class WorkingSum(Task):
    """Multiply's last step alone: the sum of two numbers that stand in the answer.

    A training aid, in no evaluation group, with `working_given`: the prompt never
    names the numbers, and training shows the answer's working as given (never masked
    or scored), so the sum can only be read from the answer, one position after its
    "=", as a multiply answer's sum is.  The LLaDA2-format model adds the prompt's
    numbers at 0.95 per digit and the same numbers written in multiply's answer at
    0.2 in the tens and hundreds (lab/training-log.md).  Half the second
    numbers end in 0, as a tens partial product does.  Its prompt is the same for every
    instance, so the split goes by the answer."""

    name = "working_sum"
    gen_length = 24
    working_given = True

    def __init__(self, max_digits: int = 5):
        self.max_digits = max_digits

    def draw(self, rng: random.Random) -> Instance:
        x = rng.randrange(10 ** rng.randint(1, self.max_digits))
        y = rng.randrange(10 ** rng.randint(1, self.max_digits))
        y = y * 10 if rng.random() < 0.5 else y
        return Instance(self.name, "sum the working", written_sum(x, y))

    def sample(self, rng: random.Random, split: str) -> Instance:
        # Split by the plain answer, so a layout of the same pairs holds out the same ones.
        while True:
            plain = WorkingSum.draw(self, rng)
            if _split_of(plain.answer) == split:
                return self.written(plain)

    def written(self, plain: Instance) -> Instance:
        """The instance in this task's layout."""
        return plain


class PaddedWorkingSum(WorkingSum):
    """working_sum with all three numbers written at one width, leading zeros in front
    ("0033747+0433890=0467637" at `width` 7).  Then a sum digit stands
    a fixed distance after the two digits it adds, in every instance and at every size,
    where in working_sum that distance varies with the numbers' lengths.  A training
    probe: does the in-answer sum come faster when its digits line up?"""

    name = "padded_sum"

    def __init__(self, max_digits: int = 5, width: int = 7):
        # 7 digits hold the largest sum, 99999 + 999990.
        super().__init__(max_digits)
        self.width = width

    def draw(self, rng: random.Random) -> Instance:
        return self.written(super().draw(rng))

    def written(self, plain: Instance) -> Instance:
        x, y, _ = (int(n) for n in plain.answer.replace("+", "=").split("="))
        return Instance(self.name, "sum the working", written_sum(x, y, self.width))


class Recall(Task):
    """The lookup asked several times per instance (multi-query associative recall):
    one capital per queried key, in the order asked.  A single-query lookup gives one
    label per row, and the matching never formed from it in thousands of steps
    (lab/training-log.md); each query here is a label of its own.  At most half of
    the keys are asked, so the answers seen unmasked never settle a masked one by
    elimination."""

    name = "recall"

    def __init__(self, min_pairs: int = 8, max_pairs: int = 40, max_queries: int = 8):
        self.min_pairs, self.max_pairs = max(2, min_pairs), max(2, max_pairs)
        self.max_queries = max(1, max_queries)
        self.gen_length = self.max_queries + 1

    def draw(self, rng: random.Random) -> Instance:
        n = rng.randint(self.min_pairs, self.max_pairs)
        keys = rng.sample([a + b for a in LETTERS for b in LETTERS], n)
        values = [rng.choice(SYMBOLS) for _ in keys]
        asked = rng.sample(range(n), max(1, min(self.max_queries, n // 2)))
        pairs = "".join(f";{k}={v}" for k, v in zip(keys, values))
        queries = "".join(f";{keys[i]}=" for i in asked)
        return Instance(self.name, f"find\n{pairs}\nvalues of{queries}", "".join(values[i] for i in asked))


BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">"}


class Brackets(Task):
    """A prefix of `min_len`-`max_len` bracket characters, never deeper than
    `max_depth`, with at least one bracket left open; the answer closes them."""

    name = "brackets"
    gen_length = 16

    def __init__(self, min_len: int = 8, max_len: int = 32, max_depth: int = 12):
        self.min_len, self.max_len, self.max_depth = min_len, max_len, max_depth

    def draw(self, rng: random.Random) -> Instance:
        length = rng.randint(self.min_len, self.max_len)
        text: list[str] = []
        stack: list[str] = []
        for i in range(length):
            last = i == length - 1
            can_close = bool(stack) and not (last and len(stack) == 1)
            must_close = len(stack) >= self.max_depth
            if must_close or (can_close and rng.random() < 0.45):
                text.append(BRACKETS[stack.pop()])
            else:
                opener = rng.choice(list(BRACKETS))
                stack.append(opener)
                text.append(opener)
        return Instance(self.name, "close " + "".join(text), "".join(BRACKETS[b] for b in reversed(stack)))


# Harder tasks: not part of `TASKS`, which the shipped model was trained on.
# Multiply pads its working: the in-answer sum came at 0.99 a digit padded against 0.85 plain
# over the same steps (lab/training-log.md).
HARD_TASKS: dict[str, Task] = {t.name: t for t in (Sort(), Multiply(width=6), Chain(), Brackets())}
# Tasks that train a mechanism another task needs; named alone, in no group.
AUX_TASKS: dict[str, Task] = {t.name: t for t in (Lookup(), Recall(), WorkingSum(), PaddedWorkingSum())}
ALL_TASKS: dict[str, Task] = {**TASKS, **HARD_TASKS, **AUX_TASKS}
# Names that stand for several tasks (eval's --task, train's --tasks).
TASK_GROUPS: dict[str, list[str]] = {"all": list(TASKS), "hard": list(HARD_TASKS),
                                     "every": [*TASKS, *HARD_TASKS]}


def get_task(name: str) -> Task:
    try:
        return ALL_TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task '{name}'; choose from {', '.join(ALL_TASKS)}") from None


def resolve_tasks(text: str) -> list[Task]:
    """`all` (the original four), `hard` (the four harder ones), `every` (both), or a
    comma-separated list of task names and groups, in order, without repeats."""
    names: list[str] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        for name in TASK_GROUPS.get(part, [part]):
            if name not in ALL_TASKS:
                raise ValueError(f"unknown task '{name}'; choose from {', '.join([*ALL_TASKS, *TASK_GROUPS])}")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("no task given")
    return [ALL_TASKS[n] for n in names]


def check_answer(instance: Instance) -> bool:
    """Recompute the answer from the prompt alone (an independent checker of the
    generators, used by the tests)."""
    prompt, answer = instance.prompt, instance.answer
    if instance.task == "sort":
        numbers = [int(x) for x in prompt.removeprefix("sort ").split()]
        return answer == " ".join(map(str, sorted(numbers)))
    if instance.task == "multiply":
        a, b = multiply_factors(prompt)
        return answer in multiply_layouts(a, b)
    if instance.task == "chain":
        _, links, hubs, query = prompt.split("\n")
        link_pairs = re.findall(r";([a-z]{2})=([A-Z])", links)
        hub_pairs = re.findall(r";([A-Z])=([A-Z]{2})", hubs)
        if ("".join(f";{k}={v}" for k, v in link_pairs) != links
                or "".join(f";{k}={v}" for k, v in hub_pairs) != hubs):
            return False
        hub = dict(link_pairs)[query.removeprefix("follow;").removesuffix("=")]
        return answer == f"{hub}={dict(hub_pairs)[hub]}"
    if instance.task == "brackets":
        closers = {v: k for k, v in BRACKETS.items()}
        stack: list[str] = []
        for ch in prompt.removeprefix("close "):
            if ch in BRACKETS:
                stack.append(ch)
            elif not stack or stack.pop() != closers[ch]:
                return False
        return bool(stack) and answer == "".join(BRACKETS[b] for b in reversed(stack))
    if instance.task == "addition":
        a, b = prompt.removeprefix("add ").removesuffix("=").split("+")
        return answer == str(int(a) + int(b))
    if instance.task == "working_sum":
        match = re.fullmatch(r"(0|[1-9]\d*)\+(0|[1-9]\d*)=(\d+)", answer)
        return prompt == "sum the working" and match is not None and int(match[1]) + int(match[2]) == int(match[3])
    if instance.task == "padded_sum":
        match = re.fullmatch(r"(\d+)\+(\d+)=(\d+)", answer)
        width = ALL_TASKS["padded_sum"].width
        return (prompt == "sum the working" and match is not None and {len(n) for n in match.groups()} == {width}
                and int(match[1]) + int(match[2]) == int(match[3]))
    if instance.task in ("retrieval", "lookup"):
        _, body, query = prompt.split("\n")
        pairs = dict(p.split("=") for p in body.split(";")[1:])
        width = 2 if instance.task == "retrieval" else 1
        value = pairs[query.removeprefix("value of;").removesuffix("=")]
        return len(value) == width and value.isupper() and answer == value
    if instance.task == "recall":
        _, body, queries = prompt.split("\n")
        pairs = dict(p.split("=") for p in body.split(";")[1:])
        asked = queries.removeprefix("values of;").removesuffix("=").split("=;")
        return len(asked) <= len(pairs) // 2 and answer == "".join(pairs[k] for k in asked)
    if instance.task in ("copy", "reverse"):
        text = prompt.split(" ", 1)[1]
        return answer == (text if instance.task == "copy" else text[::-1])
    raise ValueError(f"unknown task '{instance.task}'")


def accepted_answers(instance: Instance) -> tuple[str, ...]:
    """The answers that count as right: the instance's own, and for a multiply answer
    that writes its working, also the product alone (a model that multiplies without
    writing the working has done the task; a wrong working is still wrong)."""
    if instance.task == "multiply" and multiply_product(instance.answer) != instance.answer:
        # Either layout of the working (a model trained on the other one has done the task).
        return tuple(dict.fromkeys((instance.answer, *multiply_layouts(*multiply_factors(instance.prompt)))))
    return (instance.answer,)


def score(instance: Instance, output: str) -> bool:
    """Exact match of the generated text (whitespace-trimmed) with an accepted answer."""
    return output.strip() in accepted_answers(instance)


def closest_answer(instance: Instance, output: str) -> str:
    """The accepted answer with the most characters of `output` (trimmed) in place: the
    form the output was writing, which partial credit and edit tracing measure it by."""
    text = output.strip()
    return max(accepted_answers(instance), key=lambda answer: sum(a == b for a, b in zip(answer, text)) / len(answer))


def char_score(instance: Instance, output: str) -> float:
    """Fraction of the closest accepted answer's characters reproduced at their
    position: partial credit that shows a model learning before it gets whole answers
    right (chance is about 1/26 per letter, 1/10 per digit)."""
    answer, text = closest_answer(instance, output), output.strip()
    return sum(a == b for a, b in zip(answer, text)) / len(answer)
