"""The documentation: the Sphinx site builds with warnings as errors, the README stays a landing page, the config
reference is generated from the dataclasses, every guide has the same headings, and the metrics page documents the
metric keys the code logs (`undocumented_metrics`, also for the keys an end-to-end run logs)."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
METRICS_PAGE = DOCS / "reference" / "metrics.md"
GUIDE_HEADINGS = ["What", "When", "Command", "Cost", "What it refuses"]

# Every metric key the code logs (from the metric-name literals in moe_rl/, with the keys it forms from names:
# mismatch/<MISMATCH_KEYS>, <correction>/<key>, time/<phase>, multi_turn/ended_<reason>, actor/<loss metric>).
LOGGED_KEYS = [
    "reward/mean",
    "reward/max",
    "reward/zero_variance_groups",
    "reward/kl_penalty_mean",
    "response/length_mean",
    "response/length_max",
    "response/clip_ratio",
    "actor/entropy",
    "actor/clipfrac",
    "actor/ppo_kl",
    "actor/seq_ratio_mean",
    "actor/dual_clipfrac",
    "actor/first_minibatch_ppo_kl",
    "actor/last_minibatch_ppo_kl",
    "actor/kl_ref",
    "actor/first_minibatch_kl_ref",
    "actor/grad_norm",
    "actor/skipped_steps",
    "mismatch/training_ppl",
    "mismatch/training_log_ppl",
    "mismatch/rollout_ppl",
    "mismatch/rollout_log_ppl",
    "mismatch/kl",
    "mismatch/k3_kl",
    "mismatch/log_ppl_diff",
    "mismatch/log_ppl_abs_diff",
    "mismatch/log_ppl_diff_max",
    "mismatch/log_ppl_diff_min",
    "mismatch/ppl_ratio",
    "mismatch/chi2_token",
    "mismatch/chi2_seq",
    "mismatch/k_outside_0.5_2_fraction",
    "mismatch/k_outside_icepop_fraction",
    "mismatch/ess",
    "mismatch/exact_fraction",
    "mismatch/logprob_abs_diff_max",
    "icepop/masked_fraction",
    "icepop/weight_mean",
    "tis/weight_mean",
    "tis/capped_fraction",
    "seq-tis/weight_mean",
    "seq-mask/rejected_seq_fraction",
    "geo-mask/rejected_seq_fraction",
    "val/reward_mean",
    "val/pass@k",
    "val/pass@1",
    "val/length_mean",
    "val/prompts",
    "router/agreement",
    "router/k3_kl_own_routing",
    "router/k3_kl_engine_routes",
    "router/replay_checked",
    "router/replay_mismatches",
    "routes/recomputed_fraction",
    "routes/recomputed_disagreement",
    "routes/missing_fraction",
    "multi_turn/turns_mean",
    "multi_turn/observation_token_fraction",
    "multi_turn/prefix_cache_hit_fraction",
    "multi_turn/observations_truncated",
    "multi_turn/ended_env_done",
    "multi_turn/ended_max_turns",
    "multi_turn/ended_context_limit",
    "multi_turn/ended_env_error",
    "multi_turn/ended_env_timeout",
    "perf/padding_fraction",
    "perf/micro_batches",
    "perf/tokens_per_s",
    "perf/dp_token_imbalance",
    "perf/dp_groups_moved",
    "weight_sync/bytes",
    "weight_sync/seconds",
    "weight_sync/gb_per_s",
    "weight_sync/buckets",
    "staleness/mean",
    "staleness/max",
    "rollout/version_lag_mean",
    "rollout/version_lag_max",
    "rollout/version_lag_share_*",
    "rollout/dropped_fraction",
    "time/step",
    "time/trainer_idle",
    "time/rollout_idle",
    "time/rollout",
    "time/load_dump",
    "time/balance",
    "time/reward",
    "time/old_logprobs",
    "time/ref_logprobs",
    "time/values",
    "time/diagnostics",
    "time/update",
    "time/critic_update",
    "time/weight_sync",
    "time/validation",
    "time/environment",
    "memory/peak_rss_gib",
    "memory/peak_cuda_gib",
    "critic/value_loss",
    "critic/vf_clipfrac",
    "critic/explained_variance",
    "critic/values_mean",
    "critic/returns_mean",
    "critic/grad_norm",
    "critic/replay_mismatches",
    "critic/router_agreement",
    "critic/engine_router_agreement",
    "buffer/size",
    "buffer/age_mean",
    "buffer/route_bytes",
    "buffer/replay_ratio",
    "buffer/zero_variance_dropped",
    "buffer/zero_variance_trained",
    "buffer/priority_entropy",
    "buffer/fresh_reward_mean",
    "buffer/generation_batches",
    "buffer/evicted",
]


def _metric_name_cells() -> list[list[str]]:
    """The backticked names in the first column of every table row of the metrics page (header rows have none)."""
    rows = []
    for line in METRICS_PAGE.read_text().splitlines():
        if line.startswith("|") and not set(line) <= set("|-: "):
            rows.append(re.findall(r"`([^`]+)`", line.split("|")[1]))
    return [names for names in rows if names]


def documented_metrics() -> list[str]:
    """Every key (or glob, `*` for any rest of a key) that the metrics page documents."""
    return [name for names in _metric_name_cells() for name in names]


def undocumented_metrics(keys) -> list[str]:
    """The keys, in their order and without repeats, that no name on the metrics page (docs/reference/metrics.md)
    documents: e.g. the keys of a run's metrics.jsonl."""
    patterns = documented_metrics()
    out: list[str] = []
    for key in keys:
        if key not in out and not any(fnmatch.fnmatchcase(key, p) for p in patterns):
            out.append(key)
    return out


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory) -> Path:
    """The HTML site, built once for this module with warnings as errors."""
    out = tmp_path_factory.mktemp("docs_html")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-q", str(DOCS), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"sphinx-build -W failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    return out


def test_the_docs_build_without_warnings(built_docs):
    assert (built_docs / "index.html").is_file()
    assert (built_docs / "reference" / "cli.html").is_file()


def test_the_config_reference_lists_every_key(built_docs):
    from moe_rl.config.describe import describe_keys

    page = (built_docs / "reference" / "config.html").read_text()
    listed = set(re.findall(r'<dt><code class="[^"]*"><span class="pre">([^<]+)</span></code>', page))
    missing = sorted({key for key, _, _ in describe_keys("")} - listed)
    assert not missing, f"keys missing from the generated config reference: {missing}"


def test_the_cli_reference_holds_each_help_text(built_docs):
    page = (built_docs / "reference" / "cli.html").read_text()
    for usage in ("moe-rl-diagnose", "moe_rl.tools.tiny_model", "moe_rl.tools.export_hf", "Configuration groups"):
        assert usage in page


def test_the_readme_is_a_landing_page():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move the details into docs/"


def test_every_guide_has_the_same_headings():
    for page in sorted((DOCS / "guides").glob("*.md")):
        headings = re.findall(r"^## (.+)$", page.read_text(), re.MULTILINE)
        assert headings == GUIDE_HEADINGS, f"{page.name}: {headings}"


def test_the_metrics_page_names_full_keys():
    bad = [name for name in documented_metrics() if "/" not in name]
    assert not bad, f"name each metric in full (prefix/key) in the first column of docs/reference/metrics.md: {bad}"


def test_every_logged_metric_is_documented():
    assert undocumented_metrics(LOGGED_KEYS) == []
    keys = ["reward/mean", "bogus/key", "bogus/key", "bogus/other"]
    assert undocumented_metrics(keys) == ["bogus/key", "bogus/other"]


def test_what_has_run_where_is_said_in_the_support_table_not_in_code():
    """Status notes ("not yet run on a GPU") live in docs/reference/support.md, which the README summarises."""
    pattern = re.compile(r"(not|never) (yet )?(been )?run on a GPU", re.IGNORECASE)
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for root in ("moe_rl", "kernels")
        for path in sorted((REPO / root).rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, f"move these status notes into docs/reference/support.md: {found}"
