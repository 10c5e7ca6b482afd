"""The API server's routing: which unit a request goes to (router), where its prefill runs (policy
and its table), and how long its answer will be (answer_length). It runs in the API server
processes; the workers only take its choices, carried by the messages."""
