"""Back ends of the server's LoRA delta ``scaling * B @ (A @ h)``: in the clear, or under CKKS.

The privacy of the hidden state in split mode comes from the client's clipping and Gaussian noise
(:class:`~gaussdp.inference.HiddenStatePrivatizer`), never from the back end: whoever decrypts the
CKKS result sees ``A @ h_noised``, which is post-processing of the noised state. CKKS (the private inference
server's HE-LoRA) only keeps the server from seeing ``h_noised`` itself while it computes.

:class:`CKKSLoRABackend` holds the secret key in the process that computes (a demonstration and a
baseline). For a real split across the wire, where the server never holds the secret key and
computes the whole delta on ciphertext (packed, about 15x faster), use :mod:`gaussdp.inference.ckks`.

Measured on the shared 2-core CPU of this project (``benchmarks/bench_inference.py``): one product of
an encrypted 1536-vector by a plaintext 1536x32 matrix takes about 3.6 s as 32 ``dot`` products and
about 94 s with TenSEAL's ``matmul`` (26x slower), against about 10 microseconds in the clear.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from gaussdp._extras import require_extra
from gaussdp._validate import check_choice
from gaussdp.errors import InvalidParameter, UnsafeInput

__all__ = ["CKKSLoRABackend", "LoRABackend", "PlainLoRABackend"]


@runtime_checkable
class LoRABackend(Protocol):
    """Computes a LoRA delta ``scaling * H @ A.T @ B.T`` for rows ``H`` (n, d); A (r, d), B (d_out, r)."""

    name: str

    def delta(self, h: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float) -> np.ndarray: ...


class PlainLoRABackend:
    """The delta in the clear, in float64 numpy (the server sees the noised vectors anyway)."""

    name = "plain"

    def delta(self, h: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float) -> np.ndarray:
        return scaling * ((h @ A.T) @ B.T)


class CKKSLoRABackend:
    """``A @ h`` on a CKKS ciphertext of ``h`` (TenSEAL), then ``scaling * B @ u`` on the decryption.

    Each row is encrypted (:meth:`encrypt`, client side), multiplied by the plaintext ``A``
    (:meth:`project`, server side: ``method="dot"``, one ciphertext per LoRA rank, or ``"matmul"``,
    one ciphertext, far slower), decrypted (:meth:`decrypt`, by the secret-key holder), and the
    up-projection ``B`` is applied in the clear. CKKS is approximate: results carry errors around
    1e-6 relative to the scale of ``A @ h``.

    Args:
        context: a TenSEAL CKKS context with galois keys; a new one (with its secret key) when None.
        method: ``"dot"`` (default) or ``"matmul"``.
        poly_modulus_degree, coeff_mod_bit_sizes, scale_bits: parameters of a new context; a vector
            of at most ``poly_modulus_degree / 2`` values fits in one ciphertext.

    Raises:
        ImportError: tenseal is not installed.
        InvalidParameter: unknown method; a hidden size above the ciphertext's slots.
    """

    name = "ckks"

    def __init__(
        self,
        *,
        context: Any = None,
        method: Literal["dot", "matmul"] = "dot",
        poly_modulus_degree: int = 8192,
        coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60),
        scale_bits: int = 40,
    ) -> None:
        require_extra("he", feature="CKKSLoRABackend")
        import tenseal as ts

        check_choice("method", method, ("dot", "matmul"))
        self.method = method
        if context is None:
            context = ts.context(
                ts.SCHEME_TYPE.CKKS,
                poly_modulus_degree=poly_modulus_degree,
                coeff_mod_bit_sizes=list(coeff_mod_bit_sizes),
            )
            context.global_scale = 2.0**scale_bits
            context.generate_galois_keys()
            self.slots = poly_modulus_degree // 2
        else:
            self.slots = context.seal_context().first_context_data().parms().poly_modulus_degree() // 2
        self.context = context

    def encrypt(self, row: np.ndarray) -> Any:
        """Client side: a CKKS ciphertext of one hidden-state row."""
        import tenseal as ts

        if row.ndim != 1 or row.size > self.slots:
            raise InvalidParameter(f"a row of {row.size} values does not fit {self.slots} CKKS slots")
        return ts.ckks_vector(self.context, np.asarray(row, dtype=np.float64).tolist())

    def project(self, ciphertext: Any, A: np.ndarray) -> Any:
        """Server side: ``A @ h`` on the ciphertext, with ``A`` (r, d) in the clear."""
        if self.method == "dot":
            return [ciphertext.dot(a.tolist()) for a in A]
        return ciphertext.matmul(A.T.tolist())

    def decrypt(self, projected: Any, rank: int) -> np.ndarray:
        """Secret-key holder: the r values of ``A @ h``."""
        if self.method == "dot":
            return np.array([c.decrypt()[0] for c in projected], dtype=np.float64)
        return np.asarray(projected.decrypt()[:rank], dtype=np.float64)

    def delta(self, h: np.ndarray, A: np.ndarray, B: np.ndarray, scaling: float) -> np.ndarray:
        rows = []
        for row in h:
            u = self.decrypt(self.project(self.encrypt(row), A), A.shape[0])
            if not np.isfinite(u).all():
                raise UnsafeInput("CKKS decryption returned NaN or Inf (parameters too small?)")
            rows.append(scaling * (B @ u))
        return np.stack(rows)
