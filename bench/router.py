"""`ppd bench router`: several `ppd serve` nodes behind vllm-router, and how often a later turn
finds its prefix.

Each node publishes its KV-cache events (--kv-events-config), so the router's
kv_aware policy can place a conversation's next turn on the node that holds its
blocks. A later turn *hits* when the node that answers it had cached at least
the previous turn's whole prompt blocks (`cached_tokens` in the usage). The
same conversations (fresh text per policy, so no run warms another) go through
each routing policy in turn: the figure is kv_aware's hit rate beside
round_robin's.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from bench.common import BenchError, results_out
from bench.servers import free_port, start_server, stop_server

ROUTER_START_TIMEOUT_S = 60
AFFINITY_TTL_S = 600
WORDS = (
    "ship sea storm harbor sail anchor wave tide coral reef whale gull lantern rope deck mast "
    "compass island "
    "cove breeze"
).split()


def router_binary() -> str:
    path = shutil.which("vllm-router")
    if path is None:
        raise BenchError(
            "vllm-router is not installed: pip install vllm-router (it is in ppd-serve's test "
            "extra)"
        )
    return path


class Router:
    """vllm-router over worker URLs, on free ports; stop() ends it."""

    def __init__(self, policy: str, urls: list[str], extra: list[str], log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        cmd = [
            router_binary(),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            *urls,
            "--policy",
            policy,
            "--log-level",
            "debug",
            *extra,
        ]
        log.parent.mkdir(parents=True, exist_ok=True)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, "NO_COLOR": "1"},
            )
        deadline = time.monotonic() + ROUTER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"vllm-router exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise BenchError(
            f"vllm-router not ready after {ROUTER_START_TIMEOUT_S}s:\n{log.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class Node:
    proc: subprocess.Popen
    url: str
    events: list[str]  # its units' KV-event endpoints, as the router connects to them

    @property
    def units(self) -> int:
        return len(self.events)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
        return True


def start_nodes(
    count: int, serve_args: list[str], out: Path, env: dict[str, str] | None = None, units: int = 1
) -> list[Node]:
    """count `ppd serve` nodes of `units` units, each unit publishing KV events on its own tcp port
    (the node's port + unit), started side by side."""
    ports: list[int] = []
    while (
        len(ports) < count
    ):  # each node's units take its port + 0..units-1: no two nodes' ranges may meet
        port = free_port()
        span = range(port, port + units)
        if all(p not in span and port not in range(p, p + units) for p in ports) and all(
            map(port_free, span)
        ):
            ports.append(port)
    if units > 1:
        serve_args = [*serve_args, "--units", str(units)]

    def start(i: int) -> Node:
        config = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{ports[i]}"})
        proc, url = start_server(
            [*serve_args, "--kv-events-config", config], out / f"node{i}.log", env=env
        )
        return Node(proc, url, [f"tcp://127.0.0.1:{ports[i] + u}" for u in range(units)])

    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(start, i) for i in range(count)]
        nodes = [f.result() for f in futures if f.exception() is None]
        if len(nodes) < count:
            for node in nodes:
                stop_server(node.proc)
            raise next(f.exception() for f in futures if f.exception() is not None)
    return nodes


def router_args(policy: str, nodes: list[Node], model: str = "demo") -> list[str]:
    """What each policy needs beyond the URLs: nodes of several units are data-parallel workers to
    the router (it sends each request's unit in X-data-parallel-rank); kv_aware reads every
    unit's events."""
    args = ["--intra-node-data-parallel-size", str(nodes[0].units)] if nodes[0].units > 1 else []
    if policy != "kv_aware":
        return args
    # The model is only a name to the router: it gets a request's token ids from the node's render
    # endpoint.
    args += ["--kv-event-block-size", "16", "--kv-event-model", model]
    for node in nodes:
        args += ["--kv-event-source", f"{node.url}={','.join(node.events)}"]
    return args


@dataclass
class Turn:
    conversation: int
    turn: int
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    previous_prompt_tokens: int = (
        0  # the turn before's prompt: the prefix this turn should find cached
    )

    @property
    def hit(self) -> bool:
        return self.status == 200 and self.cached_tokens >= self.previous_prompt_tokens // 16 * 16


def conversation_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def run_conversations(
    url: str,
    count: int,
    turns: int,
    seed: int,
    max_tokens: int = 8,
    concurrency: int = 8,
    words: int = 60,
    headers_for=None,
) -> list[Turn]:
    """count conversations of `turns` turns through url, every conversation's turn t sent before any
    turn t+1 (concurrency at a time), greedy so the answers are the same on every node."""
    rngs = [random.Random(seed * 100_003 + c) for c in range(count)]
    histories = [
        [{"role": "user", "content": conversation_text(rngs[c], words)}] for c in range(count)
    ]
    previous = [0] * count
    results: list[Turn] = []
    with httpx.Client(timeout=300) as client:

        def send(c: int, t: int) -> Turn:
            headers = headers_for(c) if headers_for else None
            r = client.post(
                f"{url}/v1/chat/completions",
                headers=headers,
                json={
                    "model": "demo",
                    "messages": histories[c],
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            turn = Turn(c, t, r.status_code, previous_prompt_tokens=previous[c] if t else 0)
            if r.status_code == 200:
                body = r.json()
                turn.prompt_tokens = body["usage"]["prompt_tokens"]
                turn.cached_tokens = (body["usage"].get("prompt_tokens_details") or {}).get(
                    "cached_tokens"
                ) or 0
                previous[c] = turn.prompt_tokens
                histories[c] += [
                    {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                    {"role": "user", "content": conversation_text(rngs[c], words // 2)},
                ]
            return turn

        order = random.Random(seed)
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for t in range(turns):
                # A fresh order each turn: in lockstep, round robin would send a conversation to the
                # same node every turn by the arithmetic of the schedule alone.
                conversations = order.sample(range(count), count)
                results += list(pool.map(lambda c: send(c, t), conversations))
    return results


def session_header(conversation: int) -> dict[str, str]:
    """What a multi-turn client sends (vllm-router's consistent_hash and session affinity read
    it)."""
    return {"x-session-id": f"conversation-{conversation}"}


def summarize(turns: list[Turn]) -> dict:
    later = [t for t in turns if t.turn > 0]
    return {
        "requests": len(turns),
        "ok": sum(t.status == 200 for t in turns),
        "later_turns": len(later),
        "later_hits": sum(t.hit for t in later),
        "hit_rate": round(sum(t.hit for t in later) / len(later), 4) if later else None,
        "cached_fraction": round(
            sum(t.cached_tokens for t in later) / max(1, sum(t.prompt_tokens for t in later)), 4
        ),
    }


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=int, default=4, help="ppd serve nodes behind the router")
    p.add_argument(
        "--units", type=int, default=1, help="units per node (each its own KV-event endpoint)"
    )
    p.add_argument("--conversations", type=int, default=64, help="conversations per policy")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument(
        "--policies",
        default="kv_aware,kv_aware+affinity,round_robin",
        help="vllm-router policies to compare, comma-separated (each gets fresh conversations); "
        "kv_aware+affinity adds --kv-aware-session-affinity-ttl-secs (sessions by x-session-id)",
    )
    p.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    p.add_argument(
        "--serve-args",
        default="--policy aggregated",
        help="`ppd serve` arguments of every node (default: one worker per node, to fit many on "
        "the CPU)",
    )
    p.add_argument(
        "--router-args",
        default="",
        help="more vllm-router arguments for kv_aware, e.g. '--router-temperature 0.1'",
    )
    p.add_argument(
        "--out",
        default=None,
        help="folder for results.json and the logs (default: router-<UTC time> in "
        "$PPD_RESULTS_DIR, else in ./ppd-results)",
    )


def main(args: argparse.Namespace) -> None:
    import shlex

    out = results_out(args.out, "router")
    out.mkdir(parents=True, exist_ok=True)
    nodes = start_nodes(args.nodes, shlex.split(args.serve_args), out, units=args.units)
    results = {
        "nodes": args.nodes,
        "conversations": args.conversations,
        "turns": args.turns,
        "serve_args": args.serve_args,
        "policies": {},
    }
    try:
        for i, name in enumerate(args.policies.split(",")):
            policy, _, variant = name.partition("+")
            extra = router_args(policy, nodes)
            if variant == "affinity":
                extra += ["--kv-aware-session-affinity-ttl-secs", str(AFFINITY_TTL_S)]
            elif variant:
                raise BenchError(f"--policies: unknown variant {name!r}; known: kv_aware+affinity")
            if policy == "kv_aware":
                extra += shlex.split(args.router_args)
            router = Router(policy, [n.url for n in nodes], extra, out / f"router-{name}.log")
            try:
                turns = run_conversations(
                    router.url,
                    args.conversations,
                    args.turns,
                    seed=i + 1,
                    concurrency=args.concurrency,
                    headers_for=session_header,
                )
            finally:
                router.stop()
            results["policies"][name] = {
                **summarize(turns),
                "router_args": extra,
                "turns": [asdict(t) for t in turns],
            }
            s = results["policies"][name]
            print(
                f"{name}: {s['later_hits']}/{s['later_turns']} later turns hit their prefix "
                f"({s['hit_rate']:.1%}); "
                f"{s['ok']}/{s['requests']} answered"
            )
    finally:
        for node in nodes:
            stop_server(node.proc)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    rows = [
        f"| {name} | {r['later_hits']}/{r['later_turns']} ({r['hit_rate']:.1%}) | "
        f"{r['cached_fraction']:.1%} | "
        f"{r['ok']}/{r['requests']} |"
        for name, r in results["policies"].items()
    ]
    (out / "results.md").write_text(
        f"{args.nodes} nodes (`ppd serve {args.serve_args}`), {args.conversations} conversations "
        f"of {args.turns} "
        f"turns, {args.concurrency} in flight\n\n| policy | later turns that hit their prefix | "
        "prompt tokens cached "
        "(later turns) | answered |\n| --- | --- | --- | --- |\n" + "\n".join(rows) + "\n"
    )
    print(f"results: {out / 'results.json'}")
