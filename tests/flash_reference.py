"""flash-attn's variable-length kernel, written out in float32 for a CPU: the same signature and semantics as
``flash_attn.flash_attn_varlen_func`` (2.1 and later), so the project's flash paths run here through transformers'
own ``_flash_attention_forward``. Nothing of the project is used: each sequence's scores, softcap, causal mask
(aligned to the bottom right: query ``i`` of ``Lq`` sees key ``j`` of ``Lk`` iff ``j <= i + Lk - Lq``), window
(``window_size = (left, right)`` around that diagonal, -1 for none) and softmax, one sequence at a time."""

from __future__ import annotations

import pytest
import torch


def varlen_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int | None = None, max_seqlen_k: int | None = None,
                     dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
                     window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                     deterministic: bool = False) -> torch.Tensor:
    """``q [total_q, H, D]``, ``k``/``v [total_k, H', D]`` (H a multiple of H'): ``[total_q, H, D]``."""
    if dropout_p:
        raise NotImplementedError("the reference runs no attention dropout")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    outputs = []
    for s in range(cu_seqlens_q.numel() - 1):
        qs = q[cu_seqlens_q[s]:cu_seqlens_q[s + 1]].float().transpose(0, 1)  # [H, Lq, D]
        ks = k[cu_seqlens_k[s]:cu_seqlens_k[s + 1]].float().transpose(0, 1)
        vs = v[cu_seqlens_k[s]:cu_seqlens_k[s + 1]].float().transpose(0, 1)
        repeat = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(repeat, 0), vs.repeat_interleave(repeat, 0)
        scores = qs @ ks.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        lq, lk = qs.shape[1], ks.shape[1]
        diagonal = torch.arange(lq)[:, None] + (lk - lq)  # the key each query is aligned with
        j = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= j <= diagonal
        left, right = window_size
        if left >= 0:
            allowed &= j >= diagonal - left
        if right >= 0:
            allowed &= j <= diagonal + right
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        outputs.append((probs @ vs).transpose(0, 1).to(q.dtype))
    return torch.cat(outputs)


def batched_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: object) -> torch.Tensor:
    """``flash_attn_func``: ``q [B, Lq, H, D]`` against ``k``/``v [B, Lk, H', D]``, each row its own sequence."""
    batch, lq, lk = q.shape[0], q.shape[1], k.shape[1]
    cu = lambda length: torch.arange(batch + 1, dtype=torch.int32) * length  # noqa: E731
    out = varlen_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(lq), cu(lk), **kwargs)
    return out.view(batch, lq, *out.shape[1:])


def serve_flash_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """transformers' flash path with the references above as its kernels (under every flash name: the import is
    replaced); the list collects each varlen call's sequence and key counts."""
    from transformers import modeling_flash_attention_utils as fa

    calls: list[dict] = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):  # noqa: ANN001, ANN202 - flash-attn's signature
        calls.append({"sequences": cu_seqlens_q.numel() - 1, "keys": k.shape[0], "queries": q.shape[0], **kwargs})
        return varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs)

    imports = ((batched_reference, varlen, None, fa._pad_input, fa._unpad_input),
               (fa._lazy_define_process_function(varlen_reference), dict))
    monkeypatch.setattr(fa, "lazy_import_flash_attention", lambda implementation, *args, **kwargs: imports)
    return calls
