"""Prompt dataset loading/validation (jsonl and parquet) and the arithmetic task generator."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import write_jsonl

from megarl.rewards.math import extract_gsm8k_answer, format_reward, gsm8k_reward
from megarl.tasks import LEVELS, PromptRecord, generate_arithmetic, load_prompt_dataset, save_prompt_dataset
from megarl.tasks.arithmetic import _evaluate


GOOD = {"prompt": "What is 2 + 2?", "answer": "4", "data_source": "arithmetic"}


def test_load_jsonl_with_chat_prompts_and_extra_columns(tmp_path):
    chat = {"prompt": [{"role": "user", "content": "Hi?"}], "answer": "x", "data_source": "gsm8k", "split": "train"}
    path = tmp_path / "data.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + json.dumps(chat) + "\n")  # blank lines are skipped
    records = load_prompt_dataset(path)
    assert records == [
        PromptRecord("What is 2 + 2?", "4", "arithmetic", {}),
        PromptRecord([{"role": "user", "content": "Hi?"}], "x", "gsm8k", {"split": "train"}),
    ]


def test_jsonl_missing_column(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "p", "data_source": "s"}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 1: missing column(s) ['answer']; found ['data_source', 'prompt']"


def test_jsonl_wrong_type(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {**GOOD, "answer": 42}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 2, column 'answer': expected str, got int (42)"


def test_empty_prompts(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**GOOD, "prompt": "   "}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 0, column 'prompt': empty prompt"
    path = write_jsonl(tmp_path / "e.jsonl", [GOOD, {**GOOD, "prompt": []}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 1, column 'prompt': empty prompt (no messages)"


def test_bad_prompt_type_and_bad_message(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**GOOD, "prompt": 3.5}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 0, column 'prompt': expected str or list of chat messages, got float (3.5)"
    path = write_jsonl(tmp_path / "e.jsonl", [{**GOOD, "prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == (
        f"{path}: row 0, column 'prompt': message 0 must be {{'role': str, 'content': str}}, got dict ({{'role': 'user'}})"
    )


def test_invalid_json_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n{not json\n")
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: line 2: invalid JSON (Expecting property name enclosed in double quotes)"


def test_parquet_missing_column(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["p"], "answer": ["a"]}), path)
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: missing column(s) ['data_source']; found ['prompt', 'answer']"


def test_parquet_wrong_type(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["p", "q"], "answer": [7, 8], "data_source": ["s", "s"]}), path)
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(path)
    assert str(err.value) == f"{path}: row 0, column 'answer': expected str, got int (7)"


def test_file_errors(tmp_path):
    with pytest.raises(ValueError) as err:
        load_prompt_dataset(tmp_path / "d.csv")
    assert str(err.value) == f"{tmp_path / 'd.csv'}: unsupported file type '.csv'; known: ['.jsonl', '.parquet']"
    with pytest.raises(FileNotFoundError, match="prompt dataset not found"):
        load_prompt_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: no rows"):
        load_prompt_dataset(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_save_load_roundtrip(tmp_path, suffix):
    records = generate_arithmetic(5, level=3, seed=1)
    save_prompt_dataset(records, tmp_path / f"a{suffix}")
    assert load_prompt_dataset(tmp_path / f"a{suffix}") == records


def test_evaluate_precedence():
    # Hand: 2 + 3 * 4 = 14; 10 - 2 * 3 = 4; 7 - 2 - 1 = 4 (left to right); 2 * 3 * 4 - 5 = 19.
    assert _evaluate([2, 3, 4], ["+", "*"]) == 14
    assert _evaluate([10, 2, 3], ["-", "*"]) == 4
    assert _evaluate([7, 2, 1], ["-", "-"]) == 4
    assert _evaluate([2, 3, 4, 5], ["*", "*", "-"]) == 19


def test_arithmetic_is_seeded_and_deterministic():
    assert generate_arithmetic(20, level=2, seed=5) == generate_arithmetic(20, level=2, seed=5)
    assert generate_arithmetic(20, level=2, seed=5) != generate_arithmetic(20, level=2, seed=6)


@pytest.mark.parametrize("level", sorted(LEVELS))
def test_arithmetic_answers_and_prompt_format(level):
    spec = LEVELS[level]
    for record in generate_arithmetic(50, level=level, seed=level):
        expression = record.extra["expression"]
        tokens = expression.split()
        operands, operators = tokens[::2], tokens[1::2]
        assert len(operands) == spec.num_operands and set(operators) <= set(spec.operators)
        assert all(len(op) <= spec.max_digits for op in operands)
        # Python's own evaluation of the printed expression is the independent check.
        assert record.answer == str(eval(expression))  # noqa: S307 - digits and + - * only
        if not spec.allow_negative:
            assert int(record.answer) >= 0
        assert record.data_source == "arithmetic"
        assert expression in record.prompt and "#### <number>" in record.prompt
        # A response in the requested format earns the reward and the format reward.
        response = f"I compute {expression}.\n#### {record.answer}"
        assert extract_gsm8k_answer(response) == record.answer
        assert gsm8k_reward(response, record.answer, **record.extra) == 1.0
        assert format_reward(response, record.answer) == 1.0


def test_level_one_is_single_digit_addition():
    for record in generate_arithmetic(30, level=1, seed=0):
        a, op, b = record.extra["expression"].split()
        assert op == "+" and 0 <= int(a) <= 9 and 0 <= int(b) <= 9


def test_arithmetic_errors():
    with pytest.raises(ValueError) as err:
        generate_arithmetic(3, level=9)
    assert str(err.value) == "unknown arithmetic level 9; known: [1, 2, 3, 4, 5]"
    with pytest.raises(ValueError, match="num_examples must be > 0, got 0"):
        generate_arithmetic(0)
