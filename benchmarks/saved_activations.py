"""What one decoder layer keeps for the backward, per token, by the module that saved it: where the update's
activations go at long context, and so what a fused kernel or selective checkpointing could take away.

    OMP_NUM_THREADS=1 python benchmarks/saved_activations.py [--shape smol135] [--tokens 512] [--checkpointing]

A random-init model of the shape (``make_random_model.py``'s shapes, float32, sdpa), one forward with grad over
``--tokens`` tokens; every tensor autograd saves is counted once by its storage (parameters left out), against the
innermost module of layer 0 running when it was saved. Prints KiB per token per layer by module, and the layer's
total against the whole body's per-layer mean.

``--checkpointing``: instead, the whole body under each ``model.gradient_checkpointing`` mode (false, true,
selective; ``lit_grpo.models.checkpointing``): the bytes the forward leaves alive for the backward, per token per
layer, the peak of the forward and backward together, and their seconds, counted at the dispatcher
(``lit_grpo.core.peak_memory.PeakLiveBytes``), so the allocator plays no part.
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))


def saved_by_module(shape: str, tokens: int) -> tuple[dict[str, int], int, int]:
    """Bytes saved for the backward by each module of layer 0, all bytes saved, and the layer count."""
    import torch
    from make_random_model import SHAPES
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = SHAPES[shape]()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float()
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    seen = {p.untyped_storage().data_ptr() for p in model.parameters()}  # weights are not activations
    by_module: collections.Counter[str] = collections.Counter()
    total = [0]
    running = ["(outside layer 0)"]
    def entered(name: str) -> Any:
        return lambda module, args: running.append(name)  # returns None: the inputs stay as they are

    def left(module: Any, args: Any, output: Any) -> None:
        running.pop()  # (a hook that returned a value would replace the module's output)

    for name, module in model.model.layers[0].named_modules():
        if name:
            module.register_forward_pre_hook(entered(name))
            module.register_forward_hook(left)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            by_module[running[-1]] += storage.nbytes()
            total[0] += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model.model(input_ids=ids)  # the body only: the lm head runs in chunks (lit_grpo.core.chunked_head)
    return dict(by_module), total[0], config.num_hidden_layers


def kept_by_mode(shape: str, tokens: int, mode: object) -> tuple[int, int, float, int]:
    """Bytes alive after the body's forward, the peak through its backward, the seconds of both, and the layer
    count, under ``model.gradient_checkpointing: mode``."""
    import time

    import torch
    from make_random_model import SHAPES
    from transformers import AutoModelForCausalLM

    from lit_grpo.core.peak_memory import PeakLiveBytes
    from lit_grpo.models.checkpointing import enable_checkpointing

    torch.manual_seed(0)
    config = SHAPES[shape]()
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).float().train()
    enable_checkpointing(model, mode)
    ids = torch.randint(0, config.vocab_size, (1, tokens))
    start = time.perf_counter()
    with PeakLiveBytes() as meter:
        hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state
        kept = meter.live
        hidden.pow(2).mean().backward()  # the body's backward; the head is measured by head_memory.py
    return kept, meter.peak, time.perf_counter() - start, config.num_hidden_layers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="smol135", help="make_random_model.py's shape: smol135, qwen05, qwen05-152k")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--checkpointing", action="store_true",
                        help="compare model.gradient_checkpointing false, true and selective over the whole body")
    args = parser.parse_args(argv)
    if args.tokens < 1:
        parser.error(f"--tokens must be >= 1, got {args.tokens}")
    if args.checkpointing:
        print(f"{args.shape}, {args.tokens} tokens, the body's forward and backward by gradient_checkpointing")
        print(f"  {'mode':10s} {'kept KiB/token/layer':>21s} {'kept MiB':>9s} {'peak MiB':>9s} {'seconds':>8s}")
        for mode in (False, True, "selective"):
            kept, peak, seconds, layers = kept_by_mode(args.shape, args.tokens, mode)
            print(f"  {str(mode).lower():10s} {kept / args.tokens / layers / 1024:21.2f} {kept / 2**20:9.1f} "
                  f"{peak / 2**20:9.1f} {seconds:8.2f}")
        return
    by_module, total, layers = saved_by_module(args.shape, args.tokens)
    layer = {k: v for k, v in by_module.items() if k != "(outside layer 0)"}
    layer_bytes = sum(layer.values())
    print(f"{args.shape}, {args.tokens} tokens: KiB saved per token by layer 0's modules")
    for name, nbytes in sorted(layer.items(), key=lambda kv: -kv[1]):
        print(f"  {name:32s} {nbytes / args.tokens / 1024:7.2f}  ({nbytes / layer_bytes:5.1%})")
    print(f"  {'layer 0':32s} {layer_bytes / args.tokens / 1024:7.2f}")
    print(f"  the body's mean per layer        {total / layers / args.tokens / 1024:7.2f} "
          f"(all {layers} layers and the embedding)")


if __name__ == "__main__":
    main()
