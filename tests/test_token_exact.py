"""Token-exact trajectories: the model's tokens are exactly what the sampler produced (never decoded and encoded
again), the environment's tokens are the rendered difference of the conversation, tokenized on their own, and the
loss, its weights and its statistics count the model's tokens only.

Each test is built so that the shortcut a trainer could take gives other numbers: the sampled tokens do not survive
a round trip through their text (the character tokenizer spells ``<|im_end|>`` as ten characters that re-encode to
one special token; a small BPE re-encodes ``hel`` + ``lo`` as ``hello``), the environment's text merges with the
model's when the whole conversation is tokenized at once, and a template rewrites earlier turns."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import MetricsRecorder, tiny_module, tiny_trainer
from toy_environments import GuessTheNumber, ScriptedSampler, scripted_turns_data

from lit_grpo.core.scoring import completion_logprobs
from lit_grpo.data.multi_turn import MultiTurnOptions, TrajectoryRunner, trajectory_stats
from lit_grpo.data.rollout import BatchOrigin, collate_rollouts, pad_rollouts
from lit_grpo.engines.base import Completion, SamplingConfig
from lit_grpo.environments.rendering import ConversationRenderer
from lit_grpo.environments.tool_calls import parse_hermes
from lit_grpo.environments.tools import ToolBox
from lit_grpo.models.loading import CHATML_TEMPLATE, tiny_tokenizer

SAMPLING = SamplingConfig(max_new_tokens=64)
EOS = 2  # <|im_end|> in both tokenizers

# ChatML whose assistant turns keep only what follows the reasoning (Qwen3's templates drop earlier turns' <think>)
THINK_STRIPPING_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
    "{% if m['role'] == 'assistant' %}{{ m['content'].split('</think>')[-1].lstrip('\\n') }}"
    "{% else %}{{ m['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# a template whose turns are separated by plain text: nothing stops the model's text and the next message's from
# merging when the conversation is tokenized as a whole
PLAIN_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def bpe_tokenizer(template: str = CHATML_TEMPLATE):
    """A byte-level BPE whose merges are written out (so the pieces the tests sample are sure to exist): ``hel`` +
    ``lo`` -> ``hello``, and ``hello`` + newline -> one token. No pre-tokenizer regex: merges may cross any text
    boundary, as in tokenizers that merge whitespace with words. ChatML's markers are special tokens (ids 0-2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
    merges = [("h", "e"), ("he", "l"), ("l", "o"), ("hel", "lo"), ("hello", "Ċ")]  # Ċ: byte-level newline
    vocab = {t: i for i, t in enumerate(specials + sorted(pre_tokenizers.ByteLevel.alphabet())
                                        + [a + b for a, b in merges])}
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = template
    return fast


def make_runner(tokenizer, environment=GuessTheNumber, system_prompt: str | None = None,
                **options) -> TrajectoryRunner:
    box = ToolBox([])
    return TrajectoryRunner(environment, box, parse_hermes, ConversationRenderer(tokenizer, None, system_prompt),
                            MultiTurnOptions(**options))


def ids(tokenizer, pieces: list[str]) -> list[int]:
    """The ids of ``pieces``, each one token of the vocabulary."""
    out = tokenizer.convert_tokens_to_ids(pieces)
    assert None not in out and tokenizer.unk_token_id not in out and tokenizer.decode(out) == "".join(pieces), pieces
    return out


def turn_of(prefix: list[int], prompt_markers: int = 2) -> int:
    """Which model turn a prefix asks for: ``<|im_start|>`` (id 1) opens the prompt's ``prompt_markers`` messages and
    the assistant's opening, then two more per turn (the environment's message and the next opening)."""
    return (prefix.count(1) - prompt_markers) // 2


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def segments(completion: Completion, which: int) -> list[list[int]]:
    """The runs of ``completion``'s tokens whose mask is ``which`` (1: the model's turns, 0: the environment's)."""
    runs, current = [], []
    for token, m in zip(completion.token_ids, completion.mask):
        if m == which:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def trap_turns(tokenizer) -> tuple[list[int], list[int]]:
    """Two model turns whose tokens do not survive decode + encode: the character tokenizer's ``<|im_end|>`` spelled
    as characters (text that encodes to the one special token), and the BPE's ``hel`` + ``lo`` (encodes to
    ``hello``). The second turn answers 3."""
    if tokenizer.convert_tokens_to_ids("hello") not in (None, tokenizer.unk_token_id):
        first = ids(tokenizer, ["hel", "lo"]) + [EOS]
    else:
        first = [tokenizer.convert_tokens_to_ids(c) for c in "no<|im_end|>"] + [EOS]
    return first, ids(tokenizer, ["3"]) + [EOS]


@pytest.mark.parametrize("make_tokenizer", [tiny_tokenizer, bpe_tokenizer], ids=["chars", "bpe"])
def test_model_tokens_are_exactly_the_sampled_ones(make_tokenizer):
    tokenizer = make_tokenizer()
    first, second = trap_turns(tokenizer)
    # the trap is real: the naive round trip of the model's turn gives other tokens
    assert encode(tokenizer, tokenizer.decode(first)) != first
    sampler = ScriptedSampler(lambda prefix, j: first if turn_of(prefix) == 0 else second)
    runner = make_runner(tokenizer)
    (group,) = runner.run([{"target": 3}], 2, sampler, SAMPLING, seed=0).groups
    for completion in group:
        assert segments(completion, 1) == [first, second]
        assert completion.trajectory["turns"] == 2 and completion.trajectory["env_reward"] == 1.0
        # the sampler's own log-probs, in place; the environment's tokens carry 0
        model_logprobs = [lp for lp, m in zip(completion.logprobs, completion.mask) if m]
        assert len(model_logprobs) == len(first) + len(second) and all(lp < 0 for lp in model_logprobs)
        assert all(lp == 0.0 for lp, m in zip(completion.logprobs, completion.mask) if not m)
    # the second turn was sampled after the first exactly as sampled, then the environment's tokens
    prompt = sampler.requests[0][0]
    env = segments(group[0], 0)[0]
    assert sampler.requests[1] == [prompt + first + env] * 2
    assert group[0].token_ids == first + env + second
    # and the whole conversation, re-tokenized, is not that sequence
    messages = group[0].trajectory["messages"]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert encode(tokenizer, rendered)[: len(prompt) + len(group[0].token_ids)] != prompt + group[0].token_ids


def test_environment_text_that_merges_with_the_models_is_tokenized_on_its_own():
    tokenizer = bpe_tokenizer(PLAIN_TEMPLATE)
    hello, three = ids(tokenizer, ["hello"]), ids(tokenizer, ["3"])
    sampler = ScriptedSampler(lambda prefix, j: hello if len(sampler.requests) == 1 else three)
    (group,) = make_runner(tokenizer).run([{"target": 3}], 1, sampler, SAMPLING, seed=0).groups
    (completion,) = group
    prompt = sampler.requests[0][0]
    env_text = "\nuser: Lower.\nassistant: "
    assert completion.token_ids == hello + encode(tokenizer, env_text) + three
    assert completion.mask == (1,) * len(hello) + (0,) * len(encode(tokenizer, env_text)) + (1,) * len(three)
    whole = tokenizer.decode(prompt + completion.token_ids)
    assert whole == tokenizer.apply_chat_template(completion.trajectory["messages"], tokenize=False)[:-1]
    # tokenized as a whole, the model's "hello" and the environment's newline become one token
    joint = encode(tokenizer, whole)
    assert tokenizer.convert_tokens_to_ids("helloĊ") in joint
    assert joint != prompt + completion.token_ids


def test_environment_tokens_are_the_rendered_difference():
    tokenizer = tiny_tokenizer()
    first, second = trap_turns(tokenizer)
    wrong = ids(tokenizer, list("5")) + [EOS]
    turns = [first, wrong, second]
    sampler = ScriptedSampler(lambda prefix, j: turns[turn_of(prefix, 3)])
    runner = make_runner(tokenizer, system_prompt="Be brief.")
    (group,) = runner.run([{"target": 3}], 1, sampler, SAMPLING, seed=0).groups
    (completion,) = group
    record = completion.trajectory
    assert segments(completion, 1) == turns and record["turns"] == 3
    prompt = sampler.requests[0][0]
    messages = record["messages"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    # the trajectory, decoded, is the chat template's rendering of the whole conversation (the template's newline
    # after the model's last end-of-turn token is not part of it: the trajectory ends on the model's last token)
    assert tokenizer.decode(prompt + completion.token_ids) + "\n" == tokenizer.apply_chat_template(messages,
                                                                                                   tokenize=False)
    # each environment segment is the difference between the conversation's renderings after and before its message
    held = prompt + first
    for k, env in enumerate(segments(completion, 0)):
        before = tokenizer.decode(held)
        after = tokenizer.apply_chat_template(messages[: 4 + 2 * k], tokenize=False, add_generation_prompt=True)
        assert after.startswith(before)
        assert env == encode(tokenizer, after[len(before):])
        held = held + env + turns[k + 1]
    assert record["env_tokens"] == sum(map(len, segments(completion, 0)))
    assert record["model_tokens"] == sum(map(len, turns)) == sum(completion.mask)


def test_a_template_that_strips_earlier_reasoning_is_detected_and_the_sampled_tokens_kept():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = THINK_STRIPPING_TEMPLATE
    chars = [tokenizer.convert_tokens_to_ids(c) for c in "<think>maybe 7</think>no"]
    first, second = chars + [EOS], ids(tokenizer, ["3"]) + [EOS]
    runner = make_runner(tokenizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two batches of two trajectories: four mismatches, one warning for the runner
            sampler = ScriptedSampler(lambda prefix, j: first if turn_of(prefix) == 0 else second)
            (group,) = runner.run([{"target": 3}], 2, sampler, SAMPLING, seed=0).groups
    said = [w for w in caught if "chat template renders earlier turns differently" in str(w.message)]
    assert len(said) == 1 and "\n" not in str(said[0].message)
    for completion in group:
        assert completion.trajectory["template_mismatch"] is True
        assert segments(completion, 1) == [first, second]  # the reasoning the model sampled stays in the trajectory
        (env,) = segments(completion, 0)
        # the fallback: the rest of the assistant's closing after its sampled <|im_end|>, then the message rendered
        # as after any assistant turn, and the next assistant opening
        expected = "\n<|im_start|>user\nLower.<|im_end|>\n<|im_start|>assistant\n"
        assert env == encode(tokenizer, expected)
        assert "Lower." in tokenizer.decode(env)
    assert trajectory_stats([group])["template_mismatch"] == 2.0
    # a new runner says it again (once per runner)
    with pytest.warns(UserWarning, match="renders earlier turns differently"):
        sampler = ScriptedSampler(lambda prefix, j: first if turn_of(prefix) == 0 else second)
        make_runner(tokenizer).run([{"target": 3}], 1, sampler, SAMPLING, seed=0)


# ---- the loss counts the model's tokens only ------------------------------------------------------------------
def multi_turn_batch(policy: torch.nn.Module | None = None, alpha_shift: torch.Tensor | None = None):
    """A rollout batch of 2 tasks x 2 trajectories of GuessTheNumber with the character tokenizer (turns of several
    lengths, so rows are padded differently), and its groups. alpha (as a recompute gives it) is ``policy``'s
    log-probs of the batch, plus ``alpha_shift``; without a policy, the sampler's."""
    tokenizer = tiny_tokenizer()
    char = tokenizer.convert_tokens_to_ids

    def script(prefix: list[int], j: int) -> list[int]:
        turn = turn_of(prefix)
        guess = str((j + turn) % 10)
        return [char(c) for c in "I say "[: 3 + j + turn]] + [char(guess), EOS]

    sampler = ScriptedSampler(script)
    runner = make_runner(tokenizer, max_turns=3)
    rows = [{"target": 2}, {"target": 9}]
    groups = runner.run(rows, 2, sampler, SAMPLING, seed=0).groups
    padded = pad_rollouts(sampler.requests[0], groups, pad_token_id=0, micro_batch_size=2)
    alpha = padded.sampler_logp.clone()
    if policy is not None:
        with torch.no_grad():
            for mb in padded.micro_batches():
                logp = completion_logprobs(policy, mb, 1.0)[0]
                alpha[mb.rows, : logp.shape[1]] = logp.float()
    if alpha_shift is not None:
        alpha = alpha + alpha_shift
    rewards = [c.trajectory["env_reward"] + 0.1 * k for k, c in enumerate(c for g in groups for c in g)]
    batch = collate_rollouts(padded, rewards, origin=BatchOrigin(alpha_logp=alpha, alpha_source="recompute"))
    return batch, groups


def test_the_batch_masks_the_environments_tokens_out_of_the_loss():
    batch, groups = multi_turn_batch()
    flat = [c for g in groups for c in g]
    assert any(0 in c.mask for c in flat)  # the batch has environment tokens
    for row, c in enumerate(flat):
        n = len(c.token_ids)
        assert batch.loss_mask[row, :n].tolist() == list(c.mask)
        assert batch.completion_mask[row, :n].tolist() == [1] * n  # attention sees the environment's tokens
        assert batch.loss_mask[row, n:].sum() == 0 and batch.completion_mask[row, n:].sum() == 0
    assert torch.equal(batch.token_mask, batch.loss_mask)
    # the lengths logged are the model's tokens
    assert batch.stats["completion_length"] == pytest.approx(sum(sum(c.mask) for c in flat) / len(flat))
    module = tiny_module()
    weights = module.loss_weights(batch)
    env = (batch.completion_mask == 1) & (batch.loss_mask == 0)
    assert env.any() and (weights[env] == 0).all()
    assert (weights[batch.loss_mask == 1] > 0).all()
    assert weights.sum().item() == pytest.approx(1.0)  # token_mean: 1 / (the model's tokens) each


def module_step(module, batch) -> tuple[dict[str, float], list[torch.Tensor]]:
    """The module's own micro-batch path over ``batch`` (iteration 0): its statistics summed over micro-batches, and
    the policy's gradient."""
    module.policy.zero_grad(set_to_none=True)
    weights = module.loss_weights(batch)
    totals: dict[str, float] = {}
    micro_batches = list(batch.micro_batches())
    module._micro_batches_per_step = len(micro_batches)
    for mb in micro_batches:
        stats, _ = module.micro_batch_step(batch, mb, weights, None, None, 0)
        for key, value in stats.items():
            value = float(value)
            totals[key] = min(totals.get(key, value), value) if key.endswith("_min") else \
                max(totals.get(key, value), value) if key.endswith("_max") else totals.get(key, 0.0) + value
    grads = [p.grad.detach().clone() for p in module.policy.parameters() if p.grad is not None]
    return totals, grads


def test_the_module_step_counts_the_models_tokens_only(monkeypatch):
    """alpha changed at the environment's positions changes no number of the step (loss, gradient, ratio and TV
    statistics); changed at one model token, it does."""
    module = tiny_module()
    monkeypatch.setattr(module, "manual_backward", lambda loss: loss.backward())
    batch, _ = multi_turn_batch(module.policy)  # alpha = pi_k: every ratio 1, inside the clip
    env = ((batch.completion_mask == 1) & (batch.loss_mask == 0)).float()
    model = batch.loss_mask.float()
    base_stats, base_grads = module_step(module, batch)
    assert base_stats["ratio_min"] == pytest.approx(1.0) and base_stats["ratio_max"] == pytest.approx(1.0)
    shifted_stats, shifted_grads = module_step(module, multi_turn_batch(module.policy, 3.0 * env)[0])
    assert shifted_stats == base_stats
    assert all(torch.equal(a, b) for a, b in zip(base_grads, shifted_grads))
    one_model_token = torch.zeros_like(model)
    one_model_token[0, int(model[0].nonzero()[-1])] = 0.05
    moved_stats, moved_grads = module_step(module, multi_turn_batch(module.policy, one_model_token)[0])
    assert moved_stats["loss"] != base_stats["loss"] and moved_stats["ratio_sum"] != base_stats["ratio_sum"]
    assert not all(torch.equal(a, b) for a, b in zip(base_grads, moved_grads))


# ---- alpha, pi_ref and pi on one sequence ---------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_alpha_pi_ref_and_pi_score_the_same_sequence(tmp_path, precision):
    """v = 1, i = 1 and alpha recomputed by the in-process engine on the batch (``reuse_policy_logprobs=False``), pi_ref
    a copy of the policy: the ratio pi / alpha is exactly 1 on every model token and KL(pi || pi_ref) exactly 0, which
    holds only when the three are scored on the same token sequence, the environment's tokens included. The same
    fit logs the multi-turn statistics. The invariant holds under bf16 autocast too: the engine scores alpha in the
    trainer's forward precision."""
    from lit_grpo.callbacks import WeightSync

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"target": 3}\n' * 4)
    # the turns are scripted (toy_environments.guessing_generate); scoring (alpha) is the in-process engine's own
    data = scripted_turns_data(dataset=str(rows), environment="toy_environments:GuessTheNumber", prompts_per_step=2,
                               num_generations=2, micro_batch_size=2, max_new_tokens=4, system_prompt=None,
                               reuse_policy_logprobs=False, multi_turn={"max_turns": 3})
    module = tiny_module(beta=0.1)
    recorder = MetricsRecorder()
    trainer = tiny_trainer(tmp_path, max_steps=1, callbacks=[WeightSync(every_n_batches=1), recorder],
                           precision=precision)
    trainer.fit(module, datamodule=data)
    (step,) = recorder.steps
    assert step["train/ratio_min"] == step["train/ratio_max"] == step["train/ratio_mean"] == 1.0
    assert step["train/clip_low_fraction"] == step["train/clip_high_fraction"] == 0.0
    assert step["train/kl"] == 0.0 and step["tv/pik_alpha"] == 0.0
    # target 3: trajectory 0 guesses 0, 1, 2 and hits max_turns; trajectory 1 guesses 1, 2, 3 and is done. Each
    # hears "Higher." twice: the message, the assistant's closing newline and the next opening, 27 tokens each time
    higher = len(encode(tiny_tokenizer(), "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"))
    assert higher == 27
    assert step["rollout/turns"] == 3.0 and step["rollout/model_tokens"] == 6.0
    assert step["rollout/env_tokens"] == 2 * higher and step["rollout/env_errors"] == 0.0
    assert step["rollout/truncated"] == 0.5 and step["rollout/reward_mean"] == 0.5
    assert step["rollout/completion_length"] == step["rollout/model_tokens"]  # lengths count the model's tokens
