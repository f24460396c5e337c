"""End to end in headless Chromium: the page perturbs in the browser and only perturbed text arrives.

Needs Debian's ``chromium`` and ``chromium-driver`` (``apt-get install -y chromium chromium-driver``);
skipped with the reason when they are missing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
import warnings
from collections import Counter

import numpy as np
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)),
        reason="needs /usr/bin/chromium and /usr/bin/chromedriver "
        "(Debian: apt-get install -y chromium chromium-driver)",
    ),
]
selenium = pytest.importorskip("selenium", reason="needs selenium (dev extra)")
pytest.importorskip("fastapi", reason="needs the service extra")
uvicorn = pytest.importorskip("uvicorn", reason="needs the service extra")

from gaussdp.errors import NotPrivateWarning  # noqa: E402
from gaussdp.text import GaussianWordMechanism  # noqa: E402
from gaussdp.text.corpus import shipped_vocabulary  # noqa: E402
from gaussdp.text.tokenize import words as tokenize  # noqa: E402

SECRET = "Zorblatt"  # not in the vocabulary: must never reach the server
INPUT = (
    "My grandmother baked a warm apple pie in the kitchen, and the hungry dog slept near the oven.\n"
    f"After the storm, {SECRET} saw the cold wind blow over the harbour; the rain fell on the bridge!"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server():
    from fastapi import FastAPI, Request

    from gaussdp.text.web import make_router

    vocab = shipped_vocabulary()
    raw_bodies: list[bytes] = []
    app = FastAPI()

    @app.middleware("http")
    async def record(request: Request, call_next):  # the bytes the server really receives
        if request.method == "POST":
            raw_bodies.append(await request.body())
        return await call_next(request)

    app.include_router(make_router(vocab))
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        if time.time() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "vocab": vocab, "raw": raw_bodies}
    srv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="gaussdp-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
    ):
        opts.add_argument(flag)
    drv = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    drv.set_script_timeout(120)
    yield drv
    drv.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _wait(cond, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the page")


def test_text_browser_sends_only_perturbed_text(server, driver):
    from selenium.webdriver.common.by import By

    driver.get(server["url"] + "/text")
    _wait(lambda: driver.find_element(By.ID, "status").text.startswith("vocabulary:"))
    driver.execute_script("document.getElementById('input').value = arguments[0];", INPUT)
    sigma = driver.find_element(By.ID, "sigma")
    sigma.clear()
    sigma.send_keys("0.3")
    driver.find_element(By.ID, "perturb").click()
    output = _wait(lambda: driver.find_element(By.ID, "output").get_attribute("value"))
    driver.find_element(By.ID, "submit").click()
    _wait(lambda: driver.find_element(By.ID, "status").text.startswith("submitted"))

    assert len(server["raw"]) == 1
    raw = server["raw"][0]
    body = json.loads(raw)
    assert set(body) == {"text", "mechanism", "sigma"} and body["sigma"] == 0.3
    assert body["text"] == output

    vocab = server["vocab"]
    original = tokenize(INPUT)
    released = tokenize(body["text"])
    assert len(released) == len(original)
    assert all(w in vocab for w in released)
    # The unknown word never leaves the browser, not even as a substring of the request.
    assert SECRET.lower().encode() not in raw.lower()
    # Punctuation is dropped: the request carries only words, spaces and the line break.
    assert not any(ch in body["text"] for ch in ",;!.")
    # Every original word the mechanism changed occurs in the raw request exactly as often as the
    # mechanism released it (at other positions), i.e. never as the original: a client that also sent
    # the raw text, in any field, would fail this count.
    changed = {o for o, r in zip(original, released, strict=True) if o != r}
    assert changed, "with sigma=0.3 some words change (N_w < 1); the check would be vacuous"
    raw_text = raw.decode("utf-8").lower()
    released_counts = Counter(released)
    for w in changed:
        in_request = len(re.findall(rf"(?<![\w']){re.escape(w)}(?![\w'])", raw_text))
        assert in_request == released_counts[w], (w, in_request, released_counts[w])
    # The browser tokenises like Python.
    js_tokens = driver.execute_script(
        "return arguments[0].split('\\n').map(window.gaussdpText.tokenize);", INPUT
    )
    assert js_tokens == [tokenize(line) for line in INPUT.split("\n")]


def _chi2_pvalue(a: list[str], b: list[str]) -> float:
    """Two-sample chi-square homogeneity test; categories with expected count < 5 pooled."""
    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    cats = sorted(set(ca) | set(cb), key=lambda w: -(ca[w] + cb[w]))
    table, other = [], [0, 0]
    n = len(a) + len(b)
    for w in cats:
        tot = ca[w] + cb[w]
        if tot * min(len(a), len(b)) / n >= 5:
            table.append([ca[w], cb[w]])
        else:
            other[0] += ca[w]
            other[1] += cb[w]
    if sum(other):
        table.append(other)
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(np.array(table)).pvalue)


def test_text_browser_and_python_have_the_same_output_distribution(server, driver):
    """Chi-square homogeneity of the released-word histograms, browser vs Python.

    False-alarm rate: alpha = 1e-3 per word, 3 words, so at most 0.3% for the test (the browser's
    noise comes from crypto.getRandomValues and cannot be seeded). Power check: the same test
    rejects Python at sigma=0.6 against the browser at sigma=0.3.
    """
    driver.get(server["url"] + "/text")
    _wait(lambda: driver.execute_script("return !!window.gaussdpText"))
    vocab = server["vocab"]
    n, sigma, alpha = 3000, 0.3, 1e-3
    with pytest.warns(NotPrivateWarning):
        py_mech = GaussianWordMechanism(vocab, sigma=sigma, seed=20260101)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        py_wrong = GaussianWordMechanism(vocab, sigma=2 * sigma, seed=20260102)
    for word in ("dog", "rain", "london"):
        js = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.gaussdpText.sampleWord(arguments[0], arguments[1], arguments[2]).then(done);",
            word,
            sigma,
            n,
        )
        assert len(js) == n
        py = py_mech.perturb_words([word] * n)
        p = _chi2_pvalue(js, py)
        assert p > alpha, f"{word}: browser and Python distributions differ (p={p:.2e})"
        p_wrong = _chi2_pvalue(js, py_wrong.perturb_words([word] * n))
        assert p_wrong < alpha, f"{word}: the test cannot tell sigma=0.3 from 0.6 (p={p_wrong:.2e})"
