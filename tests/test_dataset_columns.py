"""Datasets by their columns (``data.problem_column``, ``data.answer_column``, ``data.prompt_template``,
``data.chat_template``, ``data.dataset_config``): every kind of local source, the Hub through the code a
``save_to_disk`` folder takes, the prompts they make, golds math-verify reads, and GSM8K's format as it was."""

import json
from pathlib import Path

import pytest
from conftest import tiny_data, tiny_module, tiny_trainer
from lit_grpo.callbacks import WeightSync

from lit_grpo.data.columns import RowFormat, render
from lit_grpo.data.gsm8k import load_gsm8k
from lit_grpo.data.prompts import prompt_ids

TEMPLATE = "{problem}\n\nLet's think step by step and output the final answer within \\boxed{}."
ROWS = [
    {"problem": "Find $\\cos 30^\\circ$.", "answer": "\\frac{\\sqrt{3}}{2}", "solution": "..."},
    {"problem": "What is the area of a unit circle?", "answer": "\\pi", "solution": "..."},
    {"problem": "Which choice is right?", "answer": "\\text{(C)}", "solution": "..."},
    {"problem": "Find $m+n$.", "answer": 204, "solution": "..."},
]
LATEX = dict(problem_column="problem", answer_column="answer", rewards=["math_verify"], max_prompts=None)


def write(path: Path, rows: list[dict]) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**r, "answer": str(r["answer"])} for r in rows]), path)
    else:  # a folder written by Dataset.save_to_disk
        import datasets

        datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in rows]).save_to_disk(str(path))
    return str(path)


def ordered(data) -> list[dict]:
    """The data module's rows sorted by question (``max_prompts=None`` keeps every row, in file order)."""
    return sorted(data.rows, key=lambda row: row["question"])


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "saved"])
def test_every_local_source_reads_by_its_columns(tmp_path, name):
    data = tiny_data(dataset=write(tmp_path / name, ROWS), **LATEX)
    assert [row["question"] for row in data.rows] == [row["problem"] for row in ROWS]
    assert [row["answer"] for row in data.rows] == ["\\frac{\\sqrt{3}}{2}", "\\pi", "\\text{(C)}", "204"]
    assert all(row["gold"] == row["answer"] for row in data.rows)


def test_a_saved_dataset_dict_gives_the_split_asked_for(tmp_path):
    import datasets

    folder = tmp_path / "dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2]),
                          "test": datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in ROWS[2:]])}
                         ).save_to_disk(str(folder))
    assert [r["answer"] for r in tiny_data(dataset=str(folder), split="test", **LATEX).rows] == ["\\text{(C)}", "204"]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:2])}).save_to_disk(str(tmp_path / "one"))
    with pytest.raises(ValueError, match=r"one: no split 'test'; expected one of \['train'\]"):
        tiny_data(dataset=str(tmp_path / "one"), split="test", **LATEX)


def test_a_hub_id_takes_the_saved_folders_code_with_its_default_config(tmp_path, monkeypatch):
    """The Hub path end to end but for the download: ``load_dataset`` hands back what ``load_from_disk`` reads from a
    folder saved here, and the rows are those the folder gives as a local source."""
    import datasets

    folder = write(tmp_path / "saved", ROWS)
    calls = []

    def load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.load_from_disk(folder)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub = tiny_data(dataset="HuggingFaceH4/MATH-500", split="test", **LATEX)
    assert calls == [("HuggingFaceH4/MATH-500", None, "test")]  # the dataset's default config, not GSM8K's main
    assert hub.rows == tiny_data(dataset=folder, **LATEX).rows
    tiny_data(dataset="someone/math", dataset_config="algebra", **LATEX)
    assert calls[-1] == ("someone/math", "algebra", "train")


def test_gsm8ks_own_hub_id_keeps_its_config(monkeypatch):
    import datasets

    calls = []
    rows = [{"question": "q", "answer": "#### 1"}, {"question": "r", "answer": "#### 2"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda path, name=None, split=None: calls.append(name) or rows)
    load_gsm8k("openai/gsm8k")
    assert calls == ["main"]


def test_offline_with_nothing_cached_is_one_line():
    """The suite runs with HF_HUB_OFFLINE=1 (conftest), and nobody caches a dataset of this name."""
    with pytest.raises(ValueError) as err:
        tiny_data(dataset="nobody-xyz/no-such-dataset-123", **LATEX)
    line = str(err.value)
    assert "\n" not in line
    assert "nobody-xyz/no-such-dataset-123 (its default config, split 'train')" in line
    assert "HF_HUB_OFFLINE=1 forbids downloading it" in line and "Dataset.save_to_disk" in line


def test_the_template_fills_columns_and_keeps_latex_braces():
    row = {"problem": "2+2?", "level": 1}
    assert render(TEMPLATE, row, "d", 0) == "2+2?\n\nLet's think step by step and output the final answer within " \
                                            "\\boxed{}."
    assert render("{{level}} {level}: {problem} \\frac{1}{2}", row, "d", 0) == "{level} 1: 2+2? \\frac{1}{2}"


@pytest.fixture(scope="module")
def tokenizer():
    from lit_grpo.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-random-llama")[1]


def test_prompts_carry_the_template_and_the_system_prompt(tmp_path, tokenizer):
    path = write(tmp_path / "rows.jsonl", ROWS)
    data = tiny_data(dataset=path, prompt_template=TEMPLATE, system_prompt="You are a careful solver.", **LATEX)
    data.tokenizer = tokenizer
    text = tokenizer.decode(data.prompt_ids(0))
    assert text == tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a careful solver."},
         {"role": "user", "content": TEMPLATE.replace("{problem}", ROWS[0]["problem"])}],
        add_generation_prompt=True, tokenize=False)
    plain = tiny_data(dataset=path, prompt_template=TEMPLATE, system_prompt="Be careful.", chat_template=False,
                      **LATEX)
    plain.tokenizer = tokenizer
    assert tokenizer.decode(plain.prompt_ids(0)) == "Be careful.\n\n" + TEMPLATE.replace("{problem}",
                                                                                          ROWS[0]["problem"])


def test_without_a_template_gsm8k_prompts_are_as_they_were(tokenizer):
    data = tiny_data(dataset="bundled", system_prompt=None)
    data.tokenizer = tokenizer
    assert data.prompt_ids(0) == prompt_ids(tokenizer, data.rows[0]["question"], None)
    plain = tiny_data(dataset="bundled", system_prompt=None, chat_template=False)
    plain.tokenizer = tokenizer
    assert tokenizer.decode(plain.prompt_ids(0)) == f"Question: {plain.rows[0]['question']}\nAnswer:"


def test_a_template_on_gsm8k_rows_names_their_fields():
    data = tiny_data(dataset="bundled", prompt_template="Problem: {question}\nSolve it.", max_prompts=None)
    assert data.rows[0]["question"].startswith("Problem: Natalia sold clips")
    assert data.rows[0]["question"].endswith("\nSolve it.") and data.rows[0]["gold"] == "72"


def test_gsm8k_rows_are_unchanged():
    assert tiny_data(dataset="bundled", max_prompts=None).rows == load_gsm8k("bundled")


def test_a_gsm8k_gold_of_pi_is_accepted_with_math_verify(tmp_path):
    """The ``####`` number check is GSM8K's correctness reward's: math_verify checks golds its own way."""
    path = write(tmp_path / "pi.jsonl", [{"question": "Area of the unit circle?", "answer": "It is #### \\pi"},
                                          {"question": "1+1?", "answer": "#### 2"}])
    assert [row["gold"] for row in tiny_data(dataset=path, rewards=["math_verify"], max_prompts=None).rows] == \
        ["\\pi", "2"]
    with pytest.raises(ValueError, match=r"row 0 field 'answer' has no '####' final answer"):
        tiny_data(dataset=path, rewards=["correctness"])
    with pytest.raises(ValueError, match=r"row 0 field 'answer' has no '####' final answer"):
        tiny_data(dataset=path, rewards=["math_verify", "correctness"])


def test_a_gold_math_verify_cannot_parse_names_its_row_in_the_dataset(tmp_path):
    rows = [{"problem": f"p{i}", "answer": str(i)} for i in range(12)]
    rows[7]["answer"] = "\\frac{"
    path = write(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError) as err:
        tiny_data(dataset=path, **{**LATEX, "max_prompts": 12})  # shuffled: the row keeps its index in the file
    assert "row 7's gold '\\\\frac{' is LaTeX math-verify cannot parse" in str(err.value)
    assert "'math_verify'" in str(err.value)
    tiny_data(dataset=path, **{**LATEX, "rewards": ["correctness"]})  # not checked by a reward that does not parse


def test_the_gold_check_is_bounded_as_a_reward_call_is(tmp_path, monkeypatch):
    import threading

    from lit_grpo.data import latex_answers

    release = threading.Event()
    monkeypatch.setattr(latex_answers, "_parsed_gold", lambda gold: release.wait(5.0) and ())
    path = write(tmp_path / "rows.jsonl", ROWS)
    try:
        with pytest.raises(ValueError, match=r"row 0's gold .* was not parsed within the reward's 0.2 s "
                                             r"\(data.reward_timeout_s\)"):
            tiny_data(dataset=path, reward_timeout_s=0.2, **LATEX)
    finally:
        release.set()


def test_row_format_defaults_keep_gsm8ks_columns():
    assert not RowFormat().by_columns and RowFormat().columns == ("question", "answer")
    assert RowFormat(answer_column="final").columns == ("question", "final")


RECORDED: list[str] = []


def recording_reward(completion: str, answer: str, **kwargs) -> float:
    RECORDED.append(answer)
    return 0.0


def test_a_tiny_fit_trains_on_rows_read_by_their_columns(tmp_path):
    RECORDED.clear()
    data = tiny_data(dataset=write(tmp_path / "rows.jsonl", ROWS), prompt_template=TEMPLATE,
                     **{**LATEX, "rewards": ["math_verify", recording_reward]})
    tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync()]).fit(tiny_module(), datamodule=data)
    assert len(RECORDED) == 2 * 4  # prompts_per_step x G golds handed to the rewards, each a row's LaTeX gold
    assert set(RECORDED) <= {"\\frac{\\sqrt{3}}{2}", "\\pi", "\\text{(C)}", "204"}
