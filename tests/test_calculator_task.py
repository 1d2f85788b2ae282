"""The calculator demo's pieces: the ``calculator`` tool, the ``synthetic:mul_*`` tasks, the tool tokenizer, the
layout of the ``calc-tiny-sft`` warm start's examples, and the unchanged ``arith-tiny-sft`` recipe."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from lit_grpo.data.gsm8k import load_gsm8k
from lit_grpo.data.rewards import correctness_reward
from lit_grpo.data.synthetic import (
    MUL_TASKS,
    TASKS,
    Product,
    distinct_products,
    generate_problems,
    generate_rows,
    parse_name,
    tool_sft_example,
)
from lit_grpo.environments.calculator import MAX_EXPONENT, calculator, calculator_call_text
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import ToolCall, parse_hermes
from lit_grpo.environments.tools import ToolBox, tool_schema
from lit_grpo.models.loading import ALIAS_LOADERS, alias_loader, tiny_tokenizer, tiny_tool_tokenizer
from lit_grpo.training.warm_start import (
    ARITH_TINY_SFT,
    CALC_TINY_SFT,
    ToolWarmStartConfig,
    WarmStartConfig,
    build_environment,
    cache_key,
    cached_dir,
    sft_batch,
    train_warm_start,
    training_examples,
    uses_tool,
    warm_start_tokenizer,
)

#: the data digest of arith-tiny-sft measured before the tool task was added (its cache key hashes it)
ARITH_DATA_DIGEST = "c21d90e482fcb6a4542311621b3856d0cbf7e34bdd8902cc804928011934e043"


# ---------------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(("expression", "value"), [
    ("47*38", "1786"), ("47 * 38", "1786"), ("(12+3)/4", "3.75"), ("6/3", "2"), ("7//2", "3"), ("-7//2", "-4"),
    ("10%3", "1"), ("-3**2", "-9"), ("(-3)**2", "9"), ("2**10", "1024"), ("1/3", "0.333333333333"),
    ("+5-(-2)", "7"), ("1.5*4", "6"), ("999*99", "98901"),
])
def test_calculator_evaluates_arithmetic(expression: str, value: str) -> None:
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "says"), [
    ('__import__("os").system("true")', "function call"), ("x+1", "name 'x'"), ("abs(-1)", "function call"),
    ("(1).real", "Attribute"), ("2**1000", "exponent 1000"), (f"2**{MAX_EXPONENT + 1}", "too large"),
    ("9999999**2", "base 9999999"), ("1/0", "division by zero"), ("5%0", "division by zero"), ("", "cannot parse"),
    ("1+", "cannot parse"), ("True+1", "not a number"), ("'a'*3", "not a number"), ("[1, 2]", "List"),
    ("1 if 1 else 2", "IfExp"), ("1<2", "Compare"), ("(-8)**0.5", "not a real number"), ("9" * 201, "characters"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        calculator(expression)


def test_calculator_has_a_schema_and_runs_in_a_toolbox() -> None:
    schema = tool_schema(calculator)
    assert schema["function"]["name"] == "calculator"
    assert schema["function"]["parameters"]["required"] == ["expression"]
    assert schema["function"]["parameters"]["properties"]["expression"]["type"] == "string"
    box = ToolBox(["lit_grpo.environments.calculator:calculator"])
    assert box.call(ToolCall("calculator", {"expression": "47*38"})).text == "1786"
    refused = box.call(ToolCall("calculator", {"expression": "x"}))
    assert refused.failed and "ValueError" in refused.text and "name 'x'" in refused.text


def test_the_call_spelling_is_read_by_the_hermes_parser() -> None:
    text = calculator_call_text("47*38")
    assert text == '<tool_call>{"name":"calculator","arguments":{"expression":"47*38"}}</tool_call>'
    assert parse_hermes(text) == [ToolCall("calculator", {"expression": "47*38"})]


# --------------------------------------------------------------------------------------------------------- task


@pytest.mark.parametrize("task", sorted(MUL_TASKS))
def test_mul_rows_are_deterministic_disjoint_and_judged_by_correctness(task: str) -> None:
    splits = generate_problems(task, seed=0)
    assert splits == generate_problems(task, seed=0)
    assert splits["test"] != generate_problems(task, seed=1)["test"]
    unordered = {s: {tuple(sorted(p.operands)) for p in splits[s]} for s in ("train", "test")}
    assert len(unordered["test"]) == len(splits["test"]) and len(unordered["train"]) == len(splits["train"])
    assert not unordered["train"] & unordered["test"]  # not even with the factors swapped
    digits = MUL_TASKS[task]
    assert all(len(str(p.operands[i])) == digits[i] for s in splits.values() for p in s for i in (0, 1))
    rows = load_gsm8k(f"synthetic:{task}", "test")
    assert rows == generate_rows(task, "test") and parse_name(f"synthetic:{task}:seed=2") == (task, 2)
    for row in rows[:50]:
        a, b = (int(x) for x in row["question"].removeprefix("What is ").rstrip("?").split(" * "))
        assert row["gold"] == str(a * b) and row["answer"] == f"#### {a * b}"
        assert correctness_reward(row["answer"], row["gold"]) == 1.0
        assert correctness_reward(f"#### {a * b + 1}", row["gold"]) == 0.0


def test_mul_2digit_holds_every_product_once() -> None:
    assert distinct_products([(10, 99), (10, 99)]) == 90 * 91 // 2  # pairs a <= b
    assert distinct_products([(100, 999), (10, 99)]) == 900 * 90  # no overlap: every order is its own
    splits = generate_problems("mul_2digit")
    assert len(splits["test"]) + len(splits["train"]) == 90 * 91 // 2
    with pytest.raises(ValueError, match="test_size"):
        generate_problems("mul_2digit", test_size=90 * 91 // 2)


def test_addition_rows_are_unchanged() -> None:
    assert sorted(TASKS) == ["add_2digit", "add_3digit"]
    first = generate_rows("add_2digit", "test")[0]
    assert first["answer"].endswith(f"#### {first['gold']}") and " + " in first["question"]


# ---------------------------------------------------------------------------------------------------- tokenizer


def test_tool_tokenizer_has_single_token_tags_that_survive_decoding() -> None:
    base, tok = tiny_tokenizer(), tiny_tool_tokenizer()
    assert [tok.convert_ids_to_tokens(i) for i in range(len(base))] == \
        [base.convert_ids_to_tokens(i) for i in range(len(base))]
    text = calculator_call_text("47*38")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    tags = tok.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert ids[0] == tags[0] and ids[-1] == tags[1] and len(ids) == len(text) - len("<tool_call></tool_call>") + 2
    assert tok.decode(ids) == text and tok.decode(ids, skip_special_tokens=True) == text
    assert "<tool_call>" not in tok.all_special_tokens
    # the base tokenizer spells the tags character by character
    assert len(base(text, add_special_tokens=False)["input_ids"]) == len(text)


def test_tool_template_is_chatml_and_ignores_the_tool_list() -> None:
    tok = tiny_tool_tokenizer()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                {"role": "assistant", "content": "A"}, {"role": "tool", "content": "7"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA"
                        "<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n")
    with_tools = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         tools=[tool_schema(calculator)])
    assert with_tools == rendered
    only_calls = [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]
    assert tok.apply_chat_template(only_calls, tokenize=False) == "<|im_start|>assistant\n<|im_end|>\n"


# ---------------------------------------------------------------------------------------------- warm-start data


def test_tool_example_layout_masks_the_environment_and_round_trips_the_model_tokens() -> None:
    tok = tiny_tool_tokenizer()
    problem = Product((47, 38))
    prompt, completion, trained = tool_sft_example(tok, problem, use_tool=True)
    renderer = ConversationRenderer(tok)
    assert prompt == renderer.prompt([{"role": "user", "content": "What is 47 * 38?"}])[0]
    assert len(trained) == len(completion)
    eos = tok.eos_token_id
    # three spans: the call (trained), the tool message (not), the answer (trained)
    spans = [trained[0]] + [b for a, b in zip(trained, trained[1:]) if a != b]
    assert spans == [1, 0, 1]
    model_ids = [t for t, m in zip(completion, trained) if m]
    env_ids = [t for t, m in zip(completion, trained) if not m]
    call = calculator_call_text("47 * 38")
    assert problem.expression == "47 * 38"  # the question's own spelling: one span to copy
    first_end = model_ids.index(eos)
    assert tok.decode(model_ids[:first_end]) == call
    assert tok(call, add_special_tokens=False)["input_ids"] == model_ids[:first_end]  # tokens round-trip
    assert tok.decode(model_ids[first_end + 1:]) == "#### 1786" + tok.eos_token
    assert tok.decode(env_ids) == "\n<|im_start|>tool\n1786<|im_end|>\n<|im_start|>assistant\n"
    # the whole sequence is what the template renders for the conversation (with the final assistant turn)
    whole = tok.apply_chat_template(
        [{"role": "user", "content": "What is 47 * 38?"}, {"role": "assistant", "content": call},
         {"role": "tool", "content": "1786"}, {"role": "assistant", "content": "#### 1786"}], tokenize=False)
    assert tok.decode(prompt + completion) + "\n" == whole
    # the batch's labels: -100 on the prompt and the tool message, the token itself on the model's
    ids, mask, labels = sft_batch([(prompt, completion, trained), (prompt, completion[-3:])], tok.pad_token_id)
    row = labels[0, len(prompt):len(prompt) + len(completion)]
    assert torch.equal(row == -100, torch.tensor(trained) == 0)
    assert torch.equal(row[row != -100], torch.tensor(model_ids))
    assert (labels[0, :len(prompt)] == -100).all() and (labels[1, len(prompt):len(prompt) + 3] != -100).all()


def test_direct_example_is_the_answer_alone() -> None:
    tok = tiny_tool_tokenizer()
    _, completion, trained = tool_sft_example(tok, Product((12, 11)), use_tool=False)
    assert tok.decode(completion) == "#### 132<|im_end|>" and trained == [1] * len(completion)


def test_tool_fraction_picks_that_share_of_train_problems() -> None:
    picks = uses_tool(CALC_TINY_SFT)
    assert len(picks) == len(generate_problems(CALC_TINY_SFT.task)["train"])
    assert abs(sum(picks) / len(picks) - CALC_TINY_SFT.tool_fraction) < 0.03
    assert picks == uses_tool(dataclasses.replace(CALC_TINY_SFT, seed=5))  # the training seed does not move it
    assert not any(uses_tool(dataclasses.replace(CALC_TINY_SFT, tool_fraction=0.0)))
    with pytest.raises(ValueError, match="tool_fraction"):
        ToolWarmStartConfig(tool_fraction=1.5)


def test_tool_warm_start_trains_a_few_steps_on_the_tool_tokenizer() -> None:
    config = ToolWarmStartConfig(steps=3, warmup_steps=1, batch_size=4, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)
    losses: list[float] = []
    model, tok = train_warm_start(config, log=None, on_step=lambda step, m, loss: losses.append(loss))
    assert len(losses) == 3 and all(loss == loss for loss in losses)
    assert model.config.vocab_size == len(tiny_tool_tokenizer()) == len(tok)
    assert max(len(e[0]) + len(e[1]) for e in training_examples(config, tok)) <= model.config.max_position_embeddings


# ------------------------------------------------------------------------------------------------- the alias


def test_calc_alias_is_registered_with_its_own_cache_folder() -> None:
    assert ALIAS_LOADERS["calc-tiny-sft"] == "lit_grpo.training.warm_start:load_calc_tiny_sft"
    assert callable(alias_loader("calc-tiny-sft"))
    assert cached_dir(CALC_TINY_SFT).name == f"calc-tiny-sft-{CALC_TINY_SFT.key()}"
    assert cached_dir(ARITH_TINY_SFT).name.startswith("arith-tiny-sft-")
    environment = build_environment()
    assert cache_key(CALC_TINY_SFT, environment, "data") != \
        cache_key(dataclasses.replace(CALC_TINY_SFT, tool_fraction=0.3), environment, "data")
    assert warm_start_tokenizer(CALC_TINY_SFT).chat_template == tiny_tool_tokenizer().chat_template


def test_arith_tiny_sft_key_is_unchanged() -> None:
    # the key as the recipe computed it before the tool warm start existed: the same config fields, the same
    # data digest (measured then), the same environment
    from lit_grpo.training.warm_start import training_data_digest

    assert training_data_digest(ARITH_TINY_SFT) == ARITH_DATA_DIGEST
    fields = dataclasses.asdict(ARITH_TINY_SFT)
    assert list(fields) == ["task", "data_seed", "seed", "steps", "stop_after", "batch_size", "lr", "warmup_steps",
                            "label_smoothing", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads"]
    assert fields == dataclasses.asdict(WarmStartConfig())
    payload = json.dumps({"recipe": 1, **fields, "environment": build_environment(), "data": ARITH_DATA_DIGEST},
                         sort_keys=True)
    assert ARITH_TINY_SFT.key() == hashlib.sha256(payload.encode()).hexdigest()[:12]
    assert training_examples(ARITH_TINY_SFT, tiny_tokenizer())[0][1][-1] == tiny_tokenizer().eos_token_id


def test_copy_examples_train_the_call_and_the_answer_but_not_the_choice_to_call() -> None:
    tok = tiny_tool_tokenizer()
    problem = Product((47, 38))
    _, decided, decided_mask = tool_sft_example(tok, problem, use_tool=True)
    _, copied, copied_mask = tool_sft_example(tok, problem, use_tool=True, decide=False)
    assert copied == decided  # the same tokens: only what is trained differs
    assert decided_mask[0] == 1 and copied_mask[0] == 0  # the call's first token: the decision
    assert copied_mask[1:] == decided_mask[1:]
    config = ToolWarmStartConfig(tool_fraction=0.15, copy_fraction=0.45)
    from lit_grpo.training.warm_start import example_kinds

    kinds = example_kinds(config)
    shares = {kind: kinds.count(kind) / len(kinds) for kind in ("tool", "copy", "direct")}
    assert abs(shares["tool"] - 0.15) < 0.03 and abs(shares["copy"] - 0.45) < 0.03
    # the decided calls are the same problems as without copy examples: one stream, the copy share after them
    assert uses_tool(config) == uses_tool(dataclasses.replace(config, copy_fraction=0.0))
    with pytest.raises(ValueError, match="copy_fraction"):
        ToolWarmStartConfig(tool_fraction=0.6, copy_fraction=0.5)


def test_the_tool_demo_config_runs_through_the_command_line(tmp_path) -> None:
    """The door of configs/demo_tools_cpu.yaml: its tools, multi-turn options and evaluation run end to end (on a
    warm start of a few steps saved as a model folder; the demo's own warm start takes minutes to build)."""
    import subprocess
    import sys
    from pathlib import Path

    from lit_grpo.cli.plots import read_scalars

    config = ToolWarmStartConfig(steps=3, warmup_steps=1, batch_size=4, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)
    model, tok = train_warm_start(config, log=None)
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo", "fit", "--config", str(root / "configs" / "demo_tools_cpu.yaml"),
         "--model.model_name", str(tmp_path / "model"), "--trainer.max_steps", "2", "--data.prompts_per_step", "2",
         "--data.num_generations", "2", "--data.max_new_tokens", "8", "--eval.num_questions", "2",
         "--eval.num_samples", "2", "--eval.ks", "[1]", "--trainer.default_root_dir", str(tmp_path / "runs"),
         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--trainer.enable_progress_bar", "false"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    scalars = read_scalars(tmp_path / "runs")
    assert [step for step, _ in scalars["rollout/turns"]] == [0, 1]
    assert "rollout/tool_calls" in scalars and "eval/pass@1" in scalars
