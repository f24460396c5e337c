"""One upload limit for text everywhere (issue 32): 20 MB of UTF-8, as the /text page promises.
`/text/submit` takes text above the service's vector-sized max_body_bytes (it used to refuse 8 MB
with a message about vectors) and refuses text over 20 MB with a 413 that says 20 MB."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from gaussdp.text.tokenize import MAX_INPUT_BYTES


def _h(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.slow
def test_text_submit_takes_up_to_20_mb_and_its_413_says_20_mb(client, service):  # type: ignore[no-untyped-def]
    word = "the"
    nine_mb = (word + "\n") * (9_000_000 // (len(word) + 1))  # newlines: two bytes each in JSON
    r = client.post("/text/submit", json={"text": nine_mb, "sigma": 0.5}, headers=_h(service.key_a))
    assert r.status_code != 413, r.text[:300]  # over max_body_bytes (64 KiB here) and 8 MB: reaches the route
    over = "a" * (MAX_INPUT_BYTES + 1)
    r = client.post("/text/submit", json={"text": over, "sigma": 0.5}, headers=_h(service.key_a))
    assert r.status_code == 413 and "20 MB" in r.json()["detail"], r.text[:300]
    # a body too large to hold 20 MB of text even escaped: refused before it is read, also saying 20 MB
    r = client.post(
        "/text/submit",
        content=b'{"text": "' + b"\\n" * (MAX_INPUT_BYTES + 40_000) + b'"}',
        headers={**_h(service.key_a), "Content-Type": "application/json"},
    )
    assert r.status_code == 413 and "20 MB" in r.json()["detail"], r.text[:300]
