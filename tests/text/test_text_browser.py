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

from fastapi import Request  # noqa: E402

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
def server(tmp_path_factory):
    """The real service (``create_app``: the page, corpora, sessions, fine-tuning jobs) on a port,
    with a fine-tuning worker in a thread; every POST body it receives is recorded."""
    pytest.importorskip("peft", reason="needs the hf extra")
    from gaussdp.budget import Ledger
    from gaussdp.finetune import tiny_causal_lm
    from gaussdp.service.app import create_app
    from gaussdp.service.keys import create_api_key
    from gaussdp.service.worker import run_worker

    root = tmp_path_factory.mktemp("text-flow")
    db = f"sqlite:///{root}/ledger.db"
    ledger = Ledger(db)
    key = create_api_key(ledger.store, "owner")
    model_dir = tiny_causal_lm(root / "tiny")
    data_dir = root / "data"
    vocab = shipped_vocabulary()
    raw_bodies: list[bytes] = []
    app = create_app(ledger=ledger, data_dir=str(data_dir), model_paths={"tiny": str(model_dir)})

    @app.middleware("http")
    async def record(request: Request, call_next):  # the bytes the server really receives
        if request.method == "POST":
            raw_bodies.append(await request.body())
        return await call_next(request)

    stop = threading.Event()
    worker = threading.Thread(
        target=run_worker,
        args=(db, data_dir, {"tiny": str(model_dir)}),
        kwargs={"poll_s": 0.2, "should_exit": stop.is_set},
        daemon=True,
    )
    worker.start()
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
    yield {"url": f"http://127.0.0.1:{port}", "vocab": vocab, "raw": raw_bodies, "key": key, "ledger": ledger}
    srv.should_exit = True
    stop.set()
    thread.join(timeout=10)
    worker.join(timeout=30)
    ledger.close()


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


def _wait(cond, timeout=30.0, what=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting for the page" + (f": {what()}" if what else ""))


def test_text_browser_sends_only_perturbed_text(server, driver):
    from selenium.webdriver.common.by import By

    server["raw"].clear()
    driver.get(server["url"] + "/text")
    _wait(lambda: driver.find_element(By.ID, "status").text.startswith("vocabulary:"))
    driver.execute_script("document.getElementById('input').value = arguments[0];", INPUT)
    sigma = driver.find_element(By.ID, "sigma")
    sigma.clear()
    sigma.send_keys("0.3")
    driver.find_element(By.ID, "perturb").click()
    output = _wait(lambda: driver.find_element(By.ID, "output").get_attribute("value"))
    driver.find_element(By.ID, "apikey").clear()
    driver.find_element(By.ID, "apikey").send_keys(server["key"])  # submitting needs a key
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


def _lee_paragraph() -> str:
    import gensim

    path = os.path.join(os.path.dirname(gensim.__file__), "test", "test_data", "lee_background.cor")
    with open(path, encoding="utf-8") as fh:
        return fh.readline().strip()


def test_text_browser_subword_vectors_match_python(server, driver):
    """Unknown words: the page computes bit-for-bit the float32 vectors Python computes."""
    driver.get(server["url"] + "/text")
    _wait(lambda: driver.execute_script("return !!window.gaussdpText"))
    vocab = server["vocab"]
    assert vocab.subwords is not None
    oov = sorted({w for w in tokenize(_lee_paragraph()) if w not in vocab})
    oov += ["zorblatt", "naïve", "日本語", "x", "don't", "überstraße"]
    js = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "window.gaussdpText.subwordVectors(arguments[0]).then(done);",
        oov,
    )
    got = np.array(js, dtype=np.float64)
    want = vocab.subwords.vectors(oov).astype(np.float64)
    assert got.shape == want.shape == (len(oov), vocab.dim)
    np.testing.assert_array_equal(got, want)
    assert len({tuple(r) for r in want}) > len(oov) // 2  # distinct words, mostly distinct vectors


def test_text_browser_laplace_has_python_distribution(server, driver):
    """Chi-square homogeneity, browser vs Python, for the multivariate Laplace mechanism (alpha 1e-3
    per word, 2 words); power: Python at half the epsilon is rejected."""
    from gaussdp.text import LaplaceWordMechanism

    driver.get(server["url"] + "/text")
    _wait(lambda: driver.execute_script("return !!window.gaussdpText"))
    vocab = server["vocab"]
    n, eps, alpha = 3000, 20.0, 1e-3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotPrivateWarning)
        py = LaplaceWordMechanism(vocab, epsilon=eps, seed=1)
        wrong = LaplaceWordMechanism(vocab, epsilon=eps / 2, seed=2)
    for word in ("dog", "zorblatt"):
        js = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.gaussdpText.sampleWord(arguments[0], 0, arguments[1], "
            "{name: 'laplace', epsilon: arguments[2]}).then(done);",
            word,
            n,
            eps,
        )
        vec, _ = vocab.vectors_for([word] * n)
        py_words = vocab.lookup(py.perturb_vectors(vec))
        assert _chi2_pvalue(js, py_words) > alpha, word
        assert _chi2_pvalue(js, vocab.lookup(wrong.perturb_vectors(vec))) < alpha, word


def test_text_browser_worker_words_per_second(server, driver):
    """The page's perturbation (noise + exact search) in its Web Workers: words/s, printed, with one
    worker and with one per CPU; the output has one word per input word, in order of lines."""
    driver.get(server["url"] + "/text")
    _wait(lambda: driver.execute_script("return !!window.gaussdpText"))
    n = 40_000
    rates = {}
    for workers in (1, None):
        r = driver.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "window.gaussdpText.benchWorker(arguments[0], null, arguments[1]).then(done);",
            n,
            workers,
        )
        assert r["words"] == n
        rates[r["workers"]] = r["words_per_s"]
    cpus = os.cpu_count()
    for k, rate in rates.items():
        print(
            f"\nbrowser, {k} worker(s) on {cpus} CPUs: {rate:,.0f} words/s over a "
            f"{len(server['vocab'])}-word vocabulary; a 20 MB file (~3.5 M words): ~{3.5e6 / rate:,.0f} s"
        )
    assert min(rates.values()) > 2000


def test_text_browser_whole_flow_sends_only_perturbed_text(server, driver):
    """Perturb (Laplace) -> upload -> models -> session -> job -> watch events -> download, against
    the real routes and a real worker; only perturbed text and the job's parameters are posted."""
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    server["raw"].clear()
    driver.get(server["url"] + "/text")
    _wait(lambda: driver.find_element(By.ID, "status").text.startswith("vocabulary:"))
    text = _lee_paragraph()[:1500] + "\n" + INPUT
    driver.execute_script("document.getElementById('input').value = arguments[0];", text)
    Select(driver.find_element(By.ID, "mechanism")).select_by_value("laplace")
    eps = driver.find_element(By.ID, "epsilon")
    eps.clear()
    eps.send_keys("30")
    driver.find_element(By.ID, "perturb").click()
    _wait(lambda: driver.find_element(By.ID, "status").text == "perturbed")
    assert driver.find_element(By.ID, "progress").get_attribute("value") == "1"
    output = driver.find_element(By.ID, "output").get_attribute("value")
    driver.find_element(By.ID, "apikey").clear()
    driver.find_element(By.ID, "apikey").send_keys(server["key"])
    driver.find_element(By.ID, "upload").click()
    _wait(lambda: driver.find_element(By.ID, "corpus").text)
    assert driver.find_element(By.ID, "corpus").text.startswith("corpus "), driver.find_element(
        By.ID, "corpus"
    ).text
    driver.find_element(By.ID, "models").click()
    _wait(lambda: len(Select(driver.find_element(By.ID, "model")).options) == 1)
    target = driver.find_element(By.ID, "target-epsilon")
    target.clear()
    target.send_keys("4")
    driver.find_element(By.ID, "start").click()
    _wait(
        lambda: "succeeded" in driver.find_element(By.ID, "job").text,
        timeout=180,
        what=lambda: (
            driver.find_element(By.ID, "job").text
            + " | "
            + driver.find_element(By.ID, "status").text
            + " | "
            + driver.find_element(By.ID, "corpus").text
        ),
    )
    _wait(lambda: driver.find_element(By.ID, "download").get_attribute("data-bytes"))
    assert int(driver.find_element(By.ID, "download").get_attribute("data-bytes")) > 1000
    assert driver.execute_script("return sessionStorage.getItem('gaussdp.apiKey')") == server["key"]

    # What the server stored and charged, read back through its API.
    auth = {"Authorization": f"Bearer {server['key']}"}
    (corpus,) = httpx.get(server["url"] + "/v1/corpora", headers=auth).json()
    assert corpus["local_dp"]["mechanism"] == "laplace" and corpus["local_dp"]["epsilon"] == 30
    (job,) = httpx.get(server["url"] + "/v1/finetune-jobs", headers=auth).json()
    assert job["state"] == "succeeded" and 0 < job["epsilon"] <= 4.0
    session = httpx.get(server["url"] + f"/v1/sessions/{job['session_id']}", headers=auth).json()
    assert session["spent"]["epsilon"] == job["epsilon"]  # charged up front, exactly the plan

    vocab = server["vocab"]
    released = tokenize(output)
    assert len(released) == len(tokenize(text)) and all(w in vocab for w in released)
    # Every POST body the server received: the corpus (perturbed text), the session, the job.
    assert len(server["raw"]) == 3
    assert server["raw"][0].decode("utf-8") == output
    assert set(json.loads(server["raw"][1])) == {"epsilon", "delta"}
    assert set(json.loads(server["raw"][2])) == {
        "corpus_id", "model", "session_id", "target_epsilon", "delta", "epochs", "batch_size",
    }  # fmt: skip
    # The JSON bodies carry numbers and ids only; the corpus body holds no out-of-vocabulary word.
    job_body = json.loads(server["raw"][2])
    assert all(
        isinstance(v, int | float)
        for k, v in job_body.items()
        if k not in ("corpus_id", "model", "session_id")
    )
    assert (job_body["corpus_id"], job_body["model"]) == (corpus["id"], "tiny")
    posted = server["raw"][0].decode("utf-8").lower()
    oov = {w for w in tokenize(text) if w not in vocab}
    assert SECRET.lower() in oov
    leaked = [w for w in oov if re.search(rf"(?<![\w']){re.escape(w)}(?![\w'])", posted)]
    assert leaked == [], leaked
    assert SECRET.lower().encode() not in b"\n".join(server["raw"]).lower()
