"""Serving benchmark against any OpenAI-compatible server, and modelyard vs llama.cpp side by side.

Sends streamed `/v1/completions` (or `/v1/chat/completions`) requests from a seeded dataset and
measures, per request, time to first token (TTFT), time per output token after the first (TPOT),
the gaps between streamed tokens (ITL) and end-to-end latency (E2E); then reports their
percentiles, request and output-token throughput, and goodput (requests/s that met every SLO
given). Arrivals are Poisson at `--request-rate` (a fixed seed: the same schedule every run) or
all at once (`inf`); `--concurrency` caps requests in flight, so `--concurrency N` with the
default infinite rate is a closed loop of N clients.

Datasets (all seeded, the same text for every server):
  random         prompts of `--input-len` random common words (≈ one token each);
  shared-prefix  `--num-prefixes` system prompts of `--prefix-len` words, each request one of
                 them plus a `--input-len`-word question of its own (prefix-cache workloads);
  azure-conv, azure-code
                 a production trace replayed: `--num-prompts` consecutive requests of the Azure
                 LLM inference traces 2023 (Azure Public Dataset, CC-BY 4.0; Patel et al.,
                 "Splitwise", ISCA 2024; found at ../shared/data/azure-llm-inference-2023), from
                 a seeded offset, with their own arrival gaps (rescaled so the mean rate is
                 `--request-rate`; the bursts keep their shape), context tokens as prompt words
                 and generated tokens as max_tokens, each times `--trace-token-scale` and capped
                 at `--input-len` / `--output-len` (a small CPU model cannot take 1,000-token
                 contexts at the trace's rate).

A production trace against a real worker:
    python benchmarks/serving.py --dataset azure-conv --num-prompts 120 --request-rate 0.5 \
        --trace-token-scale 0.25 --input-len 512 --output-len 64 --base-url http://127.0.0.1:8001/v1

One server:
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --model smollm2 \\
        --api-key "$(cat .modelyard/admin_key)" --concurrency 8 --num-prompts 64

modelyard vs llama.cpp (same GGUF, same prompts, greedy, EOS ignored, one server at a time):
    python benchmarks/serving.py --against-llama-cpp            # c = 1, 8, 32; 128 output tokens
    python benchmarks/serving.py --against-llama-cpp --only llama.cpp --concurrencies 1

`--against-llama-cpp` builds `llama-server` once (benchmarks/llama_cpp_build.py, cache
~/.cache/modelyard/llama.cpp), then for each server in turn starts it on the GGUF (SmolLM2's
bundled Q4_1 by default; llama-server with `-np <max concurrency> -t <threads>`, modelyard as a
`modelyard worker` process), warms it up, and runs each concurrency as a closed loop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Short common English words: each is one token in BPE vocabularies like SmolLM2's, so a prompt
# of N words is close to N tokens on every server.
_WORD_TEXT = (
    "the of and to in is that it for was on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will each "
    "about how up out them then she many some so these would other into has more her two like "
    "him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get "
    "through back much go good new write our me man too any day same right look think also "
    "around another came come work three word must because does part even place well such "
    "here take why things help put years different away again off went old number great tell "
    "men say small every found still between name should home big give air line set own under "
    "read last never us left end along while might next sound below saw something thought both "
    "few those always looked show large often together asked house world going want school "
    "important until form food keep children feet land side without boy once animals life"
)
_WORDS = _WORD_TEXT.split()


@dataclass
class Prompt:
    text: str
    words: int
    output_len: int | None = None  # this request's max_tokens (a trace's); None: --output-len
    at_s: float | None = None  # when to send it, from the start (a trace's); None: Poisson
    system: str | None = None  # shared-prefix chat: the prefix, sent as the system message


@dataclass
class Outcome:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    prompt_tokens: int = 0  # from the server's usage, where it reports it
    cached_tokens: int = 0  # of those, served from its prefix cache

    @property
    def tpot_s(self) -> float:
        return (
            (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0
        )


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def trace_prompts(args: argparse.Namespace, n: int) -> list[Prompt]:
    """`n` consecutive requests of an Azure trace from a seeded offset (see the docstring)."""
    from fleetsim import trace

    stamps, context, generated = trace.requests(args.dataset.removeprefix("azure-"))
    rng = random.Random(args.seed)
    start = rng.randrange(len(stamps) - n)
    window = slice(start, start + n)
    arrivals = stamps[window] - stamps[start]
    trace_rate = (n - 1) / arrivals[-1] if arrivals[-1] > 0 else float("inf")
    stretch = float(trace_rate / args.request_rate) if math.isfinite(args.request_rate) else 0.0
    out = []
    for at, c, g in zip(arrivals, context[window], generated[window], strict=True):
        words = max(1, min(args.input_len, round(int(c) * args.trace_token_scale)))
        tokens = max(1, min(args.output_len, round(int(g) * args.trace_token_scale)))
        out.append(Prompt(_words(rng, words), words, tokens, float(at) * stretch))
    return out


def make_prompts(args: argparse.Namespace, n: int, seed: int | None = None) -> list[Prompt]:
    if args.dataset.startswith("azure-"):
        return trace_prompts(args, n)
    rng = random.Random(args.seed if seed is None else seed)
    if args.dataset == "random":
        lens = [
            max(1, int(args.input_len * (1 + args.range_ratio * (2 * rng.random() - 1))))
            for _ in range(n)
        ]
        return [Prompt(_words(rng, k), k) for k in lens]
    prefixes = [_words(rng, args.prefix_len) for _ in range(args.num_prefixes)]
    out = []
    for i in range(n):
        question = _words(rng, args.input_len)
        # Which prefix: round robin, or (--prefix-order random) drawn per request.
        k = (
            i % len(prefixes)
            if args.prefix_order == "round-robin"
            else rng.randrange(len(prefixes))
        )
        if args.endpoint == "chat":  # a tenant's app: its system prompt, then the user's turn
            prompt = Prompt(f"Question {i}: {question}", args.prefix_len + args.input_len + 2)
            prompt.system = prefixes[k]
        else:
            prompt = Prompt(
                f"{prefixes[k]}\n\nQuestion {i}: {question}", args.prefix_len + args.input_len + 2
            )
        out.append(prompt)
    return out


def _body(args: argparse.Namespace, model: str, prompt: Prompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": prompt.output_len or args.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # modelyard, vLLM and llama-server all take it
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
        if prompt.system is not None:
            body["messages"].insert(0, {"role": "system", "content": prompt.system})
    else:
        body["prompt"] = prompt.text
    return body


async def one_request(
    session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: dict[str, Any]
) -> Outcome:
    start = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage: dict[str, Any] = {}
    itl: list[float] = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                return Outcome(False, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            buf = b""
            async for piece in resp.content.iter_any():
                buf += piece
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        continue
                    event = json.loads(data)
                    if event.get("usage"):
                        usage = event["usage"]
                    choices = event.get("choices") or []
                    text = ""
                    if choices:
                        c = choices[0]
                        text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                    if not text:
                        continue
                    now = time.perf_counter()
                    if chunks == 0:
                        first = now
                    else:
                        itl.append(now - last)
                    last = now
                    chunks += 1
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Outcome(False, error=repr(exc))
    end = time.perf_counter()
    if chunks == 0:
        return Outcome(False, error="no tokens streamed")
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(
        True,
        first - start,
        end - start,
        int(usage.get("completion_tokens") or 0) or chunks,
        itl,
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )


async def run_load(
    args: argparse.Namespace,
    base_url: str,
    model: str,
    prompts: list[Prompt],
    concurrency: int | None,
) -> tuple[list[Outcome], float]:
    """All prompts through the server: Poisson arrivals at `args.request_rate` (seeded), at
    most `concurrency` in flight. Returns the outcomes and the wall time."""
    path = "/chat/completions" if args.endpoint == "chat" else "/completions"
    url = base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(args.seed + 1)
    # A new connection per request: llama-server closes kept-alive connections that the pool
    # then reuses ("Server disconnected", 2 of 8 requests at c=1), which would count against it.
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def go(p: Prompt) -> Outcome:
            if gate is None:
                return await one_request(session, url, headers, _body(args, model, p))
            async with gate:
                return await one_request(session, url, headers, _body(args, model, p))

        tasks = []
        start = time.perf_counter()
        for p in prompts:
            if p.at_s is not None:  # a trace's own arrival time
                await asyncio.sleep(max(0.0, start + p.at_s - time.perf_counter()))
            tasks.append(asyncio.create_task(go(p)))
            if p.at_s is None and math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        outcomes = await asyncio.gather(*tasks)
        return list(outcomes), time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def summarize(args: argparse.Namespace, outcomes: list[Outcome], wall_s: float) -> dict[str, Any]:
    ok = [o for o in outcomes if o.ok]
    out_tokens = sum(o.output_tokens for o in ok)
    good = [
        o
        for o in ok
        if (args.slo_ttft_ms is None or o.ttft_s * 1e3 <= args.slo_ttft_ms)
        and (args.slo_tpot_ms is None or o.tpot_s * 1e3 <= args.slo_tpot_ms)
        and (args.slo_e2e_ms is None or o.e2e_s * 1e3 <= args.slo_e2e_ms)
    ]
    res: dict[str, Any] = {
        "requests": len(outcomes),
        "failed": len(outcomes) - len(ok),
        "wall_s": round(wall_s, 2),
        "request_throughput": round(len(ok) / wall_s, 3),
        "output_tokens": out_tokens,
        "output_tokens_per_s": round(out_tokens / wall_s, 1),
        "goodput_req_per_s": round(len(good) / wall_s, 3),
    }
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    if prompt_tokens:  # the server reports usage: the share of prompt tokens its cache served
        res["prefix_cache_hit_rate"] = round(sum(o.cached_tokens for o in ok) / prompt_tokens, 3)
    itl = [x for o in ok for x in o.itl_s]
    for name, vals in (
        ("ttft", [o.ttft_s for o in ok]),
        ("tpot", [o.tpot_s for o in ok if o.output_tokens > 1]),
        ("itl", itl),
        ("e2e", [o.e2e_s for o in ok]),
    ):
        res[f"{name}_mean_ms"] = round(statistics.fmean(vals) * 1e3, 1) if vals else None
        for q in args.percentiles:
            res[f"{name}_p{q:g}_ms"] = round(pct(vals, q) * 1e3, 1)
    errors = sorted({o.error for o in outcomes if not o.ok})
    if errors:
        res["errors"] = errors[:3]
    return res


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = [
        "server",
        "concurrency",
        "output_tokens_per_s",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "itl_p50_ms",
        "itl_p99_ms",
        "e2e_p50_ms",
        "failed",
    ]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))


# ----- --against-llama-cpp ------------------------------------------------------------------


def _free_port() -> int:
    from modelyard.control.backends.local import free_port

    return free_port()


async def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as s:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            try:
                async with s.get(base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise RuntimeError(f"server not healthy after {timeout_s:g}s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _launch(
    name: str, args: argparse.Namespace, gguf: Path, port: int, log_dir: Path
) -> subprocess.Popen[bytes]:
    slots = max(args.concurrencies)
    if name == "llama.cpp":
        from llama_cpp_build import build

        binary = build()
        # Per-slot context: the longest prompt plus the output, with room to spare.
        per_slot = (
            2
            * (
                args.input_len
                + args.prefix_len * (args.dataset == "shared-prefix")
                + args.output_len
            )
            + 64
        )
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
               "-np", str(slots), "-c", str(slots * per_slot), "-t", str(args.threads),
               "-tb", str(args.threads), "--alias", "bench"]  # fmt: skip
        env = dict(os.environ)
    else:
        cmd = [sys.executable, "-m", "modelyard.cli", "worker", "--model", str(gguf), "--host",
               "127.0.0.1", "--port", str(port), "--served-model-name", "bench"]  # fmt: skip
        env = {**os.environ, "MODELYARD_MAX_NUM_SEQS": str(max(slots, 64))}
        if args.quantization:
            env["MODELYARD_QUANTIZATION"] = args.quantization
    log_path = log_dir / f"serving-{name}.log"
    print(f"starting {name}: {' '.join(cmd)} (log {log_path})", flush=True)
    log_file = open(log_path, "wb")  # noqa: SIM115 - lives as long as the server
    return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)


async def against_llama_cpp(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Both servers started side by side (the idle one takes no CPU) and measured alternately,
    concurrency by concurrency, `--rounds` times, the order flipped every round: drift in a
    shared machine's speed hits both alike, and each round's ratio compares neighbours."""
    gguf = Path(args.gguf) if args.gguf else _bundled_gguf()
    log_dir = Path(args.log_dir)
    rows: list[dict[str, Any]] = []
    servers = [s for s in ("llama.cpp", "modelyard") if args.only in (None, s)]
    bases: dict[str, str] = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name in servers:
            port = _free_port()
            procs.append(_launch(name, args, gguf, port, log_dir))
            bases[name] = f"http://127.0.0.1:{port}"
            await _wait_ready(bases[name], procs[-1], 300)
            await run_load(args, bases[name] + "/v1", "bench", make_prompts(args, 2), 2)
        for round_ in range(args.rounds):
            for c in args.concurrencies:
                n = args.num_prompts or max(8, 4 * c)
                # Fresh prompts per round and concurrency: no prefix-cache hits across runs.
                prompts = make_prompts(args, n, seed=args.seed + 1000 * round_ + c)
                for name in servers if round_ % 2 == 0 else servers[::-1]:
                    outcomes, wall = await run_load(args, bases[name] + "/v1", "bench", prompts, c)
                    summary = summarize(args, outcomes, wall)
                    row = {"server": name, "concurrency": c, "round": round_, **summary}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc in procs:
            _stop(proc)
    print_ratios(rows)
    return rows


def print_ratios(rows: list[dict[str, Any]]) -> None:
    """modelyard ÷ llama.cpp output tokens/s at each concurrency, per round and the median."""
    by = {
        (r["server"], r["concurrency"], r.get("round", 0)): r["output_tokens_per_s"] for r in rows
    }
    ratios: dict[int, list[float]] = {}
    for (server, c, round_), theirs in by.items():
        mine = by.get(("modelyard", c, round_))
        if server == "llama.cpp" and mine is not None and theirs:
            ratios.setdefault(c, []).append(mine / theirs)
            print(
                f"round {round_} c={c}: modelyard {mine} tok/s, llama.cpp {theirs} tok/s "
                f"-> {mine / theirs:.2f}x"
            )
    for c, values in ratios.items():
        print(f"c={c}: median ratio {statistics.median(values):.2f}x over {len(values)} rounds")


def _bundled_gguf() -> Path:
    from modelyard.engine.models.bundled import resolve_model_path

    return resolve_model_path("smollm2")


def _machine() -> dict[str, Any]:
    load = os.getloadavg()
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg_at_start": [round(x, 2) for x in load],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""))
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument(
        "--dataset",
        choices=("random", "shared-prefix", "azure-conv", "azure-code"),
        default="random",
    )
    p.add_argument(
        "--trace-token-scale",
        type=float,
        default=1.0,
        help="azure-*: the trace's token counts times this, then capped",
    )
    p.add_argument(
        "--num-prompts", type=int, default=None, help="default 64 (llama.cpp mode: max(8, 4 x c))"
    )
    p.add_argument(
        "--input-len", type=int, default=64, help="prompt words (shared-prefix: the question)"
    )
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: lengths vary by ±ratio")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument(
        "--prefix-order",
        choices=("round-robin", "random"),
        default="round-robin",
        help="shared-prefix: which prefix each request takes",
    )
    p.add_argument(
        "--quantization",
        choices=("auto", "none", "int8", "w8a8", "gguf", "gguf+w8a8"),
        help="--against-llama-cpp: the modelyard worker's quantization (default: the engine's "
        "own default, auto: a quantized GGUF is served int8, see engine/defaults.py)",
    )
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson rate (req/s); inf: all at once",
    )
    p.add_argument("--concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--percentiles", type=lambda s: [float(x) for x in s.split(",")], default=[50.0, 90.0, 99.0]
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--json-out", default=None, help="write the results (and the machine) here")
    g = p.add_argument_group("--against-llama-cpp")
    g.add_argument("--against-llama-cpp", action="store_true")
    g.add_argument(
        "--concurrencies", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32]
    )
    g.add_argument("--gguf", default=None, help="default: SmolLM2's bundled Q4_1 GGUF")
    g.add_argument(
        "--rounds", type=int, default=1, help="measure both servers alternately this many times"
    )
    g.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama-server -t / -tb")
    g.add_argument(
        "--only", choices=("llama.cpp", "modelyard"), default=None, help="one server only"
    )
    g.add_argument("--log-dir", default=str(Path.home() / ".cache" / "modelyard" / "bench-logs"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = _machine()
    if args.against_llama_cpp:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        rows = asyncio.run(against_llama_cpp(args))
    else:
        prompts = make_prompts(args, args.num_prompts or 64)
        outcomes, wall = asyncio.run(
            run_load(args, args.base_url, args.model, prompts, args.concurrency)
        )
        rows = [
            {
                "server": args.base_url,
                "concurrency": args.concurrency,
                **summarize(args, outcomes, wall),
            }
        ]
        print(json.dumps(rows[0], indent=1))
    print_table(rows)
    machine["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"machine: {machine}")
    if args.json_out:
        config = {k: v for k, v in vars(args).items() if k != "api_key"}
        Path(args.json_out).write_text(
            json.dumps(
                {"started": started, "machine": machine, "args": config, "rows": rows},
                indent=1,
                default=str,
            )
        )


if __name__ == "__main__":
    main()
