"""`ppd serve --model smollm2 --dtype bfloat16` against transformers' greedy ids on 20 chat prompts
through both routes (test_real_model.py's float32 case, in a module of its own so that the second
suite's two processes run the two side by side)."""

from __future__ import annotations

import pytest

from tests.server.test_real_model import check_greedy_ids, gguf  # noqa: F401 (gguf: a fixture)

pytestmark = pytest.mark.slow


def test_greedy_ids_within_ties_of_transformers_on_20_chat_prompts_through_both_routes(
    gguf,  # noqa: F811
    start_server,
) -> None:
    check_greedy_ids("bfloat16", gguf, start_server)
