#!/usr/bin/env bash
# Compares pgoutbox at another commit with the working tree, side by side in
# one run on one machine: both bench binaries (tests/bench) are built, then
# every round runs each scenario once per build, alternating which goes
# first, and the medians are printed.
#
#   scripts/bench-compare.sh BASE_COMMIT [ROUNDS] [SCENARIOS] [SCALE] [SYSTEM]
#   make bench-compare BASE=35b3c5e
#
# One system is measured, pgoutbox (the default layout) unless SYSTEM names
# another of the bench's pgoutbox systems (pgoutbox-lease, pgoutbox-arrivals,
# ...). Defaults: 3 rounds;
# drain-1,drain-16,drain-1m,latency-1,latency-16; scale 5 (the bench's
# -scale: 100,000-message drains, long enough to be stable on a shared
# machine; drain-1m's backlog is capped at 1,000,000).
set -euo pipefail
base=${1:?usage: scripts/bench-compare.sh BASE_COMMIT [ROUNDS] [SCENARIOS] [SCALE] [SYSTEM]}
rounds=${2:-3}
scenarios=${3:-drain-1,drain-16,drain-1m,latency-1,latency-16}
scale=${4:-5}
system=${5:-pgoutbox}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'git -C "$root" worktree remove --force "$work/base" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT

git -C "$root" worktree add --detach "$work/base" "$base" >/dev/null 2>&1
(cd "$work/base/tests/bench" && go build -o "$work/bench-base" .)
(cd "$root/tests/bench" && go build -o "$work/bench-head" .)
head=$(git -C "$root" rev-parse --short HEAD)
if [ -n "$(git -C "$root" status --porcelain -- pkg internal)" ]; then head="$head+changes"; fi
echo "bench-compare: base $base vs head $head, system $system, $rounds rounds, scenarios $scenarios, scale $scale" >&2

IFS=, read -r -a list <<< "$scenarios"
for r in $(seq 1 "$rounds"); do
  for sc in "${list[@]}"; do
    order="base head"; [ $((r % 2)) -eq 0 ] && order="head base"
    for which in $order; do
      flags=(-scale "$scale"); [ "$sc" = drain-1m ] && flags=(-backlog-large $((1000000 / scale)) -scale "$scale")
      "$work/bench-$which" -systems "$system" -scenarios "$sc" -repeat 1 "${flags[@]}" -json 2>/dev/null \
        | sed "s/^{/{\"build\":\"$which\",/" >> "$work/results.jsonl"
      echo "  round $r $sc $which done" >&2
    done
  done
done

python3 - "$work/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for r in rows:
    by.setdefault((r["scenario"], r["build"]), []).append(r)
print(f"{'scenario':<12} {'base':>22} {'head':>22} {'head/base':>10}")
for sc in dict.fromkeys(r["scenario"] for r in rows):
    cells, ratio = [], ""
    vals = {}
    for b in ("base", "head"):
        rs = by.get((sc, b), [])
        if rs and rs[0]["msgs_per_s"]:
            v = statistics.median(x["msgs_per_s"] for x in rs)
            vals[b] = v
            cells.append(f"{v:,.0f} msg/s")
        elif rs:
            p50 = statistics.median(x["p50_ms"] for x in rs)
            p99 = statistics.median(x["p99_ms"] for x in rs)
            vals[b] = p99
            cells.append(f"p50 {p50:.2f} p99 {p99:.2f} ms")
        else:
            cells.append("-")
    if len(vals) == 2 and vals["base"]:
        ratio = f"{vals['head'] / vals['base']:.2f}"
    print(f"{sc:<12} {cells[0]:>22} {cells[1]:>22} {ratio:>10}")
PY
