"""``lit_grpo serve --max-num-seqs N``: the rollout server's requests decode at most N sequences at once, and give
the completions of an uncapped server (same seed), since each token's draw belongs to its row and position
(``lit_grpo.engines.continuous_batching``)."""

from __future__ import annotations

import pytest

from lit_grpo.cli.serve import main as serve_main


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from lit_grpo.models.loading import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny-random-llama")


def served(model_and_tokenizer, max_num_seqs):  # noqa: ANN001
    from lit_grpo.serve.server import RolloutServer

    model, tokenizer = model_and_tokenizer
    return RolloutServer(model, tokenizer, "tiny-random-llama", "t" * 32, max_num_seqs=max_num_seqs)


def test_a_capped_server_gives_the_uncapped_completions_and_decodes_at_most_n_rows(model_and_tokenizer):
    model, _ = model_and_tokenizer
    body = {"prompt": [[5, 6, 7], [9, 10, 11, 12], [14, 15]], "n": 4, "max_tokens": 12, "seed": 3,
            "logprobs": 0, "return_token_ids": True}
    rows_seen: list[int] = []
    hook = model.register_forward_pre_hook(lambda _, args, kwargs: rows_seen.append(kwargs["input_ids"].shape[0]),
                                           with_kwargs=True)
    try:
        free = served(model_and_tokenizer, None).generation.completions(dict(body), {})
        uncapped_rows = max(rows_seen)
        rows_seen.clear()
        capped = served(model_and_tokenizer, 5).generation.completions(dict(body), {})
    finally:
        hook.remove()
    assert uncapped_rows == 12
    decode_rows = [r for r in rows_seen if r > 0]
    assert max(decode_rows) <= 5  # prefills of admitted prompts included
    tokens = [c["token_ids"] for c in free["choices"]]
    assert tokens == [c["token_ids"] for c in capped["choices"]]
    assert len({len(t) for t in tokens}) > 1 or any(c["finish_reason"] == "length" for c in free["choices"])


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_bad_cap_is_refused_in_one_line_before_the_model_loads(value, tmp_path, monkeypatch):
    token = tmp_path / "token"
    token.write_text("t" * 32)
    token.chmod(0o600)
    monkeypatch.setattr("lit_grpo.models.loading.load_model_and_tokenizer",
                        lambda *a, **k: pytest.fail("the model loaded before the bad option was refused"))
    with pytest.raises(ValueError, match=rf"max_num_seqs must be an integer >= 1 .*got {value}") as raised:
        serve_main(["--model", "tiny-random-llama", "--port", "0", "--token-file", str(token),
                    "--max-num-seqs", value])
    assert "\n" not in str(raised.value)
