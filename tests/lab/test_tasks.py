"""Generated tasks: seeded, splits disjoint, answers right; the task tokenizer keeps
retrieval contexts short and digits/symbols one token each."""

from __future__ import annotations

import random
import re

import pytest

from lab.tasks import TASKS, TEST, TRAIN, Instance, _split_of, char_score, check_answer, multiply_factors, score
from lab.training.checkpoint import build_tokenizer


@pytest.mark.parametrize("name", list(TASKS))
def test_tasks_are_seeded_and_splits_disjoint(name):
    task = TASKS[name]
    a = [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    b = [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    assert a == b
    rng = random.Random(9)
    train = {task.sample(rng, TRAIN).prompt for _ in range(300)}
    test = {task.sample(rng, TEST).prompt for _ in range(100)}
    assert not train & test
    assert all(_split_of(p) == TEST for p in test) and all(_split_of(p) == TRAIN for p in train)


def test_answers_are_correct():
    rng = random.Random(0)
    for _ in range(50):
        inst = TASKS["addition"].sample(rng, TEST)
        a, b = inst.prompt.removeprefix("add ").removesuffix("=").split("+")
        assert int(inst.answer) == int(a) + int(b) and len(a) <= 6 and len(b) <= 6
        rev = TASKS["reverse"].sample(rng, TEST)
        assert rev.answer == rev.prompt.split(" ", 1)[1][::-1] and 16 <= len(rev.answer) <= 48
        ret = TASKS["retrieval"].sample(rng, TEST)
        body, query = ret.prompt.split("\n")[1:]
        pairs = dict(p.split("=") for p in body.split(";")[1:])
        assert 40 <= len(pairs) <= 120
        assert pairs[query.removeprefix("value of;").removesuffix("=")] == ret.answer
    assert score(ret, f" {ret.answer}\n") and not score(ret, ret.answer + "x")


def test_task_tokenizer_makes_retrieval_short_and_digits_single(tmp_path):
    from transformers import PreTrainedTokenizerFast

    ids = build_tokenizer(tmp_path, 512)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    inst = TASKS["retrieval"].sample(random.Random(1), TEST)
    n_pairs = inst.prompt.count("=") - 1
    encoded = tok.encode(inst.prompt, add_special_tokens=False)
    assert len(encoded) <= 3 * n_pairs + 12
    assert tok.decode(encoded) == inst.prompt
    query_key = inst.prompt.rsplit("\n", 1)[1].removeprefix("value of")
    assert len(tok.encode(query_key, add_special_tokens=False)) == 1
    assert len(tok.encode(inst.answer, add_special_tokens=False)) == 2  # two capitals
    assert tok.encode("48213", add_special_tokens=False) == [ord(c) for c in "48213"]
    assert len(tok.encode("QWERTY", add_special_tokens=False)) == 6
    assert tok.decode(tok.encode("any text, even ünïcode!", add_special_tokens=False)) == "any text, even ünïcode!"
    assert ids["vocab_size"] % 64 == 0 and ids["mask"] < ids["vocab_size"]


def test_wilson_interval_brackets_the_observed_rate():
    from lab.eval import wilson

    low, high = wilson(19, 20)
    assert 0.75 < low < 0.95 < high <= 1.0
    assert wilson(0, 20)[0] == 0.0 and 0.0 < wilson(0, 20)[1] < 0.2
    assert wilson(0, 0) == (0.0, 1.0)


def test_paired_difference_counts_discordant_instances_and_tests_them_exactly():
    from lab.eval import paired_difference

    # Ten instances only the first setting gets right, none the other way: p = 2 / 2**10.
    assert paired_difference("1" * 10 + "11", "0" * 10 + "11") == (10, 0, 2 / 1024)
    only_first, only_second, p = paired_difference("1100101", "0110011")
    assert (only_first, only_second) == (2, 2) and p == 1.0
    # The same split is judged the same whichever setting comes first.
    assert paired_difference("1110", "0001")[2] == paired_difference("0001", "1110")[2] == 0.625
    assert paired_difference("", "") == (0, 0, 1.0)
    with pytest.raises(ValueError, match="do not pair up"):
        paired_difference("101", "10")


def test_char_score_gives_positional_partial_credit():
    inst = Instance("copy", "copy ABCD", "ABCD")
    assert char_score(inst, "ABCD") == 1.0
    assert char_score(inst, " ABXD\n") == 0.75
    assert char_score(inst, "BCD") == 0.0  # shifted by one: nothing in place
    assert char_score(inst, "AB") == 0.5 and char_score(inst, "") == 0.0


# ---------------------------------------------------------------------------------------
# The four original tasks are pinned (the shipped model is trained and measured on
# exactly these instances); the harder tasks are seeded, split and checked.
# ---------------------------------------------------------------------------------------

# sha256 (first 16 hex digits) of 10 instances per task, alternating splits, seed 2024,
# as the generators drew them before the harder tasks were added.
ORIGINAL_DIGESTS = {"retrieval": "f18183b72e63a03f", "addition": "f7d9df6c2502f5e2",
                    "copy": "f3c16c5bf151ac7b", "reverse": "dd5e70f0ea807db6"}


def test_original_tasks_draw_the_same_instances_as_before():
    import hashlib
    import json

    assert list(TASKS) == list(ORIGINAL_DIGESTS)
    for name, want in ORIGINAL_DIGESTS.items():
        rng = random.Random(2024)
        items = [[i.task, i.prompt, i.answer] for i in (TASKS[name].sample(rng, s) for s in (TRAIN, TEST) * 5)]
        assert hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16] == want, name


@pytest.mark.parametrize("name", ["sort", "multiply", "chain", "brackets"])
def test_hard_tasks_are_seeded_split_and_checked(name):
    from lab.tasks import HARD_TASKS

    task = HARD_TASKS[name]
    a = [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    assert a == [task.sample(random.Random(5), TRAIN) for _ in range(3)]
    assert a != [task.sample(random.Random(6), TRAIN) for _ in range(3)]
    rng = random.Random(9)
    train = [task.sample(rng, TRAIN) for _ in range(300)]
    test = [task.sample(rng, TEST) for _ in range(100)]
    assert not {i.prompt for i in train} & {i.prompt for i in test}
    assert all(_split_of(i.prompt) == TEST for i in test) and all(_split_of(i.prompt) == TRAIN for i in train)
    assert len({i.prompt for i in test}) > 90, "the test split is not a handful of instances"
    for inst in train + test:
        assert inst.task == name and check_answer(inst), inst
        assert score(inst, f" {inst.answer}\n")
        # Wrong answers are refused: one character changed, one dropped, one added.
        wrong = inst.answer[:-1] + ("0" if inst.answer[-1] != "0" else "1")
        assert not check_answer(Instance(name, inst.prompt, wrong)) and not score(inst, wrong)
        assert not check_answer(Instance(name, inst.prompt, inst.answer[:-1]))
        assert not check_answer(Instance(name, inst.prompt, inst.answer + inst.answer[-1]))


def test_hard_task_formats_and_sizes():
    from lab.tasks import HARD_TASKS, BRACKETS

    rng = random.Random(3)
    for _ in range(200):
        s = HARD_TASKS["sort"].draw(rng)
        numbers = [int(x) for x in s.prompt.removeprefix("sort ").split()]
        assert 4 <= len(numbers) <= 10 and max(numbers) < 1000
        assert [int(x) for x in s.answer.split()] == sorted(numbers)
        m = HARD_TASKS["multiply"].draw(rng)
        a, b = m.prompt.removeprefix("mul ").removesuffix("=").split("*")
        assert len(a) <= 4 and len(b) <= 2 and m.answer.endswith(str(int(a) * int(b)))
        if len(b) == 2:  # the working: a times the units digit, a times the tens, then the sum, at 6 digits
            assert m.answer == f"{int(a) * int(b[1]):06d}+{int(a) * int(b[0]) * 10:06d}={int(a) * int(b):06d}"
        else:
            assert m.answer == str(int(a) * int(b))
        assert len(m.answer) < HARD_TASKS["multiply"].gen_length, "the answer and its end token fit the canvas"
        c = HARD_TASKS["chain"].draw(rng)
        _, links, hubs, query = c.prompt.split("\n")
        link_pairs = re.findall(r";([a-z]{2})=([A-Z])", links)
        hub_pairs = re.findall(r";([A-Z])=([A-Z]{2})", hubs)
        assert "".join(f";{k}={v}" for k, v in link_pairs) == links
        assert "".join(f";{k}={v}" for k, v in hub_pairs) == hubs
        assert len(dict(link_pairs)) == len(link_pairs) and len(dict(hub_pairs)) == len(hub_pairs), "distinct keys"
        assert 20 <= len(link_pairs) + len(hub_pairs) <= 60 and 10 <= len(hub_pairs) <= 20
        assert {v for _, v in link_pairs} <= dict(hub_pairs).keys(), "every link names a hub"
        hub = dict(link_pairs)[query.removeprefix("follow;").removesuffix("=")]
        assert c.answer == f"{hub}={dict(hub_pairs)[hub]}"
        br = HARD_TASKS["brackets"].draw(rng)
        text = br.prompt.removeprefix("close ")
        assert 8 <= len(text) <= 32 and 1 <= len(br.answer) <= 12
        assert set(text) <= set(BRACKETS) | set(BRACKETS.values())


def test_task_groups_keep_all_the_original_four():
    from lab.tasks import resolve_tasks

    assert [t.name for t in resolve_tasks("all")] == list(TASKS)
    assert [t.name for t in resolve_tasks("hard")] == ["sort", "multiply", "chain", "brackets"]
    assert len(resolve_tasks("every")) == 8
    assert [t.name for t in resolve_tasks("copy,hard,copy")][:2] == ["copy", "sort"]
    with pytest.raises(ValueError, match="unknown task"):
        resolve_tasks("addition,division")


def test_hard_task_answers_are_short_under_the_task_tokenizer(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from lab.tasks import HARD_TASKS

    build_tokenizer(tmp_path, 512)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    rng = random.Random(4)
    for task in HARD_TASKS.values():
        for _ in range(100):
            inst = task.draw(rng)
            answer = tok.encode(inst.answer, add_special_tokens=False)
            assert len(answer) + 1 <= task.gen_length, (task.name, inst)  # room for the end token
            assert len(tok.encode(inst.prompt, add_special_tokens=False)) <= 200
            assert tok.decode(answer) == inst.answer
    chain = HARD_TASKS["chain"].draw(rng)
    answer = tok.encode(chain.answer, add_special_tokens=False)
    assert len(answer) == 4  # the hub, "=", two capitals
    # Both hops match a token with itself: the hub's capital after the query's link
    # and before "=" in the hub table are the answer's first token.
    prompt = tok.encode(chain.prompt, add_special_tokens=False)
    query = chain.prompt.rsplit("\n", 1)[1].removeprefix("follow")
    link = tok.encode(query + chain.answer[0], add_special_tokens=False)
    assert link == [prompt[-1], answer[0]] and any(prompt[i:i + 2] == link for i in range(len(prompt) - 2))
    assert any(prompt[i:i + 4] == answer for i in range(len(prompt) - 4))


def _seeded_disjoint_splits(task, rng: random.Random):
    """300 train and 100 test instances, after checking that a seed repeats its draws
    and that the splits share no prompt."""
    assert [task.sample(random.Random(5), TRAIN) for _ in range(3)] == [
        task.sample(random.Random(5), TRAIN) for _ in range(3)]
    train = [task.sample(rng, TRAIN) for _ in range(300)]
    test = [task.sample(rng, TEST) for _ in range(100)]
    assert not {i.prompt for i in train} & {i.prompt for i in test}
    return train, test


def test_lookup_is_retrievals_mechanism_with_one_capital(tmp_path):
    """The auxiliary lookup task: seeded, split, checked; one-capital values after
    one-token keys, two pairs at the curriculum's start; in no evaluation group."""
    from transformers import PreTrainedTokenizerFast

    from lab.tasks import AUX_TASKS, TASK_GROUPS, check_answer, resolve_tasks
    from lab.training.curriculum import fitting_task, task_at

    task = AUX_TASKS["lookup"]
    rng = random.Random(9)
    train, test = _seeded_disjoint_splits(task, rng)
    for inst in train + test:
        assert check_answer(inst) and len(inst.answer) == 1 and inst.answer.isupper()
        body = inst.prompt.split("\n")[1]
        assert 8 <= body.count(";") <= 40
        other = "A" if inst.answer != "A" else "B"
        assert not check_answer(Instance("lookup", inst.prompt, other))
    assert {len(task_at("lookup", 0.0).draw(rng).prompt.split("\n")[1].split(";")) - 1 for _ in range(20)} == {2}
    assert fitting_task(task, 1) is task
    assert all("lookup" not in names for names in TASK_GROUPS.values())
    assert [t.name for t in resolve_tasks("lookup,retrieval")] == ["lookup", "retrieval"]

    build_tokenizer(tmp_path, 512)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    inst = test[0]
    assert len(tok.encode(inst.answer, add_special_tokens=False)) == 1
    query_key = inst.prompt.rsplit("\n", 1)[1].removeprefix("value of")
    assert len(tok.encode(query_key, add_special_tokens=False)) == 1


def test_recall_asks_several_keys_per_instance(tmp_path):
    """The auxiliary recall task: several queried keys per instance, one capital per
    query in the order asked, at most half of the keys asked (elimination never settles
    an answer); seeded, split, checked; four pairs and two queries at the curriculum's
    start; in no evaluation group; every key and answer one token."""
    from transformers import PreTrainedTokenizerFast

    from lab.tasks import AUX_TASKS, TASK_GROUPS, check_answer
    from lab.training.curriculum import fitting_task, task_at

    task = AUX_TASKS["recall"]
    rng = random.Random(9)
    train, test = _seeded_disjoint_splits(task, rng)
    for inst in train + test:
        assert check_answer(inst) and inst.answer.isupper()
        pairs = inst.prompt.split("\n")[1].count(";")
        asked = inst.prompt.split("\n")[2].count(";")
        assert 8 <= pairs <= 40 and len(inst.answer) == asked == min(8, pairs // 2)
        wrong = inst.answer[:-1] + ("A" if inst.answer[-1] != "A" else "B")
        assert not check_answer(Instance("recall", inst.prompt, wrong))
        assert len(inst.answer) + 1 <= task.gen_length
    # The answer follows the order asked, not the order of the pairs.
    assert any(check_answer(Instance("recall", i.prompt, i.answer[::-1])) is False for i in train
               if len(set(i.answer)) > 1)
    small = [task_at("recall", 0.0).draw(rng) for _ in range(20)]
    assert {(i.prompt.split("\n")[1].count(";"), len(i.answer)) for i in small} == {(4, 2)}
    assert fitting_task(task, 8) is task and fitting_task(task, 7) is None
    assert all("recall" not in names for names in TASK_GROUPS.values())

    build_tokenizer(tmp_path, 512)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    inst = test[0]
    assert len(tok.encode(inst.answer, add_special_tokens=False)) == len(inst.answer)
    queries = inst.prompt.rsplit("\n", 1)[1].removeprefix("values of")
    assert len(tok.encode(queries, add_special_tokens=False)) == len(inst.answer)


def test_multiply_writes_a_two_digit_multipliers_working():
    from lab.tasks import Multiply, multiply_answer, multiply_product
    from lab.training.curriculum import hard_part, task_at

    assert multiply_answer(4821, 97) == "33747+433890=467637"
    assert multiply_answer(4821, 7) == "33747" and multiply_answer(4821, 97, working=False) == "467637"
    assert multiply_answer(4821, 10) == "0+48210=48210" and multiply_answer(0, 97) == "0+0=0"
    assert multiply_product("33747+433890=467637") == "467637" and multiply_product("33747") == "33747"
    # The longest answer (four digits times two) and its end token fit the canvas.
    assert len(multiply_answer(9999, 99)) + 1 <= Multiply().gen_length == 24
    assert Multiply(working=False).gen_length == 8 and Multiply(1, 1).gen_length == 8
    direct = Multiply(working=False).draw(random.Random(0))
    a, b = multiply_factors(direct.prompt)
    assert direct.answer == str(a * b) and check_answer(direct)
    with pytest.raises(ValueError, match="up to two digits, not 3"):
        Multiply(4, 3)
    # The curriculum's sizes and the focus on the hard part keep the answer's format.
    assert task_at("multiply", 0.6).working and hard_part(Multiply()).working
    assert not hard_part(Multiply(working=False)).working


def test_the_working_a_result_is_computed_from_is_measured():
    from lab.tasks import Multiply, working_length

    assert working_length(Instance("multiply", "mul 4821*97=", "33747+433890=467637")) == len("33747+433890=")
    assert working_length(Instance("multiply", "mul 4821*7=", "33747")) == 0
    assert working_length(Instance("chain", "chain\n;ab=C\n;C=XY\nfollow;ab=", "C=XY")) == 0
    rng = random.Random(5)
    for _ in range(200):
        inst = Multiply().draw(rng)
        n = working_length(inst)
        a, b = multiply_factors(inst.prompt)
        assert (n > 0) == (b >= 10)
        assert inst.answer[n:] == str(a * b)


def test_a_product_is_right_with_its_working_or_alone():
    from lab.tasks import accepted_answers, closest_answer

    worked = Instance("multiply", "mul 4821*97=", "33747+433890=467637")
    assert accepted_answers(worked) == ("33747+433890=467637", "033747+433890=467637", "467637")
    assert score(worked, " 33747+433890=467637\n") and score(worked, "467637")
    # A wrong working is wrong even under the right product; a wrong product is wrong.
    assert not score(worked, "33747+433891=467637") and not score(worked, "467638")
    assert not score(worked, "33747+433890=") and not score(worked, "33747")
    assert char_score(worked, "467637") == 1.0 and char_score(worked, "467600") == pytest.approx(4 / 6)
    assert closest_answer(worked, "33747+433890=467600") == worked.answer and closest_answer(worked, "467") == "467637"
    # Every other answer, a one-digit multiplier's product included, has one form.
    assert accepted_answers(Instance("multiply", "mul 4821*7=", "33747")) == ("33747",)
    assert accepted_answers(Instance("chain", "chain\n;ab=C\n;C=XY\nfollow;ab=", "C=XY")) == ("C=XY",)


def test_working_sum_asks_for_the_sum_of_the_answers_own_working():
    """The auxiliary working_sum task: its prompt names no number, its answer writes two
    numbers and their sum, its working is given to training, and it splits by answer."""
    from lab.tasks import AUX_TASKS, TASK_GROUPS, working_length

    task = AUX_TASKS["working_sum"]
    rng = random.Random(7)
    train_items = [task.sample(rng, TRAIN) for _ in range(300)]
    test_items = [task.sample(rng, TEST) for _ in range(30)]
    assert task.working_given and not TASKS["addition"].working_given
    assert {i.prompt for i in train_items + test_items} == {"sum the working"}
    assert not {i.answer for i in train_items} & {i.answer for i in test_items}
    tens_like = 0
    for item in train_items + test_items:
        assert check_answer(item), item
        x, y, total = item.answer.replace("+", "=").split("=")
        assert int(x) + int(y) == int(total) and len(x) <= 5 and len(y) <= 6
        assert working_length(item) == len(f"{x}+{y}=")
        tens_like += y.endswith("0") and len(y) > 1
        wrong = f"{x}+{y}={int(total) + 1}"
        assert not check_answer(Instance("working_sum", item.prompt, wrong))
    assert tens_like > 150, "about half the second numbers end in 0, as a tens partial product does"
    assert all("working_sum" not in names for names in TASK_GROUPS.values())


def test_eval_refuses_a_task_it_cannot_score(capsys):
    from lab import eval as task_eval

    with pytest.raises(SystemExit):
        task_eval.main(["--task", "addition,working_sum", "--n", "1"])
    assert "working_sum is a training aid" in capsys.readouterr().err


def test_working_sum_grows_from_one_digit_numbers():
    from lab.training.curriculum import task_at

    rng = random.Random(8)
    small = [task_at("working_sum", 0.0).draw(rng) for _ in range(50)]
    full = [task_at("working_sum", 1.0).draw(rng) for _ in range(200)]
    assert max(len(i.answer.split("+")[0]) for i in small) == 1
    assert max(len(i.answer.split("+")[0]) for i in full) == 5


def test_padded_sum_writes_its_numbers_at_one_width_at_every_size():
    """padded_sum: working_sum with the three numbers zero-padded to one width, so a sum
    digit stands a fixed distance after the digits it adds at every curriculum level."""
    from lab.tasks import AUX_TASKS, working_length
    from lab.training.curriculum import task_at

    task = AUX_TASKS["padded_sum"]
    rng = random.Random(9)
    assert task.working_given
    for level in (0.0, 0.5, 1.0):
        for _ in range(100):
            item = task_at("padded_sum", level).sample(rng, TRAIN)
            assert item.task == "padded_sum" and check_answer(item), item
            x, y, total = item.answer.replace("+", "=").split("=")
            assert len(x) == len(y) == len(total) == 7 and int(x) + int(y) == int(total)
            assert working_length(item) == 16 and len(item.answer) <= task.gen_length
    assert max(int(task_at("padded_sum", 0.0).draw(rng).answer[:7]) for _ in range(50)) < 10
    for wrong in ("0000012+0000030=0000043", "12+0000030=0000042", "0000012+0000030=42", "12+30=42",
                  "00000012+00000030=00000042"):
        assert not check_answer(Instance("padded_sum", "sum the working", wrong)), wrong
    # The same pairs are held out as working_sum's: the split goes by the plain answer.
    plain, padded = random.Random(11), random.Random(11)
    for split in (TRAIN, TEST) * 20:
        a, b = AUX_TASKS["working_sum"].sample(plain, split), task.sample(padded, split)
        assert [int(n) for n in a.answer.replace("+", "=").split("=")] == [
            int(n) for n in b.answer.replace("+", "=").split("=")]
    assert task_at("padded_sum", 0.3).width == 7


def test_multiply_can_write_its_working_padded_and_either_layout_scores():
    """Multiply(width=W) writes the working's three numbers at W digits; the product alone
    and the working in either layout are right; the curriculum's sizes keep the width."""
    from lab.tasks import (HARD_TASKS, Multiply, accepted_answers, multiply_answer, multiply_product,
                                 working_length)
    from lab.training.curriculum import fitting_task, hard_part, task_at

    assert multiply_answer(4821, 97, width=6) == "033747+433890=467637"
    assert multiply_answer(48, 97, width=6) == "000336+004320=004656"
    assert multiply_answer(4821, 7, width=6) == "33747", "a one-digit multiplier writes no working"
    assert multiply_product("000336+004320=004656") == "4656" and multiply_product("000000+000000=000000") == "0"
    assert multiply_product("0+0=0") == "0" and multiply_product("0") == "0"
    task = Multiply(width=6)
    assert task.gen_length == 24 and len(multiply_answer(9999, 99, width=6)) + 1 <= task.gen_length
    rng = random.Random(10)
    padded_seen = 0
    for _ in range(300):
        item = task.sample(rng, TRAIN)
        assert check_answer(item) and score(item, item.answer), item
        a, b = multiply_factors(item.prompt)
        assert score(item, str(a * b)) and score(item, multiply_answer(a, b))
        if b >= 10:
            padded_seen += 1
            numbers = item.answer.replace("+", "=").split("=")
            assert [len(n) for n in numbers] == [6, 6, 6] and working_length(item) == 14
            assert not score(item, str(a * b + 1))
            assert set(accepted_answers(item)) == {item.answer, multiply_answer(a, b), str(a * b)}
    assert padded_seen > 100
    plain = Instance("multiply", "mul 4821*97=", "33747+433890=467637")
    assert "033747+433890=467637" in accepted_answers(plain), "a model that pads is right on the plain task"
    assert not check_answer(Instance("multiply", "mul 4821*97=", "033747+433890=0467637"))
    assert not check_answer(Instance("multiply", "mul 4821*97=", "0033747+0433890=0467637")), "another width"
    assert HARD_TASKS["multiply"].width == 6, "the registered task pads"
    smaller = task_at("multiply", 0.5)
    assert smaller.max_digits_a < 4 and smaller.width == 6
    worked = [i for i in (smaller.draw(rng) for _ in range(100)) if "=" in i.answer]
    assert worked and all(len(i.answer) == 20 for i in worked), "smaller numbers, the same width"
    with pytest.raises(ValueError, match="cannot hold products of up to 6 digits"):
        Multiply(width=5)
    for sized in (hard_part(task), fitting_task(task, 8)):
        assert sized.width == 6
