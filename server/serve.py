"""`ppd serve`: the units and the API built from the final plan (server/plan.py), served until a
signal, stopped whole."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import logging
import os
import shutil
import socket
from collections.abc import Callable

from partition.backends import backend_of
from scheduler.config import UnitConfig
from server.plan import ServePlan, UsageError, final_plan

log = logging.getLogger("ppd")


def load_tokenizer(path: str | None, chat_template: str | None = None):
    """The tokenizer the API uses (None with --skip-tokenizer-init: prompts and answers are token
    ids), with chat_template (--chat-template's text) in place of its own."""
    if path is None:
        return None
    from engine.tokenizer import auto_tokenizer

    fix = (
        "pass --tokenizer FOLDER with the model's tokenizer files,"
        " or --skip-tokenizer-init to serve token ids only"
    )
    try:
        tokenizer = auto_tokenizer(path)
    except (
        Exception
    ) as exc:  # transformers raises many kinds for a folder without a usable tokenizer
        raise UsageError(f"cannot load the tokenizer from {path}: {exc} ({fix})") from exc
    if isinstance(tokenizer, bool) or not callable(getattr(tokenizer, "encode", None)):
        # Without tokenizer files AutoTokenizer may return something that is not a tokenizer at all.
        raise UsageError(f"{path} has no tokenizer ({fix})")
    try:
        tokenizer.encode("ppd")
    except Exception as exc:
        raise UsageError(f"the tokenizer of {path} cannot encode text: {exc} ({fix})") from exc
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if not getattr(tokenizer, "chat_template", None):
        log.warning(
            "the tokenizer of %s has no chat template: /v1/chat/completions will answer 400 (use "
            "/v1/completions, or --tokenizer FOLDER with one that has a template)",
            path,
        )
    return tokenizer


def response_store(args: argparse.Namespace, plan: ServePlan):
    """The Responses API's store: --response-store's SQLite file, else memory; with several API
    servers and no file, a file in the server's runtime folder that they share (removed with it
    at exit)."""
    import sqlite3

    from server.response_store import open_store

    path = args.response_store
    if path is None and args.api_server_count > 1:
        path = os.path.join(plan.ipc_dir, "responses.sqlite")
    try:
        return open_store(path, args.response_store_max_bytes)
    except sqlite3.Error as exc:
        raise UsageError(
            f"--response-store {path}: cannot use it as an SQLite database ({exc}); give a path to "
            "a new "
            "file or to a store this server wrote"
        ) from None


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The server's listening socket, bound before any worker starts, so a port in use is reported
    at once. reuse_port: other API servers (--api-server-count) bind the port too, and the kernel
    spreads the connections over them; a plain bind first makes sure no other server holds the
    port, with reuse_port or without."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise UsageError(f"--host {host}: not an address of this machine ({exc})") from exc
    sock = None
    try:
        for reuse in (False, True) if reuse_port else (False,):
            if sock is not None:
                sock.close()
            sock = bound_socket(family, host, port, reuse)
    except OSError as exc:
        if sock is not None:
            sock.close()
        what = (
            "is in use (another server, or one that has not exited yet)"
            if exc.errno == errno.EADDRINUSE
            else f"cannot be opened ({exc.strerror})"
        )
        raise UsageError(
            f"port {port} on {host} {what}: stop that process or choose another with --port"
        ) from exc
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def bound_socket(family: int, host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def request_guard(args: argparse.Namespace):
    """The API's checks of every request: body size, API key (--api-key, else PPD_API_KEY, else
    vLLM's VLLM_API_KEY), Host header."""
    from server.guard import LOOPBACK_HOSTS, Guard

    if args.max_request_bytes < 1024:
        raise UsageError(f"--max-request-bytes {args.max_request_bytes}: at least 1024")
    keys = args.api_key
    if keys is None:
        env = os.environ.get("PPD_API_KEY") or os.environ.get("VLLM_API_KEY")
        keys = [env] if env else []
    if args.allowed_hosts:
        hosts = (
            None
            if args.allowed_hosts.strip() == "*"
            else tuple(h.strip() for h in args.allowed_hosts.split(","))
        )
    else:
        # Bound to loopback, only loopback names: a web page the user visits cannot reach the server
        # through a DNS name rebound to 127.0.0.1. Bound to another address, the operator decides
        # (--allowed-hosts).
        hosts = (*LOOPBACK_HOSTS, args.host) if args.host in LOOPBACK_HOSTS else None
    return Guard(args.max_request_bytes, tuple(keys), hosts)


def default_template_kwargs(args: argparse.Namespace) -> dict:
    """--default-chat-template-kwargs: a JSON object."""
    text = args.default_chat_template_kwargs
    try:
        kwargs = {} if text is None else json.loads(text)
    except ValueError:
        kwargs = None
    if not isinstance(kwargs, dict):
        raise UsageError(
            f"--default-chat-template-kwargs {text}: give a JSON object, e.g. "
            "'{\"enable_thinking\": false}'"
        )
    return kwargs


def uvicorn_options(args: argparse.Namespace) -> dict:
    """uvicorn's settings as vLLM's flags set them: log level, access log, root path, HTTPS."""
    options: dict = dict(
        log_level=args.uvicorn_log_level or args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + 5,
        access_log=not args.disable_uvicorn_access_log,
        root_path=args.root_path or "",
    )
    if args.disable_access_log_for_endpoints:
        quiet = {p.strip() for p in args.disable_access_log_for_endpoints.split(",") if p.strip()}
        logging.getLogger("uvicorn.access").addFilter(QuietPaths(frozenset(quiet)))
    if args.ssl_keyfile:
        for flag, path in (
            ("--ssl-keyfile", args.ssl_keyfile),
            ("--ssl-certfile", args.ssl_certfile),
            ("--ssl-ca-certs", args.ssl_ca_certs),
        ):
            if path is not None and not os.path.isfile(path):
                raise UsageError(f"{flag} {path}: no such file")
        options.update(
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
        if args.ssl_ciphers:
            options["ssl_ciphers"] = args.ssl_ciphers
    return options


class QuietPaths(logging.Filter):
    """--disable-access-log-for-endpoints: no access log line for these paths (any query)."""

    def __init__(self, paths: frozenset[str]) -> None:
        super().__init__()
        self.paths = paths

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else None
        return not (isinstance(path, str) and path.split("?", 1)[0] in self.paths)


def http_options(args: argparse.Namespace):
    """What the app serves besides the API, as vLLM's flags set it: docs, CORS, X-Request-Id."""
    from server.api import HttpOptions

    cors = None
    given = (args.allowed_origins, args.allowed_methods, args.allowed_headers)
    if any(v is not None for v in given) or args.allow_credentials is not None:
        lists = {}
        for flag, text in zip(
            ("--allowed-origins", "--allowed-methods", "--allowed-headers"), given
        ):
            try:
                value = ["*"] if text is None else json.loads(text)
            except ValueError:
                value = None
            if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                raise UsageError(f"{flag} {text}: give a JSON list of strings, e.g. '[\"*\"]'")
            lists[flag] = value
        cors = dict(
            allow_origins=lists["--allowed-origins"],
            allow_methods=lists["--allowed-methods"],
            allow_headers=lists["--allowed-headers"],
            allow_credentials=bool(args.allow_credentials),
        )
    return HttpOptions(
        docs=not args.disable_fastapi_docs,
        cors=cors,
        request_id_headers=args.enable_request_id_headers,
    )


def make_policy_for(args: argparse.Namespace):
    """The routing policy; ppd reads --policy-table now, else its device's shipped profile once a
    unit is ready."""
    from server.routing.policy import Objective, make_policy
    from server.routing.policy_table import PolicyTable, TableError

    table = None
    if args.policy == "ppd" and args.policy_table is not None:
        try:
            table = PolicyTable.load(args.policy_table)
        except TableError as exc:
            raise UsageError(str(exc)) from exc
        log.info("ppd policy: table %s (%s, %s)", args.policy_table, table.device, table.model)
    return make_policy(
        args.policy, table, Objective(args.w_ttft, args.w_tpot, args.ttft_slo_ms, args.itl_slo_ms)
    )


def find_tier_rate(policy, device: str, model: str) -> None:
    """The second tier's load rate `ppd profile tier` measured here, which the policy counts a
    tier-cached prefix's load at until a unit measured its own copies."""
    from profiles import tier_load_rate

    if rate := tier_load_rate(device, model):
        policy.tier_tokens_per_s = rate
        log.info("second KV tier: loads at %.0f tokens/s, as profiled", rate)


def find_shipped_table(policy, device: str, model: str) -> None:
    """Give the ppd policy this device's and model's table, the user's ($PPD_CACHE_DIR/profiles)
    before the shipped one, or say that the cost model stands in."""
    from profiles import profile_dirs
    from server.routing.policy import PPDPolicy
    from server.routing.policy_table import PolicyTable, TableError, table_path

    if not isinstance(policy, PPDPolicy) or policy.table is not None:
        return
    find_tier_rate(policy, device, model)
    path = table_path(device, model)
    if not path.is_file():
        log.warning(
            "ppd policy: no profile for %s / %s (%s in %s); a cost model from live measurements "
            "stands in "
            "(make a table with `ppd profile policy`)",
            device,
            model,
            path.name,
            " or ".join(map(str, profile_dirs())),
        )
        return
    try:
        policy.use_table(PolicyTable.load(path))
        log.info("ppd policy: table %s", path)
    except TableError as exc:
        log.warning("ppd policy: %s; a cost model from live measurements stands in", exc)


def policy_for(args: argparse.Namespace, plan: ServePlan):
    """The routing policy of an API server, with its table where the device is known before the
    units start, and of a mixture of experts the expert count its cost model needs."""
    from profiles import cpu_device_name, unit_device_name

    policy = make_policy_for(args)
    if plan.mcfg.is_moe:
        policy.experts = plan.mcfg.expected_experts
    if plan.device == "cpu":
        find_shipped_table(
            policy,
            unit_device_name(cpu_device_name(), plan.units[0].tensor_parallel_size),
            model_slug(plan),
        )
    return policy


def model_slug(plan: ServePlan) -> str:
    """The model's name in the profiles this server looks up (profiles.model_name, as `ppd profile`
    names them)."""
    from profiles import model_name

    return model_name(plan.model_path)


def api_client(args: argparse.Namespace, plan: ServePlan, policy, api_server: int):
    """API server `api_server`'s engine client, with its router and its metrics
    (--api-server-count)."""
    from server.api_servers import admission_for
    from server.engine_client import EngineClient
    from server.metrics import Metrics, PeerStates
    from server.routing.router import Router

    router = Router(
        len(plan.units),
        args.block_size,
        policy,
        plan.units[0].engine.num_kv_blocks or 0,
        session_ttl_s=args.session_ttl_s,
    )
    router.answers.from_max_tokens = args.answer_length == "max-tokens"
    metrics = Metrics(
        plan.model_name,
        PeerStates(plan.ipc_dir, api_server, args.api_server_count),
        plan.max_model_len,
    )
    return EngineClient(plan.units, router, metrics, admission_for(args), api_server)


def served_model(args: argparse.Namespace, plan: ServePlan, tokenizer, client, policy):
    """What the API serves; once the units are ready it takes their context length, and on a GPU the
    ppd policy its device's table."""
    from server.request_path import ServedModel
    from server.tools import renders_tools, template_format

    template = getattr(tokenizer, "chat_template", None)
    if (
        tokenizer is not None
        and args.tool_call_parser == "auto"
        and template
        and template_format(template) is None
    ):
        log.info(
            "tools: the chat template shows no tool-call format, so tool_choice auto reads calls "
            "in Hermes's "
            "(<tool_call>{...}</tool_call>)%s; --tool-call-parser names another, none refuses auto",
            "" if renders_tools(template) else ", with the tools described in the system message",
        )
    model = ServedModel(
        plan.model_name,
        plan.model_path,
        tokenizer,
        plan.max_model_len,
        plan.mcfg.vocab_size,
        plan.mcfg.eos_token_ids,
        args.tool_call_parser,
        aliases=plan.model_names,
        # vLLM takes the --model argument as a name unless --served-model-name names others
        paths=() if args.served_model_name else (plan.model_path, args.model),
        sampling_defaults=plan.sampling_defaults,
        max_logprobs=args.max_logprobs,
        response_role=args.response_role,
        force_usage=args.enable_force_include_usage,
        template_kwargs=default_template_kwargs(args),
        reasoning_parser=args.reasoning_parser,
    )

    def on_ready() -> None:
        model.max_model_len = client.max_model_len() or model.max_model_len
        if plan.device == "cuda":
            from profiles import unit_device_name

            find_shipped_table(
                policy,
                unit_device_name(
                    client.state[0].device_name or "cuda", plan.units[0].tensor_parallel_size
                ),
                model_slug(plan),
            )

    client.on_ready = on_ready
    return model


def serve(args: argparse.Namespace) -> None:
    # Imported here so `ppd --help` and bad command lines answer fast.
    from scheduler.worker_setup import set_process_title
    from server.api_servers import ApiServerProcesses, DrainingServer, freeze_startup_heap
    from server.launcher import Launcher
    from server.supervise import supervise

    plan, mps_daemon = final_plan(args)
    set_process_title(
        "ppd::api-0"
    )  # API server 0: also the launcher of the units and of the other API servers
    # What can fail on the operator's side fails now, before any worker starts: the port, the
    # tokenizer.
    sock = None
    try:
        guard = request_guard(args)
        http = http_options(args)
        server_options = uvicorn_options(args)  # its files checked now
        default_template_kwargs(args)
        policy = policy_for(args, plan)
        sock = listen_socket(args.host, args.port, reuse_port=args.api_server_count > 1)
        tokenizer = load_tokenizer(plan.tokenizer_path, plan.chat_template)
        store = response_store(args, plan)
    except UsageError:
        if sock is not None:
            sock.close()
        if mps_daemon is not None:
            mps_daemon.stop()
        shutil.rmtree(plan.ipc_dir, ignore_errors=True)
        raise
    client = api_client(args, plan, policy, 0)
    launcher = Launcher(plan.units, client)
    log.info(
        "serving %s on %s: %d unit(s), partition %s, policy %s",
        plan.model_name,
        plan.device
        if plan.device == "cpu"
        else f"GPU(s) {','.join(u.gpu or '' for u in plan.units)}",
        len(plan.units),
        plan.units[0].partition.describe(),
        args.policy,
    )
    launcher.spawn_all()  # the workers load the model while this process loads the web stack
    helpers = ApiServerProcesses(
        args, plan, run_api_server, client.api_server_died
    )  # API servers 1..N-1
    helpers.spawn_all()
    import uvicorn

    from server.api import build_app

    model = served_model(args, plan, tokenizer, client, policy)

    fatal: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        freeze_startup_heap()
        client.start()
        starting = asyncio.get_running_loop().create_task(launcher.start())
        watching = supervise("the API servers' watcher", helpers.watch, client.problems)

        def started(task: asyncio.Task) -> None:
            if task.cancelled():
                return
            if (exc := task.exception()) is not None:
                fatal.append(
                    str(exc)
                )  # a unit cannot start: stop serving, then report it as the exit
                server.should_exit = True
                return
            log.info(
                "ready: %s on http://%s:%d (policy %s, %d unit(s), max_model_len %d)",
                plan.model_name,
                args.host,
                args.port,
                args.policy,
                len(plan.units),
                model.max_model_len,
            )

        starting.add_done_callback(started)
        try:
            yield
        finally:
            starting.cancel()
            watching.cancel()
            # The other API servers drain too, and their requests need the workers until they are
            # done.
            await asyncio.to_thread(helpers.stop, args.shutdown_timeout + 5)
            launcher.shutdown()
            client.close()
            if mps_daemon is not None:
                mps_daemon.stop()  # after the workers, its clients, are gone
            shutil.rmtree(plan.ipc_dir, ignore_errors=True)

    def on_signal(sig: int) -> None:
        launcher.stopping = True  # the workers stop after the requests in flight (lifespan)
        helpers.signal(sig)

    app = build_app(
        model, client, lambda: health(plan, client, launcher.pids), lifespan, guard, store, http
    )
    server = DrainingServer(
        uvicorn.Config(app, host=args.host, port=args.port, **server_options),
        client,
        args.shutdown_timeout,
        on_signal,
    )
    try:
        server.run(sockets=[sock])
    finally:
        if mps_daemon is not None:
            mps_daemon.stop()  # the lifespan did, unless the server failed before it ran
    if fatal:
        raise UsageError(fatal[0])


def run_api_server(args: argparse.Namespace, plan, index: int) -> None:
    """Process entry point of API server `index` (1..N-1), started by API server 0
    (api_servers.ApiServerProcesses)."""
    from scheduler.worker_setup import die_with_parent, set_process_title

    die_with_parent()  # no orphan
    set_process_title(f"ppd::api-{index}")
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {index}]: %(message)s",
    )
    import uvicorn

    from server.api import build_app
    from server.api_servers import HelperServer, freeze_startup_heap, worker_pids

    policy = policy_for(args, plan)
    client = api_client(args, plan, policy, index)
    model = served_model(
        args, plan, load_tokenizer(plan.tokenizer_path, plan.chat_template), client, policy
    )

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        freeze_startup_heap()
        client.start()
        # uvicorn accepts connections only after this: until then API server 0 takes them all, and
        # none gets a 503 from an API server that has not heard from the units yet.
        await asyncio.gather(*(state.ready_event.wait() for state in client.state))
        log.info("ready")
        try:
            yield
        finally:
            client.close()

    app = build_app(
        model,
        client,
        lambda: health(plan, client, lambda u: worker_pids(client, u)),
        lifespan,
        request_guard(args),
        response_store(args, plan),
        http_options(args),
    )
    config = uvicorn.Config(app, **uvicorn_options(args))
    server = HelperServer(config, client, args.shutdown_timeout)
    # Bound now and listening once uvicorn starts serving, after the lifespan saw the units ready.
    family = socket.getaddrinfo(args.host, args.port, type=socket.SOCK_STREAM)[0][0]
    server.run(sockets=[bound_socket(family, args.host, args.port, reuse_port=True)])


def health(
    plan: ServePlan, client, pids: Callable[[int], dict[str, tuple[int | None, bool]]]
) -> list[dict]:
    """Each unit's readiness, device and workers (pids(unit): role -> (pid, alive)), its requests
    waiting to start and its load (the requests of every API server this one's router counts there),
    for GET /health."""
    units = []
    for u, cfg in enumerate(plan.units):
        state = client.state[u]
        device: dict = {"kind": plan.device, "tensor_parallel_size": cfg.tensor_parallel_size}
        if cfg.gpu is not None:
            device.update(
                index=cfg.gpu,
                name=state.device_name,
                memory_total_bytes=state.device_memory_total,
                memory_used_bytes=state.stats.device_memory_used if state.stats else None,
            )
        overloaded = client.overloaded(u)
        partition = backend_of(cfg.partition).stats(cfg.partition)
        if state.stats is not None and state.stats.decode_share:
            partition.update(
                decode_share=state.stats.decode_share,
                prefill_share=state.stats.prefill_share,
                switches=state.stats.share_switches,
            )
        if state.stats is not None and state.stats.partition_problem:
            partition["problem"] = state.stats.partition_problem
        kv: dict = {}
        if state.stats is not None:
            kv["retained_blocks"] = state.stats.kv_retained_blocks
            if (tier := state.stats.tier) is not None:
                kv["tier"] = {
                    "blocks": tier.blocks,
                    "capacity_blocks": tier.capacity,
                    "usage": round(tier.blocks / tier.capacity, 4),
                    "bytes": tier.blocks * tier.block_bytes,
                    "capacity_bytes": tier.capacity * tier.block_bytes,
                }
        units.append(
            {
                "unit": u,
                "ready": client.unit_ready(u),
                "device": device,
                "partition": partition,
                "waiting": state.waiting,
                "load": client.router.load[u],
                "overloaded": overloaded is not None,
                **({"overload": overloaded} if overloaded else {}),
                "workers": workers_of(pids(u), cfg),
                **({"kv_cache": kv} if kv else {}),
            }
        )
    return units


def workers_of(pids: dict[str, tuple[int | None, bool]], cfg: UnitConfig) -> list[dict]:
    """A unit's workers for /health: each process (a tensor-parallel unit's with its rank: the
    launcher names rank r's process ROLE-tpR), and a one-process unit's prefill thread in its
    decode process."""
    workers, threads = [], []
    for name, (pid, alive) in pids.items():
        role, _, rank = name.partition("-tp")
        where = {"rank": int(rank or 0)} if cfg.tensor_parallel_size > 1 else {}
        workers.append({"role": role, "pid": pid, "alive": alive, **where})
        if cfg.prefill_worker == "thread" and role == "decode":
            threads.append({"role": "prefill", "pid": pid, "alive": alive, "thread": True, **where})
    return workers + threads
