"""The reward service's HTTP server (aiohttp's): a RewardSet behind POST /score and GET /health, every path behind
the shared token (a middleware answers 401 ahead of every handler, an unknown path's 404 included).

A request is scored once: finished answers are kept by request id (a bounded LRU), so a client's retry after a lost
answer gets the same answer, and a retry that arrives while the first is still scoring waits for it. Scoring runs on
a few threads (the RewardSet's worker pool serves them all), so the event loop keeps answering /health.
The command line (moe-rl-reward-server) is moe_rl/tools/reward_server.py, which builds the RewardSet from data.*
settings."""

from __future__ import annotations

import asyncio
import hmac
import json
import signal
import sys
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from moe_rl.reward.inprocess import RewardError
from moe_rl.reward.scoring import RewardSet
from moe_rl.reward.service.wire import WireError, samples_of_json

JSON = "application/json"


class ScoringService:
    """`rewards` served to holders of `token`: `threads` batches scored at once, `cache` answers kept."""

    def __init__(self, rewards: RewardSet, token: str, threads: int = 4, cache: int = 4096):
        self.rewards, self.expected = rewards, f"Bearer {token}".encode()
        self.executor = ThreadPoolExecutor(max(1, threads), thread_name_prefix="moe-rl-score")
        self.cache_size = cache
        self.done: OrderedDict[str, tuple[int, bytes]] = OrderedDict()  # request id -> (status, body)
        self.running: dict[str, asyncio.Future] = {}  # request ids being scored
        self.scored = 0  # requests scored (not answered from the cache)

    def app(self, max_request_mib: int = 256) -> web.Application:
        """The aiohttp application: /score, /health, the token middleware."""
        app = web.Application(middlewares=[self.authorize], client_max_size=max_request_mib * 2**20)
        app.router.add_post("/score", self.score)
        app.router.add_get("/health", self.health)
        return app

    @web.middleware
    async def authorize(self, request: web.Request, handler):
        """401 unless the Authorization header holds the token (compared in constant time), whatever the path."""
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, self.expected):
            body = {"error": "401 Unauthorized: send the shared token as 'Authorization: Bearer <token>'"}
            return web.json_response(body, status=401)
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "rewards": self.rewards.describe(), "scored": self.scored})

    async def score(self, request: web.Request) -> web.Response:
        """POST /score: the Scores of the body's samples (wire.py), once per request id."""
        try:
            request_id, step, samples = samples_of_json(await request.json())
        except (ValueError, WireError) as e:
            return web.json_response({"error": f"bad request: {e}"}, status=400)
        if request_id in self.done:
            self.done.move_to_end(request_id)
            status, body = self.done[request_id]
        elif request_id in self.running:  # a retry of a request still being scored: its answer
            status, body = await asyncio.shield(self.running[request_id])
        else:
            future = asyncio.get_running_loop().create_future()
            self.running[request_id] = future
            try:
                work = asyncio.get_running_loop().run_in_executor(self.executor, self.scores, request_id, samples, step)
                status, body = await asyncio.shield(work)
                self.done[request_id] = (status, body)
                while len(self.done) > self.cache_size:
                    self.done.popitem(last=False)
                future.set_result((status, body))
            except BaseException as e:
                future.set_exception(e)
                raise
            finally:
                del self.running[request_id]
        return web.Response(body=body, status=status, content_type=JSON)

    def scores(self, request_id: str, samples: list, step: int) -> tuple[int, bytes]:
        """(status, body) of one request, on a scoring thread: 200 and the Scores, or 422 and the reward's error."""
        start = time.perf_counter()
        try:
            got = self.rewards.score_functions(samples, step, phase="(reward service)")
        except RewardError as e:
            return 422, json.dumps({"request_id": request_id, "error": str(e)}).encode()
        finally:
            self.scored += 1
        seconds = time.perf_counter() - start
        body = {"request_id": request_id, "rewards": got.rewards, "totals": got.totals, "counts": got.counts}
        return 200, json.dumps(body | {"seconds": seconds}).encode()

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


async def serve(service: ScoringService, host: str, port: int, max_request_mib: int = 256) -> None:
    """Serve until SIGTERM or SIGINT; prints one line with the address (port 0: the one the system chose)."""
    runner = web.AppRunner(service.app(max_request_mib), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    await site.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    bound = runner.addresses[0][1] if runner.addresses else port
    print(f"[moe-rl-reward-server] listening on http://{host}:{bound}", flush=True)
    for line in service.rewards.describe():
        print(f"[moe-rl-reward-server] {line}", file=sys.stderr, flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
