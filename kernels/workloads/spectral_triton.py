"""The Fourier neural operator's spectral multiply in one launch: out[b, o, x, y] = sum_i a[b, i, x, y] * w[i, o, x, y]
over the kept modes, complex numbers given as their real views (``torch.view_as_real``: a trailing axis of 2,
real then imaginary, float32).

torch writes it as a broadcast complex product [B, I, O, X, Y] summed over i (engine/workloads/fno.py), which
materialises the whole product before reducing it. Here each program owns a tile of modes and a tile of output
channels of one batch entry, walks the input channels in order (i = 0, 1, ...) and keeps the real and imaginary
sums in float32 registers, so only the [B, O, X, Y] result is written. The order of the sum is fixed: every run,
batch size and batch position gives the same bits.

Strides are taken as given, so a slice of rfft2's output (the kept corner of the spectrum) is read in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # modes (x, y flattened) per program
MAX_BLOCK_O = 32  # output channels per program, at most


@triton.jit
def _spectral_mul_kernel(a_ptr, w_ptr, out_ptr, O, M, Y,
                         sab, sai, sax, say, sac, swi, swo, swx, swy, swc, sob, soo, sox, soy, soc,
                         I: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr):
    # I (input channels) is a compile-time constant: a model has one or two widths, and Triton's CPU interpreter
    # cannot loop over a runtime scalar argument under numpy 2.4
    pid_m, pid_o, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened modes
    o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)  # [BLOCK_O]
    m_in, o_in = m < M, o < O
    x, y = m // Y, m % Y
    a_off = b * sab + x * sax + y * say  # [BLOCK_M]
    w_off = o[:, None] * swo + (x * swx + y * swy)[None, :]  # [BLOCK_O, BLOCK_M]
    w_mask = o_in[:, None] & m_in[None, :]
    acc_r = tl.zeros((BLOCK_O, BLOCK_M), dtype=tl.float32)
    acc_i = tl.zeros((BLOCK_O, BLOCK_M), dtype=tl.float32)
    for i in range(I):  # input channels in order: the sum's fixed order
        ar = tl.load(a_ptr + a_off + i * sai, mask=m_in, other=0.0)[None, :]
        ai = tl.load(a_ptr + a_off + i * sai + sac, mask=m_in, other=0.0)[None, :]
        wr = tl.load(w_ptr + w_off + i * swi, mask=w_mask, other=0.0)
        wi = tl.load(w_ptr + w_off + i * swi + swc, mask=w_mask, other=0.0)
        acc_r += ar * wr - ai * wi
        acc_i += ar * wi + ai * wr
    out_off = b * sob + o[:, None] * soo + (x * sox + y * soy)[None, :]
    tl.store(out_ptr + out_off, acc_r, mask=w_mask)
    tl.store(out_ptr + out_off + soc, acc_i, mask=w_mask)


def _check(a: torch.Tensor, w: torch.Tensor) -> None:
    """a: [B, I, X, Y, 2], w: [I, O, X, Y, 2], both float32 real views of complex tensors, on one device."""
    if a.dim() != 5 or a.shape[-1] != 2 or w.dim() != 5 or w.shape[-1] != 2:
        raise ValueError(f"spectral_mul takes real views (torch.view_as_real) a [B, I, X, Y, 2] and w [I, O, X, Y, 2], "
                         f"got {list(a.shape)} and {list(w.shape)}")
    if a.shape[1] != w.shape[0] or a.shape[2:4] != w.shape[2:4]:
        raise ValueError(f"spectral_mul: a's input channels and modes {list(a.shape[1:4])} must match w's "
                         f"[{w.shape[0]}, {w.shape[2]}, {w.shape[3]}] (a {list(a.shape)}, w {list(w.shape)})")
    if a.dtype != torch.float32 or w.dtype != torch.float32:
        raise ValueError(f"spectral_mul takes float32 real views (complex64), got {a.dtype} and {w.dtype}")
    if a.device != w.device:
        raise ValueError(f"spectral_mul: a on {a.device} and w on {w.device}")


def spectral_mul_ref(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The FNO paper's einsum "bixy,ioxy->boxy" on the complex numbers behind ``a`` [B, I, X, Y, 2] and ``w``
    [I, O, X, Y, 2]; returns the real view [B, O, X, Y, 2] (float32)."""
    _check(a, w)
    out = torch.einsum("bixy,ioxy->boxy", torch.view_as_complex(a.contiguous()), torch.view_as_complex(w.contiguous()))
    return torch.view_as_real(out)


def spectral_mul(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``spectral_mul_ref`` in one Triton launch (module docstring): a [B, I, X, Y, 2] and w [I, O, X, Y, 2] real
    views of complex64 tensors in any strides -> a new contiguous [B, O, X, Y, 2] float32."""
    _check(a, w)
    b, i, x, y, _ = a.shape
    o = w.shape[1]
    out = torch.empty(b, o, x, y, 2, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out
    if i == 0:
        return out.zero_()
    block_o = min(MAX_BLOCK_O, triton.next_power_of_2(o))
    grid = (triton.cdiv(x * y, BLOCK_M), triton.cdiv(o, block_o), b)
    _spectral_mul_kernel[grid](a, w, out, o, x * y, y, *a.stride(), *w.stride(), *out.stride(), I=i,
                               BLOCK_M=BLOCK_M, BLOCK_O=block_o, num_warps=4)
    return out
