"""``arith-tiny-sft``: a ~0.27M-parameter Llama with the character tokenizer, given a supervised warm-start on
column addition that leaves it able to solve the task but unlikely to sample the solution, so that GRPO has a
reward spread to work with on a CPU in minutes.

The gap. The warm-start trains on correct worked solutions of the task's *train* split with label smoothing
``label_smoothing`` (0.07): the target of every answer token keeps 93 % on the right character and spreads 7 %
over the whole vocabulary. The model learns the procedure (greedy decoding solves ~100 % of the held-out split,
Pass@8 at temperature 1 is ~0.95) but, sampled at temperature 1, slips on one of the ~24 answer characters most
of the time: held-out Pass@1 is ~0.2. This is the regime of a small instruction-tuned LLM on GSM8K, where the
right answer is within reach (Pass@k >> Pass@1) and RL with a verifiable reward moves probability mass onto the
completions the verifier accepts; it is *not* a test of whether GRPO can teach a skill the model lacks.

(Tried and dropped: stopping a clean warm-start early (Pass@1 ~0.25 but Pass@8
only ~0.75: GRPO got no signal on the problems the model never solves and reached ~0.55-0.7 Pass@1 in 15 minutes),
and training on solutions with injected arithmetic slips (the noise slowed the supervised learning several-fold,
and a noisy phase after clean training erased what the model knew).)

The weights are a pure function of :class:`WarmStartConfig` (seeded data order and init; trained on one thread,
so they do not depend on the machine's core count), the training data, and the numerics of the libraries and CPU
that train them. They are built on first use (about 2-3 minutes on one core) and cached under ``$LIT_GRPO_CACHE``
(default ``~/.cache/lit_grpo``) in a folder keyed by :func:`cache_key`: a hash of the config, of the training data
as the model sees it (:func:`training_data_digest`: problems, worked answers, prompt template, tokenizer), and of
:func:`build_environment` (torch and transformers versions, the CPU instruction set torch dispatches to), so a
change to any of them trains a fresh model instead of loading a stale one. Later runs load them in a second.
``warm_start.json`` in the folder records all of these and :func:`weights_fingerprint` of the weights.

The recipe sits above model loading: it builds on :mod:`lit_grpo.models.loading` (the character tokenizer, the cache
folder), and the ``arith-tiny-sft`` alias there names :func:`load_arith_tiny_sft` by its import path.

``calc-tiny-sft`` (:class:`ToolWarmStartConfig`, :data:`CALC_TINY_SFT`) is the same recipe on the tool-use task
``synthetic:mul_2digit``, with the character tokenizer plus the Hermes tool-call tags
(:func:`lit_grpo.models.loading.tiny_tool_tokenizer`). Each training example is a whole rollout, laid out token by
token as the multi-turn driver lays it out (:func:`lit_grpo.data.synthetic.tool_sft_example`): a share
``tool_fraction`` of the train problems is answered by a call of the ``calculator`` tool, the tool's message (not
trained: label -100) and ``#### <product>``; a share ``copy_fraction`` the same way but with the call's first token
(the choice to call) as context rather than target; the others by ``#### <product>`` alone. The model cannot
multiply two two-digit numbers in its head, so its direct answers are nearly always wrong, while a tool call
succeeds: held-out Pass@1 at temperature 1 is about the share of first turns that call the tool, and GRPO raises it
by making the model call the tool. Without label smoothing: the ~60 characters of a call must all be copied right.

Why the copy examples. With calls only in a share ``tool_fraction`` = 0.4 of the examples (1,600 steps), the model
called the tool 0.37 of the time but then copied the tool's 3-4 digit result into ``#### <n>`` right only 0.40 of
the time: the direct answers (``#### <product>`` after the question) teach it to produce a product from the
factors, and that habit competed with copying after the tool's message; GRPO then stalled at Pass@1 0.40. The copy
examples give the call and the copy their practice without teaching the choice to call, which the ``tool`` and
``direct`` examples alone set (a share ``tool_fraction / (1 - copy_fraction)`` of first turns).

Measured (``experiments/calc_warm_start.py``: 100 test questions x 8 samples, temperature 1) for
:data:`CALC_TINY_SFT` (tool_fraction 0.1, copy_fraction 0.6, 3,200 steps; 11 minutes on one thread of a 2-core
AMD EPYC (AVX-512) with the other core busy, torch 2.13, transformers 5.24): the first turn calls the tool 0.20 of
the time, the call's expression is the question's 0.975 of the time, a trajectory that calls it ends right 0.975 of
the time, a direct answer never; Pass@1 0.196. Why 3,200 steps: the same recipe at 1,600 steps, built on another
machine (other kernels round otherwise, so the weights differ), called 0.21 and ended right through the tool 0.98,
but built on this one 0.66 (expression 0.96), and GRPO then stalled at Pass@1 0.70 instead of 0.96; at 2,400 steps
0.83 here. With tool_fraction 0.15 and copy_fraction 0.45 (1,600 steps): calls 0.23, right through the tool 0.82,
Pass@1 0.19.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lit_grpo.data.prompts import prompt_ids
from lit_grpo.data.synthetic import generate_problems, tool_sft_example, worked_answer
from lit_grpo.models.loading import cache_dir, tiny_tokenizer, tiny_tool_tokenizer

#: bump when the training recipe changes in a way the config does not capture, to invalidate old caches
RECIPE_VERSION = 1
#: positions of the warm-started models (RoPE): every training sequence must fit
MAX_POSITIONS = 256
#: one supervised example: prompt ids, completion ids and, optionally, 1/0 per completion token (0: not trained)
Example = tuple[list[int], list[int]] | tuple[list[int], list[int], list[int]]


@dataclass(frozen=True)
class WarmStartConfig:
    """Architecture and supervised warm-start of the small arithmetic policy.

    The learning-rate schedule (linear warmup, cosine to 10 %) spans ``steps``; training stops after
    ``stop_after`` of them (``None``: all). ``label_smoothing`` on the answer tokens sets where GRPO starts
    (held-out Pass@1 at temperature 1: ~0.36 at 0.05, ~0.26 at 0.06, ~0.21 at 0.07).
    """

    #: the model alias the config is built for (names its cache folder; a class attribute, not in the key)
    alias: ClassVar[str] = "arith-tiny-sft"

    task: str = "add_2digit"
    data_seed: int = 0
    seed: int = 0
    steps: int = 800
    stop_after: int | None = None
    batch_size: int = 32
    lr: float = 1e-2
    warmup_steps: int = 50
    label_smoothing: float = 0.07
    hidden_size: int = 64
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4

    def __post_init__(self) -> None:
        if self.stop_after is not None and not 1 <= self.stop_after <= self.steps:
            raise ValueError(f"stop_after must lie in [1, steps={self.steps}] or be None, got {self.stop_after}")

    def key(self) -> str:
        """The cache key of this config in this environment (:func:`cache_key`)."""
        return cache_key(self, build_environment(), training_data_digest(self))


def build_environment() -> dict[str, str]:
    """What, besides the config and the data, changes the trained weights: the torch and transformers versions
    (kernels, Llama's initialisation) and the CPU instruction set torch's kernels dispatch to (AVX2 and AVX-512
    reductions round differently). The thread count does not: training runs on one thread."""
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


@dataclass(frozen=True)
class ToolWarmStartConfig(WarmStartConfig):
    """The warm start of a tool-using policy (``calc-tiny-sft``): :class:`WarmStartConfig`'s architecture and
    schedule on a tool-use task (:data:`lit_grpo.data.synthetic.MUL_TASKS`), with a share ``tool_fraction`` of the
    train problems solved by a calculator call (drawn once per problem from ``data_seed``) and the rest answered
    directly. ``label_smoothing`` applies to every trained token (the model's, never the tool's)."""

    alias: ClassVar[str] = "calc-tiny-sft"
    task: str = "mul_2digit"
    # at 800 the model copies the question's factors into its call only ~1/4 of the time; at 1600 how well it then
    # copies the tool's result depends on the machine that trained it (0.98 on one, 0.66 on another), at 3200 both
    # copy it (0.975 measured on the second)
    steps: int = 3200
    tool_fraction: float = 0.1
    label_smoothing: float = 0.0
    #: a further share of the problems solved with the tool whose *decision* is not trained (the call's first token
    #: is context, not a target): practice for the call and for copying the tool's result into the answer, which
    #: leaves the share of first turns that call the tool at tool_fraction / (1 - copy_fraction)
    copy_fraction: float = 0.6

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.tool_fraction <= 1.0:
            raise ValueError(f"tool_fraction must lie in [0, 1], got {self.tool_fraction}")
        if not 0.0 <= self.copy_fraction <= 1.0 - self.tool_fraction:
            raise ValueError(f"copy_fraction must lie in [0, 1 - tool_fraction], got {self.copy_fraction}")


def warm_start_tokenizer(config: WarmStartConfig):  # noqa: ANN201 (a Hugging Face tokenizer)
    """The tokenizer the config's model reads: the character tokenizer, plus the tool-call tags for a tool task."""
    return tiny_tool_tokenizer() if isinstance(config, ToolWarmStartConfig) else tiny_tokenizer()


def example_kinds(config: ToolWarmStartConfig) -> list[str]:
    """How each train problem (in order) is solved: ``tool`` (a call, its decision trained) with probability
    ``tool_fraction``, ``copy`` (a call whose decision is context) with probability ``copy_fraction``, else
    ``direct``; drawn from a stream of its own, so the choice depends on ``data_seed`` only (not on the training
    seed)."""
    rng = random.Random(f"lit_grpo.training.warm_start:tool:{config.task}:{config.data_seed}")
    kinds = []
    for _ in generate_problems(config.task, config.data_seed)["train"]:
        u = rng.random()
        kinds.append("tool" if u < config.tool_fraction else
                     "copy" if u < config.tool_fraction + config.copy_fraction else "direct")
    return kinds


def uses_tool(config: ToolWarmStartConfig) -> list[bool]:
    """Which train problems (in order) are solved with a call whose decision is trained (``tool``)."""
    return [kind == "tool" for kind in example_kinds(config)]


@functools.lru_cache(maxsize=4)
def tool_examples(task: str, data_seed: int, tool_fraction: float, copy_fraction: float = 0.0) -> tuple[Example, ...]:
    """The tool warm start's examples, which depend on these four fields only; kept, because the cache key
    hashes them and training reads them (rendering every rollout through the chat template takes seconds)."""
    config = ToolWarmStartConfig(task=task, data_seed=data_seed, tool_fraction=tool_fraction,
                                 copy_fraction=copy_fraction)
    tokenizer = warm_start_tokenizer(config)
    problems = generate_problems(task, data_seed)["train"]
    return tuple(tool_sft_example(tokenizer, p, kind != "direct", decide=kind == "tool")
                 for p, kind in zip(problems, example_kinds(config)))


def training_examples(config: WarmStartConfig, tokenizer) -> list[Example]:  # noqa: ANN001
    """Every supervised example of the config's train split: ``(prompt_ids, answer_ids)`` of a worked solution
    for the arithmetic tasks; whole tool-use rollouts (:func:`lit_grpo.data.synthetic.tool_sft_example`) for a
    :class:`ToolWarmStartConfig`."""
    if isinstance(config, ToolWarmStartConfig):
        return list(tool_examples(config.task, config.data_seed, config.tool_fraction, config.copy_fraction))
    problems = generate_problems(config.task, config.data_seed)["train"]
    eos = tokenizer.eos_token_id
    return [
        (prompt_ids(tokenizer, p.question, None),
         list(tokenizer(worked_answer(p.columns()), add_special_tokens=False)["input_ids"]) + [eos])
        for p in problems
    ]


def training_data_digest(config: WarmStartConfig) -> str:
    """SHA-256 of the training data as the model sees it: every train problem's question and worked answer, the
    tokenizer's vocabulary, special tokens and chat template, and the prompt ids of the first question (so a
    change to the generator, the answer format, the prompt template or the tokenizer changes the digest).
    For a :class:`ToolWarmStartConfig`: the tokenizer and every example's token ids and trained mask."""
    if isinstance(config, ToolWarmStartConfig):
        return tool_training_data_digest(config)
    tokenizer = tiny_tokenizer()
    problems = generate_problems(config.task, config.data_seed)["train"]
    digest = hashlib.sha256()
    digest.update(json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template,
                              "specials": tokenizer.all_special_tokens,
                              "first_prompt": prompt_ids(tokenizer, problems[0].question, None)}).encode())
    for problem in problems:
        digest.update(f"{problem.question}\x00{worked_answer(problem.columns())}\x00".encode())
    return digest.hexdigest()


def tool_training_data_digest(config: ToolWarmStartConfig) -> str:
    """SHA-256 of a tool warm start's data: the tokenizer (vocabulary, special tokens, chat template) and every
    example exactly as trained (prompt, completion and trained mask), so a change to the task, the call's
    spelling, the rendering of the tool message or the choice of problems changes it."""
    tokenizer = warm_start_tokenizer(config)
    digest = hashlib.sha256()
    digest.update(json.dumps({"vocab": sorted(tokenizer.get_vocab().items()), "template": tokenizer.chat_template,
                              "specials": tokenizer.all_special_tokens}).encode())
    for example in tool_examples(config.task, config.data_seed, config.tool_fraction, config.copy_fraction):
        digest.update(json.dumps(example).encode())
    return digest.hexdigest()


def cache_key(config: WarmStartConfig, environment: dict[str, str], data_digest: str) -> str:
    """12 hex digits of SHA-256 over the recipe version, every config field, the environment and the data
    digest: equal keys mean the same training run, so the cached weights are the ones it would train now."""
    payload = json.dumps({"recipe": RECIPE_VERSION, **dataclasses.asdict(config), "environment": environment,
                          "data": data_digest}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter and buffer (name, dtype, shape, bytes, in name order): equal fingerprints
    mean bit-identical weights, so two runs can tell whether they started from the same model."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)}:".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


#: the config behind the ``arith-tiny-sft`` alias
ARITH_TINY_SFT = WarmStartConfig()
#: the config behind the ``calc-tiny-sft`` alias
CALC_TINY_SFT = ToolWarmStartConfig()


def build_model(config: WarmStartConfig, vocab_size: int) -> LlamaForCausalLM:
    """A fresh model, initialised from ``config.seed`` without touching the global RNG."""
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_attention_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(llama)


def sft_batch(examples: list[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and labels (-100 on prompt and padding: the loss is on the answer only;
    also on the completion tokens an example marks 0, the environment's)."""
    width = max(len(e[0]) + len(e[1]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for row, (p, a, *trained) in enumerate(examples):
        n = len(p) + len(a)
        ids[row, :n] = torch.tensor(p + a)
        mask[row, :n] = 1
        targets = torch.tensor(a)
        if trained:
            targets = torch.where(torch.tensor(trained[0]) == 1, targets, torch.full_like(targets, -100))
        labels[row, len(p):n] = targets
    return ids, mask, labels


def lr_factor(config: WarmStartConfig, step: int) -> float:
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def train_warm_start(
    config: WarmStartConfig = ARITH_TINY_SFT,
    log: Callable[[str], None] | None = print,
    on_step: Callable[[int, LlamaForCausalLM, float], None] | None = None,
) -> tuple[LlamaForCausalLM, object]:
    """Supervised warm-start (cross-entropy with label smoothing on the answer tokens) on the task's *train*
    split (the test split is never seen). Prompts are the ones
    GRPO and Pass@k build: the chat template with no system prompt (``data.system_prompt: null``).
    ``on_step(step, model, loss)`` is called after every optimizer step (for probes; it must not train)."""
    tokenizer = warm_start_tokenizer(config)
    model = build_model(config, len(tokenizer))
    examples = training_examples(config, tokenizer)
    longest = max(len(e[0]) + len(e[1]) for e in examples)
    if longest > MAX_POSITIONS:
        raise ValueError(f"the longest training sequence of {config.task!r} has {longest} tokens; expected at most "
                         f"the model's {MAX_POSITIONS} positions")
    rng = random.Random(f"lit_grpo.training.warm_start:{config.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.0, betas=(0.9, 0.98))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(config, step))
    model.train()
    last = config.steps if config.stop_after is None else config.stop_after
    for step in range(1, last + 1):
        ids, mask, labels = sft_batch([examples[rng.randrange(len(examples))] for _ in range(config.batch_size)],
                                      tokenizer.pad_token_id)
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1),
                                                 ignore_index=-100, label_smoothing=config.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if log is not None and (step % 100 == 0 or step == last):
            log(f"warm-start step {step}/{last}: loss {loss.item():.4f}")
        if on_step is not None:
            on_step(step, model, loss.item())
    model.eval()
    return model, tokenizer


def cached_dir(config: WarmStartConfig = ARITH_TINY_SFT) -> Path:
    return cache_dir() / f"{config.alias}-{config.key()}"


def load_warm_started(config: WarmStartConfig = ARITH_TINY_SFT, dtype: torch.dtype = torch.float32,
                      log: Callable[[str], None] | None = print) -> tuple[LlamaForCausalLM, object]:
    """``(model, tokenizer)`` warm-started with ``config``: from the cache, or trained now on one thread (a few
    minutes) and cached for the next run. The cached folder is a plain Hugging Face model directory."""
    folder = cached_dir(config)
    if (folder / "config.json").exists():
        return LlamaForCausalLM.from_pretrained(folder, dtype=dtype), warm_start_tokenizer(config)
    if log is not None:
        log(f"{config.alias}: supervised warm-start on synthetic:{config.task} "
            f"({config.stop_after or config.steps} steps, one thread), cached in {folder}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, tokenizer = train_warm_start(config, log=log)
    finally:
        torch.set_num_threads(threads)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}-"))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        record = {**dataclasses.asdict(config), "recipe": RECIPE_VERSION, "environment": build_environment(),
                  "data": training_data_digest(config), "fingerprint": weights_fingerprint(model)}
        (staging / "warm_start.json").write_text(json.dumps(record, indent=1) + "\n")
        try:
            staging.rename(folder)  # atomic: a concurrent run sees no folder or a complete one
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process cached it first
    except OSError:
        pass  # read-only cache: keep working without it
    return model.to(dtype), tokenizer


def load_arith_tiny_sft(dtype: torch.dtype) -> tuple[LlamaForCausalLM, object]:
    """The ``arith-tiny-sft`` alias of :func:`lit_grpo.models.loading.load_model_and_tokenizer`:
    :data:`ARITH_TINY_SFT`."""
    return load_warm_started(ARITH_TINY_SFT, dtype=dtype)


def load_calc_tiny_sft(dtype: torch.dtype) -> tuple[LlamaForCausalLM, object]:
    """The ``calc-tiny-sft`` alias of :func:`lit_grpo.models.loading.load_model_and_tokenizer`:
    :data:`CALC_TINY_SFT`."""
    return load_warm_started(CALC_TINY_SFT, dtype=dtype)
