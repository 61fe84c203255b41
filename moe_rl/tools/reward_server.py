"""moe-rl-reward-server: run rewards on a machine of their own, for trainers started with data.reward=http://HOST:PORT.

Any reward moe-rl accepts (--reward as data.reward: `module:function` or `path/to/reward.py:function` in verl's,
TRL's or moe-rl's form, the built-ins, several with --weights), scored as the trainer would score it in process (a
RewardSet: the worker pool, data.reward_call_timeout_s, the error and timeout scores; data.* settings with --set
KEY=VALUE). Every request needs the token in --token-file (the trainer's data.reward_token_file or
$MOE_RL_REWARD_TOKEN holds the same); without it the answer is 401, on every path. Bound to 127.0.0.1 unless --host
says otherwise: --host 0.0.0.0 only on a trusted network (the token travels in clear over http).

examples:
  head -c 32 /dev/urandom | base64 > /shared/run/reward.token
  moe-rl-reward-server --reward my_reward.py:compute_score --port 8701 --token-file /shared/run/reward.token
  moe-rl-reward-server --reward moe_rl.reward.builtin:compute_score --reward fmt.py:format_reward \\
      --weights 1.0 0.2 --port 8701 --token-file reward.token --host 0.0.0.0 --set reward_workers=16
  # the trainer: data.reward=http://HOSTNAME:8701 data.reward_token_file=/shared/run/reward.token

Endpoints: POST /score {request_id, step, samples} -> {rewards, totals, counts, seconds}; GET /health.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from moe_rl.common.errors import ConfigError
from moe_rl.reward import RewardSet
from moe_rl.reward.service.server import ScoringService, serve
from moe_rl.reward.service.wire import WireError, read_token


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moe-rl-reward-server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--reward", action="append", required=True, help="a spec as data.reward, repeatable")
    p.add_argument("--weights", type=float, nargs="+", help="one weight per --reward (default: all 1.0)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: one the system picks, printed)")
    p.add_argument("--token-file", required=True, help="file holding the shared token")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a data.* setting, repeatable")
    p.add_argument("--threads", type=int, default=4, help="batches scored at once (they share the worker pool)")
    p.add_argument("--cache", type=int, default=4096, help="answers kept by request id (a retry is answered again)")
    p.add_argument("--max-request-mib", type=int, default=256, help="largest request body")
    return p


def data_config(specs: list[str], weights: list[float] | None, sets: list[str]):
    """The data section (moe_rl.config.DataConfig) the rewards are built from: the defaults, the rewards, then --set
    KEY=VALUE (a `data.` prefix allowed; typed and checked by the schema, as Hydra's overrides are)."""
    # heavy: omegaconf and the schema, imported on first use (the --help path stays light)
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from moe_rl.config.schema import DataConfig, check_reward_keys

    base = {"reward": specs, "reward_weights": weights}
    try:
        overrides = OmegaConf.from_dotlist([s.removeprefix("data.") for s in sets])
        data = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(DataConfig), base, overrides))
    except OmegaConfBaseException as e:
        raise ConfigError(f"--set {' '.join(sets)}: {e}") from None
    check_reward_keys(data)
    return data


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    bad = [s for s in a.set if "=" not in s]
    if bad:
        p.error(f"--set {bad[0]!r}: expected KEY=VALUE (a data.* key, e.g. reward_workers=8)")
    if a.weights is not None and len(a.weights) != len(a.reward):
        p.error(f"--weights: {len(a.weights)} weights for {len(a.reward)} --reward functions")
    if a.threads < 1 or a.cache < 1 or not 0 <= a.port < 65536:
        p.error("--threads and --cache must be at least 1, --port in 0..65535")
    try:
        token = read_token(a.token_file, "--token-file")
        rewards = RewardSet.from_config(data_config(a.reward, a.weights, a.set))
    except (ConfigError, WireError, ValueError) as e:
        print(f"moe-rl-reward-server: error: {e}", file=sys.stderr)
        return 2
    service = ScoringService(rewards, token, a.threads, a.cache)
    try:
        asyncio.run(serve(service, a.host, a.port, a.max_request_mib))
    finally:
        service.close()
        rewards.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
