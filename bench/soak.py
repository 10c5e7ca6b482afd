"""The soak test: many requests with random sampling parameters, some aborted at random moments,
against a server.

    # starts `ppd serve` (demo):
    python -m bench.soak --requests 10000 --out bench/results/cpu-demo-2core-soak
    # against a running server:
    python -m bench.soak --url http://127.0.0.1:8000 --requests 2000

Every request draws its endpoint (chat or completions), streaming or not, n, temperature, top_p,
top_k, seed, max_tokens, min_tokens, stop strings, stop token ids and ignore_eos at random; some
continue an earlier conversation, so that prefixes are cached and append-prefills take both routes.
A share of them (--abort-fraction) is abandoned by its client at a random moment: before the answer,
after the first token, mid-stream. What must hold:

- lost: 0. Every request that was not abandoned gets a whole answer: 200, every choice finished
  ("stop" or "length"), at most max_tokens tokens per choice, at least min_tokens unless a stop
  string ended it, and a stream ends with [DONE].
- unexpected: 0. No other status (a 429 counts apart, as the server's admission control speaking).
- KV usage and running requests back to 0 within a second or two of the last client leaving.
- the workers' memory (resident set size, sampled as it runs) flat after warm-up.

Writes soak.json (every figure) and soak.md into --out (by default $PPD_RESULTS_DIR/soak-<time>,
else ./ppd-results/soak-<time>), and there the log of the server it starts (serve.log).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import BenchError, results_out
from bench.servers import add_served_model_args, start_server, stop_server, with_model_args

WORDS = (
    "sea wind ship harbour light stone river bridge garden market window paper music winter summer "
    "morning story question answer number"
).split()
# The demo tokenizer is byte-level: these ids are ordinary printable bytes in any vocabulary of 128
# or more.
STOP_IDS = list(range(97, 123))


@dataclass
class Outcome:
    # ok, aborted, rejected (429), lost (incomplete 200), unexpected (other status / broken answer)
    kind: str
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Soak:
    url: str
    model: str
    rng: random.Random
    abort_fraction: float
    histories: list[list[dict]] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)

    def body(self) -> tuple[str, dict]:
        rng = self.rng
        max_tokens = rng.choice([1, 2, 4, 8, 16, 32, 64])
        body: dict = {
            "model": self.model,
            "max_tokens": max_tokens,
            "n": rng.choice([1, 1, 1, 2, 3]),
            "stream": rng.random() < 0.5,
        }
        if rng.random() < 0.7:
            body["temperature"] = rng.choice([0.0, round(rng.uniform(0.01, 2.0), 3)])
        if rng.random() < 0.3:
            body["top_p"] = round(rng.uniform(0.05, 1.0), 3)
        if rng.random() < 0.3:
            body["top_k"] = rng.choice([-1, 0, 1, 5, 50, 1000])
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(-(2**63), 2**63)
        if rng.random() < 0.3:
            body["min_tokens"] = rng.randint(0, max_tokens)
        if rng.random() < 0.2:
            body["stop"] = rng.sample(WORDS, rng.randint(1, 3)) + [rng.choice("aeiou")]
        if rng.random() < 0.2:
            body["stop_token_ids"] = rng.sample(STOP_IDS, rng.randint(1, 4))
        if rng.random() < 0.5:
            body["ignore_eos"] = True
        if body["stream"] and rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        user = " ".join(rng.choices(WORDS, k=rng.randint(2, 120)))
        if rng.random() < 0.5:
            body["messages"] = self.conversation(user)
            return "/v1/chat/completions", body
        body["prompt"] = user
        return "/v1/completions", body

    def conversation(self, user: str) -> list[dict]:
        """A new conversation, or the next turn of an earlier one (its prefix cached, probably)."""
        if self.histories and self.rng.random() < 0.5:
            history = self.rng.choice(self.histories)
            messages = history + [{"role": "user", "content": user}]
        else:
            messages = [{"role": "user", "content": user}]
        return messages

    async def one(self, client: httpx.AsyncClient) -> None:
        path, body = self.body()
        abort_at = self.rng.uniform(0.0, 1.0) if self.rng.random() < self.abort_fraction else None
        started = time.perf_counter()
        call = asyncio.ensure_future(self.call(client, path, body))
        if abort_at is None:
            outcome = await call
        else:
            done, _ = await asyncio.wait([call], timeout=abort_at)
            if done:
                outcome = call.result()
            else:
                call.cancel()  # closes the connection: the server must abort the request
                try:
                    await call
                except asyncio.CancelledError:
                    pass
                outcome = Outcome("aborted")
        outcome.seconds = time.perf_counter() - started
        self.outcomes.append(outcome)

    async def call(self, client: httpx.AsyncClient, path: str, body: dict) -> Outcome:
        try:
            if body["stream"]:
                return await self.stream(client, path, body)
            resp = await client.post(path, json=body)
            if resp.status_code != 200:
                return _status(resp.status_code, resp.text)
            data = resp.json()
            problem = self.check(
                body,
                [
                    (c.get("finish_reason"), c.get("text", c.get("message", {}).get("content")))
                    for c in data["choices"]
                ],
                data["usage"]["completion_tokens"],
            )
            if problem:
                return Outcome("lost", problem)
            self.remember(body, data["choices"][0])
            return Outcome("ok")
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            return Outcome("unexpected", f"{type(exc).__name__}: {exc}"[:200])

    async def stream(self, client: httpx.AsyncClient, path: str, body: dict) -> Outcome:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return _status(resp.status_code, (await resp.aread()).decode(errors="replace"))
            finish: dict[int, str | None] = {i: None for i in range(body["n"])}
            text: dict[int, str] = dict.fromkeys(range(body["n"]), "")
            usage, done = None, False
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Outcome(
                        "unexpected", f"error event: {chunk['error'].get('message')}"[:200]
                    )
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    text[c["index"]] += piece or ""
                    finish[c["index"]] = c.get("finish_reason") or finish[c["index"]]
            if not done:
                return Outcome("lost", "the stream ended without [DONE]")
            tokens = usage["completion_tokens"] if usage else None
            problem = self.check(body, [(finish[i], text[i]) for i in range(body["n"])], tokens)
            return Outcome("lost", problem) if problem else Outcome("ok")

    def check(
        self,
        body: dict,
        choices: list[tuple[str | None, str | None]],
        completion_tokens: int | None,
    ) -> str:
        """What is wrong with a finished answer ("" when nothing)."""
        if len(choices) != body["n"]:
            return f"{len(choices)} choices for n={body['n']}"
        if any(reason not in ("stop", "length") for reason, _ in choices):
            return f"finish reasons {[r for r, _ in choices]}"
        if completion_tokens is not None and completion_tokens > body["max_tokens"] * body["n"]:
            return f"{completion_tokens} tokens for max_tokens {body['max_tokens']} x n {body['n']}"
        if (
            completion_tokens is not None
            and not body.get("stop")
            and body.get("min_tokens", 0) * body["n"] > completion_tokens
        ):
            return f"{completion_tokens} tokens for min_tokens {body['min_tokens']} x n {body['n']}"
        return ""

    def remember(self, body: dict, choice: dict) -> None:
        if "messages" in body and len(self.histories) < 500:
            answer = choice.get("message", {}).get("content") or ""
            self.histories.append(body["messages"] + [{"role": "assistant", "content": answer}])


def _status(code: int, text: str) -> Outcome:
    return Outcome("rejected" if code == 429 else "unexpected", f"{code}: {text[:200]}")


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gauges(url: str, headers: dict | None = None) -> dict[str, float]:
    """The server's Prometheus samples, summed over labels: name -> value."""
    values: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10, headers=headers).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            values[name] = values.get(name, 0.0) + value
    return values


async def run(args: argparse.Namespace, url: str) -> dict:
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = httpx.get(f"{url}/v1/models", timeout=10, headers=headers).json()["data"][0]["id"]
    pids = {
        w["role"]: w["pid"]
        for u in httpx.get(f"{url}/health", timeout=10).json()["units"]
        for w in u["workers"]
    }
    soak = Soak(url, model, random.Random(args.seed), args.abort_fraction)
    memory: list[dict] = []
    started = time.perf_counter()
    limits = httpx.Limits(
        max_connections=args.concurrency * 2, max_keepalive_connections=args.concurrency
    )
    async with httpx.AsyncClient(
        base_url=url, timeout=args.timeout, limits=limits, headers=headers
    ) as client:
        queue = iter(range(args.requests))

        async def worker() -> None:
            for i in queue:
                await soak.one(client)
                if i % args.sample_every == 0:
                    memory.append(
                        {
                            "requests": i,
                            "seconds": round(time.perf_counter() - started, 1),
                            **{role: rss_bytes(pid) for role, pid in pids.items()},
                        }
                    )
                    if not args.no_progress:
                        print(
                            f"\r{i}/{args.requests} requests", end="", file=sys.stderr, flush=True
                        )

        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - started
    if not args.no_progress:
        print(file=sys.stderr)
    # The last client has left: the server must be idle within a second or two.
    left, drained_s = time.perf_counter(), None
    while time.perf_counter() - left < 10:
        g = gauges(url, headers)
        if g.get("vllm:kv_cache_usage_perc", 1) == 0 and g.get("vllm:num_requests_running", 1) == 0:
            drained_s = round(time.perf_counter() - left, 2)
            break
        await asyncio.sleep(0.05)
    memory.append(
        {
            "requests": args.requests,
            "seconds": round(elapsed, 1),
            **{role: rss_bytes(pid) for role, pid in pids.items()},
        }
    )
    kinds = Counter(o.kind for o in soak.outcomes)
    details = Counter(
        f"{o.kind}: {o.detail}" for o in soak.outcomes if o.kind in ("lost", "unexpected")
    )
    return {
        "requests": args.requests,
        "concurrency": args.concurrency,
        "abort_fraction": args.abort_fraction,
        "seed": args.seed,
        "sample_every": args.sample_every,
        "seconds": round(elapsed, 1),
        "requests_per_s": round(args.requests / elapsed, 1),
        "outcomes": dict(kinds),
        "problems": dict(details.most_common(20)),
        "seconds_to_idle_after_last_client": drained_s,
        "worker_rss_after_warmup": rss_trend(memory, list(pids)),
        "worker_rss_samples": memory,
        "worker_pids_unchanged": pids
        == {
            w["role"]: w["pid"]
            for u in httpx.get(f"{url}/health", timeout=10).json()["units"]
            for w in u["workers"]
        },
    }


def rss_trend(samples: list[dict], roles: list[str]) -> dict[str, dict[str, float]]:
    """Per worker, after warm-up (the first fifth of the run): the lowest and highest RSS (MiB) and
    the least-squares slope in MiB per 1000 requests, which a leak would make steadily positive."""
    warm = samples[len(samples) // 5 :]
    trend = {}
    for role in roles:
        points = [(m["requests"], m[role] / 2**20) for m in warm if m.get(role)]
        if len(points) < 2:
            continue
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / sum(
            (x - mean_x) ** 2 for x, _ in points
        )
        trend[role] = {
            "min_mib": round(min(y for _, y in points), 1),
            "max_mib": round(max(y for _, y in points), 1),
            "slope_mib_per_1000_requests": round(1000 * slope, 2),
        }
    return trend


def report(result: dict, command: str) -> str:
    o = result["outcomes"]
    growth = "; ".join(
        f"{r} {t['min_mib']:.0f} to {t['max_mib']:.0f} MiB, trend "
        f"{t['slope_mib_per_1000_requests']:+.1f} "
        "MiB per 1000 requests"
        for r, t in result["worker_rss_after_warmup"].items()
    )
    return "\n".join(
        [
            "# Soak",
            "",
            f"`{command}`",
            "",
            f"- {result['requests']} requests, {result['concurrency']} clients at a time, "
            f"{result['abort_fraction']:.0%} abandoned at a random moment; {result['seconds']} s "
            f"({result['requests_per_s']} requests/s).",
            f"- completed whole: {o.get('ok', 0)}; abandoned: {o.get('aborted', 0)}; answered 429: "
            f"{o.get('rejected', 0)}.",
            f"- lost: {o.get('lost', 0)}; unexpected errors: {o.get('unexpected', 0)}.",
            "- KV usage and running requests back to 0 "
            f"{result['seconds_to_idle_after_last_client']} s after the last "
            "client left.",
            f"- worker memory (RSS, sampled every {result.get('sample_every', 250)} requests) "
            "after warm-up (the first "
            f"fifth): {growth}; worker processes "
            f"{'unchanged' if result['worker_pids_unchanged'] else 'RESTARTED'}.",
            *(
                [""] + [f"  - {k} ({n})" for k, n in result["problems"].items()]
                if result["problems"]
                else []
            ),
            "",
        ]
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.soak", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--url",
        default=None,
        help="a running server (default: start `ppd serve` with --serve-args)",
    )
    add_served_model_args(parser)
    parser.add_argument(
        "--serve-args", default="", help="more arguments of the `ppd serve` it starts"
    )
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--requests", type=int, default=10000, help="requests in all (default: 10000)"
    )
    parser.add_argument(
        "--concurrency", type=int, default=32, help="clients at a time (default: 32)"
    )
    parser.add_argument(
        "--abort-fraction",
        type=float,
        default=0.1,
        help="share of requests abandoned (default: 0.1)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per request (default: 300)"
    )
    parser.add_argument(
        "--sample-every",
        type=int,
        default=250,
        help="requests between memory samples (default: 250)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of every random choice (default: 0)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="folder for soak.json, soak.md and the log of the server it starts (default: "
        "soak-<UTC time> in $PPD_RESULTS_DIR, else in ./ppd-results)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    parser.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="SOAK_JSON",
        help="only write soak.md again from a soak.json (its command is taken from the old "
        "soak.md)",
    )
    args = parser.parse_args()
    if args.report is not None:
        result = json.loads(args.report.read_text())
        roles = [k for k in result["worker_rss_samples"][0] if k not in ("requests", "seconds")]
        result["worker_rss_after_warmup"] = rss_trend(result["worker_rss_samples"], roles)
        old_md = args.report.with_name("soak.md")
        command = old_md.read_text().split("`")[1] if old_md.exists() else "python -m bench.soak"
        args.report.write_text(json.dumps(result, indent=1) + "\n")
        old_md.write_text(report(result, command))
        print(old_md.read_text())
        return 0
    command = "python -m bench.soak " + " ".join(sys.argv[1:])
    out = results_out(args.out, "soak")
    proc = None
    if args.url is None:
        import shlex

        try:
            serve_args = with_model_args(
                shlex.split(args.serve_args), args.model, args.dtype, args.load_format
            )
            proc, url = start_server(serve_args, out / "serve.log")
        except BenchError as exc:
            print(f"python -m bench.soak: error: {exc}", file=sys.stderr)
            return 2
    else:
        url = args.url
    try:
        result = asyncio.run(run(args, url))
    finally:
        if proc is not None:
            stop_server(proc)
    text = report(result, command)
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "soak.md").write_text(text)
    print(f"written to {out}", file=sys.stderr)
    o = result["outcomes"]
    return (
        1
        if o.get("lost")
        or o.get("unexpected")
        or result["seconds_to_idle_after_last_client"] is None
        else 0
    )


if __name__ == "__main__":
    sys.exit(main())
