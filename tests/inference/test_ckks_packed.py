"""CKKS split inference across the wire (gaussdp.inference.ckks): the packed delta matches the
plaintext delta, the server's side holds no secret key, and malformed or foreign input is refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

pytest.importorskip("tenseal")

from gaussdp.errors import UnsafeInput
from gaussdp.inference.ckks import (
    MAX_HIDDEN,
    SLOTS,
    CKKSClient,
    CKKSLoRAPlan,
    CKKSPublicContext,
    ckks_lora_delta,
    rotation_steps_for,
)


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


@pytest.fixture(scope="module")
def client() -> CKKSClient:
    return CKKSClient()  # every power-of-two rotation key: any rank


@pytest.fixture(scope="module")
def public(client: CKKSClient) -> CKKSPublicContext:
    return CKKSPublicContext(client.public_context())


def adapter(rng: np.random.Generator, r: int, d: int, d_out: int) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(size=(r, d)) / np.sqrt(d), rng.normal(size=(d_out, r)) / np.sqrt(r)


@pytest.mark.parametrize(
    ("r", "d", "d_out"),
    [
        (4, 64, 48),  # rank a power of two, period 256 > d
        (5, 300, 70),  # rank padded to 8, d padded to 512, d_out not a multiple of anything
        (1, 256, 1),  # rank one, d exactly one block, a single output
        (16, 512, 700),  # d_out > d
    ],
)
def test_packed_delta_matches_the_plaintext_delta(client, public, r, d, d_out) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(r * 1000 + d)
    A, B = adapter(rng, r, d, d_out)
    h = rng.normal(size=(3, d)) * 2.0
    out = ckks_lora_delta(public, client.encrypt(h), A, B, 0.75)
    got = client.decrypt_delta(out, rows=3)
    ref = 0.75 * (h @ A.T) @ B.T
    assert got.shape == (3, d_out)
    assert relative_error(got, ref) <= 1e-4
    # per row too: one row's error is not hidden by another's large norm
    for g, f in zip(got, ref, strict=True):
        assert relative_error(g, f) <= 1e-4


def test_rows_are_independent_and_order_is_kept(client, public) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    A, B = adapter(rng, 8, 128, 32)
    h = np.zeros((3, 128))
    h[1] = rng.normal(size=128)
    got = client.decrypt_delta(ckks_lora_delta(public, client.encrypt(h), A, B), rows=3)
    assert np.abs(got[0]).max() < 1e-5 and np.abs(got[2]).max() < 1e-5
    assert relative_error(got[1], B @ (A @ h[1])) <= 1e-4


@pytest.mark.slow
def test_full_size_1536_rank_32_within_1e_4(client, public) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(0)
    A, B = adapter(rng, 32, 1536, 1536)
    plan = CKKSLoRAPlan(A, B, 2.0)
    assert (plan.g_a, plan.g_b) == (4, 4)
    h = rng.normal(size=(2, 1536))
    got = client.decrypt_delta(plan.delta(public, client.encrypt(h)), rows=2)
    assert relative_error(got, 2.0 * (h @ A.T) @ B.T) <= 1e-4


def test_rank_specific_keys_serve_that_rank_and_refuse_another() -> None:
    small = CKKSClient(rank=4)
    assert small.rotation_steps == rotation_steps_for(4)
    assert len(small.public_context()) < len(CKKSClient().public_context())
    ctx = CKKSPublicContext(small.public_context())
    rng = np.random.default_rng(1)
    A, B = adapter(rng, 4, 64, 8)
    h = rng.normal(size=(1, 64))
    got = small.decrypt_delta(ckks_lora_delta(ctx, small.encrypt(h), A, B), rows=1)
    assert relative_error(got, h @ A.T @ B.T) <= 1e-4
    A16, B16 = adapter(rng, 16, 64, 8)  # rank 16 sums the ring from step 16: key 2 is missing
    with pytest.raises(UnsafeInput, match="no rotation keys for steps"):
        ckks_lora_delta(ctx, small.encrypt(h), A16, B16)


def test_public_context_has_no_secret_key_and_the_server_cannot_decrypt(client) -> None:  # type: ignore[no-untyped-def]
    """A separate process holding only what the server receives (public context and ciphertext)
    cannot recover h: it has no secret key, and a key of its own decrypts to noise."""
    rng = np.random.default_rng(5)
    h = rng.normal(size=(1, 256))
    pub, ct = client.public_context(), client.encrypt(h)
    assert CKKSPublicContext(pub).is_private() is False
    script = textwrap.dedent(
        """
        import sys, numpy as np, tenseal.sealapi as s
        from gaussdp.inference import ckks, _ckks_wire as wire
        pub, ct = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
        server = ckks.CKKSPublicContext(pub)
        assert not server.is_private()
        held = [v for v in vars(server).values() if isinstance(v, s.SecretKey)]
        assert not held, held
        # the public context's parts are parameters and Galois keys; none loads as a secret key
        _, parts = wire.unframe("public context", wire.CTX_MAGIC, 0, pub, 25)
        for part in parts:
            try:
                wire.load(s.SecretKey(), part, server.seal_context, max_bytes=1 << 30)
            except Exception:
                pass
            else:
                raise SystemExit("a part of the public context loads as a secret key")
        # the best the server can do: decrypt with a key of its own
        keys = s.KeyGenerator(server.seal_context)
        row = s.Ciphertext()
        _, rows = wire.unframe("ciphertext", wire.CT_MAGIC, 1, ct, 64)
        wire.load(row, rows[0], server.seal_context, max_bytes=1 << 20)
        pt = s.Plaintext()
        s.Decryptor(server.seal_context, keys.secret_key()).decrypt(row, pt)
        guess = np.asarray(s.CKKSEncoder(server.seal_context).decode_double(pt)[:256])
        np.save(sys.argv[3], guess)
        """
    )
    tmp = __import__("tempfile").mkdtemp()
    paths = [f"{tmp}/pub", f"{tmp}/ct", f"{tmp}/guess.npy"]
    for path, data in zip(paths, (pub, ct), strict=False):
        with open(path, "wb") as f:
            f.write(data)
    done = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    guess = np.load(paths[2])
    # a wrong key gives values of the size of the ciphertext modulus over the scale: no information
    assert not np.allclose(guess, h[0], atol=1.0)
    assert abs(np.corrcoef(guess, h[0])[0, 1]) < 0.3
    # while the client, with its secret key, reads the same bytes back exactly
    identity = CKKSLoRAPlan(np.eye(256)[:1], np.ones((1, 1)))
    one = client.decrypt_delta(identity.delta(CKKSPublicContext(pub), ct), rows=1)
    assert abs(one[0, 0] - h[0, 0]) < 1e-5


def test_another_clients_key_cannot_decrypt_the_answer(client, public) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(6)
    A, B = adapter(rng, 4, 64, 16)
    h = rng.normal(size=(1, 64))
    answer = ckks_lora_delta(public, client.encrypt(h), A, B)
    other = CKKSClient(rank=4)
    try:
        wrong = other.decrypt_delta(answer, rows=1)
    except UnsafeInput:
        return  # refused: fine
    assert not np.allclose(wrong, h @ A.T @ B.T, atol=1e-2)


def test_malformed_and_foreign_input_is_refused(client, public) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(7)
    A, B = adapter(rng, 4, 64, 16)
    ct = client.encrypt(rng.normal(size=(2, 64)))
    plan = CKKSLoRAPlan(A, B)
    with pytest.raises(UnsafeInput, match="bad magic"):
        plan.delta(public, b"garbage" + ct)
    with pytest.raises(UnsafeInput, match="trailing"):
        plan.delta(public, ct + b"\x00")
    with pytest.raises(UnsafeInput, match="truncated"):
        plan.delta(public, ct[:-10])
    with pytest.raises(UnsafeInput, match="hidden size is 64"):
        plan.delta(public, client.encrypt(rng.normal(size=(1, 65))))
    corrupted = bytearray(ct)
    corrupted[len(corrupted) // 2 : len(corrupted) // 2 + 64] = b"\xff" * 64
    with pytest.raises(UnsafeInput):
        plan.delta(public, bytes(corrupted))
    with pytest.raises(UnsafeInput, match="NaN or Inf"):
        client.encrypt(np.array([[1.0, np.nan]]))
    with pytest.raises(UnsafeInput, match="at most"):
        client.encrypt(np.zeros((1, MAX_HIDDEN + 1)))
    with pytest.raises(UnsafeInput, match="rank"):
        CKKSLoRAPlan(np.zeros((300, 64)), np.zeros((8, 300)))
    with pytest.raises(UnsafeInput, match="output size"):
        CKKSLoRAPlan(np.zeros((4, 64)), np.zeros((SLOTS + 1, 4)))
    with pytest.raises(UnsafeInput, match="not a LoRA pair"):
        CKKSLoRAPlan(np.zeros((4, 64)), np.zeros((8, 5)))
    with pytest.raises(UnsafeInput, match="expected rows=3"):
        client.decrypt_delta(plan.delta(public, ct), rows=3)


def test_a_context_with_other_parameters_is_refused(client) -> None:  # type: ignore[no-untyped-def]
    """A client cannot choose a larger ring (a costlier computation) or smaller, weaker parameters."""
    import tenseal.sealapi as s

    from gaussdp.inference import _ckks_wire as wire

    for n, bits in ((16384, [60, 40, 40, 60]), (8192, [50, 30, 30, 50])):
        parms = s.EncryptionParameters(s.SCHEME_TYPE.CKKS)
        parms.set_poly_modulus_degree(n)
        parms.set_coeff_modulus(s.CoeffModulus.Create(n, bits))
        _, parts = wire.unframe("public context", wire.CTX_MAGIC, 0, client.public_context(), 25)
        forged = wire.frame(wire.CTX_MAGIC, (), [wire.save(parms), *parts[1:]])
        with pytest.raises(UnsafeInput, match="parameters other than"):
            CKKSPublicContext(forged)
    with pytest.raises(UnsafeInput, match="bad magic"):
        CKKSPublicContext(b"\x00" * 100)


def test_rotation_keys_come_one_per_part(client) -> None:  # type: ignore[no-untyped-def]
    """Each part holds one key (the server loads them one at a time: short SEAL calls); the older
    format (every key in one part, one long call) is refused, as are repeated or merged keys."""
    import tenseal.sealapi as s

    from gaussdp.inference import _ckks_wire as wire
    from gaussdp.inference.ckks import _galois_elt, _shared_seal_context

    _, parts = wire.unframe("public context", wire.CTX_MAGIC, 0, client.public_context(), 25)
    loaded = CKKSPublicContext(client.public_context())
    assert loaded.galois_keys.size() == len(parts) - 1 == len(client.rotation_steps)
    assert all(loaded.has_rotation(k) for k in client.rotation_steps)
    keygen = s.KeyGenerator(_shared_seal_context())
    merged = wire.save(keygen.create_galois_keys([_galois_elt(1), _galois_elt(2)]))
    odd = wire.save(keygen.create_galois_keys([_galois_elt(3)]))  # not a power-of-two step
    for forged, match in [
        (wire.frame(wire.OLD_CTX_MAGIC, (), [parts[0], merged]), "older gaussdp"),
        (wire.frame(wire.CTX_MAGIC, (), [parts[0], merged]), "would decompress to up to"),
        (wire.frame(wire.CTX_MAGIC, (), [parts[0], odd]), "one rotation key of a power-of-two step"),
        (wire.frame(wire.CTX_MAGIC, (), [parts[0], parts[1], parts[1]]), "sent twice"),
        (wire.frame(wire.CTX_MAGIC, (), [parts[0]]), "parameters and rotation keys"),
    ]:
        with pytest.raises(UnsafeInput, match=match):
            CKKSPublicContext(forged)


def test_a_ciphertext_at_another_scale_or_level_is_refused(client, public) -> None:  # type: ignore[no-untyped-def]
    import tenseal.sealapi as s

    from gaussdp.inference import _ckks_wire as wire

    rng = np.random.default_rng(8)
    A, B = adapter(rng, 4, 64, 16)
    plan = CKKSLoRAPlan(A, B)
    ctx = public.seal_context
    encoder = s.CKKSEncoder(ctx)
    enc = s.Encryptor(ctx, client._secret_key)
    pt = s.Plaintext()
    encoder.encode([1.0] * SLOTS, 2.0**30, pt)  # another scale
    wrong_scale = wire.frame(wire.CT_MAGIC, (64,), [wire.save(enc.encrypt_symmetric(pt))])
    with pytest.raises(UnsafeInput, match="not a fresh encryption"):
        plan.delta(public, wrong_scale)
    encoder.encode([1.0] * SLOTS, 2.0**40, pt)
    ct = s.Ciphertext()
    enc.encrypt_symmetric(pt, ct)
    s.Evaluator(ctx).mod_switch_to_next_inplace(ct)  # one level down: the rescale chain breaks
    with pytest.raises(UnsafeInput, match="not a fresh encryption"):
        plan.delta(public, wire.frame(wire.CT_MAGIC, (64,), [wire.save(ct)]))


def test_a_decompression_bomb_is_refused_before_seal_inflates_it(client) -> None:  # type: ignore[no-untyped-def]
    """A few hundred bytes of zstd RLE blocks would inflate to 200 MB of "rotation keys"."""
    import struct

    from gaussdp.inference import _ckks_wire as wire

    blocks = b"".join(
        int(((2**21 - 1) << 3) | (1 << 1) | (i == 99)).to_bytes(3, "little") + b"\x00" for i in range(100)
    )
    frame = struct.pack("<I", 0xFD2FB528) + bytes([0b0010_0000, 0]) + blocks  # single segment, RLE blocks
    bomb = struct.pack("<HBBBBHQ", 0xA15E, 16, 4, 1, 2, 0, 16 + len(frame)) + frame
    assert len(bomb) < 1000
    _, parts = wire.unframe("public context", wire.CTX_MAGIC, 0, client.public_context(), 25)
    forged = wire.frame(wire.CTX_MAGIC, (), [parts[0], bomb])
    with pytest.raises(UnsafeInput, match="would decompress to up to"):
        CKKSPublicContext(forged)
    # the bound of a real key is close to its real size (zstd blocks of 128 KiB)
    assert wire.inflated_bound("keys", parts[1]) < wire.MAX_KEY_BYTES
    zlib_like = bytearray(parts[1])
    zlib_like[5] = 1  # compression mode zlib: no block sizes to bound it, refused
    with pytest.raises(UnsafeInput, match="compression mode 1"):
        CKKSPublicContext(wire.frame(wire.CTX_MAGIC, (), [parts[0], bytes(zlib_like)]))


def test_values_past_the_range_wrap_around_and_check_range_refuses_them(client, public) -> None:  # type: ignore[no-untyped-def]
    from gaussdp.inference.ckks import VALUE_LIMIT

    assert VALUE_LIMIT == 2.0**13
    A, B = np.eye(256)[:1], np.ones((SLOTS, 1))  # every output slot = h[0]: the densest result
    h = np.zeros((2, 256))
    h[0, 0], h[1, 0] = 0.9 * VALUE_LIMIT, 8.0 * VALUE_LIMIT
    plan = CKKSLoRAPlan(A, B)
    got = client.decrypt_delta(plan.delta(public, client.encrypt(h)), rows=2)
    assert np.abs(got[0] - h[0, 0]).max() < 1e-3  # inside the range: exact
    assert np.abs(got[1] - h[1, 0]).max() > 1.0  # outside: garbage, and nothing tells the client
    plan.check_range(clip_norm=1.0, sigma=100.0)  # ||v|| <= 1 * (1 + 100 (16 + 10)) = 2601 < 2^13
    with pytest.raises(UnsafeInput, match="past the CKKS range"):
        plan.check_range(clip_norm=1.0, sigma=1000.0)
