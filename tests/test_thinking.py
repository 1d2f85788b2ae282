"""A reasoning model's thought opened by its prompt (lit_grpo/data/thinking.py): DeepSeek-R1-Distill's chat template
ends the generation prompt with ``<think>\\n``. The pure functions by hand; the data module judging a completion after
that ``<think>`` (a box inside the unfinished thought scores 0 and the completion counts as truncated, the overlong
penalty as one cut at max_new_tokens); the evaluation's judge; the sampled-completions table's thinking column."""

from __future__ import annotations

import json

import pytest
from conftest import tiny_data

from lit_grpo.data.latex_answers import math_verify_reward
from lit_grpo.data.rewards import RewardRunner
from lit_grpo.data.rollout import collate_rollouts, pad_rollouts
from lit_grpo.data.thinking import judged_text, prompt_ids_open_thought, prompt_opens_thought, unfinished_thought
from lit_grpo.engines.base import Completion
from lit_grpo.evaluation.pass_at_k import sample_scores
from lit_grpo.training.completion_table import completion_table, split_thinking

# DeepSeek-R1-Distill's layout, in the tiny tokenizer's characters: the generation prompt opens the thought
THINK_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|User|>' + message['content'] }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|Assistant|><think>\n' }}{% endif %}"
)
OPEN_BOX = "1 plus 1 is \\boxed{2}"  # its answer is boxed, but the thought the prompt opened never closes
CLOSED_BOX = "1 plus 1 is 2.</think>\nSo \\boxed{2}"
ROWS = [{"problem": "What is 1+1?", "answer": "2"}, {"problem": "What is 2+2?", "answer": "4"}]


@pytest.fixture(scope="module")
def tokenizers():
    """``(think, plain)``: the tiny test tokenizer with the template above, and one with its own ChatML."""
    from lit_grpo.models.loading import load_model_and_tokenizer

    think = load_model_and_tokenizer("tiny-random-llama")[1]
    think.chat_template = THINK_TEMPLATE
    return think, load_model_and_tokenizer("tiny-random-llama")[1]


def ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def completion(tokenizer, text: str, truncated: bool = False) -> Completion:  # noqa: ANN001
    tokens = ids(tokenizer, text)
    return Completion(tokens, [0.0] * len(tokens), truncated=truncated)


# ---- the pure functions ------------------------------------------------------------------------------------------


def test_a_prompt_opens_a_thought_when_a_think_is_left_open_in_it():
    assert prompt_opens_thought("<|begin|><|User|>What is 1+1?<|Assistant|><think>\n")
    assert not prompt_opens_thought("<|im_start|>user\nWhat is 1+1?<|im_end|>\n<|im_start|>assistant\n")
    # an earlier turn's thought, closed, opens nothing; a new one after it does
    assert not prompt_opens_thought("<|Assistant|><think>a</think>2<|User|>and 2+2?<|Assistant|>")
    assert prompt_opens_thought("<|Assistant|><think>a</think>2<|User|>and 2+2?<|Assistant|><think>\n")


def test_the_judged_text_goes_on_after_the_think_the_prompt_opened():
    assert judged_text(OPEN_BOX, opened=True) == "<think>" + OPEN_BOX
    assert judged_text(OPEN_BOX, opened=False) == OPEN_BOX
    # math_verify (latex_answers.answer_section) finds no answer inside the still open thought
    assert math_verify_reward(judged_text(OPEN_BOX, True), "2") == 0.0
    assert math_verify_reward(judged_text(CLOSED_BOX, True), "2") == 1.0
    assert math_verify_reward(judged_text(OPEN_BOX, False), "2") == 1.0  # no thought: the whole text is the answer


@pytest.mark.parametrize("text, opened, unfinished", [
    (CLOSED_BOX, True, False),  # </think> then the box
    (OPEN_BOX, True, True),  # a box but no </think>
    (OPEN_BOX, False, False),  # no thinking at all
    ("<think>a</think>\\boxed{2}", False, False),  # its own thought, closed
    ("<think>a, \\boxed{2}", False, True),  # its own thought, open
    ("a</think>b<think>c", True, True),  # a second thought opened after the first, never closed
    ("<think>a<think>b</think>\\boxed{2}", False, False),  # nested: the last </think> ends the thinking
    ("a</think>b</think>\\boxed{2}", True, False),  # several ends: the last one counts
])
def test_an_unfinished_thought_by_hand(text, opened, unfinished):
    assert unfinished_thought(text, opened) is unfinished


def test_a_tokenized_prompt_is_read_as_decoded(tokenizers):
    think, plain = tokenizers
    messages = [{"role": "user", "content": "What is 1+1?"}]
    opening = think.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert opening.endswith("<|Assistant|><think>\n")
    assert prompt_ids_open_thought(think, ids(think, opening))
    assert not prompt_ids_open_thought(plain, ids(plain, plain.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False)))


# ---- the data module -------------------------------------------------------------------------------------------


def latex_data(tmp_path, tokenizer, **overrides):  # noqa: ANN001
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    data = tiny_data(dataset=str(path), problem_column="problem", answer_column="answer", rewards=["math_verify"],
                     max_prompts=None, num_generations=4, reward_timeout_s=60.0, **overrides)
    data.tokenizer = tokenizer
    return data


def test_the_data_module_judges_a_box_inside_the_opened_thought_as_no_answer_and_truncated(tmp_path, tokenizers):
    think, plain = tokenizers
    data = latex_data(tmp_path, think, max_new_tokens=64)
    assert data.opened_thought()
    row = next(i for i, r in enumerate(data.rows) if r["answer"] == "2")
    group = [completion(think, OPEN_BOX), completion(think, CLOSED_BOX),
             completion(think, "1 plus 1 is", truncated=True), completion(think, "1 plus 1 is 3.</think>\\boxed{3}")]
    assert data.score_groups([row], [group]).rewards == [0.0, 1.0, 0.0, 0.0]
    assert [c.truncated for c in group] == [True, False, True, False]
    # the flag is what the batch records: model.mask_truncated_completions leaves the row out of the loss
    padded = pad_rollouts([data.prompt_ids(row)], [group], 0, 4)
    assert padded.truncated.tolist() == [True, False, True, False]
    # a prompt that opens no thought: the same box is the answer, and the completion ended as it should
    plain_data = latex_data(tmp_path, plain, max_new_tokens=64)
    assert not plain_data.opened_thought()
    group = [completion(plain, OPEN_BOX), completion(plain, CLOSED_BOX), completion(plain, "x"), completion(plain, "y")]
    assert plain_data.score_groups([row], [group]).rewards == [1.0, 1.0, 0.0, 0.0]
    assert [c.truncated for c in group] == [False] * 4


def test_the_overlong_penalty_counts_an_unfinished_thought_as_cut_at_max_new_tokens(tmp_path, tokenizers):
    think, _ = tokenizers
    # L_max = 64, L_cache = 4, factor 0.5: every completion here is far below 60 tokens, so only a truncated one pays
    data = latex_data(tmp_path, think, max_new_tokens=64, overlong_penalty={"buffer": 4, "factor": 0.5})
    row = next(i for i, r in enumerate(data.rows) if r["answer"] == "2")
    group = [completion(think, OPEN_BOX), completion(think, CLOSED_BOX), completion(think, "a</think>b"),
             completion(think, "still thinking")]
    assert max(len(c.token_ids) for c in group) < 60
    assert data.score_groups([row], [group]).rewards == [-0.5, 1.0, 0.0, -0.5]
    assert data.overlong_penalties([group]).tolist() == [-0.5, 0.0, 0.0, -0.5]  # as the batch's statistic reads it


# ---- evaluation and the sampled-completions table ---------------------------------------------------------------


def test_the_evaluation_judges_after_the_opened_think_when_told(tokenizers):
    think, _ = tokenizers
    judge = RewardRunner([("math_verify", 1.0)], timeout_s=60.0)
    groups = [[completion(think, OPEN_BOX), completion(think, CLOSED_BOX)]]
    assert sample_scores(groups, ["2", "2"], judge, think, opened_thought=True) == [0.0, 1.0]
    assert sample_scores(groups, ["2", "2"], judge, think) == [1.0, 1.0]  # by default, the text as it is


@pytest.mark.parametrize("opens", [True, False])
def test_pass_at_k_tells_the_judge_whether_its_prompts_opened_a_thought(tokenizers, monkeypatch, opens):
    import lit_grpo.evaluation.pass_at_k as pass_at_k
    from lit_grpo.engines.base import SamplingConfig
    from lit_grpo.models.loading import load_model_and_tokenizer

    think, plain = tokenizers
    seen = []

    def scores(groups, answers, judge, tokenizer, trajectories=None, opened_thought=False):  # noqa: ANN001, ANN202
        seen.append(opened_thought)
        return [0.0] * len(answers)

    monkeypatch.setattr(pass_at_k, "sample_scores", scores)
    policy = load_model_and_tokenizer("tiny-random-llama")[0]
    settings = pass_at_k.PassAtKSettings(num_samples=1, sampling=SamplingConfig(max_new_tokens=2))
    rows = [{"question": "What is 1+1?", "answer": "2"}]
    pass_at_k.evaluate_pass_at_k(policy, think if opens else plain, rows, settings)
    assert seen == [opens]


def test_split_thinking_shows_an_unfinished_opened_thought_as_thinking():
    assert split_thinking(OPEN_BOX, opened=True) == (OPEN_BOX, "")
    assert split_thinking(CLOSED_BOX, opened=True) == ("1 plus 1 is 2.", "So \\boxed{2}")
    assert split_thinking(OPEN_BOX) == ("", OPEN_BOX)  # a prompt that opened none: all answer, as before


def test_the_table_row_of_an_unfinished_opened_thought_shows_it_under_thinking(tokenizers):
    think, _ = tokenizers
    opening = ids(think, "<|User|>What is 1+1?<|Assistant|><think>\n")
    plain = ids(think, "<|User|>What is 1+1?<|Assistant|>")
    groups = [[completion(think, OPEN_BOX), completion(think, "x")], [completion(think, OPEN_BOX),
                                                                       completion(think, "y")]]
    batch = collate_rollouts(pad_rollouts([opening, plain], groups, 0, 4), [0.0, 1.0, 0.0, 1.0])
    columns, rows = completion_table(batch, think, step=1, staleness=0)
    thinking, answer = columns.index("thinking"), columns.index("completion")
    assert (rows[0][thinking], rows[0][answer]) == (OPEN_BOX, "")  # the prompt opened the thought
    assert (rows[1][thinking], rows[1][answer]) == ("", OPEN_BOX)  # it opened none
