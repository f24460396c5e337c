"""CKKS split inference across the wire: the client keeps the secret key, the server computes blind.

The private inference server's split mode with an honest-but-curious server: the client clips and noises a
hidden state (:func:`gaussdp.inference.client_forward`), encrypts the noised rows under CKKS
(:class:`CKKSClient`) and sends the ciphertext; the server, which holds a LoRA adapter ``(A, B,
scaling)``, computes the whole delta ``scaling * B @ (A @ h)`` on the ciphertext
(:func:`ckks_lora_delta`) and returns a ciphertext that only the client can decrypt
(:meth:`CKKSClient.decrypt_delta`). The server sees neither ``h`` nor the delta; the client never
needs ``A`` or ``B``.

**What protects what.** The differential-privacy guarantee of the rows comes from the client's
clipping and noise, charged to the session for the ``sigma``/``clip_norm`` the client declares
(exactly as ``/lora-delta``); it holds even against a server that could decrypt. CKKS adds
confidentiality of the noised rows and of the delta against the server (IND-CPA security of RLWE at
the parameters below), assuming the server runs the protocol honestly. It does not hide the adapter
from the client beyond what the delta reveals (no circuit-privacy noise flooding), and it does not
protect against a server that returns a wrong answer.

**Keys.** :meth:`CKKSClient.public_context` serializes the encryption parameters and the Galois
(rotation) keys only: no secret key (it stays in the client's process) and no public or
relinearization key (the server never encrypts, and never multiplies two ciphertexts). The keys are
serialized seeded (half their size) and compressed, each rotation key on its own (so that a server
reads them one at a time: about 7 ms of SEAL work each, instead of one call of 50 to 120 ms that
holds Python's GIL): 12 power-of-two rotation keys take about 8.7 MB; ``CKKSClient(rank=r)`` makes
only the 9 that an adapter of rank ``r`` needs (about 6.6 MB at r=32). Loaded, each key takes
1.5 MiB of memory (SEAL keeps it unseeded).

**Packing** (one ciphertext of 4096 slots per row). The client encrypts the row ``h`` (zero-padded to
a period ``P``, a multiple of 256) repeated cyclically over all slots. The server computes ``u = A h``
with the diagonal method of Halevi and Shoup for a wide ``r x P`` matrix (``r`` padded to a power of
two): ``z = sum_i D_i * rot(c, i)`` with extended diagonals ``D_i[j] = A[j mod r, (j + i) mod P]``,
evaluated baby-step/giant-step (``i = k g + b``: ``g - 1`` rotations of the input, ``r/g - 1`` of the
partial sums), then sums ``z`` over the whole ring with steps ``r, 2r, ..., slots/2``, which leaves
``u[j mod r]`` in EVERY slot ``j``: exactly the replicated layout the second product needs. The
delta ``v = scaling * B u`` is then the diagonal method for a tall ``d_out x r`` matrix, again
baby-step/giant-step, with no final sum. Two plaintext multiplications (depth 2), each followed by a
rescale whose prime is the encoding scale of the matrix, so the result has exactly the input's
scale. At d=1536, r=32 (g=4 in both products): 3 rotations at the top level, 17 one level down
(7 giant steps, 7 for the ring sum, 3 baby steps), 7 two levels down; 64 plaintext products.
Measured (``benchmarks/bench_inference.py``, shared 2-core CPU): about 0.15 s per token from
encryption to decryption (0.06 s of server CPU), against 2.3 s for :class:`CKKSLoRABackend`;
relative error about 1e-8 against the plaintext delta.

**Fail closed.** One parameter set (a client cannot choose a costlier ring); every SEAL object is
bounded, from its zstd block headers, in what it decompresses to before SEAL reads it (no
decompression bombs); a ciphertext must be a fresh encryption at the top level and the encoding
scale; result values must stay below :data:`VALUE_LIMIT` (``2^13``) in magnitude, or they wrap
around silently: :meth:`CKKSLoRAPlan.check_range` refuses a declared noise that could get there.

References:
    Halevi and Shoup, "Algorithms in HElib", CRYPTO 2014, Section 4.3 (diagonal method) and Section
    4.4 / "Faster homomorphic linear transformations in HElib", CRYPTO 2018 (baby-step/giant-step).
    Albrecht et al., "Homomorphic Encryption Security Standard", HomomorphicEncryption.org, 2018,
    Table 1 (uniform/ternary secret, classical 128-bit security): n=8192 allows log2(q) <= 218.
    Cheon, Kim, Kim and Song, "Homomorphic encryption for arithmetic of approximate numbers",
    ASIACRYPT 2017 (CKKS).
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import Any

import numpy as np

from gaussdp._extras import require_extra
from gaussdp.errors import InvalidParameter, UnsafeInput
from gaussdp.inference._ckks_wire import CT_MAGIC as _CT_MAGIC
from gaussdp.inference._ckks_wire import CTX_MAGIC as _CTX_MAGIC
from gaussdp.inference._ckks_wire import MAX_CIPHERTEXT_BYTES as _MAX_CIPHERTEXT_BYTES
from gaussdp.inference._ckks_wire import MAX_KEY_BYTES as _MAX_KEY_BYTES
from gaussdp.inference._ckks_wire import MAX_PARMS_BYTES as _MAX_PARMS_BYTES
from gaussdp.inference._ckks_wire import OLD_CTX_MAGIC as _OLD_CTX_MAGIC
from gaussdp.inference._ckks_wire import frame as _frame
from gaussdp.inference._ckks_wire import load as _load
from gaussdp.inference._ckks_wire import save as _save
from gaussdp.inference._ckks_wire import unframe as _unframe

__all__ = [
    "COEFF_MOD_BIT_SIZES",
    "MAX_HIDDEN",
    "MAX_RANK",
    "POLY_MODULUS_DEGREE",
    "SCALE_BITS",
    "SLOTS",
    "VALUE_LIMIT",
    "CKKSClient",
    "CKKSLoRAPlan",
    "CKKSPublicContext",
    "ckks_lora_delta",
    "rotation_steps_for",
]

# One parameter set, fixed for client and server: a server never runs a computation whose cost a
# client chose. 60 + 45 + 45 + 60 = 210 bits <= 218, the HE standard's bound for n = 8192 at
# 128-bit classical security (Albrecht et al. 2018, Table 1); SEAL checks it again (TC128).
# The 60-bit first prime holds the result: values up to VALUE_LIMIT = 2^13 = 8192 in magnitude at
# scale 2^45 (larger ones may wrap around). The two 45-bit primes are dropped by the two
# rescales; the last 60-bit prime is the key-switching special prime. Scale 2^45 rather than
# 2^40: the ring sum adds the noise of slots/r slots into each result, and 2^40 left errors near
# 1e-4 relative at rank 1.
POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 45, 45, 60)
SCALE_BITS = 45
SLOTS = POLY_MODULUS_DEGREE // 2
# Result values below this in magnitude decrypt correctly: the encoded polynomial's coefficients are
# at most scale * max|value| (then < 2^58, half the 60-bit prime's q/2: room for the noise).
VALUE_LIMIT = 2.0 ** (COEFF_MOD_BIT_SIZES[0] - SCALE_BITS - 2)
_BLOCK = 256  # the client's period P is a multiple of this; ranks (padded) must divide it
MAX_RANK = _BLOCK
MAX_HIDDEN = SLOTS - _BLOCK  # P + r_pad <= SLOTS for the shifted reads of the first product
MAX_ROWS = 64  # ciphertexts in one message (each about 177 kB in, 131 kB out)

_MAX_GALOIS_KEYS = 2 * 12  # every power-of-two step in both directions, at most
# every step a key may be for: the powers of two, both directions (SLOTS - k is a right rotation)
_ALL_STEPS = tuple(sorted({1 << i for i in range(12)} | {SLOTS - (1 << i) for i in range(12)}))


def _sealapi() -> Any:
    require_extra("he", feature="gaussdp.inference.ckks")
    import tenseal.sealapi as sealapi

    return sealapi


def _parms() -> Any:
    s = _sealapi()
    parms = s.EncryptionParameters(s.SCHEME_TYPE.CKKS)
    parms.set_poly_modulus_degree(POLY_MODULUS_DEGREE)
    parms.set_coeff_modulus(s.CoeffModulus.Create(POLY_MODULUS_DEGREE, list(COEFF_MOD_BIT_SIZES)))
    return parms


def _seal_context(parms: Any = None) -> Any:
    s = _sealapi()
    ctx = s.SEALContext(_parms() if parms is None else parms, True, s.SEC_LEVEL_TYPE.TC128)
    if not ctx.parameters_set():
        raise InvalidParameter(f"CKKS parameters refused by SEAL: {ctx.parameters_error_message()}")
    return ctx


@functools.lru_cache(maxsize=1)
def _shared_seal_context() -> Any:
    """One SEAL context of the fixed parameters for every loaded public context of this process
    (it is read-only once built): about 6 MB of tables and 10 ms saved per context."""
    return _seal_context()


def _galois_elt(step: int) -> int:
    # SEAL's GaloisTool::get_elt_from_step for CKKS: a left rotation by `step` slots is the
    # automorphism X -> X^(3^step mod 2N).
    return pow(3, step % SLOTS, 2 * POLY_MODULUS_DEGREE)


def _period(d: int) -> int:
    return _BLOCK * math.ceil(d / _BLOCK)


def _pad_rank(r: int) -> int:
    return 1 << max(0, (r - 1).bit_length())


def _baby(r_pad: int, w_baby: float, w_giant: float) -> int:
    """The baby-step count g (a power of two) minimising the weighted rotations (g-1, r/g-1)."""
    best, best_cost = 1, math.inf
    g = 1
    while g <= r_pad:
        cost = w_baby * (g - 1) + w_giant * (r_pad // g - 1)
        if cost < best_cost:
            best, best_cost = g, cost
        g *= 2
    return best


# A rotation's key switching costs about (primes at its level) x (primes + 1): 3x4 at the top
# level, 2x3 after one rescale, 1x2 after two. Baby steps of the first product run at the top
# level, its giant steps and the ring sum one level down, the second product's giant steps two down.
def _schedule(r_pad: int) -> tuple[int, int]:
    return _baby(r_pad, 12.0, 6.0), _baby(r_pad, 6.0, 2.0)


def rotation_steps_for(rank: int | None = None) -> list[int]:
    """Rotation steps whose Galois keys :func:`ckks_lora_delta` needs for an adapter of ``rank``.

    ``None``: every power of two below the slot count (12 keys; enough for every rank up to
    :data:`MAX_RANK`).
    """
    if rank is None:
        return [1 << t for t in range(int(math.log2(SLOTS)))]
    if isinstance(rank, bool) or not isinstance(rank, int | np.integer) or not 1 <= rank <= MAX_RANK:
        raise InvalidParameter(f"rank must be an integer in [1, {MAX_RANK}], got rank={rank!r}")
    r_pad = _pad_rank(int(rank))
    g_a, g_b = _schedule(r_pad)
    steps = {1, g_a, g_b}
    step = r_pad
    while step < SLOTS:
        steps.add(step)
        step *= 2
    return sorted(s for s in steps if 0 < s < SLOTS)


class CKKSClient:
    """The client side: CKKS keys (the secret key never leaves this object), encryption, decryption.

    Args:
        rank: make only the rotation keys an adapter of this LoRA rank needs (smaller upload);
            ``None`` (default) makes every power-of-two rotation key, enough for any rank.

    Raises:
        ImportError: tenseal (extra ``he``) is not installed.
    """

    def __init__(self, *, rank: int | None = None) -> None:
        s = _sealapi()
        self._ctx = _seal_context()
        keygen = s.KeyGenerator(self._ctx)
        self._secret_key = keygen.secret_key()
        self._encoder = s.CKKSEncoder(self._ctx)
        self._encryptor = s.Encryptor(self._ctx, self._secret_key)
        self._decryptor = s.Decryptor(self._ctx, self._secret_key)
        self.rotation_steps = rotation_steps_for(rank)
        # one Galois key a part: the server loads them one by one (short SEAL calls)
        keys = [_save(keygen.create_galois_keys([_galois_elt(k)])) for k in self.rotation_steps]
        self._public = _frame(_CTX_MAGIC, (), [_save(_parms()), *keys])
        self.context_id = hashlib.sha256(self._public).hexdigest()

    def is_private(self) -> bool:
        """True: this object holds the secret key (and can decrypt)."""
        return True

    def public_context(self) -> bytes:
        """Parameters and rotation keys, WITHOUT the secret key: what the server receives once."""
        return self._public

    def encrypt(self, noised_rows: Any) -> bytes:
        """Encrypt already clipped-and-noised rows ``(n, d)`` (or one ``(d,)``): one ciphertext a row.

        Encrypting is no privacy mechanism: privatize the rows first (e.g. ``client_forward``).

        Raises:
            UnsafeInput: NaN/Inf, not 1-D/2-D, more than :data:`MAX_ROWS` rows, or ``d`` above
                :data:`MAX_HIDDEN`.
        """
        h = np.asarray(
            noised_rows.detach().cpu().double().numpy() if hasattr(noised_rows, "detach") else noised_rows,
            dtype=np.float64,
        )
        if h.ndim == 1:
            h = h[None, :]
        if h.ndim != 2 or h.shape[0] < 1 or h.shape[1] < 1:
            raise UnsafeInput(f"noised_rows must be (rows, d) or (d,), got shape {h.shape}")
        n, d = h.shape
        if n > MAX_ROWS:
            raise UnsafeInput(f"noised_rows has {n} rows; at most {MAX_ROWS} per message")
        if d > MAX_HIDDEN:
            raise UnsafeInput(f"noised_rows has {d} columns; CKKS packing takes at most {MAX_HIDDEN}")
        if not np.isfinite(h).all():
            raise UnsafeInput("noised_rows contains NaN or Inf")
        s = _sealapi()
        parts = []
        period = _period(d)
        for row in h:
            padded = np.zeros(period)
            padded[:d] = row
            pt = s.Plaintext()
            self._encoder.encode(np.resize(padded, SLOTS).tolist(), 2.0**SCALE_BITS, pt)
            # Symmetric encryption with the secret key: SEAL then serializes the ciphertext's
            # uniformly random half as a seed (half the size); its security is the same RLWE.
            parts.append(_save(self._encryptor.encrypt_symmetric(pt)))
        return _frame(_CT_MAGIC, (d,), parts)

    def decrypt_delta(self, ciphertext: bytes, *, rows: int | None = None) -> np.ndarray:
        """Decrypt the server's answer: the delta rows ``(n, d_out)`` in float64.

        Raises:
            UnsafeInput: not an answer of :func:`ckks_lora_delta` under these keys, a row count
                other than ``rows``, or a decryption that is not finite.
        """
        s = _sealapi()
        (d_out,), parts = _unframe("ciphertext", _CT_MAGIC, 1, ciphertext, MAX_ROWS)
        if rows is not None and len(parts) != rows:
            raise UnsafeInput(f"ciphertext holds {len(parts)} rows, expected rows={rows}")
        if not 1 <= d_out <= SLOTS:
            raise UnsafeInput(f"ciphertext: d_out={d_out} out of range")
        out = np.empty((len(parts), d_out))
        for i, part in enumerate(parts):
            ct = s.Ciphertext()
            try:
                _load(ct, part, self._ctx, name=f"ciphertext row {i}", max_bytes=_MAX_CIPHERTEXT_BYTES)
            except (RuntimeError, ValueError) as exc:
                raise UnsafeInput(f"ciphertext row {i} is not a ciphertext for these keys: {exc}") from None
            pt = s.Plaintext()
            self._decryptor.decrypt(ct, pt)
            out[i] = np.asarray(self._encoder.decode_double(pt)[:d_out])
        if not np.isfinite(out).all():
            raise UnsafeInput("decrypted delta contains NaN or Inf")
        return out


class CKKSPublicContext:
    """The server side of the keys: parameters and rotation keys, loaded from a client's bytes.

    It holds no secret key: nothing that is loaded from the bytes can decrypt (the format has no
    place for one). Loading checks the parameters are exactly this module's (a client cannot make
    the server run a larger computation) and that SEAL accepts the keys for them.

    Raises:
        UnsafeInput: malformed bytes, other parameters, or keys SEAL refuses.
    """

    def __init__(self, data: bytes, *, between_keys: Any = None) -> None:
        s = _sealapi()
        if bytes(data[: len(_OLD_CTX_MAGIC)]) == _OLD_CTX_MAGIC:
            raise UnsafeInput(
                "public context: the format of an older gaussdp (all rotation keys in one part); make "
                "it again with this version's CKKSClient"
            )
        _, parts = _unframe("public context", _CTX_MAGIC, 0, data, 1 + _MAX_GALOIS_KEYS)
        if len(parts) < 2:
            raise UnsafeInput("public context: expected parameters and rotation keys")
        parms = s.EncryptionParameters(s.SCHEME_TYPE.CKKS)
        try:
            _load(parms, parts[0], name="public context parameters", max_bytes=_MAX_PARMS_BYTES)
        except (RuntimeError, ValueError) as exc:
            raise UnsafeInput(f"public context: unreadable parameters: {exc}") from None
        ours = _parms()
        if (
            parms.scheme() != ours.scheme()
            or parms.poly_modulus_degree() != ours.poly_modulus_degree()
            or [m.value() for m in parms.coeff_modulus()] != [m.value() for m in ours.coeff_modulus()]
        ):
            raise UnsafeInput(
                "public context: CKKS parameters other than gaussdp's "
                f"(poly_modulus_degree={POLY_MODULUS_DEGREE}, "
                f"coeff_mod_bit_sizes={list(COEFF_MOD_BIT_SIZES)})"
            )
        self.seal_context = _shared_seal_context()  # the parameters are ours (checked above)
        self.galois_keys = RotationKeys()
        for i, part in enumerate(parts[1:]):
            if between_keys is not None:
                between_keys()  # e.g. the service's CPU limit
            key = s.GaloisKeys()
            try:
                _load(key, part, self.seal_context, name=f"rotation key {i}", max_bytes=_MAX_KEY_BYTES)
            except (RuntimeError, ValueError) as exc:
                raise UnsafeInput(f"public context: rotation key {i} refused: {exc}") from None
            self.galois_keys.add(key, name=f"public context: rotation key {i}")
        self.context_id = hashlib.sha256(bytes(data)).hexdigest()
        self.nbytes = len(data)

    def is_private(self) -> bool:
        """False: no secret key was, or could be, loaded."""
        return False

    def has_rotation(self, step: int) -> bool:
        return self.galois_keys.has_key(_galois_elt(step))


class RotationKeys:
    """The Galois keys of a public context, one SEAL ``GaloisKeys`` per rotation step (as they are
    sent and loaded: one at a time)."""

    def __init__(self) -> None:
        self._by_elt: dict[int, Any] = {}

    def add(self, key: Any, *, name: str) -> None:
        elts = [e for e in (_galois_elt(k) for k in _ALL_STEPS) if key.has_key(e)]
        if key.size() != 1 or len(elts) != 1:
            raise UnsafeInput(f"{name}: one rotation key of a power-of-two step expected, got {key.size()}")
        if elts[0] in self._by_elt:
            raise UnsafeInput(f"{name}: a rotation key sent twice")
        self._by_elt[elts[0]] = key

    def size(self) -> int:
        return len(self._by_elt)

    def has_key(self, elt: int) -> bool:
        return elt in self._by_elt

    def for_step(self, step: int) -> Any:
        """The ``GaloisKeys`` holding the key of a rotation by ``step`` slots."""
        try:
            return self._by_elt[_galois_elt(step)]
        except KeyError:
            raise UnsafeInput(f"public context: no rotation key for step {step}") from None


class CKKSLoRAPlan:
    """A LoRA adapter ``(A, B, scaling)`` prepared for :func:`ckks_lora_delta`: its diagonals,
    encoded once (they depend on the fixed parameters only, not on any client's keys).

    Memory: ``2 * r_pad`` plaintexts, about 0.33 MB each pair (11 MB at rank 32).

    Raises:
        UnsafeInput: shapes that do not match, NaN/Inf, rank above :data:`MAX_RANK`, hidden size
            above :data:`MAX_HIDDEN`, output size above :data:`SLOTS`.
    """

    def __init__(self, A: Any, B: Any, scaling: float = 1.0) -> None:
        s = _sealapi()
        a = np.asarray(A.detach().cpu().double().numpy() if hasattr(A, "detach") else A, dtype=np.float64)
        b = np.asarray(B.detach().cpu().double().numpy() if hasattr(B, "detach") else B, dtype=np.float64)
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise UnsafeInput(f"A {a.shape} and B {b.shape} are not a LoRA pair (A (r, d), B (d_out, r))")
        if not (np.isfinite(a).all() and np.isfinite(b).all() and math.isfinite(scaling)):
            raise UnsafeInput("A, B and scaling must be finite")
        r, d = a.shape
        d_out = b.shape[0]
        if r > MAX_RANK or d > MAX_HIDDEN or d_out > SLOTS:
            raise UnsafeInput(
                f"adapter rank {r}, hidden size {d}, output size {d_out}: CKKS packing takes rank <= "
                f"{MAX_RANK}, hidden size <= {MAX_HIDDEN}, output size <= {SLOTS}"
            )
        self.rank, self.d, self.d_out = r, d, d_out
        # |v_j| <= ||row j of scaling * B @ A|| * ||h||: what check_range bounds before computing
        self.max_row_norm = float(np.sqrt(((float(scaling) * b @ a) ** 2).sum(axis=1).max()))
        self.r_pad = r_pad = _pad_rank(r)
        self.period = period = _period(d)
        self.g_a, self.g_b = _schedule(r_pad)
        self.steps = rotation_steps_for(r)
        a_pad = np.zeros((r_pad, period))
        a_pad[:r, :d] = a
        b_pad = np.zeros((d_out, r_pad))
        b_pad[:, :r] = float(scaling) * b
        ctx = self._ctx = _seal_context()
        encoder = s.CKKSEncoder(ctx)
        top = ctx.first_context_data()
        mid = top.next_context_data()
        # Encoding scale = the prime the following rescale drops: the result keeps the input's scale.
        primes = [m.value() for m in top.parms().coeff_modulus()]
        self._scale_a, self._scale_b = float(primes[-1]), float(primes[-2])
        j = np.arange(period)
        jo = np.arange(d_out)
        self._diag_a: list[Any] = []
        for i in range(r_pad):
            diag = np.zeros(SLOTS)
            diag[:period] = a_pad[j % r_pad, (j + i) % period]
            k = i - i % self.g_a  # giant step k*g: pre-rotated right by k*g (rot(D, -kg))
            self._diag_a.append(self._encode(encoder, np.roll(diag, k), top.parms_id(), self._scale_a))
        self._diag_b: list[Any] = []
        for i in range(r_pad):
            diag = np.zeros(SLOTS)
            diag[:d_out] = b_pad[jo, (jo + i) % r_pad]
            k = i - i % self.g_b
            self._diag_b.append(self._encode(encoder, np.roll(diag, k), mid.parms_id(), self._scale_b))

    @staticmethod
    def _encode(encoder: Any, values: np.ndarray, parms_id: Any, scale: float) -> Any:
        pt = _sealapi().Plaintext()
        encoder.encode(values.tolist(), parms_id, scale, pt)
        return pt

    def _bsgs(self, ev: Any, gk: Any, c: Any, diags: list[Any], g: int) -> Any:
        """``sum_i diags[i] * rot(c, i)`` by baby-step/giant-step, each giant sum rescaled first."""
        s = _sealapi()
        babies = [c]
        for _ in range(1, g):
            nxt = s.Ciphertext()
            ev.rotate_vector(babies[-1], 1, gk.for_step(1), nxt)
            babies.append(nxt)
        giants = []
        for k in range(0, self.r_pad, g):
            acc = None
            for b in range(g):
                prod = s.Ciphertext()
                ev.multiply_plain(babies[b], diags[k + b], prod)
                if acc is None:
                    acc = prod
                else:
                    ev.add_inplace(acc, prod)
            ev.rescale_to_next_inplace(acc)
            giants.append(acc)
        # Horner in the giant step: S_0 + rot(S_1 + rot(S_2 + ..., g), g) needs only the key for g.
        out = giants[-1]
        for acc in reversed(giants[:-1]):
            rotated = s.Ciphertext()
            ev.rotate_vector(out, g, gk.for_step(g), rotated)
            ev.add_inplace(acc, rotated)
            out = acc
        return out

    def check_range(self, *, clip_norm: float, sigma: float) -> None:
        """Refuse rows whose delta could leave the CKKS range (``|v| <`` :data:`VALUE_LIMIT` ``= 2^13``:
        larger values may wrap around and decrypt to garbage, silently).

        A row clipped to ``clip_norm`` plus ``N(0, sigma^2 I)`` noise has norm at most
        ``clip_norm + sigma (sqrt(d) + 10)`` but with probability below ``exp(-50)`` (Gaussian
        concentration of the norm, a 1-Lipschitz function: Ledoux 2001, Theorem 2.7), and each
        delta value is at most its row of ``scaling * B @ A`` in norm times that.

        Raises:
            UnsafeInput: the bound reaches :data:`VALUE_LIMIT`.
        """
        bound = self.max_row_norm * (clip_norm + sigma * (math.sqrt(self.d) + 10.0))
        if not bound < VALUE_LIMIT:
            raise UnsafeInput(
                f"sigma={sigma:g} and clip_norm={clip_norm:g}: delta values could reach {bound:.3g}, "
                f"past the CKKS range {VALUE_LIMIT:g} of this adapter's packing (they would decrypt to "
                "garbage)"
            )

    def read_rows(self, context: CKKSPublicContext, ciphertext: bytes) -> list[Any]:
        """Parse and check a :meth:`CKKSClient.encrypt` message for this adapter; no HE work yet.

        Raises:
            UnsafeInput: malformed or foreign ciphertexts, missing rotation keys, or a hidden size
                other than the adapter's.
        """
        s = _sealapi()
        missing = [k for k in self.steps if not context.has_rotation(k)]
        if missing:
            raise UnsafeInput(
                f"public context: no rotation keys for steps {missing} (rank {self.rank} needs {self.steps})"
            )
        (d,), parts = _unframe("ciphertext", _CT_MAGIC, 1, ciphertext, MAX_ROWS)
        if d != self.d:
            raise UnsafeInput(f"ciphertext rows have {d} values; the adapter's hidden size is {self.d}")
        ctx = context.seal_context
        top = list(ctx.first_parms_id())
        rows = []
        for i, part in enumerate(parts):
            ct = s.Ciphertext()
            try:
                _load(ct, part, ctx, name=f"ciphertext row {i}", max_bytes=_MAX_CIPHERTEXT_BYTES)
            except (RuntimeError, ValueError) as exc:
                raise UnsafeInput(f"ciphertext row {i} is not a ciphertext for this context: {exc}") from None
            # A fresh ciphertext: two polynomials at the top level, at the encoding scale (anything
            # else would break the rescale chain or the exact scale of the answer).
            if (
                ct.size() != 2
                or list(ct.parms_id()) != top
                or not ct.is_ntt_form()
                or ct.scale != 2.0**SCALE_BITS
            ):
                raise UnsafeInput(f"ciphertext row {i}: not a fresh encryption by CKKSClient.encrypt")
            rows.append(ct)
        return rows

    def delta_rows(self, context: CKKSPublicContext, rows: list[Any]) -> bytes:
        """The encrypted delta of rows checked by :meth:`read_rows`: a message for ``decrypt_delta``."""
        s = _sealapi()
        ev = s.Evaluator(context.seal_context)
        gk = context.galois_keys
        out = []
        for ct in rows:
            z = self._bsgs(ev, gk, ct, self._diag_a, self.g_a)
            step = self.r_pad
            while step < SLOTS:  # sum over the ring: u[j mod r] in every slot j
                rotated = s.Ciphertext()
                ev.rotate_vector(z, step, gk.for_step(step), rotated)
                ev.add_inplace(z, rotated)
                step *= 2
            v = self._bsgs(ev, gk, z, self._diag_b, self.g_b)
            out.append(_save(v))
        return _frame(_CT_MAGIC, (self.d_out,), out)

    def delta(self, context: CKKSPublicContext, ciphertext: bytes) -> bytes:
        """The encrypted ``scaling * B @ (A @ h)`` of every encrypted row (see :func:`ckks_lora_delta`)."""
        return self.delta_rows(context, self.read_rows(context, ciphertext))


def ckks_lora_delta(
    context: CKKSPublicContext | bytes,
    ciphertext: bytes,
    A: Any = None,
    B: Any = None,
    scaling: float = 1.0,
    *,
    plan: CKKSLoRAPlan | None = None,
) -> bytes:
    """Server side: ``scaling * B @ (A @ h)`` for each encrypted row ``h``, computed on ciphertext.

    Args:
        context: the client's :meth:`CKKSClient.public_context` (bytes) or its loaded
            :class:`CKKSPublicContext` (load once, reuse).
        ciphertext: :meth:`CKKSClient.encrypt`'s message.
        A, B, scaling: the adapter, PEFT shapes A (r, d), B (d_out, r); or give ``plan`` (the same
            adapter prepared once with :class:`CKKSLoRAPlan`, faster).

    Returns:
        A message of one ciphertext per row, for :meth:`CKKSClient.decrypt_delta` (the server
        cannot decrypt it).

    Raises:
        UnsafeInput: malformed or foreign ciphertexts or context, missing rotation keys, a hidden
            size other than the adapter's.
    """
    if plan is None:
        if A is None or B is None:
            raise InvalidParameter("give A and B, or plan=")
        plan = CKKSLoRAPlan(A, B, scaling)
    ctx = context if isinstance(context, CKKSPublicContext) else CKKSPublicContext(context)
    return plan.delta(ctx, ciphertext)
