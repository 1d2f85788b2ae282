"""A ``generation_config.json`` that changes sampling in every way it can: for the sampling-contract tests, which
check that no engine samples from anything but ``softmax(logits / T)`` (``lit_grpo.engines.sampling_fields``)."""

from __future__ import annotations

import json
from pathlib import Path

from lit_grpo.wire.protocol import NEUTRAL_SAMPLING_FIELDS

#: non-default values of ``GenerationConfig``'s fields that change what is sampled or where it stops, as JSON (token
#: ids lie in the tiny tokenizer's vocabulary); ``presence_penalty`` and ``frequency_penalty`` are not
#: ``GenerationConfig`` fields, but vLLM reads them from the file too
SAMPLING_JSON = dict(
    max_length=3, max_new_tokens=2, min_length=30, min_new_tokens=11, do_sample=False, temperature=0.05, top_k=1,
    top_p=0.05, min_p=0.9, top_h=0.2, typical_p=0.2, epsilon_cutoff=0.3, eta_cutoff=0.3, repetition_penalty=5.0,
    encoder_repetition_penalty=3.0, no_repeat_ngram_size=1, bad_words_ids=[[28], [44]], renormalize_logits=True,
    forced_bos_token_id=40, forced_eos_token_id=78, exponential_decay_length_penalty=[1, 2.0],
    suppress_tokens=[19, 47], begin_suppress_tokens=[46], sequence_bias=[[[28], 20.0]], eos_token_id=[28],
    num_beams=2, num_return_sequences=2, guidance_scale=3.0, penalty_alpha=0.6, diversity_penalty=1.0,
    presence_penalty=1.5, frequency_penalty=1.0,
)


def sampling_fields_of_the_class() -> set[str]:
    """The fields of transformers' ``GenerationConfig`` (read from the class, so a later transformers' new field
    shows up) that :data:`SAMPLING_JSON` sets; the test asserts which of them it covers."""
    from transformers import GenerationConfig

    return set(GenerationConfig().to_dict()) & set(SAMPLING_JSON)


def write_polluted_generation_config(model_dir: Path) -> dict:
    """Overwrite ``model_dir/generation_config.json`` with :data:`SAMPLING_JSON`; returns what was written. Every
    field vLLM fills a request from holds a value far from its neutral one."""
    assert all(SAMPLING_JSON[k] != v for k, v in NEUTRAL_SAMPLING_FIELDS.items())
    path = Path(model_dir) / "generation_config.json"
    existing = json.loads(path.read_text()) if path.exists() else {}
    written = {**existing, **SAMPLING_JSON}
    path.write_text(json.dumps(written, indent=1))
    return written
