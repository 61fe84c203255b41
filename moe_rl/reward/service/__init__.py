"""Rewards on machines of their own: `moe-rl-reward-server` (server.py: any reward moe-rl accepts behind an HTTP
endpoint with a shared token) and the trainer's side of `data.reward=http://HOST:PORT` (client.py: batched async
requests, a time limit and retries per request, idempotent by request id). wire.py: what travels between them."""
