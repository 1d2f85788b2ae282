"""Every weight push to ``vllm serve`` checked against what the server holds after it
(``engine_options.verify_pushes``).

vLLM 0.32's ``POST /weight_checker {"action": "checksum"}`` answers a SHA-256 of every parameter as the server holds it,
keyed ``dp0:pp0:pcp0:tp0:<name>``. Most of them cannot be compared with what the trainer sent: vLLM fuses the attention
and MLP input projections, repacks linear layers for its CPU kernels and pads the embedding. Two checks need no layout:

- **held as sent.** A pushed tensor the server keeps under the same name in the same layout (the norms on every
  backend) has the trainer's SHA-256. Which names those are is learnt at the first push a server verifies (after the
  first push of the run, or after it rejoined): at least one must match then, and every one of them must match after
  every later push. A push whose tensors never reached the sampler leaves the old bytes there and fails it.
- **moved with the policy.** At the first push after which every pushed tensor has changed since the push before (the
  trainer's ``lit_grpo.wire.push_digest.tensor_digest``, a sample of each tensor; a full fine-tuning step moves every
  one), the server's parameters that changed are learnt; after every later such push each of them must have changed
  again. One that kept its bytes was left out by the load (a name the loader skipped, a layer put aside and restored).
  When some pushed tensor did not change (frozen layers, a LoRA base between merges) this check is skipped: which
  served parameters derive from it is not known. The served parameters that did not change when the set was learnt
  are reported once (``PushCheck.stale``): a load that skips them on every push. (On a CPU, vLLM packs each linear
  layer's weight for its kernels and empties the parameter: those are left out of both checks.)

The trainer's side costs a digest of each tensor as it is sent (about 11 ms for 108M float32 parameters); the server's
side hashes its whole model (timed in ``tests/test_vllm_push_check.py``). Pure logic: ``check_push`` takes the two
records and returns the state the next push is checked against, or raises ``PushNotApplied`` with one line.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch

from lit_grpo.wire.protocol import ServerError
from lit_grpo.wire.push_digest import READ_WHOLE, tensor_digest

#: what vLLM puts before each parameter's name (its data, pipeline, context and tensor parallel ranks)
SERVED_PREFIX = re.compile(r"^(?:[a-z]+\d+:)+")
#: the digest of no bytes: a parameter vLLM emptied after packing its weight for its CPU kernels (``remove_weight``)
EMPTY = hashlib.sha256(b"").hexdigest()
#: how many names a failure line shows
SHOWN = 3


class PushNotApplied(ServerError):
    """A push the server reports as done, but whose weights it does not hold."""


def sha256(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes, as ``/weight_checker`` computes it (vLLM's ``compute_tensor_digests``)."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


@dataclass
class SentRecord:
    """What one push sent, recorded as it goes out (rank 0, in the wire dtype): the SHA-256 of each tensor small
    enough to be a norm or a bias (at most ``READ_WHOLE`` elements; the only ones vLLM may keep as sent on every
    backend), and every tensor's sampled digest."""

    exact: dict[str, str] = field(default_factory=dict)
    sampled: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if tensor.numel() <= READ_WHOLE:
            self.exact[name] = sha256(tensor)
        self.sampled[name] = tensor_digest(tensor)


@dataclass(frozen=True)
class PushCheck:
    """What the next push to one server is checked against: the names it holds as sent, its digests and what was
    sent, both from the last verified push."""

    held_as_sent: frozenset[str]
    served: dict[str, frozenset[str]]
    sent: dict[str, int]
    #: the served parameters that move with the policy; None until a push moved every pushed tensor
    moves: frozenset[str] | None = None
    #: the served parameters that did not move at the push that learnt ``moves``; empty after that push
    stale: tuple[str, ...] = ()


def checksums_of(url: str, answer: object) -> dict[str, str]:
    """The ``checksums`` mapping of a ``/weight_checker`` answer, or one line naming the server and what it answered
    (a server without vLLM 0.32's weight checker, or a proxy in front of it)."""
    checksums = answer.get("checksums") if isinstance(answer, dict) else None
    if not isinstance(checksums, dict) or not checksums:
        shown = repr(answer)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise ServerError(f"rollout server {url}: POST /weight_checker answered {shown}, expected "
                          "{'checksums': {name: sha256, ...}} (vLLM >= 0.32; engine_options.verify_pushes: false "
                          "turns this check off)")
    return checksums


def served_digests(checksums: dict[str, str]) -> dict[str, frozenset[str]]:
    """``/weight_checker``'s answer by parameter name: the digests of its ranks' copies (one per tensor parallel
    shard; a replicated norm has one). Empty parameters are left out: on a CPU vLLM packs each linear layer's weight
    for its kernels and empties the parameter, so there is nothing of them to check."""
    by_name: dict[str, set[str]] = {}
    for key, digest in checksums.items():
        if digest == EMPTY:
            continue
        by_name.setdefault(SERVED_PREFIX.sub("", key), set()).add(digest)
    return {name: frozenset(digests) for name, digests in by_name.items()}


def _names(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:SHOWN])
    return shown + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")


def check_push(url: str, step: int, sent: SentRecord, served: dict[str, frozenset[str]],
               previous: PushCheck | None) -> PushCheck:
    """Check the push of ``step`` to the server at ``url`` (see the module's docstring) and return the state the next
    push is checked against. ``previous``: that state, or None for the first push this server is verified at."""
    held = {name for name, digest in sent.exact.items() if served.get(name) == frozenset({digest})}
    advice = "(engine_options.verify_pushes: false turns this check off)"
    if previous is None:
        if not held:
            raise PushNotApplied(
                f"rollout server {url}: after the push of step {step} it holds none of the {len(sent.exact)} small "
                f"pushed tensors as they were sent (e.g. {_names(list(sent.exact))}): the push did not take effect, "
                f"or the served model is not the policy's architecture and dtype {advice}")
        return PushCheck(frozenset(held), served, dict(sent.sampled))
    lost = sorted(previous.held_as_sent - held)
    if lost:
        raise PushNotApplied(
            f"rollout server {url}: the push of step {step} did not take effect: {len(lost)} of "
            f"{len(previous.held_as_sent)} parameters it held as pushed before differ from what was pushed now "
            f"({_names(lost)}) {advice}")
    moved = sent.sampled.keys() == previous.sent.keys() and all(
        digest != previous.sent[name] for name, digest in sent.sampled.items())
    if not moved:
        return PushCheck(previous.held_as_sent, served, dict(sent.sampled), previous.moves)
    changed = frozenset(name for name, digests in served.items() if previous.served.get(name) != digests)
    if previous.moves is None:
        stale = tuple(sorted(served.keys() - changed))
        return PushCheck(previous.held_as_sent, served, dict(sent.sampled), changed, stale)
    kept = sorted(previous.moves - changed)
    if kept:
        raise PushNotApplied(
            f"rollout server {url}: the push of step {step} did not take effect in full: {len(kept)} of "
            f"{len(previous.moves)} served parameters that moved with the policy kept the previous push's bytes "
            f"although every pushed tensor changed ({_names(kept)}) {advice}")
    return PushCheck(previous.held_as_sent, served, dict(sent.sampled), previous.moves)


def stale_warning(url: str, stale: tuple[str, ...]) -> str:
    """The one report of the served parameters a push that moved every pushed tensor left unchanged."""
    return (f"rollout server {url}: {len(stale)} served parameters did not change although every pushed tensor did "
            f"({_names(list(stale))}): the server's load may leave them out; later pushes are checked on the others "
            "only")


__all__ = ["PushCheck", "PushNotApplied", "SentRecord", "check_push", "served_digests", "sha256",
           "stale_warning"]
