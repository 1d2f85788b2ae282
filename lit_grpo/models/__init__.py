"""Models: loading by alias, Hub id or folder (``loading``; the warm-started demo alias's recipe is named by import
path and lives in ``lit_grpo.training.warm_start``), frozen copies such as pi_ref (``copies``) and LoRA
(``lora``, with its parts ``lora_layers``, ``lora_tensors``, ``lora_merge``, ``lora_push``, ``lora_export``;
``adapter_export`` writes an adapter with its base).
It imports ``lit_grpo.core`` only: never data, training, engines, the server or the command line.

The names of ``loading`` are importable from here, as they were from the module ``lit_grpo.models``."""

from lit_grpo.models.loading import (
    ALIAS_LOADERS,
    ALIASES,
    CHATML_TEMPLATE,
    DTYPES,
    alias_loader,
    cache_dir,
    disable_dropout,
    eos_token_ids,
    load_model_and_tokenizer,
    load_smollm2,
    load_tiny_random_llama,
    pad_token_id,
    smollm2_gguf_dir,
    tiny_llama,
    tiny_tokenizer,
)

__all__ = ["ALIASES", "ALIAS_LOADERS", "CHATML_TEMPLATE", "DTYPES", "alias_loader", "cache_dir", "disable_dropout",
           "eos_token_ids", "load_model_and_tokenizer", "load_smollm2", "load_tiny_random_llama", "pad_token_id",
           "smollm2_gguf_dir", "tiny_llama", "tiny_tokenizer"]
